//! Glue between the reuse decision ([`crate::decision::decide`]) and the
//! selection ([`super::select`]) for the request path under `policy =
//! "predicted_ttft"`. Pure: no I/O, time passed in.
//!
//! The prefix check runs once, independent of P (a probe with threshold 0:
//! "would anything be reusable?"); the selection then chooses P, D and
//! pull-vs-recompute; D's params are attached only when it says pull.
use super::{DecodeView, Policy, PrefillView, Selection, TurnView, select};
use crate::decision::{Decision, PromptInfo, Reason, decide};
use crate::registry::Registry;
use crate::store::Lookup;
use crate::thresholds::ThresholdTable;

/// The joint outcome for one turn.
#[derive(Debug, Clone)]
pub struct Placement {
    /// P, D, pull, reason and predictions.
    pub selection: Selection,
    /// The reuse decision for the chosen P (`attach` only when pulled).
    pub decision: Decision,
}

/// Decide reuse and choose P and D jointly. `prefill` and `decode` are the
/// engines' views (registry indices), `thresholds` the pushed table, `rr`
/// the round-robin counter of this turn.
///
/// # Errors
/// [`super::NoHealthy`] when no prefill or no decode engine is healthy.
#[allow(clippy::too_many_arguments)]
pub fn place(
    policy: Policy,
    lookup: &Lookup,
    prompt: &PromptInfo<'_>,
    registry: &Registry,
    thresholds: &ThresholdTable,
    prefill: &[PrefillView],
    decode: &[DecodeView],
    rr: u64,
    now_ms: u64,
) -> Result<Placement, super::NoHealthy> {
    let any_p = prefill
        .first()
        .and_then(|p| registry.get(p.index))
        .map_or("", |e| e.engine_id.as_str());
    let probe = decide(
        lookup,
        prompt,
        any_p,
        registry,
        &ThresholdTable::new(0),
        now_ms,
    );
    let reusable = probe.reused_tokens;
    let prev_decode = probe
        .decode_engine_id
        .as_deref()
        .and_then(|id| registry.index_of(id));
    let turn = TurnView {
        prompt_tokens: prompt
            .tokens
            .map_or(reusable, |t| (t.len() as u64).max(reusable)),
        reusable_tokens: reusable,
        prev_decode: prev_decode.filter(|_| reusable > 0),
    };
    let id = |i: u16| registry.get(i).map_or("", |e| e.engine_id.as_str());
    let selection = select(
        policy,
        prefill,
        decode,
        &turn,
        |p, d| thresholds.effective(id(p), id(d), now_ms),
        rr,
    )?;
    let decision = if selection.pull {
        probe
    } else {
        Decision {
            reason: if probe.reason == Reason::Pulled {
                Reason::RecomputedBelowThreshold
            } else {
                probe.reason
            },
            reused_tokens: 0,
            reusable_tokens: probe.reusable_tokens,
            attach: None,
            decode_engine_id: probe.decode_engine_id,
        }
    };
    Ok(Placement {
        selection,
        decision,
    })
}

/// [`place`] with the router's own views: health by `healthy(index)`,
/// outstanding prefill tokens and in-flight decode streams from `load`, P's
/// compute cost from the pushed models (the measured EWMA is left out: the
/// router's end-to-end prefill times include P's queue, which `queue(P)`
/// already counts).
///
/// # Errors
/// [`super::NoHealthy`] when no prefill or no decode engine is healthy.
#[allow(clippy::too_many_arguments)]
pub fn place_with_load(
    policy: Policy,
    lookup: &Lookup,
    prompt: &PromptInfo<'_>,
    registry: &Registry,
    thresholds: &ThresholdTable,
    prefill_idx: &[u16],
    decode_idx: &[u16],
    healthy: impl Fn(u16) -> bool,
    load: &super::load::LoadBook,
    rr: u64,
    now_ms: u64,
) -> Result<Placement, super::NoHealthy> {
    let pv: Vec<PrefillView> = prefill_idx
        .iter()
        .map(|&index| PrefillView {
            index,
            healthy: healthy(index),
            outstanding_tokens: load.outstanding_prefill_tokens(index),
            measured_ms_per_token: None,
            queue_ms: load.queue_ms(index, now_ms),
        })
        .collect();
    let dv: Vec<DecodeView> = decode_idx
        .iter()
        .map(|&index| DecodeView {
            index,
            healthy: healthy(index),
            inflight_streams: load.inflight_decode_streams(index),
            kv_usage: load.kv_usage(index),
        })
        .collect();
    place(
        policy, lookup, prompt, registry, thresholds, &pv, &dv, rr, now_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::{Fingerprint, History, hash_tokens};
    use crate::params::KvParams;
    use crate::registry::{EngineConfig, Role};
    use crate::select::SelectReason;
    use crate::store::StoredTurn;
    use kvloop_router_api::{CostModelCoefficients, PairThreshold, ThresholdUpdate};
    use serde_json::json;

    fn registry() -> Registry {
        Registry::new(vec![
            EngineConfig::new("p0", Role::Prefill, "http://127.0.0.1:1", "127.0.0.1", 1),
            EngineConfig::new("p1", Role::Prefill, "http://127.0.0.1:2", "127.0.0.1", 2),
            EngineConfig::new("d0", Role::Decode, "http://127.0.0.1:3", "127.0.0.1", 3),
        ])
        .unwrap()
    }

    fn stored(prev: &[u32]) -> Lookup {
        let p = KvParams::parse(&json!({"remote_engine_id": "d0", "remote_request_id": "r",
            "remote_block_ids": [[1, 2]], "remote_port": 3, "remote_num_tokens": prev.len()}))
        .unwrap();
        Lookup::Found(StoredTurn {
            params: p.compact(),
            decode_engine: 2,
            remote_num_tokens: prev.len() as u32,
            fingerprint: Fingerprint {
                tokens_len: prev.len() as u32,
                tokens_hash: hash_tokens(prev),
                ..Fingerprint::default()
            },
            expires_at_ms: 10_000,
            stored_at_unix_ms: 0,
        })
    }

    fn table(xfer_p0: f64, xfer_p1: f64) -> ThresholdTable {
        let pair = |p: &str, x| PairThreshold {
            prefill_engine_id: p.into(),
            decode_engine_id: "d0".into(),
            threshold_tokens: 64,
            valid_for_ms: 60_000,
            model: Some(CostModelCoefficients {
                xfer_fixed_ms: 1.0,
                xfer_ms_per_token: x,
                prefill_ms_per_token: 0.01,
                prefill_ms_per_token_ctx: 0.0,
                confidence: 1.0,
                abandons_slow_reads: false,
                notices_abandoned_pulls: false,
                notices_read_pulls: false,
            }),
        };
        let mut t = ThresholdTable::new(64);
        t.apply(
            &ThresholdUpdate {
                agent_url: None,
                agent_id: "a".into(),
                seq: 1,
                pairs: vec![pair("p0", xfer_p0), pair("p1", xfer_p1)],
            },
            0,
            |_| true,
        )
        .unwrap();
        t
    }

    fn views() -> ([PrefillView; 2], [DecodeView; 1]) {
        let p = |index| PrefillView {
            index,
            healthy: true,
            outstanding_tokens: 0,
            measured_ms_per_token: None,
            queue_ms: None,
        };
        let d = DecodeView {
            index: 2,
            healthy: true,
            inflight_streams: 0,
            kv_usage: None,
        };
        ([p(0), p(1)], [d])
    }

    #[test]
    fn pulls_through_the_prefill_engine_with_the_fast_path() {
        let prev: Vec<u32> = (0..1000).collect();
        let next: Vec<u32> = (0..1100).collect();
        let prompt = PromptInfo {
            tokens: Some(&next),
            history: History::None,
        };
        let (ps, ds) = views();
        let r = registry();
        let pl = place(
            Policy::PredictedTtft,
            &stored(&prev),
            &prompt,
            &r,
            &table(0.1, 0.001),
            &ps,
            &ds,
            0,
            1,
        )
        .unwrap();
        assert_eq!(
            (pl.selection.prefill, pl.selection.reason),
            (1, SelectReason::PredictedPull)
        );
        assert_eq!(
            (pl.decision.reason, pl.decision.reused_tokens),
            (Reason::Pulled, 1000)
        );
        assert!(pl.decision.attach.is_some());
        // Both paths slow: recomputing 1000 tokens (10 ms) beats a 101 ms read.
        let pl = place(
            Policy::PredictedTtft,
            &stored(&prev),
            &prompt,
            &r,
            &table(0.1, 0.1),
            &ps,
            &ds,
            0,
            1,
        )
        .unwrap();
        assert_eq!(pl.selection.reason, SelectReason::PredictedRecompute);
        assert_eq!(
            (
                pl.decision.reason,
                pl.decision.reused_tokens,
                pl.decision.attach.is_none()
            ),
            (Reason::RecomputedBelowThreshold, 0, true)
        );
        // Nothing stored: no entry, recompute on the shortest queue.
        let pl = place(
            Policy::PredictedTtft,
            &Lookup::Missing,
            &prompt,
            &r,
            &table(0.1, 0.1),
            &ps,
            &ds,
            1,
            1,
        )
        .unwrap();
        assert_eq!(pl.decision.reason, Reason::NoEntry);
        assert!(!pl.selection.pull);
    }

    #[test]
    fn round_robin_policy_keeps_the_threshold_rule() {
        let prev: Vec<u32> = (0..100).collect();
        let next: Vec<u32> = (0..120).collect();
        let prompt = PromptInfo {
            tokens: Some(&next),
            history: History::None,
        };
        let (ps, ds) = views();
        let r = registry();
        let t = ThresholdTable::new(64);
        let pl = place(
            Policy::RoundRobin,
            &stored(&prev),
            &prompt,
            &r,
            &t,
            &ps,
            &ds,
            1,
            1,
        )
        .unwrap();
        assert_eq!(
            (pl.selection.prefill, pl.decision.reason),
            (1, Reason::Pulled)
        );
        let t = ThresholdTable::new(1000);
        let pl = place(
            Policy::RoundRobin,
            &stored(&prev),
            &prompt,
            &r,
            &t,
            &ps,
            &ds,
            0,
            1,
        )
        .unwrap();
        assert_eq!(pl.decision.reason, Reason::RecomputedBelowThreshold);
    }
}
