//! Active probes: per round and peer, one small and one large READ of the
//! peer's probe engine in each shared shape (`crate::probe_plan`),
//! rate-limited per peer ([`RateLimit`]).
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kvloop_costmodel::SampleSource;
use kvloop_dataplane::{BlockPair, ReadRequest};

use crate::agent::{Agent, read_size};
use crate::metrics::labels;
use crate::probe_plan;

/// Token bucket of one peer's probe traffic.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    rate_bytes_per_s: f64,
    burst_bytes: f64,
    tokens: f64,
    last_ms: u64,
}

impl RateLimit {
    /// A bucket of `rate` bytes/s with a burst of one second of it (at least
    /// `min_burst_bytes`, so one round always fits).
    pub fn new(rate_bytes_per_s: u64, min_burst_bytes: u64, now_ms: u64) -> Self {
        let burst = (rate_bytes_per_s as f64).max(min_burst_bytes as f64);
        Self {
            rate_bytes_per_s: rate_bytes_per_s as f64,
            burst_bytes: burst,
            tokens: burst,
            last_ms: now_ms,
        }
    }

    /// Takes `bytes` if available at `now_ms`.
    pub fn try_take(&mut self, bytes: u64, now_ms: u64) -> bool {
        let dt = now_ms.saturating_sub(self.last_ms) as f64 / 1e3;
        self.last_ms = now_ms;
        self.tokens = (self.tokens + dt * self.rate_bytes_per_s).min(self.burst_bytes);
        if self.tokens >= bytes as f64 {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }
}

/// Active probes: per round and peer, one small and one large READ in each
/// shape both sides probe in ([`crate::agent::ProbeTarget`]: the registered
/// engines' layouts where the peer has them too, else the configured
/// layout), recorded as [`SampleSource::ActiveProbe`]. A peer's rounds
/// share one rate limit; a shape whose round does not fit is skipped. A
/// large READ off the path's model ([`probe_plan::confirm_again`]) has its
/// peer probed again after [`probe_plan::CONFIRM_GAP_MS`], up to
/// [`probe_plan::MAX_CONFIRM_ROUNDS`] times before an on-model READ,
/// instead of at the next period.
pub async fn run(agent: Arc<Agent>) {
    if agent.probe_engine().is_none() {
        return;
    }
    let p = agent.config().probe.clone();
    let mut buckets: HashMap<String, RateLimit> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(p.period_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round: u64 = 0;
    // Peers to probe again off the period, and how many such rounds each
    // has left before an on-model READ.
    let mut confirm: HashSet<String> = HashSet::new();
    let mut confirms_left: HashMap<String, u32> = HashMap::new();
    loop {
        let only = std::mem::take(&mut confirm);
        if only.is_empty() {
            tick.tick().await;
        } else {
            tokio::time::sleep(Duration::from_millis(probe_plan::CONFIRM_GAP_MS)).await;
        }
        round += 1;
        for t in agent.probe_targets() {
            if !only.is_empty() && !only.contains(&t.peer) {
                continue;
            }
            let peer_labels = labels(&[("peer", &t.peer)]);
            if !only.is_empty() {
                agent
                    .metrics()
                    .probe_confirm_rounds
                    .get_or_create(&peer_labels)
                    .inc();
            }
            let now = agent.now_ms();
            let round_bytes = t.plan.round_bytes();
            let shape = t.plan.shape_label();
            let b = buckets
                .entry(t.peer.clone())
                .or_insert_with(|| RateLimit::new(p.max_bytes_per_s, round_bytes, now));
            if !b.try_take(round_bytes, now) {
                agent
                    .metrics()
                    .probe_skipped
                    .get_or_create(&peer_labels)
                    .inc();
                continue;
            }
            // Vary the blocks between rounds so that nothing is cached.
            let num_blocks = t.plan.layout.num_blocks;
            let off = (round % num_blocks as u64) as u32;
            for (size, n) in [
                ("small", t.plan.small_blocks),
                ("large", t.plan.large_blocks),
            ] {
                let blocks: Vec<BlockPair> = (0..n)
                    .map(|i| {
                        let b = ((off + i) % num_blocks) as u64;
                        BlockPair {
                            remote: b,
                            local: b,
                        }
                    })
                    .collect();
                let n_blocks = blocks.len();
                let req = ReadRequest {
                    peer_engine_id: t.remote_engine_id.clone(),
                    blocks,
                    direction: kvloop_common::Direction::Probe,
                    notify: None,
                    timeout_ms: Some(agent.config().read_timeout_ms.max(10_000)),
                };
                let (bytes, descriptors) = read_size(t.engine.layout(), n_blocks);
                let predicted_ms = agent.predict_read_ms(&t.peer, bytes, descriptors);
                let r = agent
                    .watch_read(
                        Some(&t.peer),
                        (bytes, descriptors),
                        predicted_ms,
                        SampleSource::ActiveProbe,
                        t.engine.read(&req),
                    )
                    .await;
                let result = if r.is_ok() { "ok" } else { "error" };
                agent
                    .metrics()
                    .probe_reads
                    .get_or_create(&labels(&[
                        ("peer", &t.peer),
                        ("size", size),
                        ("shape", &shape),
                        ("result", result),
                    ]))
                    .inc();
                match r {
                    Ok(o) => {
                        agent.record_own_read(&t.peer, &o, SampleSource::ActiveProbe);
                        let observed_ms = o.elapsed_us as f64 / 1e3;
                        tracing::debug!(
                            peer = %t.peer, %shape, size, bytes, observed_ms,
                            predicted_ms = predicted_ms.unwrap_or(f64::NAN),
                            "probe READ"
                        );
                        if size == "large" {
                            // Judged against the model before this READ
                            // (or its overdue samples) entered it.
                            if probe_plan::confirm_again(observed_ms, predicted_ms) {
                                let left = confirms_left
                                    .entry(t.peer.clone())
                                    .or_insert(probe_plan::MAX_CONFIRM_ROUNDS);
                                if *left > 0 {
                                    *left -= 1;
                                    confirm.insert(t.peer.clone());
                                }
                            } else {
                                confirms_left.remove(&t.peer);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(peer = %t.peer, %shape, error = %e, "probe READ failed")
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_refills_at_rate() {
        let mut b = RateLimit::new(1000, 500, 0);
        assert!(b.try_take(1000, 0));
        assert!(!b.try_take(1, 0));
        assert!(!b.try_take(600, 500)); // 500 refilled
        assert!(b.try_take(500, 500));
        assert!(b.try_take(1000, 5000)); // capped at burst
        assert!(!b.try_take(1, 5000));
    }
}
