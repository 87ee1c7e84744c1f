//! vLLM-protocol engine simulator (P or D role) for tests and the demo.
//!
//! `kvloop-engine-sim` follows the engine-side rules of kvloop's P/D protocol
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
//!
//! Modules, one job each: [`config`], `api` (shapes shared by the handlers), [`tokenizer`] (and the chat template),
//! [`blocks`] (allocator), [`transfer`] (the READ trait and the side
//! channel's client), [`side_channel`] (its server), [`stats`], [`params`] (the params it emits), [`engine`]
//! (shared state) and [`pull`] (its READ side), [`http`] (OpenAI handlers),
//! [`decode`] (answers and the SSE writer), [`server`] (spawning).
#![forbid(unsafe_code)]

mod api;
pub mod blocks;
pub mod config;
mod decode;
pub mod engine;
mod http;
pub mod kv;
pub mod link_metrics;
pub mod managed;
pub mod metrics;
pub mod params;
pub mod profile;
mod pull;
pub mod server;
mod side_channel;
pub mod stats;
pub mod tokenizer;
pub mod transfer;

pub use blocks::BlockAllocator;
pub use config::{KvMode, Role, SimConfig, StreamParams, TokenizerKind};
pub use engine::Engine;
pub use kv::{DataplaneTransfer, KvMemory, KvShape, VerifyOutcome};
pub use profile::CostProfile;
pub use server::{SimHandle, kv_shape, spawn, spawn_with_transfer};
pub use stats::{PrefillLogEntry, READ_LOG_CAPACITY, ReadLogEntry, StatsSnapshot};
pub use tokenizer::{
    render_chat, token_id, tokenize_body, tokenize_body_with, tokenize_pieces, tokenize_text,
    tokenize_with,
};
pub use transfer::{
    KvTransfer, ReadFuture, ReadRequest, SimulatedTransfer, TransferError, host_port,
};
