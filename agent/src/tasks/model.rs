//! Cost-model refits, at the model's `poll_timeout` (the quinn-style
//! contract of `kvloop_costmodel::CostModel`: the shell sleeps until the
//! core's next deadline, then calls `update`).
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;

/// Longest sleep between refits, ms, should the model name no deadline.
const MAX_IDLE_MS: u64 = 1000;

/// Runs the refits until aborted.
pub async fn run(agent: Arc<Agent>) {
    loop {
        let next = agent.refit();
        let now = agent.now();
        let wait = next.map_or(Duration::from_millis(MAX_IDLE_MS), |t| {
            t.saturating_duration_since(now)
        });
        // At least 1 ms, so that a deadline already passed cannot spin.
        tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
    }
}
