//! Warnings about garbage from local API clients and agent peers
//! (malformed frames, bodies that are not what the route expects),
//! rate-limited so that a misbehaving client cannot flood the log.
use parking_lot::Mutex;

/// The peer process of a connection (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// Its pid, where the kernel reports one.
    pub pid: Option<i32>,
    /// Its uid.
    pub uid: u32,
}

/// Rate limit of warnings: at most `burst` per `period_ms`; the ones
/// dropped are counted and reported with the next one let through. Pure
/// (time is passed in).
#[derive(Clone, Debug)]
pub struct WarnLimiter {
    period_ms: u64,
    burst: u32,
    window_start_ms: u64,
    in_window: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// At most `burst` warnings per `period_ms`.
    pub const fn new(period_ms: u64, burst: u32) -> Self {
        Self {
            period_ms,
            burst,
            window_start_ms: 0,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// Whether to log a warning at `now_ms`: `Some(n)` with the number of
    /// warnings dropped since the last one logged, or `None` (dropped).
    pub fn allow(&mut self, now_ms: u64) -> Option<u64> {
        if now_ms.saturating_sub(self.window_start_ms) >= self.period_ms {
            self.window_start_ms = now_ms;
            self.in_window = 0;
        }
        if self.in_window < self.burst {
            self.in_window += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// Garbage warnings of the local API: 5 per 10 s.
static GARBAGE_WARNINGS: Mutex<WarnLimiter> = Mutex::new(WarnLimiter::new(10_000, 5));

/// Logs garbage from a client at warn, rate-limited ([`GARBAGE_WARNINGS`]).
pub fn garbage_warn(peer: Peer, what: &str) {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let now_ms = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64;
    let allowed = GARBAGE_WARNINGS.lock().allow(now_ms);
    if let Some(suppressed) = allowed {
        tracing::warn!(peer_pid = ?peer.pid, peer_uid = peer.uid, suppressed,
                       "local API: garbage from a client: {what}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn garbage_warnings_are_rate_limited_and_count_what_they_drop() {
        let mut l = super::WarnLimiter::new(1000, 2);
        assert_eq!(l.allow(0), Some(0));
        assert_eq!(l.allow(10), Some(0));
        assert_eq!(l.allow(20), None);
        assert_eq!(l.allow(999), None);
        // A new window: the two dropped ones are reported with the next.
        assert_eq!(l.allow(1000), Some(2));
        assert_eq!(l.allow(1001), Some(0));
        assert_eq!(l.allow(1002), None);
        assert_eq!(l.allow(5000), Some(1));
    }
}
