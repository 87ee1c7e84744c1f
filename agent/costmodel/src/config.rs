//! Configuration of the cost model (serde; every field has a documented default).

use serde::{Deserialize, Serialize};

/// vLLM's static `kv_recompute_threshold` default, in tokens (source: vLLM
/// NixlConnector `bidirectional_kv_xfer` docs, see `docs/design.md`).
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
        SourceWeights {
            ebpf: 1.0,
            userspace: 1.0,
            active_probe: 1.0,
        }
    }
}

/// Cost model configuration (`[cost_model]` in the agent's TOML).
///
/// Defaults are chosen so that, with active probes every 250 ms plus traffic,
/// a bandwidth step is followed within a few seconds, while ±20 % noise moves
/// a steady threshold at most rarely (measured: 0–2 changes in 5 × 10 min per
/// scenario, no back-and-forth; `examples/sim_report.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModelConfig {
    /// Half-life of a transfer sample's weight in the transfer fit, ms.
    /// Default 60000 ms: long enough that ±20 % noise averages out (the
    /// break-even of an ill-conditioned pair moves 3–4 % per 1 % of error in
    /// the per-token READ cost); a step change is followed within seconds
    /// through the change detector, not through the decay.
    pub transfer_half_life_ms: u64,
    /// Absolute part of a READ time's noise, ms: the transfer fit scales a
    /// READ's residual by `predicted + transfer_noise_floor_ms` instead of
    /// `predicted` alone (`src/fit.rs`), so the scheduling jitter of a busy
    /// node does not make sub-millisecond probes look ±100 % noisy and drag
    /// the whole path's residual scale, confidence and change detector with
    /// them. Default 1 ms: the jitter `make demo-cluster` shows on a 2-core
    /// VM (residual scale 0.56–0.97 with a purely relative fit); on EFA
    /// nodes READs that inform the threshold take milliseconds or more, so
    /// the floor only takes weight from the tiniest probes. 0: purely
    /// relative residuals, as before.
    pub transfer_noise_floor_ms: f64,
    /// Half-life of a prefill sample's weight in the prefill fit, ms.
    /// Default 60000 ms (prefill cost changes with load, more slowly than a
    /// link; steps are caught by the change detector).
    pub prefill_half_life_ms: u64,
    /// Samples kept per model (peer × direction, or prefill engine); the oldest
    /// are dropped first. Default 2048 (above what `max_sample_age_ms` keeps
    /// at ~10 samples/s; an update with two full windows costs ≈ 0.3 ms in a
    /// release build).
    pub max_samples_per_model: usize,
    /// Samples older than this are dropped, ms; a model with no sample younger
    /// than this has no fit (confidence 0). Default 120000 (2 min).
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
    /// `published × (1 ± band)` before the threshold moves. Default 0.08.
    /// The band used is `max(band_rel, band_sigmas × se_rel) / confidence`,
    /// capped by `max_band_rel` (`se_rel`: relative standard error of the
    /// break-even).
    pub band_rel: f64,
    /// The band is at least this many standard errors of the break-even
    /// estimate (relative). Default 3.
    pub band_sigmas: f64,
    /// A threshold set from an estimate with relative standard error `se₀`
    /// is refined (moved at once, without dwell) to an estimate whose standard
    /// error is at most `se₀ / refine_se_factor` and which differs by more
    /// than `max(refine_min_rel, 2 × se)`. Default 1.5.
    pub refine_se_factor: f64,
    /// Smallest relative difference for a refinement. Default 0.03.
    pub refine_min_rel: f64,
    /// Widest hysteresis band (at low confidence), relative. Default 0.5.
    pub max_band_rel: f64,
    /// The estimate must also differ from the published value by at least this
    /// many tokens to move it (keeps tiny thresholds from moving by one token).
    /// Default 4.
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
    /// Change detector (two-sided CUSUM of the new samples' standardized
    /// ratio residuals, `r − 1` slower and `1 − 1/r` faster for `r` =
    /// observed / predicted, so k× faster weighs as k× slower; clipped at
    /// ±3): alarm level `h`. On an alarm the
    /// samples older than the shifted run are dropped, so the fit follows a
    /// step change in about a second instead of a half-life. Default 20
    /// (with the default slack: about 8 consecutive clipped samples; 5 % of
    /// 10× outliers do not reach it).
    pub change_detect_threshold: f64,
    /// Change detector slack `k` per sample, in residual scales. Default 0.5.
    pub change_detect_slack: f64,
    /// Weights of the sample sources.
    pub source_weights: SourceWeights,
}

impl Default for CostModelConfig {
    fn default() -> Self {
        CostModelConfig {
            transfer_half_life_ms: 60_000,
            transfer_noise_floor_ms: 1.0,
            prefill_half_life_ms: 60_000,
            max_samples_per_model: 2048,
            max_sample_age_ms: 120_000,
            min_samples: 6,
            staleness_half_life_ms: 30_000,
            confidence_half_samples: 8.0,
            min_confidence: 0.3,
            band_rel: 0.08,
            band_sigmas: 3.0,
            refine_se_factor: 1.5,
            refine_min_rel: 0.03,
            max_band_rel: 0.5,
            min_step_tokens: 4,
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
            change_detect_threshold: 20.0,
            change_detect_slack: 0.5,
            source_weights: SourceWeights::default(),
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, expected: &'static str) -> ConfigError {
    ConfigError::Invalid {
        field,
        value: value.to_string(),
        expected,
    }
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
            return Err(invalid(
                "max_samples_per_model",
                self.max_samples_per_model,
                "at least 3",
            ));
        }
        if self.min_samples < 3 || self.min_samples > self.max_samples_per_model {
            return Err(invalid(
                "min_samples",
                self.min_samples,
                "3 ..= max_samples_per_model",
            ));
        }
        let finite_pos = [
            ("confidence_half_samples", self.confidence_half_samples),
            (
                "prior_bandwidth_bytes_per_s",
                self.prior_bandwidth_bytes_per_s,
            ),
            ("change_detect_threshold", self.change_detect_threshold),
        ];
        for (f, v) in finite_pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(f, v, "a finite number > 0"));
            }
        }
        let finite_nonneg = [
            ("prior_per_descriptor_ms", self.prior_per_descriptor_ms),
            ("transfer_noise_floor_ms", self.transfer_noise_floor_ms),
            ("change_detect_slack", self.change_detect_slack),
            ("band_sigmas", self.band_sigmas),
            (
                "prior_prefill_ms_per_token",
                self.prior_prefill_ms_per_token,
            ),
            (
                "prior_prefill_ms_per_token_ctx",
                self.prior_prefill_ms_per_token_ctx,
            ),
            ("source_weights.ebpf", self.source_weights.ebpf),
            ("source_weights.userspace", self.source_weights.userspace),
            (
                "source_weights.active_probe",
                self.source_weights.active_probe,
            ),
        ];
        for (f, v) in finite_nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(f, v, "a finite number >= 0"));
            }
        }
        if !(0.0..=1.0).contains(&self.min_confidence) {
            return Err(invalid(
                "min_confidence",
                self.min_confidence,
                "a number in [0, 1]",
            ));
        }
        if !(self.band_rel >= 0.0 && self.band_rel < 1.0) {
            return Err(invalid("band_rel", self.band_rel, "a number in [0, 1)"));
        }
        if !(self.refine_se_factor.is_finite() && self.refine_se_factor > 1.0) {
            return Err(invalid(
                "refine_se_factor",
                self.refine_se_factor,
                "a finite number > 1",
            ));
        }
        if !(self.refine_min_rel >= 0.0 && self.refine_min_rel < 1.0) {
            return Err(invalid(
                "refine_min_rel",
                self.refine_min_rel,
                "a number in [0, 1)",
            ));
        }
        if !(self.max_band_rel >= self.band_rel && self.max_band_rel < 1.0) {
            return Err(invalid(
                "max_band_rel",
                self.max_band_rel,
                "a number in [band_rel, 1)",
            ));
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
        let parsed: CostModelConfig =
            toml::from_str("dwell_ms = 500\n[source_weights]\nebpf = 0.5\n").unwrap();
        assert_eq!(parsed.dwell_ms, 500);
        assert_eq!(parsed.source_weights.ebpf, 0.5);
        assert_eq!(parsed.source_weights.userspace, 1.0);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = toml::from_str::<CostModelConfig>("dwel_ms = 5").unwrap_err();
        assert!(e.to_string().contains("dwel_ms"), "{e}");
        let c = CostModelConfig {
            band_rel: 1.5,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("band_rel"));
        let c = CostModelConfig {
            max_threshold_tokens: 1,
            ..Default::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("max_threshold_tokens")
        );
    }
}
