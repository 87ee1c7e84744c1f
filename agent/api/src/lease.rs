//! Lease records as the local API reports them (the lease table itself is
//! the agent's: `kvloop_agent::lease::LeaseTable`).
use serde::{Deserialize, Serialize};

/// A retained request as reported to callers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    /// Owner engine id.
    pub engine_id: String,
    /// Owner request id.
    pub request_id: String,
    /// Retained block ids.
    pub block_ids: Vec<u64>,
    /// Time left until the blocks are released, ms.
    pub expires_in_ms: u64,
    /// Owner notifications received so far.
    pub notifications: u32,
}

/// Why retained blocks were released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// All expected owner notifications arrived.
    Notified,
    /// The TTL / lease lapsed.
    Expired,
    /// The owner released them.
    Owner,
    /// The router released them: nobody will pull that turn (it was
    /// replaced, recomputed, evicted, expired at the router, its
    /// conversation ended, or its retention no longer pays; issue 15).
    Router,
}

/// A release, to tell the owner engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// Owner engine id.
    pub engine_id: String,
    /// Owner request id.
    pub request_id: String,
    /// The freed block ids.
    pub block_ids: Vec<u64>,
    /// Why.
    pub reason: ReleaseReason,
}
