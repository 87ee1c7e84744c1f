//! The side channel's peers: handshake (both sides), compatibility checks,
//! and the tasks that carry a peer's messages.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::{Inner, Peer};
use crate::error::{DataplaneError, Result};
use crate::notify::{Notification, parse_notification};
use crate::sidechannel::{EngineMetadata, Message, PROTOCOL_VERSION, read_message, write_message};

impl Inner {
    pub(super) fn check_peer(&self, remote: &EngineMetadata) -> Result<()> {
        if remote.version != PROTOCOL_VERSION {
            return Err(DataplaneError::LayoutMismatch {
                engine_id: remote.engine_id.clone(),
                field: "version",
                local: PROTOCOL_VERSION.to_string(),
                remote: remote.version.to_string(),
            });
        }
        if remote.engine_id == self.cfg.engine_id {
            return Err(DataplaneError::LayoutMismatch {
                engine_id: remote.engine_id.clone(),
                field: "engine_id",
                local: self.cfg.engine_id.clone(),
                remote: format!(
                    "{} (the same id: engine ids must be unique)",
                    remote.engine_id
                ),
            });
        }
        self.cfg
            .layout
            .check_compatible(&remote.engine_id, &remote.layout)?;
        self.backend
            .check_peer(&remote.engine_id, &remote.backend)?;
        if remote.backend.regions().len() != remote.layout.num_regions as usize {
            return Err(DataplaneError::LayoutMismatch {
                engine_id: remote.engine_id.clone(),
                field: "backend.regions",
                local: remote.layout.num_regions.to_string(),
                remote: remote.backend.regions().len().to_string(),
            });
        }
        for (i, r) in remote.backend.regions().iter().enumerate() {
            if r.len_bytes < remote.layout.region_len_bytes() {
                return Err(DataplaneError::LayoutMismatch {
                    engine_id: remote.engine_id.clone(),
                    field: "backend.regions.len_bytes",
                    local: format!("at least {}", remote.layout.region_len_bytes()),
                    remote: format!("{} (region {i})", r.len_bytes),
                });
            }
        }
        Ok(())
    }

    pub(super) async fn serve_handshake(
        inner: Arc<Inner>,
        mut sock: TcpStream,
        addr: SocketAddr,
    ) -> Result<()> {
        let _ = sock.set_nodelay(true);
        let timeout = Duration::from_millis(inner.cfg.handshake_timeout_ms);
        let first = tokio::time::timeout(timeout, read_message(&mut sock, &addr.to_string()))
            .await
            .map_err(|_| DataplaneError::Handshake {
                peer: addr.to_string(),
                reason: "no hello in time".into(),
            })??;
        let remote = match first {
            Some(Message::Hello { engine }) => engine,
            Some(other) => {
                let reason = format!("expected hello, got {other:?}");
                let _ = write_message(
                    &mut sock,
                    &Message::Refuse {
                        field: "type".into(),
                        reason: reason.clone(),
                    },
                )
                .await;
                return Err(DataplaneError::Handshake {
                    peer: addr.to_string(),
                    reason,
                });
            }
            None => return Ok(()),
        };
        if let Err(e) = inner.check_peer(&remote) {
            let field = match &e {
                DataplaneError::LayoutMismatch { field, .. } => field.to_string(),
                _ => "engine".into(),
            };
            let _ = write_message(
                &mut sock,
                &Message::Refuse {
                    field,
                    reason: e.to_string(),
                },
            )
            .await;
            return Err(e);
        }
        write_message(
            &mut sock,
            &Message::Welcome {
                engine: inner.metadata(),
            },
        )
        .await?;
        inner.register_peer(remote, addr, sock)
    }

    /// Adds the peer to the backend and the table, and starts the tasks that
    /// read notifications from and write messages to its side channel.
    pub(super) fn register_peer(
        self: &Arc<Self>,
        md: EngineMetadata,
        addr: SocketAddr,
        sock: TcpStream,
    ) -> Result<()> {
        let slot = self.backend.add_peer(&md.engine_id, &md.backend)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let engine_id = md.engine_id.clone();
        let old = self.peers.write().insert(
            engine_id.clone(),
            Peer {
                slot,
                metadata: md,
                addr,
                tx,
                generation,
                hint_until_ns: std::sync::atomic::AtomicU64::new(0),
            },
        );
        if let Some(old) = old {
            tracing::info!(peer = %engine_id, old = %old.addr, new = %addr, "peer reconnected; replacing");
            self.backend.remove_peer(old.slot);
        }
        tracing::info!(peer = %engine_id, %addr, "peer connected");
        let (mut rd, mut wr) = sock.into_split();
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                if write_message(&mut wr, &m).await.is_err() {
                    break;
                }
            }
        });
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let peer_label = engine_id.clone();
            loop {
                match read_message(&mut rd, &peer_label).await {
                    Ok(Some(Message::Notify { notif })) => {
                        let Some(inner) = weak.upgrade() else { return };
                        match parse_notification(&notif) {
                            Ok((owner_request_id, count)) => {
                                let _ = inner.notif_tx.send(Notification {
                                    from_engine_id: engine_id.clone(),
                                    owner_request_id,
                                    count,
                                });
                            }
                            Err(e) => {
                                tracing::warn!(peer = %engine_id, error = %e, "bad notification ignored")
                            }
                        }
                    }
                    Ok(Some(Message::ReadHint { bytes })) => {
                        let Some(inner) = weak.upgrade() else { return };
                        inner.backend.kick(Duration::from_nanos(bytes));
                    }
                    Ok(Some(other)) => {
                        tracing::warn!(peer = %engine_id, message = ?other, "unexpected side-channel message ignored")
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            // Connection gone: forget the peer (if it was not replaced since).
            let Some(inner) = weak.upgrade() else { return };
            let removed = {
                let mut peers = inner.peers.write();
                if peers
                    .get(&engine_id)
                    .is_some_and(|p| p.generation == generation)
                {
                    peers.remove(&engine_id)
                } else {
                    None
                }
            };
            if let Some(p) = removed {
                // Waits for READs being posted to the peer: off the async workers.
                let _ =
                    tokio::task::spawn_blocking(move || inner.backend.remove_peer(p.slot)).await;
                tracing::info!(peer = %engine_id, "peer disconnected");
            }
        });
        Ok(())
    }
}
