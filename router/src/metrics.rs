//! Prometheus metrics of the router (`GET /metrics`, OpenMetrics text).
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `endpoint` and `outcome` of a client request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `completions` or `chat_completions`.
    pub endpoint: &'static str,
    /// `ok`, `client_error`, `prefill_error`, `decode_error`, `unavailable`.
    pub outcome: &'static str,
}

/// One label with a static value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Value.
    pub reason: &'static str,
}

/// Eviction cause.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// `lru` or `expired`.
    pub cause: &'static str,
}

/// Prefix check mode.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `tokens` or `history`.
    pub mode: &'static str,
}

/// Engine id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    /// Engine id.
    pub engine_id: String,
}

/// A (prefill, decode) engine pair.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PairLabels {
    /// P's engine id.
    pub prefill_engine_id: String,
    /// D's engine id.
    pub decode_engine_id: String,
}

/// A pull's outcome for a pair.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PullLabels {
    /// P's engine id.
    pub prefill_engine_id: String,
    /// D's engine id.
    pub decode_engine_id: String,
    /// `read`, `declined`, `failed`, `unreported` ([`crate::alarms::PullOutcome`]).
    pub outcome: &'static str,
}

/// One routed turn's selection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelectionLabels {
    /// `round_robin` or `predicted_ttft`.
    pub policy: String,
    /// [`crate::select::SelectReason`] label (`round_robin` under that policy).
    pub reason: String,
    /// P's engine id.
    pub prefill_engine_id: String,
    /// D's engine id.
    pub decode_engine_id: String,
    /// `pull` or `recompute`.
    pub action: String,
}

/// All metrics.
pub struct Metrics {
    registry: Registry,
    /// `kvloop_router_requests_total{endpoint,outcome}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `kvloop_router_ttft_seconds`: request arrival to the first byte of D's
    /// answer forwarded (streaming) or to D's full answer (non-streaming).
    pub ttft_seconds: Histogram,
    /// `kvloop_router_decisions_total{reason}`.
    pub decisions: Family<ReasonLabel, Counter>,
    /// `kvloop_router_store_entries`.
    pub store_entries: Gauge,
    /// `kvloop_router_store_evictions_total{cause}`.
    pub evictions: Family<CauseLabel, Counter>,
    /// `kvloop_router_store_skipped_total{reason}`: finished turns not stored.
    pub store_skipped: Family<ReasonLabel, Counter>,
    /// `kvloop_router_prefill_retries_total`: P retried once without D's params.
    pub prefill_retries: Counter,
    /// `kvloop_router_decode_retries_total`: turns whose decode request failed
    /// at the connection before D answered, prefilled again without reuse
    /// and resent to D once.
    pub decode_retries: Counter,
    /// `kvloop_router_params_rejected_total{reason}`: engine params rejected (`source_prefill`, `source_decode`, `unknown_engine`).
    pub params_rejected: Family<ReasonLabel, Counter>,
    /// `kvloop_router_prefix_check_mode{mode}`: 1 for the mode in force.
    pub prefix_check_mode: Family<ModeLabel, Gauge>,
    /// `kvloop_router_engine_healthy{engine_id}`.
    pub engine_healthy: Family<EngineLabel, Gauge>,
    /// `kvloop_router_threshold_pushes_total{reason}`: `applied`, `stale`, `rejected`, `unauthorized`.
    pub threshold_pushes: Family<ReasonLabel, Counter>,
    /// `kvloop_router_pull_notices_total{reason}`: agents' notices that a
    /// pull's READ ended without the blocks (`applied`: this replica's
    /// outstanding pull, now counted as a recompute; `unknown`: another
    /// replica's or already answered; `rejected`, `unauthorized`).
    pub pull_notices: Family<ReasonLabel, Counter>,
    /// `kvloop_router_pull_read_notices_total{reason}`: agents' notices
    /// that a pull's READ completed with the blocks (`applied`: this
    /// replica's outstanding pull, now in P's compute line; `unknown`,
    /// `rejected`, `unauthorized` as for `pull_notices`).
    pub pull_read_notices: Family<ReasonLabel, Counter>,
    /// `kvloop_router_pulls_total{prefill_engine_id,decode_engine_id,outcome}`:
    /// what P reported of the pulls the router asked for.
    pub pulls: Family<PullLabels, Counter>,
    /// `kvloop_router_pull_alarm{prefill_engine_id,decode_engine_id}`: 1 while
    /// the pair's pulls keep failing.
    pub pull_alarm: Family<PairLabels, Gauge>,
    /// `kvloop_router_decode_params_missing_total{decode_engine_id}`: storable
    /// decode answers of a conversation that carried no `kv_transfer_params`.
    pub decode_params_missing: Family<EngineLabel, Counter>,
    /// `kvloop_router_store_up`: the conversation store reachable (1) or not (0).
    pub store_up: Gauge,
    /// `kvloop_router_store_errors_total{op}`: store operations that failed.
    pub store_errors: Family<OpLabel, Counter>,
    /// `kvloop_router_store_reconnects_total`.
    pub store_reconnects: Counter,
    /// `kvloop_router_selections_total{policy,reason,prefill_engine_id,decode_engine_id,action}`.
    pub selections: Family<SelectionLabels, Counter>,
    /// `kvloop_router_selection_margin_seconds`: predicted TTFT of the
    /// runner-up option minus the chosen one's (`predicted_ttft`).
    pub selection_margin_seconds: Histogram,
    /// `kvloop_router_retention_total{action,cause,result}`: retention
    /// decisions about D's holds (`release`/`keep`; `cause` of
    /// [`crate::retention::Cause`]; `result`: the agent's `released`,
    /// `deferred`, `kept`, `unknown`, or `unmanaged` (no agent known:
    /// counted only), `error`, `dropped` (queue full)).
    pub retention: Family<RetentionLabels, Counter>,
    /// `kvloop_router_retention_followed`: holds whose lease the router
    /// follows (adaptive mode).
    pub retention_followed: Gauge,
}

/// Labels of `kvloop_router_retention_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetentionLabels {
    /// `release` or `keep`.
    pub action: &'static str,
    /// Why.
    pub cause: &'static str,
    /// What came of it.
    pub result: &'static str,
}

/// `op` of a store error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// `take`, `insert`, `decode` or `connect`.
    pub op: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts engine params rejected for `reason` (`source_prefill`,
    /// `source_decode`, `unknown_engine`).
    pub fn reject_params(&self, reason: &'static str) {
        self.params_rejected
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Register everything under the `kvloop_router` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvloop_router");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Client requests by endpoint and outcome",
            requests.clone(),
        );
        // 100 µs .. ~3.3 s
        let ttft_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        registry.register(
            "ttft_seconds",
            "Time to first token as seen by the router",
            ttft_seconds.clone(),
        );
        let decisions = Family::<ReasonLabel, Counter>::default();
        for r in crate::reason::Reason::ALL {
            let _ = decisions.get_or_create(&ReasonLabel { reason: r.as_str() });
        }
        registry.register("decisions", "Reuse decisions by reason", decisions.clone());
        let store_entries = Gauge::default();
        registry.register(
            "store_entries",
            "Conversations stored",
            store_entries.clone(),
        );
        let evictions = Family::<CauseLabel, Counter>::default();
        let _ = evictions.get_or_create(&CauseLabel { cause: "lru" });
        let _ = evictions.get_or_create(&CauseLabel { cause: "expired" });
        registry.register(
            "store_evictions",
            "Stored conversations dropped by LRU bound or TTL",
            evictions.clone(),
        );
        let store_skipped = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "store_skipped",
            "Finished turns whose D params were not stored",
            store_skipped.clone(),
        );
        let prefill_retries = Counter::default();
        registry.register(
            "prefill_retries",
            "Prefill requests retried without D's params",
            prefill_retries.clone(),
        );
        let decode_retries = Counter::default();
        registry.register(
            "decode_retries",
            "Turns whose decode connection failed before D answered, prefilled again and resent once",
            decode_retries.clone(),
        );
        let params_rejected = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "params_rejected",
            "Engine kv_transfer_params rejected",
            params_rejected.clone(),
        );
        let prefix_check_mode = Family::<ModeLabel, Gauge>::default();
        registry.register(
            "prefix_check_mode",
            "Prefix safety check in force (1)",
            prefix_check_mode.clone(),
        );
        let engine_healthy = Family::<EngineLabel, Gauge>::default();
        registry.register(
            "engine_healthy",
            "Engine health (1 healthy)",
            engine_healthy.clone(),
        );
        let threshold_pushes = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "threshold_pushes",
            "Threshold pushes by outcome",
            threshold_pushes.clone(),
        );
        let pull_notices = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "pull_notices",
            "Agents' notices that a pull's READ ended without the blocks, by outcome",
            pull_notices.clone(),
        );
        let pull_read_notices = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "pull_read_notices",
            "Agents' notices that a pull's READ completed with the blocks, by outcome",
            pull_read_notices.clone(),
        );
        let pulls = Family::<PullLabels, Counter>::default();
        registry.register(
            "pulls",
            "Pulls asked for, by what P reported (read, declined, failed, unreported)",
            pulls.clone(),
        );
        let pull_alarm = Family::<PairLabels, Gauge>::default();
        registry.register(
            "pull_alarm",
            "1 while a pair's pulls keep failing",
            pull_alarm.clone(),
        );
        let decode_params_missing = Family::<EngineLabel, Counter>::default();
        registry.register(
            "decode_params_missing",
            "Decode answers that should have carried kv_transfer_params and did not",
            decode_params_missing.clone(),
        );
        let store_up = Gauge::default();
        store_up.set(1);
        registry.register(
            "store_up",
            "Conversation store reachable (1) or not (0)",
            store_up.clone(),
        );
        let store_errors = Family::<OpLabel, Counter>::default();
        for op in ["take", "insert", "decode", "connect"] {
            let _ = store_errors.get_or_create(&OpLabel { op });
        }
        registry.register(
            "store_errors",
            "Conversation store operations that failed",
            store_errors.clone(),
        );
        let store_reconnects = Counter::default();
        registry.register(
            "store_reconnects",
            "Reconnections to the conversation store",
            store_reconnects.clone(),
        );
        let selections = Family::<SelectionLabels, Counter>::default();
        registry.register(
            "selections",
            "Routed turns by policy, reason, chosen P and D, and pull or recompute",
            selections.clone(),
        );
        // 100 µs .. ~3.3 s
        let selection_margin_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        registry.register(
            "selection_margin_seconds",
            "Predicted TTFT of the runner-up option minus the chosen one's",
            selection_margin_seconds.clone(),
        );
        let retention = Family::<RetentionLabels, Counter>::default();
        registry.register(
            "retention",
            "Retention decisions about decode engines' holds, by action, cause and result",
            retention.clone(),
        );
        let retention_followed = Gauge::default();
        registry.register(
            "retention_followed",
            "Holds whose lease the router follows (adaptive retention)",
            retention_followed.clone(),
        );
        Self {
            registry,
            retention,
            retention_followed,
            selections,
            selection_margin_seconds,
            store_up,
            store_errors,
            store_reconnects,
            pulls,
            pull_alarm,
            decode_params_missing,
            requests,
            ttft_seconds,
            decisions,
            store_entries,
            evictions,
            store_skipped,
            prefill_retries,
            decode_retries,
            params_rejected,
            prefix_check_mode,
            engine_healthy,
            threshold_pushes,
            pull_notices,
            pull_read_notices,
        }
    }

    /// OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("writing to a String");
        s
    }
}
