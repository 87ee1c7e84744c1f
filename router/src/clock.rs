//! The router's clock: milliseconds on a monotonic clock, injected so tests
//! can move time without sleeping.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The router's clock: milliseconds on a monotonic clock.
pub trait Clock: Send + Sync + 'static {
    /// Now, ms.
    fn now_ms(&self) -> u64;
}

/// Real monotonic clock (ms since creation).
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// A clock tests set by hand.
#[derive(Default)]
pub struct ManualClock(pub AtomicU64);

impl ManualClock {
    /// Move forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<T: Clock> Clock for Arc<T> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

/// Wall-clock time, Unix ms (0 before 1970). Only for values shared across
/// processes (a stored turn's store time); decisions use [`Clock`].
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
