//! Lease expiry, at the lease table's next expiry (woken early when a lease
//! is added or renewed).
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;

/// Longest sleep while nothing expires sooner, ms.
const MAX_IDLE_MS: u64 = 1000;

/// Runs the expiry until aborted.
pub async fn run(agent: Arc<Agent>) {
    loop {
        let wait = match agent.expire_leases() {
            Some(at_ms) => at_ms.saturating_sub(agent.now_ms()).clamp(1, MAX_IDLE_MS),
            None => MAX_IDLE_MS,
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = agent.lease_changed() => {}
        }
    }
}
