//! Failure streaks per key, the alarm that both the router (per (P, D)
//! pair, what P reports of its pulls) and the agent (per (reader, owner)
//! pair, what its managed READs came to) raise when a pair's pulls keep
//! failing. Pure: callers feed outcomes and turn the changes into metrics
//! and log lines.
use std::collections::HashMap;
use std::hash::Hash;

/// What one outcome did to a key's alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlarmChange {
    /// Nothing to report.
    Unchanged,
    /// Raised now, after that many failures in a row (once per streak).
    Raised(u32),
    /// Cleared by a success after the alarm was raised.
    Cleared,
}

/// Consecutive failures per key; a key's alarm is raised at `alarm_after`
/// failures in a row and cleared by its next success.
#[derive(Debug)]
pub struct FailureStreaks<K> {
    alarm_after: u32,
    failures: HashMap<K, u32>,
}

impl<K: Hash + Eq + Clone + Ord> FailureStreaks<K> {
    /// Alarms after `alarm_after` (at least 1) failures in a row.
    pub fn new(alarm_after: u32) -> Self {
        Self {
            alarm_after: alarm_after.max(1),
            failures: HashMap::new(),
        }
    }

    /// A failure of `key`: [`AlarmChange::Raised`] when it completes the
    /// streak, else [`AlarmChange::Unchanged`].
    pub fn failure(&mut self, key: K) -> AlarmChange {
        let n = self.failures.entry(key).or_insert(0);
        *n = n.saturating_add(1);
        if *n == self.alarm_after {
            AlarmChange::Raised(*n)
        } else {
            AlarmChange::Unchanged
        }
    }

    /// A success of `key`: ends its streak; [`AlarmChange::Cleared`] when
    /// its alarm was raised.
    pub fn success(&mut self, key: &K) -> AlarmChange {
        match self.failures.remove(key) {
            Some(n) if n >= self.alarm_after => AlarmChange::Cleared,
            _ => AlarmChange::Unchanged,
        }
    }

    /// Whether `key`'s alarm is raised.
    pub fn alarmed(&self, key: &K) -> bool {
        self.failures
            .get(key)
            .is_some_and(|n| *n >= self.alarm_after)
    }

    /// Keys in alarm with their failures in a row, sorted by key.
    pub fn alarms(&self) -> Vec<(K, u32)> {
        let mut v: Vec<_> = self
            .failures
            .iter()
            .filter(|(_, n)| **n >= self.alarm_after)
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raised_once_per_streak_and_cleared_by_a_success() {
        let mut s = FailureStreaks::new(2);
        assert_eq!(s.failure("a"), AlarmChange::Unchanged);
        assert_eq!(s.failure("b"), AlarmChange::Unchanged);
        assert_eq!(s.failure("a"), AlarmChange::Raised(2));
        assert_eq!(s.failure("a"), AlarmChange::Unchanged);
        assert_eq!(s.alarms(), vec![("a", 3)]);
        assert!(s.alarmed(&"a") && !s.alarmed(&"b"));
        assert_eq!(s.success(&"b"), AlarmChange::Unchanged);
        assert_eq!(s.success(&"a"), AlarmChange::Cleared);
        assert!(s.alarms().is_empty());
        assert_eq!(
            FailureStreaks::<u8>::new(0).failure(1),
            AlarmChange::Raised(1)
        );
    }
}
