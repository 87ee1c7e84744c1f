//! Prometheus metrics of the probes, encoded at scrape time from the kernel
//! maps and the user-space aggregates.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `vllm:nixl_xfer_time_seconds` | histogram | `direction`, `peer`, `size_class`, `site`, `ok`, `source` |
//! | `vllm:nixl_num_failed_transfers` | counter | `site`, `source` |
//! | `kvloop_xfer_bytes` | counter | `direction`, `peer`, `site`, `source` |
//! | `kvloop_prefill_latency_seconds` | histogram | `port`, `source` |
//! | `kvloop_prefill_requests` | counter | `attributed` |
//! | `kvloop_prefill_tokens` | counter | `kind` = `prompt` / `reused` |
//! | `kvloop_tcp_retransmits` | counter | `peer` |
//! | `kvloop_probe_events` | counter | `counter` (drops, unmatched, ...) |
//! | `kvloop_probe_source_info` | gauge (1) | `source` |
//!
//! `vllm:nixl_xfer_time_seconds` follows vLLM's NIXL connector metric of the
//! same name (transfer duration, seconds); kvloop adds labels. Buckets are the
//! log2 slots of the kernel histograms (upper bounds `2^(i+1)` ns).

use std::collections::HashMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::Source;
use crate::state::{HistogramSnapshot, Snapshot};

/// Where the collector gets its data at scrape time: the histograms and
/// counters, and the probes' source; `None` once the probes are dropped
/// (nothing is encoded then).
type SnapshotFn = dyn Fn() -> Option<(Snapshot, Source)> + Send + Sync;

/// The probes' Prometheus collector (see the table above).
pub(crate) struct ProbeCollector {
    snapshot: Box<SnapshotFn>,
}

impl ProbeCollector {
    /// A collector reading through `snapshot` at each scrape.
    pub(crate) fn new(
        snapshot: impl Fn() -> Option<(Snapshot, Source)> + Send + Sync + 'static,
    ) -> Self {
        Self {
            snapshot: Box::new(snapshot),
        }
    }
}

impl std::fmt::Debug for ProbeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeCollector").finish_non_exhaustive()
    }
}

fn buckets(h: &HistogramSnapshot) -> Vec<(f64, u64)> {
    h.slots
        .iter()
        .enumerate()
        .map(|(i, c)| (HistogramSnapshot::slot_upper_seconds(i), *c))
        .collect()
}

type Labels = Vec<(&'static str, String)>;

/// One counter family: a descriptor and one sample per label set.
fn encode_counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, n) in rows {
        ConstCounter::new(n).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One histogram family of log2 probe histograms (sums in ns → seconds).
fn encode_histograms<'h>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, &'h HistogramSnapshot)>,
) -> Result<(), std::fmt::Error> {
    let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in rows {
        fam.encode_family(&labels)?.encode_histogram::<Labels>(
            h.sum_ns as f64 * 1e-9,
            h.count,
            &buckets(h),
            None,
        )?;
    }
    Ok(())
}

impl Collector for ProbeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some((snap, source)) = (self.snapshot)() else {
            return Ok(());
        };

        encode_histograms(
            &mut encoder,
            "vllm:nixl_xfer_time_seconds",
            "KV-cache READ duration post to completion, seconds (log2 buckets)",
            snap.xfer_histograms.iter().map(|(l, h)| {
                let labels: Labels = vec![
                    ("direction", l.direction.label().to_string()),
                    ("peer", l.peer.clone()),
                    (
                        "size_class",
                        l.size_class
                            .map(|c| format!("{}", 1u64 << c.min(63)))
                            .unwrap_or_else(|| "unknown".into()),
                    ),
                    ("site", l.site.to_string()),
                    ("ok", l.ok.to_string()),
                    ("source", l.source.label().to_string()),
                ];
                (labels, h)
            }),
        )?;

        let mut failed: HashMap<(&str, &str), u64> = HashMap::new();
        let mut bytes: HashMap<Labels, u64> = HashMap::new();
        for (l, h) in &snap.xfer_histograms {
            if !l.ok {
                *failed.entry((l.site, l.source.label())).or_default() += h.count;
            }
            *bytes
                .entry(vec![
                    ("direction", l.direction.label().to_string()),
                    ("peer", l.peer.clone()),
                    ("site", l.site.to_string()),
                    ("source", l.source.label().to_string()),
                ])
                .or_default() += h.sum_bytes;
        }
        encode_counters(
            &mut encoder,
            "vllm:nixl_num_failed_transfers",
            "KV-cache READs that completed with an error",
            failed.into_iter().map(|((site, source), n)| {
                let labels: Labels =
                    vec![("site", site.to_string()), ("source", source.to_string())];
                (labels, n)
            }),
        )?;
        encode_counters(
            &mut encoder,
            "kvloop_xfer_bytes",
            "Payload bytes of completed KV-cache READs",
            bytes,
        )?;
        encode_histograms(
            &mut encoder,
            "kvloop_prefill_latency_seconds",
            "Prefill request latency at the engine socket: first request bytes received to first response bytes sent, seconds",
            snap.prefill_histograms.iter().map(|(port, h)| {
                let labels: Labels = vec![("port", port.to_string()), ("source", "ebpf".into())];
                (labels, h)
            }),
        )?;
        let ctr = |name: &str| {
            snap.counters
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .unwrap_or(0)
        };
        encode_counters(
            &mut encoder,
            "kvloop_prefill_requests",
            "Prefill requests seen in user space, by whether the X-KVLoop-Tokens header attributed them",
            [
                ("true", "prefill_attributed"),
                ("false", "prefill_unattributed"),
            ]
            .map(|(v, n)| (vec![("attributed", v.to_string())], ctr(n))),
        )?;
        encode_counters(
            &mut encoder,
            "kvloop_prefill_tokens",
            "Tokens of attributed prefill requests (prompt, reused from D)",
            [
                ("prompt", "prefill_prompt_tokens"),
                ("reused", "prefill_reused_tokens"),
            ]
            .map(|(v, n)| (vec![("kind", v.to_string())], ctr(n))),
        )?;
        encode_counters(
            &mut encoder,
            "kvloop_tcp_retransmits",
            "TCP segments retransmitted, per peer (tcp:tcp_retransmit_skb)",
            snap.retransmits
                .iter()
                .map(|r| (vec![("peer", r.peer.to_string())], r.count)),
        )?;
        encode_counters(
            &mut encoder,
            "kvloop_probe_events",
            "Probe bookkeeping counters: ring-buffer drops, unmatched completions, samples",
            snap.counters
                .iter()
                .map(|(name, v)| (vec![("counter", name.to_string())], *v)),
        )?;
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_probe_source_info",
                "Where the probes' samples come from: ebpf (kernel) or userspace (fallback)",
                None,
                MetricType::Gauge,
            )?;
            let labels: Labels = vec![("source", source.label().into())];
            ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
