//! Calls to the engines (tokenize, prefill, decode) and their one error type.
//!
//! Every failure is an [`UpstreamError`]: the stage, the engine, the engine's
//! HTTP status when it answered, and whether the retry-once rule may resend
//! the request without D's params ([`UpstreamError::retry_safe`]).
use std::time::Duration;

use axum::http::{StatusCode, header};
use kvloop_router_api::TOKENS_HEADER;
use kvloop_router_api::json::RawObject;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::registry::Engine;
use crate::request::Api;

/// `e`'s endpoint for `api`.
pub fn api_url(e: &Engine, api: Api) -> &url::Url {
    match api {
        Api::Chat => &e.urls.chat,
        Api::Completions => &e.urls.completions,
    }
}

/// `/tokenize`'s answer as far as the router reads it (typed: an answer
/// of thousands of ids parsed into a `Value` first cost several % of the
/// router's CPU; the ids themselves are read by [`crate::token_ids`]).
#[derive(serde::Deserialize)]
struct TokenizeReply {
    #[serde(deserialize_with = "crate::token_ids::deserialize")]
    tokens: Vec<u32>,
}

/// Which engine call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `POST /tokenize` (on a prefill engine).
    Tokenize,
    /// The prefill request to P.
    Prefill,
    /// The decode request to D.
    Decode,
}

impl Stage {
    /// `tokenize`, `prefill`, `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Tokenize => "tokenize",
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
        }
    }
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No connection could be made (refused, unreachable, connect timeout):
    /// nothing reached the engine.
    Connect,
    /// The connection broke (reset or closed) before the engine's answer:
    /// the request may have reached the engine.
    Transport,
    /// No answer within the stage's timeout.
    Timeout,
    /// The engine answered with a non-success HTTP status.
    Status(StatusCode),
    /// The engine answered 2xx with a body the router cannot use.
    Body,
}

/// A failed engine call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{} engine {engine}: {detail}", stage.as_str())]
pub struct UpstreamError {
    /// The call.
    pub stage: Stage,
    /// Engine id.
    pub engine: String,
    /// What went wrong.
    pub failure: Failure,
    /// Human-readable detail (the engine's error text when it sent one).
    pub detail: String,
}

impl UpstreamError {
    /// An error of `stage` at `engine`.
    pub fn new(stage: Stage, engine: &str, failure: Failure, detail: impl Into<String>) -> Self {
        Self {
            stage,
            engine: engine.to_string(),
            failure,
            detail: detail.into(),
        }
    }

    fn transport(stage: Stage, engine: &str, e: &reqwest::Error) -> Self {
        let failure = if e.is_timeout() {
            Failure::Timeout
        } else if e.is_connect() {
            Failure::Connect
        } else {
            Failure::Transport
        };
        Self::new(stage, engine, failure, error_chain(e))
    }

    /// The engine's HTTP status, when it answered with an error status.
    pub fn status(&self) -> Option<StatusCode> {
        match self.failure {
            Failure::Status(s) => Some(s),
            _ => None,
        }
    }

    /// Whether resending the request (without D's params, PROTOCOL rule 6)
    /// may succeed: transport failures, timeouts and 5xx answers are; a 4xx
    /// (the request itself is refused) and an unusable 2xx body are not.
    pub fn retry_safe(&self) -> bool {
        match self.failure {
            Failure::Connect | Failure::Transport | Failure::Timeout => true,
            Failure::Status(s) => s.is_server_error(),
            Failure::Body => false,
        }
    }

    /// The status the client gets: the engine's own 4xx (the request is at
    /// fault), 504 on a timeout, else 502.
    pub fn client_status(&self) -> StatusCode {
        match self.failure {
            Failure::Status(s) if s.is_client_error() => s,
            Failure::Timeout => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }
}

/// The engine client (reqwest, HTTP/1.1 keep-alive).
#[derive(Clone)]
pub struct Upstream {
    /// The HTTP client (pooled keep-alive connections).
    pub http: reqwest::Client,
    /// A client that opens a new connection for every request (no pool),
    /// for resending after a pooled connection broke: an engine whose
    /// event loop stalled past its keep-alive timeout (uvicorn 5 s,
    /// `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) closes every idle connection it
    /// finds expired when it wakes, a request in its buffer or not, and
    /// libuv (uvloop) runs those timers before reading the socket.
    pub fresh: reqwest::Client,
}

impl Upstream {
    /// This client with every request on a new connection.
    pub fn fresh_connections(&self) -> Upstream {
        Upstream {
            http: self.fresh.clone(),
            fresh: self.fresh.clone(),
        }
    }
}

/// P's answer to a prefill request.
#[derive(Debug)]
pub struct PrefillReply {
    /// P's `kv_transfer_params`, exact text (`None` when absent or null).
    pub params: Option<Box<RawValue>>,
    /// Tokens P reports it did not compute (READ from D or found cached):
    /// `usage.prompt_tokens_details.cached_tokens` (vLLM) or
    /// `kvloop_sim.reused_tokens` (engine-sim). `None` when not reported.
    pub reported_reused: Option<u64>,
}

fn reported_reused(obj: &RawObject) -> Option<u64> {
    let field = |k: &str| {
        obj.get(k)
            .and_then(|r| serde_json::from_str::<Value>(r.get()).ok())
    };
    if let Some(n) = field("kvloop_sim").and_then(|s| s.get("reused_tokens")?.as_u64()) {
        return Some(n);
    }
    field("usage").and_then(|u| {
        u.get("prompt_tokens_details")?
            .get("cached_tokens")?
            .as_u64()
    })
}

/// `e` and its sources, `: `-joined (reqwest's own text omits the cause:
/// "error sending request for url (…)" says nothing of a reset or a
/// connect timeout).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

/// `r` when its status is a success, else an [`UpstreamError`] at `st` with
/// the status and the engine's body (`HTTP <status>: <body>`).
async fn success(
    st: Stage,
    engine: &str,
    r: reqwest::Response,
) -> Result<reqwest::Response, UpstreamError> {
    let status = r.status();
    if status.is_success() {
        return Ok(r);
    }
    let text = r.text().await.unwrap_or_default();
    Err(UpstreamError::new(
        st,
        engine,
        Failure::Status(status),
        format!("HTTP {status}: {text}"),
    ))
}

impl Upstream {
    /// `POST {url}/tokenize` with `body` (JSON bytes); the `tokens` of the
    /// answer.
    ///
    /// # Errors
    /// [`UpstreamError`] at [`Stage::Tokenize`].
    pub async fn tokenize(
        &self,
        engine: &str,
        url: &url::Url,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u32>, UpstreamError> {
        let st = Stage::Tokenize;
        let r = self
            .http
            .post(url.clone())
            .timeout(timeout)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| UpstreamError::transport(st, engine, &e))?;
        let r = success(st, engine, r).await?;
        let bytes = r
            .bytes()
            .await
            .map_err(|e| UpstreamError::transport(st, engine, &e))?;
        serde_json::from_slice::<TokenizeReply>(&bytes)
            .map(|t| t.tokens)
            .map_err(|e| {
                UpstreamError::new(
                    st,
                    engine,
                    Failure::Body,
                    format!("tokens: expected token ids ({e})"),
                )
            })
    }

    /// The prefill request (`body` from [`crate::request::prefill_body`]) to
    /// `url` ([`api_url`]). `tokens` = `(prompt tokens, reused tokens)` for
    /// the tokens header.
    ///
    /// # Errors
    /// [`UpstreamError`] at [`Stage::Prefill`].
    #[allow(clippy::too_many_arguments)]
    pub async fn prefill(
        &self,
        engine: &str,
        url: &url::Url,
        request_id: &str,
        body: Vec<u8>,
        tokens: Option<(usize, u64)>,
        timeout: Duration,
    ) -> Result<PrefillReply, UpstreamError> {
        let st = Stage::Prefill;
        let mut req = self
            .http
            .post(url.clone())
            .timeout(timeout)
            .header("x-request-id", request_id)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some((n, reused)) = tokens {
            req = req.header(TOKENS_HEADER, format!("prompt={n},reused={reused}"));
        }
        let r = req
            .send()
            .await
            .map_err(|e| UpstreamError::transport(st, engine, &e))?;
        let r = success(st, engine, r).await?;
        let bytes = r
            .bytes()
            .await
            .map_err(|e| UpstreamError::transport(st, engine, &e))?;
        let mut obj = RawObject::parse_slice(&bytes).map_err(|e| {
            UpstreamError::new(st, engine, Failure::Body, format!("response body: {e}"))
        })?;
        Ok(PrefillReply {
            reported_reused: reported_reused(&obj),
            params: obj
                .remove("kv_transfer_params")
                .filter(|p| p.get() != "null"),
        })
    }

    /// The decode request (`body` from [`crate::request::decode_body`]) to
    /// `url` ([`api_url`]): D's response once its headers arrived with a
    /// success status.
    ///
    /// # Errors
    /// [`UpstreamError`] at [`Stage::Decode`].
    pub async fn decode(
        &self,
        engine: &str,
        url: &url::Url,
        request_id: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<reqwest::Response, UpstreamError> {
        let st = Stage::Decode;
        let req = self
            .http
            .post(url.clone())
            .header("x-request-id", request_id)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        let r = match tokio::time::timeout(timeout, req.send()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Err(UpstreamError::transport(st, engine, &e)),
            Err(_) => {
                return Err(UpstreamError::new(
                    st,
                    engine,
                    Failure::Timeout,
                    "no response headers in time",
                ));
            }
        };
        let r = success(st, engine, r).await?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_decision_and_client_status() {
        let e = |f| UpstreamError::new(Stage::Prefill, "p0", f, "x");
        assert!(e(Failure::Transport).retry_safe());
        assert!(e(Failure::Connect).retry_safe());
        assert_eq!(e(Failure::Connect).client_status(), StatusCode::BAD_GATEWAY);
        assert!(e(Failure::Timeout).retry_safe());
        assert!(e(Failure::Status(StatusCode::INTERNAL_SERVER_ERROR)).retry_safe());
        assert!(
            !e(Failure::Status(StatusCode::BAD_REQUEST)).retry_safe(),
            "a 400 is not retried"
        );
        assert!(!e(Failure::Body).retry_safe());
        assert_eq!(
            e(Failure::Status(StatusCode::BAD_REQUEST)).client_status(),
            400
        );
        assert_eq!(e(Failure::Timeout).client_status(), 504);
        assert_eq!(
            e(Failure::Status(StatusCode::SERVICE_UNAVAILABLE)).client_status(),
            502
        );
        assert_eq!(e(Failure::Body).to_string(), "prefill engine p0: x");
    }

    #[test]
    fn transport_errors_name_their_cause() {
        #[derive(Debug)]
        struct Sending(std::io::Error);
        impl std::fmt::Display for Sending {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("error sending request")
            }
        }
        impl std::error::Error for Sending {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Sending(std::io::Error::other(
            "connection closed before message completed",
        ));
        assert_eq!(
            error_chain(&e),
            "error sending request: connection closed before message completed"
        );
    }

    #[test]
    fn reads_what_p_reports_it_reused() {
        let o = |s: &str| RawObject::parse(s).unwrap();
        assert_eq!(
            reported_reused(&o(r#"{"kvloop_sim":{"reused_tokens":109}}"#)),
            Some(109)
        );
        assert_eq!(
            reported_reused(&o(
                r#"{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":96}}}"#
            )),
            Some(96)
        );
        assert_eq!(
            reported_reused(&o(r#"{"usage":{"prompt_tokens":5}}"#)),
            None
        );
    }
}
