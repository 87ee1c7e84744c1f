//! Starting an engine: its KV backing, its HTTP and side-channel servers and
//! its background tasks (agent events, owner notifications, the hold sweep).
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tracing::warn;

use crate::blocks::BlockAllocator;
use crate::config::{KvMode, Role, SimConfig};
use crate::engine::Engine;
use crate::http::{
    chat_completions, completions, health, metrics_text, models, reads, stats, tokenize,
};
use crate::kv::{DataplaneTransfer, KvMemory, KvShape};
use crate::managed;
use crate::metrics;
use crate::profile::{self, CostProfile};
use crate::side_channel::side_read;
use crate::stats::Stats;
use crate::transfer::{KvTransfer, SimulatedTransfer};

/// A running engine: its addresses and a handle to stop it.
pub struct SimHandle {
    /// OpenAI-compatible HTTP address.
    pub http_addr: SocketAddr,
    /// Side-channel address.
    pub side_channel_addr: SocketAddr,
    /// The engine state.
    pub engine: Arc<Engine>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl SimHandle {
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }
    /// Stop serving (in-flight requests are dropped).
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start an engine with the [`SimulatedTransfer`] on the current tokio runtime.
///
/// # Errors
/// When a listen address cannot be bound.
pub async fn spawn(cfg: SimConfig) -> std::io::Result<SimHandle> {
    let link = connect_agent(&cfg).await?;
    match cfg.kv_mode {
        KvMode::None => {
            let t = Arc::new(SimulatedTransfer::new(cfg.transfer_us_per_token));
            spawn_inner(cfg, t, None, link).await
        }
        KvMode::Inproc => {
            let kv = Arc::new(start_kv(&cfg).await?);
            let dir = match cfg.role {
                Role::Prefill => kvloop_common::Direction::DecodeToPrefill,
                Role::Decode => kvloop_common::Direction::PrefillToDecode,
            };
            let t = Arc::new(DataplaneTransfer::new(
                kv.clone(),
                dir,
                cfg.kv_read_timeout_ms,
            ));
            spawn_inner(cfg, t, Some(kv), link).await
        }
        KvMode::Agent => {
            let Some(link) = link else {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "agent_socket: required with kv_mode `agent` (the node agent's Unix socket)",
                ));
            };
            let port = cfg.kv_listen.map(|a| a.port()).filter(|p| *p != 0);
            let kv = Arc::new(
                KvMemory::register_with_agent(&cfg.engine_id, kv_shape(&cfg), link.clone(), port)
                    .await
                    .map_err(std::io::Error::other)?,
            );
            let reg = kv.registration().expect("agent backing").clone();
            let dir = match cfg.role {
                Role::Prefill => kvloop_agent_api::proto::ReadDirection::D2p,
                Role::Decode => kvloop_agent_api::proto::ReadDirection::P2d,
            };
            let t = Arc::new(managed::AgentTransfer::new(
                reg,
                dir,
                cfg.kv_read_timeout_ms,
            ));
            spawn_inner(cfg, t, Some(kv), Some(link)).await
        }
    }
}

/// The KV shape `cfg` asks for (capacity capped by `num_blocks`).
pub fn kv_shape(cfg: &SimConfig) -> KvShape {
    let bs = cfg.block_size_tokens.max(1);
    let blocks = cfg
        .kv_capacity_tokens
        .div_ceil(u64::from(bs))
        .min(u64::from(cfg.num_blocks))
        .max(1) as u32;
    KvShape {
        bytes_per_token: cfg.kv_bytes_per_token,
        layers: cfg.kv_layers,
        block_size_tokens: bs,
        num_blocks: blocks,
    }
}

async fn start_kv(cfg: &SimConfig) -> std::io::Result<KvMemory> {
    let listen = cfg
        .kv_listen
        .unwrap_or_else(|| SocketAddr::new(cfg.side_channel_addr.ip(), 0));
    KvMemory::start(
        &cfg.engine_id,
        kv_shape(cfg),
        &cfg.kv_provider,
        listen,
        cfg.kv_read_timeout_ms,
    )
    .await
    .map_err(std::io::Error::other)
}

/// Start an engine with a custom [`KvTransfer`].
///
/// # Errors
/// When a listen address cannot be bound.
pub async fn spawn_with_transfer(
    cfg: SimConfig,
    transfer: Arc<dyn KvTransfer>,
) -> std::io::Result<SimHandle> {
    let link = connect_agent(&cfg).await?;
    spawn_inner(cfg, transfer, None, link).await
}

/// The connection pool to the node agent at `cfg.agent_socket`, if set.
async fn connect_agent(cfg: &SimConfig) -> std::io::Result<Option<Arc<managed::AgentLink>>> {
    let Some(path) = &cfg.agent_socket else {
        return Ok(None);
    };
    let link = managed::AgentLink::connect(path, &cfg.engine_id)
        .await
        .map_err(|e| {
            std::io::Error::other(format!(
                "agent_socket: cannot reach the agent at {}: {e}",
                path.display()
            ))
        })?;
    Ok(Some(Arc::new(link)))
}

async fn spawn_inner(
    mut cfg: SimConfig,
    transfer: Arc<dyn KvTransfer>,
    kv: Option<Arc<KvMemory>>,
    agent: Option<Arc<managed::AgentLink>>,
) -> std::io::Result<SimHandle> {
    let profile = load_profile(&cfg)?;
    check_time_scale(cfg.time_scale)?;
    if let Some(kv) = &kv {
        // The allocator hands out exactly the blocks the KV regions hold.
        cfg.num_blocks = kv.shape().num_blocks;
    }
    let http = TcpListener::bind(cfg.http_addr).await?;
    let http_addr = http.local_addr()?;
    // Managed mode: readers reach this engine's blocks through the agent's
    // side channel; the engine's own (HTTP lease-check) side channel is
    // not served.
    let managed_side = kv
        .as_ref()
        .and_then(|k| k.registration().map(|r| r.side_channel()));
    let (side, side_channel_addr) = match managed_side {
        Some(addr) => (None, addr),
        None => {
            let l = TcpListener::bind(cfg.side_channel_addr).await?;
            let a = l.local_addr()?;
            (Some(l), a)
        }
    };
    let engine = new_engine(cfg, side_channel_addr, transfer, kv, agent, profile);
    let tx = serve(&engine, http, side);
    spawn_agent_events(&engine);
    spawn_owner_notifications(&engine);
    spawn_sweeper(&engine);
    Ok(SimHandle {
        http_addr,
        side_channel_addr,
        engine,
        shutdown: Some(tx),
    })
}

/// The cost profile `cfg.profile` names, if any.
fn load_profile(cfg: &SimConfig) -> std::io::Result<Option<CostProfile>> {
    let Some(name) = &cfg.profile else {
        return Ok(None);
    };
    CostProfile::by_name(name).map(Some).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "profile: unknown `{name}`; expected one of {}",
                profile::PROFILE_NAMES.join(", ")
            ),
        )
    })
}

fn check_time_scale(time_scale: f64) -> std::io::Result<()> {
    if time_scale.is_finite() && time_scale >= 0.0 {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("time_scale: expected a finite number >= 0, got {time_scale}"),
    ))
}

/// The engine's shared state, advertising `side_channel_addr`'s IP unless
/// `cfg.advertised_host` is set.
fn new_engine(
    cfg: SimConfig,
    side_channel_addr: SocketAddr,
    transfer: Arc<dyn KvTransfer>,
    kv: Option<Arc<KvMemory>>,
    agent: Option<Arc<managed::AgentLink>>,
    profile: Option<CostProfile>,
) -> Arc<Engine> {
    let advertised_host =
        cfg.advertised_host
            .clone()
            .unwrap_or_else(|| match side_channel_addr.ip() {
                std::net::IpAddr::V6(v6) => format!("[{v6}]"),
                std::net::IpAddr::V4(v4) => v4.to_string(),
            });
    let mut metrics = metrics::Metrics::new();
    if let Some(reg) = kv.as_ref().and_then(|k| k.registration()) {
        metrics.collect(crate::link_metrics::AgentLinkCollector(reg.link().clone()));
    }
    Arc::new(Engine {
        alloc: Mutex::new(BlockAllocator::new(cfg.num_blocks)),
        advertised_host,
        side_port: side_channel_addr.port(),
        start: Instant::now(),
        holds: Mutex::new(HashMap::new()),
        transfer,
        stats: Stats::default(),
        last_tokens_header: Mutex::new(None),
        last_params: Mutex::new(None),
        next_request: AtomicU64::new(0),
        kv,
        profile,
        reading: Mutex::new(HashMap::new()),
        metrics,
        read_log: Mutex::new(std::collections::VecDeque::new()),
        prefill_log: Mutex::new(std::collections::VecDeque::new()),
        parked: Mutex::new(Vec::new()),
        prefill_slots: (cfg.prefill_concurrency > 0)
            .then(|| tokio::sync::Semaphore::new(cfg.prefill_concurrency)),
        agent,
        agent_lost: std::sync::atomic::AtomicBool::new(false),
        agent_reports_failed: AtomicU64::new(0),
        cfg,
    })
}

/// The engine's HTTP routes (OpenAI API, `/tokenize` unless disabled, the
/// simulator's endpoints).
fn http_routes(engine: &Arc<Engine>) -> Router {
    let mut app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/sim/stats", get(stats))
        .route("/sim/reads", get(reads))
        .route("/sim/prefills", get(crate::http::prefills))
        .route("/metrics", get(metrics_text));
    if !engine.cfg.no_tokenize {
        app = app.route("/tokenize", post(tokenize));
    }
    app.with_state(engine.clone())
}

/// Serves the HTTP API on `http` and, when given, the side channel on
/// `side`; the returned sender stops both.
fn serve(
    engine: &Arc<Engine>,
    http: TcpListener,
    side: Option<TcpListener>,
) -> tokio::sync::oneshot::Sender<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = http_routes(engine);
    let side_app = Router::new()
        .route("/kv/read", post(side_read))
        .with_state(engine.clone());
    let (side_tx, side_rx) = tokio::sync::oneshot::channel::<()>();
    let side_rx = async move {
        let _ = side_rx.await;
    };
    tokio::spawn(async move {
        let _ = axum::serve(
            http.tap_io(|t| {
                let _ = t.set_nodelay(true);
            }),
            app,
        )
        .with_graceful_shutdown(async move {
            let _ = rx.await;
            let _ = side_tx.send(());
        })
        .await;
    });
    if let Some(side) = side {
        tokio::spawn(async move {
            let _ = axum::serve(
                side.tap_io(|t| {
                    let _ = t.set_nodelay(true);
                }),
                side_app,
            )
            .with_graceful_shutdown(side_rx)
            .await;
        });
    }
    tx
}

/// Managed mode: the agent's lease releases free the blocks; a lost agent
/// connection is recorded (holds are then swept locally).
fn spawn_agent_events(engine: &Arc<Engine>) {
    let Some(reg) = engine.kv.as_ref().and_then(|k| k.registration()) else {
        return;
    };
    let weak = Arc::downgrade(engine);
    let link = reg.link().clone();
    let id = engine.cfg.engine_id.clone();
    tokio::spawn(async move {
        let w = weak.clone();
        let r = managed::run_events(link, id, move |request_id| {
            let Some(e) = w.upgrade() else { return false };
            if let Some(id) = request_id {
                e.release_held(id);
            }
            true
        })
        .await;
        if let (Err(err), Some(e)) = (r, weak.upgrade()) {
            warn!(engine = %e.cfg.engine_id, error = %err,
                  "the node agent no longer hosts this engine: holds are freed at their deadline, READs recompute");
            e.agent_lost.store(true, Ordering::Relaxed);
        }
    });
}

/// In-process transfer engine: owner notifications free the blocks a
/// reader claimed.
fn spawn_owner_notifications(engine: &Arc<Engine>) {
    let Some(dp) = engine.kv.as_ref().and_then(|k| k.transfer_engine()) else {
        return;
    };
    let mut rx = dp.subscribe_notifications();
    let weak = Arc::downgrade(engine);
    tokio::spawn(async move {
        loop {
            match rx.recv().await {
                Ok(n) => {
                    let Some(e) = weak.upgrade() else { break };
                    e.release_reading(&n.owner_request_id);
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(k)) => {
                    warn!(
                        missed = k,
                        "owner notifications lagged; holds lapse at their deadline"
                    );
                }
                Err(_) => break,
            }
        }
    });
}

/// Frees lapsed holds every 100 ms while the engine lives.
fn spawn_sweeper(engine: &Arc<Engine>) {
    let sweeper = Arc::downgrade(engine);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Some(e) = sweeper.upgrade() else { break };
            e.sweep(Instant::now());
        }
    });
}
