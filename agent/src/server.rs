//! The local API server on the agent's Unix socket: mode 0600, and every
//! connection's peer credentials (`SO_PEERCRED`) are checked: only the
//! agent's own uid or root may talk to it.
//!
//! Garbage on the socket (bytes that are not JSON requests, oversized
//! length prefixes, frames cut short) is logged at warn with the peer's pid
//! and uid, rate-limited ([`crate::garbage::WarnLimiter`]), and answered with an error frame
//! while the framing still allows one: a body that is not a request gets a
//! `bad_request` response and the connection goes on; a length prefix over
//! [`crate::proto::MAX_FRAME_BYTES`] or a frame cut short gets a
//! `bad_request` response, then the connection is closed (the stream can no
//! longer be split into frames).
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

use crate::agent::Agent;
pub use crate::garbage::Peer;
use crate::garbage::garbage_warn;
use crate::proto::{
    ApiError, ErrorKind, PROTOCOL_VERSION, Reply, Request, Response, decode_request, read_frame,
    send_json,
};

/// Whether a peer with `peer_uid` may use an agent running as `own_uid`.
pub fn peer_allowed(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == own_uid || peer_uid == 0
}

/// Binds the socket (replacing a stale one), sets mode 0600.
///
/// # Errors
/// I/O errors naming the path.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(l)
}

/// Accepts connections until the task is dropped.
pub async fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let own_uid = nix::unistd::geteuid().as_raw();
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "local API accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match sock.peer_cred() {
            Ok(c) if peer_allowed(c.uid(), own_uid) => {}
            Ok(c) => {
                tracing::warn!(peer_uid = c.uid(), pid = ?c.pid(), "local API: peer uid refused (only the agent's uid or root)");
                let _ = send_json(
                    &sock,
                    &Response::Err(ApiError::new(
                        ErrorKind::Forbidden,
                        format!(
                            "uid {} may not use this agent (only uid {own_uid} or root)",
                            c.uid()
                        ),
                    )),
                    &[],
                )
                .await;
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "local API: no peer credentials; refused");
                continue;
            }
        }
        let peer = sock
            .peer_cred()
            .map(|c| Peer {
                pid: c.pid(),
                uid: c.uid(),
            })
            .unwrap_or_default();
        let agent = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = conn(agent, &sock, peer).await {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    // The framing is lost: say why in one last frame.
                    let _ = send_json(
                        &sock,
                        &Response::Err(ApiError::new(ErrorKind::BadRequest, format!("frame: {e}"))),
                        &[],
                    )
                    .await;
                    garbage_warn(peer, &format!("bad frame, connection closed: {e}"));
                } else {
                    tracing::debug!(error = %e, "local API connection ended");
                }
            }
        });
    }
}

/// Serves one connection. Engines registered on it are unregistered when it
/// closes (the engine process is gone: its memory must not be served any
/// more), unless registered again since.
async fn conn(agent: Arc<Agent>, sock: &UnixStream, peer: Peer) -> std::io::Result<()> {
    let mut registered: Vec<(String, u64)> = Vec::new();
    let r = serve_conn(&agent, sock, peer, &mut registered).await;
    for (id, generation) in registered {
        if agent.unregister_generation(&id, generation) {
            tracing::info!(engine_id = %id, "registering connection closed: engine unregistered");
        }
    }
    r
}

async fn serve_conn(
    agent: &Arc<Agent>,
    sock: &UnixStream,
    peer: Peer,
    registered: &mut Vec<(String, u64)>,
) -> std::io::Result<()> {
    while let Some((body, fds)) = read_frame(sock).await? {
        let resp = match decode_request(&body) {
            Ok(Request::Register {
                engine_id,
                layout,
                regions,
                side_channel_port,
            }) => match agent
                .register(engine_id.clone(), layout, regions, side_channel_port, fds)
                .await
            {
                Ok((side_channel, backend, generation)) => {
                    registered.push((engine_id.clone(), generation));
                    Response::Ok(Reply::Registered {
                        engine_id,
                        side_channel,
                        backend,
                    })
                }
                Err(e) => Response::Err(e),
            },
            Ok(req) => match handle(agent, req, fds).await {
                Ok(r) => Response::Ok(r),
                Err(e) => Response::Err(e),
            },
            Err(e) => {
                garbage_warn(
                    peer,
                    &format!("a frame of {} bytes is not a request: {e}", body.len()),
                );
                Response::Err(ApiError::new(
                    ErrorKind::BadRequest,
                    format!("request: {e}"),
                ))
            }
        };
        send_json(sock, &resp, &[]).await?;
    }
    Ok(())
}

/// Handles one request.
///
/// # Errors
/// The request's [`ApiError`].
pub async fn handle(
    agent: &Arc<Agent>,
    req: Request,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<Reply, ApiError> {
    let no_fds = |fds: &Vec<_>| -> Result<(), ApiError> {
        if fds.is_empty() {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorKind::BadRequest,
                "fds: only `register` carries file descriptors",
            ))
        }
    };
    if !matches!(req, Request::Register { .. }) {
        no_fds(&fds)?;
    }
    match req {
        Request::Hello { version, client } => {
            if version != PROTOCOL_VERSION {
                return Err(ApiError::new(
                    ErrorKind::Version,
                    format!(
                        "version: agent speaks {PROTOCOL_VERSION}, client `{client}` speaks {version}"
                    ),
                ));
            }
            Ok(Reply::Welcome {
                version: PROTOCOL_VERSION,
                agent_id: agent.config().agent_id.clone(),
            })
        }
        Request::Register {
            engine_id,
            layout,
            regions,
            side_channel_port,
        } => {
            let (side_channel, backend, _) = agent
                .register(engine_id.clone(), layout, regions, side_channel_port, fds)
                .await?;
            Ok(Reply::Registered {
                engine_id,
                side_channel,
                backend,
            })
        }
        Request::Unregister { engine_id } => {
            if agent.unregister(&engine_id) {
                Ok(Reply::Done)
            } else {
                Err(ApiError::new(
                    ErrorKind::UnknownEngine,
                    format!("engine_id `{engine_id}` is not registered"),
                ))
            }
        }
        Request::Connect { engine_id, remote } => Ok(Reply::Connected {
            peer_engine_id: agent.connect(&engine_id, remote).await?,
        }),
        Request::Read {
            engine_id,
            peer_engine_id,
            blocks,
            direction,
            notify,
            check_lease,
            timeout_ms,
        } => agent
            .read(
                &engine_id,
                &peer_engine_id,
                blocks,
                direction,
                notify,
                check_lease,
                timeout_ms,
            )
            .await
            .map(|o| Reply::ReadDone(o.into())),
        Request::Notify {
            engine_id,
            peer_engine_id,
            owner_request_id,
            count,
        } => agent
            .notify(&engine_id, &peer_engine_id, &owner_request_id, count)
            .map(|_| Reply::Done),
        Request::Retain {
            engine_id,
            request_id,
            block_ids,
            ttl_ms,
        } => agent
            .retain(&engine_id, &request_id, block_ids, ttl_ms)
            .map(Reply::Lease),
        Request::Renew {
            peer_engine_id,
            request_id,
            lease_ms,
        } => agent
            .renew(&peer_engine_id, &request_id, lease_ms)
            .await
            .map(Reply::Lease),
        Request::Release {
            engine_id,
            request_id,
        } => agent.release(&engine_id, &request_id).map(|_| Reply::Done),
        Request::Events {
            engine_id,
            timeout_ms,
            max,
        } => agent
            .events(
                &engine_id,
                Duration::from_millis(timeout_ms.min(60_000)),
                max,
            )
            .await
            .map(|events| Reply::Events { events }),
        Request::RecordPrefill {
            engine_id,
            prompt_tokens,
            reused_tokens,
            latency_us,
        } => agent
            .record_prefill(&engine_id, prompt_tokens, reused_tokens, latency_us)
            .map(|_| Reply::Done),
        Request::Explain {
            prefill_engine_id,
            decode_engine_id,
        } => agent
            .explain(&prefill_engine_id, &decode_engine_id)
            .map(|(text, explain)| Reply::Explain { text, explain }),
        Request::Status => Ok(Reply::Status(agent.status())),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_same_uid_or_root() {
        assert!(super::peer_allowed(1000, 1000));
        assert!(super::peer_allowed(0, 1000));
        assert!(!super::peer_allowed(1001, 1000));
        assert!(super::peer_allowed(0, 0));
        assert!(!super::peer_allowed(1000, 0));
    }
}
