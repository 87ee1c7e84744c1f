//! In-memory conversation store (the default; docs/protocol.md Router rule 1).
//! Pure: time is passed in as milliseconds on the router's own monotonic clock.
//!
//! One entry per (tenant, `conversation_id`): D's last params of that
//! conversation, the fingerprint of what its blocks cover, and an expiry at
//! insert time + TTL (the TTL is `decoder_kv_blocks_ttl − safety margin`).
//! Entries are single use: [`MemoryStore::take`] removes them. Memory is
//! bounded by a capacity with LRU eviction. Since an entry is never read
//! without being removed, LRU order is insertion order, which (with one TTL
//! for all) is also expiry order, so [`MemoryStore::sweep_expired`] only
//! looks at the oldest end.
use std::num::NonZeroUsize;

use lru::LruCache;

use super::{ConvKey, DropCause, Dropped, Evictions, Lookup, StoredTurn};

/// The bounded, single-use, in-process conversation store.
pub struct MemoryStore {
    map: LruCache<ConvKey, StoredTurn>,
    ttl_ms: u64,
}

impl MemoryStore {
    /// A store holding at most `capacity` entries, each live for `ttl_ms`.
    pub fn new(capacity: NonZeroUsize, ttl_ms: u64) -> Self {
        Self {
            map: LruCache::new(capacity),
            ttl_ms,
        }
    }

    /// TTL of new entries, ms.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Entries stored (live or not yet swept).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Store (overwriting) a turn at `now_ms`; its expiry is set to
    /// `now_ms + ttl_ms`. Returns the evictions this caused, with the turns
    /// dropped (an overwritten turn of the same key, an LRU victim).
    pub fn insert(&mut self, key: ConvKey, mut turn: StoredTurn, now_ms: u64) -> Evictions {
        let mut ev = Evictions::default();
        turn.expires_at_ms = now_ms.saturating_add(self.ttl_ms);
        if let Some((old_key, old)) = self.map.push(key.clone(), turn) {
            let cause = if old_key == key {
                DropCause::Replaced
            } else {
                ev.lru += 1;
                DropCause::Lru
            };
            ev.dropped.push(Dropped {
                key: old_key,
                turn: old,
                cause,
            });
        }
        ev
    }

    /// Remove and return the entry of `key` (single use).
    pub fn take(&mut self, key: &ConvKey, now_ms: u64) -> Lookup {
        match self.map.pop(key) {
            None => Lookup::Missing,
            Some(t) if t.expires_at_ms <= now_ms => Lookup::Expired,
            Some(t) => Lookup::Found(t),
        }
    }

    /// Drop entries whose TTL has passed; returns how many.
    pub fn sweep_expired(&mut self, now_ms: u64) -> u64 {
        self.drain_expired(now_ms).len() as u64
    }

    /// Drop entries whose TTL has passed and return them, oldest first.
    pub fn drain_expired(&mut self, now_ms: u64) -> Vec<Dropped> {
        let mut out = Vec::new();
        while let Some((_, t)) = self.map.peek_lru() {
            if t.expires_at_ms > now_ms {
                break;
            }
            let (key, turn) = self.map.pop_lru().expect("peeked");
            out.push(Dropped {
                key,
                turn,
                cause: DropCause::Expired,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::params::KvParams;
    use serde_json::json;

    fn turn() -> StoredTurn {
        let p = KvParams::parse(&json!({"remote_engine_id": "d0", "remote_request_id": "r", "remote_block_ids": [[1]], "remote_port": 1}))
            .unwrap();
        StoredTurn {
            params: p.compact(),
            decode_engine: 0,
            remote_num_tokens: 10,
            fingerprint: Fingerprint::default(),
            expires_at_ms: 0,
            stored_at_unix_ms: 0,
        }
    }

    #[test]
    fn single_use() {
        let mut s = MemoryStore::new(NonZeroUsize::new(4).unwrap(), 1000);
        let k = ConvKey::new("t", "c");
        s.insert(k.clone(), turn(), 0);
        assert!(matches!(s.take(&k, 1), Lookup::Found(_)));
        assert_eq!(s.take(&k, 2), Lookup::Missing);
    }

    #[test]
    fn expires_by_injected_clock() {
        let mut s = MemoryStore::new(NonZeroUsize::new(4).unwrap(), 1000);
        let k = ConvKey::new("t", "c");
        s.insert(k.clone(), turn(), 5);
        assert_eq!(s.take(&k, 1005), Lookup::Expired);
        s.insert(k.clone(), turn(), 5);
        s.insert(ConvKey::new("t", "d"), turn(), 500);
        assert_eq!(s.sweep_expired(1004), 0);
        assert_eq!(s.sweep_expired(1005), 1);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn tenants_are_isolated() {
        let mut s = MemoryStore::new(NonZeroUsize::new(4).unwrap(), 1000);
        s.insert(ConvKey::new("a", "c"), turn(), 0);
        assert_eq!(s.take(&ConvKey::new("b", "c"), 1), Lookup::Missing);
        assert!(matches!(
            s.take(&ConvKey::new("a", "c"), 1),
            Lookup::Found(_)
        ));
    }

    #[test]
    fn lru_bound_counts_evictions_but_not_overwrites() {
        let mut s = MemoryStore::new(NonZeroUsize::new(2).unwrap(), 1000);
        assert_eq!(s.insert(ConvKey::new("t", "1"), turn(), 0).lru, 0);
        assert_eq!(s.insert(ConvKey::new("t", "2"), turn(), 0).lru, 0);
        assert_eq!(s.insert(ConvKey::new("t", "2"), turn(), 0).lru, 0);
        assert_eq!(s.insert(ConvKey::new("t", "3"), turn(), 0).lru, 1);
        assert_eq!(s.take(&ConvKey::new("t", "1"), 1), Lookup::Missing);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn reports_what_it_drops() {
        let mut s = MemoryStore::new(NonZeroUsize::new(2).unwrap(), 1000);
        assert!(
            s.insert(ConvKey::new("t", "1"), turn(), 0)
                .dropped
                .is_empty()
        );
        let ev = s.insert(ConvKey::new("t", "1"), turn(), 1);
        assert_eq!(ev.dropped.len(), 1);
        assert_eq!(ev.dropped[0].cause, DropCause::Replaced);
        assert_eq!(ev.dropped[0].key, ConvKey::new("t", "1"));
        s.insert(ConvKey::new("t", "2"), turn(), 2);
        let ev = s.insert(ConvKey::new("t", "3"), turn(), 3);
        assert_eq!(
            ev.dropped
                .iter()
                .map(|d| (&d.key, d.cause))
                .collect::<Vec<_>>(),
            vec![(&ConvKey::new("t", "1"), DropCause::Lru)]
        );
        let gone = s.drain_expired(1002);
        assert_eq!(gone.len(), 1);
        assert_eq!(
            (&gone[0].key, gone[0].cause),
            (&ConvKey::new("t", "2"), DropCause::Expired)
        );
    }
}
