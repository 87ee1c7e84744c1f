//! The transfer engine: owns an engine's KV regions and a backend, runs the
//! side channel, and performs bounds-checked block READs with a timeout and
//! owner notifications.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvloop_common::{Direction, ReadProbeArgs, status};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

use crate::backend::{Completion, PeerSlot, TransferBackend};
use crate::error::{DataplaneError, Result, Side};
use crate::fabric::{FabricBackend, FabricConfig};
use crate::layout::{BlockPair, KvLayout, segments};
use crate::nixl::{NixlBackend, NixlConfig};
use crate::notify::{Notification, format_notification, parse_notification};
use crate::region::{HostRegion, KvRegion, RegionDesc};
use crate::sidechannel::{EngineMetadata, Message, PROTOCOL_VERSION, read_message, write_message};

/// Which backend an engine uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendConfig {
    /// libfabric directly.
    Libfabric(FabricConfig),
    /// NIXL with a backend plugin.
    Nixl(NixlConfig),
}

/// Configuration of a [`TransferEngine`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Engine id, unique in the cluster (vLLM's `engine_id`).
    pub engine_id: String,
    /// Side-channel listen address; port 0 picks a free port.
    pub side_channel_addr: SocketAddr,
    /// Backend.
    pub backend: BackendConfig,
    /// KV layout of the regions handed to [`TransferEngine::start`].
    pub layout: KvLayout,
    /// READ timeout when a request gives none, ms. Default 5000.
    #[serde(default = "default_read_timeout_ms")]
    pub read_timeout_ms: u64,
    /// Handshake timeout, ms. Default 5000.
    #[serde(default = "default_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
}

fn default_read_timeout_ms() -> u64 {
    5000
}
fn default_handshake_timeout_ms() -> u64 {
    5000
}

/// A READ of blocks from a remote engine into local blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// Engine id of the block owner (must have completed a handshake).
    pub peer_engine_id: String,
    /// (remote block, local block) pairs; every region of each block is read.
    pub blocks: Vec<BlockPair>,
    /// Direction, for probes and metrics.
    #[serde(with = "direction_serde")]
    pub direction: Direction,
    /// When set, the owner is notified `"<owner request id>:<count>"` after
    /// the READ completed successfully.
    pub notify: Option<OwnerNotify>,
    /// Timeout; `None` uses the engine's `read_timeout_ms`.
    pub timeout_ms: Option<u64>,
}

/// Owner notification to send after a successful READ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerNotify {
    /// The owner's request id whose blocks are read.
    pub owner_request_id: String,
    /// Total notifications the owner should expect for this request.
    pub count: u32,
}

mod direction_serde {
    use kvloop_common::Direction;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(d: &Direction, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.label())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Direction, D::Error> {
        let s = String::deserialize(d)?;
        Ok(match s.as_str() {
            "d2p" => Direction::DecodeToPrefill,
            "p2d" => Direction::PrefillToDecode,
            "probe" => Direction::Probe,
            "unknown" => Direction::Unknown,
            other => {
                return Err(serde::de::Error::custom(format!(
                    "direction `{other}`: expected d2p, p2d, probe or unknown"
                )));
            }
        })
    }
}

/// What a successful READ did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ReadOutcome {
    /// Process-unique READ id (also in the probe arguments).
    pub xfer_id: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// Descriptors (block pairs × regions).
    pub descriptors: u32,
    /// Post → completion, measured in user space, µs.
    pub elapsed_us: u64,
}

struct Peer {
    slot: PeerSlot,
    metadata: EngineMetadata,
    addr: SocketAddr,
    tx: mpsc::UnboundedSender<Message>,
    generation: u64,
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
    quarantine: Mutex<HashMap<u64, u32>>,
    next_xfer: AtomicU64,
    next_generation: AtomicU64,
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
        let descs: Vec<RegionDesc> = regions.iter().map(KvRegion::desc).collect();
        let backend: Box<dyn TransferBackend> = match &cfg.backend {
            BackendConfig::Libfabric(f) => {
                let mut f = f.clone();
                if f.bind_node.is_none() && f.provider.starts_with("tcp") {
                    // tcp listens on the node's address: the side channel's.
                    f.bind_node = Some(cfg.side_channel_addr.ip().to_string());
                }
                let descs = descs.clone();
                Box::new(
                    tokio::task::spawn_blocking(move || FabricBackend::new(f, &descs))
                        .await
                        .unwrap()?,
                )
            }
            BackendConfig::Nixl(n) => {
                let n = n.clone();
                let id = cfg.engine_id.clone();
                let descs = descs.clone();
                Box::new(
                    tokio::task::spawn_blocking(move || NixlBackend::new(&id, n, &descs))
                        .await
                        .unwrap()?,
                )
            }
        };
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
            quarantine: Mutex::new(HashMap::new()),
            next_xfer: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
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
            .unwrap()
            .get(engine_id)
            .map(|p| p.metadata.clone())
    }

    /// Engine ids of connected peers.
    pub fn peers(&self) -> Vec<String> {
        self.inner.peers.read().unwrap().keys().cloned().collect()
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

    /// Reads `req.blocks` from `req.peer_engine_id` into local blocks.
    ///
    /// Every block id is checked against both layouts, and the peer must be
    /// known, before anything is posted. The future resolves when every
    /// operation completed, or with [`DataplaneError::Timeout`] after the
    /// timeout; the local destination blocks of a timed-out READ stay
    /// quarantined (refused as destinations) until the backend reports the
    /// abandoned operations complete, so late data never lands in blocks that
    /// were handed out again. On success, the owner is notified if asked.
    ///
    /// # Errors
    /// [`DataplaneError::UnknownPeer`], [`DataplaneError::BlockOutOfRange`],
    /// [`DataplaneError::DuplicateLocalBlock`], [`DataplaneError::BlockQuarantined`],
    /// [`DataplaneError::Config`] (empty `blocks`), [`DataplaneError::Timeout`],
    /// [`DataplaneError::Backend`], [`DataplaneError::PeerGone`].
    pub async fn read(&self, req: &ReadRequest) -> Result<ReadOutcome> {
        let inner = &self.inner;
        let (slot, remote_layout, peer_tx, hint) = {
            let peers = inner.peers.read().unwrap();
            let p = peers
                .get(&req.peer_engine_id)
                .ok_or_else(|| DataplaneError::UnknownPeer {
                    engine_id: req.peer_engine_id.clone(),
                })?;
            (
                p.slot,
                p.metadata.layout,
                p.tx.clone(),
                needs_serving_progress(&p.metadata.backend),
            )
        };
        let local_layout = inner.cfg.layout;
        validate_pairs(&local_layout, &remote_layout, &req.blocks)?;
        {
            let q = inner.quarantine.lock().unwrap();
            if let Some(b) = req
                .blocks
                .iter()
                .find(|b| !q.is_empty() && q.contains_key(&b.local))
            {
                return Err(DataplaneError::BlockQuarantined { block_id: b.local });
            }
        }
        let segs = segments(&local_layout, &req.blocks);
        let bytes = req.blocks.len() as u64 * local_layout.bytes_per_block_id();
        let descriptors =
            (req.blocks.len() as u64 * local_layout.num_regions as u64).min(u32::MAX as u64) as u32;
        let xfer_id = inner.next_xfer.fetch_add(1, Ordering::Relaxed);
        let mut probe = ReadProbeArgs {
            xfer_id,
            bytes,
            descriptors,
            direction: req.direction as u8,
            backend: inner.backend.kind() as u8,
            status: status::OK,
            peer: ReadProbeArgs::peer_from_str(&req.peer_engine_id),
        };
        let timeout_ms = req.timeout_ms.unwrap_or(inner.cfg.read_timeout_ms);
        let start = Instant::now();
        kvloop_common::usdt::read_post(&probe);
        // Wake the owner's serving-side progress for about the READ's duration
        // (estimated at 1 GB/s, a low rate for the paths kvloop runs on).
        if hint {
            let _ = peer_tx.send(Message::ReadHint { bytes });
        }
        let (done, mut rx) = Completion::new();
        inner.backend.post_read(slot, &segs, done);
        let result = match tokio::time::timeout(Duration::from_millis(timeout_ms), &mut rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(DataplaneError::Shutdown),
            Err(_) => {
                // Quarantine the destination blocks until the backend is done with them.
                let locals: Vec<u64> = req.blocks.iter().map(|b| b.local).collect();
                {
                    let mut q = inner.quarantine.lock().unwrap();
                    for b in &locals {
                        *q.entry(*b).or_insert(0) += 1;
                    }
                }
                let weak = Arc::downgrade(inner);
                tokio::spawn(async move {
                    let _ = rx.await;
                    if let Some(inner) = weak.upgrade() {
                        let mut q = inner.quarantine.lock().unwrap();
                        for b in &locals {
                            if let Some(c) = q.get_mut(b) {
                                *c -= 1;
                                if *c == 0 {
                                    q.remove(b);
                                }
                            }
                        }
                    }
                });
                Err(DataplaneError::Timeout {
                    xfer_id,
                    engine_id: req.peer_engine_id.clone(),
                    timeout_ms,
                })
            }
        };
        let elapsed = start.elapsed();
        probe.status = match &result {
            Ok(()) => status::OK,
            Err(DataplaneError::Timeout { .. }) => status::TIMED_OUT,
            Err(DataplaneError::Shutdown) => status::CANCELLED,
            Err(_) => status::IO_ERROR,
        };
        kvloop_common::usdt::read_done(&probe);
        result?;
        if let Some(n) = &req.notify {
            let notif = format_notification(&n.owner_request_id, n.count);
            if peer_tx.send(Message::Notify { notif }).is_err() {
                tracing::warn!(peer = %req.peer_engine_id, "owner notification not sent: side channel closed");
            }
        }
        Ok(ReadOutcome {
            xfer_id,
            bytes,
            descriptors,
            elapsed_us: elapsed.as_micros() as u64,
        })
    }

    /// Local block ids currently quarantined by timed-out READs.
    pub fn quarantined_blocks(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .inner
            .quarantine
            .lock()
            .unwrap()
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
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
            .unwrap()
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

/// Whether READs from an engine with this backend need its serving side to
/// make progress (and so a [`Message::ReadHint`]): libfabric providers other
/// than `shm` (`tcp;ofi_rxm` moves data only while the target polls; EFA's
/// protocol path likewise). `shm` READs are done by the reader (CMA) and NIXL
/// runs its own progress thread.
fn needs_serving_progress(md: &crate::backend::BackendMetadata) -> bool {
    matches!(md, crate::backend::BackendMetadata::Libfabric { provider, .. } if provider != "shm")
}

/// Checks every pair against both layouts, and that no local block is written
/// twice, before anything is posted.
///
/// # Errors
/// [`DataplaneError::Config`] for an empty list, [`DataplaneError::BlockOutOfRange`]
/// naming `blocks[i].remote` / `blocks[i].local`, [`DataplaneError::DuplicateLocalBlock`].
pub fn validate_pairs(local: &KvLayout, remote: &KvLayout, pairs: &[BlockPair]) -> Result<()> {
    if pairs.is_empty() {
        return Err(DataplaneError::Config {
            field: "blocks",
            expected: "at least one (remote, local) block pair".into(),
        });
    }
    let mut seen: HashMap<u64, usize> = HashMap::with_capacity(pairs.len());
    for (i, p) in pairs.iter().enumerate() {
        remote.check_block(Side::Remote, || format!("blocks[{i}].remote"), p.remote)?;
        local.check_block(Side::Local, || format!("blocks[{i}].local"), p.local)?;
        if let Some(first) = seen.insert(p.local, i) {
            return Err(DataplaneError::DuplicateLocalBlock {
                block_id: p.local,
                first,
                second: i,
            });
        }
    }
    Ok(())
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

    fn check_peer(&self, remote: &EngineMetadata) -> Result<()> {
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

    async fn serve_handshake(
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
    fn register_peer(
        self: &Arc<Self>,
        md: EngineMetadata,
        addr: SocketAddr,
        sock: TcpStream,
    ) -> Result<()> {
        let slot = self.backend.add_peer(&md.engine_id, &md.backend)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let engine_id = md.engine_id.clone();
        let old = self.peers.write().unwrap().insert(
            engine_id.clone(),
            Peer {
                slot,
                metadata: md,
                addr,
                tx,
                generation,
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
                let mut peers = inner.peers.write().unwrap();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn l(n: u32) -> KvLayout {
        KvLayout {
            num_regions: 2,
            num_blocks: n,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        }
    }

    #[test]
    fn pairs_are_checked_against_both_layouts() {
        let ok = [BlockPair {
            remote: 9,
            local: 3,
        }];
        validate_pairs(&l(4), &l(10), &ok).unwrap();
        let e = validate_pairs(&l(4), &l(8), &ok).unwrap_err().to_string();
        assert!(
            e.contains("blocks[0].remote") && e.contains("remote layout"),
            "{e}"
        );
        let e = validate_pairs(&l(2), &l(10), &ok).unwrap_err().to_string();
        assert!(
            e.contains("blocks[0].local") && e.contains("local layout"),
            "{e}"
        );
        let dup = [
            BlockPair {
                remote: 1,
                local: 0,
            },
            BlockPair {
                remote: 2,
                local: 0,
            },
        ];
        let e = validate_pairs(&l(4), &l(4), &dup).unwrap_err().to_string();
        assert!(e.contains("local block 0 appears twice"), "{e}");
        let e = validate_pairs(&l(4), &l(4), &[]).unwrap_err().to_string();
        assert!(e.contains("`blocks`"), "{e}");
    }
}
