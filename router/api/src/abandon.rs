//! When an agent abandons a slow READ (pure): the rule an agent promises
//! when it pushes a pair's model with
//! [`crate::CostModelCoefficients::abandons_slow_reads`], so that a router
//! can foresee it. The agent applies it to its managed READs
//! (`agent/src/overdue.rs`, `Agent::read`); the router, to the pulled
//! prefills it sent (`router/src/select/load.rs`): past the deadline P
//! recomputes the whole prompt and is busy for that long.

/// A READ in flight this many times its predicted time is overdue.
pub const OVERDUE_FACTOR: f64 = 4.0;

/// ... and at least this many ms past it: scheduling stalls of a loaded
/// node (tens of ms on a 2-core VM) are not a slower path.
pub const OVERDUE_MIN_EXCESS_MS: f64 = 100.0;

/// When a READ predicted at `predicted_ms` becomes overdue, ms after it
/// began: `max(OVERDUE_FACTOR × predicted, predicted +
/// OVERDUE_MIN_EXCESS_MS)`. `None` without a usable (finite, positive)
/// prediction.
pub fn first_overdue_ms(predicted_ms: Option<f64>) -> Option<f64> {
    let p = predicted_ms.filter(|p| p.is_finite() && *p > 0.0)?;
    Some((OVERDUE_FACTOR * p).max(p + OVERDUE_MIN_EXCESS_MS))
}

/// When a READ is abandoned, ms after it began, so that its engine
/// recomputes the blocks instead: once it has run as long as recomputing
/// them takes (`recompute_ms`, the reading engine's prefill model), but
/// never before it is overdue ([`first_overdue_ms`]: a READ near its
/// path's prediction is never cut, however cheap recompute is). Waiting
/// longer can only lose more: this is the ski-rental rule (rent until the
/// rent paid equals the price, then buy), whose total — the time waited
/// plus the recompute — is at most twice the better of the two choices in
/// hindsight once `recompute_ms` rules, where a READ over a path that just
/// slowed otherwise runs to its end or the engine's timeout (seconds).
/// `None` without both predictions: the READ runs to its end.
pub fn abandon_after_ms(predicted_ms: Option<f64>, recompute_ms: Option<f64>) -> Option<f64> {
    let first = first_overdue_ms(predicted_ms)?;
    let r = recompute_ms.filter(|r| r.is_finite() && *r > 0.0)?;
    Some(r.max(first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overdue_past_the_prediction() {
        // A fast path: 20 ms predicted; 4× would be 80, the excess floor rules.
        assert_eq!(first_overdue_ms(Some(20.0)), Some(120.0));
        // A slower one: 4× rules.
        assert_eq!(first_overdue_ms(Some(100.0)), Some(400.0));
        assert_eq!(first_overdue_ms(None), None);
        assert_eq!(first_overdue_ms(Some(0.0)), None);
        assert_eq!(first_overdue_ms(Some(f64::NAN)), None);
    }

    #[test]
    fn a_read_is_abandoned_once_recompute_would_have_finished() {
        // Recompute (900 ms) rules over the first mark (120 ms).
        assert_eq!(abandon_after_ms(Some(20.0), Some(900.0)), Some(900.0));
        // Recompute cheaper than the first mark: a READ near its prediction
        // is never cut.
        assert_eq!(abandon_after_ms(Some(100.0), Some(50.0)), Some(400.0));
        // Nothing to judge by: the READ runs to its end.
        assert_eq!(abandon_after_ms(None, Some(900.0)), None);
        assert_eq!(abandon_after_ms(Some(20.0), None), None);
        assert_eq!(abandon_after_ms(Some(20.0), Some(f64::INFINITY)), None);
    }
}
