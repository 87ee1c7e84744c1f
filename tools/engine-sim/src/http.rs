//! The OpenAI-compatible handlers (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, `/tokenize`) and the simulator's own endpoints
//! (`/sim/stats`, `/sim/reads`, `/sim/prefills`, `/metrics`). Decoding is in [`crate::decode`].
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::{Api, CREATED, knob};
use crate::config::Role;
use crate::decode::{BlockGuard, DecodeJob, decode_full, decode_stream};
use crate::engine::Engine;
use crate::stats::{PrefillLogEntry, ReadLogEntry};

/// Counts one request in a gauge while alive (also when the handler is
/// cancelled by a client that went away).
struct InGauge(prometheus_client::metrics::gauge::Gauge);

impl InGauge {
    fn new(g: &prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for InGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Wall-clock time, Unix ms.
fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

pub(crate) async fn completions(
    State(e): State<Arc<Engine>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    generate(e, Api::Completions, headers, body).await
}

pub(crate) async fn chat_completions(
    State(e): State<Arc<Engine>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    generate(e, Api::Chat, headers, body).await
}

/// An OpenAI error body with `status`.
pub(crate) fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let msg = msg.into();
    (status, Json(json!({"error": {"message": msg, "type": "invalid_request_error", "code": status.as_u16()}})))
        .into_response()
}

/// A parsed generation request: body, prompt tokens, params, request id.
struct Generation {
    body: Value,
    tokens: Arc<Vec<u32>>,
    params: Option<Value>,
    request_id: String,
    /// The caller's `x-request-id`, if any.
    caller_request_id: Option<String>,
    arrived: Instant,
}

pub(crate) async fn generate(
    e: Arc<Engine>,
    api: Api,
    headers: HeaderMap,
    raw: axum::body::Bytes,
) -> Response {
    let g = match parse_generation(&e, &headers, &raw) {
        Ok(g) => g,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    match e.cfg.role {
        Role::Prefill => prefill(e, api, g).await,
        Role::Decode => decode(e, api, g).await,
    }
}

/// Counts the request, records its tokens header and params, parses and
/// tokenizes its body.
///
/// # Errors
/// The message of the 400 answer: invalid JSON, no or a malformed prompt.
fn parse_generation(e: &Engine, headers: &HeaderMap, raw: &[u8]) -> Result<Generation, String> {
    e.stats.requests.fetch_add(1, Ordering::Relaxed);
    if let Some(h) = headers.get("x-kvloop-tokens").and_then(|v| v.to_str().ok()) {
        *e.last_tokens_header.lock() = Some(h.to_string());
    }
    let body: Value =
        serde_json::from_slice(raw).map_err(|err| format!("body: invalid JSON: {err}"))?;
    let arrived = Instant::now();
    let tokens = Arc::new(e.tokenize(&body)?);
    e.metrics.prompt_tokens.inc_by(tokens.len() as u64);
    let params = body
        .get("kv_transfer_params")
        .filter(|v| !v.is_null())
        .cloned();
    *e.last_params.lock() = params.clone();
    Ok(Generation {
        caller_request_id: headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        request_id: e.new_request_id(),
        body,
        tokens,
        params,
        arrived,
    })
}

/// P: reads D's blocks when the params allow, computes the rest, holds the
/// prompt's blocks for D and answers with one token and its params.
async fn prefill(e: Arc<Engine>, api: Api, g: Generation) -> Response {
    let Generation {
        body,
        tokens,
        params,
        request_id,
        caller_request_id,
        arrived,
    } = g;
    let arrived_unix_ms = unix_ms();
    let params = params.as_ref();
    let n_prompt = tokens.len() as u64;
    let has_blocks = params
        .and_then(|p| p.get("remote_block_ids"))
        .is_some_and(|b| !b.is_null());
    if knob(&body, "fail_prefill") || (has_blocks && knob(&body, "fail_prefill_with_params")) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated prefill failure",
        );
    }
    let waiting = InGauge::new(&e.metrics.requests_waiting);
    let mut ids = e.allocate_blocks(e.blocks_for(n_prompt)).await;
    let pulled = e.pull(&request_id, params, &tokens, true, &ids).await;
    let (reused, verify) = (pulled.reused, pulled.verify);
    if pulled.abandoned {
        ids = e.park_blocks(ids).await;
    }
    let read_ms = arrived.elapsed().as_secs_f64() * 1e3;
    let waited = Instant::now();
    let slot = e.prefill_slot().await;
    let queue = waited.elapsed();
    drop(waiting);
    let running = InGauge::new(&e.metrics.requests_running);
    let compute_start_unix_ms = unix_ms();
    let reused = e.compute_prompt(&ids, &tokens, reused, verify).await;
    drop(slot);
    drop(running);
    let computed = n_prompt - reused;
    let prefill_time = arrived.elapsed();
    e.metrics.ttft_seconds.observe(prefill_time.as_secs_f64());
    e.metrics.generation_tokens.inc();
    // The agent's prefill model wants the READ and the compute, not the
    // wait for a slot (0 without `--prefill-concurrency`).
    e.report_prefill(n_prompt, reused, prefill_time.saturating_sub(queue));
    e.log_prefill(PrefillLogEntry {
        request_id: caller_request_id.unwrap_or_else(|| request_id.clone()),
        engine_request_id: request_id.clone(),
        prompt_tokens: n_prompt,
        reused_tokens: reused,
        arrived_unix_ms,
        compute_start_unix_ms,
        compute_end_unix_ms: unix_ms(),
        read_ms,
        queue_ms: queue.as_secs_f64() * 1e3,
    });
    let kv = e
        .hold(
            &request_id,
            ids,
            n_prompt,
            Duration::from_millis(e.cfg.lease_ms),
            Some(reused),
        )
        .await;
    let choice = match api {
        Api::Completions => {
            json!({"index": 0, "text": " tok0", "logprobs": null, "finish_reason": "length"})
        }
        Api::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": "tok0"}, "finish_reason": "length"})
        }
    };
    let object = api.object(false);
    let resp = json!({
        "id": request_id, "object": object, "created": CREATED, "model": e.cfg.model,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1},
        "kv_transfer_params": kv,
        "kvloop_sim": {"reused_tokens": reused, "computed_tokens": computed},
    });
    Json(resp).into_response()
}

/// D: reads P's blocks when the params allow, computes the rest, then
/// answers in full or streams ([`crate::decode`]).
async fn decode(e: Arc<Engine>, api: Api, g: Generation) -> Response {
    let Generation {
        body,
        tokens,
        params,
        request_id,
        arrived,
        ..
    } = g;
    if knob(&body, "fail_decode") {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated decode failure",
        );
    }
    let n_prompt = tokens.len() as u64;
    let mut blocks = BlockGuard {
        ids: e.allocate_blocks(e.blocks_for(n_prompt)).await,
        engine: e.clone(),
    };
    let pulled = e
        .pull(&request_id, params.as_ref(), &tokens, false, &blocks.ids)
        .await;
    let (reused, verify) = (pulled.reused, pulled.verify);
    if pulled.abandoned {
        let old = std::mem::take(&mut blocks.ids);
        blocks.ids = e.park_blocks(old).await;
    }
    e.compute_prompt(&blocks.ids, &tokens, reused, verify).await;
    e.metrics
        .ttft_seconds
        .observe(arrived.elapsed().as_secs_f64());
    let max_tokens = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(e.cfg.default_max_tokens)
        .max(1);
    let finish = body
        .get("sim")
        .and_then(|s| s.get("finish_reason"))
        .and_then(Value::as_str)
        .unwrap_or("length")
        .to_string();
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let job = DecodeJob {
        e,
        api,
        request_id,
        tokens,
        max_tokens,
        finish,
        blocks,
    };
    if stream {
        decode_stream(job, body)
    } else {
        decode_full(job, &body).await
    }
}

pub(crate) async fn models(State(e): State<Arc<Engine>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": e.cfg.model, "object": "model", "owned_by": "kvloop-engine-sim"}]}))
        .into_response()
}

pub(crate) async fn tokenize(State(e): State<Arc<Engine>>, body: axum::body::Bytes) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(err) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("body: invalid JSON: {err}"),
            );
        }
    };
    match e.tokenize(&body) {
        Ok(t) => {
            Json(json!({"count": t.len(), "max_model_len": 131072, "tokens": t})).into_response()
        }
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

pub(crate) async fn stats(State(e): State<Arc<Engine>>) -> Response {
    Json(e.stats()).into_response()
}

pub(crate) async fn reads(State(e): State<Arc<Engine>>) -> Response {
    let log: Vec<ReadLogEntry> = e.read_log.lock().iter().cloned().collect();
    Json(log).into_response()
}

/// `GET /sim/prefills`: the prefill log, oldest first.
pub(crate) async fn prefills(State(e): State<Arc<Engine>>) -> Response {
    let log: Vec<PrefillLogEntry> = e.prefill_log.lock().iter().cloned().collect();
    Json(log).into_response()
}

pub(crate) async fn metrics_text(State(e): State<Arc<Engine>>) -> Response {
    let usage = e.alloc.lock().usage();
    e.metrics.kv_cache_usage.set(usage);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        e.metrics.render(),
    )
        .into_response()
}

/// The node agent's link of a managed-mode engine (`--kv-mode agent`), if any.
fn agent_link(e: &Engine) -> Option<&Arc<crate::managed::AgentLink>> {
    e.kv.as_ref()
        .and_then(|k| k.registration())
        .map(|r| r.link())
}

/// `GET /health`: 200, or 503 with a JSON reason while a managed-mode engine
/// has lost its node agent (issue 12 item 9: from the loss until it has
/// registered its KV memory again, every turn recomputes).
pub(crate) async fn health(State(e): State<Arc<Engine>>) -> Response {
    match agent_link(&e).map(|l| l.health()) {
        Some(h) if !h.connected => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "degraded",
                "agent_lost": true,
                "agent_lost_total": h.lost_total,
                "detail": "the node agent is lost: KV is recomputed until the engine has registered again",
            })),
        )
            .into_response(),
        _ => StatusCode::OK.into_response(),
    }
}
