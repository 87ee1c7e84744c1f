//! How long D keeps a finished turn's blocks: the first lease, and whether
//! to renew it when it ends. Pure; time and D's KV pressure are inputs.
use serde::{Deserialize, Serialize};

use crate::gaps::GapHistogram;

/// Which retention the router applies to D's holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetentionMode {
    /// vLLM's behaviour: D keeps every hold for its fixed TTL
    /// (`decoder_kv_blocks_ttl`, 480 s); the router never tells D.
    Fixed,
    /// Fixed TTL, but a hold the router knows is useless (replaced,
    /// consumed by a recompute, prefix mismatch, evicted, expired, the
    /// conversation deleted) is released at once.
    EarlyRelease,
    /// Early release, and each hold's lease sized from the measured gaps
    /// and renewed while the expected TTFT saved exceeds the cost of the
    /// blocks under D's KV pressure.
    #[default]
    Adaptive,
}

/// Retention policy bounds. Defaults in brackets.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// `fixed`, `early_release` or `adaptive` [adaptive].
    pub mode: RetentionMode,
    /// The cap of any hold from its turn's end, ms [480000: vLLM's
    /// `decoder_kv_blocks_ttl` default]. Fixed mode's TTL.
    pub max_hold_ms: u64,
    /// Shortest lease, ms [5000].
    pub min_lease_ms: u64,
    /// A first lease covers this quantile of the tenant's gaps [0.9].
    pub gap_quantile: f64,
    /// A conversation with a previous gap `g` gets a first lease of
    /// `g × conversation_gap_factor` [2.0].
    pub conversation_gap_factor: f64,
    /// Observations of a tenant before its gaps size leases [20]; until
    /// then a hold is kept for `max_hold_ms` (and renewals are not asked).
    pub min_gap_samples: u64,
    /// TTFT milliseconds that one block held for one second costs when D's
    /// KV cache is half full [0.0005]. The cost scales with
    /// `usage / (1 − usage)`: free at an empty cache, 1× at 50 %, 9× at
    /// 90 %. It stands for the batch slots the held blocks take from new
    /// requests; tune it with the retention bench
    /// (`cargo bench -p kvloop-retention`).
    pub block_second_cost_ms: f64,
    /// D's KV usage assumed when the engine reports none (0..1) [0.5].
    pub default_kv_usage: f64,
    /// Recompute cost per token on P, ms, used for the TTFT a hold saves
    /// when the pair has no pushed cost model [0.032: Qwen3-32B on H200
    /// recomputes 24,000 tokens in about 758 ms past its fixed cost, the
    /// published OFF TTFT behind `kvloop-engine-sim`'s `qwen3-32b-h200`
    /// profile (tools/engine-sim/src/profile.rs)].
    pub prefill_ms_per_token: f64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            mode: RetentionMode::default(),
            max_hold_ms: 480_000,
            min_lease_ms: 5_000,
            gap_quantile: 0.9,
            conversation_gap_factor: 2.0,
            min_gap_samples: 20,
            block_second_cost_ms: 0.0005,
            default_kv_usage: 0.5,
            prefill_ms_per_token: 0.032,
        }
    }
}

impl RetentionConfig {
    /// Checks the bounds.
    ///
    /// # Errors
    /// A message naming the bad field and what was expected.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_hold_ms == 0 {
            return Err("retention.max_hold_ms: expected > 0".into());
        }
        if self.min_lease_ms == 0 || self.min_lease_ms > self.max_hold_ms {
            return Err(format!(
                "retention.min_lease_ms: expected 1..={} (max_hold_ms), got {}",
                self.max_hold_ms, self.min_lease_ms
            ));
        }
        if !(self.gap_quantile > 0.0 && self.gap_quantile <= 1.0) {
            return Err(format!(
                "retention.gap_quantile: expected in (0, 1], got {}",
                self.gap_quantile
            ));
        }
        if !(self.conversation_gap_factor >= 1.0 && self.conversation_gap_factor.is_finite()) {
            return Err(format!(
                "retention.conversation_gap_factor: expected ≥ 1, got {}",
                self.conversation_gap_factor
            ));
        }
        if !(self.block_second_cost_ms >= 0.0 && self.block_second_cost_ms.is_finite()) {
            return Err(format!(
                "retention.block_second_cost_ms: expected ≥ 0, got {}",
                self.block_second_cost_ms
            ));
        }
        if !(self.prefill_ms_per_token >= 0.0 && self.prefill_ms_per_token.is_finite()) {
            return Err(format!(
                "retention.prefill_ms_per_token: expected ≥ 0, got {}",
                self.prefill_ms_per_token
            ));
        }
        if !(0.0..1.0).contains(&self.default_kv_usage) {
            return Err(format!(
                "retention.default_kv_usage: expected in [0, 1), got {}",
                self.default_kv_usage
            ));
        }
        Ok(())
    }
}

/// What the policy knows of one hold when it decides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HoldFacts {
    /// Since its turn was stored, ms.
    pub elapsed_ms: u64,
    /// Blocks D holds for it.
    pub blocks: u64,
    /// TTFT saved when the next turn READs instead of recomputing, ms.
    pub saved_ms: f64,
    /// D's KV cache usage (0..1), when the engine reports it.
    pub kv_usage: Option<f64>,
    /// The conversation's previous inter-turn gap, ms, once it has one.
    pub conversation_gap_ms: Option<u64>,
}

/// Why a lease was given, renewed or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetentionReason {
    /// Fixed or early-release mode: the whole cap.
    Fixed,
    /// Too few gaps observed for the tenant: the whole cap.
    NoHistory,
    /// Sized from the tenant's gap quantile.
    TenantGaps,
    /// Sized from the conversation's own previous gap.
    ConversationGap,
    /// Renewed: the expected TTFT saved exceeds the blocks' cost.
    Worth,
    /// Not renewed: the blocks cost more than the TTFT they may save.
    NotWorth,
    /// Not renewed: the cap is reached.
    Cap,
}

impl RetentionReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::NoHistory => "no_history",
            Self::TenantGaps => "tenant_gaps",
            Self::ConversationGap => "conversation_gap",
            Self::Worth => "worth",
            Self::NotWorth => "not_worth",
            Self::Cap => "cap",
        }
    }
}

/// A decision on a hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    /// Keep the blocks readable for this long from now, ms; 0: release.
    pub keep_ms: u64,
    /// Why.
    pub reason: RetentionReason,
    /// Expected TTFT saved over the window, ms (renewals; 0 otherwise).
    pub value_ms: f64,
    /// Cost of the blocks over the window, ms (renewals; 0 otherwise).
    pub cost_ms: f64,
}

impl Verdict {
    fn keep(keep_ms: u64, reason: RetentionReason) -> Self {
        Self {
            keep_ms,
            reason,
            value_ms: 0.0,
            cost_ms: 0.0,
        }
    }
    /// Whether the blocks are released.
    pub fn releases(&self) -> bool {
        self.keep_ms == 0
    }
}

/// The policy (a [`RetentionConfig`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RetentionPolicy {
    cfg: RetentionConfig,
}

impl RetentionPolicy {
    /// The policy of `cfg` (validate it first).
    pub fn new(cfg: RetentionConfig) -> Self {
        Self { cfg }
    }

    /// Its bounds.
    pub fn config(&self) -> &RetentionConfig {
        &self.cfg
    }

    /// Whether D is told about useless holds (every mode but `fixed`).
    pub fn releases_early(&self) -> bool {
        self.cfg.mode != RetentionMode::Fixed
    }

    /// The first lease of a hold just stored (`facts.elapsed_ms` = 0).
    pub fn first_lease(&self, gaps: &GapHistogram, facts: &HoldFacts) -> Verdict {
        let c = &self.cfg;
        if c.mode != RetentionMode::Adaptive {
            return Verdict::keep(c.max_hold_ms, RetentionReason::Fixed);
        }
        if gaps.samples() < c.min_gap_samples {
            return Verdict::keep(c.max_hold_ms, RetentionReason::NoHistory);
        }
        let (want, reason) = match facts.conversation_gap_ms {
            Some(g) => (
                g as f64 * c.conversation_gap_factor,
                RetentionReason::ConversationGap,
            ),
            None => match gaps.quantile_ms(c.gap_quantile) {
                Some(q) => (q, RetentionReason::TenantGaps),
                // Nobody came back yet: the shortest lease.
                None => (0.0, RetentionReason::TenantGaps),
            },
        };
        let keep = (want.ceil() as u64).clamp(c.min_lease_ms, c.max_hold_ms);
        Verdict::keep(keep, reason)
    }

    /// At the end of a lease (`facts.elapsed_ms` since the turn was
    /// stored): renew for a window as long as the time already waited
    /// (at least `min_lease_ms`, at most up to the cap) when the expected
    /// TTFT saved, `P(next turn in the window | none yet) × saved_ms`,
    /// is at least the blocks' cost, `blocks × window_s ×
    /// block_second_cost_ms × u / (1 − u)` at D's KV usage `u`.
    pub fn renew(&self, gaps: &GapHistogram, facts: &HoldFacts) -> Verdict {
        let c = &self.cfg;
        let left = c.max_hold_ms.saturating_sub(facts.elapsed_ms);
        if c.mode != RetentionMode::Adaptive || left == 0 {
            return Verdict::keep(0, RetentionReason::Cap);
        }
        let window = facts.elapsed_ms.max(c.min_lease_ms).min(left);
        let Some(p) = gaps.p_next_within(facts.elapsed_ms, window) else {
            return Verdict::keep(left, RetentionReason::NoHistory);
        };
        let u = facts
            .kv_usage
            .unwrap_or(c.default_kv_usage)
            .clamp(0.0, 0.95);
        let value_ms = p * facts.saved_ms.max(0.0);
        let cost_ms =
            facts.blocks as f64 * (window as f64 / 1000.0) * c.block_second_cost_ms * u / (1.0 - u);
        let reason = if value_ms >= cost_ms && value_ms > 0.0 {
            RetentionReason::Worth
        } else {
            RetentionReason::NotWorth
        };
        Verdict {
            keep_ms: if reason == RetentionReason::Worth {
                window
            } else {
                0
            },
            reason,
            value_ms,
            cost_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(elapsed_ms: u64) -> HoldFacts {
        HoldFacts {
            elapsed_ms,
            blocks: 100,
            saved_ms: 200.0,
            kv_usage: Some(0.5),
            conversation_gap_ms: None,
        }
    }

    fn agentic() -> GapHistogram {
        let mut h = GapHistogram::new(1.0);
        for i in 0..90 {
            h.record_gap(1_000 + i * 20);
        }
        for _ in 0..10 {
            h.record_abandoned();
        }
        h
    }

    #[test]
    fn fixed_keeps_the_cap_and_never_renews() {
        let p = RetentionPolicy::new(RetentionConfig {
            mode: RetentionMode::Fixed,
            ..Default::default()
        });
        assert_eq!(p.first_lease(&agentic(), &facts(0)).keep_ms, 480_000);
        assert!(p.renew(&agentic(), &facts(480_000)).releases());
        assert!(!p.releases_early());
    }

    #[test]
    fn without_history_the_cap_is_kept() {
        let p = RetentionPolicy::default();
        let v = p.first_lease(&GapHistogram::default(), &facts(0));
        assert_eq!((v.keep_ms, v.reason), (480_000, RetentionReason::NoHistory));
    }

    #[test]
    fn first_lease_follows_the_tenant_then_the_conversation() {
        let p = RetentionPolicy::default();
        let v = p.first_lease(&agentic(), &facts(0));
        assert_eq!(v.reason, RetentionReason::TenantGaps);
        // The 0.9-quantile of 1.0–2.8 s gaps, floored at min_lease_ms.
        assert_eq!(v.keep_ms, 5_000);
        let mut f = facts(0);
        f.conversation_gap_ms = Some(40_000);
        let v = p.first_lease(&agentic(), &f);
        assert_eq!(
            (v.keep_ms, v.reason),
            (80_000, RetentionReason::ConversationGap)
        );
        f.conversation_gap_ms = Some(400_000);
        assert_eq!(p.first_lease(&agentic(), &f).keep_ms, 480_000);
    }

    #[test]
    fn renewal_stops_once_the_gaps_say_nobody_comes_back() {
        let p = RetentionPolicy::default();
        // Right after most turns would have come back: some hope is left.
        let v = p.renew(&agentic(), &facts(1_500));
        assert_eq!(v.reason, RetentionReason::Worth, "{v:?}");
        assert_eq!(v.keep_ms, 5_000);
        // Past every observed gap: only abandons are left.
        let v = p.renew(&agentic(), &facts(10_000));
        assert!(v.releases(), "{v:?}");
        assert_eq!(v.reason, RetentionReason::NotWorth);
    }

    #[test]
    fn pressure_raises_the_cost() {
        let p = RetentionPolicy::default();
        let mut f = facts(1_500);
        f.kv_usage = Some(0.0);
        assert_eq!(p.renew(&agentic(), &f).cost_ms, 0.0);
        f.kv_usage = Some(0.95);
        f.blocks = 100_000;
        assert!(p.renew(&agentic(), &f).releases());
    }

    #[test]
    fn the_cap_bounds_every_renewal() {
        let p = RetentionPolicy::default();
        let mut h = GapHistogram::new(1.0);
        for _ in 0..100 {
            h.record_gap(470_000);
        }
        let v = p.renew(&h, &facts(400_000));
        assert_eq!(v.keep_ms, 80_000);
        assert!(p.renew(&h, &facts(480_000)).releases());
    }

    #[test]
    fn bad_bounds_name_the_field() {
        let c = RetentionConfig {
            gap_quantile: 1.5,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("gap_quantile"));
        let c = RetentionConfig {
            min_lease_ms: 0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("min_lease_ms"));
        assert!(RetentionConfig::default().validate().is_ok());
    }
}
