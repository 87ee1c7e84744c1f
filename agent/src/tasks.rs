//! The agent's background loops: peer discovery, active probes, cost-model
//! updates, threshold pushes, lease expiry, eBPF sample drain. Each loop is
//! a tokio task holding a `Weak` reference; none blocks another (a router
//! that is down only delays its own push task).
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvloop_costmodel::{Direction as CmDirection, SampleSource, TransferSample};
use kvloop_dataplane::{BackendConfig, BlockPair, ReadRequest};
use kvloop_router_api::{THRESHOLDS_PATH, ThresholdUpdate};

use crate::agent::{AbortOnDrop, Agent, EnginesInfo};
use crate::metrics::labels;

/// Starts every loop; dropping the result stops them.
pub fn spawn_all(agent: &Arc<Agent>) -> Vec<AbortOnDrop> {
    let mut v = vec![
        AbortOnDrop(tokio::spawn(discovery_loop(agent.clone()))),
        AbortOnDrop(tokio::spawn(model_loop(agent.clone()))),
        AbortOnDrop(tokio::spawn(push_loop(agent.clone()))),
        AbortOnDrop(tokio::spawn(lease_loop(agent.clone()))),
        AbortOnDrop(tokio::spawn(ebpf_drain_loop(agent.clone()))),
    ];
    if agent.probe_engine.is_some() {
        v.push(AbortOnDrop(tokio::spawn(probe_loop(agent.clone()))));
    }
    if agent.cfg.network.enabled {
        v.push(AbortOnDrop(tokio::spawn(crate::netstate::watch_loop(
            agent.clone(),
        ))));
    }
    v
}

/// Asks every peer agent for its engines every second; connects the probe
/// engine to each peer's probe engine.
async fn discovery_loop(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        refresh_peers(&agent).await;
        connect_probe_paths(&agent).await;
    }
}

/// Connects the probe engine to every known peer's probe engine not
/// connected yet (the discovery loop's job, never a READ's).
async fn connect_probe_paths(agent: &Agent) {
    let Some(pe) = &agent.probe_engine else {
        return;
    };
    let theirs: Vec<(String, crate::agent::EngineAddr)> = agent
        .peers
        .read()
        .unwrap()
        .iter()
        .filter_map(|(n, p)| {
            p.info
                .as_ref()
                .and_then(|i| i.probe.clone())
                .map(|pr| (n.clone(), pr))
        })
        .collect();
    let connected = pe.peers();
    for (name, pr) in theirs {
        if connected.contains(&pr.engine_id) {
            continue;
        }
        match pe.connect(pr.side_channel).await {
            Ok(_) => {
                tracing::info!(peer = %name, side_channel = %pr.side_channel, "probe path connected")
            }
            Err(e) => tracing::warn!(peer = %name, error = %e, "probe path connect failed"),
        }
    }
}

/// Asks every peer agent for its engines once (`GET /v1/engines`); also
/// called on demand when a READ names an engine no known peer hosts (an
/// engine registered since the last periodic query).
pub async fn refresh_peers(agent: &Agent) {
    let peers: Vec<(String, std::net::SocketAddr)> = agent
        .peers
        .read()
        .unwrap()
        .iter()
        .filter_map(|(n, p)| p.http.map(|h| (n.clone(), h)))
        .collect();
    for (name, http) in peers {
        discover_peer(agent, &name, http).await;
    }
}

/// Queries one peer agent's engines and records them (no connecting: a
/// READ may be waiting on this).
async fn discover_peer(agent: &Agent, name: &str, http: std::net::SocketAddr) {
    let url = format!("http://{http}/v1/engines");
    let info = match agent.http.get(&url).send().await {
        Ok(r) if r.status().is_success() => r.json::<EnginesInfo>().await.ok(),
        Ok(r) => {
            tracing::debug!(peer = %name, status = %r.status(), "peer engines query failed");
            None
        }
        Err(e) => {
            tracing::debug!(peer = %name, error = %e, "peer unreachable");
            None
        }
    };
    let Some(info) = info else { return };
    let own_probe = agent.probe_engine.as_ref().map(|e| e.side_channel_addr());
    if info.agent_id == agent.cfg.agent_id
        || (own_probe.is_some() && info.probe.as_ref().map(|p| p.side_channel) == own_probe)
    {
        // A peers[] entry that reaches this agent itself under another
        // name or address (a shared peer list): never probe oneself.
        tracing::info!(peer = %name, %http, "peers[]: entry is this agent itself; skipped");
        agent.peers.write().unwrap().remove(name);
        agent.metrics.path_valid.remove(&labels(&[("peer", name)]));
        return;
    }
    if info.version != crate::http::API_VERSION {
        tracing::warn!(peer = %name, version = info.version, "peer speaks another agent API version; ignored");
        return;
    }
    if let Some(p) = agent.peers.write().unwrap().get_mut(name) {
        p.info = Some(info);
    }
}

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

/// Active probes: per round and peer, one small and one large READ of the
/// peer's probe engine, shaped like KV transfers (the probe layout's block
/// size and regions), recorded as [`SampleSource::ActiveProbe`].
async fn probe_loop(agent: Arc<Agent>) {
    let Some(pe) = agent.probe_engine.clone() else {
        return;
    };
    let p = agent.cfg.probe.clone();
    let bytes_per_block = p.block_len_bytes * p.num_regions as u64;
    let round_bytes = (p.small_blocks + p.large_blocks) as u64 * bytes_per_block;
    let mut buckets: HashMap<String, RateLimit> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(p.period_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round: u64 = 0;
    loop {
        tick.tick().await;
        round += 1;
        let targets: Vec<(String, String)> = agent
            .peers
            .read()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.path_valid)
            .filter_map(|(n, s)| {
                s.info
                    .as_ref()
                    .and_then(|i| i.probe.as_ref())
                    .map(|pr| (n.clone(), pr.engine_id.clone()))
            })
            .collect();
        let connected = pe.peers();
        for (peer, engine_id) in targets {
            if !connected.contains(&engine_id) {
                continue;
            }
            let now = agent.now_ms();
            let b = buckets
                .entry(peer.clone())
                .or_insert_with(|| RateLimit::new(p.max_bytes_per_s, round_bytes, now));
            if !b.try_take(round_bytes, now) {
                agent
                    .metrics
                    .probe_skipped
                    .get_or_create(&labels(&[("peer", &peer)]))
                    .inc();
                continue;
            }
            // Vary the blocks between rounds so that nothing is cached.
            let off = (round % p.num_blocks as u64) as u32;
            for (size, n) in [("small", p.small_blocks), ("large", p.large_blocks)] {
                let blocks: Vec<BlockPair> = (0..n)
                    .map(|i| {
                        let b = ((off + i) % p.num_blocks) as u64;
                        BlockPair {
                            remote: b,
                            local: b,
                        }
                    })
                    .collect();
                let r = pe
                    .read(&ReadRequest {
                        peer_engine_id: engine_id.clone(),
                        blocks,
                        direction: kvloop_common::Direction::Probe,
                        notify: None,
                        timeout_ms: Some(agent.cfg.read_timeout_ms.max(10_000)),
                    })
                    .await;
                let result = if r.is_ok() { "ok" } else { "error" };
                agent
                    .metrics
                    .probe_reads
                    .get_or_create(&labels(&[
                        ("peer", &peer),
                        ("size", size),
                        ("result", result),
                    ]))
                    .inc();
                match r {
                    Ok(o) => agent.record_own_read(&peer, &o, SampleSource::ActiveProbe),
                    Err(e) => tracing::debug!(%peer, error = %e, "probe READ failed"),
                }
            }
        }
    }
}

/// Bandwidth a provider should give on this node, bytes/s (for the alarm).
pub fn expected_bandwidth(agent: &Agent, peer: &str) -> f64 {
    let cfg = &agent.cfg.probe;
    if cfg.expected_bandwidth_bytes_per_s > 0.0 {
        return cfg.expected_bandwidth_bytes_per_s;
    }
    match &agent.cfg.backend {
        BackendConfig::Libfabric(f) if f.provider.starts_with("efa") => 12.5e9,
        BackendConfig::Libfabric(f) if f.provider.starts_with("shm") => 5e9,
        BackendConfig::Libfabric(_) => {
            let iface = agent
                .peers
                .read()
                .unwrap()
                .get(peer)
                .and_then(|p| p.interface.clone());
            iface
                .and_then(|i| crate::netstate::sysfs_speed_mbps(&i))
                .map(|mbps| mbps as f64 * 125_000.0)
                .unwrap_or(1.25e9)
        }
        BackendConfig::Nixl(_) => 1.25e9,
    }
}

/// Bandwidth alarm rule (pure): fitted bandwidth below `ratio` × expected,
/// only once the bandwidth is identified by the fit.
pub fn bandwidth_alarm(
    fitted_bytes_per_s: f64,
    identified: bool,
    expected: f64,
    ratio: f64,
) -> bool {
    identified && fitted_bytes_per_s.is_finite() && fitted_bytes_per_s < ratio * expected
}

/// Refits the cost model at its poll interval; publishes metrics and the
/// bandwidth alarm.
async fn model_loop(agent: Arc<Agent>) {
    let iv = Duration::from_millis(agent.cfg.cost_model.update_interval_ms);
    let mut tick = tokio::time::interval(iv);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = agent.now();
        let (changes, thresholds) = {
            let mut m = agent.model.lock().unwrap();
            let c = m.update(now);
            (c, m.pair_thresholds(Duration::from_millis(1)))
        };
        for c in changes {
            tracing::info!(
                prefill = %c.prefill_engine_id, decode = %c.decode_engine_id,
                from = c.change.from_tokens, to = c.change.to_tokens,
                reason = ?c.change.reason, "recompute threshold changed"
            );
            agent
                .metrics
                .threshold_changes
                .get_or_create(&labels(&[
                    ("prefill", &c.prefill_engine_id),
                    ("decode", &c.decode_engine_id),
                ]))
                .inc();
        }
        for t in thresholds {
            agent
                .metrics
                .threshold
                .get_or_create(&labels(&[
                    ("prefill", &t.prefill_engine_id),
                    ("decode", &t.decode_engine_id),
                ]))
                .set(t.threshold_tokens as i64);
        }
        let names: Vec<String> = agent.peers.read().unwrap().keys().cloned().collect();
        for peer in names {
            let fit = agent
                .model
                .lock()
                .unwrap()
                .transfer_fit(&peer, CmDirection::Inbound, now);
            let Some(fit) = fit else { continue };
            let bw = fit.coefficients.bandwidth_bytes_per_s();
            let l = labels(&[("peer", &peer)]);
            agent.metrics.path_bandwidth.get_or_create(&l).set(bw);
            agent
                .metrics
                .path_fixed_ms
                .get_or_create(&l)
                .set(fit.coefficients.fixed_ms);
            let expected = expected_bandwidth(&agent, &peer);
            let alarm = bandwidth_alarm(
                bw,
                fit.summary.identified[1],
                expected,
                agent.cfg.probe.alarm_ratio,
            );
            let was = agent
                .peers
                .write()
                .unwrap()
                .get_mut(&peer)
                .map(|p| std::mem::replace(&mut p.alarm, alarm))
                .unwrap_or(false);
            if alarm && !was {
                tracing::warn!(
                    %peer, fitted_gbit_s = bw * 8e-9, expected_gbit_s = expected * 8e-9,
                    "path bandwidth far below what the provider should give (fallback to a slow path?)"
                );
            } else if !alarm && was {
                tracing::info!(%peer, fitted_gbit_s = bw * 8e-9, "path bandwidth back to normal");
            }
            agent.metrics.path_alarm.get_or_create(&l).set(alarm as i64);
        }
    }
}

/// Pushes thresholds to every router every push period (and at once after
/// a path invalidation). Each router is pushed by its own task, with
/// retries and back-off; a push still in flight is not duplicated.
async fn push_loop(agent: Arc<Agent>) {
    if agent.cfg.routers.is_empty() {
        return;
    }
    let in_flight: Vec<Arc<std::sync::atomic::AtomicBool>> = agent
        .cfg
        .routers
        .iter()
        .map(|_| Arc::new(std::sync::atomic::AtomicBool::new(false)))
        .collect();
    let period = Duration::from_millis(agent.cfg.push_period_ms);
    loop {
        let pairs = agent
            .model
            .lock()
            .unwrap()
            .pair_thresholds(Duration::from_millis(agent.cfg.valid_for_ms()));
        let update = ThresholdUpdate {
            agent_id: agent.cfg.agent_id.clone(),
            seq: agent
                .push_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            pairs,
        };
        for (i, r) in agent.cfg.routers.iter().enumerate() {
            if in_flight[i].swap(true, std::sync::atomic::Ordering::AcqRel) {
                continue;
            }
            let flag = in_flight[i].clone();
            let agent2 = agent.clone();
            let r = r.clone();
            let update = update.clone();
            tokio::spawn(async move {
                push_one(&agent2, &r, &update).await;
                flag.store(false, std::sync::atomic::Ordering::Release);
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = agent.push_now.notified() => {}
        }
    }
}

async fn push_one(agent: &Agent, r: &crate::config::RouterTarget, u: &ThresholdUpdate) {
    let url = format!("{}{}", r.url.trim_end_matches('/'), THRESHOLDS_PATH);
    let mut delay = Duration::from_millis(agent.cfg.push_retry_initial_ms);
    for attempt in 1..=agent.cfg.push_attempts {
        let res = agent
            .http
            .put(&url)
            .bearer_auth(r.token.as_deref().unwrap_or_default())
            .timeout(Duration::from_millis(agent.cfg.push_timeout_ms))
            .json(u)
            .send()
            .await;
        let ok = match res {
            Ok(resp) if resp.status().is_success() => true,
            Ok(resp) => {
                let st = resp.status();
                let body = resp.text().await.unwrap_or_default();
                tracing::warn!(router = %r.url, status = %st, %body, attempt, "threshold push refused");
                // 4xx other than 429: retrying the same body will not help.
                if st.is_client_error() && st.as_u16() != 429 {
                    agent
                        .metrics
                        .pushes
                        .get_or_create(&labels(&[("router", &r.url), ("result", "refused")]))
                        .inc();
                    return;
                }
                false
            }
            Err(e) => {
                tracing::debug!(router = %r.url, error = %e, attempt, "threshold push failed");
                false
            }
        };
        agent
            .metrics
            .pushes
            .get_or_create(&labels(&[
                ("router", &r.url),
                ("result", if ok { "ok" } else { "error" }),
            ]))
            .inc();
        if ok {
            return;
        }
        if attempt < agent.cfg.push_attempts {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(agent.cfg.push_period_ms));
        }
    }
}

async fn lease_loop(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        agent.expire_leases();
    }
}

/// Feeds kernel-timed READs of this process (eBPF probes loaded) and
/// kernel-timed prefills on the configured `prefill_ports` to the cost
/// model; in fallback mode the agent records its own user-space timings.
async fn ebpf_drain_loop(agent: Arc<Agent>) {
    if agent.probes.source() != kvloop_probes::Source::Ebpf {
        return;
    }
    let pid = std::process::id();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let snap = agent.probes.snapshot();
        for p in snap.prefills {
            let Some(engine) = agent.cfg.prefill_ports.iter().find(|x| x.port == p.port) else {
                continue;
            };
            let Ok(tokens) = p.tokens else { continue };
            if p.latency_ns == 0 || tokens.reused_tokens >= tokens.prompt_tokens {
                continue;
            }
            let s = kvloop_costmodel::PrefillSample {
                at: agent.now(),
                prompt_tokens: tokens.prompt_tokens,
                reused_tokens: tokens.reused_tokens,
                latency: Duration::from_nanos(p.latency_ns),
                source: SampleSource::Ebpf,
            };
            let _ = agent
                .model
                .lock()
                .unwrap()
                .record_prefill(&engine.engine_id, s);
        }
        for x in snap.xfers {
            if x.tgid != pid
                || x.status != 0
                || x.bytes == 0
                || x.descriptors == 0
                || x.latency_ns == 0
                || x.direction == kvloop_common::Direction::Probe
            {
                continue;
            }
            let Some(peer) = agent.peer_of_engine(&x.peer) else {
                continue;
            };
            let s = TransferSample {
                at: agent.now(),
                bytes: x.bytes,
                descriptors: x.descriptors as u64,
                latency: Duration::from_nanos(x.latency_ns),
                source: SampleSource::Ebpf,
            };
            let _ = agent
                .model
                .lock()
                .unwrap()
                .record_transfer(&peer, CmDirection::Inbound, s);
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

    #[test]
    fn alarm_only_when_identified_and_far_below() {
        assert!(bandwidth_alarm(1e8, true, 12.5e9, 0.1));
        assert!(!bandwidth_alarm(1e8, false, 12.5e9, 0.1));
        assert!(!bandwidth_alarm(2e9, true, 12.5e9, 0.1));
    }
}
