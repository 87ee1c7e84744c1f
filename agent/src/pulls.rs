//! Pull outcomes per (reader, owner) engine pair, and the alarm of a pair
//! whose pulls keep failing (issue: a side channel nobody can reach made
//! every READ decline, silently). Pure: the agent feeds it outcomes and
//! turns its answers into metrics and warnings.
use crate::proto::ErrorKind;

/// Consecutive pulls not read (declined or failed) that raise a pair's alarm.
pub const DEFAULT_ALARM_AFTER: u32 = 5;

/// What a managed READ came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullOutcome {
    /// The blocks were read.
    Read,
    /// Declined before reading (lease unknown, expiring, not covering the
    /// blocks, the owner unknown): the reader recomputes.
    Declined(ErrorKind),
    /// The READ failed (timeout, peer gone, backend).
    Failed(ErrorKind),
    /// The agent abandoned the READ once recomputing its blocks would have
    /// finished (`crate::overdue::abandon_after_ms`): the reader recomputes.
    Abandoned,
}

impl PullOutcome {
    /// The `result` label: `read`, `declined`, `failed`.
    pub fn result_label(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Declined(_) => "declined",
            Self::Failed(_) => "failed",
            Self::Abandoned => "abandoned",
        }
    }

    /// The `reason` label: the error kind, `recompute_faster` for an
    /// abandoned READ, or `""` for a read.
    pub fn reason_label(self) -> &'static str {
        match self {
            Self::Read => "",
            Self::Abandoned => "recompute_faster",
            Self::Declined(k) | Self::Failed(k) => k.as_str(),
        }
    }
}

pub use kvloop_router_api::streak::AlarmChange;
use kvloop_router_api::streak::FailureStreaks;

/// Consecutive unread pulls per (reader, owner) pair.
#[derive(Debug)]
pub struct PullTracker(FailureStreaks<(String, String)>);

impl Default for PullTracker {
    fn default() -> Self {
        Self::new(DEFAULT_ALARM_AFTER)
    }
}

impl PullTracker {
    /// Raises a pair's alarm after `alarm_after` (≥ 1) unread pulls in a row.
    pub fn new(alarm_after: u32) -> Self {
        Self(FailureStreaks::new(alarm_after))
    }

    /// Records one pull of `owner`'s blocks by `reader`.
    pub fn record(&mut self, reader: &str, owner: &str, outcome: PullOutcome) -> AlarmChange {
        let key = (reader.to_string(), owner.to_string());
        match outcome {
            PullOutcome::Read => self.0.success(&key),
            PullOutcome::Declined(_) | PullOutcome::Failed(_) | PullOutcome::Abandoned => {
                self.0.failure(key)
            }
        }
    }

    /// Whether the pair's alarm is raised.
    pub fn alarmed(&self, reader: &str, owner: &str) -> bool {
        self.0.alarmed(&(reader.to_string(), owner.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_whose_pulls_keep_failing_raises_an_alarm_until_one_reads() {
        let mut t = PullTracker::new(3);
        let lease = PullOutcome::Declined(ErrorKind::Lease);
        let timeout = PullOutcome::Failed(ErrorKind::Timeout);
        assert_eq!(t.record("p0", "d0", lease), AlarmChange::Unchanged);
        assert_eq!(t.record("p0", "d0", timeout), AlarmChange::Unchanged);
        // Another pair does not count towards p0,d0.
        assert_eq!(t.record("p1", "d0", lease), AlarmChange::Unchanged);
        assert_eq!(t.record("p0", "d0", lease), AlarmChange::Raised(3));
        assert!(t.alarmed("p0", "d0") && !t.alarmed("p1", "d0"));
        // Raised once, not at every further failure.
        assert_eq!(t.record("p0", "d0", lease), AlarmChange::Unchanged);
        assert_eq!(
            t.record("p0", "d0", PullOutcome::Read),
            AlarmChange::Cleared
        );
        assert!(!t.alarmed("p0", "d0"));
        // A read below the threshold just resets the count.
        assert_eq!(
            t.record("p1", "d0", PullOutcome::Read),
            AlarmChange::Unchanged
        );
        assert_eq!(lease.result_label(), "declined");
        assert_eq!(lease.reason_label(), "lease");
        assert_eq!(PullOutcome::Read.reason_label(), "");
    }
}
