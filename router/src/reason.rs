//! Why a request was or was not given D's params: the label of
//! `kvloop_router_decisions_total` (pure, no dependencies, so the metrics
//! can pre-register every reason).

/// Why a request was or was not given D's params.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// D's params attached: P READs the reusable tokens.
    Pulled,
    /// Reusable tokens below the pair's threshold (or the cost model says recompute).
    RecomputedBelowThreshold,
    /// The stored entry's TTL had passed.
    Expired,
    /// The new prompt does not token-extend what D holds, is shorter than
    /// `remote_num_tokens`, or cannot be compared.
    PrefixMismatch,
    /// Nothing stored for this conversation (or no conversation id).
    NoEntry,
}

impl Reason {
    /// Every reason, for metric pre-registration.
    pub const ALL: [Reason; 5] = [
        Reason::Pulled,
        Reason::RecomputedBelowThreshold,
        Reason::Expired,
        Reason::PrefixMismatch,
        Reason::NoEntry,
    ];

    /// Metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Pulled => "pulled",
            Reason::RecomputedBelowThreshold => "recomputed_below_threshold",
            Reason::Expired => "expired",
            Reason::PrefixMismatch => "prefix_mismatch",
            Reason::NoEntry => "no_entry",
        }
    }
}
