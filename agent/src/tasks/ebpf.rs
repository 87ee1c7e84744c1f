//! The eBPF sample drain: feeds kernel-timed READs (the agent's own, and in
//! observe mode the engines' NIXL transfers) and kernel-timed prefills on
//! the configured `prefill_ports` to the cost model; in fallback mode the
//! agent records its own user-space timings instead and this task does
//! nothing.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;
use crate::config::ObserveScope;

/// Drain period, ms (the probes' ring buffers hold far more than this).
const DRAIN_PERIOD_MS: u64 = 250;
/// Processes whose scope is remembered; the memory is cleared beyond this.
const MAX_SCOPE_CACHE: usize = 4096;

/// Runs the drain until aborted.
pub async fn run(agent: Arc<Agent>) {
    if agent.probes().source() != kvloop_probes::Source::Ebpf {
        return;
    }
    let pid = std::process::id();
    let mut scope = ScopeCache::new(agent.config().observe.scope);
    let mut tick = tokio::time::interval(Duration::from_millis(DRAIN_PERIOD_MS));
    loop {
        tick.tick().await;
        let snap = agent.probes().snapshot();
        scope.refresh(&snap);
        agent.ingest_kernel_samples(snap, pid, &|tgid| scope.contains(tgid));
    }
}

/// Which processes are in the agent's scope, looked up once per process
/// (`/proc/<pid>/ns/net` against the agent's own, for `scope = "netns"`).
struct ScopeCache {
    scope: ObserveScope,
    own_netns: Option<std::path::PathBuf>,
    known: HashMap<u32, bool>,
}

impl ScopeCache {
    fn new(scope: ObserveScope) -> Self {
        Self {
            scope,
            own_netns: std::fs::read_link("/proc/self/ns/net").ok(),
            known: HashMap::new(),
        }
    }

    /// Looks up the processes of a snapshot's transfers not seen before.
    fn refresh(&mut self, snap: &kvloop_probes::Snapshot) {
        if self.scope == ObserveScope::Node {
            return;
        }
        if self.known.len() > MAX_SCOPE_CACHE {
            self.known.clear();
        }
        for x in &snap.xfers {
            let own = &self.own_netns;
            self.known.entry(x.tgid).or_insert_with(|| {
                let theirs = std::fs::read_link(format!("/proc/{}/ns/net", x.tgid)).ok();
                theirs.is_some() && theirs == *own
            });
        }
    }

    fn contains(&self, tgid: u32) -> bool {
        self.scope == ObserveScope::Node || self.known.get(&tgid).copied().unwrap_or(false)
    }
}
