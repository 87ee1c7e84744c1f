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

/// Whether an overdue READ should be abandoned now, before
/// [`abandon_after_ms`], from how far it has come: `done_fraction` of its
/// bytes completed after `elapsed_ms`. At the rate so far, the rest takes
/// `elapsed × (1 − f) / f`; when that is more than recomputing every block
/// from now (`recompute_ms`), waiting on can only lose. Over a path that
/// just dropped 100× (a 27 MB READ predicted at 20 ms, over a link lowered
/// to 100 Mbit/s), the READ has moved about 5 % of its bytes when it
/// becomes overdue (120 ms): the rest would take 2.1 s, so a recompute of
/// 900 ms starts at 120 ms instead of at 900 ms under the ski-rental rule
/// alone.
///
/// Never before the READ is overdue ([`first_overdue_ms`]), and never
/// without progress to judge by (`done_fraction` 0: a READ whose first
/// operations have not completed yet, or a backend that reports a READ
/// only whole, such as NIXL): those keep the ski-rental deadline. The
/// linear extrapolation errs both ways: where a READ slows down as it goes
/// (TCP behind a token bucket sends its burst first) it underestimates the
/// rest and cuts late; where the READ first waited behind another on the
/// same path, or only whole operations count (up to one operation behind
/// the bytes that arrived), it overestimates the rest and may cut a READ
/// that would have finished before recompute. `false` without both
/// predictions.
pub fn abandon_on_progress(
    predicted_ms: Option<f64>,
    recompute_ms: Option<f64>,
    elapsed_ms: f64,
    done_fraction: f64,
) -> bool {
    let (Some(first), Some(r)) = (
        first_overdue_ms(predicted_ms),
        recompute_ms.filter(|r| r.is_finite() && *r > 0.0),
    ) else {
        return false;
    };
    if elapsed_ms < first || !(done_fraction > 0.0 && done_fraction < 1.0) {
        return false;
    }
    elapsed_ms * (1.0 - done_fraction) / done_fraction > r
}

/// When a router foresees P's agent giving up a pulled READ that turns
/// out slow, ms after the READ began: at its first overdue mark
/// ([`first_overdue_ms`]), the earliest [`abandon_on_progress`] cuts it,
/// and where a READ over a path that just slowed is cut when its
/// operations complete in steps (libfabric). From then on the router
/// counts P busy recomputing the whole prompt. Where the agent waits
/// longer (no progress to judge by: NIXL, or agents before the progress
/// rule), P looks busy a little early, which only steers turns away from
/// it (also where the agent does not watch a READ at all: its deadline
/// at or past the engine's own READ timeout); a READ merely late ends, P
/// answers, and the count goes. `None` as [`abandon_after_ms`] (no cut
/// without both predictions).
pub fn foreseen_abandon_ms(predicted_ms: Option<f64>, recompute_ms: Option<f64>) -> Option<f64> {
    abandon_after_ms(predicted_ms, recompute_ms)?;
    first_overdue_ms(predicted_ms)
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

    #[test]
    fn an_overdue_read_is_abandoned_early_when_its_rest_outlasts_recompute() {
        // 20 ms predicted, overdue at 120 ms; 5 % done at 120 ms: the rest
        // (2,280 ms) outlasts a 900 ms recompute.
        assert!(abandon_on_progress(Some(20.0), Some(900.0), 120.0, 0.05));
        // Half done at 130 ms: the rest (130 ms) is cheaper than recompute.
        assert!(!abandon_on_progress(Some(20.0), Some(900.0), 130.0, 0.5));
        // Not overdue yet, however slow it looks.
        assert!(!abandon_on_progress(Some(20.0), Some(900.0), 100.0, 0.01));
        // Nothing moved yet (or a backend that reports only whole READs):
        // the ski-rental deadline decides.
        assert!(!abandon_on_progress(Some(20.0), Some(900.0), 500.0, 0.0));
        // Done, or no prediction.
        assert!(!abandon_on_progress(Some(20.0), Some(900.0), 500.0, 1.0));
        assert!(!abandon_on_progress(None, Some(900.0), 500.0, 0.1));
        assert!(!abandon_on_progress(Some(20.0), None, 500.0, 0.1));
    }

    #[test]
    fn routers_foresee_the_cut_at_the_first_overdue_mark() {
        assert_eq!(foreseen_abandon_ms(Some(20.0), Some(900.0)), Some(120.0));
        assert_eq!(foreseen_abandon_ms(Some(100.0), Some(50.0)), Some(400.0));
        assert_eq!(foreseen_abandon_ms(None, Some(900.0)), None);
        assert_eq!(foreseen_abandon_ms(Some(20.0), None), None);
    }
}
