//! The HTTP shell: the router's state, the axum app, and one request's walk
//! (parse → decide → prefill → decode → relay). Parsing and body rewrites
//! are in [`crate::request`], engine calls in [`crate::upstream`], the relay
//! and the storing of turns in [`crate::relay`], the router's own endpoints
//! in [`crate::admin`]. Decisions are made by the pure modules.
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use kvloop_router_api::THRESHOLDS_PATH;
use lru::LruCache;
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use tracing::{debug, info, warn};
use xxhash_rust::xxh3::xxh3_64;

use crate::alarms::{AlarmChange, MissingParams, PullOutcome, PullTracker};
use crate::clock::Clock;
use crate::config::{Policy, PrefixCheckMode, RouterConfig};
use crate::decision::{PromptInfo, decide};
use crate::error::RouteError;
use crate::fingerprint::{History, HistoryHasher, hash_tokens};
use crate::metrics::{
    EngineLabel, Metrics, ModeLabel, PairLabels, PullLabels, ReasonLabel, RequestLabels,
};
use crate::prefill::{params_for_decode, prefill};
use crate::registry::{Registry, Role};
use crate::relay::{Relay, StoreCtx};
use crate::request::{Api, decode_body, parse_request, tokenize_body};
use crate::select::load::LoadBook;
use crate::sse::rewrite_body;
use crate::store::{ConvKey, Lookup, Store, StoredTurn};
use crate::thresholds::ThresholdTable;
use crate::upstream::{Failure, Stage, Upstream, UpstreamError};

/// Shared state of a running router.
pub struct AppState {
    pub(crate) cfg: RouterConfig,
    pub(crate) registry: Registry,
    pub(crate) healthy: Vec<AtomicBool>,
    pub(crate) store: Arc<Store>,
    /// Expiry times of stored keys (hash of the key → ms), so a turn whose
    /// entry the sweeper (or Redis' own TTL) already dropped is counted
    /// `expired`, not `no_entry`.
    expiries: Mutex<LruCache<u64, u64>>,
    pub(crate) thresholds: Mutex<ThresholdTable>,
    /// Metrics.
    pub metrics: Metrics,
    pub(crate) upstream: Upstream,
    clock: Box<dyn Clock>,
    pub(crate) rr_prefill: AtomicUsize,
    rr_decode: AtomicUsize,
    /// Outstanding prefill tokens and in-flight decode streams per engine
    /// (`policy = "predicted_ttft"`).
    pub(crate) load: Arc<LoadBook>,
    tokenize_ok: AtomicBool,
    /// After a failed `/tokenize`, no new attempt before this time (ms).
    tokenize_retry_at_ms: AtomicU64,
    request_seq: AtomicU64,
    pub(crate) prefill_idx: Vec<u16>,
    pub(crate) decode_idx: Vec<u16>,
    pub(crate) pulls: Mutex<PullTracker>,
    pub(crate) missing_params: Mutex<MissingParams>,
    /// Model ids the engines serve (empty: not known yet, nothing refused).
    models: RwLock<HashSet<String>>,
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
        let registry = Registry::new(cfg.engines.clone())?;
        let http = reqwest::Client::builder()
            .http1_only()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
            .pool_max_idle_per_host(1024)
            .build()?;
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
            prefill_idx: registry.with_role(Role::Prefill),
            decode_idx: registry.with_role(Role::Decode),
            store: Arc::new(store),
            expiries: Mutex::new(LruCache::new(capacity)),
            thresholds: Mutex::new(ThresholdTable::new(cfg.kv_recompute_threshold)),
            metrics,
            upstream: Upstream { http },
            clock,
            rr_prefill: AtomicUsize::new(0),
            rr_decode: AtomicUsize::new(0),
            load: LoadBook::new(registry.engines().len()),
            tokenize_ok: AtomicBool::new(true),
            tokenize_retry_at_ms: AtomicU64::new(0),
            request_seq: AtomicU64::new(0),
            pulls: Mutex::new(PullTracker::default()),
            missing_params: Mutex::new(MissingParams::default()),
            models: RwLock::new(HashSet::new()),
            registry,
            cfg,
        };
        state.publish_prefix_mode();
        Ok(Arc::new(state))
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
    async fn take_turn(&self, key: &ConvKey, now: u64) -> Lookup {
        let expiry = self.expiries.lock().pop(&key_hash(key));
        match self.store.take_or_missing(key, now).await {
            Lookup::Missing if expiry.is_some_and(|t| t <= now) => Lookup::Expired,
            l => l,
        }
    }

    /// Store a finished turn.
    /// The store counts its evictions and updates `store_entries` itself.
    pub(crate) fn store_turn(&self, key: ConvKey, turn: StoredTurn) {
        let now = self.now_ms();
        let h = key_hash(&key);
        self.store.insert_detached(key, turn, now);
        self.expiries
            .lock()
            .put(h, now.saturating_add(self.cfg.store_ttl_ms()));
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

    /// `/tokenize` on engine `i` within `timeout`: the token ids, or `None`
    /// (after a failure the history check is used for [`TOKENIZE_RETRY_MS`]).
    pub(crate) async fn tokenize_on(
        &self,
        i: u16,
        body: &Value,
        timeout: Duration,
    ) -> Option<Vec<u32>> {
        if self.now_ms() < self.tokenize_retry_at_ms.load(Ordering::Relaxed) {
            return None;
        }
        let e = self.registry.get(i)?;
        let tokens = match self
            .upstream
            .tokenize(&e.engine_id, &e.http_url, body, timeout)
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

    /// `GET /v1/models` of engine `i`, when it answers 2xx.
    pub(crate) async fn fetch_models(&self, i: u16) -> Option<Bytes> {
        let e = self.registry.get(i)?;
        let r = self
            .upstream
            .http
            .get(format!("{}/v1/models", e.http_url))
            .timeout(Duration::from_millis(self.cfg.health_timeout_ms))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.bytes().await.ok()
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

    fn serves_model(&self, model: &str) -> bool {
        let m = self.models.read();
        m.is_empty() || m.contains(model)
    }

    /// Check every engine's `/health` once (and learn the models served).
    pub async fn check_health(&self) {
        let mut answers = Vec::new();
        for (i, e) in self.registry.engines().iter().enumerate() {
            let ok = matches!(
                self.upstream.http
                    .get(format!("{}/health", e.http_url))
                    .timeout(Duration::from_millis(self.cfg.health_timeout_ms))
                    .send()
                    .await,
                Ok(r) if r.status().is_success()
            );
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
            if ok && let Some(b) = self.fetch_models(i as u16).await {
                answers.push(b);
            }
        }
        self.set_models(crate::admin::merge_models(&answers).1);
    }
}

/// Build the axum app for a state.
pub fn app(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(crate::admin::models))
        .route("/version", get(crate::admin::version))
        .route("/health", get(crate::admin::health))
        .route("/metrics", get(crate::admin::metrics))
        .route(
            THRESHOLDS_PATH,
            put(crate::admin::put_thresholds).get(crate::admin::get_thresholds),
        )
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Spawn the background tasks (health checks, store sweeping) for `state`;
/// they end when the state is dropped.
pub fn spawn_background(state: &Arc<AppState>) {
    let weak = Arc::downgrade(state);
    let period = Duration::from_millis(state.cfg.health_interval_ms.max(10));
    tokio::spawn(async move {
        loop {
            let Some(s) = weak.upgrade() else { break };
            s.check_health().await;
            s.sweep();
            drop(s);
            tokio::time::sleep(period).await;
        }
    });
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    route(s, Api::Completions, headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    route(s, Api::Chat, headers, body).await
}

async fn route(s: Arc<AppState>, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let (outcome, resp) = match route_inner(&s, api, &headers, body).await {
        Ok(r) => ("ok", r),
        Err(e) => (e.outcome(), e.into_response()),
    };
    s.metrics
        .requests
        .get_or_create(&RequestLabels {
            endpoint: api.label(),
            outcome,
        })
        .inc();
    resp
}

async fn route_inner(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    raw: Bytes,
) -> Result<Response, RouteError> {
    let t0 = Instant::now();
    let req = parse_request(
        api,
        headers,
        &raw,
        &s.cfg.tenant_header,
        &s.cfg.default_tenant,
    )?;
    if let Some(m) = &req.model
        && !s.serves_model(m)
    {
        return Err(RouteError::ModelNotFound(m.clone()));
    }
    let p_idx = s
        .pick(&s.prefill_idx, &s.rr_prefill)
        .ok_or(RouteError::Unavailable("prefill"))?;
    let mut d_idx = s
        .pick(&s.decode_idx, &s.rr_decode)
        .ok_or(RouteError::Unavailable("decode"))?;
    let request_id = req.request_id.clone().unwrap_or_else(|| {
        format!(
            "kvloop-{}-{}",
            s.now_ms(),
            s.request_seq.fetch_add(1, Ordering::Relaxed)
        )
    });

    // What the router knows of the prompt.
    let tokens: Option<Vec<u32>> = match &req.prompt_token_ids {
        Some(t) => Some(t.clone()),
        None if (req.conversation_id.is_some() || s.cfg.tokenize_every_request)
            && s.cfg.prefix_check == PrefixCheckMode::Tokens =>
        {
            match tokenize_body(api, &req.body) {
                Some(b) => {
                    let timeout = Duration::from_millis(s.cfg.prefill_timeout_ms);
                    s.tokenize_on(p_idx, &b, timeout).await
                }
                None => None,
            }
        }
        None => None,
    };
    let history = req.history();

    // Decision (single use: the entry leaves the store here).
    let key = req
        .conversation_id
        .as_deref()
        .map(|c| ConvKey::new(&req.tenant, c));
    let now = s.now_ms();
    let lookup = match &key {
        Some(k) => s.take_turn(k, now).await,
        None => Lookup::Missing,
    };
    // The P whose `/tokenize` counted the prompt (also counts the reply).
    let tokenize_idx = p_idx;
    let mut p_idx = p_idx;
    let decision = {
        let th = s.thresholds.lock();
        let info = PromptInfo {
            tokens: tokens.as_deref(),
            history,
        };
        if s.cfg.policy == Policy::PredictedTtft {
            let rr = s.rr_prefill.fetch_add(1, Ordering::Relaxed) as u64;
            let healthy = |i: u16| s.healthy[i as usize].load(Ordering::Relaxed);
            let pl = crate::select::route::place_with_load(
                s.cfg.policy,
                lookup,
                &info,
                &s.registry,
                &th,
                &s.prefill_idx,
                &s.decode_idx,
                healthy,
                &s.load,
                rr,
                now,
            )
            .map_err(|e| RouteError::Unavailable(e.role))?;
            debug!(%request_id, selection = %pl.selection.explain(|i| s.engine_id(i)), "selection");
            (p_idx, d_idx) = (pl.selection.prefill, pl.selection.decode);
            pl.decision
        } else {
            decide(lookup, &info, &s.engine_id(p_idx), &s.registry, &th, now)
        }
    };
    let p_engine_id = s.engine_id(p_idx);
    let decode_load = s.load.begin_decode(d_idx);
    s.metrics
        .decisions
        .get_or_create(&ReasonLabel {
            reason: decision.reason.as_str(),
        })
        .inc();
    debug!(%request_id, reason = decision.reason.as_str(), reused = decision.reused_tokens, prefill = %p_engine_id, decode = %s.engine_id(d_idx), "decision");

    // What to store after the turn.
    let ctx = key.map(|key| {
        let mut hist = HistoryHasher::default();
        match history {
            History::Chat(m) => m.iter().for_each(|m| hist.message(m)),
            History::Text(t) => hist.text(t),
            History::None => {}
        }
        StoreCtx {
            state: s.clone(),
            key,
            decode_engine: d_idx,
            prefill_engine: tokenize_idx,
            tokens: tokens.as_ref().map(|t| (t.len() as u32, hash_tokens(t))),
            history: (!matches!(history, History::None)).then_some(hist),
            api,
            model: req.model.clone(),
            hidden_output: req.hidden_output,
            stop_str_hidden: req.stop_str_hidden,
        }
    });

    let n_prompt = tokens.as_ref().map(Vec::len);
    let _prefill_load = s.load.begin_prefill(
        p_idx,
        (n_prompt.unwrap_or(0) as u64).saturating_sub(decision.reused_tokens),
    );
    let (p_idx, p_reply) = prefill(s, &req, p_idx, &decision, n_prompt, &request_id)
        .await
        .inspect_err(|e| warn!(%request_id, error = %e, "prefill failed"))?;
    let d_params = params_for_decode(s, p_idx, p_reply)?;

    // Decode request: the client's body with P's params. Never resent to another D.
    let d = s.registry.get(d_idx).expect("index");
    let d_resp = s
        .upstream
        .decode(
            &d.engine_id,
            &d.http_url,
            api,
            &request_id,
            decode_body(&req.body, &d_params),
            Duration::from_millis(s.cfg.decode_timeout_ms),
        )
        .await
        .inspect_err(|e| warn!(%request_id, error = %e, "decode failed; P's params are not resent to another decode engine"))?;

    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header("x-request-id", &request_id);
    if let Some(ct) = d_resp.headers().get(header::CONTENT_TYPE) {
        builder = builder.header(header::CONTENT_TYPE, ct.clone());
    }
    if req.stream {
        let relay = Relay::new(
            Box::pin(d_resp.bytes_stream()),
            ctx,
            t0,
            s.clone(),
            decode_load,
        );
        return Ok(builder
            .body(Body::from_stream(relay))
            .expect("valid response"));
    }
    let bytes = d_resp.bytes().await.map_err(|e| {
        UpstreamError::new(
            Stage::Decode,
            &d.engine_id,
            Failure::Transport,
            e.to_string(),
        )
    })?;
    s.metrics.ttft_seconds.observe(t0.elapsed().as_secs_f64());
    let (summary, rewritten) = rewrite_body(&bytes);
    if let Some(ctx) = ctx {
        ctx.finish(summary, false).await;
    }
    let body = rewritten.map_or(Body::from(bytes), Body::from);
    Ok(builder.body(body).expect("valid response"))
}
