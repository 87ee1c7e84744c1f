//! When the agent pushes its thresholds to the routers at once instead of
//! at the next push period. Pure: no I/O, no clock.
//!
//! The push task pushes every `push_period_ms` (1 s). A change that moves
//! routing decisions should not wait for it: the router's predicted-TTFT
//! selection costs each (P, D) option with the pushed cost model, so a
//! regime change the cost model found (a link slowed 10×, a P twice as
//! busy) reaches the routers after the next refit (`update_interval_ms`,
//! 250 ms) instead of up to a period later. What counts as such a change
//! is [`urgent_push`]; jitter of a steady fit does not (see its tests).
use std::collections::HashMap;

use kvloop_router_api::{CostModelCoefficients, PairThreshold};

/// Reusable tokens at which the predicted READ and recompute times are
/// compared (a typical multi-turn reuse: a few turns of a coding agent).
pub const URGENT_REF_TOKENS: f64 = 4096.0;

/// Factor by which the predicted READ or recompute time of
/// [`URGENT_REF_TOKENS`] must move to push at once. Measured with the
/// simulator of `tests/urgent_push.rs` (one pushed update per second,
/// refits every 250 ms): on a steady path under ±20–80 % noise it fired
/// 0–1 times in 120 s (against 120 periodic pushes); after a 10× slower
/// or 4× faster step, at the first refit after the change detector found
/// it (1.25–2.75 s).
pub const URGENT_FACTOR: f64 = 1.5;

/// Why an update is pushed at once.
#[derive(Debug, Clone, PartialEq)]
pub enum UrgentReason {
    /// A pair appeared in, or left, the agent's thresholds.
    PairSet,
    /// A pair's published threshold changed.
    Threshold {
        /// Prefill engine id.
        prefill: String,
        /// Decode engine id.
        decode: String,
    },
    /// A pair's cost model appeared, went away (low confidence), or its
    /// predicted READ or recompute time of [`URGENT_REF_TOKENS`] moved by at
    /// least [`URGENT_FACTOR`].
    Model {
        /// Prefill engine id.
        prefill: String,
        /// Decode engine id.
        decode: String,
    },
}

impl UrgentReason {
    /// Metric label value.
    pub fn label(&self) -> &'static str {
        match self {
            UrgentReason::PairSet => "pair_set",
            UrgentReason::Threshold { .. } => "threshold",
            UrgentReason::Model { .. } => "model",
        }
    }
}

/// Whether `now` (the thresholds after a refit) differs from `pushed` (the
/// last update pushed) enough to push at once, and why. `None`: wait for
/// the period.
pub fn urgent_push(pushed: &[PairThreshold], now: &[PairThreshold]) -> Option<UrgentReason> {
    fn key(t: &PairThreshold) -> (&str, &str) {
        (&t.prefill_engine_id, &t.decode_engine_id)
    }
    let before: HashMap<_, _> = pushed.iter().map(|t| (key(t), t)).collect();
    if before.len() != now.len() {
        return Some(UrgentReason::PairSet);
    }
    for t in now {
        let Some(b) = before.get(&key(t)) else {
            return Some(UrgentReason::PairSet);
        };
        let names = || (t.prefill_engine_id.clone(), t.decode_engine_id.clone());
        if b.threshold_tokens != t.threshold_tokens {
            let (prefill, decode) = names();
            return Some(UrgentReason::Threshold { prefill, decode });
        }
        if model_moved(b.model.as_ref(), t.model.as_ref()) {
            let (prefill, decode) = names();
            return Some(UrgentReason::Model { prefill, decode });
        }
    }
    None
}

fn model_moved(a: Option<&CostModelCoefficients>, b: Option<&CostModelCoefficients>) -> bool {
    match (a, b) {
        (None, None) => false,
        (Some(_), None) | (None, Some(_)) => true,
        (Some(a), Some(b)) => {
            let r = URGENT_REF_TOKENS;
            moved(a.xfer_ms(r), b.xfer_ms(r))
                || moved(a.recompute_prefix_ms(r), b.recompute_prefix_ms(r))
        }
    }
}

/// `a` and `b` differ by at least [`URGENT_FACTOR`] (times floored at
/// 1 µs; a non-finite time counts as moved when the other is finite).
fn moved(a: f64, b: f64) -> bool {
    if !a.is_finite() || !b.is_finite() {
        return a.is_finite() != b.is_finite();
    }
    let (a, b) = (a.max(1e-3), b.max(1e-3));
    a.max(b) / a.min(b) >= URGENT_FACTOR
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(xfer_ms_per_token: f64, prefill_ms_per_token: f64) -> CostModelCoefficients {
        CostModelCoefficients {
            xfer_fixed_ms: 2.0,
            xfer_ms_per_token,
            prefill_ms_per_token,
            prefill_ms_per_token_ctx: 1e-6,
            confidence: 0.9,
            abandons_slow_reads: false,
            notices_abandoned_pulls: false,
            notices_read_pulls: false,
        }
    }

    fn pair(
        p: &str,
        d: &str,
        threshold_tokens: u64,
        m: Option<CostModelCoefficients>,
    ) -> PairThreshold {
        PairThreshold {
            prefill_engine_id: p.into(),
            decode_engine_id: d.into(),
            threshold_tokens,
            valid_for_ms: 2500,
            model: m,
        }
    }

    #[test]
    fn steady_fits_wait_for_the_period() {
        let a = [pair("p0", "d0", 30, Some(model(0.001, 0.05)))];
        // A few percent of jitter in every coefficient.
        let b = [pair("p0", "d0", 30, Some(model(0.00108, 0.048)))];
        assert_eq!(urgent_push(&a, &b), None);
        assert_eq!(urgent_push(&a, &a), None);
        assert_eq!(urgent_push(&[], &[]), None);
    }

    #[test]
    fn a_regime_change_is_pushed_at_once() {
        let a = [
            pair("p0", "d0", 30, Some(model(0.001, 0.05))),
            pair("p0", "d1", 30, Some(model(0.001, 0.05))),
        ];
        // d1's path 10× slower: READ of 4096 tokens 6.1 → 43 ms.
        let slow = [
            pair("p0", "d0", 30, Some(model(0.001, 0.05))),
            pair("p0", "d1", 30, Some(model(0.01, 0.05))),
        ];
        assert_eq!(
            urgent_push(&a, &slow),
            Some(UrgentReason::Model {
                prefill: "p0".into(),
                decode: "d1".into()
            })
        );
        // Back again is as urgent.
        assert!(urgent_push(&slow, &a).is_some());
        // P twice as slow to recompute.
        let busy = [
            pair("p0", "d0", 30, Some(model(0.001, 0.1))),
            pair("p0", "d1", 30, Some(model(0.001, 0.1))),
        ];
        assert_eq!(urgent_push(&a, &busy).unwrap().label(), "model");
    }

    #[test]
    fn thresholds_pairs_and_models_coming_and_going() {
        let a = [pair("p0", "d0", 30, Some(model(0.001, 0.05)))];
        let t = [pair("p0", "d0", 31, Some(model(0.001, 0.05)))];
        assert_eq!(urgent_push(&a, &t).unwrap().label(), "threshold");
        let none = [pair("p0", "d0", 30, None)];
        assert_eq!(urgent_push(&a, &none).unwrap().label(), "model");
        assert_eq!(urgent_push(&none, &a).unwrap().label(), "model");
        assert_eq!(urgent_push(&[], &a), Some(UrgentReason::PairSet));
        assert_eq!(urgent_push(&a, &[]), Some(UrgentReason::PairSet));
        let other = [pair("p1", "d0", 30, Some(model(0.001, 0.05)))];
        assert_eq!(urgent_push(&a, &other), Some(UrgentReason::PairSet));
        let inf = [pair("p0", "d0", 30, Some(model(f64::INFINITY, 0.05)))];
        assert!(urgent_push(&a, &inf).is_some());
        assert!(urgent_push(&inf, &inf).is_none());
    }
}
