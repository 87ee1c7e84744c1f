//! The transfer engine: owns an engine's KV regions and a backend, runs the
//! side channel, and performs bounds-checked block READs with a timeout and
//! owner notifications.
//!
//! * `peers`: handshake and the side channel's per-peer tasks.
//! * `read`: READ requests, bounds checks and [`TransferEngine::read`].
mod peers;
mod read;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

pub use crate::config::{BackendConfig, EngineConfig};
pub use read::{OwnerNotify, ReadOutcome, ReadRequest, validate_pairs};

use crate::backend::{PeerSlot, TransferBackend};
use crate::error::{DataplaneError, Result};
use crate::fabric::FabricBackend;
use crate::layout::KvLayout;
use crate::nixl::NixlBackend;
use crate::notify::{Notification, format_notification};
use crate::quarantine::SharedQuarantine;
use crate::region::{HostRegion, KvRegion, RegionDesc};
use crate::sidechannel::{EngineMetadata, Message, PROTOCOL_VERSION, read_message, write_message};

struct Peer {
    slot: PeerSlot,
    metadata: EngineMetadata,
    addr: SocketAddr,
    tx: mpsc::UnboundedSender<Message>,
    generation: u64,
    /// Until when (ns after [`Inner::epoch`]) the peer's serving side is
    /// known to be awake from our last [`Message::ReadHint`]: READs inside
    /// the window send no further hint.
    hint_until_ns: AtomicU64,
}

struct Inner {
    cfg: EngineConfig,
    // Dropped by hand (see `Drop for Inner`): the backend goes before the
    // regions, and both are leaked if READs into the regions are still in flight.
    backend: std::mem::ManuallyDrop<Box<dyn TransferBackend>>,
    regions: std::mem::ManuallyDrop<Vec<KvRegion>>,
    local_addr: SocketAddr,
    peers: RwLock<HashMap<String, Peer>>,
    notif_tx: broadcast::Sender<Notification>,
    quarantine: SharedQuarantine,
    next_xfer: AtomicU64,
    next_generation: AtomicU64,
    /// Origin of the peers' hint windows.
    epoch: std::time::Instant,
    /// READs of this engine awaiting their result.
    reads_waiting: std::sync::atomic::AtomicUsize,
}

/// An engine's transfer endpoint. Cheap to clone.
#[derive(Clone)]
pub struct TransferEngine {
    inner: Arc<Inner>,
    _accept: Arc<AbortOnDrop>,
}

struct AbortOnDrop(JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl TransferEngine {
    /// Starts an engine over `regions` (one per layout region, each at least
    /// `layout.region_len_bytes()` long): registers them with the backend and
    /// listens on the side channel.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] for a bad layout or region set; backend and
    /// I/O errors from setup.
    pub async fn start(cfg: EngineConfig, regions: Vec<HostRegion>) -> Result<Self> {
        Self::start_with_regions(cfg, regions.into_iter().map(KvRegion::from).collect()).await
    }

    /// As [`TransferEngine::start`], with regions of any kind (host memfd or,
    /// with feature `cuda`, device memory registered with `FI_HMEM` / NIXL `VRAM`).
    ///
    /// # Errors
    /// As [`TransferEngine::start`].
    pub async fn start_with_regions(cfg: EngineConfig, regions: Vec<KvRegion>) -> Result<Self> {
        check_regions(&cfg, &regions)?;
        let descs: Vec<RegionDesc> = regions.iter().map(KvRegion::desc).collect();
        let backend = open_backend(&cfg, descs).await?;
        let listener = TcpListener::bind(cfg.side_channel_addr)
            .await
            .map_err(|e| {
                DataplaneError::io(format!("bind side channel {}", cfg.side_channel_addr), e)
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| DataplaneError::io("side channel address", e))?;
        let (notif_tx, _) = broadcast::channel(4096);
        let inner = Arc::new(Inner {
            cfg,
            backend: std::mem::ManuallyDrop::new(backend),
            regions: std::mem::ManuallyDrop::new(regions),
            local_addr,
            peers: RwLock::new(HashMap::new()),
            notif_tx,
            quarantine: SharedQuarantine::default(),
            next_xfer: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            epoch: std::time::Instant::now(),
            reads_waiting: std::sync::atomic::AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&inner);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((sock, addr)) = listener.accept().await else {
                    continue;
                };
                let Some(inner) = weak.upgrade() else { return };
                tokio::spawn(async move {
                    if let Err(e) = Inner::serve_handshake(inner, sock, addr).await {
                        tracing::warn!(%addr, error = %e, "side-channel handshake failed");
                    }
                });
            }
        });
        tracing::info!(
            engine_id = %inner.cfg.engine_id,
            backend = %inner.backend.name(),
            side_channel = %local_addr,
            "transfer engine started"
        );
        Ok(Self {
            inner,
            _accept: Arc::new(AbortOnDrop(accept)),
        })
    }

    /// This engine's id.
    pub fn engine_id(&self) -> &str {
        &self.inner.cfg.engine_id
    }

    /// The bound side-channel address.
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The local layout.
    pub fn layout(&self) -> &KvLayout {
        &self.inner.cfg.layout
    }

    /// The backend's name, e.g. `libfabric tcp;ofi_rxm`.
    pub fn backend_name(&self) -> String {
        self.inner.backend.name()
    }

    /// Payload bytes each rail of the backend has carried since start
    /// (libfabric rails, first rail first: one entry without rails; empty
    /// for NIXL). Sampled before and after a READ, the difference is what
    /// each rail carried of it.
    pub fn rail_bytes(&self) -> Vec<u64> {
        self.inner.backend.rail_bytes()
    }

    /// Local host region `i` (for filling and checking block contents).
    ///
    /// # Panics
    /// When `i >= layout.num_regions` or region `i` is device memory.
    pub fn region(&self, i: usize) -> &HostRegion {
        self.inner.regions[i]
            .as_host()
            .expect("region is device memory; use region_desc")
    }

    /// Address, length and kind of local region `i`.
    ///
    /// # Panics
    /// When `i >= layout.num_regions`.
    pub fn region_desc(&self, i: usize) -> RegionDesc {
        self.inner.regions[i].desc()
    }

    /// This engine's handshake metadata.
    pub fn metadata(&self) -> EngineMetadata {
        self.inner.metadata()
    }

    /// Metadata of a connected peer.
    pub fn peer_metadata(&self, engine_id: &str) -> Option<EngineMetadata> {
        self.inner
            .peers
            .read()
            .get(engine_id)
            .map(|p| p.metadata.clone())
    }

    /// Engine ids of connected peers.
    pub fn peers(&self) -> Vec<String> {
        self.inner.peers.read().keys().cloned().collect()
    }

    /// Subscribes to owner notifications received from readers.
    pub fn subscribe_notifications(&self) -> broadcast::Receiver<Notification> {
        self.inner.notif_tx.subscribe()
    }

    /// Connects to the engine at `addr` and performs the handshake; on
    /// success both engines can READ from each other. Returns the peer's
    /// metadata.
    ///
    /// # Errors
    /// [`DataplaneError::Handshake`] when the peer refuses or does not answer
    /// in time; [`DataplaneError::LayoutMismatch`] when this side refuses the
    /// peer's layout or backend.
    pub async fn connect(&self, addr: SocketAddr) -> Result<EngineMetadata> {
        let inner = self.inner.clone();
        let timeout = Duration::from_millis(inner.cfg.handshake_timeout_ms);
        let fail = |reason: String| DataplaneError::Handshake {
            peer: addr.to_string(),
            reason,
        };
        let mut sock = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                fail(format!(
                    "connect timed out after {} ms",
                    timeout.as_millis()
                ))
            })?
            .map_err(|e| fail(format!("connect: {e}")))?;
        let _ = sock.set_nodelay(true);
        write_message(
            &mut sock,
            &Message::Hello {
                engine: inner.metadata(),
            },
        )
        .await?;
        let reply = tokio::time::timeout(timeout, read_message(&mut sock, &addr.to_string()))
            .await
            .map_err(|_| fail(format!("no answer within {} ms", timeout.as_millis())))??;
        let remote = match reply {
            Some(Message::Welcome { engine }) => engine,
            Some(Message::Refuse { field, reason }) => {
                return Err(fail(format!("refused by peer: field `{field}`: {reason}")));
            }
            Some(other) => return Err(fail(format!("unexpected message {other:?}"))),
            None => return Err(fail("connection closed during handshake".into())),
        };
        inner.check_peer(&remote)?;
        inner.register_peer(remote.clone(), addr, sock)?;
        Ok(remote)
    }

    /// Local block ids currently quarantined: destinations of READs whose
    /// caller stopped waiting (timed out, or its future was dropped) and that
    /// the backend has not completed yet. Ascending.
    pub fn quarantined_blocks(&self) -> Vec<u64> {
        self.inner.quarantine.lock().blocks()
    }

    /// Asks a connected peer to keep its serving-side progress active for
    /// about `bytes` at 1 GB/s (at most 1 s): what [`TransferEngine::read`]
    /// does before each READ. For tools that READ the peer's memory by other
    /// means (the raw baseline of `kvloop bench read`).
    ///
    /// # Errors
    /// [`DataplaneError::UnknownPeer`] when there is no such peer.
    pub fn hint_peer(&self, peer_engine_id: &str, bytes: u64) -> Result<()> {
        let _ = self
            .peer_tx(peer_engine_id)?
            .send(Message::ReadHint { bytes });
        Ok(())
    }

    /// The side-channel sender of a connected peer.
    fn peer_tx(&self, peer_engine_id: &str) -> Result<mpsc::UnboundedSender<Message>> {
        self.inner
            .peers
            .read()
            .get(peer_engine_id)
            .map(|p| p.tx.clone())
            .ok_or_else(|| DataplaneError::UnknownPeer {
                engine_id: peer_engine_id.into(),
            })
    }

    /// Sends a notification to a connected peer without a READ (for example
    /// to release blocks the reader decided not to read).
    ///
    /// # Errors
    /// [`DataplaneError::UnknownPeer`] when there is no such peer.
    pub fn notify(&self, peer_engine_id: &str, owner_request_id: &str, count: u32) -> Result<()> {
        self.peer_tx(peer_engine_id)?
            .send(Message::Notify {
                notif: format_notification(owner_request_id, count),
            })
            .map_err(|_| DataplaneError::PeerGone {
                engine_id: peer_engine_id.into(),
                reason: "side channel closed".into(),
            })
    }
}

/// Checks the layout, the engine id and the region set against the layout.
///
/// # Errors
/// [`DataplaneError::Config`] naming the bad field.
fn check_regions(cfg: &EngineConfig, regions: &[KvRegion]) -> Result<()> {
    cfg.layout.validate()?;
    if cfg.engine_id.is_empty() || cfg.engine_id.len() > 256 {
        return Err(DataplaneError::Config {
            field: "engine_id",
            expected: "a non-empty id of at most 256 bytes".into(),
        });
    }
    if regions.len() != cfg.layout.num_regions as usize {
        return Err(DataplaneError::Config {
            field: "regions",
            expected: format!(
                "{} regions (layout.num_regions), got {}",
                cfg.layout.num_regions,
                regions.len()
            ),
        });
    }
    for (i, r) in regions.iter().enumerate() {
        if (r.len() as u64) < cfg.layout.region_len_bytes() {
            return Err(DataplaneError::Config {
                field: "regions",
                expected: format!(
                    "region {i} of at least {} bytes (num_blocks × block_len_bytes), got {}",
                    cfg.layout.region_len_bytes(),
                    r.len()
                ),
            });
        }
    }
    Ok(())
}

/// Opens the configured backend over `descs`, off the async workers.
///
/// # Errors
/// Backend setup errors.
async fn open_backend(
    cfg: &EngineConfig,
    descs: Vec<RegionDesc>,
) -> Result<Box<dyn TransferBackend>> {
    let backend: Box<dyn TransferBackend> = match &cfg.backend {
        BackendConfig::Libfabric(f) => {
            let mut f = f.clone();
            if f.bind_node.is_none() && f.rails.is_empty() && f.provider.starts_with("tcp") {
                // tcp listens on the node's address: the side channel's
                // (rails name their own).
                f.bind_node = Some(cfg.side_channel_addr.ip().to_string());
            }
            Box::new(
                tokio::task::spawn_blocking(move || FabricBackend::new(f, &descs))
                    .await
                    .unwrap()?,
            )
        }
        BackendConfig::Nixl(n) => {
            let n = n.clone();
            let id = cfg.engine_id.clone();
            Box::new(
                tokio::task::spawn_blocking(move || NixlBackend::new(&id, n, &descs))
                    .await
                    .unwrap()?,
            )
        }
    };
    Ok(backend)
}

impl Drop for Inner {
    fn drop(&mut self) {
        // READs still in flight write into `regions`: if the backend cannot
        // quiesce, leak both rather than unmap memory a provider may still
        // write (a bounded leak at shutdown beats a crash).
        if self.backend.quiesce(Duration::from_secs(2)) {
            // SAFETY: dropped once, here; the backend before the regions it registered.
            unsafe {
                std::mem::ManuallyDrop::drop(&mut self.backend);
                std::mem::ManuallyDrop::drop(&mut self.regions);
            }
        } else {
            tracing::warn!(engine_id = %self.cfg.engine_id, "engine dropped with READs in flight: leaking its KV regions");
        }
    }
}

impl Inner {
    fn metadata(&self) -> EngineMetadata {
        EngineMetadata {
            version: PROTOCOL_VERSION,
            engine_id: self.cfg.engine_id.clone(),
            layout: self.cfg.layout,
            backend: self.backend.metadata(),
        }
    }
}
