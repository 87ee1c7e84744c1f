//! READs still in flight long past what their path's model predicts (pure).
//!
//! A READ's time reaches the cost model when the READ ends. Over a path
//! that just slowed down, the first READs take seconds (a 27 MB turn over a
//! link lowered to 100 Mbit/s: 2–3 s in `make demo-cluster`), and the
//! agent's probes queue behind them on the same link, so the change
//! detector heard nothing until they ended while the routers kept sending
//! turns over the path. A READ in flight for `t` ms has taken at least
//! `t` ms: once `t` is far past the prediction that is evidence already (a
//! censored observation: the true time is known to exceed `t`). The agent
//! records it as a sample of `t` ms at each of a few marks
//! ([`marks_ms`]), so the detector can find the change while the READ is
//! still running; the READ's own sample follows when it ends. A lower
//! bound only ever understates how slow the path is. It carries the
//! READ's own source: a probe's lower bound is an active-probe sample, a
//! managed READ's a user-space one.
//!
//! Used for the agent's managed READs and its probe READs
//! (`crate::agent::Agent::watch_read`). A managed READ is also abandoned,
//! so that its engine recomputes, once recomputing would have finished
//! ([`abandon_after_ms`], `crate::agent::Agent::read`).

/// A READ in flight this many times its predicted time is overdue.
pub const OVERDUE_FACTOR: f64 = 4.0;

/// ... and at least this many ms past it: scheduling stalls of a loaded
/// node (tens of ms on this 2-core VM) are not a slower path.
pub const OVERDUE_MIN_EXCESS_MS: f64 = 100.0;

/// Lower-bound samples one READ gives at most, each mark twice the one
/// before. Three add at most 7.5 to the change detector's CUSUM (2.5 a
/// sample), a third of its default `change_detect_threshold` (20): one
/// stalled READ alone never makes a change, several overdue READs and the
/// probes' confirming rounds (`crate::probe_plan::MAX_CONFIRM_ROUNDS`) do.
pub const OVERDUE_MARKS: usize = 3;

/// Times since a READ began, ms, at which it is recorded as taking at
/// least that long, for a prediction of `predicted_ms`: the first at
/// `max(OVERDUE_FACTOR × predicted, predicted + OVERDUE_MIN_EXCESS_MS)`,
/// each next one twice the one before. Empty without a usable prediction.
pub fn marks_ms(predicted_ms: Option<f64>) -> Vec<f64> {
    let Some(p) = predicted_ms.filter(|p| p.is_finite() && *p > 0.0) else {
        return Vec::new();
    };
    let first = (OVERDUE_FACTOR * p).max(p + OVERDUE_MIN_EXCESS_MS);
    (0..OVERDUE_MARKS)
        .map(|i| first * f64::from(1u32 << i))
        .collect()
}

/// When a managed READ is abandoned, ms after it began, so that its engine
/// recomputes the blocks instead: once it has run as long as recomputing
/// them takes (`recompute_ms`, the local engine's prefill model), but never
/// before the first overdue mark of [`marks_ms`] (a READ near its path's
/// prediction is never cut, however cheap recompute is). Waiting longer can
/// only lose more: this is the ski-rental rule (rent until the rent paid
/// equals the price, then buy), whose total — the time waited plus the
/// recompute — is at most twice the better of the two choices in hindsight
/// once `recompute_ms` rules, where a READ over a path that just slowed
/// otherwise runs to its end or the engine's timeout (seconds; 5 s by
/// default). `None` without both predictions: the READ runs to its end.
pub fn abandon_after_ms(predicted_ms: Option<f64>, recompute_ms: Option<f64>) -> Option<f64> {
    let first_mark = *marks_ms(predicted_ms).first()?;
    let r = recompute_ms.filter(|r| r.is_finite() && *r > 0.0)?;
    Some(r.max(first_mark))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_start_past_the_prediction_and_double() {
        // A fast path: 20 ms predicted; 4× would be 80, the excess floor rules.
        assert_eq!(marks_ms(Some(20.0)), vec![120.0, 240.0, 480.0]);
        // A slower one: 4× rules.
        assert_eq!(marks_ms(Some(100.0)), vec![400.0, 800.0, 1600.0]);
        // Nothing to judge by.
        assert!(marks_ms(None).is_empty());
        assert!(marks_ms(Some(0.0)).is_empty());
        assert!(marks_ms(Some(f64::NAN)).is_empty());
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
