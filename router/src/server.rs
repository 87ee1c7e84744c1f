//! The HTTP shell: axum handlers, engine calls (reqwest, HTTP/1.1 keep-alive),
//! SSE relay, health checks. Decisions are made by the pure modules.
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures_util::Stream;
use kvloop_router_api::{THRESHOLDS_PATH, TOKENS_HEADER, ThresholdUpdate};
use serde_json::{Map, Value, json};
use tracing::{debug, info, warn};

use crate::config::{Policy, PrefixCheckMode, RouterConfig};
use crate::decision::{PromptInfo, decide};
use crate::fingerprint::{Fingerprint, History, HistoryHasher, hash_tokens};
use crate::metrics::{EngineLabel, Metrics, ModeLabel, ReasonLabel, RequestLabels};
use crate::params::{KvParams, no_reuse_prefill_params};
use crate::registry::{Registry, Role};
use crate::sse::{ReplySummary, StreamInspector};
use crate::store::{ConvKey, Lookup, Store, StoredTurn};
use crate::thresholds::{ApplyOutcome, ThresholdTable};

/// The router's clock: milliseconds on a monotonic clock. Injected so tests
/// can move time without sleeping.
pub trait Clock: Send + Sync + 'static {
    /// Now, ms.
    fn now_ms(&self) -> u64;
}

/// Real monotonic clock (ms since creation).
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// A clock tests set by hand.
#[derive(Default)]
pub struct ManualClock(pub AtomicU64);

impl ManualClock {
    /// Move forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<T: Clock> Clock for Arc<T> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

/// Shared state of a running router.
pub struct AppState {
    cfg: RouterConfig,
    registry: Registry,
    healthy: Vec<AtomicBool>,
    store: Arc<Store>,
    thresholds: Mutex<ThresholdTable>,
    /// Metrics.
    pub metrics: Metrics,
    http: reqwest::Client,
    clock: Box<dyn Clock>,
    rr_prefill: AtomicUsize,
    rr_decode: AtomicUsize,
    load: Arc<crate::select::load::LoadBook>,
    tokenize_ok: AtomicBool,
    /// After a failed `/tokenize`, no new attempt before this time (ms).
    tokenize_retry_at_ms: AtomicU64,
    request_seq: AtomicU64,
    prefill_idx: Vec<u16>,
    decode_idx: Vec<u16>,
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
        let state = AppState {
            healthy: registry
                .engines()
                .iter()
                .map(|_| AtomicBool::new(true))
                .collect(),
            prefill_idx: registry.with_role(Role::Prefill),
            decode_idx: registry.with_role(Role::Decode),
            store: Arc::new(Store::from_config(
                &cfg,
                registry
                    .engines()
                    .iter()
                    .map(|e| e.engine_id.clone())
                    .collect(),
                &metrics,
            )?),
            thresholds: Mutex::new(ThresholdTable::new(cfg.kv_recompute_threshold)),
            metrics,
            http,
            clock,
            rr_prefill: AtomicUsize::new(0),
            rr_decode: AtomicUsize::new(0),
            load: crate::select::load::LoadBook::new(registry.engines().len()),
            tokenize_ok: AtomicBool::new(true),
            tokenize_retry_at_ms: AtomicU64::new(0),
            request_seq: AtomicU64::new(0),
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

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Stored conversations.
    pub fn store_len(&self) -> usize {
        self.store.len_or_zero()
    }

    fn pick(&self, idx: &[u16], rr: &AtomicUsize) -> Option<u16> {
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

    /// Check every engine's `/health` once.
    pub async fn check_health(&self) {
        for (i, e) in self.registry.engines().iter().enumerate() {
            let ok = matches!(
                self.http
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
        }
    }
}

/// Build the axum app for a state.
pub fn app(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route(THRESHOLDS_PATH, put(put_thresholds).get(get_thresholds))
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

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Api {
    Completions,
    Chat,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat_completions",
        }
    }
}

fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "upstream_error"
    };
    (
        status,
        Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}})),
    )
        .into_response()
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
        Err((outcome, r)) => (outcome, r),
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

type RouteResult = Result<Response, (&'static str, Response)>;

fn client_err(msg: impl Into<String>) -> (&'static str, Response) {
    ("client_error", error_response(StatusCode::BAD_REQUEST, msg))
}

/// Everything known about the prompt for the decision and for storing the turn.
struct PromptFacts {
    tokens: Option<Vec<u32>>,
}

/// Back-off after a failed `/tokenize` (the history check is used meanwhile), ms.
const TOKENIZE_RETRY_MS: u64 = 30_000;

async fn tokenize(
    s: &AppState,
    url: &str,
    api: Api,
    body: &Map<String, Value>,
) -> Option<Vec<u32>> {
    if s.now_ms() < s.tokenize_retry_at_ms.load(Ordering::Relaxed) {
        return None;
    }
    let mut req = Map::new();
    if let Some(m) = body.get("model") {
        req.insert("model".into(), m.clone());
    }
    match api {
        Api::Completions => {
            req.insert("prompt".into(), body.get("prompt")?.clone());
        }
        Api::Chat => {
            for k in [
                "messages",
                "tools",
                "chat_template",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
            ] {
                if let Some(v) = body.get(k) {
                    req.insert(k.into(), v.clone());
                }
            }
        }
    }
    let r = s
        .http
        .post(format!("{url}/tokenize"))
        .timeout(Duration::from_millis(s.cfg.prefill_timeout_ms))
        .json(&req)
        .send()
        .await;
    let tokens = match r {
        Ok(r) if r.status().is_success() => r.json::<Value>().await.ok().and_then(|v| {
            v.get("tokens")?
                .as_array()?
                .iter()
                .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<u32>>>()
        }),
        Ok(r) => {
            debug!(status = %r.status(), "tokenize failed");
            None
        }
        Err(e) => {
            debug!(error = %e, "tokenize failed");
            None
        }
    };
    if tokens.is_none() {
        s.tokenize_retry_at_ms
            .store(s.now_ms() + TOKENIZE_RETRY_MS, Ordering::Relaxed);
    }
    s.set_tokenize_ok(tokens.is_some());
    tokens
}

async fn route_inner(s: &Arc<AppState>, api: Api, headers: &HeaderMap, raw: Bytes) -> RouteResult {
    let t0 = Instant::now();
    let mut body: Map<String, Value> = match serde_json::from_slice::<Value>(&raw) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err(client_err("body: expected a JSON object")),
        Err(e) => return Err(client_err(format!("body: invalid JSON: {e}"))),
    };
    if let Some(p) = body.get("kv_transfer_params") {
        if p.is_null() {
            body.remove("kv_transfer_params");
        } else {
            if let Err(e) = KvParams::parse(p) {
                return Err(client_err(e.to_string()));
            }
            return Err(client_err(
                "kv_transfer_params: set by the router from its conversation store; clients may not supply it",
            ));
        }
    }
    match api {
        Api::Completions if !body.contains_key("prompt") => {
            return Err(client_err("prompt: required"));
        }
        Api::Chat if !body.get("messages").is_some_and(Value::is_array) => {
            return Err(client_err("messages: expected an array of messages"));
        }
        _ => {}
    }
    let conversation_id = match body.remove("conversation_id") {
        Some(Value::String(c)) => Some(c),
        Some(Value::Null) | None => headers
            .get("x-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        Some(_) => return Err(client_err("conversation_id: expected a string")),
    };
    let tenant = headers
        .get(s.cfg.tenant_header.as_str())
        .and_then(|v| v.to_str().ok())
        .unwrap_or(&s.cfg.default_tenant)
        .to_string();
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let unavailable = |role: &str| {
        (
            "unavailable",
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no healthy {role} engine"),
            ),
        )
    };
    let p_idx = s
        .pick(&s.prefill_idx, &s.rr_prefill)
        .ok_or_else(|| unavailable("prefill"))?;
    let mut d_idx = s
        .pick(&s.decode_idx, &s.rr_decode)
        .ok_or_else(|| unavailable("decode"))?;
    let mut p = s.registry.get(p_idx).expect("index");
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| {
            format!(
                "kvloop-{}-{}",
                s.now_ms(),
                s.request_seq.fetch_add(1, Ordering::Relaxed)
            )
        });

    // What the router knows of the prompt.
    let prompt_token_ids: Option<Vec<u32>> = match (api, body.get("prompt")) {
        (Api::Completions, Some(Value::Array(a))) if a.iter().all(Value::is_u64) => a
            .iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => None,
    };
    let facts = PromptFacts {
        tokens: match prompt_token_ids {
            Some(t) => Some(t),
            None if (conversation_id.is_some() || s.cfg.tokenize_every_request)
                && s.cfg.prefix_check == PrefixCheckMode::Tokens =>
            {
                tokenize(s, &p.http_url, api, &body).await
            }
            None => None,
        },
    };
    let history = match (api, body.get("prompt"), body.get("messages")) {
        (Api::Chat, _, Some(Value::Array(m))) => History::Chat(m),
        (Api::Completions, Some(Value::String(t)), _) => History::Text(t),
        _ => History::None,
    };

    // Decision (single use: the entry leaves the store here).
    let key = conversation_id.as_deref().map(|c| ConvKey::new(&tenant, c));
    let now = s.now_ms();
    let lookup = match &key {
        Some(k) => s.store.take_or_missing(k, now).await,
        None => Lookup::Missing,
    };
    let decision = {
        let th = s.thresholds.lock().unwrap();
        let info = PromptInfo {
            tokens: facts.tokens.as_deref(),
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
            .map_err(|e| unavailable(e.role))?;
            debug!(%request_id, selection = %pl.selection.explain(|i| s.registry.get(i).map_or(String::new(), |e| e.engine_id.clone())), "selection");
            (p, d_idx) = (
                s.registry.get(pl.selection.prefill).expect("index"),
                pl.selection.decode,
            );
            pl.decision
        } else {
            decide(lookup, &info, &p.engine_id, &s.registry, &th, now)
        }
    };
    let d = s.registry.get(d_idx).expect("index");
    let _decode_load = s.load.begin_decode(d_idx);
    s.metrics
        .decisions
        .get_or_create(&ReasonLabel {
            reason: decision.reason.as_str(),
        })
        .inc();
    debug!(%request_id, reason = decision.reason.as_str(), reused = decision.reused_tokens, prefill = %p.engine_id, decode = %d.engine_id, "decision");

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
            tokens: facts
                .tokens
                .as_ref()
                .map(|t| (t.len() as u32, hash_tokens(t))),
            history: (!matches!(history, History::None)).then_some(hist),
            api,
        }
    });
    // Prefill request.
    let mut p_body = body.clone();
    p_body.insert("stream".into(), Value::Bool(false));
    p_body.insert("max_tokens".into(), Value::from(1));
    if p_body.contains_key("max_completion_tokens") {
        p_body.insert("max_completion_tokens".into(), Value::from(1));
    }
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        p_body.remove(k);
    }
    let attached = decision.attach.is_some();
    p_body.insert(
        "kv_transfer_params".into(),
        decision
            .attach
            .clone()
            .unwrap_or_else(no_reuse_prefill_params),
    );
    let n_prompt = facts.tokens.as_ref().map(Vec::len);
    let _prefill_load = s.load.begin_prefill(
        s.registry.index_of(&p.engine_id).unwrap_or(u16::MAX),
        (n_prompt.unwrap_or(0) as u64).saturating_sub(decision.reused_tokens),
    );
    let mut p_resp = send_prefill(
        s,
        &p.http_url,
        api,
        &request_id,
        &p_body,
        n_prompt,
        decision.reused_tokens,
    )
    .await;
    if p_resp.is_err() && attached {
        warn!(%request_id, prefill = %p.engine_id, error = %p_resp.as_ref().err().unwrap(), "prefill failed with D's params attached; retrying once without them");
        s.metrics.prefill_retries.inc();
        p_body.insert("kv_transfer_params".into(), no_reuse_prefill_params());
        // Once, without D's params; on the next healthy prefill engine when
        // there is another one (round robin), else the same.
        if let Some(next) = s.pick(&s.prefill_idx, &s.rr_prefill) {
            p = s.registry.get(next).expect("index");
        }
        p_resp = send_prefill(s, &p.http_url, api, &request_id, &p_body, n_prompt, 0).await;
    }
    let p_json = p_resp.map_err(|e| {
        warn!(%request_id, prefill = %p.engine_id, error = %e, "prefill failed");
        (
            "prefill_error",
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("prefill engine {}: {e}", p.engine_id),
            ),
        )
    })?;
    let p_params = p_json.get("kv_transfer_params").filter(|v| !v.is_null()).ok_or_else(|| {
        s.metrics.reject_params("source_prefill");
        (
            "prefill_error",
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("prefill engine {}: kv_transfer_params: missing in its response (is it a kv_producer?)", p.engine_id),
            ),
        )
    })?;
    let p_params = KvParams::parse(p_params).map_err(|e| {
        s.metrics.reject_params("source_prefill");
        (
            "prefill_error",
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("prefill engine {}: {e}", p.engine_id),
            ),
        )
    })?;
    let Some(emitter) = s
        .registry
        .index_of(&p_params.engine_id)
        .and_then(|i| s.registry.get(i))
    else {
        s.metrics.reject_params("unknown_engine");
        return Err((
            "prefill_error",
            error_response(
                StatusCode::BAD_GATEWAY,
                format!(
                    "kv_transfer_params.remote_engine_id: engine {:?} is not in the registry",
                    p_params.engine_id
                ),
            ),
        ));
    };
    let d_params = p_params.to_request_value(&emitter.side_channel_host, false, true);

    // Decode request: the client's body with P's params. Never resent to another D.
    let mut d_body = body;
    d_body.insert("kv_transfer_params".into(), d_params);
    let d_bytes = serde_json::to_vec(&Value::Object(d_body)).expect("serializable");
    let d_req = s
        .http
        .post(format!("{}{}", d.http_url, api.path()))
        .header("x-request-id", &request_id)
        .header(header::CONTENT_TYPE, "application/json")
        .body(d_bytes);
    let d_resp = match tokio::time::timeout(
        Duration::from_millis(s.cfg.decode_timeout_ms),
        d_req.send(),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            warn!(%request_id, decode = %d.engine_id, error = %e, "decode failed; P's params are not resent to another decode engine");
            return Err((
                "decode_error",
                error_response(
                    StatusCode::BAD_GATEWAY,
                    format!("decode engine {}: {e}", d.engine_id),
                ),
            ));
        }
        Err(_) => {
            return Err((
                "decode_error",
                error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("decode engine {}: no response headers in time", d.engine_id),
                ),
            ));
        }
    };
    if !d_resp.status().is_success() {
        let status = d_resp.status();
        let text = d_resp.text().await.unwrap_or_default();
        warn!(%request_id, decode = %d.engine_id, %status, "decode failed; P's params are not resent to another decode engine");
        return Err((
            "decode_error",
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("decode engine {}: HTTP {status}: {text}", d.engine_id),
            ),
        ));
    }

    let content_type = d_resp.headers().get(header::CONTENT_TYPE).cloned();
    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header("x-request-id", &request_id);
    if let Some(ct) = content_type {
        builder = builder.header(header::CONTENT_TYPE, ct);
    }
    if stream {
        let relay = Relay {
            inner: Box::pin(d_resp.bytes_stream()),
            inspect: ctx.is_some(),
            inspector: StreamInspector::default(),
            ctx,
            _decode_load,
            t0,
            first: true,
            state: s.clone(),
        };
        Ok(builder
            .body(Body::from_stream(relay))
            .expect("valid response"))
    } else {
        let bytes = d_resp.bytes().await.map_err(|e| {
            (
                "decode_error",
                error_response(
                    StatusCode::BAD_GATEWAY,
                    format!("decode engine {}: {e}", d.engine_id),
                ),
            )
        })?;
        s.metrics.ttft_seconds.observe(t0.elapsed().as_secs_f64());
        if let Some(ctx) = ctx {
            let mut summary = ReplySummary::default();
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(v) => summary.absorb(&v),
                Err(e) => debug!(error = %e, "decode reply is not JSON"),
            }
            ctx.finish(&summary, false);
        }
        Ok(builder.body(Body::from(bytes)).expect("valid response"))
    }
}

/// Prefill errors (both lead to the retry-once rule when params were attached).
#[derive(Debug, thiserror::Error)]
enum PrefillError {
    #[error("{0}")]
    Transport(#[from] reqwest::Error),
    #[error("HTTP {0}: {1}")]
    Status(StatusCode, String),
    #[error("response body: {0}")]
    Body(String),
}

async fn send_prefill(
    s: &AppState,
    url: &str,
    api: Api,
    request_id: &str,
    body: &Map<String, Value>,
    n_prompt: Option<usize>,
    reused: u64,
) -> Result<Value, PrefillError> {
    let mut req = s
        .http
        .post(format!("{url}{}", api.path()))
        .timeout(Duration::from_millis(s.cfg.prefill_timeout_ms))
        .header("x-request-id", request_id)
        .header(header::CONTENT_TYPE, "application/json")
        .body(serde_json::to_vec(body).expect("serializable"));
    if let Some(n) = n_prompt {
        req = req.header(TOKENS_HEADER, format!("prompt={n},reused={reused}"));
    }
    let r = req.send().await?;
    let status = r.status();
    if !status.is_success() {
        let text = r.text().await.unwrap_or_default();
        return Err(PrefillError::Status(status, text));
    }
    let bytes = r.bytes().await?;
    serde_json::from_slice(&bytes).map_err(|e| PrefillError::Body(e.to_string()))
}

/// What a finished turn needs to be stored.
struct StoreCtx {
    state: Arc<AppState>,
    key: ConvKey,
    decode_engine: u16,
    tokens: Option<(u32, u64)>,
    history: Option<HistoryHasher>,
    api: Api,
}

impl StoreCtx {
    fn skip(&self, reason: &'static str) {
        self.state
            .metrics
            .store_skipped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    fn finish(self, summary: &ReplySummary, streamed: bool) {
        let s = &self.state;
        if !summary.storable(streamed) {
            self.skip(if summary.rewritable_output {
                "rewritable_output"
            } else if streamed && !summary.done {
                "incomplete_stream"
            } else {
                "abnormal_finish"
            });
            return;
        }
        let Some(raw) = &summary.kv_transfer_params else {
            self.skip("no_params");
            return;
        };
        let params = match KvParams::parse(raw) {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "decode engine returned malformed kv_transfer_params; not stored");
                s.metrics.reject_params("source_decode");
                return;
            }
        };
        let Some(idx) = s.registry.index_of(&params.engine_id) else {
            warn!(engine = %params.engine_id, "kv_transfer_params from an unregistered engine; not stored");
            s.metrics.reject_params("unknown_engine");
            return;
        };
        if idx != self.decode_engine {
            warn!(engine = %params.engine_id, "kv_transfer_params name another engine than the decode engine that answered; not stored");
            s.metrics.reject_params("source_decode");
            return;
        }
        let Some(held) = params.num_tokens.and_then(|n| u32::try_from(n).ok()) else {
            self.skip("no_remote_num_tokens");
            return;
        };
        let mut fp = Fingerprint::default();
        if let Some((n, h)) = self.tokens {
            fp.tokens_len = n;
            fp.tokens_hash = h;
        }
        if let Some(mut hist) = self.history {
            match self.api {
                Api::Chat => hist.assistant(&summary.text),
                Api::Completions => hist.text(&summary.text),
            }
            (fp.history_len, fp.history_hash) = hist.finish();
        }
        let turn = StoredTurn {
            params: params.compact(),
            decode_engine: idx,
            remote_num_tokens: held,
            fingerprint: fp,
            expires_at_ms: 0,
        };
        s.store.insert_detached(self.key, turn, s.now_ms());
    }
}

/// Forwards D's SSE bytes unchanged as they arrive, inspecting them on the way.
struct Relay {
    inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    /// Inspect the bytes (only when the turn may be stored).
    inspect: bool,
    inspector: StreamInspector,
    ctx: Option<StoreCtx>,
    _decode_load: crate::select::load::DecodeGuard,
    t0: Instant,
    first: bool,
    state: Arc<AppState>,
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        match this.inner.as_mut().poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(b))) => {
                if this.first {
                    this.first = false;
                    this.state
                        .metrics
                        .ttft_seconds
                        .observe(this.t0.elapsed().as_secs_f64());
                }
                if this.inspect {
                    this.inspector.feed(&b);
                }
                Poll::Ready(Some(Ok(b)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.ctx = None; // broken stream: never stored
                Poll::Ready(Some(Err(std::io::Error::other(e))))
            }
            Poll::Ready(None) => {
                this.inspector.finish();
                if let Some(ctx) = this.ctx.take() {
                    ctx.finish(&this.inspector.summary, true);
                }
                Poll::Ready(None)
            }
        }
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    let order = s.decode_idx.iter().chain(s.prefill_idx.iter());
    for &i in order {
        if !s.healthy[i as usize].load(Ordering::Relaxed) {
            continue;
        }
        let e = s.registry.get(i).expect("index");
        if let Ok(r) = s.http.get(format!("{}/v1/models", e.http_url)).send().await
            && r.status().is_success()
            && let Ok(b) = r.bytes().await
        {
            return (
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                b,
            )
                .into_response();
        }
    }
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "no healthy engine answered /v1/models",
    )
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let engines: Vec<Value> = s
        .registry
        .engines()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            json!({"engine_id": e.engine_id, "role": e.role, "http_url": e.http_url,
                   "healthy": s.healthy[i].load(Ordering::Relaxed)})
        })
        .collect();
    let any = |idx: &[u16]| {
        idx.iter()
            .any(|&i| s.healthy[i as usize].load(Ordering::Relaxed))
    };
    let ok = any(&s.prefill_idx) && any(&s.decode_idx);
    let body = json!({
        "status": if ok { "ok" } else { "degraded" },
        "prefix_check": s.prefix_check_in_force().as_str(),
        "prefix_check_configured": s.cfg.prefix_check.as_str(),
        "store_entries": s.store_len(),
        "store": s.store.health_json(),
        "kv_recompute_threshold": s.cfg.kv_recompute_threshold,
        "engines": engines,
    });
    (
        if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        Json(body),
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    s.sweep();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        s.store.splice_metrics(s.metrics.encode()),
    )
        .into_response()
}

fn authorized(s: &AppState, headers: &HeaderMap) -> bool {
    if s.cfg.admin_token.is_empty() {
        return false;
    }
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(tok) = v.strip_prefix("Bearer ") else {
        return false;
    };
    // constant-time comparison
    let (a, b) = (tok.as_bytes(), s.cfg.admin_token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn put_thresholds(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let count = |reason| {
        s.metrics
            .threshold_pushes
            .get_or_create(&ReasonLabel { reason })
            .inc()
    };
    if !authorized(&s, &headers) {
        count("unauthorized");
        return error_response(
            StatusCode::UNAUTHORIZED,
            "Authorization: expected `Bearer <admin_token>`",
        );
    }
    let u: ThresholdUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => {
            count("rejected");
            return error_response(StatusCode::BAD_REQUEST, format!("body: {e}"));
        }
    };
    let now = s.now_ms();
    let r = s
        .thresholds
        .lock()
        .unwrap()
        .apply(&u, now, |id| s.registry.index_of(id).is_some());
    match r {
        Ok(ApplyOutcome::Applied(n)) => {
            count("applied");
            debug!(agent = %u.agent_id, seq = u.seq, pairs = n, "thresholds applied");
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(ApplyOutcome::StaleSeq { last_seq }) => {
            count("stale");
            info!(agent = %u.agent_id, seq = u.seq, last_seq, "threshold push with a lower seq ignored");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => {
            count("rejected");
            error_response(StatusCode::BAD_REQUEST, e.to_string())
        }
    }
}

async fn get_thresholds(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return error_response(
            StatusCode::UNAUTHORIZED,
            "Authorization: expected `Bearer <admin_token>`",
        );
    }
    let now = s.now_ms();
    let th = s.thresholds.lock().unwrap();
    let pairs: Vec<Value> = th
        .snapshot(now)
        .into_iter()
        .map(|(p, d, t, left, agent)| {
            json!({"prefill_engine_id": p, "decode_engine_id": d, "threshold_tokens": t,
                   "valid_for_ms_left": left, "agent_id": agent, "in_force": left > 0})
        })
        .collect();
    Json(json!({"static_threshold_tokens": th.static_threshold_tokens(), "pairs": pairs}))
        .into_response()
}
