//! `GET /metrics`: Prometheus text with vLLM's metric names where vLLM has
//! one (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:time_to_first_token_seconds`, and the NixlConnector's
//! `vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred`,
//! `vllm:nixl_num_failed_transfers`), and `kvloop_sim_*` for the simulator's
//! own counters (verified and mismatched blocks, reused and computed tokens).
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The engine's metrics.
pub struct Metrics {
    registry: Registry,
    /// `vllm:prompt_tokens_total`: prompt tokens of generation requests.
    pub prompt_tokens: Counter,
    /// `vllm:generation_tokens_total`: output tokens.
    pub generation_tokens: Counter,
    /// `vllm:time_to_first_token_seconds`: request arrival → first token, s.
    pub ttft_seconds: Histogram,
    /// `vllm:nixl_xfer_time_seconds`: one READ (claim + transfer), s.
    pub xfer_time_seconds: Histogram,
    /// `vllm:nixl_bytes_transferred`: bytes of one READ.
    pub xfer_bytes: Histogram,
    /// `vllm:nixl_num_failed_transfers_total`: READs that failed or were declined.
    pub failed_transfers: Counter,
    /// `kvloop_sim_verified_blocks_total`: READ blocks that matched byte for byte.
    pub verified_blocks: Counter,
    /// `kvloop_sim_mismatched_blocks_total`: READ blocks that differed (recomputed).
    pub mismatched_blocks: Counter,
    /// `kvloop_sim_reused_tokens_total`: prompt tokens read instead of computed.
    pub reused_tokens: Counter,
    /// `kvloop_sim_computed_tokens_total`: prompt tokens computed.
    pub computed_tokens: Counter,
    /// `vllm:num_requests_waiting`: requests arrived and not yet computing
    /// (READing remote KV, or waiting for a prefill slot), as vLLM counts
    /// its waiting queue.
    pub requests_waiting: Gauge,
    /// `vllm:num_requests_running`: requests computing their prompt (P) or
    /// decoding (D).
    pub requests_running: Gauge,
    /// `kvloop_sim_parked_blocks`: blocks out of use because an abandoned
    /// READ may still write them.
    pub parked_blocks: Gauge,
    /// `vllm:kv_cache_usage_perc`: blocks in use over all blocks, 0..1
    /// (vLLM's name and range: 1 means 100 % used), set at each scrape.
    pub kv_cache_usage: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let secs = [
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
        ];
        let m = Self {
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            ttft_seconds: Histogram::new(secs),
            xfer_time_seconds: Histogram::new(secs),
            xfer_bytes: Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                65536.0, 4.0, 10,
            )),
            failed_transfers: Counter::default(),
            verified_blocks: Counter::default(),
            mismatched_blocks: Counter::default(),
            reused_tokens: Counter::default(),
            computed_tokens: Counter::default(),
            requests_waiting: Gauge::default(),
            requests_running: Gauge::default(),
            parked_blocks: Gauge::default(),
            kv_cache_usage: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Generation tokens processed",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token, seconds",
            m.ttft_seconds.clone(),
        );
        registry.register(
            "vllm:nixl_xfer_time_seconds",
            "KV READ duration (claim over the side channel + transfer), seconds",
            m.xfer_time_seconds.clone(),
        );
        registry.register(
            "vllm:nixl_bytes_transferred",
            "Bytes of one KV READ",
            m.xfer_bytes.clone(),
        );
        registry.register(
            "vllm:nixl_num_failed_transfers",
            "KV READs that failed or were declined",
            m.failed_transfers.clone(),
        );
        registry.register(
            "kvloop_sim_verified_blocks",
            "READ blocks that matched the locally computed KV byte for byte",
            m.verified_blocks.clone(),
        );
        registry.register(
            "kvloop_sim_mismatched_blocks",
            "READ blocks that differed from the locally computed KV (then recomputed)",
            m.mismatched_blocks.clone(),
        );
        registry.register(
            "kvloop_sim_reused_tokens",
            "Prompt tokens read from a remote engine instead of computed",
            m.reused_tokens.clone(),
        );
        registry.register(
            "kvloop_sim_computed_tokens",
            "Prompt tokens computed locally",
            m.computed_tokens.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Requests waiting to be computed",
            m.requests_waiting.clone(),
        );
        registry.register(
            "vllm:num_requests_running",
            "Requests being computed",
            m.requests_running.clone(),
        );
        registry.register(
            "kvloop_sim_parked_blocks",
            "Blocks out of use because an abandoned READ may still write them",
            m.parked_blocks.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0..1 (1 means 100 percent usage)",
            m.kv_cache_usage.clone(),
        );
        Self { registry, ..m }
    }

    /// Adds a scrape-time collector (the agent link of a managed-mode engine).
    pub fn collect(&mut self, c: impl prometheus_client::collector::Collector) {
        self.registry.register_collector(Box::new(c));
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = encode(&mut s, &self.registry);
        s
    }
}
