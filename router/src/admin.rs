//! The router's own endpoints: `/v1/models`, `/version`, `/health`,
//! `/metrics` and the threshold admin API.
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvloop_router_api::{PullNotice, ThresholdUpdate};
use serde_json::{Value, json};
use tracing::{debug, info};

use crate::alarms::MISSING_PARAMS_HINT;
use crate::error::error_response;
use crate::metrics::ReasonLabel;
use crate::models::merge_models;
use crate::state::AppState;
use crate::thresholds::ApplyOutcome;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// `GET /v1/models`: the models of every healthy engine, merged.
pub async fn models(State(s): State<Arc<AppState>>) -> Response {
    let mut answers = Vec::new();
    for &i in s.decode_idx.iter().chain(s.prefill_idx.iter()) {
        if !s.healthy[i as usize].load(Ordering::Relaxed) {
            continue;
        }
        if let Some(b) = s.fetch_models(i).await {
            answers.push(b);
        }
    }
    if answers.is_empty() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream_error",
            None,
            "no healthy engine answered /v1/models",
        );
    }
    let (body, ids) = merge_models(&answers);
    s.set_models(ids);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// `GET /version`: the engines' version (vLLM serves `{"version": ...}`)
/// plus the router's own.
pub async fn version(State(s): State<Arc<AppState>>) -> Response {
    let engine = s.fetch_version().await;
    let mut body = json!({"kvloop_router": env!("CARGO_PKG_VERSION")});
    body["version"] = engine.unwrap_or_else(|| Value::from(env!("CARGO_PKG_VERSION")));
    Json(body).into_response()
}

/// `GET /health`: 503 unless a healthy P and a healthy D exist, and while
/// warming up after start (`status: "warming"`, until an agent's first
/// threshold push or `warmup_ms`); `status: "degraded"` (still 200) while a
/// warning stands (pulls of a pair keep failing, decode answers lack
/// `kv_transfer_params`).
pub async fn health(State(s): State<Arc<AppState>>) -> Response {
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
    let serving = any(&s.prefill_idx) && any(&s.decode_idx);
    let id = |i: u16| {
        s.registry
            .get(i)
            .map(|e| e.engine_id.clone())
            .unwrap_or_default()
    };
    let mut warnings = Vec::new();
    for ((p, d), n) in s.pulls.lock().alarms() {
        warnings.push(json!({"kind": "pulls_failing", "prefill_engine_id": id(p), "decode_engine_id": id(d),
            "consecutive_failures": n,
            "detail": "P keeps declining or failing the READs of D's blocks and recomputes: check the pair's side channel (its host must be reachable from P) and the agents"}));
    }
    let missing = {
        let m = s.missing_params.lock();
        (m.streak, m.total)
    };
    if missing.0 > 0 {
        warnings.push(
            json!({"kind": "decode_params_missing", "streak": missing.0, "total": missing.1,
            "detail": MISSING_PARAMS_HINT}),
        );
    }
    let warmup_left_ms = s.warmup_left_ms();
    let status = match (serving, warnings.is_empty(), warmup_left_ms) {
        (true, _, Some(_)) => "warming",
        (true, true, None) => "ok",
        _ => "degraded",
    };
    let body = json!({
        "status": status,
        "prefix_check": s.prefix_check_in_force().as_str(),
        "prefix_check_configured": s.cfg.prefix_check.as_str(),
        "store_entries": s.store_len(),
        "store": s.store.health_json(),
        "replicas": s.replica_rank().map(|(rank, count)| json!({"sharing": count, "rank": rank})),
        "kv_recompute_threshold": s.cfg.kv_recompute_threshold,
        "warmup_left_ms": warmup_left_ms,
        "warnings": warnings,
        "engines": engines,
    });
    let code = if serving && warmup_left_ms.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// `GET /metrics` (OpenMetrics text).
pub async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    s.sweep();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        s.metrics.encode(),
    )
        .into_response()
}

pub(crate) fn authorized(s: &AppState, headers: &HeaderMap) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(tok) = v.strip_prefix("Bearer ") else {
        return false;
    };
    kvloop_router_api::bearer_matches(&s.cfg.admin_token, tok)
}

pub(crate) fn unauthorized() -> Response {
    error_response(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        None,
        "Authorization: expected `Bearer <admin_token>`",
    )
}

/// An agent's call to the admin API: its bearer token checked, then its
/// body parsed by `parse`; a refusal is counted in `family`
/// (`unauthorized`, `rejected`) and answered (401; 400 with the parser's
/// message, which names the bad field).
fn admit<T, E: std::fmt::Display>(
    s: &AppState,
    headers: &HeaderMap,
    family: &Family<ReasonLabel, Counter>,
    parse: impl FnOnce() -> Result<T, E>,
) -> Result<T, Box<Response>> {
    let count = |reason| family.get_or_create(&ReasonLabel { reason }).inc();
    if !authorized(s, headers) {
        count("unauthorized");
        return Err(Box::new(unauthorized()));
    }
    parse().map_err(|e| {
        count("rejected");
        Box::new(bad_request(e.to_string()))
    })
}

/// 400 with an OpenAI-style error body.
fn bad_request(message: String) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        None,
        message,
    )
}

/// `PUT /admin/thresholds`.
pub async fn put_thresholds(
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
    let u = match admit(&s, &headers, &s.metrics.threshold_pushes, || {
        serde_json::from_slice::<ThresholdUpdate>(&body).map_err(|e| format!("body: {e}"))
    }) {
        Ok(u) => u,
        Err(refused) => return *refused,
    };
    let now = s.now_ms();
    let r = s
        .thresholds
        .lock()
        .apply(&u, now, |id| s.registry.index_of(id).is_some());
    match r {
        Ok(ApplyOutcome::Applied(n)) => {
            count("applied");
            if n > 0 && !s.thresholds_pushed.swap(true, Ordering::Relaxed) {
                info!(agent = %u.agent_id, "first threshold push with a pair applied (the warm-up, where configured, is over)");
            }
            if let Some(url) = u.agent_url.as_deref()
                && (url.starts_with("http://") || url.starts_with("https://"))
            {
                // Where retention decisions about these decode engines go.
                s.retention.lock().learn(
                    url.trim_end_matches('/'),
                    u.pairs.iter().map(|p| p.decode_engine_id.as_str()),
                    now,
                );
            }
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
            bad_request(e.to_string())
        }
    }
}

/// `POST /admin/pulls/abandoned` ([`kvloop_router_api::PullNotice`]):
/// P's agent says a pull's READ ended without the blocks, so P is
/// recomputing the whole prompt; the load book counts it so from now
/// ([`crate::select::load::LoadBook::pull_abandoned`]). `204` whether or
/// not this replica sent that turn.
pub async fn post_pull_abandoned(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    pull_notice(&s, &headers, &body, &s.metrics.pull_notices, |d| {
        s.load.pull_abandoned(d)
    })
}

/// `POST /admin/pulls/read` ([`kvloop_router_api::PullNotice`]): P's
/// agent says a pull's READ completed with the blocks, so P's engine now
/// queues the turn's suffix; the load book counts it in P's line from now
/// ([`crate::select::load::LoadBook::pull_read`]). `204` whether or not
/// this replica sent that turn.
pub async fn post_pull_read(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    pull_notice(&s, &headers, &body, &s.metrics.pull_read_notices, |d| {
        s.load.pull_read(d)
    })
}

/// One pull notice: admitted (token, body), applied to the load book by
/// `apply` (whether this replica has the pull), counted in `counter`
/// (`applied`, `unknown`).
fn pull_notice(
    s: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    counter: &Family<ReasonLabel, Counter>,
    apply: impl FnOnce(u64) -> bool,
) -> Response {
    let n = match admit(s, headers, counter, || PullNotice::parse(body)) {
        Ok(n) => n,
        Err(refused) => return *refused,
    };
    let digest = crate::select::load::pull_digest(&n.decode_engine_id, &n.decode_request_id);
    let known = apply(digest);
    counter
        .get_or_create(&ReasonLabel {
            reason: if known { "applied" } else { "unknown" },
        })
        .inc();
    debug!(
        agent = %n.agent_id, prefill = %n.prefill_engine_id, decode = %n.decode_engine_id,
        request = %n.decode_request_id, after_ms = n.after_ms, cause = %n.cause, known,
        "pull's READ ended"
    );
    StatusCode::NO_CONTENT.into_response()
}

/// `GET /admin/thresholds`.
pub async fn get_thresholds(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    let now = s.now_ms();
    let th = s.thresholds.lock();
    let pairs: Vec<Value> = th
        .snapshot(now)
        .into_iter()
        .map(|e| {
            json!({"prefill_engine_id": e.prefill_engine_id, "decode_engine_id": e.decode_engine_id,
                   "threshold_tokens": e.threshold_tokens, "valid_for_ms_left": e.valid_for_ms_left,
                   "agent_id": e.agent_id, "in_force": e.valid_for_ms_left > 0, "model": e.model})
        })
        .collect();
    Json(json!({"static_threshold_tokens": th.static_threshold_tokens(), "pairs": pairs}))
        .into_response()
}

/// `GET /admin/routes?n=N&request_id=ID` (admin token): the last routed
/// turns, oldest first ([`crate::explain::RouteRecord`]; `n` default 50,
/// at most [`crate::explain::RECENT_ROUTES`]).
pub async fn get_routes(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
) -> Response {
    // `n` and `request_id` (request ids are taken as sent, not
    // percent-decoded: the router's and most clients' ids need none).
    let q: std::collections::HashMap<&str, &str> = raw
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .collect();
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    let n = match query_n(q.get("n").copied(), crate::explain::RECENT_ROUTES) {
        Ok(n) => n,
        Err(r) => return *r,
    };
    let routes = s.routes.lock().last(n, q.get("request_id").copied());
    Json(json!({"policy": s.cfg.policy.as_str(), "routes": routes})).into_response()
}

/// `GET /admin/retention?n=N` (admin token): decode-side retention as the
/// router sees it — mode and bounds, the agent of each decode engine, each
/// tenant's inter-turn gaps, the holds it follows and its last `n` (50)
/// decisions with the agents' answers (`crate::retention::Retention::snapshot`).
pub async fn get_retention(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    let n = raw
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == "n")
        .map(|(_, v)| v);
    let n = match query_n(n, crate::retention::RECENT_DECISIONS) {
        Ok(n) => n,
        Err(r) => return *r,
    };
    let mut v = s.retention.lock().snapshot(n);
    let kv_usage: serde_json::Map<String, Value> = s
        .decode_idx
        .iter()
        .filter_map(|&i| Some((s.engine_id(i), s.load.kv_usage(i)?.into())))
        .collect();
    v["kv_usage"] = Value::Object(kv_usage);
    Json(v).into_response()
}

/// Query `n`: 50 when absent, at most `max`; `400` naming it when it is not
/// a non-negative integer.
fn query_n(v: Option<&str>, max: usize) -> Result<usize, Box<Response>> {
    match v.map(str::parse::<usize>) {
        None => Ok(50.min(max)),
        Some(Ok(n)) => Ok(n.min(max)),
        Some(Err(_)) => Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("n"),
            "query `n`: expected a non-negative integer",
        ))),
    }
}
