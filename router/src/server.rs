//! The HTTP shell: the router's state, the axum app, and one request's walk
//! (parse → decide → prefill → decode → relay). Parsing and body rewrites
//! are in [`crate::request`], engine calls in [`crate::upstream`], the relay
//! and the storing of turns in [`crate::relay`], the router's own endpoints
//! in [`crate::admin`]. Decisions are made by the pure modules.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use kvloop_router_api::{PULL_ABANDONED_PATH, PULL_READ_PATH, THRESHOLDS_PATH};
use serde_json::value::RawValue;
use tracing::{debug, warn};

use crate::config::{Policy, PrefixCheckMode};
use crate::decision::{PromptInfo, decide};
use crate::error::RouteError;
use crate::explain::{ROUTE_HEADER, RouteRecord, Routed};
use crate::fingerprint::{History, HistoryHasher, hash_tokens};
use crate::metrics::{ReasonLabel, RequestLabels};
use crate::prefill::{params_for_decode, prefill, prefill_again};
use crate::relay::{Relay, StoreCtx};
use crate::request::{Api, decode_body, parse_request, tokenize_body};
use crate::sse::rewrite_body;
use crate::store::{ConvKey, Lookup};
use crate::upstream::{Failure, Stage, Upstream, UpstreamError};

pub use crate::state::{AppState, BuildError};

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
        .route("/admin/routes", get(crate::admin::get_routes))
        .route("/admin/retention", get(crate::admin::get_retention))
        .route(
            "/v1/conversations/{id}",
            axum::routing::delete(crate::retention_task::delete_conversation),
        )
        .route(PULL_ABANDONED_PATH, post(crate::admin::post_pull_abandoned))
        .route(PULL_READ_PATH, post(crate::admin::post_pull_read))
        .route(
            THRESHOLDS_PATH,
            put(crate::admin::put_thresholds).get(crate::admin::get_thresholds),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// An unknown path: 404 with an OpenAI-style error body (as vLLM's server).
async fn not_found(uri: axum::http::Uri) -> Response {
    crate::error::error_response(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        None,
        format!("no route {}", uri.path()),
    )
}

/// A known path with another method: 405 with an OpenAI-style error body.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    crate::error::error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        None,
        format!("method {method} not allowed on {}", uri.path()),
    )
}

/// Spawn the background tasks (health checks, store sweeping) for `state`;
/// they end when the state is dropped.
pub fn spawn_background(state: &Arc<AppState>) {
    crate::load_poll::spawn(state);
    crate::load_share::spawn(state);
    crate::retention_task::spawn(state);
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

    // What the router knows of the prompt, and the stored turn (single
    // use: the entry leaves the store here), asked for at once: the
    // `/tokenize` round trip to P and the store's (Redis) round trip
    // overlap.
    let key = req
        .conversation_id
        .as_deref()
        .map(|c| ConvKey::new(&req.tenant, c));
    let conversation = key.as_ref().map(ConvKey::digest);
    let now = s.now_ms();
    let tokens = async {
        match &req.prompt_token_ids {
            Some(t) => Some(t.clone()),
            None if (req.conversation_id.is_some() || s.cfg.tokenize_every_request)
                && s.cfg.prefix_check == PrefixCheckMode::Tokens =>
            {
                let b = tokenize_body(api, &req.members)?;
                let timeout = Duration::from_millis(s.cfg.prefill_timeout_ms);
                s.tokenize_on(p_idx, b, timeout).await
            }
            None => None,
        }
    };
    let lookup = async {
        match &key {
            Some(k) => s.take_turn(k, now).await,
            None => Lookup::Missing,
        }
    };
    let (tokens, lookup): (Option<Vec<u32>>, Lookup) = tokio::join!(tokens, lookup);
    let history = req.history();
    // A taken turn that this request does not pull is released below.
    let taken = match (&key, &lookup) {
        (Some(k), Lookup::Found(t)) => {
            s.retention_taken(k, t, now);
            Some((k.clone(), t))
        }
        _ => None,
    };
    // The P whose `/tokenize` counted the prompt (also counts the reply).
    let tokenize_idx = p_idx;
    let mut p_idx = p_idx;
    // `chosen`: the selection's option (its compute on P, and when P's
    // agent would abandon a pull's READ), for the load book.
    let (decision, record, chosen) = {
        let th = s.thresholds.lock();
        let info = PromptInfo {
            tokens: tokens.as_deref(),
            history,
        };
        let routed = |decision: &crate::decision::Decision| Routed {
            request_id: &request_id,
            at_ms: now,
            policy: s.cfg.policy.as_str(),
            decision: decision.reason.as_str(),
            reused_tokens: decision.reused_tokens,
            reusable_tokens: decision.reusable_tokens,
            previous_decode: None,
        };
        if s.cfg.policy == Policy::PredictedTtft {
            if let Some(c) = conversation.filter(|_| s.store.is_shared()) {
                // Another replica's prefill of this conversation is gone.
                s.load.supersede(c);
            }
            // Replicas start their round robin apart (`rr_offset`).
            let rr =
                (s.rr_select.fetch_add(1, Ordering::Relaxed) as u64).wrapping_add(s.rr_offset());
            let healthy = |i: u16| s.healthy[i as usize].load(Ordering::Relaxed);
            let pl = crate::select::route::place_with_load(
                s.cfg.policy,
                &lookup,
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
            (p_idx, d_idx) = (pl.selection.prefill, pl.selection.decode);
            let record = RouteRecord::from_selection(
                &Routed {
                    previous_decode: pl.decision.decode_engine_id.as_deref(),
                    ..routed(&pl.decision)
                },
                &pl.selection,
                |i| s.engine_id(i),
            );
            (pl.decision, record, pl.selection.chosen)
        } else {
            let d = decide(&lookup, &info, &s.engine_id(p_idx), &s.registry, &th, now);
            let record = RouteRecord::round_robin(
                &Routed {
                    previous_decode: d.decode_engine_id.as_deref(),
                    ..routed(&d)
                },
                &s.engine_id(p_idx),
                &s.engine_id(d_idx),
                d.attach.is_some(),
            );
            (d, record, None)
        }
    };
    if let Some((k, t)) = &taken
        && decision.attach.is_none()
    {
        let cause = if decision.reason == crate::reason::Reason::PrefixMismatch {
            crate::retention::Cause::PrefixMismatch
        } else {
            crate::retention::Cause::Recomputed
        };
        s.release_turn(k, t, cause);
    }
    // Formatted only when someone reads it (about 1 µs a turn).
    let route_line =
        (s.cfg.route_header || tracing::enabled!(tracing::Level::DEBUG)).then(|| record.line());
    if let Some(line) = &route_line {
        debug!(%request_id, route = %line, "route");
    }
    s.record_route(record);
    let decode_load = s.load.begin_decode(d_idx);
    s.metrics
        .decisions
        .get_or_create(&ReasonLabel {
            reason: decision.reason.as_str(),
        })
        .inc();

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
    // A pulled turn names its pull, for P's agent's notice of a cut.
    let pull = decision.attach.is_some().then(|| {
        let digest = match (&decision.decode_engine_id, &taken) {
            (Some(d), Some((_, t))) => t
                .params
                .remote_request_id()
                .map_or(0, |r| crate::select::load::pull_digest(d, &r)),
            _ => 0,
        };
        crate::select::load::Pull {
            digest,
            read_noticed: chosen.is_some_and(|c| c.read_noticed),
        }
    });
    let prefill_load = s.load.begin_prefill(
        p_idx,
        (n_prompt.unwrap_or(0) as u64).saturating_sub(decision.reused_tokens),
        chosen.map(|c| c.compute_ms()),
        pull,
        chosen.and_then(|c| c.abandon),
        conversation.unwrap_or(0),
    );
    let pull_failed = || {
        if let Some((k, t)) = &taken {
            s.release_turn(k, t, crate::retention::Cause::PullFailed);
        }
    };
    let (p_idx, p_reply) = prefill(
        s,
        &req,
        p_idx,
        &decision,
        n_prompt,
        &request_id,
        pull_failed,
    )
    .await
    .inspect_err(|e| warn!(%request_id, error = %e, "prefill failed"))?;
    // P answered: its compute line moves on now, not when D answers (D
    // first READs P's blocks: over a slowed path that took 2 s in `make
    // demo-cluster`, and P looked busy with a prefill it had finished).
    drop(prefill_load);
    let d_params = params_for_decode(s, p_idx, p_reply)?;

    // Decode request: the client's body with P's params. Never resent to
    // another D; resent to this D once, after a fresh prefill, when the
    // connection broke before D answered.
    let d = s.registry.get(d_idx).expect("index");
    let decode = |up: Upstream, params: Box<RawValue>| {
        let body = decode_body(&req.members, &params);
        let (request_id, timeout) = (&request_id, Duration::from_millis(s.cfg.decode_timeout_ms));
        async move {
            let url = crate::upstream::api_url(d, api);
            up.decode(&d.engine_id, url, request_id, body, timeout)
                .await
        }
    };
    let d_resp = match decode(s.upstream.clone(), d_params).await {
        Ok(r) => r,
        Err(e) if e.failure == Failure::Transport => {
            // A connection that broke before D's answer (a reset under a
            // reused keep-alive connection; D's process going away) may
            // have delivered the request: D may have READ P's blocks and P
            // freed them. P's params are never sent again; P prefills the
            // prompt once more into fresh blocks (no reuse) and D gets
            // those, on new connections. Nothing has reached the client yet.
            warn!(%request_id, error = %e, "decode connection broke before D answered; prefilling again without reuse and resending to D once");
            s.metrics.decode_retries.inc();
            let reply = prefill_again(s, &req, p_idx, n_prompt, &request_id)
                .await
                .inspect_err(
                    |e| warn!(%request_id, error = %e, "prefill for the decode retry failed"),
                )?;
            let fresh = s.upstream.fresh_connections();
            decode(fresh, params_for_decode(s, p_idx, reply)?)
                .await
                .inspect_err(|e| warn!(%request_id, error = %e, "decode retry failed"))?
        }
        Err(e) => {
            warn!(%request_id, error = %e, "decode failed; P's params are not resent to another decode engine");
            return Err(e.into());
        }
    };

    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header("x-request-id", &request_id);
    if s.cfg.route_header
        && let Some(line) = &route_line
        && let Ok(v) = axum::http::HeaderValue::from_str(line)
    {
        builder = builder.header(ROUTE_HEADER, v);
    }
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
