//! P/D selection (issue 13 item 2). Pure, sans-IO: the caller passes the
//! engines' health and load, the turn's reusable tokens, and the per-pair
//! thresholds and cost models in force ([`crate::thresholds::Effective`]);
//! time enters only through those (their validity is the caller's `now`).
//!
//! Two policies (`policy` in the config, [`crate::config::Policy`]):
//! - `round_robin`: P and D round robin over healthy engines, pull when the
//!   pair's threshold rule says so ([`Effective::should_pull`]); what vLLM's
//!   multi-turn proxy does with the fixed threshold.
//! - `predicted_ttft`: for each healthy prefill engine P and each way to get
//!   the reusable prefix (pull it from the previous D, or recompute it),
//!   predicted TTFT =
//!   `queue(P) + reuse + suffix`, where
//!   - `queue(P)` = the predicted compute the prefills outstanding on P
//!     still have (this replica's, and with a Redis store every replica's,
//!     shared every `load_share_interval_ms`: [`share`]; merged in sending
//!     order, the head's progress since it could start deducted:
//!     [`load::LoadBook::remaining_ms`]), plus the mean predicted compute
//!     for each request P's own report (its waiting and running requests,
//!     polled every `load_interval_ms`) has beyond those
//!     ([`load::LoadBook::queue_ms`]; before this replica predicted
//!     anything, at the mean of the other replicas' shared predictions).
//!     With neither: this replica's outstanding prefill tokens on P × P's
//!     ms per token (the model's `prefill_ms_per_token`);
//!   - `reuse` = pull: `xfer_fixed_ms + r · xfer_ms_per_token` of the
//!     (P, previous D) model; recompute: `r · (a + b · r/2)`. Where P's
//!     agent abandons slow READs (the model's `abandons_slow_reads`), a
//!     pull's prefill known to be still READing (overtaken) re-enters P's
//!     line as a whole-prompt recompute if still outstanding at its
//!     deadline
//!     (`kvloop_router_api::abandon::foreseen_abandon_ms`: the first
//!     overdue mark, where the agent cuts a READ whose progress shows the
//!     path slowed: [`load::Abandon`]), so that P looks as busy as it then
//!     is;
//!   - `suffix` = the `s` new tokens after the `r` reused ones:
//!     `s · (a + b · (r + s/2))`;
//!
//!   with `a = prefill_ms_per_token`, `b = prefill_ms_per_token_ctx` of P's
//!   model (`kvloop_router_api::CostModelCoefficients`). The option with the
//!   lowest prediction wins; ties go to the shorter queue, then round-robin
//!   order. D is chosen by load: not full (KV usage at least
//!   [`FULL_KV_USAGE`] where reported), fewest in-flight decode streams,
//!   lowest reported KV usage, then round-robin order. A P whose (P,
//!   previous D) model is not valid (none pushed, lapsed, or confidence below
//!   [`SELECT_MIN_CONFIDENCE`]) has no pull option, only its recompute
//!   option (costed with a model of another of its pairs; a P with no valid
//!   model at all borrows another healthy P's, with its own measured cost
//!   per token where known). Where no healthy P has a valid model, or a
//!   pull is possible and no P has a valid model of the path from the
//!   previous D, predictions cannot be compared: the turn falls back to
//!   round robin and the threshold rule (reason `fallback_no_model`).
//!
//! Every [`Selection`] says why ([`SelectReason`]) and carries the predicted
//! times of the chosen and the runner-up option (one line:
//! [`crate::explain::RouteRecord::line`]).
//!
//! Integration (server, `route_inner`): under `predicted_ttft` the router
//! still picks a P round robin first (for `/tokenize`), takes the stored
//! turn, then calls [`route::place_with_load`], which runs the prefix check
//! once, selects P, D and pull-vs-recompute, and returns the reuse decision
//! for the chosen P (D's params attached only when pulling). The request
//! holds [`load::LoadBook`] guards: the prefill's computed tokens
//! (`prompt − reused`) on P until P answers, one decode stream on D until the
//! relay ends. Every routed turn becomes a [`crate::explain::RouteRecord`]:
//! debug log line, `kvloop_router_selections_total`, the optional
//! `x-kvloop-route` header and `GET /admin/routes`. D's KV usage comes
//! from its `/metrics` (`crate::load_poll`, every `load_interval_ms`).
mod line;
pub mod load;
pub mod route;
pub mod share;

use crate::thresholds::Effective;

use kvloop_router_api::CostModelCoefficients;
use kvloop_router_api::abandon::foreseen_abandon_ms;

pub use crate::config::Policy;

/// A prefill engine as the selection sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillView {
    /// Registry index.
    pub index: u16,
    /// Passes health checks.
    pub healthy: bool,
    /// Prefill tokens sent to it and not yet answered (router's own count).
    pub outstanding_tokens: u64,
    /// Measured cost, ms per computed token (`None`: no sample yet).
    pub measured_ms_per_token: Option<f64>,
    /// Queue ahead on P from predicted compute, ms
    /// ([`load::LoadBook::queue_ms`]); replaces tokens × ms per token when
    /// known.
    pub queue_ms: Option<f64>,
}

/// A decode engine as the selection sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeView {
    /// Registry index.
    pub index: u16,
    /// Passes health checks.
    pub healthy: bool,
    /// Decode streams in flight (router's own count).
    pub inflight_streams: u32,
    /// KV cache usage, 0..1, where the engine reports it
    /// (`vllm:kv_cache_usage_perc`, read every `load_interval_ms`).
    pub kv_usage: Option<f64>,
}

/// A decode engine at or above this KV usage counts as full (vLLM
/// preempts requests when it cannot allocate blocks).
pub const FULL_KV_USAGE: f64 = 0.99;

/// Order of KV usage: lower first, unreported last.
fn usage_rank(u: Option<f64>) -> u32 {
    u.map_or(u32::MAX, |u| (u.clamp(0.0, 1.0) * 1e6) as u32)
}

/// The turn to place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnView {
    /// Prompt tokens of this turn.
    pub prompt_tokens: u64,
    /// Tokens of it that the previous turn's D holds (the prefix check
    /// passed); 0 when nothing can be reused.
    pub reusable_tokens: u64,
    /// Registry index of that D (`None` when nothing can be reused).
    pub prev_decode: Option<u16>,
}

/// Why P, D and pull-vs-recompute were chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectReason {
    /// Policy `round_robin`.
    RoundRobin,
    /// Lowest predicted TTFT, pulling the prefix.
    PredictedPull,
    /// Lowest predicted TTFT, recomputing (or nothing to reuse).
    PredictedRecompute,
    /// Policy `predicted_ttft` without the models to predict: round robin
    /// and the threshold rule.
    FallbackNoModel,
}

impl SelectReason {
    /// Every reason (metrics pre-registration).
    pub const ALL: [SelectReason; 4] = [
        SelectReason::RoundRobin,
        SelectReason::PredictedPull,
        SelectReason::PredictedRecompute,
        SelectReason::FallbackNoModel,
    ];

    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            SelectReason::RoundRobin => "round_robin",
            SelectReason::PredictedPull => "predicted_pull",
            SelectReason::PredictedRecompute => "predicted_recompute",
            SelectReason::FallbackNoModel => "fallback_no_model",
        }
    }
}

/// One predicted option.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Prefill engine (registry index).
    pub prefill: u16,
    /// Pull the reusable prefix (else recompute it).
    pub pull: bool,
    /// Predicted TTFT, ms (`queue_ms + reuse_ms + suffix_ms`).
    pub ttft_ms: f64,
    /// Waiting behind P's outstanding prefills, ms.
    pub queue_ms: f64,
    /// Pulling or recomputing the reusable prefix, ms.
    pub reuse_ms: f64,
    /// Computing the new suffix, ms.
    pub suffix_ms: f64,
    /// A pull whose READ P's agent abandons when it turns out slow (the
    /// model's `abandons_slow_reads`): when the router foresees the cut
    /// (`kvloop_router_api::abandon::foreseen_abandon_ms`), and P's compute
    /// of the whole prompt after it ([`load::LoadBook::begin_prefill`]).
    pub abandon: Option<load::Abandon>,
    /// A pull whose READ's end P's agent tells the routers (the model's
    /// `notices_read_pulls`): the load book counts it in P's compute line
    /// from that notice on ([`load::Pull::read_noticed`]).
    pub read_noticed: bool,
}

impl Prediction {
    /// What this option holds P's compute for, ms: the suffix, plus the
    /// prefix when it is recomputed (a pull's READ happens before P
    /// schedules the request and does not hold P).
    pub fn compute_ms(&self) -> f64 {
        self.suffix_ms + if self.pull { 0.0 } else { self.reuse_ms }
    }
}

/// The outcome for one turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    /// Prefill engine (registry index).
    pub prefill: u16,
    /// Decode engine (registry index).
    pub decode: u16,
    /// Attach the previous D's params (pull) rather than recompute.
    pub pull: bool,
    /// Why.
    pub reason: SelectReason,
    /// The chosen option's prediction (predicted reasons only).
    pub chosen: Option<Prediction>,
    /// The best option not chosen (predicted reasons, ≥ 2 options).
    pub runner_up: Option<Prediction>,
}

/// No healthy engine of a role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no healthy {role} engine")]
pub struct NoHealthy {
    /// `prefill` or `decode`.
    pub role: &'static str,
}

/// First healthy engine in round-robin order from `rr`.
fn round_robin<T>(v: &[T], rr: u64, healthy: impl Fn(&T) -> bool) -> Option<&T> {
    let n = v.len();
    (0..n)
        .map(|k| &v[((rr as usize) % n.max(1) + k) % n])
        .find(|e| healthy(e))
}

/// Position of `e` in round-robin order from `rr` (tie-breaker).
fn rr_rank(pos: usize, n: usize, rr: u64) -> usize {
    (pos + n - (rr as usize) % n) % n
}

/// Lowest model confidence the selection predicts with. Below the
/// threshold rule's [`crate::thresholds::MIN_MODEL_CONFIDENCE`]: comparing options only needs
/// the model to rank them, and on a busy node a path's READ times scatter
/// (the agent's confidence falls with residual noise) while its cost still
/// differs from the others' by orders of magnitude; below this floor the
/// turn falls back to round robin and the threshold rule.
pub const SELECT_MIN_CONFIDENCE: f64 = 0.2;

fn valid(m: &Option<CostModelCoefficients>) -> Option<&CostModelCoefficients> {
    m.as_ref().filter(|m| m.confidence >= SELECT_MIN_CONFIDENCE)
}

/// D by load (see the module docs).
fn pick_decode(decode: &[DecodeView], rr: u64) -> Option<u16> {
    let n = decode.len();
    decode
        .iter()
        .enumerate()
        .filter(|(_, d)| d.healthy)
        .min_by_key(|(i, d)| {
            (
                d.kv_usage.is_some_and(|u| u >= FULL_KV_USAGE),
                d.inflight_streams,
                usage_rank(d.kv_usage),
                rr_rank(*i, n, rr),
            )
        })
        .map(|(_, d)| d.index)
}

/// Choose P, D and pull-vs-recompute for one turn.
///
/// `pair(p, d)` is the threshold and model in force for that pair (registry
/// indices; the caller evaluates validity at its `now`). `rr` is the
/// caller's round-robin counter for this turn.
///
/// # Errors
/// [`NoHealthy`] when no prefill or no decode engine is healthy.
pub fn select(
    policy: Policy,
    prefill: &[PrefillView],
    decode: &[DecodeView],
    turn: &TurnView,
    pair: impl Fn(u16, u16) -> Effective,
    rr: u64,
) -> Result<Selection, NoHealthy> {
    let rr_p = round_robin(prefill, rr, |p| p.healthy)
        .ok_or(NoHealthy { role: "prefill" })?
        .index;
    let rr_d = round_robin(decode, rr, |d| d.healthy)
        .ok_or(NoHealthy { role: "decode" })?
        .index;
    let r = turn.reusable_tokens.min(turn.prompt_tokens);
    let prev = turn.prev_decode.filter(|_| r > 0);
    let fallback = |reason| {
        let pull = prev.is_some_and(|d| pair(rr_p, d).should_pull(r));
        Selection {
            prefill: rr_p,
            decode: rr_d,
            pull,
            reason,
            chosen: None,
            runner_up: None,
        }
    };
    if policy == Policy::RoundRobin {
        return Ok(fallback(SelectReason::RoundRobin));
    }
    let decode_pick = pick_decode(decode, rr).expect("a healthy decode engine exists");
    let n_p = prefill.len();
    let mut options: Vec<(Prediction, usize)> = Vec::new();
    let mut pull_paths = 0usize;
    // Per healthy P, once: the (P, previous D) path model, and P's compute
    // model (that pair's, else any pair of P's).
    let models: Vec<_> = prefill
        .iter()
        .enumerate()
        .filter(|(_, p)| p.healthy)
        .map(|(pos, p)| {
            let pull_model = prev.and_then(|d| valid(&pair(p.index, d).model).cloned());
            let compute = pull_model.clone().or_else(|| {
                decode
                    .iter()
                    .find_map(|d| valid(&pair(p.index, d.index).model).cloned())
            });
            (pos, p, pull_model, compute)
        })
        .collect();
    // A P whose agent's models all lapsed or lost confidence for a moment
    // borrows another healthy P's (one pool serves one model), with its own
    // measured cost per token where the router has one, rather than the
    // whole turn falling back to round robin: that sent half the turns to
    // the busier P in `make demo-cluster`.
    let Some(borrowed) = models.iter().find_map(|m| m.3.clone()) else {
        return Ok(fallback(SelectReason::FallbackNoModel));
    };
    for (pos, p, pull_model, compute) in models {
        let m = compute.unwrap_or_else(|| CostModelCoefficients {
            prefill_ms_per_token: p
                .measured_ms_per_token
                .unwrap_or(borrowed.prefill_ms_per_token),
            ..borrowed.clone()
        });
        // A P without a valid model of the path from the previous D keeps
        // its recompute option; the turn falls back only when no P has one
        // (below).
        pull_paths += usize::from(pull_model.is_some());
        let (a, b) = (m.prefill_ms_per_token, m.prefill_ms_per_token_ctx);
        let per_token = p.measured_ms_per_token.unwrap_or(a);
        // The larger of this replica's own count and the engine's report
        // (which also holds other replicas' requests, but lags).
        let queue_ms = p
            .queue_ms
            .unwrap_or(p.outstanding_tokens as f64 * per_token);
        let rf = r as f64;
        let s = (turn.prompt_tokens - r) as f64;
        let suffix_ms = s * (a + b * (rf + s / 2.0));
        let mut push = |pull: bool, reuse_ms: f64, abandon: Option<load::Abandon>| {
            options.push((
                Prediction {
                    prefill: p.index,
                    pull,
                    ttft_ms: queue_ms + reuse_ms + suffix_ms,
                    queue_ms,
                    reuse_ms,
                    suffix_ms,
                    abandon,
                    read_noticed: pull && pull_model.as_ref().is_some_and(|x| x.notices_read_pulls),
                },
                rr_rank(pos, n_p, rr),
            ));
        };
        let recompute_ms = rf * (a + b * rf / 2.0);
        push(false, recompute_ms, None);
        if let Some(x) = &pull_model {
            let read_ms = x.xfer_ms(rf);
            let abandon = x
                .abandons_slow_reads
                .then(|| foreseen_abandon_ms(Some(read_ms), Some(recompute_ms)))
                .flatten()
                .map(|after_ms| load::Abandon {
                    after_ms,
                    compute_ms: recompute_ms + suffix_ms,
                    read_ms,
                    noticed: x.notices_abandoned_pulls,
                });
            push(true, read_ms, abandon);
        }
    }
    if prev.is_some() && pull_paths == 0 {
        // Something to pull and no path model to cost it with.
        return Ok(fallback(SelectReason::FallbackNoModel));
    }
    options.sort_by(|(x, rx), (y, ry)| {
        x.ttft_ms
            .total_cmp(&y.ttft_ms)
            .then(x.queue_ms.total_cmp(&y.queue_ms))
            .then(rx.cmp(ry))
            // equal predictions on one P: recompute (moves no bytes)
            .then(x.pull.cmp(&y.pull))
    });
    let best = options[0].0;
    Ok(Selection {
        prefill: best.prefill,
        decode: decode_pick,
        pull: best.pull,
        reason: if best.pull {
            SelectReason::PredictedPull
        } else {
            SelectReason::PredictedRecompute
        },
        chosen: Some(best),
        runner_up: options.get(1).map(|o| o.0),
    })
}

#[cfg(test)]
mod tests;
