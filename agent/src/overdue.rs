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
//! ([`abandon_after_ms`], `crate::agent::Agent::read`). That rule lives in
//! `kvloop_router_api::abandon`: the agent tells the routers it applies it
//! (`abandons_slow_reads` in the pushed model), and they foresee P's
//! recompute with the same rule.

pub use kvloop_router_api::abandon::{
    OVERDUE_FACTOR, OVERDUE_MIN_EXCESS_MS, abandon_after_ms, first_overdue_ms,
};

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
    let Some(first) = first_overdue_ms(predicted_ms) else {
        return Vec::new();
    };
    (0..OVERDUE_MARKS)
        .map(|i| first * f64::from(1u32 << i))
        .collect()
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
}
