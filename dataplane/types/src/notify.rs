//! Owner notifications, with vLLM NixlConnector's `"<owner request id>:<count>"`
//! semantics: after a READ completes, the reader tells the owner of the blocks
//! which of its requests was read and how many notifications in total the
//! owner should expect for it (the reader's tensor-parallel ratio). The owner
//! releases the blocks once that many have arrived (or its lease lapses).
//!
//! Pure code: no I/O, no clock.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One notification as received by the owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notification {
    /// Engine id of the reader that sent it.
    pub from_engine_id: String,
    /// The owner's request id whose blocks were read.
    pub owner_request_id: String,
    /// Total notifications the owner should expect for this request (≥ 1).
    pub count: u32,
}

/// Formats the wire string `"<owner request id>:<count>"`.
pub fn format_notification(owner_request_id: &str, count: u32) -> String {
    format!("{owner_request_id}:{count}")
}

/// Parses `"<owner request id>:<count>"`. The request id may itself contain
/// `:`; the count is after the last one.
///
/// # Errors
/// A message naming what is wrong (missing `:`, empty id, count not a
/// positive integer).
pub fn parse_notification(s: &str) -> Result<(String, u32), String> {
    let (id, count) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("notification `{s}`: expected `<owner request id>:<count>`"))?;
    if id.is_empty() {
        return Err(format!("notification `{s}`: empty owner request id"));
    }
    let count: u32 =
        count.parse().ok().filter(|&c| c > 0).ok_or_else(|| {
            format!("notification `{s}`: count `{count}` is not a positive integer")
        })?;
    Ok((id.to_string(), count))
}

/// Counts notifications per owner request id and says when a request's
/// blocks may be released.
#[derive(Debug, Default)]
pub struct NotificationTracker {
    seen: HashMap<String, (u32, u32)>, // request id -> (received, expected)
}

impl NotificationTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one notification; returns `true` when all expected
    /// notifications for that request have arrived (the entry is then
    /// forgotten, so a duplicate later starts a new count).
    pub fn record(&mut self, owner_request_id: &str, count: u32) -> bool {
        let e = self
            .seen
            .entry(owner_request_id.to_string())
            .or_insert((0, count));
        e.0 += 1;
        e.1 = e.1.max(count);
        if e.0 >= e.1 {
            self.seen.remove(owner_request_id);
            true
        } else {
            false
        }
    }

    /// Forgets a request (its lease lapsed).
    pub fn forget(&mut self, owner_request_id: &str) {
        self.seen.remove(owner_request_id);
    }

    /// Requests with notifications outstanding.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no request is waiting for notifications.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_style_strings() {
        assert_eq!(
            parse_notification("cmpl-1:2").unwrap(),
            ("cmpl-1".into(), 2)
        );
        assert_eq!(parse_notification("a:b:1").unwrap(), ("a:b".into(), 1));
        assert!(
            parse_notification("nocount")
                .unwrap_err()
                .contains("expected")
        );
        assert!(parse_notification("x:0").unwrap_err().contains("positive"));
        assert!(parse_notification(":1").unwrap_err().contains("empty"));
        assert_eq!(format_notification("r", 4), "r:4");
    }

    #[test]
    fn releases_after_all_expected_notifications() {
        let mut t = NotificationTracker::new();
        assert!(!t.record("r1", 2));
        assert!(t.record("r2", 1));
        assert_eq!(t.len(), 1);
        assert!(t.record("r1", 2));
        assert!(t.is_empty());
    }
}
