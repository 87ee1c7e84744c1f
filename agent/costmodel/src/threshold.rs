//! Per-pair threshold with hysteresis, bounds and change history.
//!
//! Policy (why):
//! - Before a pair's first confident estimate the published threshold is the
//!   static default (vLLM's 64 tokens): it is what the router would use anyway.
//! - The first estimate with confidence ≥ `min_confidence` is published at
//!   once: the static default is known to be far from the break-even (public
//!   measurements put it at 2k–9k tokens), so waiting only costs.
//! - Afterwards the threshold moves only when the estimate stays outside
//!   `published × (1 ± band)` (and at least `min_step_tokens` away), on the
//!   same side, for `dwell_ms`. The band is
//!   `max(band_rel, band_sigmas × se_rel) / confidence`, capped at
//!   `max_band_rel`, where `se_rel` is the break-even's relative standard
//!   error (delta method from the fits' covariances): a break-even that is
//!   ill-conditioned (per-token READ cost close to per-token recompute cost)
//!   or fitted from few samples needs a larger disagreement to move.
//! - When confidence falls below `min_confidence` (samples few or old) the
//!   threshold **holds its last good value** rather than falling back to the
//!   static 64: the last good value was measured on this pair, 64 never was,
//!   and a stale threshold errs by the drift since then while 64 errs by the
//!   whole break-even. The low confidence is exported with the coefficients
//!   and the push's `valid_for_ms` bounds how long a router trusts it.
//! - Refinement: when the estimate's standard error has fallen by
//!   `refine_se_factor` since the published value was set and the estimate
//!   differs by more than `max(refine_min_rel, 2 × se)`, the threshold moves to it at
//!   once. An early estimate from few samples is thus corrected as evidence
//!   accumulates; the error can only fall by that factor a few times, so this
//!   cannot flap. A regime change found by a model's change detector (which
//!   already required a persistent shift) resets the published value's
//!   precision, so the threshold follows the new regime as soon as its fit
//!   is confident, then refines.
//! - A path invalidated by the network state (link down) publishes
//!   `max_threshold_tokens` (recompute) at once; its samples are dropped, and
//!   the next confident estimate is published at once, like a first one.

use crate::breakeven::{break_even_tokens, clamp_threshold};
use crate::config::CostModelConfig;
use crate::time::Instant;
use kvloop_router_api::CostModelCoefficients;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;

/// Which part of the cost model moved the threshold most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CauseKind {
    /// The fixed cost per READ.
    TransferFixedCost,
    /// The per-token transfer cost (bandwidth, descriptors).
    TransferPerTokenCost,
    /// The prefill (recompute) cost.
    PrefillCost,
}

/// Why the published threshold changed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChangeReason {
    /// First estimate with enough confidence (replacing the static default or
    /// the invalidated value).
    FirstEstimate,
    /// The estimate became at least twice as precise as the published one
    /// (standard error halved) and differs from it by more than `band_rel`.
    Refined {
        /// Relative standard error of the published value before.
        from_se_rel: f64,
        /// Relative standard error of the new value.
        to_se_rel: f64,
    },
    /// A model's change detector found a regime change (a persistent shift
    /// of its samples), and the threshold followed the new regime's first
    /// confident estimate at once.
    RegimeChange {
        /// Coefficient group whose change moved the break-even most.
        cause: CauseKind,
        /// Human-readable detail of the cause (old → new value).
        detail: String,
    },
    /// The estimate stayed outside the hysteresis band for the dwell time.
    OutsideBand {
        /// Band used, relative.
        band_rel: f64,
        /// How long the estimate had been outside, ms.
        outside_for_ms: f64,
        /// Coefficient group whose change moved the break-even most.
        cause: CauseKind,
        /// Human-readable detail of the cause (old → new value).
        detail: String,
    },
    /// The path to the decode node was invalidated (link down).
    PathInvalidated {
        /// What the network state reported.
        detail: String,
    },
}

/// One change of a pair's published threshold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThresholdChange {
    /// When it changed (injected clock).
    pub at: Instant,
    /// Threshold before, tokens.
    pub from_tokens: u64,
    /// Threshold after, tokens.
    pub to_tokens: u64,
    /// Unclamped break-even estimate, tokens; `None` when READing never wins.
    pub break_even_tokens: Option<f64>,
    /// Pair confidence at the change.
    pub confidence: f64,
    /// Why.
    pub reason: ChangeReason,
}

/// Where the published threshold comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThresholdState {
    /// Static default: no confident estimate yet.
    StaticDefault,
    /// Tracking the estimate (within hysteresis).
    Estimated,
    /// Holding the last good value: confidence below `min_confidence`.
    HeldLowConfidence,
    /// The path is invalidated: `max_threshold_tokens` (recompute).
    Invalidated,
}

/// The estimate the pair is currently moving towards.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingMove {
    /// Since when the estimate is outside the band on this side.
    pub since: Instant,
    /// `true` when above the band.
    pub upward: bool,
    /// Latest clamped estimate, tokens.
    pub estimate_tokens: u64,
}

/// One evaluation of a pair's model.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Estimate {
    pub coefficients: CostModelCoefficients,
    pub raw_tokens: f64,
    /// Standard error of `raw_tokens`, relative.
    pub se_rel: f64,
    /// Change epochs of the (transfer, prefill) models behind it.
    pub epoch: (u64, u64),
    pub tokens: u64,
}

/// Hysteresis state of one pair.
#[derive(Clone, Debug)]
pub(crate) struct PairThresholdState {
    pub published: u64,
    pub state: ThresholdState,
    pub published_coefficients: Option<CostModelCoefficients>,
    pub pending: Option<PendingMove>,
    pub history: VecDeque<ThresholdChange>,
    pub last_estimate: Option<Estimate>,
    pub band_rel: f64,
    /// Relative standard error of the estimate the published value came from.
    pub published_se_rel: f64,
    /// Change epochs of the models when the value was published.
    pub published_epoch: (u64, u64),
    /// A regime change happened since the last publish.
    pub regime_changed: bool,
}

fn pct(old: f64, new: f64) -> String {
    if old > 0.0 {
        format!("{:+.0} %", (new / old - 1.0) * 100.0)
    } else {
        "new".into()
    }
}

/// Which coefficient group explains most of the move from `old` to `new`.
fn attribute(old: &CostModelCoefficients, new: &CostModelCoefficients) -> (CauseKind, String) {
    let r_new = break_even_tokens(new);
    let ln = |a: f64, b: f64| {
        let (a, b) = (a.clamp(1.0, 1e12), b.clamp(1.0, 1e12));
        (a / b).ln().abs()
    };
    let mut fixed = new.clone();
    fixed.xfer_fixed_ms = old.xfer_fixed_ms;
    let mut per_tok = new.clone();
    per_tok.xfer_ms_per_token = old.xfer_ms_per_token;
    let mut pre = new.clone();
    pre.prefill_ms_per_token = old.prefill_ms_per_token;
    pre.prefill_ms_per_token_ctx = old.prefill_ms_per_token_ctx;
    let cands = [
        (
            CauseKind::TransferFixedCost,
            ln(r_new, break_even_tokens(&fixed)),
            format!(
                "READ fixed cost {:.3} → {:.3} ms ({})",
                old.xfer_fixed_ms,
                new.xfer_fixed_ms,
                pct(old.xfer_fixed_ms, new.xfer_fixed_ms)
            ),
        ),
        (
            CauseKind::TransferPerTokenCost,
            ln(r_new, break_even_tokens(&per_tok)),
            format!(
                "READ cost per token {:.5} → {:.5} ms ({})",
                old.xfer_ms_per_token,
                new.xfer_ms_per_token,
                pct(old.xfer_ms_per_token, new.xfer_ms_per_token)
            ),
        ),
        (
            CauseKind::PrefillCost,
            ln(r_new, break_even_tokens(&pre)),
            format!(
                "prefill cost per token {:.5} → {:.5} ms ({}), per token·ctx {:.3e} → {:.3e} ms",
                old.prefill_ms_per_token,
                new.prefill_ms_per_token,
                pct(old.prefill_ms_per_token, new.prefill_ms_per_token),
                old.prefill_ms_per_token_ctx,
                new.prefill_ms_per_token_ctx
            ),
        ),
    ];
    let best = cands
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("three candidates");
    (best.0, best.2)
}

impl PairThresholdState {
    pub fn new(cfg: &CostModelConfig) -> Self {
        PairThresholdState {
            published: cfg
                .static_default_tokens
                .clamp(cfg.min_threshold_tokens, cfg.max_threshold_tokens),
            state: ThresholdState::StaticDefault,
            published_coefficients: None,
            pending: None,
            history: VecDeque::new(),
            last_estimate: None,
            band_rel: cfg.band_rel,
            published_se_rel: 1.0,
            published_epoch: (0, 0),
            regime_changed: false,
        }
    }

    fn record(&mut self, cfg: &CostModelConfig, change: ThresholdChange) -> ThresholdChange {
        self.published = change.to_tokens;
        self.history.push_back(change.clone());
        while self.history.len() > cfg.history_len {
            self.history.pop_front();
        }
        change
    }

    /// Invalidates the path: publishes `max_threshold_tokens` at once.
    pub fn invalidate(
        &mut self,
        now: Instant,
        cfg: &CostModelConfig,
        detail: &str,
    ) -> Option<ThresholdChange> {
        let from = self.published;
        self.state = ThresholdState::Invalidated;
        self.pending = None;
        self.last_estimate = None;
        self.published_coefficients = None;
        self.published_se_rel = 1.0;
        (from != cfg.max_threshold_tokens).then(|| {
            self.record(
                cfg,
                ThresholdChange {
                    at: now,
                    from_tokens: from,
                    to_tokens: cfg.max_threshold_tokens,
                    break_even_tokens: None,
                    confidence: 0.0,
                    reason: ChangeReason::PathInvalidated {
                        detail: detail.to_string(),
                    },
                },
            )
        })
    }

    /// Advances the hysteresis with the estimate at `now`; returns the change
    /// if the published threshold moved.
    pub fn step(
        &mut self,
        now: Instant,
        cfg: &CostModelConfig,
        est: Option<Estimate>,
    ) -> Option<ThresholdChange> {
        self.last_estimate = est.clone();
        let Some(est) = est else {
            self.pending = None;
            if self.state == ThresholdState::Estimated {
                self.state = ThresholdState::HeldLowConfidence;
            }
            return None;
        };
        let conf = est.coefficients.confidence;
        self.band_rel = (cfg.band_rel.max(cfg.band_sigmas * est.se_rel) / conf.max(1e-6))
            .clamp(cfg.band_rel, cfg.max_band_rel);
        if conf < cfg.min_confidence {
            self.pending = None;
            if self.state == ThresholdState::Estimated {
                self.state = ThresholdState::HeldLowConfidence;
            }
            return None;
        }
        let raw = est.raw_tokens.is_finite().then_some(est.raw_tokens);
        match self.state {
            ThresholdState::StaticDefault | ThresholdState::Invalidated => {
                self.state = ThresholdState::Estimated;
                self.pending = None;
                self.published_coefficients = Some(est.coefficients.clone());
                self.published_se_rel = est.se_rel;
                let from = self.published;
                return (from != est.tokens).then(|| {
                    self.record(
                        cfg,
                        ThresholdChange {
                            at: now,
                            from_tokens: from,
                            to_tokens: est.tokens,
                            break_even_tokens: raw,
                            confidence: conf,
                            reason: ChangeReason::FirstEstimate,
                        },
                    )
                });
            }
            ThresholdState::HeldLowConfidence | ThresholdState::Estimated => {
                self.state = ThresholdState::Estimated;
            }
        }
        // A regime change detected in one of the pair's models makes the
        // published value's precision moot: let the new regime refine it.
        if est.epoch != self.published_epoch {
            self.published_epoch = est.epoch;
            self.published_se_rel = 1.0;
            self.regime_changed = true;
        }
        let p = self.published as f64;
        let e = est.tokens as f64;
        let far = est.tokens.abs_diff(self.published) >= cfg.min_step_tokens;
        let upward = e > p * (1.0 + self.band_rel);
        let downward = e < p * (1.0 - self.band_rel);
        let outside = far && (upward || downward);
        let refine = far
            && est.se_rel * cfg.refine_se_factor <= self.published_se_rel
            && (e - p).abs() > p * cfg.refine_min_rel.max(2.0 * est.se_rel);
        if !outside {
            self.pending = None;
        }
        if !(outside || refine) {
            return None;
        }
        let outside_for = if outside {
            let since = match &self.pending {
                Some(pm) if pm.upward == upward => pm.since,
                _ => now,
            };
            self.pending = Some(PendingMove {
                since,
                upward,
                estimate_tokens: est.tokens,
            });
            now.saturating_duration_since(since)
        } else {
            Duration::ZERO
        };
        if !refine && outside_for < Duration::from_millis(cfg.dwell_ms) {
            return None;
        }
        let (cause, detail) = match &self.published_coefficients {
            Some(old) => attribute(old, &est.coefficients),
            None => (
                CauseKind::TransferPerTokenCost,
                "no earlier model".to_string(),
            ),
        };
        let reason = if refine && self.regime_changed {
            ChangeReason::RegimeChange { cause, detail }
        } else if outside {
            ChangeReason::OutsideBand {
                band_rel: self.band_rel,
                outside_for_ms: outside_for.as_secs_f64() * 1e3,
                cause,
                detail,
            }
        } else {
            ChangeReason::Refined {
                from_se_rel: self.published_se_rel,
                to_se_rel: est.se_rel,
            }
        };
        self.pending = None;
        self.regime_changed = false;
        self.published_coefficients = Some(est.coefficients.clone());
        self.published_se_rel = est.se_rel;
        let from = self.published;
        Some(self.record(
            cfg,
            ThresholdChange {
                at: now,
                from_tokens: from,
                to_tokens: est.tokens,
                break_even_tokens: raw,
                confidence: conf,
                reason,
            },
        ))
    }
}

/// Builds an [`Estimate`] from router-form coefficients, clamped to the config bounds.
pub(crate) fn estimate(
    c: CostModelCoefficients,
    se_tokens: f64,
    epoch: (u64, u64),
    cfg: &CostModelConfig,
) -> Estimate {
    let raw = break_even_tokens(&c);
    let se_rel = if raw.is_finite() && raw > 0.0 {
        (se_tokens / raw).min(1.0)
    } else {
        0.0
    };
    Estimate {
        se_rel,
        epoch,
        tokens: clamp_threshold(raw, cfg.min_threshold_tokens, cfg.max_threshold_tokens),
        raw_tokens: raw,
        coefficients: c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn est(tokens: u64, conf: f64, se_rel: f64, epoch: (u64, u64)) -> Option<Estimate> {
        Some(Estimate {
            coefficients: CostModelCoefficients {
                xfer_fixed_ms: 10.0,
                xfer_ms_per_token: 0.0,
                prefill_ms_per_token: 10.0 / tokens as f64,
                prefill_ms_per_token_ctx: 0.0,
                confidence: conf,
                abandons_slow_reads: false,
                notices_abandoned_pulls: false,
                notices_read_pulls: false,
            },
            raw_tokens: tokens as f64,
            se_rel,
            epoch,
            tokens,
        })
    }

    fn t(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    #[test]
    fn static_default_then_first_estimate_at_once() {
        let cfg = CostModelConfig::default();
        let mut s = PairThresholdState::new(&cfg);
        assert_eq!(s.published, 64);
        assert!(s.step(t(0), &cfg, None).is_none());
        // Below min_confidence: stays at the static default.
        assert!(s.step(t(1), &cfg, est(5000, 0.2, 0.1, (0, 0))).is_none());
        assert_eq!((s.published, s.state), (64, ThresholdState::StaticDefault));
        let c = s
            .step(t(2), &cfg, est(5000, 0.5, 0.1, (0, 0)))
            .expect("published at once");
        assert_eq!(
            (c.from_tokens, c.to_tokens, c.reason),
            (64, 5000, ChangeReason::FirstEstimate)
        );
    }

    #[test]
    fn moves_only_after_dwell_outside_band() {
        let cfg = CostModelConfig::default(); // band 8 %, 3 se, dwell 2 s
        let mut s = PairThresholdState::new(&cfg);
        s.step(t(0), &cfg, est(1000, 1.0, 0.01, (0, 0)));
        // Inside the band: nothing.
        assert!(s.step(t(100), &cfg, est(1070, 1.0, 0.01, (0, 0))).is_none());
        assert!(s.pending.is_none());
        // Outside, but not for long enough; then back inside resets the dwell.
        assert!(s.step(t(200), &cfg, est(1200, 1.0, 0.01, (0, 0))).is_none());
        assert!(
            s.step(t(2100), &cfg, est(1200, 1.0, 0.01, (0, 0)))
                .is_none()
        );
        assert!(
            s.step(t(2150), &cfg, est(1050, 1.0, 0.01, (0, 0)))
                .is_none()
        );
        assert!(
            s.step(t(2200), &cfg, est(1200, 1.0, 0.01, (0, 0)))
                .is_none()
        );
        assert!(
            s.step(t(4199), &cfg, est(1200, 1.0, 0.01, (0, 0)))
                .is_none()
        );
        let c = s
            .step(t(4200), &cfg, est(1210, 1.0, 0.01, (0, 0)))
            .expect("moved after 2 s");
        assert_eq!(c.to_tokens, 1210);
        assert!(matches!(c.reason, ChangeReason::OutsideBand { .. }));
        // Switching sides restarts the dwell.
        assert!(
            s.step(t(5000), &cfg, est(1500, 1.0, 0.01, (0, 0)))
                .is_none()
        );
        assert!(s.step(t(6000), &cfg, est(900, 1.0, 0.01, (0, 0))).is_none());
        assert!(s.step(t(7500), &cfg, est(900, 1.0, 0.01, (0, 0))).is_none());
        assert!(s.step(t(8000), &cfg, est(900, 1.0, 0.01, (0, 0))).is_some());
    }

    #[test]
    fn band_widens_with_standard_error_and_low_confidence() {
        let cfg = CostModelConfig::default();
        let mut s = PairThresholdState::new(&cfg);
        s.step(t(0), &cfg, est(1000, 1.0, 0.10, (0, 0)));
        // se 10 % → band 30 %: a 25 % move is noise.
        for i in 1..20 {
            assert!(
                s.step(t(i * 500), &cfg, est(1250, 1.0, 0.10, (0, 0)))
                    .is_none()
            );
        }
        assert!((s.band_rel - 0.30).abs() < 1e-9);
        // Low confidence (0.4, se 1 %): band 8 % / 0.4 = 20 %.
        s.step(t(20_000), &cfg, est(1000, 0.4, 0.01, (0, 0)));
        assert!((s.band_rel - 0.20).abs() < 1e-9);
    }

    #[test]
    fn low_confidence_holds_last_good_value() {
        let cfg = CostModelConfig::default();
        let mut s = PairThresholdState::new(&cfg);
        s.step(t(0), &cfg, est(3000, 0.9, 0.02, (0, 0)));
        for i in 1..10 {
            assert!(
                s.step(t(i * 1000), &cfg, est(9000, 0.1, 0.02, (0, 0)))
                    .is_none()
            );
        }
        assert_eq!(
            (s.published, s.state),
            (3000, ThresholdState::HeldLowConfidence)
        );
        assert!(s.step(t(20_000), &cfg, None).is_none());
        assert_eq!(s.published, 3000);
    }

    #[test]
    fn refinement_and_change_epoch() {
        let cfg = CostModelConfig::default();
        let mut s = PairThresholdState::new(&cfg);
        s.step(t(0), &cfg, est(1000, 0.9, 0.20, (0, 0)));
        // se 20 % → 10 %, estimate 25 % away (> 2 se): refined at once.
        let c = s
            .step(t(100), &cfg, est(1250, 0.9, 0.10, (0, 0)))
            .expect("refined");
        assert!(matches!(c.reason, ChangeReason::Refined { .. }), "{c:?}");
        // Same precision: a 15 % difference (inside 30 % band) does nothing.
        assert!(
            s.step(t(5000), &cfg, est(1100, 0.9, 0.10, (0, 0)))
                .is_none()
        );
        // 28 % away, inside the 30 % band, not more precise: nothing...
        assert!(
            s.step(t(5050), &cfg, est(1600, 0.9, 0.10, (0, 0)))
                .is_none()
        );
        // ...until a change point in the transfer model resets the published
        // precision: then it follows the new regime at once.
        let c = s
            .step(t(5100), &cfg, est(1600, 0.9, 0.10, (1, 0)))
            .expect("follows the new regime");
        assert_eq!(c.to_tokens, 1600);
    }

    #[test]
    fn invalidation_publishes_max_then_recovers_at_once() {
        let cfg = CostModelConfig::default();
        let mut s = PairThresholdState::new(&cfg);
        s.step(t(0), &cfg, est(3000, 0.9, 0.02, (0, 0)));
        let c = s.invalidate(t(1), &cfg, "eth1 down").expect("change");
        assert_eq!(c.to_tokens, cfg.max_threshold_tokens);
        assert!(s.invalidate(t(2), &cfg, "again").is_none());
        let c = s
            .step(t(3), &cfg, est(3100, 0.9, 0.02, (0, 0)))
            .expect("first estimate again");
        assert_eq!(c.reason, ChangeReason::FirstEstimate);
        assert_eq!(s.history.len(), 3);
    }
}
