//! Configuration of the cost model (serde; every field has a documented default).

use serde::{Deserialize, Serialize};

/// vLLM's static `kv_recompute_threshold` default, in tokens (source: vLLM
/// NixlConnector `bidirectional_kv_xfer` docs, see `shared/DESIGN.md`).
pub const VLLM_STATIC_THRESHOLD_TOKENS: u64 = 64;

/// Errors of [`CostModelConfig::validate`]; each names the bad field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A field is outside its allowed range.
    #[error("cost model config: `{field}` = {value} is invalid: expected {expected}")]
    Invalid {
        /// Field name as written in the TOML.
        field: &'static str,
        /// The value found, formatted.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
}

/// Relative weight of each sample source in the fits (multiplies the time-decay
/// weight). All default to 1.0: eBPF, user-space and active-probe timings of a
/// READ measure the same thing; lower one if a source is known to be biased.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceWeights {
    /// Weight of samples timed in the kernel by the eBPF probes. Default 1.0.
    pub ebpf: f64,
    /// Weight of samples timed in user space by the agent. Default 1.0.
    pub userspace: f64,
    /// Weight of the agent's own active-probe READs. Default 1.0.
    pub active_probe: f64,
}

impl Default for SourceWeights {
    fn default() -> Self {
        SourceWeights { ebpf: 1.0, userspace: 1.0, active_probe: 1.0 }
    }
}

/// Cost model configuration (`[cost_model]` in the agent's TOML).
///
/// Defaults are chosen so that, with active probes every 250 ms plus traffic,
/// a bandwidth step is followed within a few seconds, while ±20 % noise never
/// moves the published threshold (see the crate's tests for the measurements).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModelConfig {
    /// Half-life of a transfer sample's weight in the transfer fit, ms.
    /// Default 2500 ms: after a step change the new regime holds the majority
    /// of the weight after one half-life, which is when the robust fit follows.
    pub transfer_half_life_ms: u64,
    /// Half-life of a prefill sample's weight in the prefill fit, ms.
    /// Default 5000 ms (prefill cost changes with load, more slowly than a link).
    pub prefill_half_life_ms: u64,
    /// Samples kept per model (peer × direction, or prefill engine); the oldest
    /// are dropped first. Default 512.
    pub max_samples_per_model: usize,
    /// Samples older than this are dropped, ms. Default 120000 (2 min).
    pub max_sample_age_ms: u64,
    /// Fewer samples than this in a model: no fit. Default 6.
    pub min_samples: usize,
    /// Half-life of confidence with the age of the newest sample, ms: a model
    /// whose newest sample is this old has half the confidence. Default 30000.
    pub staleness_half_life_ms: u64,
    /// Effective sample count at which the count part of confidence is 0.5
    /// (`n / (n + this)`). Default 8.
    pub confidence_half_samples: f64,
    /// Below this confidence the published threshold does not move (it holds
    /// the last good value, or the static default before the first good one).
    /// Default 0.3.
    pub min_confidence: f64,
    /// Hysteresis band at full confidence, relative: the estimate must leave
    /// `published × (1 ± band)` before the threshold moves. Default 0.10.
    /// The band used is `band_rel / confidence`, capped by `max_band_rel`.
    pub band_rel: f64,
    /// Widest hysteresis band (at low confidence), relative. Default 0.5.
    pub max_band_rel: f64,
    /// The estimate must also differ from the published value by at least this
    /// many tokens to move it (one vLLM block by default). Default 16.
    pub min_step_tokens: u64,
    /// The estimate must stay outside the band on the same side for this long
    /// before the threshold moves, ms. Default 2000.
    pub dwell_ms: u64,
    /// Smallest threshold ever published, tokens. Default 16 (one block).
    pub min_threshold_tokens: u64,
    /// Largest threshold ever published, tokens; also published when pulling
    /// never pays off and when a path is invalidated. Default 131072
    /// (Qwen3's longest context with YaRN).
    pub max_threshold_tokens: u64,
    /// Threshold published for a pair before its first confident estimate.
    /// Default 64 (vLLM's static `kv_recompute_threshold`).
    pub static_default_tokens: u64,
    /// Threshold changes kept per pair for `explain`. Default 16.
    pub history_len: usize,
    /// Bandwidth assumed when the samples cannot identify it (all transfers of
    /// one size) and no earlier fit identified it, bytes/s. Default 1.25e9
    /// (10 Gbit/s: on the slow side, so the threshold errs towards recompute).
    pub prior_bandwidth_bytes_per_s: f64,
    /// Per-descriptor cost assumed when descriptors cannot be told apart from
    /// bytes (every READ of one block shape), ms. Default 0.0 (the cost is then
    /// folded into the fitted bandwidth, exact for that shape).
    pub prior_per_descriptor_ms: f64,
    /// Linear prefill cost assumed when all prefills compute the same number of
    /// tokens and no earlier fit identified it, ms/token. Default 0.05.
    pub prior_prefill_ms_per_token: f64,
    /// Attention prefill cost assumed when it cannot be identified, ms per
    /// computed token per context token. Default 0.0.
    pub prior_prefill_ms_per_token_ctx: f64,
    /// Smallest pivot (share of a column's weighted second moment not explained
    /// by the earlier columns) for a coefficient to be fitted rather than fixed
    /// at its prior. Default 0.01 (≈ a coefficient of variation of 0.1 of the
    /// transfer sizes).
    pub min_pivot: f64,
    /// How often the driver should call `update`, ms (returned by
    /// `poll_timeout`). Default 250.
    pub update_interval_ms: u64,
    /// Weights of the sample sources.
    pub source_weights: SourceWeights,
}

impl Default for CostModelConfig {
    fn default() -> Self {
        CostModelConfig {
            transfer_half_life_ms: 2500,
            prefill_half_life_ms: 5000,
            max_samples_per_model: 512,
            max_sample_age_ms: 120_000,
            min_samples: 6,
            staleness_half_life_ms: 30_000,
            confidence_half_samples: 8.0,
            min_confidence: 0.3,
            band_rel: 0.10,
            max_band_rel: 0.5,
            min_step_tokens: 16,
            dwell_ms: 2000,
            min_threshold_tokens: 16,
            max_threshold_tokens: 131_072,
            static_default_tokens: VLLM_STATIC_THRESHOLD_TOKENS,
            history_len: 16,
            prior_bandwidth_bytes_per_s: 1.25e9,
            prior_per_descriptor_ms: 0.0,
            prior_prefill_ms_per_token: 0.05,
            prior_prefill_ms_per_token_ctx: 0.0,
            min_pivot: 0.01,
            update_interval_ms: 250,
            source_weights: SourceWeights::default(),
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, expected: &'static str) -> ConfigError {
    ConfigError::Invalid { field, value: value.to_string(), expected }
}

impl CostModelConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let pos_ms = [
            ("transfer_half_life_ms", self.transfer_half_life_ms),
            ("prefill_half_life_ms", self.prefill_half_life_ms),
            ("max_sample_age_ms", self.max_sample_age_ms),
            ("staleness_half_life_ms", self.staleness_half_life_ms),
            ("update_interval_ms", self.update_interval_ms),
        ];
        for (f, v) in pos_ms {
            if v == 0 {
                return Err(invalid(f, v, "a duration > 0 ms"));
            }
        }
        if self.max_samples_per_model < 3 {
            return Err(invalid("max_samples_per_model", self.max_samples_per_model, "at least 3"));
        }
        if self.min_samples < 3 || self.min_samples > self.max_samples_per_model {
            return Err(invalid("min_samples", self.min_samples, "3 ..= max_samples_per_model"));
        }
        let finite_pos = [
            ("confidence_half_samples", self.confidence_half_samples),
            ("prior_bandwidth_bytes_per_s", self.prior_bandwidth_bytes_per_s),
        ];
        for (f, v) in finite_pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(f, v, "a finite number > 0"));
            }
        }
        let finite_nonneg = [
            ("prior_per_descriptor_ms", self.prior_per_descriptor_ms),
            ("prior_prefill_ms_per_token", self.prior_prefill_ms_per_token),
            ("prior_prefill_ms_per_token_ctx", self.prior_prefill_ms_per_token_ctx),
            ("source_weights.ebpf", self.source_weights.ebpf),
            ("source_weights.userspace", self.source_weights.userspace),
            ("source_weights.active_probe", self.source_weights.active_probe),
        ];
        for (f, v) in finite_nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(f, v, "a finite number >= 0"));
            }
        }
        if !(0.0..=1.0).contains(&self.min_confidence) {
            return Err(invalid("min_confidence", self.min_confidence, "a number in [0, 1]"));
        }
        if !(self.band_rel >= 0.0 && self.band_rel < 1.0) {
            return Err(invalid("band_rel", self.band_rel, "a number in [0, 1)"));
        }
        if !(self.max_band_rel >= self.band_rel && self.max_band_rel < 1.0) {
            return Err(invalid("max_band_rel", self.max_band_rel, "a number in [band_rel, 1)"));
        }
        if !(self.min_pivot > 0.0 && self.min_pivot < 1.0) {
            return Err(invalid("min_pivot", self.min_pivot, "a number in (0, 1)"));
        }
        if self.min_threshold_tokens == 0 {
            return Err(invalid("min_threshold_tokens", 0, "at least 1 token"));
        }
        if self.max_threshold_tokens < self.min_threshold_tokens {
            return Err(invalid(
                "max_threshold_tokens",
                self.max_threshold_tokens,
                ">= min_threshold_tokens",
            ));
        }
        if self.history_len == 0 {
            return Err(invalid("history_len", 0, "at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip_toml() {
        let c = CostModelConfig::default();
        c.validate().unwrap();
        let parsed: CostModelConfig = toml::from_str("").unwrap();
        assert_eq!(parsed, c);
        let parsed: CostModelConfig = toml::from_str("dwell_ms = 500\n[source_weights]\nebpf = 0.5\n").unwrap();
        assert_eq!(parsed.dwell_ms, 500);
        assert_eq!(parsed.source_weights.ebpf, 0.5);
        assert_eq!(parsed.source_weights.userspace, 1.0);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = toml::from_str::<CostModelConfig>("dwel_ms = 5").unwrap_err();
        assert!(e.to_string().contains("dwel_ms"), "{e}");
        let c = CostModelConfig { band_rel: 1.5, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("band_rel"));
        let c = CostModelConfig { max_threshold_tokens: 1, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("max_threshold_tokens"));
    }
}
