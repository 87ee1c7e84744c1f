//! The engine's counters (`GET /sim/stats`) and its READ log (`GET /sim/reads`).
use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::KvMode;

/// Counters exposed at `GET /sim/stats`.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) requests: AtomicU64,
    pub(crate) reads_ok: AtomicU64,
    pub(crate) reads_declined: AtomicU64,
    pub(crate) invalid_params: AtomicU64,
    pub(crate) reused_tokens: AtomicU64,
    pub(crate) computed_tokens: AtomicU64,
    pub(crate) side_reads_served: AtomicU64,
    pub(crate) side_reads_refused: AtomicU64,
    pub(crate) verified_blocks: AtomicU64,
    pub(crate) mismatched_blocks: AtomicU64,
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

/// One prefill this engine computed (`GET /sim/prefills`, newest last, at
/// most [`READ_LOG_CAPACITY`] kept). Times are Unix ms (wall clock), so a
/// client on the same machine can line them up with its own.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PrefillLogEntry {
    /// The caller's `x-request-id` (the router's request id), else this
    /// engine's request id.
    pub request_id: String,
    /// This engine's request id (the `request_id` of its `/sim/reads` entries).
    pub engine_request_id: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens read from D instead of computed.
    pub reused_tokens: u64,
    /// When the request arrived, Unix ms.
    pub arrived_unix_ms: f64,
    /// When its compute began (after the READ and the wait for a prefill
    /// slot), Unix ms.
    pub compute_start_unix_ms: f64,
    /// When its compute ended, Unix ms.
    pub compute_end_unix_ms: f64,
    /// READ of D's blocks (claim + transfer + verification start), ms; 0
    /// without params.
    pub read_ms: f64,
    /// Waiting for a prefill slot (`--prefill-concurrency`), ms.
    pub queue_ms: f64,
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
    /// The prefill cost profile in use, if any (what a demo's oracle
    /// computes counterfactual prefills with).
    #[serde(default)]
    pub profile: Option<crate::profile::CostProfile>,
    /// `--time-scale`.
    #[serde(default)]
    pub time_scale: Option<f64>,
    /// Last `X-KVLoop-Tokens` header seen, if any.
    pub last_tokens_header: Option<String>,
    /// `kv_transfer_params` of the last generation request, if any.
    pub last_kv_transfer_params: Option<Value>,
}
