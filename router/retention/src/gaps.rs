//! The measured distribution of inter-turn gaps: a bcc-style log2
//! histogram of milliseconds with exponential decay, plus the
//! conversations that did not come back within the retention cap
//! (right-censored: their gap is "longer than the cap").
use serde::{Deserialize, Serialize};

/// Buckets: bucket 0 is `[0, 1)` ms, bucket `i ≥ 1` is `[2^(i-1), 2^i)` ms;
/// the last one also takes everything longer (2^31 ms ≈ 25 days).
pub const GAP_BUCKETS: usize = 32;

/// Log2 histogram of inter-turn gaps (ms) with decay.
///
/// Each observation first multiplies every count by `decay` (default
/// `1 − 1/2000`: the last ≈ 2,000 observations dominate, as
/// linkerd2-proxy's decayed EWMA forgets old latencies), so the
/// distribution follows a tenant whose behaviour changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GapHistogram {
    counts: [f64; GAP_BUCKETS],
    /// Conversations not back within the retention cap (weight, decayed).
    abandoned: f64,
    /// Observations, not decayed.
    samples: u64,
    decay: f64,
}

impl Default for GapHistogram {
    fn default() -> Self {
        Self::new(1.0 - 1.0 / 2000.0)
    }
}

fn bucket_of(gap_ms: u64) -> usize {
    ((u64::BITS - gap_ms.leading_zeros()) as usize).min(GAP_BUCKETS - 1)
}

/// `[lo, hi)` of bucket `i`, ms.
fn bounds(i: usize) -> (f64, f64) {
    if i == 0 {
        (0.0, 1.0)
    } else {
        ((1u64 << (i - 1)) as f64, (1u64 << i) as f64)
    }
}

impl GapHistogram {
    /// Empty, each observation decaying the older ones by `decay`
    /// (`0 < decay ≤ 1`; 1: no decay).
    pub fn new(decay: f64) -> Self {
        Self {
            counts: [0.0; GAP_BUCKETS],
            abandoned: 0.0,
            samples: 0,
            decay: decay.clamp(f64::MIN_POSITIVE, 1.0),
        }
    }

    fn age(&mut self) {
        for c in &mut self.counts {
            *c *= self.decay;
        }
        self.abandoned *= self.decay;
        self.samples += 1;
    }

    /// A next turn arrived `gap_ms` after the previous one was stored.
    pub fn record_gap(&mut self, gap_ms: u64) {
        self.age();
        self.counts[bucket_of(gap_ms)] += 1.0;
    }

    /// A stored turn was not followed within the retention cap (or its
    /// conversation ended without saying so).
    pub fn record_abandoned(&mut self) {
        self.age();
        self.abandoned += 1.0;
    }

    /// Observations so far (gaps and abandons, not decayed).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Weight of gaps `≤ x_ms` (linear within a bucket).
    fn mass_le(&self, x_ms: f64) -> f64 {
        let mut m = 0.0;
        for (i, c) in self.counts.iter().enumerate() {
            let (lo, hi) = bounds(i);
            if x_ms >= hi {
                m += c;
            } else if x_ms > lo {
                m += c * (x_ms - lo) / (hi - lo);
            }
        }
        m
    }

    fn gap_mass(&self) -> f64 {
        self.counts.iter().sum()
    }

    /// The `q`-quantile of the gaps that came back, ms (`None` when none
    /// did). Interpolated linearly inside its bucket.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total = self.gap_mass();
        if total <= 0.0 {
            return None;
        }
        let want = q.clamp(0.0, 1.0) * total;
        let mut acc = 0.0;
        for (i, c) in self.counts.iter().enumerate() {
            if *c > 0.0 && acc + c >= want {
                let (lo, hi) = bounds(i);
                return Some(lo + (hi - lo) * ((want - acc) / c).clamp(0.0, 1.0));
            }
            acc += c;
        }
        Some(bounds(GAP_BUCKETS - 1).1)
    }

    /// Probability that the next turn arrives within `window_ms` after
    /// `elapsed_ms`, given that it has not arrived by `elapsed_ms`
    /// (abandoned conversations count as never arriving). `None` without
    /// observations.
    pub fn p_next_within(&self, elapsed_ms: u64, window_ms: u64) -> Option<f64> {
        let e = elapsed_ms as f64;
        let alive = self.gap_mass() - self.mass_le(e) + self.abandoned;
        if alive <= 1e-12 {
            return (self.samples > 0).then_some(0.0);
        }
        let hit = self.mass_le(e + window_ms as f64) - self.mass_le(e);
        Some((hit / alive).clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 1);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(1024), 11);
        assert_eq!(bucket_of(u64::MAX), GAP_BUCKETS - 1);
    }

    #[test]
    fn quantile_interpolates_within_the_bucket() {
        let mut h = GapHistogram::new(1.0);
        assert_eq!(h.quantile_ms(0.5), None);
        for _ in 0..100 {
            h.record_gap(3000); // bucket [2048, 4096)
        }
        let q = h.quantile_ms(0.9).unwrap();
        assert!((2048.0..4096.0).contains(&q), "{q}");
    }

    #[test]
    fn conditional_probability_accounts_for_abandons() {
        let mut h = GapHistogram::new(1.0);
        for _ in 0..50 {
            h.record_gap(1500);
        }
        for _ in 0..50 {
            h.record_abandoned();
        }
        // From 0: half come back, all within 2048 ms.
        let p0 = h.p_next_within(0, 2048).unwrap();
        assert!((p0 - 0.5).abs() < 1e-9, "{p0}");
        // After 2048 ms without a turn, only abandoned ones are left.
        assert_eq!(h.p_next_within(2048, 100_000), Some(0.0));
    }

    #[test]
    fn decay_forgets_the_old_behaviour() {
        let mut h = GapHistogram::new(0.9);
        for _ in 0..100 {
            h.record_gap(100_000);
        }
        for _ in 0..100 {
            h.record_gap(1_000);
        }
        assert!(h.quantile_ms(0.5).unwrap() < 2_048.0);
        assert_eq!(h.samples(), 200);
    }
}
