//! Loops the router closes on what engines report. Pure: no I/O, time passed in.
//!
//! - [`PullTracker`]: the outcome of every pull the router asked for (P's
//!   answer says how many prompt tokens it did not compute), per (P, D)
//!   pair. A pair whose pulls keep failing raises an alarm.
//! - [`MissingParams`]: decode answers that should have carried
//!   `kv_transfer_params` and did not (stock vLLM <= 0.32 streams them
//!   without), with a rate-limited warning.
//! - [`WarnLimiter`]: one warning per period for a condition that may hold
//!   for every request (rejected decode params).
/// Consecutive failed pulls of one pair that raise its alarm.
pub const PULL_ALARM_AFTER: u32 = 3;

/// The likely cause named when decode answers lack `kv_transfer_params`.
pub const MISSING_PARAMS_HINT: &str = "vLLM <= 0.32 streaming answers carry no kv_transfer_params (vLLM PR #40186); install the kvloop-vllm plugin";

/// At most one missing-params warning per this many ms.
pub const WARN_EVERY_MS: u64 = 60_000;

/// What became of one pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PullOutcome {
    /// P reports at least half of the attached reusable tokens as not
    /// computed (vLLM counts whole blocks only, so a little less than all).
    Read,
    /// P answered but reports (almost) nothing reused: it declined the READ
    /// or the READ failed, and it recomputed.
    Declined,
    /// The prefill request with D's params failed.
    Failed,
    /// P does not report reuse (no `cached_tokens`, no `kvloop_sim`).
    Unreported,
}

impl PullOutcome {
    /// Metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PullOutcome::Read => "read",
            PullOutcome::Declined => "declined",
            PullOutcome::Failed => "failed",
            PullOutcome::Unreported => "unreported",
        }
    }

    /// Classify P's report for a pull of `attached` tokens.
    pub fn classify(attached: u64, reported: Option<u64>) -> Self {
        match reported {
            None => PullOutcome::Unreported,
            Some(r) if attached > 0 && r.saturating_mul(2) >= attached => PullOutcome::Read,
            Some(_) => PullOutcome::Declined,
        }
    }
}

pub use kvloop_router_api::streak::AlarmChange;
use kvloop_router_api::streak::FailureStreaks;

/// Pull outcomes per (prefill index, decode index).
#[derive(Debug)]
pub struct PullTracker(FailureStreaks<(u16, u16)>);

impl Default for PullTracker {
    fn default() -> Self {
        Self(FailureStreaks::new(PULL_ALARM_AFTER))
    }
}

impl PullTracker {
    /// Record one outcome; returns the pair's alarm change, if any
    /// (never [`AlarmChange::Unchanged`]). `Unreported` changes nothing
    /// (nothing is known).
    pub fn record(&mut self, p: u16, d: u16, outcome: PullOutcome) -> Option<AlarmChange> {
        let change = match outcome {
            PullOutcome::Unreported => return None,
            PullOutcome::Read => self.0.success(&(p, d)),
            PullOutcome::Declined | PullOutcome::Failed => self.0.failure((p, d)),
        };
        (change != AlarmChange::Unchanged).then_some(change)
    }

    /// Pairs in alarm with their consecutive failures, sorted.
    pub fn alarms(&self) -> Vec<((u16, u16), u32)> {
        self.0.alarms()
    }
}

/// At most one warning per [`WARN_EVERY_MS`] for one condition that may
/// hold for every request (an engine that keeps answering the same wrong
/// thing would otherwise log at the request rate); the metrics count every
/// occurrence.
#[derive(Debug, Default)]
pub struct WarnLimiter {
    last_warn_ms: Option<u64>,
    suppressed: u64,
}

impl WarnLimiter {
    /// One occurrence at `now_ms`: `Some(n)` when a warning is due, with
    /// `n` the occurrences not warned about since the last warning; `None`
    /// when it is not (counted).
    pub fn occurred(&mut self, now_ms: u64) -> Option<u64> {
        let due = self
            .last_warn_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= WARN_EVERY_MS);
        if due {
            self.last_warn_ms = Some(now_ms);
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// Decode answers that should have carried `kv_transfer_params`.
#[derive(Debug, Default)]
pub struct MissingParams {
    /// Answers without params since the last one with them.
    pub streak: u64,
    /// Total answers without params.
    pub total: u64,
    warn: WarnLimiter,
}

impl MissingParams {
    /// A storable decode answer without params at `now_ms`; true when a
    /// warning is due (at most one per [`WARN_EVERY_MS`]).
    pub fn missing(&mut self, now_ms: u64) -> bool {
        self.streak += 1;
        self.total += 1;
        self.warn.occurred(now_ms).is_some()
    }

    /// A decode answer that carried params.
    pub fn present(&mut self) {
        self.streak = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_reports() {
        assert_eq!(PullOutcome::classify(109, Some(109)), PullOutcome::Read);
        assert_eq!(PullOutcome::classify(109, Some(96)), PullOutcome::Read);
        assert_eq!(PullOutcome::classify(109, Some(0)), PullOutcome::Declined);
        assert_eq!(PullOutcome::classify(109, None), PullOutcome::Unreported);
    }

    #[test]
    fn alarm_after_consecutive_failures_and_cleared_by_a_read() {
        let mut t = PullTracker::default();
        assert_eq!(t.record(0, 1, PullOutcome::Declined), None);
        assert_eq!(t.record(0, 1, PullOutcome::Failed), None);
        assert_eq!(t.record(0, 2, PullOutcome::Read), None);
        assert_eq!(
            t.record(0, 1, PullOutcome::Declined),
            Some(AlarmChange::Raised(3))
        );
        assert_eq!(t.record(0, 1, PullOutcome::Declined), None);
        assert_eq!(t.alarms(), vec![((0, 1), 4)]);
        assert_eq!(t.record(0, 1, PullOutcome::Unreported), None);
        assert_eq!(
            t.record(0, 1, PullOutcome::Read),
            Some(AlarmChange::Cleared)
        );
        assert!(t.alarms().is_empty());
    }

    #[test]
    fn warn_limiter_warns_once_per_period_and_counts_the_rest() {
        let mut w = WarnLimiter::default();
        assert_eq!(w.occurred(5), Some(0));
        assert_eq!(w.occurred(6), None);
        assert_eq!(w.occurred(WARN_EVERY_MS), None);
        assert_eq!(w.occurred(WARN_EVERY_MS + 5), Some(2));
        assert_eq!(w.occurred(3 * WARN_EVERY_MS), Some(0));
    }

    #[test]
    fn missing_params_warns_rate_limited() {
        let mut m = MissingParams::default();
        assert!(m.missing(0));
        assert!(!m.missing(1_000));
        assert!(m.missing(WARN_EVERY_MS));
        assert_eq!((m.streak, m.total), (3, 3));
        m.present();
        assert_eq!(m.streak, 0);
    }
}
