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
mod engines;
mod leases;
mod links;
mod model;
mod peers;
mod probe_engines;
mod rails;
mod read;

pub use kvloop_agent_api::peer::{API_VERSION, EngineAddr, EnginesInfo, PROBE_ENGINE_PREFIX};
pub use model::bandwidth_alarm;
pub use peers::PeerState;
pub use probe_engines::ProbeTarget;
pub use read::{dataplane_error, read_size};

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parking_lot::{Mutex, RwLock};
use std::time::Duration;

use kvloop_costmodel::{
    CostModel, Direction as CmDirection, Instant, KvShape, PairSpec, PrefillSample, SampleSource,
    TransferSample,
};
use kvloop_dataplane::{
    EngineConfig, HostRegion, KvLayout, ReadOutcome, ReadRequest, TransferEngine,
};
use serde::Serialize;
use tokio::sync::Notify;

use crate::config::AgentConfig;
use crate::lease::{LeaseError, LeaseInfo, LeaseTable, Released};
use crate::metrics::{Metrics, labels};
use crate::proto::{ApiError, EngineEvent, ErrorKind, ErrorOrigin, ReadDirection, RegionSource};
use crate::pulls::{AlarmChange, PullOutcome};

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

/// Most abandoned-pull notices waiting for the routers; more are dropped
/// (a notice is worth sending only while P recomputes).
const PULL_NOTICES_QUEUED: usize = 256;

/// Most events queued per engine; older ones are dropped first.
const MAX_QUEUED_EVENTS: usize = 65536;

/// The agent: configuration, hosted engines, leases, events, the cost
/// model, the peer table, probes and metrics. Its state is private: the
/// local API ([`crate::server`]), the HTTP API ([`crate::http`]) and the
/// background tasks ([`crate::tasks`]) act through its methods.
pub struct Agent {
    cfg: AgentConfig,
    start: std::time::Instant,
    engines: RwLock<HashMap<String, Hosted>>,
    leases: Mutex<LeaseTable>,
    /// Wakes the lease task when a lease was added or renewed (its next
    /// expiry may be earlier than the one it sleeps until).
    lease_changed: Notify,
    events: Mutex<HashMap<String, EventQueue>>,
    /// The cost model (sans-IO; refitted at its `poll_timeout` by the
    /// model task).
    model: Mutex<CostModel>,
    /// Peer agents by name.
    peers: RwLock<HashMap<String, PeerState>>,
    /// The configured probe engine, when probes run.
    probe_engine: Option<TransferEngine>,
    /// Probe engines shaped like the registered engines' layouts.
    shaped_probes: RwLock<Vec<probe_engines::ShapedProbe>>,
    /// Held while deciding on and opening an engine-shaped probe engine.
    shape_lock: tokio::sync::Mutex<()>,
    /// Per engine, its rails' byte totals at the last accounting
    /// ([`Agent::account_rail_bytes`]).
    rail_seen: Mutex<HashMap<String, Vec<u64>>>,
    /// eBPF probes (or their user-space fallback).
    probes: kvloop_probes::Probes,
    metrics: Metrics,
    /// HTTP client for peers and routers.
    http: reqwest::Client,
    /// Sequence of threshold pushes.
    push_seq: AtomicU64,
    /// Wakes the push task at once (a path was invalidated, or
    /// [`kvloop_costmodel::urgent_push`] after a refit).
    push_now: Notify,
    /// The pairs of the last update built for the routers.
    last_pushed: Mutex<Vec<kvloop_costmodel::PairThreshold>>,
    /// The agent's own READs are timed in the kernel (eBPF loaded and its
    /// READ-site uprobes attached); otherwise they are timed in user space
    /// and labelled `source="userspace"`.
    reads_timed_in_kernel: bool,
    next_generation: AtomicU64,
    /// Consecutive unread pulls per (reader, owner) pair.
    pulls: Mutex<crate::pulls::PullTracker>,
    /// Notices for the routers that a pull's READ ended without the
    /// blocks (sent by `crate::tasks::notices`; dropped when it lags).
    pull_notices: tokio::sync::mpsc::Sender<kvloop_router_api::PullNotice>,
    /// Their receiving end, until the task takes it.
    pull_notices_rx: Mutex<Option<tokio::sync::mpsc::Receiver<kvloop_router_api::PullNotice>>>,
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
            model.upsert_pair(p.spec())?;
        }
        let probe_engine = if cfg.probe.enabled {
            let plan = crate::probe_plan::ProbePlan::configured(&cfg.probe);
            let id = format!("{PROBE_ENGINE_PREFIX}{}", cfg.agent_id);
            Some(
                probe_engines::start_probe_engine(&cfg, id, &plan, cfg.probe.side_channel_port)
                    .await?,
            )
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
        let (pull_notices, pull_notices_rx) = tokio::sync::mpsc::channel(PULL_NOTICES_QUEUED);
        for name in peers.keys() {
            metrics
                .path_valid
                .get_or_create(&labels(&[("peer", name.as_str())]))
                .set(1);
        }
        Ok(Arc::new(Self {
            leases: Mutex::new(LeaseTable::new(cfg.lease)),
            lease_changed: Notify::new(),
            cfg,
            start: std::time::Instant::now(),
            engines: RwLock::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            model: Mutex::new(model),
            peers: RwLock::new(peers),
            probe_engine,
            shaped_probes: RwLock::new(Vec::new()),
            shape_lock: tokio::sync::Mutex::new(()),
            rail_seen: Mutex::new(HashMap::new()),
            probes,
            metrics,
            http,
            push_seq: AtomicU64::new(1),
            push_now: Notify::new(),
            last_pushed: Mutex::new(Vec::new()),
            reads_timed_in_kernel,
            next_generation: AtomicU64::new(1),
            pulls: Mutex::new(crate::pulls::PullTracker::default()),
            pull_notices,
            pull_notices_rx: Mutex::new(Some(pull_notices_rx)),
        }))
    }

    /// The receiving end of the abandoned-pull notices (`None` once taken:
    /// one task sends them).
    pub fn take_pull_notices(
        &self,
    ) -> Option<tokio::sync::mpsc::Receiver<kvloop_router_api::PullNotice>> {
        self.pull_notices_rx.lock().take()
    }

    /// Configuration in force.
    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// The agent's metrics (registered by `main` with the probes').
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The eBPF probes (or their user-space fallback).
    pub fn probes(&self) -> &kvloop_probes::Probes {
        &self.probes
    }

    /// The configured probe engine, when probes run.
    pub fn probe_engine(&self) -> Option<&TransferEngine> {
        self.probe_engine.as_ref()
    }

    /// The HTTP client for peers and routers (connect timeout 1 s).
    pub fn http_client(&self) -> &reqwest::Client {
        &self.http
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
            .iter()
            .map(|(id, h)| EngineAddr {
                engine_id: id.clone(),
                side_channel: h.engine.side_channel_addr(),
            })
            .collect();
        EnginesInfo {
            version: API_VERSION,
            agent_id: self.cfg.agent_id.clone(),
            probe: self.probe_engine.as_ref().map(|e| EngineAddr {
                engine_id: e.engine_id().to_string(),
                side_channel: e.side_channel_addr(),
            }),
            engines,
            shaped_probes: self.shaped_probe_addrs(),
        }
    }

    fn engine(&self, engine_id: &str) -> Result<TransferEngine, ApiError> {
        self.engines
            .read()
            .get(engine_id)
            .map(|h| h.engine.clone())
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::UnknownEngine,
                    format!("engine_id `{engine_id}` is not registered with this agent"),
                )
            })
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
        self.model_prefill(engine_id, s)
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))
    }

    /// Explanation of a pair: rendered text and JSON.
    ///
    /// # Errors
    /// `bad_request` when the pair is unknown.
    pub fn explain(&self, p: &str, d: &str) -> Result<(String, serde_json::Value), ApiError> {
        let now = self.now();
        let m = self.model.lock();
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
        let m = self.model.lock();
        let thresholds: Vec<_> = m
            .pair_thresholds(Duration::from_millis(self.cfg.valid_for_ms()))
            .into_iter()
            .map(|p| {
                serde_json::json!({"prefill_engine_id": p.prefill_engine_id,
                 "decode_engine_id": p.decode_engine_id, "threshold_tokens": p.threshold_tokens,
                 "confidence": p.model.as_ref().map(|m| m.confidence)})
            })
            .collect();
        let peers: serde_json::Map<String, serde_json::Value> = self
            .peers
            .read()
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
            "leases": self.leases.lock().len(),
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
        self.engines.write().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::read::lease_covers;
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
        assert_eq!(e.kind.as_str(), "lease");
        assert!(e.message.contains("blocks[1].remote = 6"), "{}", e.message);
        assert!(e.message.contains("`r1`"), "{}", e.message);
    }
}
