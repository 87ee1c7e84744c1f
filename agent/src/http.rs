//! The agent's HTTP server: `/metrics`, `/healthz`, and the versioned
//! agent-to-agent API (`/v1/...`): peers discover each other's engines and
//! probe engine, renew leases of retained blocks, and `kvloop explain`
//! reads explanations.
//!
//! | route | answer |
//! |---|---|
//! | `GET /healthz` | `200 ok` |
//! | `GET /metrics` | OpenMetrics text |
//! | `GET /v1/engines` | [`EnginesInfo`] |
//! | `POST /v1/leases/renew` | body [`RenewRequest`] → `LeaseInfo`, or `404`/`409` with an `ApiError` |
//! | `POST /v1/leases/retention` | a router's retention decision: body [`RetentionRequest`], `Authorization: Bearer <router token>` when `routers[].token` is set → [`RetentionAnswer`], or `401`/`400`/`404`/`409` with an `ApiError` |
//! | `GET /v1/explain?pair=P,D` | `{"text": ..., "explain": ...}` |
//! | `GET /v1/status` | status JSON |
use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus_client::registry::Registry;
use serde::Deserialize;

use kvloop_agent_api::peer::EnginesInfo;

use crate::agent::Agent;
use crate::garbage::{Peer, garbage_warn};
use crate::proto::{ApiError, ErrorKind};

pub use kvloop_agent_api::peer::{
    API_VERSION, RETENTION_PATH, RenewRequest, RetentionAnswer, RetentionRequest,
};

struct HttpState {
    agent: Arc<Agent>,
    registry: Registry,
}

/// The router of the HTTP server; `registry` holds every metric.
pub fn router(agent: Arc<Agent>, registry: Registry) -> axum::Router {
    let st = Arc::new(HttpState { agent, registry });
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/engines", get(engines))
        .route("/v1/leases/renew", post(renew))
        .route(RETENTION_PATH, post(retention))
        .route("/v1/explain", get(explain))
        .route("/v1/status", get(status))
        .with_state(st)
}

async fn metrics(State(s): State<Arc<HttpState>>) -> Response {
    s.agent.account_rail_bytes();
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &s.registry) {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

async fn engines(State(s): State<Arc<HttpState>>) -> Json<EnginesInfo> {
    Json(s.agent.engines_info())
}

async fn status(State(s): State<Arc<HttpState>>) -> Json<serde_json::Value> {
    Json(s.agent.status())
}

fn err(code: StatusCode, e: ApiError) -> Response {
    (code, Json(e)).into_response()
}

/// The JSON body of `POST path` as a `T` of this [`API_VERSION`]
/// (`version_of` reads its version): else the answer to send (`400`
/// naming the body or `version`; a refused body with its own status),
/// and garbage is warned about (rate-limited).
fn parse_request<T: serde::de::DeserializeOwned>(
    path: &str,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
    version_of: impl Fn(&T) -> u32,
) -> Result<T, Box<Response>> {
    let refuse = |status: StatusCode, kind: ErrorKind, message: String| {
        Box::new(err(status, ApiError::new(kind, message)))
    };
    let body = body.map_err(|e| {
        garbage_warn(
            Peer::default(),
            &format!("HTTP POST {path} body refused: {e}"),
        );
        refuse(
            e.status(),
            ErrorKind::BadRequest,
            format!("body: {}", e.body_text()),
        )
    })?;
    let r: T = serde_json::from_slice(&body).map_err(|e| {
        garbage_warn(
            Peer::default(),
            &format!("HTTP POST {path} body is not a valid request: {e}"),
        );
        refuse(
            StatusCode::BAD_REQUEST,
            ErrorKind::BadRequest,
            format!("body: {e}"),
        )
    })?;
    let version = version_of(&r);
    if version != API_VERSION {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            ErrorKind::Version,
            format!("version: agent speaks {API_VERSION}, got {version}"),
        ));
    }
    Ok(r)
}

async fn renew(
    State(s): State<Arc<HttpState>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let r: RenewRequest =
        match parse_request("/v1/leases/renew", body, |r: &RenewRequest| r.version) {
            Ok(r) => r,
            Err(e) => return *e,
        };
    match s.agent.renew_local(&r.engine_id, &r.request_id, r.lease_ms) {
        Ok(i) => Json(i).into_response(),
        Err(e) => err(StatusCode::CONFLICT, e),
    }
}

async fn retention(
    State(s): State<Arc<HttpState>>,
    headers: axum::http::HeaderMap,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !s.agent.retention_authorized(bearer) {
        return err(
            StatusCode::UNAUTHORIZED,
            ApiError::new(
                ErrorKind::Forbidden,
                "Authorization: expected `Bearer <token>` of one of routers[] (the router's admin_token)",
            ),
        );
    }
    let r: RetentionRequest =
        match parse_request(RETENTION_PATH, body, |r: &RetentionRequest| r.version) {
            Ok(r) => r,
            Err(e) => return *e,
        };
    match s.agent.retention(&r, bearer).await {
        Ok(a) => Json(a).into_response(),
        Err(e) if e.kind == ErrorKind::UnknownEngine => err(StatusCode::NOT_FOUND, e),
        Err(e) => err(StatusCode::CONFLICT, e),
    }
}

#[derive(Deserialize)]
struct PairQuery {
    pair: String,
}

/// Parses `P,D`.
///
/// # Errors
/// A message naming `pair`.
pub fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once(',') {
        Some((p, d)) if !p.trim().is_empty() && !d.trim().is_empty() && !d.contains(',') => {
            Ok((p.trim().to_string(), d.trim().to_string()))
        }
        _ => Err(format!(
            "pair `{s}`: expected `<prefill engine id>,<decode engine id>`"
        )),
    }
}

async fn explain(State(s): State<Arc<HttpState>>, q: Query<PairQuery>) -> Response {
    let (p, d) = match parse_pair(&q.pair) {
        Ok(x) => x,
        Err(m) => {
            return err(
                StatusCode::BAD_REQUEST,
                ApiError::new(ErrorKind::BadRequest, m),
            );
        }
    };
    match s.agent.explain(&p, &d) {
        Ok((text, explain)) => {
            Json(serde_json::json!({"text": text, "explain": explain})).into_response()
        }
        Err(e) => err(StatusCode::NOT_FOUND, e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pair_parsing_names_the_field() {
        assert_eq!(
            super::parse_pair("p0, d0").unwrap(),
            ("p0".into(), "d0".into())
        );
        assert!(super::parse_pair("p0").unwrap_err().contains("pair"));
        assert!(super::parse_pair(",d").is_err());
        assert!(super::parse_pair("a,b,c").is_err());
    }
}
