//! The multi-turn client: runs conversations against an OpenAI-compatible
//! `/v1/chat/completions` endpoint with streaming SSE.
//!
//! Per request it sends the history so far plus the next user message, with
//! `"stream": true`, `"stream_options": {"include_usage": true}`,
//! `"max_tokens"` (the token count of the conversation's reference answer,
//! capped by [`ClientConfig::max_output_tokens`]) and `"conversation_id"` in
//! the body, and the same id as the `X-Session-ID` header (see
//! `docs/protocol.md`). The server's real answer (the concatenated
//! `delta.content`) becomes the assistant message of the history for the next
//! turn; the reference answer is never sent.
//!
//! Measured per request (see [`RequestRecord`]): TTFT (send → first chunk
//! with non-empty content or reasoning), latency (send → end of stream), TPOT
//! ((latency − TTFT) / (output tokens − 1)), input tokens (client-side count
//! with [`TokenCounter::count_chat`]) and output tokens (`usage` when the
//! server sends it, else the client-side count of the answer).
//!
//! Load is bounded: at most [`ClientConfig::max_concurrency`] conversations in
//! flight (turns of one conversation are sequential), at most
//! [`ClientConfig::max_requests`] requests in all, no request started after
//! [`ClientConfig::max_duration`], each request bounded by
//! [`ClientConfig::request_timeout`]. A failed request is recorded with its
//! error and ends its conversation; the run goes on.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tracing::{debug, warn};

use crate::sse::{SseParser, StreamEvent, parse_event};
use crate::tokenizer::TokenCounter;
use crate::{Conversation, LoadgenError, Message, Result};

/// Header carrying the conversation id (also sent as body `conversation_id`).
pub const SESSION_HEADER: &str = "X-Session-ID";

/// Client settings. [`ClientConfig::new`] gives the defaults listed per field.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Server base URL, e.g. `http://127.0.0.1:8000` (`/v1/chat/completions` is appended).
    pub base_url: String,
    /// `model` sent; `None` (default): the first id of `GET /v1/models`.
    pub model: Option<String>,
    /// Conversations in flight at once (default 1).
    pub max_concurrency: usize,
    /// Requests in all (default 100 000).
    pub max_requests: usize,
    /// No request starts later than this after the run's start (default 600 s).
    pub max_duration: Duration,
    /// Bound on one request, headers to end of stream (default 300 s).
    pub request_timeout: Duration,
    /// Cap on `max_tokens` per request (default none).
    pub max_output_tokens: Option<u64>,
    /// `max_tokens` when a user turn has no reference answer after it (default 64).
    pub default_output_tokens: u64,
    /// Send `<id>@<mode>` as conversation id, so runs of several modes against
    /// the same servers do not share conversation state (default true).
    pub tag_ids_with_mode: bool,
    /// Extra top-level body fields merged into every request (e.g. `cache_salt`).
    pub extra_body: Map<String, Value>,
    /// Extra headers sent with every request.
    pub extra_headers: Vec<(String, String)>,
    /// Bearer token for `Authorization`, if any.
    pub api_key: Option<String>,
    /// Before each request, ask the server's `POST /tokenize` (vLLM's shape:
    /// `{"model", "messages"}` → `{"count"}`) for its prompt-token count and
    /// record it as [`RequestRecord::server_prompt_tokens`] (outside the
    /// timed span; `usage` in the stream, when sent, overrides it). Default false.
    pub server_tokenize: bool,
}

impl ClientConfig {
    /// Defaults (see each field) for `base_url`.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: None,
            max_concurrency: 1,
            max_requests: 100_000,
            max_duration: Duration::from_secs(600),
            request_timeout: Duration::from_secs(300),
            max_output_tokens: None,
            default_output_tokens: 64,
            tag_ids_with_mode: true,
            extra_body: Map::new(),
            extra_headers: Vec::new(),
            api_key: None,
            server_tokenize: false,
        }
    }
}

/// One request's measurements.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Conversation id as sent (`conversation_id`, `X-Session-ID`).
    pub conversation_id: String,
    /// 0-based user turn within the conversation.
    pub turn: usize,
    /// Prompt tokens counted by the client ([`TokenCounter::count_chat`]).
    pub input_tokens: u64,
    /// The server's prompt-token count (`usage.prompt_tokens`, or `/tokenize`
    /// with [`ClientConfig::server_tokenize`]), if any.
    pub server_prompt_tokens: Option<u64>,
    /// Output tokens (`usage.completion_tokens`, else the client's count of the answer).
    pub output_tokens: u64,
    /// `max_tokens` sent.
    pub max_tokens: u64,
    /// Time to first content/reasoning chunk, ms; `None` when none arrived.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, ms; `None` with < 2 output tokens.
    pub tpot_ms: Option<f64>,
    /// Send → end of stream (or failure), ms.
    pub latency_ms: f64,
    /// Send time relative to the run's start, ms.
    pub start_ms: f64,
    /// Error, when the request failed (HTTP status, transport, stream cut).
    pub error: Option<String>,
    /// What the server said beyond the OpenAI fields: response headers named
    /// `x-kvloop-*` (lower-case name → string) and non-standard top-level
    /// fields of stream chunks (e.g. `kv_transfer_params`; last one wins).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub server_info: Map<String, Value>,
}

/// Top-level fields of a `chat.completion.chunk` that are not copied into
/// [`RequestRecord::server_info`].
const STANDARD_CHUNK_FIELDS: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "choices",
    "usage",
    "system_fingerprint",
    "service_tier",
];

/// All requests of one run of a conversation set, labelled by mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModeRun {
    /// Mode label, e.g. `OFF`, `fixed`, `adaptive`.
    pub mode: String,
    /// Wall time of the run, ms.
    pub wall_ms: f64,
    /// Requests in order of their start.
    pub records: Vec<RequestRecord>,
    /// Free-form facts the caller attaches (threshold, transfer times, …);
    /// copied into the JSON report.
    #[serde(default)]
    pub meta: Map<String, Value>,
}

struct Shared {
    cfg: ClientConfig,
    http: reqwest::Client,
    url: String,
    model: String,
    mode: String,
    tok: TokenCounter,
    start: Instant,
    deadline: Instant,
    issued: AtomicUsize,
    records: Mutex<Vec<RequestRecord>>,
}

/// Milliseconds since `t`, rounded to microseconds (keeps the JSON short).
fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

fn config_err(field: &str, message: impl Into<String>) -> LoadgenError {
    LoadgenError::Config {
        field: field.into(),
        message: message.into(),
    }
}

/// Runs every conversation once against `cfg.base_url` and returns the
/// records labelled `mode`.
///
/// Errors: only for a bad configuration ([`LoadgenError::Config`]: URL,
/// concurrency 0, model lookup failing); failed requests are recorded.
pub async fn run_mode(
    mode: &str,
    conversations: &[Conversation],
    cfg: &ClientConfig,
    tok: &TokenCounter,
) -> Result<ModeRun> {
    if cfg.max_concurrency == 0 {
        return Err(config_err("max_concurrency", "must be >= 1"));
    }
    let base = cfg.base_url.trim_end_matches('/').to_string();
    let parsed = reqwest::Url::parse(&base)
        .map_err(|e| config_err("base_url", format!("not a URL ({e}): {base}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(config_err(
            "base_url",
            format!("expected http:// or https://, got {base}"),
        ));
    }
    let http = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| config_err("base_url", format!("HTTP client: {e}")))?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => discover_model(&http, &base, cfg).await?,
    };
    let start = Instant::now();
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        http,
        url: format!("{base}/v1/chat/completions"),
        model,
        mode: mode.to_string(),
        tok: *tok,
        start,
        deadline: start + cfg.max_duration,
        issued: AtomicUsize::new(0),
        records: Mutex::new(Vec::new()),
    });
    let convs = Arc::new(conversations.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..cfg.max_concurrency.min(convs.len()) {
        let (shared, convs, next) = (shared.clone(), convs.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(c) = convs.get(i) else { break };
                if !run_conversation(&shared, c).await {
                    break;
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            warn!("conversation worker failed: {e}");
        }
    }
    let mut records = std::mem::take(&mut *shared.records.lock().expect("records lock"));
    records.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    Ok(ModeRun {
        mode: mode.to_string(),
        wall_ms: ms_since(start),
        records,
        meta: Map::new(),
    })
}

async fn discover_model(http: &reqwest::Client, base: &str, cfg: &ClientConfig) -> Result<String> {
    let mut req = http
        .get(format!("{base}/v1/models"))
        .timeout(cfg.request_timeout);
    if let Some(k) = &cfg.api_key {
        req = req.bearer_auth(k);
    }
    let v: Value = async { req.send().await?.error_for_status()?.json().await }
        .await
        .map_err(|e: reqwest::Error| {
            config_err(
                "model",
                format!("not given and GET {base}/v1/models failed: {e}"),
            )
        })?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            config_err(
                "model",
                format!("not given and {base}/v1/models lists no model"),
            )
        })
}

/// Runs one conversation; returns false when the run's limits are reached.
async fn run_conversation(s: &Shared, conv: &Conversation) -> bool {
    let cid = if s.cfg.tag_ids_with_mode {
        format!("{}@{}", conv.id, s.mode)
    } else {
        conv.id.clone()
    };
    let mut history: Vec<Message> = Vec::new();
    let mut skip_reference = false;
    let mut turn = 0;
    for (i, m) in conv.messages.iter().enumerate() {
        match m.role.as_str() {
            "user" => {
                if Instant::now() >= s.deadline {
                    return false;
                }
                if s.issued.fetch_add(1, Ordering::Relaxed) >= s.cfg.max_requests {
                    return false;
                }
                history.push(m.clone());
                let reference = conv.messages.get(i + 1).filter(|n| n.role == "assistant");
                let mut max_tokens = reference
                    .map(|r| s.tok.count(&r.content).max(1) as u64)
                    .unwrap_or(s.cfg.default_output_tokens);
                if let Some(cap) = s.cfg.max_output_tokens {
                    max_tokens = max_tokens.min(cap);
                }
                let (record, answer) = send_turn(s, &cid, turn, &history, max_tokens).await;
                let failed = record.error.is_some();
                s.records.lock().expect("records lock").push(record);
                if failed {
                    return true;
                }
                history.push(Message::new("assistant", answer));
                skip_reference = true;
                turn += 1;
            }
            "assistant" if skip_reference => skip_reference = false,
            _ => {
                skip_reference = false;
                history.push(m.clone());
            }
        }
    }
    true
}

/// Sends one request; returns its record and the answer text.
async fn send_turn(
    s: &Shared,
    cid: &str,
    turn: usize,
    history: &[Message],
    max_tokens: u64,
) -> (RequestRecord, String) {
    let mut body = json!({
        "model": s.model,
        "messages": history,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "conversation_id": cid,
    });
    if let Value::Object(o) = &mut body {
        for (k, v) in &s.cfg.extra_body {
            o.insert(k.clone(), v.clone());
        }
    }
    let mut rec = RequestRecord {
        conversation_id: cid.to_string(),
        turn,
        input_tokens: s.tok.count_chat(history) as u64,
        server_prompt_tokens: None,
        output_tokens: 0,
        max_tokens,
        ttft_ms: None,
        tpot_ms: None,
        latency_ms: 0.0,
        start_ms: ms_since(s.start),
        error: None,
        server_info: Map::new(),
    };
    if s.cfg.server_tokenize {
        rec.server_prompt_tokens = server_count(s, history).await;
    }
    let t0 = Instant::now();
    let mut answer = String::new();
    let result = tokio::time::timeout(
        s.cfg.request_timeout,
        stream_answer(s, cid, &body, t0, &mut rec, &mut answer),
    )
    .await
    .unwrap_or_else(|_| Err(format!("timed out after {:?}", s.cfg.request_timeout)));
    rec.latency_ms = ms_since(t0);
    if rec.output_tokens == 0 {
        rec.output_tokens = s.tok.count(&answer) as u64;
    }
    if let (Some(ttft), true) = (rec.ttft_ms, rec.output_tokens > 1) {
        rec.tpot_ms =
            Some(((rec.latency_ms - ttft) / (rec.output_tokens - 1) as f64 * 1e3).round() / 1e3);
    }
    if let Err(e) = result {
        warn!(conversation_id = cid, turn, "request failed: {e}");
        rec.error = Some(e);
    }
    debug!(?rec, "request done");
    (rec, answer)
}

/// The server's prompt-token count from `POST /tokenize`; `None` (with a
/// debug log) when the server has no such endpoint or answers otherwise.
async fn server_count(s: &Shared, history: &[Message]) -> Option<u64> {
    let url = format!(
        "{}/tokenize",
        s.url.trim_end_matches("/v1/chat/completions")
    );
    let body = json!({"model": s.model, "messages": history});
    let mut req = s.http.post(&url).json(&body).timeout(s.cfg.request_timeout);
    if let Some(k) = &s.cfg.api_key {
        req = req.bearer_auth(k);
    }
    let v: Value = match async { req.send().await?.error_for_status()?.json().await }.await {
        Ok(v) => v,
        Err(e) => {
            let e: reqwest::Error = e;
            debug!("POST {url}: {e}");
            return None;
        }
    };
    v.get("count").and_then(Value::as_u64).or_else(|| {
        v.get("tokens")
            .and_then(Value::as_array)
            .map(|t| t.len() as u64)
    })
}

async fn stream_answer(
    s: &Shared,
    cid: &str,
    body: &Value,
    t0: Instant,
    rec: &mut RequestRecord,
    answer: &mut String,
) -> std::result::Result<(), String> {
    let mut req = s.http.post(&s.url).header(SESSION_HEADER, cid).json(body);
    for (k, v) in &s.cfg.extra_headers {
        req = req.header(k, v);
    }
    if let Some(k) = &s.cfg.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| format!("POST {}: {e}", s.url))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!(
            "HTTP {status}: {}",
            text.chars().take(300).collect::<String>()
        ));
    }
    for (name, value) in resp.headers() {
        if name.as_str().starts_with("x-kvloop-") {
            let v = String::from_utf8_lossy(value.as_bytes()).into_owned();
            rec.server_info
                .insert(name.as_str().to_string(), Value::String(v));
        }
    }
    let mut parser = SseParser::new();
    let mut stream = resp.bytes_stream();
    let mut done = false;
    let mut finished = false;
    let mut handle = |data: String,
                      rec: &mut RequestRecord,
                      answer: &mut String|
     -> std::result::Result<bool, String> {
        if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(&data) {
            for (k, v) in o {
                if !STANDARD_CHUNK_FIELDS.contains(&k.as_str()) && k != "error" {
                    rec.server_info.insert(k, v);
                }
            }
        }
        match parse_event(&data)? {
            StreamEvent::Done => Ok(true),
            StreamEvent::Error(e) => Err(format!("error in stream: {e}")),
            StreamEvent::Chunk(c) => {
                if rec.ttft_ms.is_none() && (!c.content.is_empty() || !c.reasoning.is_empty()) {
                    rec.ttft_ms = Some(ms_since(t0));
                }
                answer.push_str(&c.content);
                if let Some(p) = c.prompt_tokens {
                    rec.server_prompt_tokens = Some(p);
                }
                if let Some(n) = c.completion_tokens {
                    rec.output_tokens = n;
                }
                finished |= c.finish_reason.is_some();
                Ok(false)
            }
        }
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("reading stream: {e}"))?;
        for data in parser.push(&chunk) {
            done |= handle(data, rec, answer)?;
        }
        if done {
            break;
        }
    }
    if let Some(data) = parser.finish() {
        done |= handle(data, rec, answer)?;
    }
    if !done && !finished {
        return Err("stream ended before a finish_reason or [DONE]".into());
    }
    Ok(())
}
