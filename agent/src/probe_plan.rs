//! Shapes of active probe READs (pure).
//!
//! A READ's cost depends on its descriptors as well as its bytes: vLLM
//! registers KV per layer and per K/V, so one block id of Qwen3-32B is 128
//! descriptors of 4 KiB at TP 8 (`docs/operator-guide.md`, "Active probes
//! follow the engines' layout"), where the configured probe layout is 2 descriptors of
//! 64 KiB. Probes shaped like the configured layout alone fit a bandwidth
//! that descriptor-bound READs never see. So, in managed mode, the agent
//! opens one more probe engine per distinct layout its engines register
//! (descriptors per block id, bytes per descriptor, tokens per block), and
//! probes a peer in every shape both sides have; the configured probe
//! engine serves peers that share none. This module decides those shapes;
//! the agent (`crate::agent`) starts the engines and the probe task
//! (`crate::tasks::probes`) reads with them.
use kvloop_dataplane::KvLayout;

use crate::config::ProbeConfig;

/// Most engine-shaped probe engines one agent opens (distinct layouts among
/// its registered engines; a node rarely hosts more than two models).
pub const MAX_ENGINE_SHAPES: usize = 4;

/// One probe engine's layout and the two READ sizes a probe round makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbePlan {
    /// The probe engine's layout.
    pub layout: KvLayout,
    /// Block ids in a small probe READ (≥ 1).
    pub small_blocks: u32,
    /// Block ids in a large probe READ (> `small_blocks`, ≤ `layout.num_blocks`).
    pub large_blocks: u32,
}

impl ProbePlan {
    /// The configured probe engine's plan (`[probe]` as written).
    pub fn configured(p: &ProbeConfig) -> Self {
        let layout = KvLayout {
            num_regions: p.num_regions,
            num_blocks: p.num_blocks,
            block_len_bytes: p.block_len_bytes,
            block_size_tokens: p.block_size_tokens,
        };
        Self {
            layout,
            small_blocks: p.small_blocks.max(1),
            large_blocks: p.large_blocks.min(p.num_blocks),
        }
    }

    /// A plan shaped like `engine` (its regions, block length and tokens per
    /// block) that moves about the configured plan's bytes: the large READ
    /// keeps the configured large READ's bytes (at least `small + 1` block
    /// ids, so the fit still tells fixed cost from bandwidth), and the
    /// engine's memory the configured one's (at least twice the large READ,
    /// so that rounds rotate over blocks nothing has cached).
    pub fn following(p: &ProbeConfig, engine: &KvLayout) -> Self {
        let cfg = Self::configured(p);
        let bpb = engine.bytes_per_block_id().max(1);
        let small_blocks = cfg.small_blocks;
        let large_bytes = cfg.large_blocks as u64 * cfg.layout.bytes_per_block_id();
        let large_blocks = ((large_bytes / bpb) as u32).max(small_blocks + 1);
        let memory = cfg.layout.num_blocks as u64 * cfg.layout.bytes_per_block_id();
        let num_blocks = ((memory / bpb) as u32).max(2 * large_blocks);
        Self {
            layout: KvLayout {
                num_regions: engine.num_regions,
                num_blocks,
                block_len_bytes: engine.block_len_bytes,
                block_size_tokens: engine.block_size_tokens,
            },
            small_blocks,
            large_blocks,
        }
    }

    /// Bytes one round (a small and a large READ) moves.
    pub fn round_bytes(&self) -> u64 {
        (self.small_blocks + self.large_blocks) as u64 * self.layout.bytes_per_block_id()
    }

    /// The shape's label in metrics and logs: `<descriptors per block
    /// id>x<bytes per descriptor>`, e.g. `128x4096`.
    pub fn shape_label(&self) -> String {
        shape_label(&self.layout)
    }
}

/// A probe READ this many times slower or faster than the path's fitted
/// model predicts is off the model: the peer is probed again at once
/// ([`confirm_again`]).
pub const CONFIRM_FACTOR: f64 = 2.0;

/// Most rounds a peer is probed again in a row, off the period, before an
/// on-model READ: with the round that raised the doubt, enough for the
/// change detector to decide. Its CUSUM gains at most 2.5 per sample (a
/// residual clipped at 3σ less the slack 0.5) and alarms above
/// `change_detect_threshold` (20 by default, `kvloop_costmodel`), so after
/// 9 samples far off; a round gives 2 (its small and its large READ).
/// Bounded by the peer's probe rate limit.
pub const MAX_CONFIRM_ROUNDS: u32 = 4;

/// Wait before a confirming round, ms: long enough for a READ on a fast
/// path to leave the queues, far below any probe period.
pub const CONFIRM_GAP_MS: u64 = 50;

/// Whether a probe READ that took `observed_ms` against the fitted model's
/// `predicted_ms` calls for another probe of the same peer before the next
/// period: off by [`CONFIRM_FACTOR`] either way. A degraded or restored
/// link is then found by the change detector within a few confirming
/// rounds (tens to hundreds of ms) instead of a few probe periods, which
/// is when the routers stop, or start again, pulling over it. Like BFD's
/// poll sequence (RFC 5880 §6.5): when something looks wrong, ask again
/// now rather than at the next interval. `false` without a prediction.
pub fn confirm_again(observed_ms: f64, predicted_ms: Option<f64>) -> bool {
    let Some(p) = predicted_ms.filter(|p| p.is_finite() && *p > 0.0) else {
        return false;
    };
    if !observed_ms.is_finite() || observed_ms <= 0.0 {
        return false;
    }
    let r = observed_ms / p;
    r >= CONFIRM_FACTOR || r <= 1.0 / CONFIRM_FACTOR
}

/// `<num_regions>x<block_len_bytes>` of a layout.
pub fn shape_label(l: &KvLayout) -> String {
    format!("{}x{}", l.num_regions, l.block_len_bytes)
}

/// Whether two layouts READ each other's blocks: the dataplane's own rule,
/// [`KvLayout::check_compatible`] (all fields but `num_blocks`).
pub fn same_shape(a: &KvLayout, b: &KvLayout) -> bool {
    a.check_compatible("", b).is_ok()
}

/// What the agent does with a newly registered engine's layout, given the
/// shapes it probes already (the configured one first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeDecision {
    /// Probes already have this shape.
    Known,
    /// Open a probe engine with this plan.
    Open(ProbePlan),
    /// [`MAX_ENGINE_SHAPES`] engine shapes are open already: not followed.
    TooMany,
}

/// Decides on `engine`'s layout; `engine_shapes` are the layouts of the
/// engine-shaped probe engines open now.
pub fn decide(p: &ProbeConfig, engine_shapes: &[KvLayout], engine: &KvLayout) -> ShapeDecision {
    let configured = ProbePlan::configured(p).layout;
    if same_shape(&configured, engine) || engine_shapes.iter().any(|s| same_shape(s, engine)) {
        ShapeDecision::Known
    } else if engine_shapes.len() >= MAX_ENGINE_SHAPES {
        ShapeDecision::TooMany
    } else {
        ShapeDecision::Open(ProbePlan::following(p, engine))
    }
}

/// The shapes to probe a peer in: every engine shape both sides have (in
/// `ours`' order); when they share none, the configured shape. `ours` and
/// `theirs` are layouts of engine-shaped probe engines. Returns indices
/// into `ours`, or `None` for the configured probe engine.
pub fn shapes_to_probe(ours: &[KvLayout], theirs: &[KvLayout]) -> Vec<Option<usize>> {
    let shared: Vec<Option<usize>> = ours
        .iter()
        .enumerate()
        .filter(|(_, o)| theirs.iter().any(|t| same_shape(o, t)))
        .map(|(i, _)| Some(i))
        .collect();
    if shared.is_empty() {
        vec![None]
    } else {
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(regions: u32, block_len: u64) -> KvLayout {
        KvLayout {
            num_regions: regions,
            num_blocks: 1000,
            block_len_bytes: block_len,
            block_size_tokens: 16,
        }
    }

    #[test]
    fn default_config_plan_is_two_64k_descriptors() {
        let p = ProbePlan::configured(&ProbeConfig::default());
        assert_eq!(p.shape_label(), "2x65536");
        assert_eq!((p.small_blocks, p.large_blocks), (1, 32));
        assert_eq!(p.round_bytes(), 33 * 2 * 65536);
    }

    #[test]
    fn qwen3_32b_tp8_plan_keeps_bytes_with_real_descriptors() {
        // Qwen3-32B at TP 8: 64 layers × K/V = 128 regions of 4 KiB per block id.
        let p = ProbePlan::following(&ProbeConfig::default(), &l(128, 4096));
        assert_eq!(p.shape_label(), "128x4096");
        assert_eq!(p.layout.bytes_per_block_id(), 512 << 10);
        // The configured large READ is 32 × 128 KiB = 4 MiB = 8 such block ids.
        assert_eq!((p.small_blocks, p.large_blocks), (1, 8));
        // The configured memory is 64 × 128 KiB = 8 MiB = 16 block ids.
        assert_eq!(p.layout.num_blocks, 16);
        assert_eq!(p.layout.block_size_tokens, 16);
    }

    #[test]
    fn huge_blocks_still_give_two_sizes_and_room_to_rotate() {
        // Qwen3-32B at TP 1: 128 × 32 KiB = 4 MiB per block id.
        let p = ProbePlan::following(&ProbeConfig::default(), &l(128, 32 << 10));
        assert_eq!((p.small_blocks, p.large_blocks), (1, 2));
        assert_eq!(p.layout.num_blocks, 4);
        assert!(p.large_blocks <= p.layout.num_blocks);
    }

    #[test]
    fn small_blocks_get_many_block_ids() {
        let p = ProbePlan::following(&ProbeConfig::default(), &l(4, 4096));
        assert_eq!(p.large_blocks, 256);
        assert_eq!(p.layout.num_blocks, 512);
    }

    #[test]
    fn decide_opens_each_new_shape_once_up_to_the_cap() {
        let cfg = ProbeConfig::default();
        let conf = ProbePlan::configured(&cfg).layout;
        assert_eq!(decide(&cfg, &[], &l(2, 65536)), ShapeDecision::Known);
        assert_eq!(decide(&cfg, &[conf], &conf), ShapeDecision::Known);
        let ShapeDecision::Open(p) = decide(&cfg, &[], &l(128, 4096)) else {
            panic!("a new shape opens");
        };
        assert_eq!(
            decide(&cfg, &[p.layout], &l(128, 4096)),
            ShapeDecision::Known
        );
        // num_blocks is not part of the shape.
        let mut other_blocks = l(128, 4096);
        other_blocks.num_blocks = 7;
        assert_eq!(
            decide(&cfg, &[p.layout], &other_blocks),
            ShapeDecision::Known
        );
        // Tokens per block are.
        let mut other_tokens = l(128, 4096);
        other_tokens.block_size_tokens = 32;
        assert!(matches!(
            decide(&cfg, &[p.layout], &other_tokens),
            ShapeDecision::Open(_)
        ));
        let full: Vec<KvLayout> = (0..MAX_ENGINE_SHAPES as u32)
            .map(|i| l(8 + i, 4096))
            .collect();
        assert_eq!(decide(&cfg, &full, &l(64, 4096)), ShapeDecision::TooMany);
    }

    #[test]
    fn probe_in_shared_shapes_else_the_configured_one() {
        let a = l(128, 4096);
        let b = l(64, 8192);
        assert_eq!(shapes_to_probe(&[], &[]), vec![None]);
        assert_eq!(shapes_to_probe(&[a], &[]), vec![None]);
        assert_eq!(shapes_to_probe(&[a], &[b]), vec![None]);
        assert_eq!(shapes_to_probe(&[a, b], &[b]), vec![Some(1)]);
        assert_eq!(shapes_to_probe(&[a, b], &[b, a]), vec![Some(0), Some(1)]);
    }

    #[test]
    fn a_read_off_the_model_either_way_is_confirmed_at_once() {
        // A link lowered to a tenth: 10× slower.
        assert!(confirm_again(100.0, Some(10.0)));
        // Restored: 10× faster than the slow model.
        assert!(confirm_again(10.0, Some(100.0)));
        // Exactly the factor either way counts.
        assert!(confirm_again(20.0, Some(10.0)));
        assert!(confirm_again(5.0, Some(10.0)));
        // Noise within the factor does not.
        assert!(!confirm_again(19.0, Some(10.0)));
        assert!(!confirm_again(6.0, Some(10.0)));
        // No fit yet, or nonsense: nothing to judge by.
        assert!(!confirm_again(100.0, None));
        assert!(!confirm_again(100.0, Some(0.0)));
        assert!(!confirm_again(f64::NAN, Some(10.0)));
        assert!(!confirm_again(0.0, Some(10.0)));
    }
}
