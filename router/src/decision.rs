//! The per-request reuse decision (docs/protocol.md Router rules 1, 3 and 7).
//! Pure: the caller has already taken the conversation's entry from the store
//! (single use) and passes the time in.
use serde_json::value::RawValue;

use crate::fingerprint::{History, PrefixCheck, check_prefix};
use crate::registry::Registry;
use crate::store::Lookup;
use crate::thresholds::ThresholdTable;

pub use crate::reason::Reason;

/// A decision for one prefill request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Why.
    pub reason: Reason,
    /// Tokens P will READ instead of computing (0 unless pulled).
    pub reused_tokens: u64,
    /// Tokens the previous turn's D holds of this prompt (the prefix check
    /// passed), pulled or not; 0 when nothing could be reused.
    pub reusable_tokens: u64,
    /// D's params to attach to the prefill request (only when pulled), with
    /// `remote_host` from the registry and the D→P flags; every other member
    /// exactly as D sent it.
    pub attach: Option<Box<RawValue>>,
    /// Engine id of the D holding the blocks, when an entry was found.
    pub decode_engine_id: Option<String>,
}

/// What the router knows of the new prompt.
#[derive(Debug, Clone, Copy)]
pub struct PromptInfo<'a> {
    /// Token ids, when known.
    pub tokens: Option<&'a [u32]>,
    /// Comparable history.
    pub history: History<'a>,
}

/// Decide for a request to prefill engine `prefill_engine_id` at `now_ms`.
pub fn decide(
    lookup: &Lookup,
    prompt: &PromptInfo<'_>,
    prefill_engine_id: &str,
    registry: &Registry,
    thresholds: &ThresholdTable,
    now_ms: u64,
) -> Decision {
    let none = |reason| Decision {
        reason,
        reused_tokens: 0,
        reusable_tokens: 0,
        attach: None,
        decode_engine_id: None,
    };
    let turn = match lookup {
        Lookup::Missing => return none(Reason::NoEntry),
        Lookup::Expired => return none(Reason::Expired),
        Lookup::Found(t) => t,
    };
    let Some(d) = registry.get(turn.decode_engine) else {
        return none(Reason::NoEntry);
    };
    let held = u64::from(turn.remote_num_tokens);
    let mut out = none(Reason::PrefixMismatch);
    out.decode_engine_id = Some(d.engine_id.clone());
    if check_prefix(&turn.fingerprint, held, prompt.tokens, prompt.history) != PrefixCheck::Extends
    {
        return out;
    }
    let reusable = prompt.tokens.map_or(held, |t| held.min(t.len() as u64));
    out.reusable_tokens = reusable;
    if !thresholds
        .effective(prefill_engine_id, &d.engine_id, now_ms)
        .should_pull(reusable)
    {
        out.reason = Reason::RecomputedBelowThreshold;
        return out;
    }
    out.reason = Reason::Pulled;
    out.reused_tokens = reusable;
    out.attach = Some(
        turn.params
            .expand_json(&d.engine_id, held, &d.side_channel_host),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::{Fingerprint, hash_tokens};
    use crate::params::KvParams;
    use crate::registry::{EngineConfig, Role};
    use crate::store::StoredTurn;
    use serde_json::json;

    fn registry() -> Registry {
        Registry::new(vec![
            EngineConfig::new("p0", Role::Prefill, "http://127.0.0.1:1", "127.0.0.1", 1),
            EngineConfig::new("d0", Role::Decode, "http://[::1]:2", "::1", 2),
        ])
        .unwrap()
    }

    fn turn(prev_prompt: &[u32], held: u32) -> StoredTurn {
        let p = KvParams::parse(
            &json!({"remote_engine_id": "d0", "remote_request_id": "r", "remote_block_ids": [[1,2]],
            "remote_port": 2, "remote_host": "somewhere", "remote_num_tokens": held}),
        )
        .unwrap();
        StoredTurn {
            params: p.compact(),
            decode_engine: 1,
            remote_num_tokens: held,
            fingerprint: Fingerprint {
                tokens_len: prev_prompt.len() as u32,
                tokens_hash: hash_tokens(prev_prompt),
                ..Default::default()
            },
            expires_at_ms: 10_000,
            stored_at_unix_ms: 0,
        }
    }

    fn run(lookup: Lookup, tokens: &[u32], t: &ThresholdTable) -> Decision {
        let p = PromptInfo {
            tokens: Some(tokens),
            history: History::None,
        };
        decide(&lookup, &p, "p0", &registry(), t, 0)
    }

    #[test]
    fn every_reason() {
        let prev: Vec<u32> = (0..100).collect();
        let next: Vec<u32> = (0..200).collect();
        let t = ThresholdTable::new(64);
        assert_eq!(run(Lookup::Missing, &next, &t).reason, Reason::NoEntry);
        assert_eq!(run(Lookup::Expired, &next, &t).reason, Reason::Expired);
        let d = run(Lookup::Found(turn(&prev, 150)), &next, &t);
        assert_eq!((d.reason, d.reused_tokens), (Reason::Pulled, 150));
        let a: serde_json::Value = serde_json::from_str(d.attach.unwrap().get()).unwrap();
        assert_eq!(a["remote_host"], "[::1]");
        assert_eq!(a["do_remote_decode"], true);
        assert_eq!(a["do_remote_prefill"], false);
        // edited history
        let mut edited = next.clone();
        edited[3] = 999;
        assert_eq!(
            run(Lookup::Found(turn(&prev, 150)), &edited, &t).reason,
            Reason::PrefixMismatch
        );
        // prompt shorter than remote_num_tokens
        assert_eq!(
            run(Lookup::Found(turn(&prev, 150)), &next[..120], &t).reason,
            Reason::PrefixMismatch
        );
        // below threshold
        let short: Vec<u32> = (0..10).collect();
        let d = run(Lookup::Found(turn(&short, 12)), &next, &t);
        assert_eq!(
            (d.reason, d.reused_tokens, d.attach.is_none()),
            (Reason::RecomputedBelowThreshold, 0, true)
        );
    }
}
