//! Pure model of `kvloop top`: Prometheus text and the agents' `/v1/status`
//! turned into rows (no I/O), sorting and filtering.
use std::collections::BTreeMap;

use serde::Serialize;

/// One sample of a Prometheus/OpenMetrics text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Metric name (with `_bucket`, `_total` suffixes as exposed).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Parses the sample lines of a text exposition (comments skipped; label
/// values without escaped quotes).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for l in text.lines() {
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        let (head, value) = match l.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => {
                let body = rest.trim_end_matches('}');
                let mut m = BTreeMap::new();
                for kv in body.split("\",") {
                    if let Some((k, v)) = kv.split_once("=\"") {
                        m.insert(k.trim().to_string(), v.trim_end_matches('"').to_string());
                    }
                }
                (n.to_string(), m)
            }
            None => (head.to_string(), BTreeMap::new()),
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// Upper bound (s) of the bucket holding quantile `q` of a cumulative
/// histogram given as `(le, count)` pairs in any order; `None` when empty.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let mut b = buckets.to_vec();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    b.iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
        .filter(|le| le.is_finite())
        .or_else(|| b.iter().rev().find(|(le, _)| le.is_finite()).map(|x| x.0))
}

/// Probe READ latency of the samples whose `peer` label contains `peer`:
/// `(p50 µs, p99 µs, READs)` summed over the other labels.
pub fn probe_latency(samples: &[Sample], peer: &str) -> Option<(f64, f64, u64)> {
    let mut by_le: BTreeMap<String, f64> = BTreeMap::new();
    for s in samples {
        if s.name == "vllm:nixl_xfer_time_seconds_bucket"
            && s.labels.get("direction").is_some_and(|d| d == "probe")
            && s.labels.get("peer").is_some_and(|p| p.contains(peer))
            && let Some(le) = s.labels.get("le")
        {
            *by_le.entry(le.clone()).or_default() += s.value;
        }
    }
    let b: Vec<(f64, f64)> = by_le
        .iter()
        .filter_map(|(le, c)| {
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, *c))
        })
        .collect();
    let n = b.iter().map(|x| x.1).fold(0.0, f64::max) as u64;
    Some((quantile(&b, 0.5)? * 1e6, quantile(&b, 0.99)? * 1e6, n))
}

/// One (agent, peer) path.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PathRow {
    /// The agent.
    pub agent: String,
    /// The peer agent.
    pub peer: String,
    /// Fitted bandwidth, GB/s (10^9 B/s).
    pub bandwidth_gbps: Option<f64>,
    /// Fitted fixed cost, ms.
    pub fixed_ms: Option<f64>,
    /// Probe READ latency p50, µs (upper bound of its log2 bucket).
    pub p50_us: Option<f64>,
    /// Probe READ latency p99, µs (same).
    pub p99_us: Option<f64>,
    /// Probe READs counted.
    pub probe_reads: u64,
    /// Path valid (link up).
    pub path_valid: bool,
    /// Bandwidth alarm raised.
    pub alarm: bool,
}

/// One pair threshold pushed by an agent.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ThresholdRow {
    /// The agent.
    pub agent: String,
    /// Prefill engine.
    pub prefill: String,
    /// Decode engine.
    pub decode: String,
    /// Threshold, tokens.
    pub threshold_tokens: Option<u64>,
    /// Confidence of the fitted model behind it, in `[0, 1]` (none while
    /// the pair has no fit or its fit is invalidated: the router then uses
    /// its static threshold).
    pub confidence: Option<f64>,
}

/// Everything shown.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Snapshot {
    /// Paths of every agent.
    pub paths: Vec<PathRow>,
    /// Thresholds of every agent.
    pub thresholds: Vec<ThresholdRow>,
    /// Router decisions by reason: `(router, reason, count)`.
    pub decisions: Vec<(String, String, f64)>,
    /// Agents or routers that did not answer: `(address, error)`.
    pub errors: Vec<(String, String)>,
}

/// Adds one agent's `/v1/status` and `/metrics` to `snap`.
pub fn add_agent(snap: &mut Snapshot, status: &serde_json::Value, metrics: &str) {
    let agent = status["agent_id"].as_str().unwrap_or("?").to_string();
    let samples = parse_metrics(metrics);
    if let Some(peers) = status["peers"].as_object() {
        for (name, p) in peers {
            let lat = probe_latency(&samples, name);
            snap.paths.push(PathRow {
                agent: agent.clone(),
                peer: name.clone(),
                bandwidth_gbps: p["bandwidth_bytes_per_s"].as_f64().map(|b| b / 1e9),
                fixed_ms: p["fixed_ms"].as_f64(),
                p50_us: lat.map(|l| l.0),
                p99_us: lat.map(|l| l.1),
                probe_reads: lat.map_or(0, |l| l.2),
                path_valid: p["path_valid"].as_bool().unwrap_or(false),
                alarm: p["alarm"].as_bool().unwrap_or(false),
            });
        }
    }
    if let Some(ts) = status["thresholds"].as_array() {
        for t in ts {
            snap.thresholds.push(ThresholdRow {
                agent: agent.clone(),
                prefill: t["prefill_engine_id"].as_str().unwrap_or("?").into(),
                decode: t["decode_engine_id"].as_str().unwrap_or("?").into(),
                threshold_tokens: t["threshold_tokens"].as_u64(),
                confidence: t["confidence"].as_f64(),
            });
        }
    }
}

/// Adds one router's decisions (`kvloop_router_decisions_total{reason}`).
pub fn add_router(snap: &mut Snapshot, router: &str, metrics: &str) {
    for s in parse_metrics(metrics) {
        if s.name == "kvloop_router_decisions_total"
            && let Some(r) = s.labels.get("reason")
        {
            snap.decisions
                .push((router.to_string(), r.clone(), s.value));
        }
    }
}

/// Sort order of the path table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    /// Agent, then peer.
    Path,
    /// Lowest bandwidth first.
    Bandwidth,
    /// Highest p99 first.
    P99,
    /// Highest fixed cost first.
    Fixed,
}

impl SortKey {
    /// The next key (`s`).
    pub fn next(self) -> Self {
        match self {
            SortKey::Path => SortKey::Bandwidth,
            SortKey::Bandwidth => SortKey::P99,
            SortKey::P99 => SortKey::Fixed,
            SortKey::Fixed => SortKey::Path,
        }
    }

    /// Its name in the footer.
    pub fn label(self) -> &'static str {
        match self {
            SortKey::Path => "path",
            SortKey::Bandwidth => "bandwidth",
            SortKey::P99 => "p99",
            SortKey::Fixed => "fixed",
        }
    }
}

/// The path rows to show: filtered (`alarms_only`: alarm raised or path
/// invalid; `needle`: agent or peer contains it) and sorted.
pub fn view(paths: &[PathRow], key: SortKey, alarms_only: bool, needle: &str) -> Vec<PathRow> {
    let mut v: Vec<PathRow> = paths
        .iter()
        .filter(|p| !alarms_only || p.alarm || !p.path_valid)
        .filter(|p| needle.is_empty() || p.agent.contains(needle) || p.peer.contains(needle))
        .cloned()
        .collect();
    let f = |x: Option<f64>, missing: f64| x.unwrap_or(missing);
    match key {
        SortKey::Path => v.sort_by(|a, b| (&a.agent, &a.peer).cmp(&(&b.agent, &b.peer))),
        SortKey::Bandwidth => v.sort_by(|a, b| {
            f(a.bandwidth_gbps, f64::INFINITY).total_cmp(&f(b.bandwidth_gbps, f64::INFINITY))
        }),
        SortKey::P99 => v.sort_by(|a, b| f(b.p99_us, -1.0).total_cmp(&f(a.p99_us, -1.0))),
        SortKey::Fixed => v.sort_by(|a, b| f(b.fixed_ms, -1.0).total_cmp(&f(a.fixed_ms, -1.0))),
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "# TYPE vllm:nixl_xfer_time_seconds histogram\n\
vllm:nixl_xfer_time_seconds_bucket{direction=\"probe\",peer=\"probe.node-b\",ok=\"true\",le=\"0.000128\"} 10\n\
vllm:nixl_xfer_time_seconds_bucket{direction=\"probe\",peer=\"probe.node-b\",ok=\"true\",le=\"0.000256\"} 90\n\
vllm:nixl_xfer_time_seconds_bucket{direction=\"probe\",peer=\"probe.node-b\",ok=\"true\",le=\"0.001024\"} 100\n\
vllm:nixl_xfer_time_seconds_bucket{direction=\"probe\",peer=\"probe.node-b\",ok=\"true\",le=\"+Inf\"} 100\n\
vllm:nixl_xfer_time_seconds_bucket{direction=\"d2p\",peer=\"probe.node-b\",ok=\"true\",le=\"+Inf\"} 7\n\
kvloop_router_decisions_total{reason=\"below_threshold\"} 4\n\
kvloop_router_decisions_total{reason=\"no_params\"} 2\n";

    #[test]
    fn probe_percentiles_come_from_the_cumulative_buckets() {
        let s = parse_metrics(METRICS);
        assert_eq!(s.len(), 7);
        assert_eq!(s[0].labels["le"], "0.000128");
        let (p50, p99, n) = probe_latency(&s, "node-b").unwrap();
        assert!((p50 - 256.0).abs() < 1e-9, "{p50}");
        assert!((p99 - 1024.0).abs() < 1e-9, "{p99}");
        assert_eq!(n, 100);
        assert_eq!(probe_latency(&s, "node-c"), None);
    }

    #[test]
    fn status_and_metrics_become_rows_sorted_and_filtered() {
        let st = serde_json::json!({"agent_id": "node-a",
            "peers": {"node-b": {"path_valid": true, "alarm": false,
                                 "bandwidth_bytes_per_s": 2.5e9, "fixed_ms": 0.2},
                      "node-c": {"path_valid": true, "alarm": true,
                                 "bandwidth_bytes_per_s": 1e8, "fixed_ms": 0.9}},
            "thresholds": [{"prefill_engine_id": "p0", "decode_engine_id": "d0",
                            "threshold_tokens": 320, "confidence": 0.75}]});
        let mut snap = Snapshot::default();
        add_agent(&mut snap, &st, METRICS);
        add_router(&mut snap, "r0", METRICS);
        assert_eq!(snap.paths.len(), 2);
        assert_eq!(snap.paths[0].p99_us, Some(1024.0));
        assert_eq!(snap.paths[0].bandwidth_gbps, Some(2.5));
        assert_eq!(snap.thresholds[0].threshold_tokens, Some(320));
        assert_eq!(snap.thresholds[0].confidence, Some(0.75));
        assert_eq!(snap.decisions.len(), 2);
        let v = view(&snap.paths, SortKey::Bandwidth, false, "");
        assert_eq!(v[0].peer, "node-c");
        let v = view(&snap.paths, SortKey::Path, true, "");
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].peer, "node-c");
        assert_eq!(view(&snap.paths, SortKey::Path, false, "b").len(), 1);
        assert_eq!(SortKey::Fixed.next(), SortKey::Path);
    }
}
