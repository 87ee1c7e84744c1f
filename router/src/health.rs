//! Active health checking of the engines: one check's outcome and the rule
//! that turns consecutive outcomes into healthy or unhealthy. No I/O: the
//! checks are sent by [`crate::state::AppState::check_health`].

/// What one `GET /health` gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// A 2xx answer within `health_timeout_ms`.
    Ok,
    /// The connection was refused or could not be made: nothing listens
    /// (the engine's process is gone, or its node is).
    Refused,
    /// A timeout, an error status or a broken connection: the engine may be
    /// only busy (a CPU engine computing on a loaded machine answers late).
    Failed,
}

/// An engine's health state: whether it is healthy and its consecutive
/// failed checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Health {
    /// Routable.
    pub healthy: bool,
    /// Consecutive [`Check::Failed`] checks since the last good one.
    pub failures: u32,
}

impl Health {
    /// The state after `check`, with `failure_threshold`
    /// (`health_failure_threshold`, ≥ 1) consecutive failures to mark an
    /// engine unhealthy. A refusal marks it at once; one good check marks
    /// it healthy.
    pub fn after(self, check: Check, failure_threshold: u32) -> Health {
        match check {
            Check::Ok => Health {
                healthy: true,
                failures: 0,
            },
            Check::Refused => Health {
                healthy: false,
                failures: self.failures.saturating_add(1),
            },
            Check::Failed => {
                let failures = self.failures.saturating_add(1);
                Health {
                    healthy: self.healthy && failures < failure_threshold.max(1),
                    failures,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UP: Health = Health {
        healthy: true,
        failures: 0,
    };

    #[test]
    fn a_busy_engine_is_marked_after_the_threshold_a_dead_one_at_once() {
        let h = UP.after(Check::Failed, 3).after(Check::Failed, 3);
        assert!(h.healthy, "two late answers of three");
        let h = h.after(Check::Failed, 3);
        assert_eq!(
            h,
            Health {
                healthy: false,
                failures: 3
            }
        );
        assert!(!UP.after(Check::Refused, 3).healthy);
        assert!(!UP.after(Check::Failed, 1).healthy, "threshold 1: at once");
    }

    #[test]
    fn one_good_check_resets_and_marks_healthy() {
        let h = UP.after(Check::Failed, 3).after(Check::Failed, 3);
        let h = h.after(Check::Ok, 3).after(Check::Failed, 3);
        assert!(h.healthy);
        assert_eq!(h.failures, 1);
        let down = UP.after(Check::Refused, 3);
        assert_eq!(down.after(Check::Ok, 3), UP);
        // An unhealthy engine stays unhealthy while checks fail.
        assert!(!down.after(Check::Failed, 3).healthy);
    }
}
