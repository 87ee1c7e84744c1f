//! Engine load polling (every `load_interval_ms`): under
//! `policy = "predicted_ttft"` each prefill engine's `GET /metrics` is read
//! for vLLM's `vllm:num_requests_waiting` and `vllm:num_requests_running`,
//! so the selection sees the queue that every router replica together put
//! on a P, not only this replica's own requests; each decode engine's for
//! its KV usage (the selection's D choice, adaptive retention's renewals). The parsing is pure
//! ([`queue_requests`]); a failed scrape leaves the engine unreported (the
//! selection then counts only this replica's requests).
use std::sync::Arc;
use std::time::Duration;

use crate::config::Policy;
use crate::state::AppState;

/// Sum of the `vllm:num_requests_waiting` and `vllm:num_requests_running`
/// samples (every label set, e.g. one per model) in Prometheus text;
/// `None` when neither appears.
pub fn queue_requests(text: &str) -> Option<u32> {
    let mut seen = false;
    let mut sum = 0.0f64;
    for name in ["vllm:num_requests_waiting", "vllm:num_requests_running"] {
        for v in samples(text, name).filter(|v| v.is_finite() && *v >= 0.0) {
            sum += v;
            seen = true;
        }
    }
    seen.then(|| sum.round().min(f64::from(u32::MAX - 1)) as u32)
}

/// The values of every sample of metric `name` (any label set) in
/// Prometheus text; a line of another metric whose name starts with `name`
/// is not one (a label set or a space must follow the name).
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let rest = match rest.chars().next() {
            Some('{') => rest.split_once('}').map_or("", |(_, v)| v),
            Some(' ') => rest,
            _ => return None,
        };
        rest.split_whitespace().next()?.parse::<f64>().ok()
    })
}

/// The largest sample of gauge `name` (any label set) in Prometheus text,
/// finite and in `0..=1`; `None` when absent. Used for D's KV usage
/// (`vllm:kv_cache_usage_perc`, vLLM's name and range, 1 = 100 %).
pub fn fraction_gauge(text: &str, name: &str) -> Option<f64> {
    samples(text, name)
        .filter(|v| (0.0..=1.0).contains(v))
        .reduce(f64::max)
}

impl AppState {
    /// Polls once: every prefill engine's queue (under `predicted_ttft`)
    /// and every decode engine's KV usage (`vllm:kv_cache_usage_perc`;
    /// vLLM before v1: `vllm:gpu_cache_usage_perc`), which the selection's
    /// D choice and decode-side retention's renewals read.
    pub async fn poll_load(&self) {
        if self.cfg.policy == Policy::PredictedTtft {
            for &i in &self.prefill_idx {
                let got = self
                    .engine_get(i, "/metrics")
                    .await
                    .and_then(|b| queue_requests(std::str::from_utf8(&b).ok()?));
                self.load.set_reported_requests(i, got);
            }
        }
        for &i in &self.decode_idx {
            let usage = self.engine_get(i, "/metrics").await.and_then(|b| {
                let t = std::str::from_utf8(&b).ok()?;
                fraction_gauge(t, "vllm:kv_cache_usage_perc")
                    .or_else(|| fraction_gauge(t, "vllm:gpu_cache_usage_perc"))
            });
            self.load.set_kv_usage(i, usage);
        }
    }
}

/// Spawns the poller of `state` (none when `load_interval_ms` is 0, or
/// when neither the policy predicts nor retention is adaptive); it ends
/// when the state is dropped.
pub fn spawn(state: &Arc<AppState>) {
    let predicts = state.cfg.policy == Policy::PredictedTtft;
    let adaptive = state.cfg.retention.mode == kvloop_retention::RetentionMode::Adaptive;
    if state.cfg.load_interval_ms == 0 || !(predicts || adaptive) {
        return;
    }
    let weak = Arc::downgrade(state);
    let period = Duration::from_millis(state.cfg.load_interval_ms.max(10));
    tokio::spawn(async move {
        loop {
            let Some(s) = weak.upgrade() else { break };
            s.poll_load().await;
            drop(s);
            tokio::time::sleep(period).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::queue_requests;

    #[test]
    fn waiting_and_running_are_summed_over_label_sets() {
        let t = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
                 vllm:num_requests_waiting{model_name=\"a\"} 2.0\n\
                 vllm:num_requests_waiting{model_name=\"b\"} 1\n\
                 vllm:num_requests_running 1\n\
                 vllm:num_requests_waiting_by_reason{reason=\"x\"} 9\n\
                 vllm:num_requests_swapped 7\n";
        assert_eq!(queue_requests(t), Some(4));
        assert_eq!(queue_requests("vllm:num_requests_running NaN\n"), None);
        assert_eq!(queue_requests("other 1\n"), None);
        assert_eq!(queue_requests("vllm:num_requests_running 0\n"), Some(0));
    }

    #[test]
    fn kv_usage_is_the_largest_fraction() {
        use super::fraction_gauge as f;
        let n = "vllm:kv_cache_usage_perc";
        let t = "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n\
                 vllm:kv_cache_usage_perc{model_name=\"b\"} 0.5\nvllm:kv_cache_usage_perc_x 0.9\n";
        assert_eq!(f(t, n), Some(0.5));
        assert_eq!(f("vllm:kv_cache_usage_perc 7\n", n), None, "outside 0..1");
        assert_eq!(f("vllm:kv_cache_usage_perc NaN\n", n), None);
        assert_eq!(f("", n), None);
    }
}
