//! The router's shared state ([`AppState`]): config, engine registry and
//! health, the conversation store, thresholds, metrics, load book, pull
//! alarms and the models served; built from a config and an injected
//! clock. The HTTP shell ([`crate::server`]) and the router's own
//! endpoints ([`crate::admin`]) act on it.
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use lru::LruCache;
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use tracing::{debug, info, warn};
use xxhash_rust::xxh3::xxh3_64;

use crate::alarms::{AlarmChange, MissingParams, PullOutcome, PullTracker, WarnLimiter};
use crate::clock::Clock;
use crate::config::{PrefixCheckMode, RouterConfig};
use crate::explain::{RecentRoutes, RouteRecord};
use crate::health::{Check, Health};
use crate::metrics::{EngineLabel, Metrics, ModeLabel, PairLabels, PullLabels, SelectionLabels};
use crate::registry::{Registry, Role};
use crate::retention::{Job, Retention};
use crate::select::load::LoadBook;
use crate::store::{ConvKey, Lookup, Store, StoredTurn};
use crate::thresholds::ThresholdTable;
use crate::upstream::Upstream;

/// Shared state of a running router.
pub struct AppState {
    pub(crate) cfg: RouterConfig,
    pub(crate) registry: Registry,
    pub(crate) healthy: Vec<AtomicBool>,
    /// Consecutive failed health checks per engine ([`crate::health`]).
    health_failures: Vec<std::sync::atomic::AtomicU32>,
    pub(crate) store: Arc<Store>,
    /// Expiry times of stored keys (hash of the key → ms), so a turn whose
    /// entry the sweeper (or Redis' own TTL) already dropped is counted
    /// `expired`, not `no_entry`.
    expiries: Mutex<LruCache<u64, u64>>,
    pub(crate) thresholds: Mutex<ThresholdTable>,
    /// Metrics.
    pub metrics: Metrics,
    pub(crate) upstream: Upstream,
    clock: Arc<dyn Clock>,
    pub(crate) rr_prefill: AtomicUsize,
    pub(crate) rr_decode: AtomicUsize,
    /// Round-robin counter of the selection (`policy = "predicted_ttft"`),
    /// one step per routed turn. Not `rr_prefill`: that one also steps for
    /// the `/tokenize` pick, so with two prefill engines the selection's
    /// round robin (its fallback without models) always landed on the same
    /// one.
    pub(crate) rr_select: AtomicUsize,
    /// This replica's rank among the replicas that share their load,
    /// `rank << 32 | count` (`crate::select::share::replica_rank`), set by
    /// each load exchange; 0 before one (or without sharing). Where the
    /// selection's round robin starts ([`AppState::rr_offset`]).
    replica_rank: AtomicU64,
    /// Outstanding prefill tokens and in-flight decode streams per engine
    /// (`policy = "predicted_ttft"`).
    pub(crate) load: Arc<LoadBook>,
    tokenize_ok: AtomicBool,
    /// After a failed `/tokenize`, no new attempt before this time (ms).
    tokenize_retry_at_ms: AtomicU64,
    pub(crate) request_seq: AtomicU64,
    pub(crate) prefill_idx: Vec<u16>,
    pub(crate) decode_idx: Vec<u16>,
    pub(crate) pulls: Mutex<PullTracker>,
    pub(crate) missing_params: Mutex<MissingParams>,
    /// Warnings about decode params not stored, one limiter per
    /// `kvloop_router_params_rejected_total` reason.
    pub(crate) rejected_params_warn: Mutex<HashMap<&'static str, WarnLimiter>>,
    /// Model ids the engines serve (empty: not known yet, nothing refused).
    models: RwLock<HashSet<String>>,
    /// The last routed turns (`GET /admin/routes`).
    pub(crate) routes: Mutex<RecentRoutes>,
    /// Decode-side retention: agents, followed holds, gaps (issue 15).
    pub(crate) retention: Mutex<Retention>,
    /// When this router started, ms on its clock (`warmup_ms`).
    started_ms: u64,
    /// An agent's threshold push was applied since start (`warmup_ms`).
    pub(crate) thresholds_pushed: AtomicBool,
    /// Where retention decisions go to be sent (set by
    /// [`crate::retention_task::spawn`]; unset: counted as dropped).
    pub(crate) retention_jobs: std::sync::OnceLock<tokio::sync::mpsc::Sender<Job>>,
}

/// Errors building the router.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Config.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Registry.
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    /// HTTP client.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
    /// Conversation store.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Back-off after a failed `/tokenize` (the history check is used meanwhile), ms.
const TOKENIZE_RETRY_MS: u64 = 30_000;

fn key_hash(k: &ConvKey) -> u64 {
    xxh3_64(format!("{k:?}").as_bytes())
}

impl AppState {
    /// Build the state from a config and a clock.
    ///
    /// # Errors
    /// Invalid config or registry.
    pub fn new(cfg: RouterConfig, clock: Box<dyn Clock>) -> Result<Arc<Self>, BuildError> {
        cfg.validate()?;
        let clock: Arc<dyn Clock> = Arc::from(clock);
        let registry = Registry::new(cfg.engines.clone())?;
        let client = |max_idle: usize| {
            reqwest::Client::builder()
                .http1_only()
                .tcp_nodelay(true)
                .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
                .pool_max_idle_per_host(max_idle)
                .pool_idle_timeout(Duration::from_millis(cfg.upstream_idle_timeout_ms))
                .build()
        };
        let (http, fresh) = (client(1024)?, client(0)?);
        let metrics = Metrics::new();
        for e in registry.engines() {
            metrics
                .engine_healthy
                .get_or_create(&EngineLabel {
                    engine_id: e.engine_id.clone(),
                })
                .set(1);
        }
        let capacity = std::num::NonZeroUsize::new(cfg.store_capacity).expect("validated");
        let store = Store::from_config(
            &cfg,
            registry
                .engines()
                .iter()
                .map(|e| e.engine_id.clone())
                .collect(),
            &metrics,
        )?;
        let state = AppState {
            healthy: registry
                .engines()
                .iter()
                .map(|_| AtomicBool::new(true))
                .collect(),
            health_failures: registry
                .engines()
                .iter()
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            prefill_idx: registry.with_role(Role::Prefill),
            decode_idx: registry.with_role(Role::Decode),
            store: Arc::new(store),
            expiries: Mutex::new(LruCache::new(capacity)),
            thresholds: Mutex::new(ThresholdTable::new(cfg.kv_recompute_threshold)),
            metrics,
            upstream: Upstream { http, fresh },
            clock: clock.clone(),
            rr_prefill: AtomicUsize::new(0),
            rr_decode: AtomicUsize::new(0),
            rr_select: AtomicUsize::new(0),
            replica_rank: AtomicU64::new(0),
            started_ms: clock.now_ms(),
            load: LoadBook::new(registry.engines().len(), clock),
            tokenize_ok: AtomicBool::new(true),
            tokenize_retry_at_ms: AtomicU64::new(0),
            request_seq: AtomicU64::new(0),
            pulls: Mutex::new(PullTracker::default()),
            missing_params: Mutex::new(MissingParams::default()),
            rejected_params_warn: Mutex::new(HashMap::new()),
            models: RwLock::new(HashSet::new()),
            routes: Mutex::new(RecentRoutes::default()),
            retention: Mutex::new(Retention::new(cfg.retention)),
            retention_jobs: std::sync::OnceLock::new(),
            thresholds_pushed: AtomicBool::new(false),
            registry,
            cfg,
        };
        state.publish_prefix_mode();
        Ok(Arc::new(state))
    }

    /// Warm-up left, ms: `Some` while `/health` answers `warming`
    /// ([`crate::warmup::warmup_left_ms`]).
    pub(crate) fn warmup_left_ms(&self) -> Option<u64> {
        crate::warmup::warmup_left_ms(
            self.now_ms(),
            self.started_ms,
            self.cfg.warmup_ms,
            self.thresholds_pushed.load(Ordering::Relaxed),
        )
    }

    /// The prefix check in force: `tokens` while the engine's `/tokenize`
    /// works (and configured), else `history`.
    pub fn prefix_check_in_force(&self) -> PrefixCheckMode {
        if self.cfg.prefix_check == PrefixCheckMode::Tokens
            && self.tokenize_ok.load(Ordering::Relaxed)
        {
            PrefixCheckMode::Tokens
        } else {
            PrefixCheckMode::History
        }
    }

    fn publish_prefix_mode(&self) {
        let m = self.prefix_check_in_force();
        for mode in [PrefixCheckMode::Tokens, PrefixCheckMode::History] {
            self.metrics
                .prefix_check_mode
                .get_or_create(&ModeLabel {
                    mode: mode.as_str(),
                })
                .set(i64::from(mode == m));
        }
    }

    fn set_tokenize_ok(&self, ok: bool) {
        if self.tokenize_ok.swap(ok, Ordering::Relaxed) != ok {
            if ok {
                info!("engine /tokenize works again: prefix check by tokens");
            } else {
                warn!("engine /tokenize failed: prefix check falls back to message history");
            }
            self.publish_prefix_mode();
        }
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Stored conversations.
    pub fn store_len(&self) -> usize {
        self.store.len_or_zero()
    }

    /// Sets this replica's `(rank, count)` among the replicas that share.
    pub(crate) fn set_replica_rank(&self, (rank, count): (u64, u64)) {
        let packed = (rank.min(u64::from(u32::MAX)) << 32) | count.min(u64::from(u32::MAX));
        self.replica_rank.store(packed, Ordering::Relaxed);
    }

    /// This replica's `(rank, count)` among the replicas that share their
    /// load; `None` before the first exchange or without sharing.
    pub fn replica_rank(&self) -> Option<(u64, u64)> {
        let v = self.replica_rank.load(Ordering::Relaxed);
        (v != 0).then_some((v >> 32, v & u64::from(u32::MAX)))
    }

    /// Where the selection's round robin starts over the prefill engines
    /// ([`crate::select::share::tie_offset`] of this replica's rank; 0
    /// alone). The same counter breaks the decode engines' ties, so they
    /// start apart too where there are as many of them as prefill
    /// engines or more.
    pub(crate) fn rr_offset(&self) -> u64 {
        self.replica_rank().map_or(0, |r| {
            crate::select::share::tie_offset(r, self.prefill_idx.len())
        })
    }

    pub(crate) fn pick(&self, idx: &[u16], rr: &AtomicUsize) -> Option<u16> {
        if idx.is_empty() {
            return None;
        }
        let start = rr.fetch_add(1, Ordering::Relaxed);
        (0..idx.len())
            .map(|k| idx[(start + k) % idx.len()])
            .find(|&i| self.healthy[i as usize].load(Ordering::Relaxed))
    }

    /// Drop expired store entries now.
    pub fn sweep(&self) {
        self.store.sweep_now(self.now_ms());
    }

    /// Take (single use) the stored turn of `key` at `now`. An entry the
    /// sweeper already dropped at its TTL is still reported `Expired`.
    /// The store updates `store_entries` and its error counts itself.
    pub(crate) async fn take_turn(&self, key: &ConvKey, now: u64) -> Lookup {
        let expiry = self.expiries.lock().pop(&key_hash(key));
        match self.store.take_or_missing(key, now).await {
            Lookup::Missing if expiry.is_some_and(|t| t <= now) => Lookup::Expired,
            l => l,
        }
    }

    /// Store a finished turn, before the client's answer ends: with a
    /// shared store (Redis) the conversation's next turn may reach another
    /// replica as soon as the client has the answer, and must find the
    /// turn there. Bounded by `store_timeout_ms`; a failure is counted and
    /// the next turn recomputes. The store counts its evictions and updates
    /// `store_entries` itself.
    pub(crate) async fn store_turn(&self, key: ConvKey, turn: StoredTurn, prefill_engine: u16) {
        let now = self.now_ms();
        let h = key_hash(&key);
        self.retention_stored(&key, &turn, prefill_engine, now);
        self.store.insert_or_count(key, turn, now).await;
        self.expiries
            .lock()
            .put(h, now.saturating_add(self.cfg.store_ttl_ms()));
    }

    /// Count a routed turn (`kvloop_router_selections_total`, the margin
    /// histogram) and keep it for `GET /admin/routes`.
    pub(crate) fn record_route(&self, r: RouteRecord) {
        self.metrics
            .selections
            .get_or_create(&SelectionLabels {
                policy: r.policy.clone(),
                reason: r.reason.clone(),
                prefill_engine_id: r.prefill_engine_id.clone(),
                decode_engine_id: r.decode_engine_id.clone(),
                action: r.action.clone(),
            })
            .inc();
        if let Some(m) = r.margin_ms() {
            self.metrics
                .selection_margin_seconds
                .observe(m.max(0.0) / 1e3);
        }
        self.routes.lock().push(r);
    }

    pub(crate) fn engine_id(&self, i: u16) -> String {
        self.registry
            .get(i)
            .map(|e| e.engine_id.clone())
            .unwrap_or_default()
    }

    /// Record what became of a pull from D `d` to P `p`.
    pub(crate) fn record_pull(&self, p: u16, d: u16, outcome: PullOutcome) {
        let (pe, de) = (self.engine_id(p), self.engine_id(d));
        self.metrics
            .pulls
            .get_or_create(&PullLabels {
                prefill_engine_id: pe.clone(),
                decode_engine_id: de.clone(),
                outcome: outcome.as_str(),
            })
            .inc();
        let change = self.pulls.lock().record(p, d, outcome);
        let gauge = |v| {
            self.metrics
                .pull_alarm
                .get_or_create(&PairLabels {
                    prefill_engine_id: pe.clone(),
                    decode_engine_id: de.clone(),
                })
                .set(v)
        };
        match change {
            Some(AlarmChange::Raised(n)) => {
                gauge(1);
                warn!(prefill = %pe, decode = %de, consecutive_failures = n, "pulls of this pair keep failing: P declines or fails the READs of D's blocks and recomputes every turn (check D's side-channel host in the registry and the agents)");
            }
            Some(AlarmChange::Cleared) => {
                gauge(0);
                info!(prefill = %pe, decode = %de, "pulls of this pair succeed again");
            }
            Some(AlarmChange::Unchanged) | None => {}
        }
    }

    /// `/tokenize` on engine `i` with `body` (JSON bytes, from
    /// [`crate::request::tokenize_body`] or
    /// [`crate::request::tokenize_text_body`]) within `timeout`: the token
    /// ids, or `None`
    /// (after a failure the history check is used for [`TOKENIZE_RETRY_MS`]).
    pub(crate) async fn tokenize_on(
        &self,
        i: u16,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Option<Vec<u32>> {
        if self.now_ms() < self.tokenize_retry_at_ms.load(Ordering::Relaxed) {
            return None;
        }
        let e = self.registry.get(i)?;
        let tokens = match self
            .upstream
            .tokenize(&e.engine_id, &e.urls.tokenize, body, timeout)
            .await
        {
            Ok(t) => Some(t),
            Err(err) => {
                debug!(error = %err, "tokenize failed");
                self.tokenize_retry_at_ms
                    .store(self.now_ms() + TOKENIZE_RETRY_MS, Ordering::Relaxed);
                None
            }
        };
        self.set_tokenize_ok(tokens.is_some());
        tokens
    }

    /// `GET <path>` of engine `i` within `health_timeout_ms`: the body,
    /// when it answers 2xx.
    pub(crate) async fn engine_get(&self, i: u16, path: &str) -> Option<Bytes> {
        let e = self.registry.get(i)?;
        let r = self
            .upstream
            .http
            .get(format!("{}{path}", e.http_url))
            .timeout(Duration::from_millis(self.cfg.health_timeout_ms))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.bytes().await.ok()
    }

    /// `GET /v1/models` of engine `i`, when it answers 2xx.
    pub(crate) async fn fetch_models(&self, i: u16) -> Option<Bytes> {
        self.engine_get(i, "/v1/models").await
    }

    /// The `version` of the first healthy engine that serves `/version`.
    pub(crate) async fn fetch_version(&self) -> Option<Value> {
        for &i in self.decode_idx.iter().chain(self.prefill_idx.iter()) {
            let e = self.registry.get(i)?;
            if !self.healthy[i as usize].load(Ordering::Relaxed) {
                continue;
            }
            let Ok(r) = self
                .upstream
                .http
                .get(format!("{}/version", e.http_url))
                .timeout(Duration::from_millis(self.cfg.health_timeout_ms))
                .send()
                .await
            else {
                continue;
            };
            if let Ok(v) = r.json::<Value>().await
                && let Some(ver) = v.get("version")
            {
                return Some(ver.clone());
            }
        }
        None
    }

    /// Replace the known model ids (from the engines' `/v1/models`).
    pub(crate) fn set_models(&self, ids: Vec<String>) {
        if !ids.is_empty() {
            *self.models.write() = ids.into_iter().collect();
        }
    }

    pub(crate) fn serves_model(&self, model: &str) -> bool {
        let m = self.models.read();
        m.is_empty() || m.contains(model)
    }

    /// Check every engine's `/health` once (and learn the models served).
    pub async fn check_health(&self) {
        let mut answers = Vec::new();
        for (i, e) in self.registry.engines().iter().enumerate() {
            let check = match self
                .upstream
                .http
                .get(format!("{}/health", e.http_url))
                .timeout(Duration::from_millis(self.cfg.health_timeout_ms))
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => Check::Ok,
                Err(e) if e.is_connect() && !e.is_timeout() => Check::Refused,
                _ => Check::Failed,
            };
            let before = Health {
                healthy: self.healthy[i].load(Ordering::Relaxed),
                failures: self.health_failures[i].load(Ordering::Relaxed),
            };
            let after = before.after(check, self.cfg.health_failure_threshold);
            self.health_failures[i].store(after.failures, Ordering::Relaxed);
            let ok = after.healthy;
            if check == Check::Failed && ok {
                debug!(engine = %e.engine_id, failures = after.failures, "health check failed; still routed until health_failure_threshold");
            }
            if self.healthy[i].swap(ok, Ordering::Relaxed) != ok {
                if ok {
                    info!(engine = %e.engine_id, "engine healthy");
                } else {
                    warn!(engine = %e.engine_id, "engine unhealthy");
                }
            }
            self.metrics
                .engine_healthy
                .get_or_create(&EngineLabel {
                    engine_id: e.engine_id.clone(),
                })
                .set(i64::from(ok));
            if check == Check::Ok
                && let Some(b) = self.fetch_models(i as u16).await
            {
                answers.push(b);
            }
        }
        self.set_models(crate::models::merge_models(&answers).1);
    }
}
