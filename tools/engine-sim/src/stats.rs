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
