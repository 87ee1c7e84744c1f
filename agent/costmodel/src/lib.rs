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
//! Both fits are robust, time-decayed, relative-error IRLS (Huber then
//! Tukey bisquare; see the `fit` module for why). The published threshold has
//! hysteresis, bounds and a confidence (see the `threshold` module for the
//! policy and its reasons).
#![deny(missing_docs)]
// `!(x > 0.0)` is used on purpose: it is true for NaN, which must take the
// same branch as a non-positive value.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod breakeven;
mod config;
mod fit;
mod model;
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
pub use samples::{
    ChangePoint, Direction, PrefillSample, SampleError, SampleSource, SourceStats, TransferSample,
};
pub use threshold::{CauseKind, ChangeReason, PendingMove, ThresholdChange, ThresholdState};
pub use time::Instant;
