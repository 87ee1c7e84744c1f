//! The router's own endpoints: `/v1/models`, `/version`, `/health`,
//! `/metrics` and the threshold admin API.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvloop_router_api::ThresholdUpdate;
use kvloop_router_api::json::RawObject;
use serde_json::{Value, json};
use tracing::{debug, info};

use crate::alarms::MISSING_PARAMS_HINT;
use crate::error::error_response;
use crate::metrics::ReasonLabel;
use crate::server::AppState;
use crate::thresholds::ApplyOutcome;

/// Merge the `/v1/models` answers of several engines: one entry per model
/// id (the first engine's members kept exactly), `max_model_len` the
/// smallest any engine reports (a request must fit every engine it may
/// reach). Answers that are not `{"data": [...]}` are ignored.
pub fn merge_models(answers: &[Bytes]) -> (Vec<u8>, Vec<String>) {
    let mut order: Vec<String> = Vec::new();
    let mut models: BTreeMap<String, (RawObject, Option<u64>)> = BTreeMap::new();
    for a in answers {
        let Ok(v) = serde_json::from_slice::<RawObject>(a) else {
            continue;
        };
        let Some(data) = v
            .get("data")
            .and_then(|d| serde_json::from_str::<Vec<RawObject>>(d.get()).ok())
        else {
            continue;
        };
        for m in data {
            let Some(id) = m
                .get("id")
                .and_then(|i| serde_json::from_str::<String>(i.get()).ok())
            else {
                continue;
            };
            let len = m
                .get("max_model_len")
                .and_then(|l| serde_json::from_str::<u64>(l.get()).ok());
            match models.get_mut(&id) {
                Some((_, have)) => {
                    *have = match (*have, len) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    }
                }
                None => {
                    order.push(id.clone());
                    models.insert(id, (m, len));
                }
            }
        }
    }
    let data: Vec<String> = order
        .iter()
        .map(|id| {
            let (mut m, len) = models.remove(id).expect("inserted");
            if let Some(l) = len {
                m.set_value("max_model_len", &l);
            }
            m.to_json()
        })
        .collect();
    let body = format!("{{\"object\":\"list\",\"data\":[{}]}}", data.join(","));
    (body.into_bytes(), order)
}

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

/// `GET /health`: 503 unless a healthy P and a healthy D exist;
/// `status: "degraded"` (still 200) while a warning stands (pulls of a pair
/// keep failing, decode answers lack `kv_transfer_params`).
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
    let status = match (serving, warnings.is_empty()) {
        (true, true) => "ok",
        _ => "degraded",
    };
    let body = json!({
        "status": status,
        "prefix_check": s.prefix_check_in_force().as_str(),
        "prefix_check_configured": s.cfg.prefix_check.as_str(),
        "store_entries": s.store_len(),
        "store": s.store.health_json(),
        "kv_recompute_threshold": s.cfg.kv_recompute_threshold,
        "warnings": warnings,
        "engines": engines,
    });
    let code = if serving {
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

fn unauthorized() -> Response {
    error_response(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        None,
        "Authorization: expected `Bearer <admin_token>`",
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
    if !authorized(&s, &headers) {
        count("unauthorized");
        return unauthorized();
    }
    let u: ThresholdUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => {
            count("rejected");
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                format!("body: {e}"),
            );
        }
    };
    let now = s.now_ms();
    let r = s
        .thresholds
        .lock()
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
            error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                e.to_string(),
            )
        }
    }
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
        .map(|(p, d, t, left, agent)| {
            json!({"prefill_engine_id": p, "decode_engine_id": d, "threshold_tokens": t,
                   "valid_for_ms_left": left, "agent_id": agent, "in_force": left > 0})
        })
        .collect();
    Json(json!({"static_threshold_tokens": th.static_threshold_tokens(), "pairs": pairs}))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_merged_with_the_smallest_max_model_len() {
        let d = Bytes::from_static(
            br#"{"object":"list","data":[{"id":"m","object":"model","root":"r","x":1.50}]}"#,
        );
        let p = Bytes::from_static(br#"{"object":"list","data":[{"id":"m","max_model_len":4096},{"id":"lora","max_model_len":2048}]}"#);
        let p2 = Bytes::from_static(br#"{"data":[{"id":"m","max_model_len":2048}]}"#);
        let (body, ids) = merge_models(&[d, p, p2, Bytes::from_static(b"nope")]);
        assert_eq!(ids, ["m", "lora"]);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"object":"list","data":[{"id":"m","object":"model","root":"r","x":1.50,"max_model_len":2048},{"id":"lora","max_model_len":2048}]}"#
        );
    }
}
