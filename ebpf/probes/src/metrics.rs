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
use std::sync::Weak;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::Probes;
use crate::loader::Inner;
use crate::state::HistogramSnapshot;

#[derive(Debug)]
pub(crate) struct ProbeCollector {
    pub(crate) probes: Weak<Inner>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probes")
            .field("source", &self.source)
            .finish()
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

impl Collector for ProbeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(inner) = self.probes.upgrade() else {
            return Ok(());
        };
        let snap = Probes::snapshot_histograms(&inner);

        {
            let mut fam = encoder.encode_descriptor(
                "vllm:nixl_xfer_time_seconds",
                "KV-cache READ duration post to completion, seconds (log2 buckets)",
                None,
                MetricType::Histogram,
            )?;
            for (l, h) in &snap.xfer_histograms {
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
                fam.encode_family(&labels)?.encode_histogram::<Labels>(
                    h.sum_ns as f64 * 1e-9,
                    h.count,
                    &buckets(h),
                    None,
                )?;
            }
        }

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
        {
            let mut fam = encoder.encode_descriptor(
                "vllm:nixl_num_failed_transfers",
                "KV-cache READs that completed with an error",
                None,
                MetricType::Counter,
            )?;
            for ((site, source), n) in &failed {
                let labels: Labels =
                    vec![("site", site.to_string()), ("source", source.to_string())];
                ConstCounter::new(*n).encode(fam.encode_family(&labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_xfer_bytes",
                "Payload bytes of completed KV-cache READs",
                None,
                MetricType::Counter,
            )?;
            for (labels, n) in &bytes {
                ConstCounter::new(*n).encode(fam.encode_family(labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_prefill_latency_seconds",
                "Prefill request latency at the engine socket: first request bytes received to first response bytes sent, seconds",
                None,
                MetricType::Histogram,
            )?;
            for (port, h) in &snap.prefill_histograms {
                let labels: Labels = vec![("port", port.to_string()), ("source", "ebpf".into())];
                fam.encode_family(&labels)?.encode_histogram::<Labels>(
                    h.sum_ns as f64 * 1e-9,
                    h.count,
                    &buckets(h),
                    None,
                )?;
            }
        }
        let ctr = |name: &str| {
            snap.counters
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .unwrap_or(0)
        };
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_prefill_requests",
                "Prefill requests seen in user space, by whether the X-KVLoop-Tokens header attributed them",
                None,
                MetricType::Counter,
            )?;
            for (v, n) in [
                ("true", "prefill_attributed"),
                ("false", "prefill_unattributed"),
            ] {
                let labels: Labels = vec![("attributed", v.into())];
                ConstCounter::new(ctr(n)).encode(fam.encode_family(&labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_prefill_tokens",
                "Tokens of attributed prefill requests (prompt, reused from D)",
                None,
                MetricType::Counter,
            )?;
            for (v, n) in [
                ("prompt", "prefill_prompt_tokens"),
                ("reused", "prefill_reused_tokens"),
            ] {
                let labels: Labels = vec![("kind", v.into())];
                ConstCounter::new(ctr(n)).encode(fam.encode_family(&labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_tcp_retransmits",
                "TCP segments retransmitted, per peer (tcp:tcp_retransmit_skb)",
                None,
                MetricType::Counter,
            )?;
            for r in &snap.retransmits {
                let labels: Labels = vec![("peer", r.peer.to_string())];
                ConstCounter::new(r.count).encode(fam.encode_family(&labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_probe_events",
                "Probe bookkeeping counters: ring-buffer drops, unmatched completions, samples",
                None,
                MetricType::Counter,
            )?;
            for (name, v) in &snap.counters {
                let labels: Labels = vec![("counter", name.to_string())];
                ConstCounter::new(*v).encode(fam.encode_family(&labels)?)?;
            }
        }
        {
            let mut fam = encoder.encode_descriptor(
                "kvloop_probe_source_info",
                "Where the probes' samples come from: ebpf (kernel) or userspace (fallback)",
                None,
                MetricType::Gauge,
            )?;
            let labels: Labels = vec![("source", inner.source.label().into())];
            ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
