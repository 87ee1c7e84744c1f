//! Injected time: the model never reads a clock.

use serde::{Deserialize, Serialize};
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time, in nanoseconds since an arbitrary epoch chosen by the
/// caller (in the agent: a monotonic clock read at the edge; in tests: a
/// simulated clock). Only differences between two `Instant`s of the same
/// caller are meaningful; they are never compared across processes or hosts.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Instant(pub u64);

impl Instant {
    /// The epoch (0 ns).
    pub const ZERO: Instant = Instant(0);

    /// Builds an instant `nanos` nanoseconds after the epoch.
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Builds an instant `millis` milliseconds after the epoch (saturating).
    pub const fn from_millis(millis: u64) -> Self {
        Instant(millis.saturating_mul(1_000_000))
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`; zero when `earlier` is later
    /// (a sample stamped slightly in the future counts as fresh, never as
    /// negative age).
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, rhs: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, rhs: Duration) -> Instant {
        Instant(
            self.0
                .saturating_sub(u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

/// Milliseconds of a duration as `f64`.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_millis(5);
        assert_eq!((t + Duration::from_millis(1)).as_nanos(), 6_000_000);
        assert_eq!(t - Duration::from_secs(1), Instant::ZERO);
        assert_eq!(Instant::ZERO.saturating_duration_since(t), Duration::ZERO);
        assert_eq!(
            Instant(u64::MAX) + Duration::from_secs(1),
            Instant(u64::MAX)
        );
    }
}
