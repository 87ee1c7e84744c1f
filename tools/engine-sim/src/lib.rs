//! vLLM-protocol engine simulator (P or D role) for tests and the demo.
//!
//! `kvloop-engine-sim` follows the engine-side rules of `shared/PROTOCOL.md`
//! closely enough to test the router end to end:
//!
//! - **Prefill role (P)**: answers `/v1/completions` and `/v1/chat/completions`
//!   with one token and a top-level `kv_transfer_params`
//!   (`do_remote_prefill: true`), holding its blocks under a lease
//!   ([`SimConfig::lease_ms`]). When the request carries D's params
//!   (`do_remote_decode: true` with block ids) it READs
//!   `min(remote_num_tokens, prompt_tokens)` tokens through its [`KvTransfer`]
//!   and computes only the rest; invalid, expired or already-read params mean a
//!   local recompute with a warning, never a crash.
//! - **Decode role (D)**: READs P's blocks (or recomputes when that fails),
//!   streams `max_tokens` tokens, and on a normal finish holds its blocks for
//!   [`SimConfig::decoder_kv_blocks_ttl_ms`] and returns its own params with
//!   `remote_blocks_expiry_time` (seconds on D's process clock).
//! - Both roles serve `/tokenize` (vLLM's shape) with a deterministic
//!   whitespace tokenizer and a fixed chat template, so P and D agree.
//!
//! Prefill latency is `prefill_us_per_token × computed tokens`, or with
//! `--profile` a calibrated cost profile ([`profile`]: `qwen3-32b-h200`,
//! `glm-5-fp8-h200`, fitted to the published TTFTs), spent as a real sleep
//! scaled by `--time-scale`. The KV side is pluggable through [`KvTransfer`]:
//!
//! - `--kv-mode none` (default): [`SimulatedTransfer`] checks the remote lease
//!   over the emitter's side channel (HTTP on the side-channel address) and
//!   sleeps `transfer_us_per_token × tokens`.
//! - `--kv-mode inproc`: real KV memory ([`kv`]): memfd regions registered
//!   with an in-process `kvloop-dataplane` transfer engine (observe mode, as
//!   stock vLLM with NIXL); KV content deterministic per (token id, position,
//!   layer), written when a prefill computes tokens; [`DataplaneTransfer`]
//!   claims the emitter's blocks on its side channel, READs them over
//!   libfabric and notifies the owner, which frees them; every arriving block
//!   is verified byte-exact (`verified_blocks`, `mismatched_blocks` in
//!   `/sim/stats` and `/metrics`), and a mismatch means a recompute, never
//!   wrong KV served.
//! - `--kv-mode agent` (managed mode, [`managed`]): the same memfd KV
//!   memory, registered with the node agent (`--agent-socket`), which maps
//!   the same pages. The agent serves this engine's blocks on its side
//!   channel (that address goes into `kv_transfer_params`), keeps the leases
//!   (the engine retains every held request there, and frees the blocks
//!   when the agent reports the lease released: owner notification, TTL),
//!   and does this engine's READs: it renews the owner's lease through the
//!   owner's agent, declines blocks the lease does not cover or that expire
//!   within the safety margin, READs, and notifies the owner. Every block
//!   that arrives is verified byte-exact as in `inproc`.
//!
//! With `--agent-socket`, a prefill engine also reports every prefill's
//! timing to the agent's cost model, in any mode.
//!
//! `GET /metrics` uses vLLM's metric names ([`metrics`]); `GET /sim/reads`
//! lists the READs this engine performed (direction, tokens, bytes, ms).
//!
//! Test knobs travel in the request body as an object `"sim"` (the router
//! passes unknown fields through): `fail_prefill`, `fail_prefill_with_params`,
//! `fail_decode` (bools → HTTP 500), `reasoning`, `tool_call` (bools → extra
//! output deltas), `truncate_stream` (bool → the stream ends before the finish
//! chunk), `finish_reason` (string override).
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::{debug, warn};

pub mod kv;
pub mod managed;
pub mod metrics;
pub mod profile;

pub use kv::{DataplaneTransfer, KvMemory, KvShape, VerifyOutcome};
pub use profile::CostProfile;

/// Where an engine's KV lives and who performs its READs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// No KV memory: READs are simulated by [`SimulatedTransfer`] (a sleep).
    None,
    /// Real memfd KV regions and an in-process transfer engine that does the
    /// engine's own READs (observe mode, like stock vLLM with NIXL).
    Inproc,
    /// Real memfd KV regions registered with the node agent
    /// (`--agent-socket`), which serves them, keeps their leases and does the
    /// engine's READs (managed mode).
    Agent,
}

/// How prompts become tokens (both roles must agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per whitespace-separated word ([`tokenize_text`]).
    Words,
    /// Word pieces ([`tokenize_pieces`]): about as many tokens as a BPE
    /// tokenizer (cl100k) on source code, still prefix-stable at word boundaries.
    Pieces,
}

/// Role of a simulated engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill engine (P): computes the prompt, returns one token and its params.
    Prefill,
    /// Decode engine (D): generates the answer and keeps its blocks for the next turn.
    Decode,
}

/// Configuration of one simulated engine. Every field has a default suited to
/// tests; numbers are simulation knobs, not measurements.
#[derive(Clone, Debug, clap::Args)]
pub struct SimConfig {
    /// Role of this engine.
    #[arg(long, value_enum, default_value = "prefill")]
    pub role: Role,
    /// Engine id (`remote_engine_id` in the params it emits).
    #[arg(long, default_value = "sim-0")]
    pub engine_id: String,
    /// Model name served (`/v1/models`).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// OpenAI-compatible HTTP listen address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub http_addr: SocketAddr,
    /// Side-channel listen address (lease checks and READ notifications).
    /// Not listened on in `--kv-mode agent`: the agent's side channel
    /// serves the engine's blocks there.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub side_channel_addr: SocketAddr,
    /// Host written into `remote_host` (default: the side-channel IP, bracketed if IPv6).
    #[arg(long)]
    pub advertised_host: Option<String>,
    /// Prefill cost per computed token, microseconds (real sleep).
    #[arg(long, default_value_t = 20)]
    pub prefill_us_per_token: u64,
    /// Simulated READ cost per transferred token, microseconds (real sleep).
    #[arg(long, default_value_t = 2)]
    pub transfer_us_per_token: u64,
    /// Delay between streamed output tokens, microseconds.
    #[arg(long, default_value_t = 0)]
    pub decode_us_per_token: u64,
    /// How long D keeps a finished request's blocks, ms (vLLM default 480 s).
    #[arg(long, default_value_t = 480_000)]
    pub decoder_kv_blocks_ttl_ms: u64,
    /// How long P holds its blocks after a prefill waiting for D's READ, ms (vLLM: 30 s).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// An emitter declines a READ of blocks expiring within this margin, ms (vLLM: 5 s).
    #[arg(long, default_value_t = 5_000)]
    pub expiry_margin_ms: u64,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size_tokens: u32,
    /// Blocks in the simulated KV cache.
    #[arg(long, default_value_t = 1 << 20)]
    pub num_blocks: u32,
    /// Tensor-parallel size reported in the params.
    #[arg(long, default_value_t = 1)]
    pub tp_size: u32,
    /// Output tokens when the request has no `max_tokens`.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u64,
    /// P-side recompute threshold (tokens): below it P recomputes even with params.
    /// 0 leaves the decision to the router.
    #[arg(long, default_value_t = 0)]
    pub kv_recompute_threshold_tokens: u64,
    /// Do not serve `/tokenize` (404), like an engine without that endpoint.
    #[arg(long)]
    pub no_tokenize: bool,
    /// Prefill cost profile (`qwen3-32b-h200`, `glm-5-fp8-h200`); replaces
    /// `prefill_us_per_token` with `t0 + new × (a + b × (ctx + new/2))` (see [`profile`]).
    #[arg(long)]
    pub profile: Option<String>,
    /// Multiplies every simulated compute time (prefill, decode); 0.5 runs
    /// twice as fast as real time. Transfers are real and never scaled.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// KV memory and READs: `none` (simulated), `inproc` (real memfd KV and
    /// in-process READs), `agent` (real memfd KV managed by the node agent
    /// at `--agent-socket`).
    #[arg(long, value_enum, default_value = "none")]
    pub kv_mode: KvMode,
    /// KV bytes per token over all layers (scaled; see [`kv`]). Default
    /// 2048 = 4 layers × 512 B (real Qwen3-32B: 256 KiB, 32 KiB per GPU at TP 8).
    #[arg(long, default_value_t = 2048)]
    pub kv_bytes_per_token: u64,
    /// Simulated layers (one memory region each).
    #[arg(long, default_value_t = 4)]
    pub kv_layers: u32,
    /// KV capacity in tokens with real KV memory (caps `num_blocks`).
    #[arg(long, default_value_t = 262_144)]
    pub kv_capacity_tokens: u64,
    /// libfabric provider of the in-process transfer engine (`inproc`; in
    /// `agent` mode the agent's configured backend is used).
    #[arg(long, default_value = "tcp;ofi_rxm")]
    pub kv_provider: String,
    /// Transfer-engine side-channel address (default: the side-channel IP,
    /// port 0). In `agent` mode only its port is used (0: the agent picks),
    /// on the agent's node address.
    #[arg(long)]
    pub kv_listen: Option<SocketAddr>,
    /// READ timeout, ms.
    #[arg(long, default_value_t = 5_000)]
    pub kv_read_timeout_ms: u64,
    /// Tokenizer: `words` or `pieces`.
    #[arg(long, value_enum, default_value = "words")]
    pub tokenizer: TokenizerKind,
    /// Unix socket of the node agent (`kvloop-agent`). Required by
    /// `--kv-mode agent` (the KV memory is registered there); in any mode a
    /// prefill engine reports every prefill's (prompt tokens, reused tokens,
    /// latency) to it, which feeds the agent's cost model.
    #[arg(long)]
    pub agent_socket: Option<std::path::PathBuf>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            role: Role::Prefill,
            engine_id: "sim-0".into(),
            model: "sim-model".into(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            side_channel_addr: "127.0.0.1:0".parse().unwrap(),
            advertised_host: None,
            prefill_us_per_token: 20,
            transfer_us_per_token: 2,
            decode_us_per_token: 0,
            decoder_kv_blocks_ttl_ms: 480_000,
            lease_ms: 30_000,
            expiry_margin_ms: 5_000,
            block_size_tokens: 16,
            num_blocks: 1 << 20,
            tp_size: 1,
            default_max_tokens: 16,
            kv_recompute_threshold_tokens: 0,
            no_tokenize: false,
            profile: None,
            time_scale: 1.0,
            kv_mode: KvMode::None,
            kv_bytes_per_token: 2048,
            kv_layers: 4,
            kv_capacity_tokens: 262_144,
            kv_provider: "tcp;ofi_rxm".into(),
            kv_listen: None,
            kv_read_timeout_ms: 5_000,
            tokenizer: TokenizerKind::Words,
            agent_socket: None,
        }
    }
}

/// Token id of one whitespace-separated word: FNV-1a 64 of its bytes mod 100 000.
pub fn token_id(word: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in word.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % 100_000) as u32
}

/// Deterministic tokenizer: one token per whitespace-separated word.
pub fn tokenize_text(text: &str) -> Vec<u32> {
    text.split_whitespace().map(token_id).collect()
}

/// Word-piece tokenizer: each whitespace-separated word is split into runs
/// of alphanumeric characters cut every 6 characters and runs of other
/// characters cut every 3; each piece is one token (FNV-1a of its bytes mod
/// 100 000). Words are tokenized independently, so texts joined at
/// whitespace keep their token prefixes. On the demo's source-code
/// conversations it counts within ~5 % of tiktoken's cl100k_base
/// (1052 / 4161 / 25013 pieces for 1089 / 4161 / ~24.7k cl100k tokens).
pub fn tokenize_pieces(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let mut run = String::new();
    for w in text.split_whitespace() {
        let mut kind: Option<bool> = None;
        let mut len = 0usize;
        for ch in w.chars() {
            let k = ch.is_alphanumeric();
            let limit = if k { 6 } else { 3 };
            if kind.is_some_and(|prev| prev != k) || len == limit {
                out.push(token_id(&run));
                run.clear();
                len = 0;
            }
            kind = Some(k);
            run.push(ch);
            len += 1;
        }
        if !run.is_empty() {
            out.push(token_id(&run));
            run.clear();
        }
    }
    out
}

/// Tokens of `text` with tokenizer `kind`.
pub fn tokenize_with(kind: TokenizerKind, text: &str) -> Vec<u32> {
    match kind {
        TokenizerKind::Words => tokenize_text(text),
        TokenizerKind::Pieces => tokenize_pieces(text),
    }
}

/// The fixed chat template: `<|role|> content ` per message, then `<|assistant|>`.
/// Content may be a string or an array of `{"type":"text","text":...}` parts.
pub fn render_chat(messages: &[Value]) -> String {
    let mut s = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|> ");
        match m.get("content") {
            Some(Value::String(c)) => s.push_str(c),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        s.push_str(t);
                        s.push(' ');
                    }
                }
            }
            _ => {}
        }
        s.push(' ');
    }
    s.push_str("<|assistant|>");
    s
}

/// Tokens of a request body: `prompt` (string or array of token ids) or `messages`.
///
/// # Errors
/// A message naming the missing or malformed field.
pub fn tokenize_body(body: &Value) -> Result<Vec<u32>, String> {
    tokenize_body_with(TokenizerKind::Words, body)
}

/// As [`tokenize_body`] with tokenizer `kind`.
///
/// # Errors
/// A message naming the missing or malformed field.
pub fn tokenize_body_with(kind: TokenizerKind, body: &Value) -> Result<Vec<u32>, String> {
    if let Some(p) = body.get("prompt") {
        return match p {
            Value::String(s) => Ok(tokenize_with(kind, s)),
            Value::Array(a) => a
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or_else(|| {
                            "prompt: expected a string or an array of token ids".to_string()
                        })
                })
                .collect(),
            _ => Err("prompt: expected a string or an array of token ids".into()),
        };
    }
    if let Some(m) = body.get("messages") {
        let Some(a) = m.as_array() else {
            return Err("messages: expected an array".into());
        };
        return Ok(tokenize_with(kind, &render_chat(a)));
    }
    Err("prompt or messages: required".into())
}

/// Free-list block allocator over `0..num_blocks`.
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<u32>,
}

impl BlockAllocator {
    /// All blocks free; low ids are handed out first.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).rev().collect(),
        }
    }
    /// Allocate `n` blocks, or `None` when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        Some(v)
    }
    /// Return blocks to the free list.
    pub fn release(&mut self, ids: &[u32]) {
        self.free.extend(ids.iter().rev());
    }
    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
}

/// Blocks held for a finished request until read or expired.
#[derive(Debug, Clone)]
struct Hold {
    block_ids: Vec<u32>,
    num_tokens: u64,
    expires_at: Instant,
    /// Managed mode: leased at the node agent, whose lease table decides
    /// when the blocks are free again (a reader may have renewed the lease
    /// past `expires_at`): freed on the agent's release event, or evicted
    /// once the agent has ended the lease; never by the sweep while the
    /// agent is reachable.
    agent_lease: bool,
}

/// One READ a reader asks its [`KvTransfer`] to perform.
#[derive(Debug, Clone)]
pub struct ReadRequest {
    /// The reader's engine id.
    pub reader_engine_id: String,
    /// Emitter's engine id.
    pub remote_engine_id: String,
    /// Emitter's side-channel host (possibly a bracketed IPv6 literal).
    pub remote_host: String,
    /// Emitter's side-channel port.
    pub remote_port: u16,
    /// Emitter's request id (owner of the blocks).
    pub remote_request_id: String,
    /// Emitter's block ids, flattened over KV-cache groups.
    pub remote_block_ids: Vec<u32>,
    /// Tokens to read.
    pub num_tokens: u64,
    /// The reader's destination blocks: the first `ceil(num_tokens / block_size_tokens)`
    /// blocks of the reader's allocation for this request.
    pub local_block_ids: Vec<u32>,
    /// Tokens per block (the reader's; the sim assumes both sides agree).
    pub block_size_tokens: u32,
}

impl ReadRequest {
    /// The (remote, local) block pairs of the first
    /// `ceil(num_tokens / block_size_tokens)` blocks on each side.
    ///
    /// # Errors
    /// [`TransferError::Declined`] when either side lists fewer blocks.
    pub fn block_pairs(&self) -> Result<Vec<kvloop_dataplane::BlockPair>, TransferError> {
        let bs = u64::from(self.block_size_tokens.max(1));
        let n_blocks = self.num_tokens.div_ceil(bs) as usize;
        if self.remote_block_ids.len() < n_blocks || self.local_block_ids.len() < n_blocks {
            return Err(TransferError::Declined(format!(
                "{} tokens need {n_blocks} blocks; remote_block_ids has {}, local {}",
                self.num_tokens,
                self.remote_block_ids.len(),
                self.local_block_ids.len()
            )));
        }
        Ok(self.remote_block_ids[..n_blocks]
            .iter()
            .zip(&self.local_block_ids[..n_blocks])
            .map(|(r, l)| kvloop_dataplane::BlockPair {
                remote: u64::from(*r),
                local: u64::from(*l),
            })
            .collect())
    }
}

/// Why a READ was not done (the reader then recomputes).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The emitter no longer holds the blocks (read already, expired, unknown).
    #[error("emitter declined the READ: {0}")]
    Declined(String),
    /// Side channel unreachable or broken.
    #[error("side channel: {0}")]
    SideChannel(String),
    /// The READ itself failed (connect, bounds, timeout, backend).
    #[error("READ failed: {0}")]
    Transfer(String),
}

/// Boxed future returned by [`KvTransfer::read`].
pub type ReadFuture<'a> = Pin<Box<dyn Future<Output = Result<u64, TransferError>> + Send + 'a>>;

/// The KV side of an engine: performs one READ of a remote engine's blocks and
/// notifies the owner. Returns the tokens read. A managed-mode implementation
/// asks the node agent to do the READ.
pub trait KvTransfer: Send + Sync + 'static {
    /// Read `req.num_tokens` tokens of KV from the emitter and notify it.
    fn read(&self, req: ReadRequest) -> ReadFuture<'_>;
}

/// Simulated transfer: checks the emitter's lease over its side channel (which
/// also acts as the read notification, freeing the blocks), then sleeps
/// `transfer_us_per_token × tokens`.
pub struct SimulatedTransfer {
    http: reqwest::Client,
    transfer_us_per_token: u64,
}

impl SimulatedTransfer {
    /// A transfer with the given per-token cost (microseconds).
    pub fn new(transfer_us_per_token: u64) -> Self {
        Self {
            http: side_channel_http(),
            transfer_us_per_token,
        }
    }
}

/// `host:port` with IPv6 literals bracketed (idempotent for bracketed input).
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl KvTransfer for SimulatedTransfer {
    fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
        Box::pin(async move {
            claim_on_side_channel(&self.http, &req, false).await?;
            sleep_us(self.transfer_us_per_token * req.num_tokens).await;
            Ok(req.num_tokens)
        })
    }
}

/// An HTTP client for side-channel claims (no Nagle delay).
pub(crate) fn side_channel_http() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .expect("http client")
}

/// Claims the emitter's held blocks on its side channel (`POST /kv/read`):
/// the emitter checks that the hold exists, covers the blocks and tokens and
/// does not expire within its margin. With `defer_release` it keeps the
/// blocks until the reader's owner notification and answers with its
/// transfer engine's address; without, the claim itself frees them.
/// Returns the emitter's JSON answer (null when it has no body).
///
/// # Errors
/// [`TransferError::SideChannel`] when unreachable or the answer is not
/// JSON; [`TransferError::Declined`] when the emitter refuses.
pub(crate) async fn claim_on_side_channel(
    http: &reqwest::Client,
    req: &ReadRequest,
    defer_release: bool,
) -> Result<Value, TransferError> {
    let url = format!(
        "http://{}/kv/read",
        host_port(&req.remote_host, req.remote_port)
    );
    let body = json!({
        "remote_request_id": req.remote_request_id,
        "remote_engine_id": req.remote_engine_id,
        "block_ids": req.remote_block_ids,
        "num_tokens": req.num_tokens,
        "reader_engine_id": req.reader_engine_id,
        "defer_release": defer_release,
    });
    let resp = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| TransferError::SideChannel(format!("{url}: {e}")))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(TransferError::Declined(format!("{status}: {text}")));
    }
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| TransferError::SideChannel(format!("{url}: reply: {e}")))?;
    if bytes.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| TransferError::SideChannel(format!("{url}: reply: {e}")))
}

/// A decode request's blocks: released on drop unless held for the next turn.
struct BlockGuard {
    engine: Arc<Engine>,
    ids: Vec<u32>,
}

impl BlockGuard {
    /// Grow to cover `num_tokens` tokens and hold for `decoder_kv_blocks_ttl_ms`
    /// ([`Engine::hold`]: returns the params of the next turn, or null).
    /// With real KV, writes the KV of the generated tokens (`all_tokens` =
    /// prompt then generated, positions `n_prompt..num_tokens`).
    async fn extend_and_hold(
        mut self,
        request_id: &str,
        num_tokens: u64,
        all_tokens: &[u32],
        n_prompt: usize,
    ) -> Value {
        let e = self.engine.clone();
        let more = e.blocks_for(num_tokens).saturating_sub(self.ids.len());
        let mut ids = std::mem::take(&mut self.ids);
        ids.extend(e.allocate_blocks(more).await);
        if let Some(kv) = &e.kv {
            kv.write_tokens(&ids, all_tokens, n_prompt, num_tokens as usize);
        }
        e.hold(request_id, ids, num_tokens, e.decoder_ttl()).await
    }
}

impl Drop for BlockGuard {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.engine.alloc.lock().unwrap().release(&self.ids);
        }
    }
}

/// Sleep `us` microseconds; no timer at all for 0 (a zero-length tokio sleep
/// still waits for the next timer tick, about 1 ms).
async fn sleep_us(us: u64) {
    if us > 0 {
        tokio::time::sleep(Duration::from_micros(us)).await;
    }
}

/// Counters exposed at `GET /sim/stats`.
#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    reads_ok: AtomicU64,
    reads_declined: AtomicU64,
    invalid_params: AtomicU64,
    reused_tokens: AtomicU64,
    computed_tokens: AtomicU64,
    side_reads_served: AtomicU64,
    side_reads_refused: AtomicU64,
    verified_blocks: AtomicU64,
    mismatched_blocks: AtomicU64,
}

/// One READ this engine performed (`GET /sim/reads`, newest last, at most
/// [`READ_LOG_CAPACITY`] kept).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReadLogEntry {
    /// This engine's request id.
    pub request_id: String,
    /// `d2p` (a P engine reading D's retained blocks) or `p2d`.
    pub direction: String,
    /// Prompt tokens of the request.
    pub prompt_tokens: u64,
    /// Tokens the READ covered (0 when it failed).
    pub tokens: u64,
    /// Payload bytes (real KV) or 0 (simulated).
    pub bytes: u64,
    /// Claim + transfer time, ms.
    pub transfer_ms: f64,
    /// Blocks verified byte-exact.
    pub verified_blocks: u64,
    /// Blocks that differed (the request was recomputed).
    pub mismatched_blocks: u64,
    /// Error, when the READ failed or was declined.
    pub error: Option<String>,
}

/// Entries kept in the READ log.
pub const READ_LOG_CAPACITY: usize = 8192;

/// Snapshot of the engine's counters (`GET /sim/stats`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatsSnapshot {
    /// Generation requests received.
    pub requests: u64,
    /// READs this engine performed successfully.
    pub reads_ok: u64,
    /// READs this engine attempted that were declined (then recomputed).
    pub reads_declined: u64,
    /// Requests whose params were invalid (then recomputed).
    pub invalid_params: u64,
    /// Prompt tokens read from a remote engine instead of computed.
    pub reused_tokens: u64,
    /// Prompt tokens computed locally.
    pub computed_tokens: u64,
    /// READs of this engine's blocks served on the side channel.
    pub side_reads_served: u64,
    /// READs of this engine's blocks refused (unknown, expired, expiring).
    pub side_reads_refused: u64,
    /// READ blocks verified byte-exact (real KV only).
    #[serde(default)]
    pub verified_blocks: u64,
    /// READ blocks that differed from the locally computed KV (real KV only).
    #[serde(default)]
    pub mismatched_blocks: u64,
    /// KV mode (`none`, `inproc`, `agent`).
    #[serde(default)]
    pub kv_mode: Option<KvMode>,
    /// Requests currently holding blocks.
    pub holds: u64,
    /// Last `X-KVLoop-Tokens` header seen, if any.
    pub last_tokens_header: Option<String>,
    /// `kv_transfer_params` of the last generation request, if any.
    pub last_kv_transfer_params: Option<Value>,
}

/// Shared state of one engine.
pub struct Engine {
    cfg: SimConfig,
    advertised_host: String,
    side_port: u16,
    start: Instant,
    alloc: Mutex<BlockAllocator>,
    holds: Mutex<HashMap<String, Hold>>,
    transfer: Arc<dyn KvTransfer>,
    stats: Stats,
    last_tokens_header: Mutex<Option<String>>,
    last_params: Mutex<Option<Value>>,
    next_request: AtomicU64,
    kv: Option<Arc<KvMemory>>,
    profile: Option<CostProfile>,
    /// Holds claimed by a reader (`defer_release`): freed by the owner
    /// notification or when the deadline passes.
    reading: Mutex<HashMap<String, Hold>>,
    metrics: metrics::Metrics,
    read_log: Mutex<std::collections::VecDeque<ReadLogEntry>>,
    agent: Option<Arc<managed::AgentLink>>,
    /// Managed mode: the agent connection was lost; holds are swept locally.
    agent_lost: std::sync::atomic::AtomicBool,
    agent_reports_failed: AtomicU64,
}

/// A running engine: its addresses and a handle to stop it.
pub struct SimHandle {
    /// OpenAI-compatible HTTP address.
    pub http_addr: SocketAddr,
    /// Side-channel address.
    pub side_channel_addr: SocketAddr,
    /// The engine state.
    pub engine: Arc<Engine>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl SimHandle {
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }
    /// Stop serving (in-flight requests are dropped).
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start an engine with the [`SimulatedTransfer`] on the current tokio runtime.
///
/// # Errors
/// When a listen address cannot be bound.
pub async fn spawn(cfg: SimConfig) -> std::io::Result<SimHandle> {
    let link = connect_agent(&cfg).await?;
    match cfg.kv_mode {
        KvMode::None => {
            let t = Arc::new(SimulatedTransfer::new(cfg.transfer_us_per_token));
            spawn_inner(cfg, t, None, link).await
        }
        KvMode::Inproc => {
            let kv = Arc::new(start_kv(&cfg).await?);
            let dir = match cfg.role {
                Role::Prefill => kvloop_common::Direction::DecodeToPrefill,
                Role::Decode => kvloop_common::Direction::PrefillToDecode,
            };
            let t = Arc::new(DataplaneTransfer::new(
                kv.clone(),
                dir,
                cfg.kv_read_timeout_ms,
            ));
            spawn_inner(cfg, t, Some(kv), link).await
        }
        KvMode::Agent => {
            let Some(link) = link else {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "agent_socket: required with kv_mode `agent` (the node agent's Unix socket)",
                ));
            };
            let port = cfg.kv_listen.map(|a| a.port()).filter(|p| *p != 0);
            let kv = Arc::new(
                KvMemory::register_with_agent(&cfg.engine_id, kv_shape(&cfg), link.clone(), port)
                    .await
                    .map_err(std::io::Error::other)?,
            );
            let reg = kv.registration().expect("agent backing").clone();
            let dir = match cfg.role {
                Role::Prefill => kvloop_agent_api::proto::ReadDirection::D2p,
                Role::Decode => kvloop_agent_api::proto::ReadDirection::P2d,
            };
            let t = Arc::new(managed::AgentTransfer::new(
                reg,
                dir,
                cfg.kv_read_timeout_ms,
            ));
            spawn_inner(cfg, t, Some(kv), Some(link)).await
        }
    }
}

/// The KV shape `cfg` asks for (capacity capped by `num_blocks`).
pub fn kv_shape(cfg: &SimConfig) -> KvShape {
    let bs = cfg.block_size_tokens.max(1);
    let blocks = cfg
        .kv_capacity_tokens
        .div_ceil(u64::from(bs))
        .min(u64::from(cfg.num_blocks))
        .max(1) as u32;
    KvShape {
        bytes_per_token: cfg.kv_bytes_per_token,
        layers: cfg.kv_layers,
        block_size_tokens: bs,
        num_blocks: blocks,
    }
}

async fn start_kv(cfg: &SimConfig) -> std::io::Result<KvMemory> {
    let listen = cfg
        .kv_listen
        .unwrap_or_else(|| SocketAddr::new(cfg.side_channel_addr.ip(), 0));
    KvMemory::start(
        &cfg.engine_id,
        kv_shape(cfg),
        &cfg.kv_provider,
        listen,
        cfg.kv_read_timeout_ms,
    )
    .await
    .map_err(std::io::Error::other)
}

/// Start an engine with a custom [`KvTransfer`].
///
/// # Errors
/// When a listen address cannot be bound.
pub async fn spawn_with_transfer(
    cfg: SimConfig,
    transfer: Arc<dyn KvTransfer>,
) -> std::io::Result<SimHandle> {
    let link = connect_agent(&cfg).await?;
    spawn_inner(cfg, transfer, None, link).await
}

/// The connection pool to the node agent at `cfg.agent_socket`, if set.
async fn connect_agent(cfg: &SimConfig) -> std::io::Result<Option<Arc<managed::AgentLink>>> {
    let Some(path) = &cfg.agent_socket else {
        return Ok(None);
    };
    let link = managed::AgentLink::connect(path, &cfg.engine_id)
        .await
        .map_err(|e| {
            std::io::Error::other(format!(
                "agent_socket: cannot reach the agent at {}: {e}",
                path.display()
            ))
        })?;
    Ok(Some(Arc::new(link)))
}

async fn spawn_inner(
    mut cfg: SimConfig,
    transfer: Arc<dyn KvTransfer>,
    kv: Option<Arc<KvMemory>>,
    agent: Option<Arc<managed::AgentLink>>,
) -> std::io::Result<SimHandle> {
    let profile = match &cfg.profile {
        None => None,
        Some(name) => Some(CostProfile::by_name(name).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "profile: unknown `{name}`; expected one of {}",
                    profile::PROFILE_NAMES.join(", ")
                ),
            )
        })?),
    };
    if !(cfg.time_scale.is_finite() && cfg.time_scale >= 0.0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "time_scale: expected a finite number >= 0, got {}",
                cfg.time_scale
            ),
        ));
    }
    if let Some(kv) = &kv {
        // The allocator hands out exactly the blocks the KV regions hold.
        cfg.num_blocks = kv.shape().num_blocks;
    }
    let http = TcpListener::bind(cfg.http_addr).await?;
    let http_addr = http.local_addr()?;
    // Managed mode: readers reach this engine's blocks through the agent's
    // side channel; the engine's own (HTTP lease-check) side channel is
    // not served.
    let managed_side = kv
        .as_ref()
        .and_then(|k| k.registration().map(|r| r.side_channel()));
    let (side, side_channel_addr) = match managed_side {
        Some(addr) => (None, addr),
        None => {
            let l = TcpListener::bind(cfg.side_channel_addr).await?;
            let a = l.local_addr()?;
            (Some(l), a)
        }
    };
    let advertised_host =
        cfg.advertised_host
            .clone()
            .unwrap_or_else(|| match side_channel_addr.ip() {
                std::net::IpAddr::V6(v6) => format!("[{v6}]"),
                std::net::IpAddr::V4(v4) => v4.to_string(),
            });
    let engine = Arc::new(Engine {
        alloc: Mutex::new(BlockAllocator::new(cfg.num_blocks)),
        advertised_host,
        side_port: side_channel_addr.port(),
        start: Instant::now(),
        holds: Mutex::new(HashMap::new()),
        transfer,
        stats: Stats::default(),
        last_tokens_header: Mutex::new(None),
        last_params: Mutex::new(None),
        next_request: AtomicU64::new(0),
        kv,
        profile,
        reading: Mutex::new(HashMap::new()),
        metrics: metrics::Metrics::new(),
        read_log: Mutex::new(std::collections::VecDeque::new()),
        agent,
        agent_lost: std::sync::atomic::AtomicBool::new(false),
        agent_reports_failed: AtomicU64::new(0),
        cfg,
    });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let mut app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/sim/stats", get(stats))
        .route("/sim/reads", get(reads))
        .route("/metrics", get(metrics_text));
    if !engine.cfg.no_tokenize {
        app = app.route("/tokenize", post(tokenize));
    }
    let app = app.with_state(engine.clone());
    let side_app = Router::new()
        .route("/kv/read", post(side_read))
        .with_state(engine.clone());
    let (side_tx, side_rx) = tokio::sync::oneshot::channel::<()>();
    let side_rx = async move {
        let _ = side_rx.await;
    };
    tokio::spawn(async move {
        let _ = axum::serve(
            http.tap_io(|t| {
                let _ = t.set_nodelay(true);
            }),
            app,
        )
        .with_graceful_shutdown(async move {
            let _ = rx.await;
            let _ = side_tx.send(());
        })
        .await;
    });
    if let Some(side) = side {
        tokio::spawn(async move {
            let _ = axum::serve(
                side.tap_io(|t| {
                    let _ = t.set_nodelay(true);
                }),
                side_app,
            )
            .with_graceful_shutdown(side_rx)
            .await;
        });
    }
    if let Some(reg) = engine.kv.as_ref().and_then(|k| k.registration()) {
        // Managed mode: the agent's lease releases free the blocks.
        let weak = Arc::downgrade(&engine);
        let link = reg.link().clone();
        let id = engine.cfg.engine_id.clone();
        tokio::spawn(async move {
            let w = weak.clone();
            let r = managed::run_events(link, id, move |request_id| {
                let Some(e) = w.upgrade() else { return false };
                if let Some(id) = request_id {
                    e.release_held(id);
                }
                true
            })
            .await;
            if let (Err(err), Some(e)) = (r, weak.upgrade()) {
                warn!(engine = %e.cfg.engine_id, error = %err,
                      "the node agent no longer hosts this engine: holds are freed at their deadline, READs recompute");
                e.agent_lost.store(true, Ordering::Relaxed);
            }
        });
    }
    if let Some(dp) = engine.kv.as_ref().and_then(|k| k.transfer_engine()) {
        // Owner notifications free the blocks a reader claimed.
        let mut rx = dp.subscribe_notifications();
        let weak = Arc::downgrade(&engine);
        tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(n) => {
                        let Some(e) = weak.upgrade() else { break };
                        e.release_reading(&n.owner_request_id);
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(k)) => {
                        warn!(
                            missed = k,
                            "owner notifications lagged; holds lapse at their deadline"
                        );
                    }
                    Err(_) => break,
                }
            }
        });
    }
    let sweeper = Arc::downgrade(&engine);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Some(e) = sweeper.upgrade() else { break };
            e.sweep(Instant::now());
        }
    });
    Ok(SimHandle {
        http_addr,
        side_channel_addr,
        engine,
        shutdown: Some(tx),
    })
}

impl Engine {
    /// Counters.
    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.stats;
        StatsSnapshot {
            requests: s.requests.load(Ordering::Relaxed),
            reads_ok: s.reads_ok.load(Ordering::Relaxed),
            reads_declined: s.reads_declined.load(Ordering::Relaxed),
            invalid_params: s.invalid_params.load(Ordering::Relaxed),
            reused_tokens: s.reused_tokens.load(Ordering::Relaxed),
            computed_tokens: s.computed_tokens.load(Ordering::Relaxed),
            side_reads_served: s.side_reads_served.load(Ordering::Relaxed),
            side_reads_refused: s.side_reads_refused.load(Ordering::Relaxed),
            verified_blocks: s.verified_blocks.load(Ordering::Relaxed),
            mismatched_blocks: s.mismatched_blocks.load(Ordering::Relaxed),
            kv_mode: Some(self.cfg.kv_mode),
            holds: self.holds.lock().unwrap().len() as u64,
            last_tokens_header: self.last_tokens_header.lock().unwrap().clone(),
            last_kv_transfer_params: self.last_params.lock().unwrap().clone(),
        }
    }

    /// Free every hold whose deadline has passed.
    fn sweep(&self, now: Instant) {
        let mut holds = self.holds.lock().unwrap();
        let agent_lost = self.agent_lost.load(Ordering::Relaxed);
        let expired: Vec<String> = holds
            .iter()
            .filter(|(_, h)| h.expires_at <= now && (!h.agent_lease || agent_lost))
            .map(|(k, _)| k.clone())
            .collect();
        let mut alloc = self.alloc.lock().unwrap();
        for k in expired {
            if let Some(h) = holds.remove(&k) {
                alloc.release(&h.block_ids);
            }
        }
        let mut reading = self.reading.lock().unwrap();
        reading.retain(|_, h| {
            if h.expires_at <= now {
                alloc.release(&h.block_ids);
                false
            } else {
                true
            }
        });
    }

    /// Frees the blocks of a hold the node agent released (managed mode:
    /// all owner notifications received, lease lapsed, or evicted).
    fn release_held(&self, request_id: &str) {
        let h = self.holds.lock().unwrap().remove(request_id);
        if let Some(h) = h {
            self.alloc.lock().unwrap().release(&h.block_ids);
        }
    }

    /// Frees the blocks of a claimed hold (owner notification received).
    fn release_reading(&self, request_id: &str) {
        let h = self.reading.lock().unwrap().remove(request_id);
        if let Some(h) = h {
            self.alloc.lock().unwrap().release(&h.block_ids);
        }
    }

    /// Evicts the holds that expire first until `n_blocks` are free
    /// (a full cache drops retained KV, as vLLM's prefix cache does).
    /// Managed mode: a hold leased at the agent is freed only once the
    /// agent has ended its lease (so no reader can renew it any more); the
    /// agent refuses (`lease_in_use`) while a reader that renewed it is
    /// reading, and the engine evicts another hold instead.
    async fn evict_for(&self, n_blocks: usize) {
        let mut order: Vec<(Instant, String, bool)> = self
            .holds
            .lock()
            .unwrap()
            .iter()
            .map(|(k, h)| (h.expires_at, k.clone(), h.agent_lease))
            .collect();
        order.sort();
        let reg = self.kv.as_ref().and_then(|k| k.registration()).cloned();
        for (_, k, agent_lease) in order {
            if self.alloc.lock().unwrap().free_blocks() >= n_blocks {
                break;
            }
            if let (true, Some(reg)) = (agent_lease, &reg) {
                match reg.release(&k).await {
                    Ok(()) => {}
                    // Gone at the agent already (notified, expired): its
                    // release event may still be on the way.
                    Err(managed::ClientError::Api(e)) if e.kind == "lease" => {}
                    Err(e) => {
                        debug!(request = %k, error = %e, "lease kept by the agent; not evicted");
                        continue;
                    }
                }
            }
            let h = self.holds.lock().unwrap().remove(&k);
            if let Some(h) = h {
                self.alloc.lock().unwrap().release(&h.block_ids);
            }
        }
    }

    /// Simulated compute time of `new_tokens` prompt tokens after `ctx_tokens`
    /// cached ones (profile or `prefill_us_per_token`), scaled by `time_scale`.
    pub fn prefill_time(&self, new_tokens: u64, ctx_tokens: u64) -> Duration {
        let ms = match &self.profile {
            Some(p) => p.prefill_ms(new_tokens, ctx_tokens),
            None => (self.cfg.prefill_us_per_token * new_tokens) as f64 / 1000.0,
        };
        Duration::from_secs_f64((ms * self.cfg.time_scale).max(0.0) / 1000.0)
    }

    /// Tokens of a request body with this engine's tokenizer.
    fn tokenize(&self, body: &Value) -> Result<Vec<u32>, String> {
        tokenize_body_with(self.cfg.tokenizer, body)
    }

    fn log_read(&self, entry: ReadLogEntry) {
        let mut log = self.read_log.lock().unwrap();
        if log.len() >= READ_LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(entry);
    }

    /// Computes the prompt: sleeps the simulated time of tokens
    /// `reused..n` while writing their KV (real KV) and finishing the
    /// verification of the READ blocks; when verification found a mismatch,
    /// recomputes the reused part too. Returns the tokens finally reused.
    async fn compute_prompt(
        self: &Arc<Self>,
        ids: &[u32],
        tokens: &Arc<Vec<u32>>,
        reused: u64,
        verify: Option<tokio::task::JoinHandle<VerifyOutcome>>,
    ) -> u64 {
        let n = tokens.len() as u64;
        let sleep = tokio::time::sleep(self.prefill_time(n - reused, reused));
        let write = {
            let kv = self.kv.clone();
            let ids = ids.to_vec();
            let tokens = tokens.clone();
            tokio::task::spawn_blocking(move || {
                if let Some(kv) = kv {
                    kv.write_tokens(&ids, &tokens, reused as usize, tokens.len());
                }
            })
        };
        let verify = async move {
            match verify {
                Some(h) => h.await.ok(),
                None => None,
            }
        };
        let ((), _, outcome) = tokio::join!(sleep, write, verify);
        let mut reused = reused;
        if let Some(o) = outcome {
            self.stats
                .verified_blocks
                .fetch_add(o.verified_blocks, Ordering::Relaxed);
            self.stats
                .mismatched_blocks
                .fetch_add(o.mismatched_blocks, Ordering::Relaxed);
            self.metrics.verified_blocks.inc_by(o.verified_blocks);
            self.metrics.mismatched_blocks.inc_by(o.mismatched_blocks);
            if let Some(last) = self.read_log.lock().unwrap().back_mut() {
                last.verified_blocks = o.verified_blocks;
                last.mismatched_blocks = o.mismatched_blocks;
            }
            if o.mismatched_blocks > 0 {
                warn!(engine = %self.cfg.engine_id, mismatched = o.mismatched_blocks,
                      "READ KV differs from the locally computed KV; recomputing");
                let sleep = tokio::time::sleep(self.prefill_time(reused, 0));
                let kv = self.kv.clone();
                let ids = ids.to_vec();
                let tokens = tokens.clone();
                let upto = reused as usize;
                let write = tokio::task::spawn_blocking(move || {
                    if let Some(kv) = kv {
                        kv.write_tokens(&ids, &tokens, 0, upto);
                    }
                });
                let _ = tokio::join!(sleep, write);
                reused = 0;
            }
        }
        self.stats
            .reused_tokens
            .fetch_add(reused, Ordering::Relaxed);
        self.stats
            .computed_tokens
            .fetch_add(n - reused, Ordering::Relaxed);
        self.metrics.reused_tokens.inc_by(reused);
        self.metrics.computed_tokens.inc_by(n - reused);
        reused
    }

    /// How long D holds a finished request's blocks.
    fn decoder_ttl(&self) -> Duration {
        Duration::from_millis(self.cfg.decoder_kv_blocks_ttl_ms)
    }

    /// Blocks needed for `num_tokens` tokens (at least one).
    fn blocks_for(&self, num_tokens: u64) -> usize {
        num_tokens
            .div_ceil(u64::from(self.cfg.block_size_tokens))
            .max(1) as usize
    }

    /// Allocate `n_blocks` blocks (after sweeping lapsed holds when short;
    /// empty when the cache is full).
    async fn allocate_blocks(&self, n_blocks: usize) -> Vec<u32> {
        if let Some(ids) = self.alloc.lock().unwrap().allocate(n_blocks) {
            return ids;
        }
        self.sweep(Instant::now());
        if let Some(ids) = self.alloc.lock().unwrap().allocate(n_blocks) {
            return ids;
        }
        if self.kv.is_some() {
            self.evict_for(n_blocks).await;
        }
        self.alloc
            .lock()
            .unwrap()
            .allocate(n_blocks)
            .unwrap_or_default()
    }

    /// Holds `ids` (covering `num_tokens` tokens) for `ttl` under
    /// `request_id` for a reader and returns the `kv_transfer_params` that
    /// describe them, or null when they cannot be read (managed mode: the
    /// agent did not retain them, see [`Engine::retain_at_agent`]).
    async fn hold(&self, request_id: &str, ids: Vec<u32>, num_tokens: u64, ttl: Duration) -> Value {
        self.hold_blocks(request_id, ids.clone(), num_tokens, ttl);
        if self.retain_at_agent(request_id, &ids, ttl).await {
            self.params(request_id, ids, num_tokens)
        } else {
            Value::Null
        }
    }

    /// Hold `ids` (covering `num_tokens` tokens) for `ttl` under `request_id`.
    fn hold_blocks(&self, request_id: &str, ids: Vec<u32>, num_tokens: u64, ttl: Duration) {
        self.holds.lock().unwrap().insert(
            request_id.to_string(),
            Hold {
                block_ids: ids,
                num_tokens,
                expires_at: Instant::now() + ttl,
                // Managed mode: the agent's to release from the start, so
                // that neither the sweep nor an eviction frees the blocks
                // while the retain is under way.
                agent_lease: self.kv.as_ref().is_some_and(|k| k.registration().is_some()),
            },
        );
    }

    /// Managed mode: retains a new hold's blocks at the node agent, before
    /// its params leave the engine (a reader's lease check must find them).
    /// Returns whether the params may be sent: `false` when the agent did
    /// not retain them, or when the hold was evicted meanwhile; the hold is
    /// then dropped (and any lease the agent made of it released), and the
    /// caller sends no params: the next turn recomputes.
    async fn retain_at_agent(&self, request_id: &str, ids: &[u32], ttl: Duration) -> bool {
        let Some(reg) = self.kv.as_ref().and_then(|k| k.registration()) else {
            return true;
        };
        let r = reg.retain(request_id, ids, ttl.as_millis() as u64).await;
        let still_held = self.holds.lock().unwrap().contains_key(request_id);
        if r.is_ok() && still_held {
            return true;
        }
        match r {
            Ok(()) => debug!(request = %request_id, "hold evicted while being retained"),
            Err(e) => warn!(engine = %self.cfg.engine_id, request = %request_id, error = %e,
                            "the agent did not retain the blocks; no params sent"),
        }
        if let Err(e) = reg.release(request_id).await {
            debug!(request = %request_id, error = %e, "no lease to release");
        }
        self.release_held(request_id);
        false
    }

    fn params(&self, request_id: &str, block_ids: Vec<u32>, num_tokens: u64) -> Value {
        let decode = self.cfg.role == Role::Decode;
        let mut p = json!({
            "do_remote_decode": decode,
            "do_remote_prefill": !decode,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.advertised_host,
            "remote_port": self.side_port,
            "tp_size": self.cfg.tp_size,
            "remote_num_tokens": num_tokens,
        });
        if decode {
            let expiry = (self.start.elapsed()
                + Duration::from_millis(self.cfg.decoder_kv_blocks_ttl_ms))
            .as_secs_f64();
            p["remote_blocks_expiry_time"] = json!(expiry);
        }
        p
    }

    /// Try to READ the KV the params describe; returns the tokens reused (0 on
    /// any failure) and, with real KV, the pending verification of the READ blocks.
    async fn pull(
        &self,
        request_id: &str,
        params: Option<&Value>,
        tokens: &Arc<Vec<u32>>,
        expect_from_decode: bool,
        local_block_ids: &[u32],
    ) -> (u64, Option<tokio::task::JoinHandle<VerifyOutcome>>) {
        let r = self
            .pull_inner(
                request_id,
                params,
                tokens,
                expect_from_decode,
                local_block_ids,
            )
            .await;
        if r == 0 {
            return (0, None);
        }
        let verify = self.kv.clone().map(|kv| {
            let ids = local_block_ids.to_vec();
            let tokens = tokens.clone();
            tokio::task::spawn_blocking(move || kv.verify_tokens(&ids, &tokens, r as usize))
        });
        (r, verify)
    }

    async fn pull_inner(
        &self,
        request_id: &str,
        params: Option<&Value>,
        tokens: &Arc<Vec<u32>>,
        expect_from_decode: bool,
        local_block_ids: &[u32],
    ) -> u64 {
        let prompt_tokens = tokens.len() as u64;
        let Some(p) = params else { return 0 };
        let flag = if expect_from_decode {
            "do_remote_decode"
        } else {
            "do_remote_prefill"
        };
        if p.get(flag).and_then(Value::as_bool) != Some(true) {
            return 0;
        }
        if p.get("remote_block_ids").is_none_or(Value::is_null) {
            return 0; // the "no reuse" shape
        }
        let mut req = match self.read_request(p, prompt_tokens, expect_from_decode) {
            Ok(r) => r,
            Err(field) => {
                warn!(engine = %self.cfg.engine_id, %field, "invalid kv_transfer_params; recomputing locally");
                self.stats.invalid_params.fetch_add(1, Ordering::Relaxed);
                return 0;
            }
        };
        if req.num_tokens == 0 || req.num_tokens < self.cfg.kv_recompute_threshold_tokens {
            return 0;
        }
        let n_local = self.blocks_for(req.num_tokens).min(local_block_ids.len());
        req.local_block_ids = local_block_ids[..n_local].to_vec();
        let want_tokens = req.num_tokens;
        let start = Instant::now();
        let result = self.transfer.read(req).await;
        let elapsed = start.elapsed();
        let mut entry = ReadLogEntry {
            request_id: request_id.to_string(),
            direction: if expect_from_decode { "d2p" } else { "p2d" }.into(),
            prompt_tokens,
            tokens: 0,
            bytes: 0,
            transfer_ms: elapsed.as_secs_f64() * 1e3,
            verified_blocks: 0,
            mismatched_blocks: 0,
            error: None,
        };
        let out = match result {
            Ok(n) => {
                self.stats.reads_ok.fetch_add(1, Ordering::Relaxed);
                let bytes = self
                    .kv
                    .as_ref()
                    .map(|kv| self.blocks_for(want_tokens) as u64 * kv.bytes_per_block())
                    .unwrap_or(0);
                self.metrics
                    .xfer_time_seconds
                    .observe(elapsed.as_secs_f64());
                self.metrics.xfer_bytes.observe(bytes as f64);
                entry.tokens = n;
                entry.bytes = bytes;
                n
            }
            Err(e) => {
                warn!(engine = %self.cfg.engine_id, error = %e, "READ declined; recomputing locally");
                self.stats.reads_declined.fetch_add(1, Ordering::Relaxed);
                self.metrics.failed_transfers.inc();
                entry.error = Some(e.to_string());
                0
            }
        };
        self.log_read(entry);
        out
    }

    fn read_request(
        &self,
        p: &Value,
        prompt_tokens: u64,
        from_decode: bool,
    ) -> Result<ReadRequest, &'static str> {
        let blocks: Vec<u32> = match p.get("remote_block_ids") {
            Some(Value::Array(a)) => {
                let mut out = Vec::new();
                for x in a {
                    match x {
                        Value::Array(g) => {
                            for b in g {
                                out.push(
                                    b.as_u64()
                                        .and_then(|v| u32::try_from(v).ok())
                                        .ok_or("remote_block_ids")?,
                                );
                            }
                        }
                        other => out.push(
                            other
                                .as_u64()
                                .and_then(|v| u32::try_from(v).ok())
                                .ok_or("remote_block_ids")?,
                        ),
                    }
                }
                out
            }
            _ => return Err("remote_block_ids"),
        };
        if blocks.is_empty() {
            return Err("remote_block_ids");
        }
        let engine = p
            .get("remote_engine_id")
            .and_then(Value::as_str)
            .ok_or("remote_engine_id")?;
        let host = p
            .get("remote_host")
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .ok_or("remote_host")?;
        let port = p
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|v| u16::try_from(v).ok())
            .ok_or("remote_port")?;
        let rid = p
            .get("remote_request_id")
            .and_then(Value::as_str)
            .ok_or("remote_request_id")?;
        let held = p.get("remote_num_tokens").and_then(Value::as_u64);
        let num_tokens = if from_decode {
            // D→P: count = min(remote_num_tokens, prompt_tokens); nothing cached locally.
            held.ok_or("remote_num_tokens")?.min(prompt_tokens)
        } else {
            held.unwrap_or(prompt_tokens).min(prompt_tokens)
        };
        Ok(ReadRequest {
            reader_engine_id: self.cfg.engine_id.clone(),
            remote_engine_id: engine.into(),
            remote_host: host.into(),
            remote_port: port,
            remote_request_id: rid.into(),
            remote_block_ids: blocks,
            num_tokens,
            local_block_ids: Vec::new(),
            block_size_tokens: self.cfg.block_size_tokens,
        })
    }

    /// Reports one prefill to the node agent (when configured), in the
    /// background; failures are counted and logged once.
    fn report_prefill(self: &Arc<Self>, prompt_tokens: u64, reused_tokens: u64, took: Duration) {
        let Some(agent) = self.agent.clone() else {
            return;
        };
        let e = self.clone();
        tokio::spawn(async move {
            if let Err(err) = agent
                .record_prefill(
                    &e.cfg.engine_id,
                    prompt_tokens,
                    reused_tokens,
                    took.as_micros() as u64,
                )
                .await
                && e.agent_reports_failed.fetch_add(1, Ordering::Relaxed) == 0
            {
                warn!(engine = %e.cfg.engine_id, error = %err, "prefill report to the agent failed");
            }
        });
    }

    /// Decode time of `n` output tokens, µs, scaled by `time_scale`.
    fn decode_us(&self, n: u64) -> u64 {
        ((self.cfg.decode_us_per_token * n) as f64 * self.cfg.time_scale) as u64
    }

    fn new_request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-req-{n}", self.cfg.engine_id)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

impl Api {
    /// OpenAI's `object` of a response (`chunk`: a streamed chunk).
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completions, _) => "text_completion",
        }
    }
}

async fn completions(
    State(e): State<Arc<Engine>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    generate(e, Api::Completions, headers, body).await
}

async fn chat_completions(
    State(e): State<Arc<Engine>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    generate(e, Api::Chat, headers, body).await
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let msg = msg.into();
    (status, Json(json!({"error": {"message": msg, "type": "invalid_request_error", "code": status.as_u16()}})))
        .into_response()
}

fn knob(body: &Value, name: &str) -> bool {
    body.get("sim")
        .and_then(|s| s.get(name))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

async fn generate(
    e: Arc<Engine>,
    api: Api,
    headers: HeaderMap,
    raw: axum::body::Bytes,
) -> Response {
    e.stats.requests.fetch_add(1, Ordering::Relaxed);
    if let Some(h) = headers.get("x-kvloop-tokens").and_then(|v| v.to_str().ok()) {
        *e.last_tokens_header.lock().unwrap() = Some(h.to_string());
    }
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(err) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("body: invalid JSON: {err}"),
            );
        }
    };
    let arrived = Instant::now();
    let tokens = match e.tokenize(&body) {
        Ok(t) => Arc::new(t),
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let n_prompt = tokens.len() as u64;
    e.metrics.prompt_tokens.inc_by(n_prompt);
    let params = body.get("kv_transfer_params").filter(|v| !v.is_null());
    *e.last_params.lock().unwrap() = params.cloned();
    let request_id = e.new_request_id();
    let created = 1_700_000_000u64;
    match e.cfg.role {
        Role::Prefill => {
            let has_blocks = params
                .and_then(|p| p.get("remote_block_ids"))
                .is_some_and(|b| !b.is_null());
            if knob(&body, "fail_prefill")
                || (has_blocks && knob(&body, "fail_prefill_with_params"))
            {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "simulated prefill failure",
                );
            }
            let ids = e.allocate_blocks(e.blocks_for(n_prompt)).await;
            let (reused, verify) = e.pull(&request_id, params, &tokens, true, &ids).await;
            let reused = e.compute_prompt(&ids, &tokens, reused, verify).await;
            let computed = n_prompt - reused;
            let prefill_time = arrived.elapsed();
            e.metrics.ttft_seconds.observe(prefill_time.as_secs_f64());
            e.metrics.generation_tokens.inc();
            e.report_prefill(n_prompt, reused, prefill_time);
            let kv = e
                .hold(
                    &request_id,
                    ids,
                    n_prompt,
                    Duration::from_millis(e.cfg.lease_ms),
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
                "id": request_id, "object": object, "created": created, "model": e.cfg.model,
                "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1},
                "kv_transfer_params": kv,
                "kvloop_sim": {"reused_tokens": reused, "computed_tokens": computed},
            });
            Json(resp).into_response()
        }
        Role::Decode => {
            if knob(&body, "fail_decode") {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "simulated decode failure",
                );
            }
            let blocks = BlockGuard {
                ids: e.allocate_blocks(e.blocks_for(n_prompt)).await,
                engine: e.clone(),
            };
            let (reused, verify) = e
                .pull(&request_id, params, &tokens, false, &blocks.ids)
                .await;
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
    }
}

fn words(max_tokens: u64) -> Vec<String> {
    (0..max_tokens).map(|i| format!("tok{i}")).collect()
}

/// One decode request after its prefill part.
struct DecodeJob {
    e: Arc<Engine>,
    api: Api,
    request_id: String,
    tokens: Arc<Vec<u32>>,
    max_tokens: u64,
    finish: String,
    blocks: BlockGuard,
}

impl DecodeJob {
    /// Prompt tokens then the tokens of the generated words; the tokens held
    /// after a normal finish (all but the last generated one).
    fn held_tokens(&self) -> (Vec<u32>, u64) {
        let mut all = self.tokens.to_vec();
        all.extend(tokenize_with(
            self.e.cfg.tokenizer,
            &words(self.max_tokens).join(" "),
        ));
        let held = (all.len() as u64 - 1).max(self.tokens.len() as u64);
        (all, held)
    }
}

async fn decode_full(job: DecodeJob, body: &Value) -> Response {
    let (all_tokens, held) = job.held_tokens();
    let DecodeJob {
        e,
        api,
        request_id,
        tokens,
        max_tokens,
        finish,
        blocks,
    } = job;
    let n_prompt = tokens.len() as u64;
    e.metrics.generation_tokens.inc_by(max_tokens);
    sleep_us(e.decode_us(max_tokens)).await;
    let text = words(max_tokens).join(" ");
    let normal = finish == "stop" || finish == "length";
    let kv = if normal {
        blocks
            .extend_and_hold(&request_id, held, &all_tokens, n_prompt as usize)
            .await
    } else {
        Value::Null
    };
    let choice = match api {
        Api::Completions => {
            json!({"index": 0, "text": format!(" {text}"), "logprobs": null, "finish_reason": finish})
        }
        Api::Chat => {
            let mut msg = json!({"role": "assistant", "content": text});
            if knob(body, "reasoning") {
                msg["reasoning_content"] = json!("thinking");
            }
            if knob(body, "tool_call") {
                msg["tool_calls"] = json!([{"id": "call0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
            }
            json!({"index": 0, "message": msg, "finish_reason": finish})
        }
    };
    let object = api.object(false);
    Json(json!({
        "id": request_id, "object": object, "created": 1_700_000_000u64, "model": e.cfg.model,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens, "total_tokens": n_prompt + max_tokens},
        "kv_transfer_params": kv,
    }))
    .into_response()
}

fn decode_stream(job: DecodeJob, body: Value) -> Response {
    let (all_tokens, held) = job.held_tokens();
    let DecodeJob {
        e,
        api,
        request_id,
        tokens,
        max_tokens,
        finish,
        blocks,
    } = job;
    let n_prompt = tokens.len();
    e.metrics.generation_tokens.inc_by(max_tokens);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, Infallible>>(16);
    tokio::spawn(async move {
        let object = api.object(true);
        let chunk = |choice: Value| {
            let v = json!({"id": request_id, "object": object, "created": 1_700_000_000u64, "model": e.cfg.model, "choices": [choice]});
            bytes::Bytes::from(format!("data: {v}\n\n"))
        };
        let delta = |d: Value| match api {
            Api::Chat => json!({"index": 0, "delta": d, "finish_reason": null}),
            Api::Completions => {
                json!({"index": 0, "text": d.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": null})
            }
        };
        if api == Api::Chat {
            if tx
                .send(Ok(chunk(delta(
                    json!({"role": "assistant", "content": ""}),
                ))))
                .await
                .is_err()
            {
                return;
            }
            if knob(&body, "reasoning")
                && tx
                    .send(Ok(chunk(delta(json!({"reasoning_content": "thinking"})))))
                    .await
                    .is_err()
            {
                return;
            }
            if knob(&body, "tool_call") {
                let tc = json!({"tool_calls": [{"index": 0, "id": "call0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
                if tx.send(Ok(chunk(delta(tc)))).await.is_err() {
                    return;
                }
            }
        }
        for (i, w) in words(max_tokens).into_iter().enumerate() {
            if e.cfg.decode_us_per_token > 0 {
                tokio::time::sleep(Duration::from_micros(e.decode_us(1))).await;
            }
            let piece = if i == 0 && api == Api::Chat {
                w
            } else {
                format!(" {w}")
            };
            if tx
                .send(Ok(chunk(delta(json!({"content": piece})))))
                .await
                .is_err()
            {
                return;
            }
        }
        if knob(&body, "truncate_stream") {
            debug!("simulated truncated stream");
            return;
        }
        let fin = match api {
            Api::Chat => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Api::Completions => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish})
            }
        };
        if tx.send(Ok(chunk(fin))).await.is_err() {
            return;
        }
        if finish == "stop" || finish == "length" {
            let kv = blocks
                .extend_and_hold(&request_id, held, &all_tokens, n_prompt)
                .await;
            let v = json!({"id": request_id, "object": object, "created": 1_700_000_000u64, "model": e.cfg.model, "choices": [], "kv_transfer_params": kv});
            if tx
                .send(Ok(bytes::Bytes::from(format!("data: {v}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx
            .send(Ok(bytes::Bytes::from_static(b"data: [DONE]\n\n")))
            .await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn models(State(e): State<Arc<Engine>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": e.cfg.model, "object": "model", "owned_by": "kvloop-engine-sim"}]}))
        .into_response()
}

async fn tokenize(State(e): State<Arc<Engine>>, body: axum::body::Bytes) -> Response {
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

async fn stats(State(e): State<Arc<Engine>>) -> Response {
    Json(e.stats()).into_response()
}

async fn reads(State(e): State<Arc<Engine>>) -> Response {
    let log: Vec<ReadLogEntry> = e.read_log.lock().unwrap().iter().cloned().collect();
    Json(log).into_response()
}

async fn metrics_text(State(e): State<Arc<Engine>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        e.metrics.render(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct SideRead {
    remote_request_id: String,
    block_ids: Vec<u32>,
    num_tokens: u64,
    /// Real KV: keep the blocks until the reader's owner notification (or
    /// the read deadline) and answer with the transfer engine's address.
    #[serde(default)]
    defer_release: bool,
}

/// Side channel: a reader's READ of this engine's held blocks. Serves it when
/// the hold exists, covers the blocks and tokens, and does not expire within
/// the safety margin; the READ doubles as the owner notification (the hold is
/// freed), so params are single use.
async fn side_read(State(e): State<Arc<Engine>>, Json(r): Json<SideRead>) -> Response {
    let now = Instant::now();
    let mut holds = e.holds.lock().unwrap();
    let refuse = |msg: String| {
        e.stats.side_reads_refused.fetch_add(1, Ordering::Relaxed);
        (StatusCode::GONE, msg).into_response()
    };
    let Some(h) = holds.get(&r.remote_request_id) else {
        return refuse(format!(
            "request {}: no blocks held (read already, expired or unknown)",
            r.remote_request_id
        ));
    };
    if h.expires_at <= now + Duration::from_millis(e.cfg.expiry_margin_ms) {
        return refuse(format!(
            "request {}: blocks expire within the safety margin",
            r.remote_request_id
        ));
    }
    if r.block_ids != h.block_ids || r.num_tokens > h.num_tokens {
        return refuse(format!(
            "request {}: block ids or token count do not match the hold",
            r.remote_request_id
        ));
    }
    if r.defer_release {
        let Some(kv) = e.kv.as_ref().filter(|k| k.transfer_engine().is_some()) else {
            return refuse(format!(
                "request {}: defer_release needs kv_mode inproc; this engine is in kv_mode {}",
                r.remote_request_id,
                match e.cfg.kv_mode {
                    KvMode::None => "none",
                    KvMode::Inproc => "inproc",
                    KvMode::Agent => "agent (READ through the node agents)",
                }
            ));
        };
        let mut h = holds.remove(&r.remote_request_id).expect("checked above");
        drop(holds);
        // Freed by the owner notification; the deadline covers a reader that died.
        h.expires_at =
            now + Duration::from_millis(e.cfg.kv_read_timeout_ms + e.cfg.expiry_margin_ms);
        e.reading
            .lock()
            .unwrap()
            .insert(r.remote_request_id.clone(), h);
        e.stats.side_reads_served.fetch_add(1, Ordering::Relaxed);
        return Json(json!({
            "dataplane_addr": kv.dataplane_addr().to_string(),
            "engine_id": e.cfg.engine_id,
        }))
        .into_response();
    }
    let h = holds.remove(&r.remote_request_id).expect("checked above");
    drop(holds);
    e.alloc.lock().unwrap().release(&h.block_ids);
    e.stats.side_reads_served.fetch_add(1, Ordering::Relaxed);
    StatusCode::OK.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_deterministic_and_chat_extends() {
        assert_eq!(tokenize_text("a b  c"), tokenize_text("a b c"));
        let m1 = vec![json!({"role": "user", "content": "hello there"})];
        let mut m2 = m1.clone();
        m2.push(json!({"role": "assistant", "content": "tok0 tok1"}));
        m2.push(json!({"role": "user", "content": "more"}));
        let t1 = tokenize_text(&render_chat(&m1));
        let t2 = tokenize_text(&render_chat(&m2));
        assert_eq!(&t2[..t1.len()], &t1[..]);
    }

    #[test]
    fn pieces_split_long_words_and_punctuation_and_keep_prefixes() {
        assert_eq!(tokenize_pieces("abcdefgh").len(), 2);
        assert_eq!(tokenize_pieces("foo::bar();").len(), 4); // foo ::  bar ();
        assert_eq!(tokenize_pieces("tok12 tok0").len(), 2);
        let a = tokenize_pieces("fn main() { x }");
        let b = tokenize_pieces("fn main() { x } more::words");
        assert_eq!(&b[..a.len()], &a[..]);
    }

    #[test]
    fn allocator_hands_out_and_takes_back() {
        let mut a = BlockAllocator::new(4);
        assert_eq!(a.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(a.allocate(2), None);
        a.release(&[0, 1, 2]);
        assert_eq!(a.free_blocks(), 4);
    }

    #[test]
    fn ipv6_hosts_are_bracketed_once() {
        assert_eq!(host_port("::1", 5), "[::1]:5");
        assert_eq!(host_port("[::1]", 5), "[::1]:5");
        assert_eq!(host_port("10.0.0.1", 5), "10.0.0.1:5");
    }
}
