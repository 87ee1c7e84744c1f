//! What router replicas share of their prefill lines (pure: encoding and
//! merging; the exchange itself is `crate::load_share`).
//!
//! Each replica knows exactly what it sent to each prefill engine and the
//! compute it predicted for each ([`super::load::LoadBook`]); what P itself
//! reports (`vllm:num_requests_waiting` + `running`, polled) is a count,
//! costed at the mean prediction, and as old as the poll. Sharing the lines
//! lets every replica's `queue(P)` sum the predicted work of every
//! replica's outstanding prefills on P, in the order they were sent.
//!
//! Each prefill also names its conversation (a digest of tenant and
//! conversation id, `ShareLine::conversations`): a replica that routes a
//! turn of a conversation drops that conversation's prefills from the
//! lines it holds (`LoadBook::supersede`), so that the in-flight turns of
//! a replica that died, retried by their clients on another replica, do
//! not stay counted in P's queue until the dead replica's share ages out.
//!
//! Ages, not timestamps, travel: a share says how long ago each prefill was
//! sent, as of the moment it was taken (`sent_unix_ms`, the only wall-clock
//! value, is used to add the time the share spent in the store and to drop
//! shares of replicas that stopped sharing).
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Other router replicas' outstanding prefills on one engine, as they last
/// shared them (`crate::load_share`): `(sent at ms, predicted compute µs)`
/// on this replica's clock, and when one of them last finished its head.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct SharedLine {
    /// `(sent at ms, predicted compute µs, conversation)`, any order; the
    /// conversation is its digest ([`crate::store::ConvKey::digest`]), 0
    /// for none.
    pub items: Vec<(u64, u64, u64)>,
    /// When the engine last finished one of their heads, ms.
    pub last_done_ms: Option<u64>,
    /// Their pulls still READing, not in P's compute line
    /// ([`ShareLine::reading`]).
    pub reading: u32,
}

/// One replica's line on one engine as it shares it (the wire form of
/// [`super::share::LoadShare`]'s lines): ages relative to the moment it is
/// taken, so that no two replicas' clocks need to agree.
#[derive(Default, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShareLine {
    /// `[age ms, predicted compute µs]` per outstanding prefill, oldest first.
    pub items: Vec<(u64, u64)>,
    /// Per item, the digest of its conversation (0: none); absent from
    /// replicas before it, which count as none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conversations: Vec<u64>,
    /// Time since the engine last finished this replica's head, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_age_ms: Option<u64>,
    /// This replica's pulls on the engine still READing, whose READ's end
    /// is noticed: not in `items` (not yet in P's compute line), but in
    /// P's reported requests, where the other replicas count them as known
    /// ([`super::load::LoadBook::queue_ms`]) rather than as unknown work at
    /// the mean. Absent from replicas before it (none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reading: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Removes from `line` the items of the `gone` conversations `(digest, at
/// ms)` sent at or before `at`: a later one is the conversation's next
/// turn, routed by another replica after this one's.
pub(super) fn drop_conversations<'a>(
    line: &mut SharedLine,
    gone: impl Iterator<Item = &'a (u64, u64)> + Clone,
) {
    line.items
        .retain(|&(sent_ms, _, c)| c == 0 || !gone.clone().any(|&(g, at)| g == c && sent_ms <= at));
}

/// Version of the share format.
pub const SHARE_VERSION: u8 = 1;

/// One replica's lines, as stored (JSON, a few dozen bytes per prefill in
/// flight).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadShare {
    /// [`SHARE_VERSION`].
    pub v: u8,
    /// When the share was taken, Unix ms.
    pub sent_unix_ms: u64,
    /// Per prefill engine id, its line.
    pub engines: BTreeMap<String, ShareLine>,
}

/// A share that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// Not JSON of the share's shape (the message names the field).
    #[error("load share: {0}")]
    Format(#[from] serde_json::Error),
    /// Another version.
    #[error("load share: version {found}, expected {SHARE_VERSION}")]
    Version {
        /// The version found.
        found: u8,
    },
}

/// Decodes a stored share.
///
/// # Errors
/// [`ShareError`] naming what is wrong.
pub fn decode(bytes: &[u8]) -> Result<LoadShare, ShareError> {
    let s: LoadShare = serde_json::from_slice(bytes)?;
    if s.v != SHARE_VERSION {
        return Err(ShareError::Version { found: s.v });
    }
    Ok(s)
}

/// Encodes a share.
pub fn encode(s: &LoadShare) -> Vec<u8> {
    serde_json::to_vec(s).unwrap_or_default()
}

/// Whether a share taken at `sent_unix_ms` is too old at `now_unix_ms` to
/// count (its replica stopped sharing: gone, or cut off from the store).
pub fn is_stale(sent_unix_ms: u64, now_unix_ms: u64, max_age_ms: u64) -> bool {
    now_unix_ms.saturating_sub(sent_unix_ms) > max_age_ms
}

/// Where this replica stands among the replicas that share: `(rank,
/// count)`, its position among the live replica ids (`me` and `others`,
/// sorted; every replica computes the same order) and their number. Used
/// to spread the replicas' round-robin tie-breaks ([`tie_offset`]).
pub fn replica_rank<'a>(me: &str, others: impl IntoIterator<Item = &'a str>) -> (u64, u64) {
    let (mut rank, mut count) = (0u64, 1u64);
    for id in others {
        if id == me {
            continue;
        }
        count += 1;
        rank += u64::from(id < me);
    }
    (rank, count)
}

/// The start of this replica's round robin over `n` engines, given its
/// `(rank, count)` ([`replica_rank`]): `rank × n / count`, so that
/// replicas that choose at the same instant, before either has shared
/// what it sent, break ties on different engines. Without it every
/// replica starts at engine 0 and their first turns (and every tie until
/// they share, one `load_share_interval_ms` later) land on the same P:
/// measured in `kvloop demo cluster`, both replicas' first three turns
/// queued 4 : 2 on two P. Envoy's round robin starts each worker at a
/// random index for the same reason; a rank spreads them evenly.
pub fn tie_offset((rank, count): (u64, u64), n: usize) -> u64 {
    if count == 0 {
        return 0;
    }
    rank.min(count - 1) * n as u64 / count
}

/// The other replicas' lines per engine id, on this replica's clock:
/// `now_ms` (this replica's [`crate::clock::Clock`]) and `now_unix_ms` (wall
/// clock) are the same instant. Stale shares are left out; a share from
/// the future (clocks apart) counts as taken now.
pub fn merge(
    shares: &[LoadShare],
    now_ms: u64,
    now_unix_ms: u64,
    max_age_ms: u64,
) -> BTreeMap<String, SharedLine> {
    let mut out: BTreeMap<String, SharedLine> = BTreeMap::new();
    for s in shares {
        if is_stale(s.sent_unix_ms, now_unix_ms, max_age_ms) {
            continue;
        }
        let in_store_ms = now_unix_ms.saturating_sub(s.sent_unix_ms);
        for (id, line) in &s.engines {
            let m = out.entry(id.clone()).or_default();
            // A share without conversations (an older replica) names none.
            let conversation = |i: usize| line.conversations.get(i).copied().unwrap_or(0);
            m.items
                .extend(line.items.iter().enumerate().map(|(i, &(age, us))| {
                    (
                        now_ms.saturating_sub(age + in_store_ms),
                        us,
                        conversation(i),
                    )
                }));
            if let Some(a) = line.done_age_ms {
                let at = now_ms.saturating_sub(a + in_store_ms);
                m.last_done_ms = Some(m.last_done_ms.map_or(at, |x| x.max(at)));
            }
            m.reading = m.reading.saturating_add(line.reading);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(engine id, [age ms, compute µs], done age ms)`.
    type Line<'a> = (&'a str, Vec<(u64, u64)>, Option<u64>);

    fn share(sent: u64, engines: &[Line<'_>]) -> LoadShare {
        LoadShare {
            v: SHARE_VERSION,
            sent_unix_ms: sent,
            engines: engines
                .iter()
                .map(|(id, items, d)| {
                    (
                        id.to_string(),
                        ShareLine {
                            items: items.clone(),
                            done_age_ms: *d,
                            conversations: Vec::new(),
                            reading: 0,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn round_trips_and_refuses_other_versions_and_shapes() {
        let s = share(
            5,
            &[("p0", vec![(10, 2000)], Some(3)), ("p1", vec![], None)],
        );
        let b = encode(&s);
        assert_eq!(decode(&b).unwrap(), s);
        let mut other = s.clone();
        other.v = 9;
        let e = decode(&encode(&other)).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        let e = decode(br#"{"v":1,"sent_unix_ms":"x","engines":{}}"#).unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    /// `(sent at ms, compute µs)` of a merged line's items.
    fn timed(line: &SharedLine) -> Vec<(u64, u64)> {
        line.items.iter().map(|x| (x.0, x.1)).collect()
    }

    /// The conversation of each of a merged line's items.
    fn conversations(line: &SharedLine) -> Vec<u64> {
        line.items.iter().map(|x| x.2).collect()
    }

    #[test]
    fn merge_keeps_each_item_with_its_conversation() {
        let old = share(1_000_000, &[("p0", vec![(10, 1), (20, 2)], None)]);
        let mut named = share(1_000_000, &[("p0", vec![(30, 3)], None)]);
        named.engines.get_mut("p0").unwrap().conversations = vec![9];
        let m = merge(&[old.clone(), named], 10_000, 1_000_000, 1000);
        assert_eq!(m["p0"].items.len(), 3);
        assert_eq!(conversations(&m["p0"]), vec![0, 0, 9]);
        // The wire form leaves the field out when nothing is named, and a
        // share without it (an older replica) reads as none.
        let text = String::from_utf8(encode(&old)).unwrap();
        assert!(!text.contains("conversations"), "{text}");
        let m = merge(&[decode(text.as_bytes()).unwrap()], 10_000, 1_000_000, 1000);
        assert_eq!(conversations(&m["p0"]), vec![0, 0], "none named");
    }

    #[test]
    fn merge_puts_ages_on_this_clock_and_drops_stale_shares() {
        // Now: 10_000 ms on this replica's clock, Unix 1_000_000.
        let a = share(999_990, &[("p0", vec![(100, 5000)], Some(40))]);
        let b = share(
            1_000_000,
            &[
                ("p0", vec![(20, 7000)], Some(500)),
                ("p1", vec![(0, 1)], None),
            ],
        );
        let stale = share(990_000, &[("p0", vec![(0, 9)], None)]);
        let m = merge(&[a, b, stale], 10_000, 1_000_000, 1000);
        let p0 = &m["p0"];
        // a: 100 ms old when taken, 10 ms in the store.
        assert_eq!(timed(p0), vec![(9_890, 5000), (9_980, 7000)]);
        // The latest finish: a's, 50 ms ago.
        assert_eq!(p0.last_done_ms, Some(9_950));
        assert_eq!(timed(&m["p1"]), vec![(10_000, 1)]);
        assert!(is_stale(990_000, 1_000_000, 1000));
        // From the future: counts as now.
        let f = share(1_000_500, &[("p0", vec![(5, 1)], None)]);
        assert_eq!(
            timed(&merge(&[f], 10_000, 1_000_000, 1000)["p0"]),
            vec![(9_995, 1)]
        );
    }

    #[test]
    fn replicas_spread_their_round_robin_starts() {
        let ids = ["r-b", "r-a", "r-c"];
        let ranks: Vec<(u64, u64)> = ids
            .iter()
            .map(|me| replica_rank(me, ids.iter().copied()))
            .collect();
        assert_eq!(ranks, vec![(1, 3), (0, 3), (2, 3)]);
        // Two replicas over two P start on different engines; over four P,
        // two apart.
        assert_eq!((tie_offset((0, 2), 2), tie_offset((1, 2), 2)), (0, 1));
        assert_eq!((tie_offset((0, 2), 4), tie_offset((1, 2), 4)), (0, 2));
        // Alone (no share read yet): no offset.
        assert_eq!(replica_rank("r-a", []), (0, 1));
        assert_eq!(tie_offset((0, 1), 3), 0);
        assert_eq!(tie_offset((5, 0), 3), 0);
    }

    #[test]
    fn pulls_still_reading_are_shared_as_a_count_and_summed() {
        let mut a = share(1_000, &[("p0", vec![(10, 100_000)], None)]);
        a.engines.get_mut("p0").unwrap().reading = 2;
        let wire = encode(&a);
        assert!(String::from_utf8_lossy(&wire).contains("\"reading\":2"));
        assert_eq!(decode(&wire).unwrap(), a);
        let mut b = share(1_000, &[("p0", vec![], None)]);
        b.engines.get_mut("p0").unwrap().reading = 1;
        let merged = merge(&[a, b], 5_000, 1_000, 1_000);
        assert_eq!(merged["p0"].reading, 3);
        // None reading: not on the wire (replicas before it read none).
        let none = share(1_000, &[("p0", vec![(10, 100_000)], None)]);
        assert!(!String::from_utf8_lossy(&encode(&none)).contains("reading"));
    }
}
