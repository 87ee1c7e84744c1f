//! Peer discovery: asks every peer agent for its engines every second and
//! connects the probe engine to each peer's probe engine.
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;

/// Period of the discovery, ms.
const DISCOVERY_PERIOD_MS: u64 = 1000;

/// Runs the discovery until aborted.
pub async fn run(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(Duration::from_millis(DISCOVERY_PERIOD_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        agent.refresh_peers().await;
        agent.connect_probe_paths().await;
    }
}
