//! The router's request error: what the client gets and how it is counted.
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::request::BadRequest;
use crate::upstream::{Stage, UpstreamError};

/// Why a client request was not served.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The request is malformed (HTTP 400, the message names the field).
    #[error(transparent)]
    BadRequest(#[from] BadRequest),
    /// No engine serves the requested model (HTTP 404, as vLLM answers).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No healthy engine of a role (HTTP 503).
    #[error("no healthy {0} engine")]
    Unavailable(&'static str),
    /// An engine call failed (HTTP 502/504, or the engine's own 4xx).
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

impl RouteError {
    /// The `outcome` label of `kvloop_router_requests_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            RouteError::BadRequest(_) | RouteError::ModelNotFound(_) => "client_error",
            RouteError::Unavailable(_) => "unavailable",
            RouteError::Upstream(e) => match e.stage {
                Stage::Tokenize | Stage::Prefill => "prefill_error",
                Stage::Decode => "decode_error",
            },
        }
    }

    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            RouteError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RouteError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            RouteError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouteError::Upstream(e) => e.client_status(),
        }
    }
}

/// An OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_response(
    status: StatusCode,
    kind: &str,
    param: Option<&str>,
    message: impl Into<String>,
) -> Response {
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": status.as_u16()}})),
    )
        .into_response()
}

impl IntoResponse for RouteError {
    fn into_response(self) -> Response {
        let status = self.status();
        let (kind, param) = match &self {
            RouteError::BadRequest(b) => ("invalid_request_error", b.param()),
            RouteError::ModelNotFound(_) => ("NotFoundError", Some("model")),
            RouteError::Unavailable(_) | RouteError::Upstream(_) => ("upstream_error", None),
        };
        error_response(status, kind, param, self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::Failure;

    #[test]
    fn statuses_and_outcomes() {
        let up = |stage, f| RouteError::Upstream(UpstreamError::new(stage, "e", f, "x"));
        let cases = [
            (
                RouteError::BadRequest(BadRequest("m".into())),
                400,
                "client_error",
            ),
            (RouteError::ModelNotFound("m".into()), 404, "client_error"),
            (RouteError::Unavailable("decode"), 503, "unavailable"),
            (up(Stage::Prefill, Failure::Transport), 502, "prefill_error"),
            (up(Stage::Decode, Failure::Timeout), 504, "decode_error"),
            (
                up(Stage::Prefill, Failure::Status(StatusCode::BAD_REQUEST)),
                400,
                "prefill_error",
            ),
        ];
        for (e, status, outcome) in cases {
            assert_eq!((e.status().as_u16(), e.outcome()), (status, outcome), "{e}");
        }
    }
}
