//! Decode-side retention of finished turns' KV blocks (issue 15): how long
//! D keeps a turn's blocks for the conversation's next turn.
//!
//! vLLM's D keeps every finished request's blocks for a fixed
//! `decoder_kv_blocks_ttl` (480 s). kvloop's router instead
//! - releases a hold as soon as it knows nobody will READ it
//!   ([`RetentionMode::EarlyRelease`]);
//! - sizes each hold's first lease from the measured inter-turn gaps of
//!   its tenant ([`GapHistogram`], per [`GapBook`] tenant) or of its own
//!   conversation, and renews it while the expected TTFT saved exceeds
//!   what the blocks cost under D's KV pressure
//!   ([`RetentionPolicy::renew`]), never beyond `max_hold_ms`
//!   ([`RetentionMode::Adaptive`]).
//!
//! Pure code: time (`elapsed_ms`) and D's KV usage are inputs. The router
//! (`router/src/retention.rs`) drives it and tells the agents; the
//! retention bench (`benches/retention_bench.rs`) compares the modes.
#![forbid(unsafe_code)]

pub mod gaps;
pub mod policy;

use std::collections::BTreeMap;

pub use gaps::GapHistogram;
pub use policy::{
    HoldFacts, RetentionConfig, RetentionMode, RetentionPolicy, RetentionReason, Verdict,
};

/// Most tenants tracked; beyond, new tenants share one histogram
/// (the key `""`), so memory stays bounded.
pub const MAX_TENANTS: usize = 4096;

/// The gap histograms of every tenant.
#[derive(Clone, Debug, Default)]
pub struct GapBook {
    tenants: BTreeMap<String, GapHistogram>,
    /// What an unseen tenant reads.
    empty: GapHistogram,
}

impl GapBook {
    fn slot(&mut self, tenant: &str) -> &mut GapHistogram {
        if !self.tenants.contains_key(tenant) && self.tenants.len() >= MAX_TENANTS {
            return self.tenants.entry(String::new()).or_default();
        }
        self.tenants.entry(tenant.to_string()).or_default()
    }

    /// The tenant's histogram (the shared overflow one, or an empty one,
    /// when unseen).
    pub fn get(&self, tenant: &str) -> &GapHistogram {
        self.tenants
            .get(tenant)
            .or_else(|| self.tenants.get(""))
            .unwrap_or(&self.empty)
    }

    /// A next turn of `tenant` came `gap_ms` after its previous one.
    pub fn record_gap(&mut self, tenant: &str, gap_ms: u64) {
        self.slot(tenant).record_gap(gap_ms);
    }

    /// A stored turn of `tenant` was not followed within the cap.
    pub fn record_abandoned(&mut self, tenant: &str) {
        self.slot(tenant).record_abandoned();
    }

    /// Every tenant tracked with its histogram (`""`: the shared overflow
    /// one), in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &GapHistogram)> {
        self.tenants.iter().map(|(t, h)| (t.as_str(), h))
    }

    /// Tenants tracked.
    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    /// Whether no tenant is tracked.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_separate_and_bounded() {
        let mut b = GapBook::default();
        b.record_gap("a", 1000);
        assert_eq!(b.get("a").samples(), 1);
        assert_eq!(b.get("b").samples(), 0);
        for i in 0..(MAX_TENANTS + 10) {
            b.record_gap(&format!("t{i}"), 5);
        }
        assert!(b.len() <= MAX_TENANTS + 1);
    }
}
