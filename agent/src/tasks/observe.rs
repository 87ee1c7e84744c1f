//! Observe mode's attach task: puts the NIXL library probes on every
//! `observe.nixl_libs` file (for every process using it), retrying those
//! absent or failing every 5 s until all are attached.
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;

/// Retry period of a library not attached yet, ms.
const RETRY_MS: u64 = 5000;

/// Runs until every library is attached (or at once without eBPF).
pub async fn run(agent: Arc<Agent>) {
    let mut left = agent.config().observe.nixl_libs.clone();
    if left.is_empty() {
        return;
    }
    if agent.probes().source() != kvloop_probes::Source::Ebpf {
        tracing::warn!(libs = ?left, "observe.nixl_libs: eBPF probes are not loaded; engines' NIXL transfers are not timed");
        return;
    }
    let mut warned = std::collections::HashSet::new();
    loop {
        left.retain(|lib| match agent.probes().attach_nixl(lib, None) {
            Ok(symbols) => {
                tracing::info!(lib = %lib.display(), ?symbols, "observe: NIXL probes attached (every process using it)");
                false
            }
            Err(e) => {
                if warned.insert(lib.clone()) {
                    tracing::warn!(lib = %lib.display(), error = %e, "observe: NIXL probes not attached yet; retrying every 5 s");
                }
                true
            }
        });
        if left.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(RETRY_MS)).await;
    }
}
