//! Retained blocks of the engines an agent hosts: a TTL per retained request
//! and a lease a reader can renew. Pure code, time injected (`now_ms` on any
//! monotonic clock of the caller; only differences are used).
//!
//! Rules (docs/protocol.md, "Engine-side rules"):
//! * an owner retains a request's blocks for a TTL (vLLM's
//!   `decoder_kv_blocks_ttl`, 480 s on D; a 30 s lease on P);
//! * a reader renews the lease while it waits (heartbeats), never beyond
//!   [`LeaseConfig::max_lease_ms`] from the renewal;
//! * a READ is declined when the blocks expire within
//!   [`LeaseConfig::safety_margin_ms`] (the request is recomputed, never
//!   served from freed blocks);
//! * blocks are released when all expected owner notifications
//!   (`"<req>:<count>"`) have arrived, when the owner releases them, or when
//!   the lease lapses ([`LeaseTable::expire`]).
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Lease policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeaseConfig {
    /// TTL used when a retain request gives none, ms. Default 480000
    /// (vLLM's `decoder_kv_blocks_ttl` default, 480 s).
    pub default_ttl_ms: u64,
    /// A renewal extends the lease to at most this long from the renewal,
    /// ms. Default 30000 (vLLM's P-side lease, 30 s).
    pub max_lease_ms: u64,
    /// A READ is declined when the blocks expire within this margin, ms.
    /// Default 5000 (docs/protocol.md: 5 s).
    pub safety_margin_ms: u64,
    /// Longest TTL an owner may ask for, ms. Default 3600000 (1 h).
    pub max_ttl_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            default_ttl_ms: 480_000,
            max_lease_ms: 30_000,
            safety_margin_ms: 5_000,
            max_ttl_ms: 3_600_000,
        }
    }
}

/// Why a lease operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LeaseError {
    /// No retained blocks under that (engine, request).
    #[error("no retained blocks for request `{request_id}` of engine `{engine_id}`")]
    Unknown {
        /// Owner engine id.
        engine_id: String,
        /// Owner request id.
        request_id: String,
    },
    /// The blocks expire too soon to be read safely (or already expired).
    #[error(
        "blocks of request `{request_id}` of engine `{engine_id}` expire in {expires_in_ms} ms, \
         within the safety margin of {safety_margin_ms} ms: READ declined, recompute"
    )]
    ExpiringSoon {
        /// Owner engine id.
        engine_id: String,
        /// Owner request id.
        request_id: String,
        /// Time left, ms.
        expires_in_ms: u64,
        /// The margin in force, ms.
        safety_margin_ms: u64,
    },
    /// The owner asked to release blocks a reader renewed for a READ that
    /// has not notified yet: the owner must keep them (evict another).
    #[error(
        "blocks of request `{request_id}` of engine `{engine_id}` are being read \
         (a reader renewed them for {reading_for_ms} ms more): not released"
    )]
    InUse {
        /// Owner engine id.
        engine_id: String,
        /// Owner request id.
        request_id: String,
        /// How long the reader's renewal still holds them, ms.
        reading_for_ms: u64,
    },
    /// The router released the blocks (the hold stays only while a READ
    /// that started before the release is in flight): no new READ.
    #[error(
        "blocks of request `{request_id}` of engine `{engine_id}` were released by the router: \
         READ declined, recompute"
    )]
    Released {
        /// Owner engine id.
        engine_id: String,
        /// Owner request id.
        request_id: String,
    },
    /// Bad retain input; names the field.
    #[error("retain: `{field}`: expected {expected}")]
    Invalid {
        /// The bad field.
        field: &'static str,
        /// What was expected.
        expected: String,
    },
}

pub use kvloop_agent_api::lease::{LeaseInfo, ReleaseReason, Released};

#[derive(Clone, Debug)]
struct Entry {
    block_ids: Vec<u64>,
    expires_at_ms: u64,
    received: u32,
    /// A reader renewed the lease to READ until then (0: never renewed):
    /// the owner may not release the blocks before.
    reading_until_ms: u64,
    /// The router released the hold while a READ was in flight: no new
    /// READ or renewal; the entry lapses at `reading_until_ms` (or when
    /// the READ notifies).
    released: bool,
}

/// What a router's retention decision ([`LeaseTable::set_retention`]) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RetentionOutcome {
    /// Released now: tell the owner engine.
    Released(Released),
    /// A READ that started before is in flight: no new READ starts, and the
    /// blocks go when it notifies or its renewal lapses.
    Deferred {
        /// How long the reader's renewal still holds them, ms.
        reading_for_ms: u64,
    },
    /// Kept, now expiring in `expires_in_ms`.
    Kept {
        /// Time left, ms.
        expires_in_ms: u64,
    },
}

/// The lease table of one agent (all hosted engines).
#[derive(Debug, Default)]
pub struct LeaseTable {
    cfg: LeaseConfig,
    entries: BTreeMap<(String, String), Entry>,
}

impl LeaseTable {
    /// An empty table with policy `cfg`.
    pub fn new(cfg: LeaseConfig) -> Self {
        Self {
            cfg,
            entries: BTreeMap::new(),
        }
    }

    /// The policy.
    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    /// Retains `block_ids` of `request_id` for `ttl_ms` (default TTL when
    /// `None`). Retaining the same request again replaces its blocks and TTL.
    ///
    /// # Errors
    /// [`LeaseError::Invalid`] for empty ids, no blocks, or a TTL of 0 or
    /// above `max_ttl_ms`.
    pub fn retain(
        &mut self,
        engine_id: &str,
        request_id: &str,
        block_ids: Vec<u64>,
        ttl_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<LeaseInfo, LeaseError> {
        if engine_id.is_empty() {
            return Err(invalid("engine_id", "a non-empty engine id"));
        }
        if request_id.is_empty() {
            return Err(invalid("request_id", "a non-empty request id"));
        }
        if block_ids.is_empty() {
            return Err(invalid("block_ids", "at least one block id"));
        }
        let ttl = ttl_ms.unwrap_or(self.cfg.default_ttl_ms);
        if ttl == 0 || ttl > self.cfg.max_ttl_ms {
            return Err(invalid(
                "ttl_ms",
                format!("1..={} ms, got {ttl}", self.cfg.max_ttl_ms),
            ));
        }
        let key = (engine_id.to_string(), request_id.to_string());
        self.entries.insert(
            key,
            Entry {
                block_ids,
                expires_at_ms: now_ms.saturating_add(ttl),
                received: 0,
                reading_until_ms: 0,
                released: false,
            },
        );
        Ok(self
            .info(engine_id, request_id, now_ms)
            .expect("just inserted"))
    }

    /// The lease of a request, if retained and not expired.
    pub fn info(&self, engine_id: &str, request_id: &str, now_ms: u64) -> Option<LeaseInfo> {
        let e = self
            .entries
            .get(&(engine_id.to_string(), request_id.to_string()))?;
        (e.expires_at_ms > now_ms).then(|| LeaseInfo {
            engine_id: engine_id.into(),
            request_id: request_id.into(),
            block_ids: e.block_ids.clone(),
            expires_in_ms: e.expires_at_ms - now_ms,
            notifications: e.received,
        })
    }

    /// A reader renews the lease: the blocks stay at least
    /// `min(lease_ms, max_lease_ms)` from now (a lease never shortens the
    /// owner's TTL).
    ///
    /// # Errors
    /// [`LeaseError::Unknown`] when not retained or already expired.
    pub fn renew(
        &mut self,
        engine_id: &str,
        request_id: &str,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<LeaseInfo, LeaseError> {
        let max = self.cfg.max_lease_ms;
        match self
            .entries
            .get_mut(&(engine_id.to_string(), request_id.to_string()))
        {
            Some(e) if e.released => {
                return Err(LeaseError::Released {
                    engine_id: engine_id.into(),
                    request_id: request_id.into(),
                });
            }
            Some(e) if e.expires_at_ms > now_ms => {
                let want = now_ms.saturating_add(lease_ms.min(max));
                e.expires_at_ms = e.expires_at_ms.max(want);
                e.reading_until_ms = e.reading_until_ms.max(want);
            }
            _ => return Err(unknown(engine_id, request_id)),
        }
        Ok(self.info(engine_id, request_id, now_ms).expect("present"))
    }

    /// Whether a READ of the request's blocks may start now: the blocks are
    /// retained and do not expire within the safety margin.
    ///
    /// # Errors
    /// [`LeaseError::Unknown`], [`LeaseError::ExpiringSoon`].
    pub fn check_read(
        &self,
        engine_id: &str,
        request_id: &str,
        now_ms: u64,
    ) -> Result<LeaseInfo, LeaseError> {
        let e = self
            .entries
            .get(&(engine_id.to_string(), request_id.to_string()))
            .ok_or_else(|| unknown(engine_id, request_id))?;
        if e.released {
            return Err(LeaseError::Released {
                engine_id: engine_id.into(),
                request_id: request_id.into(),
            });
        }
        let left = e.expires_at_ms.saturating_sub(now_ms);
        if left <= self.cfg.safety_margin_ms {
            return Err(LeaseError::ExpiringSoon {
                engine_id: engine_id.into(),
                request_id: request_id.into(),
                expires_in_ms: left,
                safety_margin_ms: self.cfg.safety_margin_ms,
            });
        }
        Ok(self.info(engine_id, request_id, now_ms).expect("present"))
    }

    /// An owner notification `"<request_id>:<count>"` arrived for
    /// `engine_id`: releases the blocks when `count` notifications have
    /// arrived. Unknown requests are ignored (`None`).
    pub fn on_notification(
        &mut self,
        engine_id: &str,
        request_id: &str,
        count: u32,
    ) -> Option<Released> {
        let key = (engine_id.to_string(), request_id.to_string());
        let e = self.entries.get_mut(&key)?;
        e.received += 1;
        if e.received >= count.max(1) {
            let e = self.entries.remove(&key).expect("present");
            return Some(Released {
                engine_id: key.0,
                request_id: key.1,
                block_ids: e.block_ids,
                reason: ReleaseReason::Notified,
            });
        }
        None
    }

    /// The owner releases a request's blocks (an engine evicting them).
    ///
    /// # Errors
    /// [`LeaseError::Unknown`] when not retained; [`LeaseError::InUse`]
    /// while a reader's renewal holds them (until its owner notification
    /// or the renewal's end).
    pub fn release(
        &mut self,
        engine_id: &str,
        request_id: &str,
        now_ms: u64,
    ) -> Result<Released, LeaseError> {
        let key = (engine_id.to_string(), request_id.to_string());
        let e = self
            .entries
            .get(&key)
            .ok_or_else(|| unknown(engine_id, request_id))?;
        if e.reading_until_ms > now_ms {
            return Err(LeaseError::InUse {
                engine_id: key.0,
                request_id: key.1,
                reading_for_ms: e.reading_until_ms - now_ms,
            });
        }
        let e = self.entries.remove(&key).expect("present");
        Ok(Released {
            engine_id: key.0,
            request_id: key.1,
            block_ids: e.block_ids,
            reason: ReleaseReason::Owner,
        })
    }

    /// The router's retention decision for a hold: `keep_ms` 0 releases it
    /// (deferred while a READ that started before is in flight: no new READ
    /// or renewal after this call); `keep_ms` > 0 sets its expiry to
    /// `keep_ms` + the safety margin from now (a READ may start until
    /// `keep_ms`), shortening or extending the owner's TTL, never below a
    /// reader's renewal and never beyond `max_ttl_ms` from now. Idempotent:
    /// the same call again has the same effect (a second release of a
    /// released hold answers [`LeaseError::Unknown`] or `Deferred`).
    ///
    /// # Errors
    /// [`LeaseError::Unknown`] when not retained (released, expired or never
    /// retained); [`LeaseError::Released`] when asked to keep a hold the
    /// router already released.
    pub fn set_retention(
        &mut self,
        engine_id: &str,
        request_id: &str,
        keep_ms: u64,
        now_ms: u64,
    ) -> Result<RetentionOutcome, LeaseError> {
        let key = (engine_id.to_string(), request_id.to_string());
        let margin = self.cfg.safety_margin_ms;
        let max_ttl = self.cfg.max_ttl_ms;
        let e = match self.entries.get_mut(&key) {
            Some(e) if e.expires_at_ms > now_ms => e,
            _ => return Err(unknown(engine_id, request_id)),
        };
        if keep_ms == 0 {
            if e.reading_until_ms > now_ms {
                e.released = true;
                e.expires_at_ms = e.reading_until_ms;
                return Ok(RetentionOutcome::Deferred {
                    reading_for_ms: e.reading_until_ms - now_ms,
                });
            }
            let e = self.entries.remove(&key).expect("present");
            return Ok(RetentionOutcome::Released(Released {
                engine_id: key.0,
                request_id: key.1,
                block_ids: e.block_ids,
                reason: ReleaseReason::Router,
            }));
        }
        if e.released {
            return Err(LeaseError::Released {
                engine_id: key.0,
                request_id: key.1,
            });
        }
        let want = now_ms
            .saturating_add(keep_ms.saturating_add(margin))
            .min(now_ms.saturating_add(max_ttl));
        e.expires_at_ms = want.max(e.reading_until_ms);
        Ok(RetentionOutcome::Kept {
            expires_in_ms: e.expires_at_ms - now_ms,
        })
    }

    /// Drops every entry of an engine (it unregistered).
    pub fn drop_engine(&mut self, engine_id: &str) {
        self.entries.retain(|(e, _), _| e != engine_id);
    }

    /// Removes and returns the leases that lapsed at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Released> {
        let gone: Vec<(String, String)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.expires_at_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        gone.into_iter()
            .map(|k| {
                let e = self.entries.remove(&k).expect("present");
                Released {
                    engine_id: k.0,
                    request_id: k.1,
                    block_ids: e.block_ids,
                    reason: if e.released {
                        ReleaseReason::Router
                    } else {
                        ReleaseReason::Expired
                    },
                }
            })
            .collect()
    }

    /// Earliest expiry, for the driver's timer.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.entries.values().map(|e| e.expires_at_ms).min()
    }

    /// Retained requests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is retained.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn invalid(field: &'static str, expected: impl Into<String>) -> LeaseError {
    LeaseError::Invalid {
        field,
        expected: expected.into(),
    }
}

fn unknown(engine_id: &str, request_id: &str) -> LeaseError {
    LeaseError::Unknown {
        engine_id: engine_id.into(),
        request_id: request_id.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> LeaseTable {
        LeaseTable::new(LeaseConfig {
            default_ttl_ms: 10_000,
            max_lease_ms: 3_000,
            safety_margin_ms: 1_000,
            max_ttl_ms: 60_000,
        })
    }

    #[test]
    fn retain_expires_at_ttl_and_declines_within_margin() {
        let mut t = table();
        let i = t.retain("d0", "r1", vec![1, 2], None, 100).unwrap();
        assert_eq!(i.expires_in_ms, 10_000);
        assert!(t.check_read("d0", "r1", 9_000).is_ok());
        match t.check_read("d0", "r1", 9_200).unwrap_err() {
            LeaseError::ExpiringSoon { expires_in_ms, .. } => assert_eq!(expires_in_ms, 900),
            e => panic!("{e}"),
        }
        assert_eq!(t.next_expiry_ms(), Some(10_100));
        assert!(t.expire(10_099).is_empty());
        let r = t.expire(10_100);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].reason, ReleaseReason::Expired);
        assert_eq!(r[0].block_ids, vec![1, 2]);
        assert!(matches!(
            t.check_read("d0", "r1", 10_100),
            Err(LeaseError::Unknown { .. })
        ));
    }

    #[test]
    fn renew_extends_up_to_max_lease_and_never_shortens() {
        let mut t = table();
        t.retain("p0", "r", vec![7], Some(2_000), 0).unwrap();
        // at 1500 the lease has 500 ms left; renew asks 60 s, capped at 3 s.
        let i = t.renew("p0", "r", 60_000, 1_500).unwrap();
        assert_eq!(i.expires_in_ms, 3_000);
        // a short renewal does not shorten it
        let i = t.renew("p0", "r", 10, 1_600).unwrap();
        assert_eq!(i.expires_in_ms, 2_900);
        // after expiry, renewal fails
        assert!(matches!(
            t.renew("p0", "r", 1_000, 4_500),
            Err(LeaseError::Unknown { .. })
        ));
    }

    #[test]
    fn released_after_count_notifications() {
        let mut t = table();
        t.retain("d0", "r", vec![1], None, 0).unwrap();
        assert!(t.on_notification("d0", "r", 2).is_none());
        let r = t.on_notification("d0", "r", 2).unwrap();
        assert_eq!(r.reason, ReleaseReason::Notified);
        assert!(t.is_empty());
        // unknown request: ignored
        assert!(t.on_notification("d0", "zzz", 1).is_none());
    }

    #[test]
    fn bad_input_names_the_field() {
        let mut t = table();
        let e = t.retain("d0", "r", vec![], None, 0).unwrap_err();
        assert!(e.to_string().contains("block_ids"), "{e}");
        let e = t.retain("d0", "r", vec![1], Some(0), 0).unwrap_err();
        assert!(e.to_string().contains("ttl_ms"), "{e}");
        let e = t.retain("", "r", vec![1], None, 0).unwrap_err();
        assert!(e.to_string().contains("engine_id"), "{e}");
    }

    #[test]
    fn owner_release_waits_for_a_reader_that_renewed() {
        let mut t = LeaseTable::new(LeaseConfig::default());
        t.retain("d0", "r", vec![1, 2], Some(60_000), 0).unwrap();
        t.renew("d0", "r", 10_000, 1_000).unwrap();
        let e = t.release("d0", "r", 2_000).unwrap_err();
        assert!(
            matches!(
                e,
                LeaseError::InUse {
                    reading_for_ms: 9_000,
                    ..
                }
            ),
            "{e:?}"
        );
        // The reader's notification ends it; or, without one, the renewal lapses.
        assert!(t.on_notification("d0", "r", 1).is_some());
        t.retain("d0", "s", vec![3], Some(60_000), 0).unwrap();
        t.renew("d0", "s", 10_000, 1_000).unwrap();
        assert!(t.release("d0", "s", 11_000).is_ok());
        assert!(matches!(
            t.release("d0", "s", 11_000),
            Err(LeaseError::Unknown { .. })
        ));
    }

    #[test]
    fn owner_release_and_drop_engine() {
        let mut t = table();
        t.retain("d0", "a", vec![1], None, 0).unwrap();
        t.retain("d0", "b", vec![2], None, 0).unwrap();
        t.retain("d1", "c", vec![3], None, 0).unwrap();
        assert_eq!(
            t.release("d0", "a", 0).unwrap().reason,
            ReleaseReason::Owner
        );
        t.drop_engine("d0");
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn retention_shortens_renews_and_releases_a_hold() {
        let mut t = table();
        t.retain("d0", "r1", vec![4], None, 0).unwrap();
        // Adaptive first lease: 2 s (+ 1 s margin) instead of the 10 s TTL.
        let k = t.set_retention("d0", "r1", 2_000, 0).unwrap();
        assert_eq!(
            k,
            RetentionOutcome::Kept {
                expires_in_ms: 3_000
            }
        );
        assert!(t.check_read("d0", "r1", 1_999).is_ok());
        assert!(
            t.check_read("d0", "r1", 2_001).is_err(),
            "within the margin"
        );
        // Renewed at the lease end; capped at max_ttl from now.
        t.set_retention("d0", "r1", 4_000, 1_500).unwrap();
        assert!(t.check_read("d0", "r1", 5_000).is_ok());
        let k = t.set_retention("d0", "r1", 999_999, 2_000).unwrap();
        assert_eq!(
            k,
            RetentionOutcome::Kept {
                expires_in_ms: 60_000
            }
        );
        // Released: no READ after, the owner engine is told (reason router).
        match t.set_retention("d0", "r1", 0, 2_500).unwrap() {
            RetentionOutcome::Released(r) => {
                assert_eq!((r.reason, r.block_ids), (ReleaseReason::Router, vec![4]));
            }
            o => panic!("{o:?}"),
        }
        assert!(matches!(
            t.check_read("d0", "r1", 2_501),
            Err(LeaseError::Unknown { .. })
        ));
        // At least once: a repeated release finds nothing, changes nothing.
        assert!(matches!(
            t.set_retention("d0", "r1", 0, 2_600),
            Err(LeaseError::Unknown { .. })
        ));
    }

    #[test]
    fn release_during_a_read_waits_for_it_and_declines_new_reads() {
        let mut t = table();
        t.retain("d0", "r1", vec![1, 2], None, 0).unwrap();
        // A reader checked and renewed (its READ is in flight until 3 s).
        t.check_read("d0", "r1", 0).unwrap();
        t.renew("d0", "r1", 3_000, 0).unwrap();
        let o = t.set_retention("d0", "r1", 0, 1_000).unwrap();
        assert_eq!(
            o,
            RetentionOutcome::Deferred {
                reading_for_ms: 2_000
            }
        );
        // Released for everyone else: a new READ (the next turn racing the
        // release) declines and recomputes; no renewal, no keep.
        for now in [1_001, 2_500] {
            assert!(matches!(
                t.check_read("d0", "r1", now),
                Err(LeaseError::Released { .. })
            ));
        }
        assert!(matches!(
            t.renew("d0", "r1", 3_000, 1_100),
            Err(LeaseError::Released { .. })
        ));
        assert!(matches!(
            t.set_retention("d0", "r1", 5_000, 1_200),
            Err(LeaseError::Released { .. })
        ));
        // The in-flight READ still completes: its notification frees them.
        let r = t.on_notification("d0", "r1", 1).unwrap();
        assert_eq!(r.reason, ReleaseReason::Notified);
        // Without a notification they go at the renewal's end, reason router.
        t.retain("d0", "r2", vec![7], None, 0).unwrap();
        t.renew("d0", "r2", 3_000, 0).unwrap();
        t.set_retention("d0", "r2", 0, 1_000).unwrap();
        assert!(t.expire(2_999).is_empty());
        assert_eq!(t.expire(3_000)[0].reason, ReleaseReason::Router);
    }

    #[test]
    fn a_new_turn_retained_after_a_release_is_readable() {
        let mut t = table();
        t.retain("d0", "r1", vec![1], None, 0).unwrap();
        t.set_retention("d0", "r1", 0, 100).unwrap();
        // The next turn's hold is another request id; the old one stays gone.
        t.retain("d0", "r2", vec![1, 2], None, 200).unwrap();
        assert!(t.check_read("d0", "r2", 300).is_ok());
        assert!(t.check_read("d0", "r1", 300).is_err());
    }
}
