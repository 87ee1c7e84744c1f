//! Sans-IO transfer/prefill cost model and adaptive recompute threshold of
//! the kvloop agent (issue 5, item 5).
//!
//! Pure code in the style of quinn-proto: no I/O, no threads, no clock. The
//! driver (the agent) feeds samples, calls [`CostModel::update`] with its own
//! time ([`Instant`], nanoseconds since any epoch) at [`CostModel::poll_timeout`],
//! and reads thresholds ([`CostModel::pair_thresholds`], which map one-to-one
//! to `kvloop_router_api::PairThreshold`) and explanations
//! ([`CostModel::explain`]).
//!
//! Models:
//! - transfer, per (peer, [`Direction`]):
//!   `t_xfer_ms(bytes, descriptors) = a + bytes/B + c·descriptors`;
//! - prefill, per local prefill engine:
//!   `t_prefill_ms(n, ctx) = p0 + n·(k1 + k2·(ctx + n/2))`, `n` computed tokens;
//! - break-even per (P, D) pair: the reusable tokens `R*` at which READing
//!   them (`bytes = R·bytes_per_token`, `descriptors = ceil(R/block)·regions`)
//!   costs as much as recomputing them (`R·(k1 + k2·R/2)`).
//!
//! ```
//! use kvloop_costmodel::*;
//! use std::time::Duration;
//!
//! let mut m = CostModel::new(CostModelConfig::default()).unwrap();
//! m.upsert_pair(PairSpec {
//!     prefill_engine_id: "p0".into(),
//!     decode_engine_id: "d0".into(),
//!     decode_peer: "node-d".into(),
//!     shape: KvShape { bytes_per_token: 262_144, block_size_tokens: 16, regions_per_block: 128 },
//! })
//! .unwrap();
//! for i in 0..40u64 {
//!     let at = Instant::from_millis(i * 250);
//!     let blocks = [1, 64, 8, 256][i as usize % 4];
//!     let bytes = blocks * 16 * 262_144;
//!     // 10 ms fixed + 12.5 GB/s.
//!     let latency = Duration::from_secs_f64(0.010 + bytes as f64 / 12.5e9);
//!     let s = TransferSample { at, bytes, descriptors: blocks * 128, latency, source: SampleSource::ActiveProbe };
//!     m.record_transfer("node-d", Direction::Inbound, s).unwrap();
//!     let prompt = 256 << (i % 6);
//!     let latency = Duration::from_secs_f64((5.0 + prompt as f64 * 0.16) / 1e3);
//!     let s = PrefillSample { at, prompt_tokens: prompt, reused_tokens: 0, latency, source: SampleSource::Ebpf };
//!     m.record_prefill("p0", s).unwrap();
//!     m.update(at);
//! }
//! // 10 ms / (0.16 − 0.021) ms per token ≈ 72 tokens.
//! let t = m.threshold_tokens("p0", "d0").unwrap();
//! assert!((65..80).contains(&t), "{t}");
//! let push = m.pair_thresholds(Duration::from_secs(15)); // → ThresholdUpdate::pairs
//! assert_eq!(push[0].threshold_tokens, t);
//! println!("{}", m.explain("p0", "d0", Instant::from_millis(10_000)).unwrap());
//! ```
//!
//! Both fits are robust, time-decayed, relative-error IRLS (Huber then
//! Tukey bisquare; see the `fit` module for why), with sample weights
//! `2^(-age / half_life)` (the time decay of linkerd2-proxy's EWMA, applied
//! to a regression instead of a mean) and a CUSUM change detector that drops
//! the samples of a previous regime. The published threshold has hysteresis
//! (a band from the break-even's standard error, a dwell time), bounds and a
//! confidence (see the `threshold` module for the policy and its reasons).
//!
//! ## Threshold policy
//!
//! - Before a pair's first confident estimate: the static default (vLLM's 64
//!   tokens), which is what a router would use anyway.
//! - The first estimate with confidence ≥ `min_confidence` is published at
//!   once (64 is known to be far from typical break-evens).
//! - Then the threshold moves only when the estimate stays outside
//!   `published × (1 ± band)` for `dwell_ms`, with
//!   `band = max(band_rel, band_sigmas × se) / confidence` (capped at
//!   `max_band_rel`), `se` the break-even's relative standard error (delta
//!   method from the fits' covariances). Few, old or noisy samples widen it.
//! - Refinement: once the standard error has fallen by `refine_se_factor`
//!   since the last publish, an estimate more than `max(refine_min_rel, 2 se)`
//!   away is published at once (bounded: precision cannot keep improving).
//! - Regime change: the CUSUM detector of a model (a persistent shift of new
//!   samples against the fit) drops the old regime's samples and lets the
//!   pair follow the new regime's first confident estimate at once.
//! - Low confidence (few or old samples): the threshold **holds the last good
//!   value**, not the static 64. The last good value was measured on this
//!   pair, 64 never was; a stale value errs by the drift since, 64 by the whole
//!   break-even. The low confidence travels with the coefficients, and the
//!   push's `valid_for_ms` bounds how long a router trusts it.
//! - A path invalidated by the network state (`invalidate_peer`, link down)
//!   publishes `max_threshold_tokens` (recompute) at once.
//!
//! ## Confidence
//!
//! Per model: `n/(n + confidence_half_samples)` (Kish effective sample count
//! of the inliers) × `2^(−age of newest sample / staleness_half_life)` ×
//! a penalty when a coefficient is fixed at its prior (0.5 for the
//! bandwidth or the linear prefill cost, 0.8 for the attention cost;
//! `(1 + penalty)/2` when fixed at a last good value) × `1/(1 + (residual/0.5)²)`. Per pair: the
//! minimum of its transfer and prefill models.
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// `!(x > 0.0)` is used on purpose: it is true for NaN, which must take the
// same branch as a non-positive value.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod breakeven;
mod config;
mod fit;
mod model;
mod push;
mod samples;
mod threshold;
mod time;

pub use breakeven::{
    KvShape, PrefillCoefficients, TransferCoefficients, break_even_se_tokens, break_even_tokens,
    clamp_threshold, router_coefficients,
};
pub use config::{ConfigError, CostModelConfig, SourceWeights, VLLM_STATIC_THRESHOLD_TOKENS};
pub use kvloop_router_api::{CostModelCoefficients, PairThreshold};
pub use model::{CostModel, Explain, FitSummary, PairChange, PairSpec, PrefillFit, TransferFit};
pub use push::{URGENT_FACTOR, URGENT_REF_TOKENS, UrgentReason, urgent_push};
pub use samples::{
    ChangePoint, Direction, PrefillSample, SampleError, SampleSource, SourceStats, TransferSample,
};
pub use threshold::{CauseKind, ChangeReason, PendingMove, ThresholdChange, ThresholdState};
pub use time::Instant;
