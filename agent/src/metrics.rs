//! The agent's Prometheus metrics (`GET /metrics`, OpenMetrics text).
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `kvloop_agent_engines` | gauge | | engines registered (managed mode) |
//! | `kvloop_agent_leases` | gauge | | retained requests under a lease |
//! | `kvloop_agent_reads` | counter | `direction`, `result` | managed READs: `ok`, `error`, `declined`, or `abandoned` (in flight when recomputing its blocks would have finished: `crate::overdue::abandon_after_ms`) |
//! | `kvloop_agent_read_bytes` | counter | `direction` | payload of successful managed READs |
//! | `kvloop_agent_rail_bytes` | counter | `rail`, `address` | payload bytes of the READs this agent's engines made (hosted and probe engines), per rail (`address`: the `backend.rails` entry, or `default`) |
//! | `kvloop_agent_reads_in_flight` | gauge | | managed READs posted and not finished (cancelled ones leave at once) |
//! | `kvloop_agent_pulls` | counter | `reader`, `owner`, `result`, `reason` | managed READs per engine pair: `read`, `declined`, `failed` (with the error kind) or `abandoned` (`recompute_faster`) |
//! | `kvloop_agent_pull_alarm` | gauge | `reader`, `owner` | 1 while the pair's last [`crate::pulls::DEFAULT_ALARM_AFTER`] or more pulls in a row were not read |
//! | `kvloop_agent_probe_reads` | counter | `peer`, `size`, `shape`, `result` | active probe READs (`shape`: descriptors per block id x bytes per descriptor, e.g. `128x4096`) |
//! | `kvloop_agent_probe_skipped` | counter | `peer` | probe rounds skipped by the rate limit |
//! | `kvloop_agent_reads_overdue` | counter | `peer` | READs (managed and probe) still in flight far past their path's prediction, each recorded as a lower-bound sample (`crate::overdue`) |
//! | `kvloop_agent_probe_confirm_rounds` | counter | `peer` | probe rounds run off the period because a probe READ was off the path's model (`crate::probe_plan::confirm_again`) |
//! | `kvloop_agent_model_samples` | counter | `fit`, `source`, `result` | samples offered to the cost model (`fit`: `transfer` or `prefill`; `source`: `ebpf`, `userspace`, `active_probe`; `result`: `accepted`, or `rejected` as invalid); what a fit holds now is in `kvloop explain` (a change point drops older samples) |
//! | `kvloop_agent_kernel_transfers` | counter | `site`, `result` | kernel-timed transfers drained: `recorded` for the cost model, else why not ([`crate::observe::Skip`]) |
//! | `kvloop_agent_path_bandwidth_bytes_per_second` | gauge | `peer` | fitted bandwidth of the inbound path |
//! | `kvloop_agent_path_fixed_cost_ms` | gauge | `peer` | fitted fixed cost per READ |
//! | `kvloop_agent_path_bandwidth_alarm` | gauge | `peer` | 1 when the fitted bandwidth is below `probe.alarm_ratio` × expected |
//! | `kvloop_agent_path_valid` | gauge | `peer` | 0 while the link under the path is down |
//! | `kvloop_agent_threshold_tokens` | gauge | `prefill`, `decode` | published recompute threshold |
//! | `kvloop_agent_threshold_changes` | counter | `prefill`, `decode` | threshold changes |
//! | `kvloop_agent_pushes` | counter | `router`, `result` | threshold push attempts (`ok`, `error`) |
//! | `kvloop_agent_pull_notices` | counter | `router`, `notice`, `result` | notices to the routers that a pull's READ ended (`notice`: `read` with the blocks, `abandoned` without them; `result`: `ok`, `error`; `kvloop_router_api::PullNotice`) |
//! | `kvloop_agent_pushes_early` | counter | `reason` | pushes made at once after a refit instead of at the next period (`pair_set`, `threshold`, `model`: `kvloop_costmodel::urgent_push`) |
//! | `kvloop_agent_retention` | counter | `action`, `outcome` | router retention decisions (`release`, `keep`) applied here or forwarded: `released`, `deferred`, `kept`, `unknown`, `forwarded`, `error` |
//! | `kvloop_agent_link_up` / `_link_speed_mbps` / `_link_mtu` | gauge | `interface` | rtnetlink link state (speed from sysfs) |
//! | `kvloop_agent_link_rx_bytes` / `_link_tx_bytes` / `_link_rx_errors` / `_link_tx_errors` | gauge | `interface` | link counters |
//! | `kvloop_agent_rdma_counter` | gauge | `device`, `port`, `counter` | `/sys/class/infiniband` port counters (EFA/RDMA) |
//!
//! plus the eBPF probes' metrics (`kvloop_probe_*`, see `ebpf/README.md`).
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label set: (name, value) pairs.
pub type Labels = Vec<(String, String)>;
type F64Gauge = Gauge<f64, AtomicU64>;

/// Builds a label set.
pub fn labels(kv: &[(&str, &str)]) -> Labels {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// All agent metrics.
#[derive(Default)]
pub struct Metrics {
    /// Engines registered.
    pub engines: Gauge,
    /// Retained requests.
    pub leases: Gauge,
    /// Managed READs.
    pub reads: Family<Labels, Counter>,
    /// Payload of managed READs.
    pub read_bytes: Family<Labels, Counter>,
    /// Managed READs posted and not finished.
    pub reads_in_flight: Gauge,
    /// Payload bytes per rail.
    pub rail_bytes: Family<Labels, Counter>,
    /// Managed READs per (reader, owner) pair, by outcome and reason.
    pub pulls: Family<Labels, Counter>,
    /// Pairs whose pulls keep failing.
    pub pull_alarm: Family<Labels, Gauge>,
    /// Active probe READs.
    pub probe_reads: Family<Labels, Counter>,
    /// Probe rounds skipped by the rate limit.
    pub probe_skipped: Family<Labels, Counter>,
    /// READs in flight far past their prediction (lower-bound samples).
    pub reads_overdue: Family<Labels, Counter>,
    /// Probe rounds run off the period to confirm an off-model READ.
    pub probe_confirm_rounds: Family<Labels, Counter>,
    /// Samples offered to the cost model, by fit, source and result.
    pub model_samples: Family<Labels, Counter>,
    /// Kernel-timed transfers drained, by site and result.
    pub kernel_transfers: Family<Labels, Counter>,
    /// Fitted bandwidth.
    pub path_bandwidth: Family<Labels, F64Gauge>,
    /// Fitted fixed cost.
    pub path_fixed_ms: Family<Labels, F64Gauge>,
    /// Bandwidth alarm.
    pub path_alarm: Family<Labels, Gauge>,
    /// Path validity.
    pub path_valid: Family<Labels, Gauge>,
    /// Published thresholds.
    pub threshold: Family<Labels, Gauge>,
    /// Threshold changes.
    pub threshold_changes: Family<Labels, Counter>,
    /// Push attempts.
    pub pushes: Family<Labels, Counter>,
    /// Early pushes by reason.
    pub pushes_early: Family<Labels, Counter>,
    /// Pull notices per router, notice (`read`, `abandoned`) and result.
    pub pull_notices: Family<Labels, Counter>,
    /// Router retention decisions by action and outcome.
    pub retention: Family<Labels, Counter>,
    /// Link up.
    pub link_up: Family<Labels, Gauge>,
    /// Link speed.
    pub link_speed_mbps: Family<Labels, Gauge>,
    /// Link MTU.
    pub link_mtu: Family<Labels, Gauge>,
    /// Link rx bytes.
    pub link_rx_bytes: Family<Labels, Gauge>,
    /// Link tx bytes.
    pub link_tx_bytes: Family<Labels, Gauge>,
    /// Link rx errors.
    pub link_rx_errors: Family<Labels, Gauge>,
    /// Link tx errors.
    pub link_tx_errors: Family<Labels, Gauge>,
    /// RDMA port counters.
    pub rdma: Family<Labels, Gauge>,
}

impl Metrics {
    /// Registers every metric in `r` under the `kvloop_agent` prefix.
    pub fn register(&self, r: &mut Registry) {
        let r = r.sub_registry_with_prefix("kvloop_agent");
        r.register(
            "engines",
            "Engines registered (managed mode)",
            self.engines.clone(),
        );
        r.register(
            "leases",
            "Retained requests under a lease",
            self.leases.clone(),
        );
        r.register("reads", "Managed READs", self.reads.clone());
        r.register(
            "read_bytes",
            "Payload bytes of successful managed READs",
            self.read_bytes.clone(),
        );
        r.register(
            "rail_bytes",
            "Payload bytes of the READs this agent's engines made, per rail",
            self.rail_bytes.clone(),
        );
        r.register(
            "reads_in_flight",
            "Managed READs posted and not finished",
            self.reads_in_flight.clone(),
        );
        r.register(
            "pulls",
            "Managed READs per (reader, owner) engine pair: read, declined or failed, with the reason",
            self.pulls.clone(),
        );
        r.register(
            "pull_alarm",
            "1 while a pair's pulls keep failing (declined or failed many times in a row)",
            self.pull_alarm.clone(),
        );
        r.register(
            "probe_reads",
            "Active probe READs",
            self.probe_reads.clone(),
        );
        r.register(
            "probe_skipped",
            "Probe rounds skipped by the rate limit",
            self.probe_skipped.clone(),
        );
        r.register(
            "reads_overdue",
            "READs still in flight far past their path's prediction, recorded as lower-bound samples",
            self.reads_overdue.clone(),
        );
        r.register(
            "model_samples",
            "Samples offered to the cost model, by fit, source and result",
            self.model_samples.clone(),
        );
        r.register(
            "probe_confirm_rounds",
            "Probe rounds run off the period because a probe READ was off the path's model",
            self.probe_confirm_rounds.clone(),
        );
        r.register(
            "kernel_transfers",
            "Kernel-timed transfers drained: recorded for the cost model, or why not",
            self.kernel_transfers.clone(),
        );
        r.register(
            "path_bandwidth_bytes_per_second",
            "Fitted bandwidth of the inbound path from a peer",
            self.path_bandwidth.clone(),
        );
        r.register(
            "path_fixed_cost_ms",
            "Fitted fixed cost of one READ from a peer",
            self.path_fixed_ms.clone(),
        );
        r.register(
            "path_bandwidth_alarm",
            "1 when a path's fitted bandwidth is far below what its provider should give",
            self.path_alarm.clone(),
        );
        r.register(
            "path_valid",
            "0 while the link under the path is down",
            self.path_valid.clone(),
        );
        r.register(
            "threshold_tokens",
            "Published recompute threshold per (P, D) pair",
            self.threshold.clone(),
        );
        r.register(
            "threshold_changes",
            "Threshold changes per pair",
            self.threshold_changes.clone(),
        );
        r.register(
            "pushes",
            "Threshold push attempts per router",
            self.pushes.clone(),
        );
        r.register(
            "pull_notices",
            "Notices to the routers that a pull's READ ended (with the blocks or without), per router",
            self.pull_notices.clone(),
        );
        r.register(
            "pushes_early",
            "Threshold pushes made at once after a refit (the cost model moved), by reason",
            self.pushes_early.clone(),
        );
        r.register(
            "retention",
            "Router retention decisions (release, keep) by outcome",
            self.retention.clone(),
        );
        r.register(
            "link_up",
            "Link operational state (1 = up)",
            self.link_up.clone(),
        );
        r.register(
            "link_speed_mbps",
            "Link speed from sysfs, Mbit/s (0 unknown)",
            self.link_speed_mbps.clone(),
        );
        r.register("link_mtu", "Link MTU, bytes", self.link_mtu.clone());
        r.register(
            "link_rx_bytes",
            "Link received bytes",
            self.link_rx_bytes.clone(),
        );
        r.register(
            "link_tx_bytes",
            "Link transmitted bytes",
            self.link_tx_bytes.clone(),
        );
        r.register(
            "link_rx_errors",
            "Link receive errors",
            self.link_rx_errors.clone(),
        );
        r.register(
            "link_tx_errors",
            "Link transmit errors",
            self.link_tx_errors.clone(),
        );
        r.register(
            "rdma_counter",
            "EFA/RDMA port counters from /sys/class/infiniband",
            self.rdma.clone(),
        );
    }
}
