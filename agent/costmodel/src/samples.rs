//! Sample types and the per-model sample window with its fit.

use crate::config::CostModelConfig;
use crate::fit::{self, Fit, FitParams, K, Row};
use crate::time::{Instant, ms};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;

/// Where a sample's timing came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleSource {
    /// Timed in the kernel by the eBPF probes (issue "eBPF probes").
    Ebpf,
    /// Timed in user space by the agent (fallback where eBPF cannot load).
    Userspace,
    /// One of the agent's own active-probe READs.
    ActiveProbe,
}

impl SampleSource {
    /// All sources, in display order.
    pub const ALL: [SampleSource; 3] = [
        SampleSource::Ebpf,
        SampleSource::Userspace,
        SampleSource::ActiveProbe,
    ];
}

/// Direction of a transfer relative to this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Data flows from the peer to this node: this node READs the peer's
    /// blocks (D→P when this node is the prefill node).
    Inbound,
    /// Data flows from this node to the peer: the peer READs this node's blocks.
    Outbound,
}

/// One timed READ between this node and a peer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferSample {
    /// When the READ completed (injected clock).
    pub at: Instant,
    /// Bytes moved (> 0).
    pub bytes: u64,
    /// Descriptors in the READ request (≥ 1).
    pub descriptors: u64,
    /// Wall time from request to completion (> 0).
    pub latency: Duration,
    /// Where the timing came from.
    pub source: SampleSource,
}

/// One timed prefill on a local prefill engine.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillSample {
    /// When the prefill finished (injected clock).
    pub at: Instant,
    /// Prompt length, tokens (> `reused_tokens`).
    pub prompt_tokens: u64,
    /// Tokens whose KV was READ instead of computed (the context of the
    /// computed ones). Computed tokens = `prompt_tokens - reused_tokens`.
    pub reused_tokens: u64,
    /// Prefill time (request received to first token sent), > 0.
    pub latency: Duration,
    /// Where the timing came from.
    pub source: SampleSource,
}

/// A sample rejected by validation; names the bad field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// A field is outside its allowed range.
    #[error("{kind} sample: `{field}` = {value} is invalid: expected {expected}")]
    Invalid {
        /// "transfer", "prefill" or "pair".
        kind: &'static str,
        /// Field name.
        field: &'static str,
        /// Value found, formatted.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
}

pub(crate) fn invalid(
    kind: &'static str,
    field: &'static str,
    value: impl ToString,
    expected: &'static str,
) -> SampleError {
    SampleError::Invalid {
        kind,
        field,
        value: value.to_string(),
        expected,
    }
}

/// What the fitting machinery needs from a sample.
pub(crate) trait Sample: Copy {
    fn at(&self) -> Instant;
    fn source(&self) -> SampleSource;
    /// Regressors and response (ms).
    fn row(&self) -> ([f64; K], f64);
}

impl TransferSample {
    pub(crate) fn validate(&self) -> Result<(), SampleError> {
        if self.bytes == 0 {
            return Err(invalid("transfer", "bytes", 0, "at least 1 byte"));
        }
        if self.descriptors == 0 {
            return Err(invalid(
                "transfer",
                "descriptors",
                0,
                "at least 1 descriptor",
            ));
        }
        if self.latency.is_zero() {
            return Err(invalid("transfer", "latency", "0 ns", "a duration > 0"));
        }
        Ok(())
    }
}

impl Sample for TransferSample {
    fn at(&self) -> Instant {
        self.at
    }
    fn source(&self) -> SampleSource {
        self.source
    }
    /// `latency_ms ≈ fixed_ms + bytes · ms_per_byte + descriptors · ms_per_descriptor`.
    fn row(&self) -> ([f64; K], f64) {
        (
            [1.0, self.bytes as f64, self.descriptors as f64],
            ms(self.latency),
        )
    }
}

impl PrefillSample {
    pub(crate) fn validate(&self) -> Result<(), SampleError> {
        if self.prompt_tokens == 0 {
            return Err(invalid("prefill", "prompt_tokens", 0, "at least 1 token"));
        }
        if self.reused_tokens >= self.prompt_tokens {
            return Err(invalid(
                "prefill",
                "reused_tokens",
                self.reused_tokens,
                "fewer than prompt_tokens (at least one token is computed)",
            ));
        }
        if self.latency.is_zero() {
            return Err(invalid("prefill", "latency", "0 ns", "a duration > 0"));
        }
        Ok(())
    }
}

impl Sample for PrefillSample {
    fn at(&self) -> Instant {
        self.at
    }
    fn source(&self) -> SampleSource {
        self.source
    }
    /// `latency_ms ≈ p0 + n·k1 + n·(ctx + n/2)·k2`, `n` computed tokens, `ctx`
    /// reused tokens (each computed token attends on average to `ctx + n/2`
    /// earlier tokens).
    fn row(&self) -> ([f64; K], f64) {
        let n = (self.prompt_tokens - self.reused_tokens) as f64;
        let ctx = self.reused_tokens as f64;
        ([1.0, n, n * (ctx + n / 2.0)], ms(self.latency))
    }
}

/// Samples behind a fit, per source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceStats {
    /// The source.
    pub source: SampleSource,
    /// Samples of this source in the window.
    pub samples: usize,
    /// Age of the newest of them, ms.
    pub newest_age_ms: f64,
    /// Age of the oldest of them, ms.
    pub oldest_age_ms: f64,
}

/// A regime change found by the change detector of a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChangePoint {
    /// When the detector fired (injected clock).
    pub detected_at: Instant,
    /// Start of the run of shifted samples; older samples were dropped.
    pub since: Instant,
    /// `true` when the samples became slower than the model (costs rose).
    pub slower: bool,
    /// Samples dropped.
    pub dropped: usize,
}

/// Result of one model's fit: coefficients (their meaning depends on the
/// model), quality and confidence.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ModelFit {
    pub fit: Fit,
    pub confidence: f64,
}

/// Per-coefficient confidence penalty when a coefficient is fixed at the
/// config prior (at a last good value the penalty is halved).
pub(crate) type Penalty = [f64; K];

/// Clip of the standardized residual fed to the change detector: one gross
/// outlier adds at most `CUSUM_CLIP - slack`.
const CUSUM_CLIP: f64 = 3.0;

/// A sample's residual against the fit from `r = observed / predicted`,
/// symmetric in the ratio: `r − 1` when slower (`r ≥ 1`), `1 − 1/r` when
/// faster, so a READ k× faster than predicted counts as much as one k×
/// slower (`±(k − 1)`). Near `r = 1` both are the relative error. The plain
/// relative error `r − 1` is bounded below by −1: under noise (σ 0.8) a
/// 4× faster link (a restored one) took 9–24 s to detect against 2–3 s for
/// a 4× slower one (`tests/recovery.rs`).
fn ratio_residual(r: f64) -> f64 {
    if r >= 1.0 {
        r - 1.0
    } else {
        1.0 - 1.0 / r.max(1e-6)
    }
}

/// Samples at the end of an alarmed CUSUM run whose mean sets the shift's
/// size in [`change_point`].
const SHIFT_TAIL: usize = 3;

/// When the shift that raised an alarm began, from the run of
/// standardized residuals `run` (time order, signed so that the shift is
/// positive) between the CUSUM's last zero and the alarm: the start `τ`
/// that maximizes `Σ_{i ≥ τ} (z_i − k')`, the likelihood-ratio estimate
/// of a mean shift of size `2k'`, with `k'` half the mean of the run's last
/// [`SHIFT_TAIL`] residuals (at least the detector's slack `k`). The
/// CUSUM's own start (its last zero) assumes a shift of `2k`: under noise
/// skewed by jitter the sum can stay above zero long before a gross step,
/// and every sample from then on would be kept as the new regime's, so
/// that the refit, outvoted by the old regime's samples, rejected the new
/// ones as outliers and never moved. `None` for an empty run.
fn change_point(run: &[(Instant, f64)], k: f64) -> Option<Instant> {
    let tail = &run[run.len().saturating_sub(SHIFT_TAIL)..];
    if tail.is_empty() {
        return None;
    }
    let shift = tail.iter().map(|x| x.1).sum::<f64>() / tail.len() as f64;
    let k2 = k.max(shift / 2.0);
    let (mut best, mut best_at, mut acc) = (f64::NEG_INFINITY, None, 0.0);
    for &(at, z) in run.iter().rev() {
        acc += z - k2;
        if acc >= best {
            best = acc;
            best_at = Some(at);
        }
    }
    best_at
}

/// Two-sided CUSUM of standardized ratio residuals ([`ratio_residual`]) of new samples against
/// the current fit (Page's test): `S⁺ = max(0, S⁺ + z − k)`,
/// `S⁻ = max(0, S⁻ − z − k)`, alarm when either exceeds `h`.
#[derive(Clone, Debug, Default)]
struct Cusum {
    pos: f64,
    neg: f64,
    pos_since: Option<Instant>,
    neg_since: Option<Instant>,
}

/// Window of samples of one model, and its latest fit.
#[derive(Clone, Debug)]
pub(crate) struct SampleModel<S: Sample> {
    pub samples: VecDeque<S>,
    /// Samples pushed since the last refit, not yet seen by the detector.
    unchecked: Vec<S>,
    cusum: Cusum,
    pub last_good: [Option<f64>; K],
    pub fit: Option<ModelFit>,
    pub last_change_point: Option<ChangePoint>,
    /// Number of change points found so far.
    pub change_epoch: u64,
}

impl<S: Sample> Default for SampleModel<S> {
    fn default() -> Self {
        SampleModel {
            samples: VecDeque::new(),
            unchecked: Vec::new(),
            cusum: Cusum::default(),
            last_good: [None; K],
            fit: None,
            last_change_point: None,
            change_epoch: 0,
        }
    }
}

impl<S: Sample> SampleModel<S> {
    pub fn push(&mut self, s: S, cfg: &CostModelConfig) {
        self.samples.push_back(s);
        self.unchecked.push(s);
        while self.samples.len() > cfg.max_samples_per_model {
            self.samples.pop_front();
        }
    }

    pub fn clear(&mut self) {
        self.samples.clear();
        self.unchecked.clear();
        self.cusum = Cusum::default();
        self.fit = None;
    }

    /// Drops samples older than `max_sample_age_ms` (against `now`) or whose
    /// decay weight relative to the newest sample is below 1e-4 (about 13
    /// half-lives: they no longer move the fit). A model without new samples
    /// keeps its window, so it ages (confidence falls) rather than vanishing,
    /// until `max_sample_age_ms`.
    fn prune(&mut self, now: Instant, half_life: Duration, cfg: &CostModelConfig) {
        let max_age = Duration::from_millis(cfg.max_sample_age_ms);
        let Some(newest) = self.samples.iter().map(|s| s.at()).max() else {
            return;
        };
        let max_spread = half_life.saturating_mul(13);
        self.samples.retain(|s| {
            now.saturating_duration_since(s.at()) <= max_age
                && newest.saturating_duration_since(s.at()) <= max_spread
        });
    }

    /// Feeds the samples that arrived since the last refit to the change
    /// detector; on an alarm drops the samples older than the shifted run.
    fn detect_change(&mut self, now: Instant, cfg: &CostModelConfig, noise_floor: f64) -> bool {
        let unchecked = std::mem::take(&mut self.unchecked);
        let Some(mf) = &self.fit else { return false };
        if mf.fit.n_eff < cfg.confidence_half_samples {
            return false;
        }
        let beta = mf.fit.beta;
        let residual = |s: &S| {
            let (x, y) = s.row();
            let yhat: f64 = beta
                .iter()
                .zip(&x)
                .map(|(b, x)| b * x)
                .sum::<f64>()
                .max(1e-6);
            ratio_residual((y + noise_floor) / (yhat + noise_floor))
        };
        let mut sorted = unchecked;
        sorted.sort_by_key(|s| s.at());
        let sigma = mf.fit.sigma_rel.max(1e-3);
        let k = cfg.change_detect_slack;
        let z_of = |s: &S| (residual(s) / sigma).clamp(-CUSUM_CLIP, CUSUM_CLIP);
        let mut alarm: Option<(Instant, bool, Instant)> = None;
        for s in &sorted {
            let z = z_of(s);
            let c = &mut self.cusum;
            if c.pos == 0.0 {
                c.pos_since = Some(s.at());
            }
            if c.neg == 0.0 {
                c.neg_since = Some(s.at());
            }
            c.pos = (c.pos + z - k).max(0.0);
            c.neg = (c.neg - z - k).max(0.0);
            if c.pos > cfg.change_detect_threshold {
                alarm = Some((c.pos_since.unwrap_or(s.at()), true, s.at()));
                break;
            }
            if c.neg > cfg.change_detect_threshold {
                alarm = Some((c.neg_since.unwrap_or(s.at()), false, s.at()));
                break;
            }
        }
        if let Some((start, slower, end)) = alarm {
            let sign = if slower { 1.0 } else { -1.0 };
            let mut run: Vec<(Instant, f64)> = self
                .samples
                .iter()
                .filter(|s| s.at() >= start && s.at() <= end)
                .map(|s| (s.at(), sign * z_of(s)))
                .collect();
            run.sort_by_key(|x| x.0);
            let since = change_point(&run, k).unwrap_or(start);
            let before = self.samples.len();
            self.samples.retain(|s| s.at() >= since);
            self.cusum = Cusum::default();
            self.last_change_point = Some(ChangePoint {
                detected_at: now,
                since,
                slower,
                dropped: before - self.samples.len(),
            });
            self.change_epoch += 1;
            return true;
        }
        false
    }

    /// Refits at `now`. `config_prior` holds the priors from the config;
    /// `penalty` the confidence factor of each coefficient when it is fixed;
    /// `noise_floor` the absolute part of the noise, ms (`src/fit.rs`).
    pub fn refit(
        &mut self,
        now: Instant,
        half_life: Duration,
        cfg: &CostModelConfig,
        config_prior: [f64; K],
        penalty: Penalty,
        noise_floor: f64,
    ) {
        let changed = self.detect_change(now, cfg, noise_floor);
        let warm = if changed {
            None
        } else {
            self.fit.as_ref().map(|m| m.fit.beta)
        };
        self.prune(now, half_life, cfg);
        if self.samples.len() < cfg.min_samples {
            self.fit = None;
            return;
        }
        let newest = self.samples.iter().map(|s| s.at()).max().unwrap_or(now);
        let hl = half_life.as_secs_f64();
        let rows: Vec<Row> = self
            .samples
            .iter()
            .map(|s| {
                let (x, y) = s.row();
                // Ages relative to the newest sample: the same fit as ages
                // relative to `now` (a common factor), without underflow when
                // a model has had no sample for a long time.
                let age = newest.saturating_duration_since(s.at()).as_secs_f64();
                let sw = match s.source() {
                    SampleSource::Ebpf => cfg.source_weights.ebpf,
                    SampleSource::Userspace => cfg.source_weights.userspace,
                    SampleSource::ActiveProbe => cfg.source_weights.active_probe,
                };
                Row {
                    x,
                    y,
                    w: sw * (-(age / hl) * std::f64::consts::LN_2).exp(),
                }
            })
            .collect();
        let mut prior = config_prior;
        let mut from_last_good = [false; K];
        for j in 0..K {
            if let Some(v) = self.last_good[j] {
                prior[j] = v;
                from_last_good[j] = true;
            }
        }
        let params = FitParams {
            prior,
            min_pivot: cfg.min_pivot,
            min_sigma: 0.01,
            floor_y: 1e-6,
            noise_floor,
        };
        let Some(f) = fit::robust_fit(&rows, &params, warm) else {
            self.fit = None;
            return;
        };
        // Confidence = count × staleness × identifiability × noise.
        let count = f.n_eff / (f.n_eff + cfg.confidence_half_samples);
        let age_ms = now.saturating_duration_since(newest).as_secs_f64() * 1e3;
        let stale = (-(age_ms / cfg.staleness_half_life_ms as f64) * std::f64::consts::LN_2).exp();
        let mut ident = 1.0;
        for j in 0..K {
            if !f.identified[j] {
                ident *= if from_last_good[j] {
                    (1.0 + penalty[j]) / 2.0
                } else {
                    penalty[j]
                };
            }
        }
        let noise = 1.0 / (1.0 + (f.sigma_rel / 0.5).powi(2));
        let confidence = (count * stale * ident * noise).clamp(0.0, 1.0);
        // A coefficient becomes the "last good" value (the prior when the data
        // stop identifying it) only when it is well determined: relative
        // standard error at most 10 %.
        for j in 0..K {
            let se = f.cov[j][j].max(0.0).sqrt();
            if f.identified[j] && f.beta[j] > 0.0 && se <= 0.1 * f.beta[j] {
                self.last_good[j] = Some(f.beta[j]);
            }
        }
        self.fit = Some(ModelFit { fit: f, confidence });
    }

    pub fn source_stats(&self, now: Instant) -> Vec<SourceStats> {
        SampleSource::ALL
            .iter()
            .filter_map(|&src| {
                let ages: Vec<f64> = self
                    .samples
                    .iter()
                    .filter(|s| s.source() == src)
                    .map(|s| ms(now.saturating_duration_since(s.at())))
                    .collect();
                if ages.is_empty() {
                    return None;
                }
                Some(SourceStats {
                    source: src,
                    samples: ages.len(),
                    newest_age_ms: ages.iter().copied().fold(f64::INFINITY, f64::min),
                    oldest_age_ms: ages.iter().copied().fold(0.0, f64::max),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    #[test]
    fn a_gross_step_starts_where_the_gross_residuals_do() {
        // A CUSUM run that began long before the step (noise skewed above
        // zero: +0.6 a sample), then four clipped residuals.
        let mut run: Vec<(Instant, f64)> = (0..20).map(|i| (at(i * 100), 0.6)).collect();
        run.extend((20..24).map(|i| (at(i * 100), 3.0)));
        assert_eq!(change_point(&run, 0.5), Some(at(2000)));
    }

    #[test]
    fn a_small_shift_keeps_the_whole_run() {
        // A shift of one residual scale: the whole run is the new regime.
        let run: Vec<(Instant, f64)> = (0..40).map(|i| (at(i * 100), 1.0)).collect();
        assert_eq!(change_point(&run, 0.5), Some(at(0)));
        assert_eq!(change_point(&[], 0.5), None);
    }
}
