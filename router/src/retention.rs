//! Decode-side retention at the router (issue 15): which agent to tell, and
//! the book of D's holds of stored turns. No I/O: the shell
//! ([`crate::retention_task`]) sends what this decides, at the times it
//! asks, on the router's clock (ms).
//!
//! - **Early release**: a stored turn that leaves the store without a pull
//!   (replaced by the next turn, evicted, expired, recomputed, prefix
//!   mismatch, the conversation deleted) is a hold nobody will READ: its
//!   agent is told to release it ([`Job`] with `keep_ms` 0).
//! - **Adaptive**: a stored turn's hold gets a first lease from the
//!   tenant's (or the conversation's) inter-turn gaps, and at its end is
//!   renewed while it pays (`kvloop_retention::RetentionPolicy`); a hold
//!   not renewed is released and its turn leaves the store.
//!
//! Where to send: the agents that push thresholds say where they are
//! (`ThresholdUpdate::agent_url`); a decision for a decode engine goes to
//! the agent that pushed a pair with it, which forwards it to the agent
//! hosting the engine. With no agent known (stock vLLM, observe mode) a
//! decision is only counted (`result="unmanaged"`).
use std::collections::HashMap;

use kvloop_retention::{GapBook, HoldFacts, RetentionConfig, RetentionMode, RetentionPolicy};
use lru::LruCache;

use crate::store::{ConvKey, StoredTurn};

/// Why the router decided about a hold (the `cause` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Replaced by a newer turn of the conversation.
    Replaced,
    /// Evicted by the store's capacity bound.
    Lru,
    /// The router's store TTL passed.
    Expired,
    /// Taken, but the next turn recomputed (below threshold, or the
    /// selection chose to recompute).
    Recomputed,
    /// Taken, but the next turn's prompt does not extend it.
    PrefixMismatch,
    /// `DELETE /v1/conversations/{id}`.
    Ended,
    /// Taken for a pull, but P failed with D's params attached (the router
    /// retried without them, or the request failed).
    PullFailed,
    /// Its lease ended and renewing does not pay (or the cap was reached).
    NotRenewed,
    /// A first lease (keep).
    FirstLease,
    /// A renewal (keep).
    Renewed,
}

impl Cause {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Replaced => "replaced",
            Self::Lru => "lru",
            Self::Expired => "expired",
            Self::Recomputed => "recomputed",
            Self::PrefixMismatch => "prefix_mismatch",
            Self::Ended => "ended",
            Self::PullFailed => "pull_failed",
            Self::NotRenewed => "not_renewed",
            Self::FirstLease => "first_lease",
            Self::Renewed => "renewed",
        }
    }
}

/// One decision to send: keep D's hold of `request_id` for `keep_ms`
/// (0: release it).
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The conversation.
    pub key: ConvKey,
    /// The policy's reason (`no_history`, `tenant_gaps`,
    /// `conversation_gap`, `worth`, `not_worth`, `cap`), or the cause for
    /// an early release.
    pub reason: &'static str,
    /// Expected TTFT saved over a renewal's window, ms (0 otherwise).
    pub value_ms: f64,
    /// Cost of the blocks over that window, ms (0 otherwise).
    pub cost_ms: f64,
    /// The agent to send it to (base URL); `None`: no agent known, counted
    /// only.
    pub agent_url: Option<String>,
    /// D.
    pub decode_engine_id: String,
    /// D's request id of the hold.
    pub request_id: String,
    /// Keep this long, ms; 0 releases.
    pub keep_ms: u64,
    /// Why.
    pub cause: Cause,
}

/// A hold the book follows (adaptive mode).
#[derive(Clone, Debug)]
struct Held {
    decode_engine_id: String,
    request_id: String,
    blocks: u64,
    saved_ms: f64,
    stored_at_ms: u64,
    due_ms: u64,
    conversation_gap_ms: Option<u64>,
}

/// Most holds followed, and most conversations whose last gap is kept.
pub const MAX_FOLLOWED: usize = 65_536;
/// Retention decisions kept for `GET /admin/retention`.
pub const RECENT_DECISIONS: usize = 256;

fn conversation(k: &ConvKey) -> String {
    format!("{}/{}", k.tenant(), k.conversation_id())
}

/// A decision as sent, with what came of it (`GET /admin/retention`,
/// `kvloop explain --router ... --retention`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DecisionRecord {
    /// When it was sent, router clock ms.
    pub at_ms: u64,
    /// `release` or `keep`.
    pub action: &'static str,
    /// Kept for, ms (0: released).
    pub keep_ms: u64,
    /// [`Cause::as_str`].
    pub cause: &'static str,
    /// [`Job::reason`].
    pub reason: &'static str,
    /// `tenant/conversation_id`.
    pub conversation: String,
    /// D.
    pub decode_engine_id: String,
    /// D's request id.
    pub request_id: String,
    /// Expected TTFT saved (renewals), ms.
    pub value_ms: f64,
    /// Cost of the blocks (renewals), ms.
    pub cost_ms: f64,
    /// The agent's answer (`released`, `deferred`, `kept`, `unknown`) or
    /// `unmanaged`, `error`, `dropped`.
    pub result: &'static str,
}

/// The router's retention state.
pub struct Retention {
    policy: RetentionPolicy,
    /// Decode engine id → agent base URL (learned from pushes).
    agents: HashMap<String, String>,
    gaps: GapBook,
    held: HashMap<ConvKey, Held>,
    last_gap_ms: LruCache<ConvKey, u64>,
    recent: std::collections::VecDeque<DecisionRecord>,
    /// Decode engine id → until when (ms) its agent said it does not host
    /// it (stock vLLM behind an agent that only pushes thresholds): not
    /// learned again before.
    unmanaged: HashMap<String, u64>,
}

/// How long a decode engine no agent hosts is treated as unmanaged, ms.
pub const UNMANAGED_FOR_MS: u64 = 60_000;

impl Retention {
    /// State for `cfg` (validated by the router's config).
    pub fn new(cfg: RetentionConfig) -> Self {
        Self {
            policy: RetentionPolicy::new(cfg),
            agents: HashMap::new(),
            gaps: GapBook::default(),
            held: HashMap::new(),
            last_gap_ms: LruCache::new(std::num::NonZeroUsize::new(MAX_FOLLOWED).expect("> 0")),
            recent: std::collections::VecDeque::new(),
            unmanaged: HashMap::new(),
        }
    }

    /// The agent no longer holds `request_id` of `key` (read and released
    /// by its next turn on another replica, expired): stop following it.
    pub fn forget(&mut self, key: &ConvKey, request_id: &str) {
        if self
            .held
            .get(key)
            .is_some_and(|h| h.request_id == request_id)
        {
            self.held.remove(key);
        }
    }

    /// The agent answered that no agent hosts `decode_engine_id` (observe
    /// mode): decisions about it are only counted for
    /// [`UNMANAGED_FOR_MS`].
    pub fn mark_unmanaged(&mut self, decode_engine_id: &str, now_ms: u64) {
        self.agents.remove(decode_engine_id);
        self.unmanaged
            .insert(decode_engine_id.to_string(), now_ms + UNMANAGED_FOR_MS);
    }

    /// Keeps `job`'s outcome `result` at `now_ms` (the last
    /// [`RECENT_DECISIONS`]).
    pub fn record(&mut self, job: &Job, result: &'static str, now_ms: u64) {
        if self.recent.len() >= RECENT_DECISIONS {
            self.recent.pop_front();
        }
        self.recent.push_back(DecisionRecord {
            at_ms: now_ms,
            action: if job.keep_ms == 0 { "release" } else { "keep" },
            keep_ms: job.keep_ms,
            cause: job.cause.as_str(),
            reason: job.reason,
            conversation: conversation(&job.key),
            decode_engine_id: job.decode_engine_id.clone(),
            request_id: job.request_id.clone(),
            value_ms: job.value_ms,
            cost_ms: job.cost_ms,
            result,
        });
    }

    /// What `GET /admin/retention` shows: the mode and bounds, the agents
    /// known per decode engine, each tenant's gaps (samples, p50, p90), the
    /// holds followed, and the last `n` decisions (newest last); the caller
    /// adds D's KV usage.
    pub fn snapshot(&self, n: usize) -> serde_json::Value {
        let tenants: Vec<serde_json::Value> = self
            .gaps
            .iter()
            .map(|(t, h)| {
                serde_json::json!({"tenant": t, "samples": h.samples(),
                    "gap_p50_ms": h.quantile_ms(0.5), "gap_p90_ms": h.quantile_ms(0.9)})
            })
            .collect();
        let skip = self.recent.len().saturating_sub(n);
        serde_json::json!({
            "config": self.policy.config(),
            "agents": self.agents,
            "tenants": tenants,
            "followed": self.held.len(),
            "decisions": self.recent.iter().skip(skip).collect::<Vec<_>>(),
            "decisions_kept": self.recent.len(),
        })
    }

    /// The policy's configuration.
    pub fn config(&self) -> &RetentionConfig {
        self.policy.config()
    }

    /// An agent at `agent_url` pushed pairs with these decode engines at
    /// `now_ms` (one marked unmanaged is not learned before its time).
    pub fn learn<'a>(
        &mut self,
        agent_url: &str,
        decode_engine_ids: impl Iterator<Item = &'a str>,
        now_ms: u64,
    ) {
        self.unmanaged.retain(|_, until| *until > now_ms);
        for d in decode_engine_ids {
            if self.unmanaged.contains_key(d) {
                continue;
            }
            if self.agents.get(d).map(String::as_str) != Some(agent_url) {
                self.agents.insert(d.to_string(), agent_url.to_string());
            }
        }
    }

    /// Whether a turn stored on `decode_engine_id` gets a lease now
    /// (adaptive mode and its agent known): [`Retention::stored`]'s
    /// question, before its caller estimates what the hold saves.
    pub fn leases(&self, decode_engine_id: &str) -> bool {
        self.policy.config().mode == RetentionMode::Adaptive
            && self.agents.contains_key(decode_engine_id)
    }

    /// The agent to tell about `decode_engine_id`'s holds.
    pub fn agent_of(&self, decode_engine_id: &str) -> Option<&str> {
        self.agents.get(decode_engine_id).map(String::as_str)
    }

    /// Holds followed now.
    pub fn followed(&self) -> usize {
        self.held.len()
    }

    /// The release of `turn`'s hold (held by `decode_engine_id`) for
    /// `cause`; `None` in fixed mode or without a request id. Stops
    /// following its conversation.
    pub fn release(
        &mut self,
        key: &ConvKey,
        decode_engine_id: &str,
        turn: &StoredTurn,
        cause: Cause,
    ) -> Option<Job> {
        let request_id = turn.params.remote_request_id();
        // Stop following it (not a newer turn of the same conversation that
        // replaced it).
        if self
            .held
            .get(key)
            .is_some_and(|h| Some(&h.request_id) == request_id.as_ref())
        {
            self.held.remove(key);
        }
        if !self.policy.releases_early() {
            return None;
        }
        Some(Job {
            key: key.clone(),
            reason: cause.as_str(),
            value_ms: 0.0,
            cost_ms: 0.0,
            agent_url: self.agent_of(decode_engine_id).map(str::to_string),
            decode_engine_id: decode_engine_id.to_string(),
            request_id: request_id?,
            keep_ms: 0,
            cause,
        })
    }

    /// The next turn of `key` took its stored turn at `now_ms`: the gap is
    /// observed (tenant and conversation), and the hold is no longer
    /// followed (the take decides about it). A turn this replica did not
    /// store (another replica on the shared store) is measured by wall
    /// clock: `turn_stored_at_unix_ms` (0: unknown) against `now_unix_ms`.
    pub fn taken(
        &mut self,
        key: &ConvKey,
        now_ms: u64,
        turn_stored_at_unix_ms: u64,
        now_unix_ms: u64,
    ) {
        let gap = match self.held.remove(key) {
            Some(h) => Some(now_ms.saturating_sub(h.stored_at_ms)),
            None if turn_stored_at_unix_ms > 0 => {
                Some(now_unix_ms.saturating_sub(turn_stored_at_unix_ms))
            }
            None => None,
        };
        if let Some(gap) = gap {
            self.gaps.record_gap(key.tenant(), gap);
            self.last_gap_ms.put(key.clone(), gap);
        }
    }

    /// A turn of `key` was stored at `now_ms`, held by `decode_engine_id`;
    /// `saved_ms` is the TTFT its reuse would save. In adaptive mode with a
    /// known agent: its first lease to send, and the hold is followed until
    /// its due time.
    pub fn stored(
        &mut self,
        key: &ConvKey,
        decode_engine_id: &str,
        turn: &StoredTurn,
        saved_ms: f64,
        now_ms: u64,
    ) -> Option<Job> {
        if !self.leases(decode_engine_id) {
            return None;
        }
        let agent_url = self.agent_of(decode_engine_id)?.to_string();
        let request_id = turn.params.remote_request_id()?;
        let conversation_gap_ms = self.last_gap_ms.get(key).copied();
        let blocks = turn.params.block_count();
        let facts = HoldFacts {
            elapsed_ms: 0,
            blocks,
            saved_ms,
            kv_usage: None,
            conversation_gap_ms,
        };
        let v = self.policy.first_lease(self.gaps.get(key.tenant()), &facts);
        if self.held.len() >= MAX_FOLLOWED && !self.held.contains_key(key) {
            // Too many followed: this one keeps D's own TTL.
            return None;
        }
        self.held.insert(
            key.clone(),
            Held {
                decode_engine_id: decode_engine_id.to_string(),
                request_id: request_id.clone(),
                blocks,
                saved_ms,
                stored_at_ms: now_ms,
                due_ms: now_ms.saturating_add(v.keep_ms),
                conversation_gap_ms,
            },
        );
        Some(Job {
            key: key.clone(),
            reason: v.reason.as_str(),
            value_ms: v.value_ms,
            cost_ms: v.cost_ms,
            agent_url: Some(agent_url),
            decode_engine_id: decode_engine_id.to_string(),
            request_id,
            keep_ms: v.keep_ms,
            cause: Cause::FirstLease,
        })
    }

    /// Holds whose lease ended by `now_ms`, at each D's reported KV usage
    /// (`kv_usage(decode_engine_id)`; the policy's default where `None`): a
    /// renewal to send (keep), or a release, with the key whose stored turn
    /// must leave the store.
    pub fn due(
        &mut self,
        now_ms: u64,
        kv_usage: impl Fn(&str) -> Option<f64>,
    ) -> Vec<(ConvKey, Job)> {
        let keys: Vec<ConvKey> = self
            .held
            .iter()
            .filter(|(_, h)| h.due_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for key in keys {
            let h = self.held.get(&key).expect("listed").clone();
            let facts = HoldFacts {
                elapsed_ms: now_ms.saturating_sub(h.stored_at_ms),
                blocks: h.blocks,
                saved_ms: h.saved_ms,
                kv_usage: kv_usage(&h.decode_engine_id),
                conversation_gap_ms: h.conversation_gap_ms,
            };
            let v = self.policy.renew(self.gaps.get(key.tenant()), &facts);
            let agent_url = self.agent_of(&h.decode_engine_id).map(str::to_string);
            let k2 = key.clone();
            let job = |keep_ms, cause| Job {
                key: k2.clone(),
                reason: v.reason.as_str(),
                value_ms: v.value_ms,
                cost_ms: v.cost_ms,
                agent_url: agent_url.clone(),
                decode_engine_id: h.decode_engine_id.clone(),
                request_id: h.request_id.clone(),
                keep_ms,
                cause,
            };
            if v.keep_ms > 0 {
                self.held.get_mut(&key).expect("listed").due_ms = now_ms.saturating_add(v.keep_ms);
                out.push((key, job(v.keep_ms, Cause::Renewed)));
            } else {
                self.held.remove(&key);
                self.gaps.record_abandoned(key.tenant());
                out.push((key, job(0, Cause::NotRenewed)));
            }
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

    fn turn(req: &str) -> StoredTurn {
        let p = KvParams::parse(
            &json!({"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "d0",
            "remote_request_id": req, "remote_host": "h", "remote_port": 1, "tp_size": 1}),
        )
        .unwrap();
        StoredTurn {
            params: p.compact(),
            decode_engine: 0,
            remote_num_tokens: 40,
            fingerprint: Fingerprint::default(),
            expires_at_ms: 0,
            stored_at_unix_ms: 0,
        }
    }

    fn cfg(mode: RetentionMode) -> RetentionConfig {
        RetentionConfig {
            mode,
            min_gap_samples: 3,
            ..RetentionConfig::default()
        }
    }

    #[test]
    fn releases_only_outside_fixed_mode_and_names_the_agent() {
        let k = ConvKey::new("t", "c");
        let mut fixed = Retention::new(cfg(RetentionMode::Fixed));
        assert_eq!(fixed.release(&k, "d0", &turn("r1"), Cause::Replaced), None);
        let mut r = Retention::new(cfg(RetentionMode::EarlyRelease));
        let j = r.release(&k, "d0", &turn("r1"), Cause::Replaced).unwrap();
        assert_eq!(
            (j.agent_url, j.keep_ms),
            (None, 0),
            "no agent: counted only"
        );
        r.learn("http://a:9470", ["d0"].into_iter(), 0);
        let j = r.release(&k, "d0", &turn("r1"), Cause::Lru).unwrap();
        assert_eq!(j.agent_url.as_deref(), Some("http://a:9470"));
        assert_eq!((j.request_id.as_str(), j.cause), ("r1", Cause::Lru));
        // The agent hosts no d0 (stock vLLM): counted only for a while.
        r.mark_unmanaged("d0", 1_000);
        r.learn("http://a:9470", ["d0"].into_iter(), 2_000);
        assert_eq!(r.agent_of("d0"), None);
        r.learn(
            "http://a:9470",
            ["d0"].into_iter(),
            1_000 + UNMANAGED_FOR_MS,
        );
        assert_eq!(r.agent_of("d0"), Some("http://a:9470"));
        // Early release alone never sizes leases.
        assert_eq!(r.stored(&k, "d0", &turn("r2"), 500.0, 0), None);
    }

    #[test]
    fn adaptive_leases_follow_the_gaps_then_renew_or_release() {
        let mut r = Retention::new(cfg(RetentionMode::Adaptive));
        r.learn("http://a:9470", ["d0"].into_iter(), 0);
        let max = r.config().max_hold_ms;
        // No history: the whole cap.
        let k = ConvKey::new("t", "c0");
        let j = r.stored(&k, "d0", &turn("r0"), 500.0, 0).unwrap();
        assert_eq!((j.keep_ms, j.cause), (max, Cause::FirstLease));
        // Gaps of about 2 s, observed on takes.
        for i in 0..5u64 {
            let k = ConvKey::new("t", &format!("g{i}"));
            r.stored(&k, "d0", &turn("x"), 500.0, 1_000 * i).unwrap();
            r.taken(&k, 1_000 * i + 2_000, 0, 0);
        }
        // A new conversation: leased from the tenant's gaps, far below the cap.
        let k = ConvKey::new("t", "new");
        let j = r.stored(&k, "d0", &turn("r9"), 500.0, 100_000).unwrap();
        assert!(j.keep_ms < 60_000, "{j:?}");
        assert_eq!(r.due(100_000, |_| None).len(), 0, "not due yet");
        // At its end, with D almost full of KV: not worth renewing.
        let due = r.due(100_000 + j.keep_ms, |d| (d == "d0").then_some(0.99));
        let (key, rel) = due.iter().find(|(key, _)| key == &k).unwrap();
        assert_eq!((key, rel.keep_ms, rel.cause), (&k, 0, Cause::NotRenewed));
        assert_eq!(rel.request_id, "r9");
        // A turn another replica stored: its gap from the shared store time.
        let k = ConvKey::new("t", "elsewhere");
        r.taken(&k, 0, 1_000_000, 1_003_000);
        let j = r.stored(&k, "d0", &turn("e1"), 500.0, 150_000).unwrap();
        assert_eq!(
            (j.keep_ms, j.reason),
            (6_000, "conversation_gap"),
            "3 s gap × 2"
        );
        // A turn replaced by a newer one: the newer one stays followed.
        let k = ConvKey::new("t", "rep");
        r.stored(&k, "d0", &turn("old"), 500.0, 300_000).unwrap();
        r.stored(&k, "d0", &turn("new"), 500.0, 300_001).unwrap();
        let n = r.followed();
        let rel = r.release(&k, "d0", &turn("old"), Cause::Replaced).unwrap();
        assert_eq!(rel.request_id, "old");
        assert_eq!(r.followed(), n, "the newer turn is still followed");
        // A kept hold the agent no longer has is not followed any more.
        r.forget(&k, "other");
        assert_eq!(r.followed(), n, "another request id: kept");
        r.forget(&k, "new");
        assert_eq!(r.followed(), n - 1);
        // A conversation with history uses its own previous gap.
        let k = ConvKey::new("t", "g1");
        let j = r.stored(&k, "d0", &turn("r10"), 500.0, 200_000).unwrap();
        assert_eq!(
            j.keep_ms,
            r.config().min_lease_ms.max(4_000),
            "2 s × factor 2"
        );
    }
}
