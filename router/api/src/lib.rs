//! Wire types of the router's admin API, shared by `kvloop-router` (server) and
//! `kvloop-agent` (client), plus the protocol pieces every kvloop component
//! that talks to engines needs: [`kv_params`] (typed `kv_transfer_params`,
//! members kept bit-exact), [`json`] (raw JSON objects), [`sse`] (the one
//! server-sent-events parser) and [`streak`] (the pull alarm of a pair whose
//! pulls keep failing, shared by the router and the agent).
//!
//! `PUT /admin/thresholds` with `Authorization: Bearer <token>` and a JSON body
//! [`ThresholdUpdate`]. The router answers `204 No Content` on success, `401`
//! on a missing or wrong token, `400` with a message naming the bad field on
//! malformed input.
//!
//! Deadlines travel as durations (`valid_for_ms`), never as absolute times:
//! the agent's and the router's clocks are never compared. The router computes
//! `valid_until = time of receipt + valid_for_ms` on its own monotonic clock.
#![forbid(unsafe_code)]

pub mod abandon;
pub mod json;
pub mod kv_params;
pub mod notice;
pub mod sse;
pub mod streak;

pub use kv_params::{BlockIds, KvTransferParams, ParamsError};
pub use notice::{NoticeError, PULL_ABANDONED_PATH, PULL_READ_PATH, PullNotice};
pub use sse::{SseEvent, SseParser};

use serde::{Deserialize, Serialize};

/// Path of the threshold push endpoint.
pub const THRESHOLDS_PATH: &str = "/admin/thresholds";

/// Whether the bearer token `given` is `expected` (the router's
/// `admin_token`: the router checks it on its admin API, the agents on
/// the retention decisions the router sends them). Constant time in the
/// tokens' contents; an empty `expected` never matches.
pub fn bearer_matches(expected: &str, given: &str) -> bool {
    let (a, b) = (expected.as_bytes(), given.as_bytes());
    !a.is_empty()
        && a.len() == b.len()
        && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Header a router adds to every prefill request it sends to P, so that the
/// prefill probe (kernel, socket level) can attribute the measured latency to
/// token counts: `X-KVLoop-Tokens: prompt=<N>,reused=<R>`, where `N` is the
/// prompt length in tokens and `R` the tokens P will READ from D instead of
/// computing (0 when P recomputes). Omitted when the router does not know `N`.
pub const TOKENS_HEADER: &str = "x-kvloop-tokens";

/// One push from an agent: the thresholds of the (P, D) pairs whose prefill
/// engine lives on the agent's node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdUpdate {
    /// Identity of the pushing agent (its node name).
    pub agent_id: String,
    /// Monotonic push sequence of this agent; a router ignores a push whose
    /// `seq` is lower than the last one it applied from the same `agent_id`
    /// (a delayed retry never overwrites a newer decision).
    pub seq: u64,
    /// The pairs, at most one entry per (prefill, decode) engine pair.
    pub pairs: Vec<PairThreshold>,
    /// The pushing agent's HTTP base URL (`http://<node_addr>:<port>`): the
    /// router sends its retention decisions for these pairs' decode
    /// engines there (`POST /v1/leases/retention`; the agent forwards them
    /// to the agent hosting the engine). Absent from agents before issue
    /// 15: the router then only counts what it would release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
}

/// The recompute decision inputs for one (prefill engine, decode engine) pair.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairThreshold {
    /// Engine id of the prefill engine (P, the reader on D→P).
    pub prefill_engine_id: String,
    /// Engine id of the decode engine (D, which retains the blocks).
    pub decode_engine_id: String,
    /// Minimum reusable tokens for which P should READ D's blocks instead of
    /// recomputing them. Replaces vLLM's static `kv_recompute_threshold`
    /// (default 64 tokens) for this pair while valid.
    pub threshold_tokens: u64,
    /// How long this entry stays valid after the router receives it, in
    /// milliseconds. The agent sets it below 3 × its push period; when it
    /// lapses the router falls back to its static threshold.
    pub valid_for_ms: u64,
    /// The fitted cost model behind the threshold, when the agent has one.
    /// A router may use it to decide per request (pull when the predicted
    /// transfer time is below the predicted recompute time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<CostModelCoefficients>,
}

/// Coefficients of the pair's fitted cost model (see `kvloop-costmodel`).
///
/// Transfer of `r` reusable tokens:
/// `t_xfer_ms(r) = xfer_fixed_ms + r * xfer_ms_per_token`.
/// Recompute of those `r` tokens on P, given `ctx` tokens before them:
/// `t_recompute_ms(r) = r * (prefill_ms_per_token + prefill_ms_per_token_ctx * ctx)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModelCoefficients {
    /// Fixed cost of one D→P READ (handshake, notification, queueing), ms.
    pub xfer_fixed_ms: f64,
    /// Transfer cost per reusable token (bytes per token / bandwidth), ms.
    pub xfer_ms_per_token: f64,
    /// Prefill cost per computed token, linear term, ms.
    pub prefill_ms_per_token: f64,
    /// Prefill cost per computed token per token of context (attention), ms.
    pub prefill_ms_per_token_ctx: f64,
    /// Confidence in `[0, 1]`: low when samples are few or old.
    pub confidence: f64,
    /// The pushing agent owns P's READs over this pair (managed mode) and
    /// abandons one once recomputing would have finished
    /// ([`abandon::abandon_after_ms`] of this model's `xfer_ms(r)` and
    /// `recompute_prefix_ms(r)`); P then recomputes the whole prompt. A
    /// router uses it to see P busy with that recompute. Sent only when
    /// true (absent from agents before it, and in observe mode), so a
    /// router must be upgraded before the agents that set it (this struct
    /// denies unknown fields).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub abandons_slow_reads: bool,
    /// The pushing agent also tells the routers at once when a READ over
    /// this pair is abandoned, fails or is declined ([`PullNotice`] at
    /// [`PULL_ABANDONED_PATH`]). A router then books P's recompute from
    /// that notice, instead of assuming that every pull still READing at
    /// its first overdue mark was cut there: the agent cuts only a READ
    /// whose progress says the rest would outlast recomputing
    /// ([`abandon::abandon_on_progress`]), and a READ late but not cut
    /// made P look busy with a recompute it never did. Sent only when true
    /// (this struct denies unknown fields: upgrade routers first).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub notices_abandoned_pulls: bool,
    /// The pushing agent owns P's READs over this pair (managed mode) and
    /// tells the routers at once when one completes with the blocks
    /// ([`PullNotice`] at [`PULL_READ_PATH`]). A router then counts such
    /// a pull in P's compute line from that notice on, and not before:
    /// P's engine computes other turns while the READ runs, and a pull
    /// counted at its place in line from the moment it was sent made P
    /// look busy for as long as a slow READ lasted. Sent only when true
    /// (this struct denies unknown fields: upgrade routers first).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub notices_read_pulls: bool,
}

impl CostModelCoefficients {
    /// `t_xfer_ms(r)`: READ of `r` reusable tokens, ms.
    pub fn xfer_ms(&self, r: f64) -> f64 {
        self.xfer_fixed_ms + r * self.xfer_ms_per_token
    }

    /// `t_recompute_ms(r)` of a prefix of `r` tokens (average context
    /// `r / 2`), ms.
    pub fn recompute_prefix_ms(&self, r: f64) -> f64 {
        r * (self.prefill_ms_per_token + self.prefill_ms_per_token_ctx * r / 2.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_match_exactly() {
        assert!(bearer_matches("t0k", "t0k"));
        assert!(!bearer_matches("t0k", "t0K"));
        assert!(!bearer_matches("t0k", "t0"));
        assert!(
            !bearer_matches("", ""),
            "no token configured: nothing matches"
        );
    }

    #[test]
    fn round_trips_and_rejects_unknown_fields() {
        let u = ThresholdUpdate {
            agent_id: "node-a".into(),
            seq: 7,
            pairs: vec![PairThreshold {
                prefill_engine_id: "p0".into(),
                decode_engine_id: "d0".into(),
                threshold_tokens: 2048,
                valid_for_ms: 15_000,
                model: None,
            }],
            agent_url: Some("http://10.0.0.7:9470".into()),
        };
        let s = serde_json::to_string(&u).unwrap();
        assert_eq!(serde_json::from_str::<ThresholdUpdate>(&s).unwrap(), u);
        let bad = s.replace("\"seq\"", "\"sequence\"");
        let err = serde_json::from_str::<ThresholdUpdate>(&bad).unwrap_err();
        assert!(err.to_string().contains("sequence"), "{err}");
    }
}
