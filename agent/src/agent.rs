//! The agent's shared state and the operations of the local API: hosted
//! engines (one [`TransferEngine`] per registered engine), leases, events,
//! the cost model and the peer table.
//!
//! One transfer engine per registered engine (not one per agent): an engine
//! id, a layout and a side-channel address are what a vLLM-compatible peer
//! sees in `kv_transfer_params` (`remote_engine_id`, `remote_host`,
//! `remote_port`), and the dataplane's handshake checks layouts per engine;
//! separate engines keep that one-to-one and let engines with different
//! layouts (models) share a node. The probe engine is one more engine.
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvloop_costmodel::{
    CostModel, Direction as CmDirection, Instant, KvShape, PairSpec, PrefillSample, SampleSource,
    TransferSample,
};
use kvloop_dataplane::{
    EngineConfig, HostRegion, KvLayout, ReadOutcome, ReadRequest, TransferEngine,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::config::AgentConfig;
use crate::lease::{LeaseError, LeaseInfo, LeaseTable, Released};
use crate::metrics::{Metrics, labels};
use crate::proto::{ApiError, EngineEvent, ErrorKind, ErrorOrigin, ReadDirection, RegionSource};
use crate::pulls::{AlarmChange, PullOutcome};

/// Prefix of the probe engine's id: `probe.<agent_id>`.
pub const PROBE_ENGINE_PREFIX: &str = "probe.";

/// What a peer agent says about itself at `GET /v1/engines`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnginesInfo {
    /// Agent-to-agent API version ([`crate::http::API_VERSION`]).
    pub version: u32,
    /// The agent's id.
    pub agent_id: String,
    /// Its probe engine (id, side channel), when probes run.
    pub probe: Option<EngineAddr>,
    /// Engines it hosts.
    pub engines: Vec<EngineAddr>,
}

/// An engine id and its side-channel address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineAddr {
    /// Engine id.
    pub engine_id: String,
    /// Side channel.
    pub side_channel: SocketAddr,
}

/// What the agent knows about a peer agent.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeerState {
    /// Its HTTP address.
    pub http: Option<SocketAddr>,
    /// Its last `/v1/engines` answer.
    pub info: Option<EnginesInfo>,
    /// Local interface of the path.
    pub interface: Option<String>,
    /// `false` while the link under the path is down.
    pub path_valid: bool,
    /// Bandwidth alarm raised.
    pub alarm: bool,
}

struct Hosted {
    engine: TransferEngine,
    generation: u64,
    _notif: AbortOnDrop,
}

/// Aborts a task when dropped.
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Default)]
struct EventQueue {
    q: VecDeque<EngineEvent>,
    notify: Arc<Notify>,
}

/// Most events queued per engine; older ones are dropped first.
const MAX_QUEUED_EVENTS: usize = 65536;

/// The agent.
pub struct Agent {
    /// Configuration in force.
    pub cfg: AgentConfig,
    start: std::time::Instant,
    engines: RwLock<HashMap<String, Hosted>>,
    leases: Mutex<LeaseTable>,
    events: Mutex<HashMap<String, EventQueue>>,
    /// The cost model (sans-IO; driven by [`crate::tasks`]).
    pub model: Mutex<CostModel>,
    /// Peer agents by name.
    pub peers: RwLock<HashMap<String, PeerState>>,
    /// The probe engine, when probes run.
    pub probe_engine: Option<TransferEngine>,
    /// eBPF probes (or their user-space fallback).
    pub probes: kvloop_probes::Probes,
    /// Metrics.
    pub metrics: Metrics,
    /// HTTP client for peers and routers.
    pub http: reqwest::Client,
    /// Sequence of threshold pushes.
    pub push_seq: AtomicU64,
    /// Wakes the push task at once (a path was invalidated).
    pub push_now: Notify,
    /// The agent's own READs are timed in the kernel (eBPF loaded and its
    /// READ-site uprobes attached); otherwise they are timed in user space
    /// and labelled `source="userspace"`.
    pub reads_timed_in_kernel: bool,
    next_generation: AtomicU64,
    /// Consecutive unread pulls per (reader, owner) pair.
    pulls: Mutex<crate::pulls::PullTracker>,
}

pub use crate::config::is_own_peer_entry;

impl Agent {
    /// Builds the agent: cost model with the configured pairs, probe engine.
    ///
    /// # Errors
    /// A bad pair or cost model config; the probe engine failing to start.
    pub async fn new(cfg: AgentConfig, probes: kvloop_probes::Probes) -> anyhow::Result<Arc<Self>> {
        let mut model = CostModel::new(cfg.cost_model.clone())?;
        for p in &cfg.pairs {
            model.upsert_pair(PairSpec {
                prefill_engine_id: p.prefill_engine_id.clone(),
                decode_engine_id: p.decode_engine_id.clone(),
                decode_peer: p.decode_peer.clone(),
                shape: KvShape {
                    bytes_per_token: p.bytes_per_token,
                    block_size_tokens: p.block_size_tokens,
                    regions_per_block: p.regions_per_block,
                },
            })?;
        }
        let probe_engine = if cfg.probe.enabled {
            let p = &cfg.probe;
            let layout = KvLayout {
                num_regions: p.num_regions,
                num_blocks: p.num_blocks,
                block_len_bytes: p.block_len_bytes,
                block_size_tokens: p.block_size_tokens,
            };
            let regions = (0..p.num_regions)
                .map(|i| HostRegion::new(&format!("probe{i}"), layout.region_len_bytes() as usize))
                .collect::<Result<Vec<_>, _>>()?;
            let ecfg = EngineConfig {
                engine_id: format!("{PROBE_ENGINE_PREFIX}{}", cfg.agent_id),
                side_channel_addr: SocketAddr::new(cfg.node_addr, p.side_channel_port),
                backend: cfg.backend.clone(),
                layout,
                read_timeout_ms: cfg.read_timeout_ms.max(10_000),
                handshake_timeout_ms: 5000,
            };
            Some(TransferEngine::start(ecfg, regions).await?)
        } else {
            None
        };
        let peers: HashMap<String, PeerState> = cfg
            .peers
            .iter()
            .filter(|p| {
                let own = is_own_peer_entry(&cfg, p);
                if own {
                    tracing::info!(peer = %p.name, http = %p.http, "peers[]: skipping this agent's own entry");
                }
                !own
            })
            .map(|p| {
                (
                    p.name.clone(),
                    PeerState {
                        http: Some(p.http),
                        info: None,
                        interface: p.interface.clone(),
                        path_valid: true,
                        alarm: false,
                    },
                )
            })
            .collect();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(1000))
            .timeout(Duration::from_millis(cfg.push_timeout_ms.max(1000)))
            .build()?;
        let reads_timed_in_kernel = probes.source() == kvloop_probes::Source::Ebpf
            && probes
                .attached()
                .iter()
                .any(|a| a.ends_with("-> kvloop_read_post"));
        let metrics = Metrics::default();
        for name in peers.keys() {
            metrics
                .path_valid
                .get_or_create(&labels(&[("peer", name.as_str())]))
                .set(1);
        }
        Ok(Arc::new(Self {
            leases: Mutex::new(LeaseTable::new(cfg.lease)),
            cfg,
            start: std::time::Instant::now(),
            engines: RwLock::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            model: Mutex::new(model),
            peers: RwLock::new(peers),
            probe_engine,
            probes,
            metrics,
            http,
            push_seq: AtomicU64::new(1),
            push_now: Notify::new(),
            reads_timed_in_kernel,
            next_generation: AtomicU64::new(1),
            pulls: Mutex::new(crate::pulls::PullTracker::default()),
        }))
    }

    /// Milliseconds since the agent started (its only clock for leases).
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The cost model's clock: nanoseconds since the agent started.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(self.start.elapsed().as_nanos() as u64)
    }

    /// What `GET /v1/engines` answers.
    pub fn engines_info(&self) -> EnginesInfo {
        let engines = self
            .engines
            .read()
            .unwrap()
            .iter()
            .map(|(id, h)| EngineAddr {
                engine_id: id.clone(),
                side_channel: h.engine.side_channel_addr(),
            })
            .collect();
        EnginesInfo {
            version: crate::http::API_VERSION,
            agent_id: self.cfg.agent_id.clone(),
            probe: self.probe_engine.as_ref().map(|e| EngineAddr {
                engine_id: e.engine_id().to_string(),
                side_channel: e.side_channel_addr(),
            }),
            engines,
        }
    }

    /// The peer agent hosting `engine_id` (from the peers' engine lists).
    /// An id of exactly [`kvloop_common::PEER_LEN`] bytes also matches the
    /// longer ids it is a prefix of (probe samples carry truncated ids).
    pub fn peer_of_engine(&self, engine_id: &str) -> Option<String> {
        let truncated = engine_id.len() == kvloop_common::PEER_LEN;
        let m = |id: &str| id == engine_id || (truncated && id.starts_with(engine_id));
        let peers = self.peers.read().unwrap();
        peers
            .iter()
            .find(|(_, p)| {
                p.info.as_ref().is_some_and(|i| {
                    i.engines.iter().any(|e| m(&e.engine_id))
                        || i.probe.as_ref().is_some_and(|e| m(&e.engine_id))
                })
            })
            .map(|(n, _)| n.clone())
    }

    fn engine(&self, engine_id: &str) -> Result<TransferEngine, ApiError> {
        self.engines
            .read()
            .unwrap()
            .get(engine_id)
            .map(|h| h.engine.clone())
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::UnknownEngine,
                    format!("engine_id `{engine_id}` is not registered with this agent"),
                )
            })
    }

    /// Registers an engine: maps its memfds and starts its transfer engine.
    /// Returns its side channel, backend name and registration generation
    /// (for [`Agent::unregister_generation`]).
    ///
    /// # Errors
    /// `bad_request` naming the field (fd count, lengths, layout); `dataplane`.
    pub async fn register(
        self: &Arc<Self>,
        engine_id: String,
        layout: KvLayout,
        regions: RegionSource,
        side_channel_port: Option<u16>,
        fds: Vec<OwnedFd>,
    ) -> Result<(SocketAddr, String, u64), ApiError> {
        if engine_id.starts_with(PROBE_ENGINE_PREFIX) {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "engine_id: `{PROBE_ENGINE_PREFIX}*` is reserved for the agent's probe engine"
                ),
            ));
        }
        layout
            .validate()
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        // Params naming a side channel peers cannot reach would make every
        // reader decline and recompute, silently: refuse instead.
        self.cfg
            .check_side_channel_reachable()
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, format!("side channel: {e}")))?;
        let host = match regions {
            RegionSource::Memfd { len_bytes } => {
                if fds.len() != layout.num_regions as usize || len_bytes.len() != fds.len() {
                    return Err(ApiError::new(
                        ErrorKind::BadRequest,
                        format!(
                            "regions.len_bytes / fds: expected {} of each (layout.num_regions), got {} lengths and {} fds",
                            layout.num_regions,
                            len_bytes.len(),
                            fds.len()
                        ),
                    ));
                }
                let mut v = Vec::with_capacity(fds.len());
                for (i, (fd, len)) in fds.into_iter().zip(len_bytes).enumerate() {
                    let r = HostRegion::from_fd(fd, len as usize).map_err(|e| {
                        ApiError::new(
                            ErrorKind::BadRequest,
                            format!("regions.len_bytes[{i}]: {e}"),
                        )
                    })?;
                    v.push(r);
                }
                v
            }
            RegionSource::CudaIpc { .. } => {
                return Err(ApiError::new(
                    ErrorKind::BadRequest,
                    crate::cuda::unsupported_message(),
                ));
            }
        };
        let ecfg = EngineConfig {
            engine_id: engine_id.clone(),
            side_channel_addr: SocketAddr::new(self.cfg.node_addr, side_channel_port.unwrap_or(0)),
            backend: self.cfg.backend.clone(),
            layout,
            read_timeout_ms: self.cfg.read_timeout_ms,
            handshake_timeout_ms: 5000,
        };
        // Replace an earlier registration first (it may hold the port).
        self.unregister(&engine_id);
        let engine = TransferEngine::start(ecfg, host)
            .await
            .map_err(|e| dataplane_error(&e))?;
        let addr = engine.side_channel_addr();
        let backend = engine.backend_name();
        let mut rx = engine.subscribe_notifications();
        let weak = Arc::downgrade(self);
        let id = engine_id.clone();
        let task = tokio::spawn(async move {
            loop {
                let n = match rx.recv().await {
                    Ok(n) => n,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(k)) => {
                        tracing::warn!(engine_id = %id, lost = k, "owner notifications lost (queue overflow)");
                        continue;
                    }
                    Err(_) => return,
                };
                let Some(agent) = weak.upgrade() else { return };
                let released =
                    agent
                        .leases
                        .lock()
                        .unwrap()
                        .on_notification(&id, &n.owner_request_id, n.count);
                agent.push_event(
                    &id,
                    EngineEvent::Notification {
                        from_engine_id: n.from_engine_id,
                        owner_request_id: n.owner_request_id,
                        count: n.count,
                    },
                );
                if let Some(r) = released {
                    agent.push_event(&id, EngineEvent::Released(r));
                }
                agent.update_lease_gauge();
            }
        });
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.engines.write().unwrap().insert(
            engine_id.clone(),
            Hosted {
                engine,
                generation,
                _notif: AbortOnDrop(task),
            },
        );
        // A fresh queue: events of an earlier registration of the same id
        // (an engine that restarted) must not reach the new one.
        self.events
            .lock()
            .unwrap()
            .insert(engine_id.clone(), Default::default());
        self.metrics
            .engines
            .set(self.engines.read().unwrap().len() as i64);
        tracing::info!(%engine_id, side_channel = %addr, %backend, "engine registered");
        Ok((addr, backend, generation))
    }

    /// Unregisters an engine; `true` if it was registered.
    pub fn unregister(&self, engine_id: &str) -> bool {
        let gone = self.engines.write().unwrap().remove(engine_id).is_some();
        if gone {
            self.leases.lock().unwrap().drop_engine(engine_id);
            // Waiters in `events` see `unknown_engine` from now on.
            if let Some(q) = self.events.lock().unwrap().remove(engine_id) {
                q.notify.notify_waiters();
            }
            self.metrics
                .engines
                .set(self.engines.read().unwrap().len() as i64);
            tracing::info!(%engine_id, "engine unregistered");
        }
        gone
    }

    /// Unregisters `engine_id` only if it is still the registration of
    /// `generation` (the registering connection closed; a newer registration
    /// of the same id stays).
    pub fn unregister_generation(&self, engine_id: &str, generation: u64) -> bool {
        let same = self
            .engines
            .read()
            .unwrap()
            .get(engine_id)
            .is_some_and(|h| h.generation == generation);
        same && self.unregister(engine_id)
    }

    /// Connects a hosted engine to a remote engine.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane`.
    pub async fn connect(&self, engine_id: &str, remote: SocketAddr) -> Result<String, ApiError> {
        let e = self.engine(engine_id)?;
        let md = e.connect(remote).await.map_err(|e| dataplane_error(&e))?;
        Ok(md.engine_id)
    }

    /// A managed READ (see [`crate::proto::Request::Read`]).
    ///
    /// # Errors
    /// `unknown_engine`, `bad_request`, `lease`, `dataplane`.
    #[allow(clippy::too_many_arguments)]
    pub async fn read(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        blocks: Vec<kvloop_dataplane::BlockPair>,
        direction: ReadDirection,
        notify: Option<kvloop_dataplane::OwnerNotify>,
        check_lease: bool,
        timeout_ms: Option<u64>,
    ) -> Result<ReadOutcome, ApiError> {
        let e = self.engine(engine_id)?;
        let dir_label = match direction {
            ReadDirection::D2p => "d2p",
            ReadDirection::P2d => "p2d",
        };
        if check_lease {
            let req = notify.as_ref().ok_or_else(|| {
                ApiError::new(
                    ErrorKind::BadRequest,
                    "notify: check_lease needs notify.owner_request_id (the owner's request)",
                )
            })?;
            let lease_ms = self.cfg.lease.max_lease_ms;
            let checked = self
                .renew(peer_engine_id, &req.owner_request_id, lease_ms)
                .await
                .and_then(|lease| lease_covers(&lease, &blocks));
            if let Err(err) = checked {
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", "declined")]))
                    .inc();
                self.record_pull(engine_id, peer_engine_id, PullOutcome::Declined(err.kind));
                return Err(err);
            }
        }
        let r = e
            .read(&ReadRequest {
                peer_engine_id: peer_engine_id.to_string(),
                blocks,
                direction: direction.to_dataplane(),
                notify,
                timeout_ms,
            })
            .await;
        match r {
            Ok(o) => {
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", "ok")]))
                    .inc();
                self.record_pull(engine_id, peer_engine_id, PullOutcome::Read);
                self.metrics
                    .read_bytes
                    .get_or_create(&labels(&[("direction", dir_label)]))
                    .inc_by(o.bytes);
                if !self.reads_timed_in_kernel {
                    self.observe_read_userspace(peer_engine_id, direction, &o);
                }
                if let Some(peer) = self.peer_of_engine(peer_engine_id) {
                    self.record_own_read(&peer, &o, SampleSource::Userspace);
                }
                Ok(o)
            }
            Err(err) => {
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", "error")]))
                    .inc();
                let err = dataplane_error(&err);
                self.record_pull(engine_id, peer_engine_id, PullOutcome::Failed(err.kind));
                Err(err)
            }
        }
    }

    /// Counts a pull of `owner`'s blocks by `reader` and raises or clears
    /// the pair's alarm (`kvloop_agent_pull_alarm`, a warning when raised).
    fn record_pull(&self, reader: &str, owner: &str, outcome: PullOutcome) {
        self.metrics
            .pulls
            .get_or_create(&labels(&[
                ("reader", reader),
                ("owner", owner),
                ("result", outcome.result_label()),
                ("reason", outcome.reason_label()),
            ]))
            .inc();
        let change = self.pulls.lock().unwrap().record(reader, owner, outcome);
        let alarm = self
            .metrics
            .pull_alarm
            .get_or_create(&labels(&[("reader", reader), ("owner", owner)]));
        match change {
            AlarmChange::Raised(n) => {
                alarm.set(1);
                tracing::warn!(reader, owner, unread = n, last = ?outcome,
                               "pulls of this pair keep failing: every turn recomputes");
            }
            AlarmChange::Cleared => {
                alarm.set(0);
                tracing::info!(reader, owner, "pulls of this pair read again");
            }
            AlarmChange::Unchanged => {}
        }
    }

    /// Records a READ this agent made from `peer` in the cost model. Where
    /// the eBPF probes are loaded the kernel timing of the same READ is used
    /// instead ([`crate::tasks`] drains it), so user-space timing is only
    /// recorded in fallback mode; active probes are always recorded as such.
    pub fn record_own_read(&self, peer: &str, o: &ReadOutcome, source: SampleSource) {
        if source == SampleSource::Userspace && self.reads_timed_in_kernel {
            return;
        }
        let s = TransferSample {
            at: self.now(),
            bytes: o.bytes,
            descriptors: o.descriptors as u64,
            latency: Duration::from_micros(o.elapsed_us.max(1)),
            source,
        };
        if let Err(e) = self
            .model
            .lock()
            .unwrap()
            .record_transfer(peer, CmDirection::Inbound, s)
        {
            tracing::debug!(error = %e, "transfer sample rejected");
        }
    }

    /// Feeds a READ timed in user space to the probes' transfer histograms
    /// (`source="userspace"`), where the kernel does not time this agent's
    /// READs.
    fn observe_read_userspace(
        &self,
        peer_engine_id: &str,
        direction: ReadDirection,
        o: &ReadOutcome,
    ) {
        let args = kvloop_common::ReadProbeArgs {
            xfer_id: o.xfer_id,
            bytes: o.bytes,
            descriptors: o.descriptors,
            direction: direction.to_dataplane() as u8,
            backend: match self.cfg.backend {
                kvloop_dataplane::BackendConfig::Libfabric(_) => {
                    kvloop_common::BackendKind::Libfabric as u8
                }
                kvloop_dataplane::BackendConfig::Nixl(_) => kvloop_common::BackendKind::Nixl as u8,
            },
            status: 0,
            peer: kvloop_common::ReadProbeArgs::peer_from_str(peer_engine_id),
        };
        self.probes
            .observe_read_userspace(&args, Duration::from_micros(o.elapsed_us.max(1)));
    }

    /// Retains blocks of a hosted engine.
    ///
    /// # Errors
    /// `unknown_engine`, `lease`.
    pub fn retain(
        &self,
        engine_id: &str,
        request_id: &str,
        block_ids: Vec<u64>,
        ttl_ms: Option<u64>,
    ) -> Result<LeaseInfo, ApiError> {
        let e = self.engine(engine_id)?;
        let nb = e.layout().num_blocks as u64;
        if let Some((i, b)) = block_ids.iter().enumerate().find(|(_, b)| **b >= nb) {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!("block_ids[{i}] = {b}: expected a block id below {nb} (layout.num_blocks)"),
            ));
        }
        let now = self.now_ms();
        let r = self
            .leases
            .lock()
            .unwrap()
            .retain(engine_id, request_id, block_ids, ttl_ms, now)
            .map_err(lease_err);
        self.update_lease_gauge();
        r
    }

    /// Renews the lease of `request_id` of `owner_engine_id`: in the local
    /// table when the owner is hosted here, else through its agent
    /// (`POST /v1/leases/renew`). Fails when the blocks expire within the
    /// safety margin.
    ///
    /// # Errors
    /// `lease` (unknown, expiring), `unknown_engine` (no agent hosts it).
    pub async fn renew(
        &self,
        owner_engine_id: &str,
        request_id: &str,
        lease_ms: u64,
    ) -> Result<LeaseInfo, ApiError> {
        if self.engines.read().unwrap().contains_key(owner_engine_id) {
            return self.renew_local(owner_engine_id, request_id, lease_ms);
        }
        let peer = match self.peer_of_engine(owner_engine_id) {
            Some(p) => p,
            None => {
                // Registered since the last periodic discovery: ask the peers now.
                crate::tasks::refresh_peers(self).await;
                self.peer_of_engine(owner_engine_id).ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::UnknownEngine,
                        format!("peer_engine_id `{owner_engine_id}`: no known agent hosts it (peers[] of the config)"),
                    )
                })?
            }
        };
        let http = self.peers.read().unwrap().get(&peer).and_then(|p| p.http);
        let http = http.ok_or_else(|| {
            ApiError::new(
                ErrorKind::Internal,
                format!("peer `{peer}` has no HTTP address"),
            )
        })?;
        let url = format!("http://{http}/v1/leases/renew");
        let body = crate::http::RenewRequest {
            version: crate::http::API_VERSION,
            engine_id: owner_engine_id.into(),
            request_id: request_id.into(),
            lease_ms,
        };
        let resp = self.http.post(&url).json(&body).send().await.map_err(|e| {
            ApiError::new(ErrorKind::Lease, format!("renew at {url}: {e}"))
                .with_origin(ErrorOrigin::Peer)
        })?;
        let status = resp.status();
        if status.is_success() {
            resp.json::<LeaseInfo>().await.map_err(|e| {
                ApiError::new(ErrorKind::Lease, format!("renew at {url}: bad answer: {e}"))
            })
        } else {
            let mut e: ApiError = resp.json().await.unwrap_or_else(|_| {
                ApiError::new(ErrorKind::Lease, format!("renew at {url}: HTTP {status}"))
            });
            e.origin.get_or_insert(ErrorOrigin::Peer);
            Err(e)
        }
    }

    /// Renews a lease of a hosted engine and checks the safety margin.
    ///
    /// # Errors
    /// `lease`.
    pub fn renew_local(
        &self,
        engine_id: &str,
        request_id: &str,
        lease_ms: u64,
    ) -> Result<LeaseInfo, ApiError> {
        let now = self.now_ms();
        let mut t = self.leases.lock().unwrap();
        t.check_read(engine_id, request_id, now)
            .map_err(lease_err)?;
        t.renew(engine_id, request_id, lease_ms, now)
            .map_err(lease_err)
    }

    /// The owner releases blocks.
    ///
    /// # Errors
    /// `lease` when nothing is retained; `lease_in_use` while a reader's
    /// renewal holds them.
    pub fn release(&self, engine_id: &str, request_id: &str) -> Result<(), ApiError> {
        let now = self.now_ms();
        let r = self
            .leases
            .lock()
            .unwrap()
            .release(engine_id, request_id, now);
        self.update_lease_gauge();
        let r = r.map_err(lease_err)?;
        self.push_event(engine_id, EngineEvent::Released(r));
        Ok(())
    }

    /// Expires lapsed leases and tells their owners (called by a timer).
    pub fn expire_leases(&self) {
        let now = self.now_ms();
        let gone: Vec<Released> = self.leases.lock().unwrap().expire(now);
        for r in gone {
            tracing::debug!(engine_id = %r.engine_id, request_id = %r.request_id, "lease expired");
            let id = r.engine_id.clone();
            self.push_event(&id, EngineEvent::Released(r));
        }
        self.update_lease_gauge();
    }

    fn update_lease_gauge(&self) {
        self.metrics
            .leases
            .set(self.leases.lock().unwrap().len() as i64);
    }

    /// Sends an owner notification without a READ.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane`.
    pub fn notify(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        owner_request_id: &str,
        count: u32,
    ) -> Result<(), ApiError> {
        self.engine(engine_id)?
            .notify(peer_engine_id, owner_request_id, count)
            .map_err(|e| dataplane_error(&e))
    }

    fn push_event(&self, engine_id: &str, ev: EngineEvent) {
        let mut m = self.events.lock().unwrap();
        let q = m.entry(engine_id.to_string()).or_default();
        if q.q.len() >= MAX_QUEUED_EVENTS {
            q.q.pop_front();
        }
        q.q.push_back(ev);
        q.notify.notify_waiters();
        q.notify.notify_one();
    }

    /// Waits up to `timeout` for events of `engine_id`.
    ///
    /// # Errors
    /// `unknown_engine`.
    pub async fn events(
        &self,
        engine_id: &str,
        timeout: Duration,
        max: usize,
    ) -> Result<Vec<EngineEvent>, ApiError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notify = {
                let mut m = self.events.lock().unwrap();
                let Some(q) = m.get_mut(engine_id) else {
                    return Err(ApiError::new(
                        ErrorKind::UnknownEngine,
                        format!("engine_id `{engine_id}` is not registered with this agent"),
                    ));
                };
                if !q.q.is_empty() {
                    let n = q.q.len().min(max.max(1));
                    return Ok(q.q.drain(..n).collect());
                }
                q.notify.clone()
            };
            if tokio::time::timeout_at(deadline, notify.notified())
                .await
                .is_err()
            {
                return Ok(Vec::new());
            }
        }
    }

    /// Records a prefill reported by an engine.
    ///
    /// # Errors
    /// `bad_request` naming the field.
    pub fn record_prefill(
        &self,
        engine_id: &str,
        prompt_tokens: u64,
        reused_tokens: u64,
        latency_us: u64,
    ) -> Result<(), ApiError> {
        let s = PrefillSample {
            at: self.now(),
            prompt_tokens,
            reused_tokens,
            latency: Duration::from_micros(latency_us),
            source: SampleSource::Userspace,
        };
        self.model
            .lock()
            .unwrap()
            .record_prefill(engine_id, s)
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))
    }

    /// Explanation of a pair: rendered text and JSON.
    ///
    /// # Errors
    /// `bad_request` when the pair is unknown.
    pub fn explain(&self, p: &str, d: &str) -> Result<(String, serde_json::Value), ApiError> {
        let now = self.now();
        let m = self.model.lock().unwrap();
        let ex = m.explain(p, d, now).ok_or_else(|| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!("pair `{p},{d}`: not configured on this agent (pairs[] of the config)"),
            )
        })?;
        let json = serde_json::to_value(&ex).unwrap_or_default();
        Ok((ex.to_string(), json))
    }

    /// Status as JSON.
    pub fn status(&self) -> serde_json::Value {
        let now = self.now();
        let m = self.model.lock().unwrap();
        let thresholds: Vec<_> = m
            .pair_thresholds(Duration::from_millis(self.cfg.valid_for_ms()))
            .into_iter()
            .map(|p| {
                serde_json::json!({"prefill_engine_id": p.prefill_engine_id,
                 "decode_engine_id": p.decode_engine_id, "threshold_tokens": p.threshold_tokens})
            })
            .collect();
        let peers: serde_json::Map<String, serde_json::Value> = self
            .peers
            .read()
            .unwrap()
            .iter()
            .map(|(n, p)| {
                let fit = m.transfer_fit(n, CmDirection::Inbound, now);
                (
                    n.clone(),
                    serde_json::json!({
                        "path_valid": p.path_valid,
                        "alarm": p.alarm,
                        "interface": p.interface,
                        "known": p.info.is_some(),
                        "bandwidth_bytes_per_s": fit.as_ref().map(|f| f.coefficients.bandwidth_bytes_per_s()),
                        "fixed_ms": fit.as_ref().map(|f| f.coefficients.fixed_ms),
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "agent_id": self.cfg.agent_id,
            "engines": self.engines_info(),
            "leases": self.leases.lock().unwrap().len(),
            "ebpf": self.probes.source() == kvloop_probes::Source::Ebpf,
            "read_timing": self.read_timing_label(),
            "peers": peers,
            "thresholds": thresholds,
        })
    }

    /// Where this agent's own READs are timed: `ebpf` (READ-site uprobes
    /// attached) or `userspace`.
    pub fn read_timing_label(&self) -> &'static str {
        if self.reads_timed_in_kernel {
            "ebpf"
        } else {
            "userspace"
        }
    }

    /// Drops every hosted engine (shutdown).
    pub fn shutdown(&self) {
        self.engines.write().unwrap().clear();
    }
}

/// `lease`, or `lease_in_use` for an owner release refused while a reader
/// holds the blocks (the owner keeps them and evicts another request).
fn lease_err(e: LeaseError) -> ApiError {
    let kind = if matches!(e, LeaseError::InUse { .. }) {
        ErrorKind::LeaseInUse
    } else {
        ErrorKind::Lease
    };
    ApiError::new(kind, e.to_string())
}

/// A dataplane failure as the local API reports it: the finer kind, where
/// it came from ([`kvloop_dataplane::DataplaneError::source_kind`]) and
/// whether sending the request again is safe
/// ([`kvloop_dataplane::DataplaneError::retry_safe`]).
pub fn dataplane_error(e: &kvloop_dataplane::DataplaneError) -> ApiError {
    use kvloop_dataplane::DataplaneError as D;
    let kind = match e {
        D::BlockOutOfRange { .. } | D::DuplicateLocalBlock { .. } => ErrorKind::BlockRange,
        D::BlockQuarantined { .. } => ErrorKind::BlockQuarantined,
        D::UnknownPeer { .. } => ErrorKind::UnknownPeer,
        D::LayoutMismatch { .. } => ErrorKind::LayoutMismatch,
        D::Handshake { .. } => ErrorKind::Handshake,
        D::Timeout { .. } => ErrorKind::Timeout,
        D::PeerGone { .. } => ErrorKind::PeerGone,
        D::Backend { .. } | D::NixlUnavailable(_) => ErrorKind::Backend,
        D::Config { .. } => ErrorKind::BadRequest,
        D::Shutdown => ErrorKind::Internal,
        D::Protocol { .. } | D::Io { .. } => ErrorKind::Dataplane,
    };
    let origin = match e.source_kind() {
        kvloop_dataplane::ErrorSource::Local => ErrorOrigin::Local,
        kvloop_dataplane::ErrorSource::Peer => ErrorOrigin::Peer,
        kvloop_dataplane::ErrorSource::Backend => ErrorOrigin::Backend,
    };
    ApiError::new(kind, e.to_string())
        .with_origin(origin)
        .retry_safe(e.retry_safe())
}

/// A READ checked against the owner's lease may only name blocks the lease
/// retains: params that name other blocks (stale, or not this request's)
/// are declined rather than served from the wrong blocks.
///
/// # Errors
/// `lease`, naming the first block pair the lease does not cover.
fn lease_covers(lease: &LeaseInfo, blocks: &[kvloop_dataplane::BlockPair]) -> Result<(), ApiError> {
    match blocks
        .iter()
        .enumerate()
        .find(|(_, b)| !lease.block_ids.contains(&b.remote))
    {
        None => Ok(()),
        Some((i, b)) => Err(ApiError::new(
            ErrorKind::Lease,
            format!(
                "blocks[{i}].remote = {}: not retained under request `{}` of engine `{}` (it retains {} blocks)",
                b.remote,
                lease.request_id,
                lease.engine_id,
                lease.block_ids.len()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvloop_dataplane::BlockPair;

    #[test]
    fn dataplane_errors_keep_their_kind_origin_and_retry_safety() {
        let e = dataplane_error(&kvloop_dataplane::DataplaneError::UnknownPeer {
            engine_id: "d0".into(),
        });
        assert_eq!(e.kind, ErrorKind::UnknownPeer);
        assert_eq!((e.origin, e.retry_safe), (Some(ErrorOrigin::Local), false));
        assert!(e.message.contains("d0"), "{e}");
        let e = dataplane_error(&kvloop_dataplane::DataplaneError::Timeout {
            xfer_id: 3,
            engine_id: "d0".into(),
            timeout_ms: 50,
        });
        assert_eq!(e.kind, ErrorKind::Timeout);
        assert_eq!((e.origin, e.retry_safe), (Some(ErrorOrigin::Backend), true));
        let e = dataplane_error(&kvloop_dataplane::DataplaneError::PeerGone {
            engine_id: "d0".into(),
            reason: "closed".into(),
        });
        assert_eq!(
            (e.kind, e.origin),
            (ErrorKind::PeerGone, Some(ErrorOrigin::Peer))
        );
    }

    #[test]
    fn a_checked_read_names_only_retained_blocks() {
        let lease = LeaseInfo {
            engine_id: "d0".into(),
            request_id: "r1".into(),
            block_ids: vec![4, 5, 9],
            expires_in_ms: 10_000,
            notifications: 0,
        };
        let ok = [
            BlockPair {
                remote: 9,
                local: 0,
            },
            BlockPair {
                remote: 4,
                local: 1,
            },
        ];
        assert!(lease_covers(&lease, &ok).is_ok());
        let bad = [
            BlockPair {
                remote: 5,
                local: 0,
            },
            BlockPair {
                remote: 6,
                local: 1,
            },
        ];
        let e = lease_covers(&lease, &bad).unwrap_err();
        assert_eq!(e.kind, "lease");
        assert!(e.message.contains("blocks[1].remote = 6"), "{}", e.message);
        assert!(e.message.contains("`r1`"), "{}", e.message);
    }
}
