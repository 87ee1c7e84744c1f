//! Break-even between READing `R` reusable tokens and recomputing them.

use kvloop_router_api::CostModelCoefficients;
use serde::{Deserialize, Serialize};

/// Shape of the KV transfer of one (P, D) pair: how `R` reusable tokens turn
/// into a READ.
///
/// `bytes = R × bytes_per_token`;
/// `descriptors = ceil(R / block_size_tokens) × regions_per_block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvShape {
    /// KV bytes per token across all layers on the READ path. Qwen3-32B in
    /// bf16: 64 layers × 8 KV heads × 128 head dim × 2 (K, V) × 2 bytes =
    /// 262144 bytes (256 KiB; source: the model's `config.json`).
    pub bytes_per_token: u64,
    /// Tokens per KV block (vLLM's `block_size`, default 16).
    pub block_size_tokens: u64,
    /// Descriptors per block in a READ (memory regions a block is split
    /// across, e.g. one per layer and K/V when each layer is registered
    /// separately: 128 for Qwen3-32B).
    pub regions_per_block: u64,
}

/// Transfer coefficients of one (peer, direction):
/// `t_xfer_ms = fixed_ms + bytes × ms_per_byte + descriptors × ms_per_descriptor`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferCoefficients {
    /// Fixed cost per READ (handshake, notification, queueing), ms.
    pub fixed_ms: f64,
    /// Inverse bandwidth, ms per byte.
    pub ms_per_byte: f64,
    /// Cost per descriptor, ms.
    pub ms_per_descriptor: f64,
}

impl TransferCoefficients {
    /// Bandwidth in bytes/s (`inf` when the per-byte cost is 0).
    pub fn bandwidth_bytes_per_s(&self) -> f64 {
        1e3 / self.ms_per_byte
    }

    /// Predicted time of one READ, ms.
    pub fn predict_ms(&self, bytes: u64, descriptors: u64) -> f64 {
        self.fixed_ms
            + bytes as f64 * self.ms_per_byte
            + descriptors as f64 * self.ms_per_descriptor
    }
}

/// Prefill coefficients of one prefill engine:
/// `t_prefill_ms(n, ctx) = p0_ms + n × (ms_per_token + ms_per_token_ctx × (ctx + n/2))`
/// for `n` computed tokens after `ctx` tokens of context.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillCoefficients {
    /// Fixed cost per prefill request, ms (paid whether or not KV is reused,
    /// so it does not enter the break-even).
    pub p0_ms: f64,
    /// Linear cost per computed token (weights, MLP), ms.
    pub ms_per_token: f64,
    /// Attention cost per computed token per token attended to, ms.
    pub ms_per_token_ctx: f64,
}

impl PrefillCoefficients {
    /// Predicted prefill time, ms.
    pub fn predict_ms(&self, new_tokens: u64, context_tokens: u64) -> f64 {
        let n = new_tokens as f64;
        self.p0_ms
            + n * (self.ms_per_token + self.ms_per_token_ctx * (context_tokens as f64 + n / 2.0))
    }

    /// Extra time to recompute the first `r` tokens of a prompt instead of
    /// READing them, ms: `r × (k1 + k2 × r/2)`. The suffix attends to those
    /// tokens either way, so only their own computation counts.
    pub fn recompute_ms(&self, r: f64) -> f64 {
        r * (self.ms_per_token + self.ms_per_token_ctx * r / 2.0)
    }
}

/// Coefficients in the router's form (`kvloop_router_api::CostModelCoefficients`).
///
/// Transfer of `r` tokens: `xfer_fixed_ms + r × xfer_ms_per_token` with the
/// descriptor count `ceil(r/B) × regions` taken as its mean `(r/B + 1/2) ×
/// regions`. Recompute: the router's `r × (prefill_ms_per_token +
/// prefill_ms_per_token_ctx × ctx)` equals this crate's recompute cost with
/// `ctx = r/2` (the reusable prefix attends to itself; on average to half of it).
pub fn router_coefficients(
    xfer: &TransferCoefficients,
    prefill: &PrefillCoefficients,
    shape: &KvShape,
    confidence: f64,
) -> CostModelCoefficients {
    let regions = shape.regions_per_block as f64;
    let block = shape.block_size_tokens.max(1) as f64;
    CostModelCoefficients {
        xfer_fixed_ms: xfer.fixed_ms + 0.5 * regions * xfer.ms_per_descriptor,
        xfer_ms_per_token: shape.bytes_per_token as f64 * xfer.ms_per_byte
            + regions / block * xfer.ms_per_descriptor,
        prefill_ms_per_token: prefill.ms_per_token,
        prefill_ms_per_token_ctx: prefill.ms_per_token_ctx,
        confidence: confidence.clamp(0.0, 1.0),
        abandons_slow_reads: false,
        notices_abandoned_pulls: false,
        notices_read_pulls: false,
    }
}

/// Reusable tokens `R*` at which READing them costs as much as recomputing
/// them: the positive root of
/// `(k2/2)·R² + (k1 − x1)·R − x0 = 0` (`x0 = xfer_fixed_ms`,
/// `x1 = xfer_ms_per_token`, `k1 = prefill_ms_per_token`,
/// `k2 = prefill_ms_per_token_ctx`). Above `R*` READing wins.
///
/// Returns `f64::INFINITY` when READing never wins (per-token transfer at least
/// as costly as recompute and no attention term), 0 when it always wins.
/// Never NaN for finite non-negative inputs; negative inputs are taken as 0.
pub fn break_even_tokens(c: &CostModelCoefficients) -> f64 {
    let clean = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let x0 = clean(c.xfer_fixed_ms);
    let x1 = if c.xfer_ms_per_token.is_nan() {
        0.0
    } else {
        c.xfer_ms_per_token.max(0.0)
    };
    let k1 = clean(c.prefill_ms_per_token);
    let q = clean(c.prefill_ms_per_token_ctx) / 2.0;
    if !x1.is_finite() {
        return f64::INFINITY;
    }
    let b = k1 - x1;
    let r = if q > 0.0 {
        let disc = (b * b + 4.0 * q * x0).sqrt();
        if b >= 0.0 {
            let den = b + disc;
            if den > 0.0 { 2.0 * x0 / den } else { 0.0 }
        } else {
            (disc - b) / (2.0 * q)
        }
    } else if b > 0.0 {
        x0 / b
    } else {
        f64::INFINITY
    };
    if r.is_nan() {
        f64::INFINITY
    } else {
        r.max(0.0)
    }
}

/// Standard error of [`break_even_tokens`], tokens, by the delta method:
/// `cov_xfer` is the covariance of (`xfer_fixed_ms`, `xfer_ms_per_token`),
/// `cov_prefill` of (`prefill_ms_per_token`, `prefill_ms_per_token_ctx`)
/// (transfer and prefill fits are independent). The gradient is taken by
/// central differences. 0 when the break-even is not finite.
pub fn break_even_se_tokens(
    c: &CostModelCoefficients,
    cov_xfer: [[f64; 2]; 2],
    cov_prefill: [[f64; 2]; 2],
) -> f64 {
    let r0 = break_even_tokens(c);
    if !r0.is_finite() {
        return 0.0;
    }
    let grad = |set: &dyn Fn(&mut CostModelCoefficients, f64), v: f64| -> f64 {
        let h = v.abs() * 1e-4 + 1e-12;
        let (mut up, mut dn) = (c.clone(), c.clone());
        set(&mut up, v + h);
        set(&mut dn, (v - h).max(0.0));
        let (ru, rd) = (break_even_tokens(&up), break_even_tokens(&dn));
        if ru.is_finite() && rd.is_finite() {
            (ru - rd) / (v + h - (v - h).max(0.0))
        } else {
            0.0
        }
    };
    let gx = [
        grad(&|c, v| c.xfer_fixed_ms = v, c.xfer_fixed_ms),
        grad(&|c, v| c.xfer_ms_per_token = v, c.xfer_ms_per_token),
    ];
    let gp = [
        grad(&|c, v| c.prefill_ms_per_token = v, c.prefill_ms_per_token),
        grad(
            &|c, v| c.prefill_ms_per_token_ctx = v,
            c.prefill_ms_per_token_ctx,
        ),
    ];
    let quad = |g: [f64; 2], m: [[f64; 2]; 2]| {
        (0..2)
            .map(|i| (0..2).map(|j| g[i] * m[i][j] * g[j]).sum::<f64>())
            .sum::<f64>()
    };
    let var = quad(gx, cov_xfer) + quad(gp, cov_prefill);
    if var.is_finite() && var > 0.0 {
        var.sqrt()
    } else {
        0.0
    }
}

/// Covariance of (`xfer_fixed_ms`, `xfer_ms_per_token`) from the covariance of
/// the transfer coefficients (fixed, per byte, per descriptor), for a shape.
pub(crate) fn router_xfer_cov(cov: &[[f64; 3]; 3], shape: &KvShape) -> [[f64; 2]; 2] {
    let regions = shape.regions_per_block as f64;
    let block = shape.block_size_tokens.max(1) as f64;
    let j = [
        [1.0, 0.0, 0.5 * regions],
        [0.0, shape.bytes_per_token as f64, regions / block],
    ];
    let mut out = [[0.0; 2]; 2];
    for (a, row) in out.iter_mut().enumerate() {
        for (b, cell) in row.iter_mut().enumerate() {
            *cell = (0..3)
                .map(|p| (0..3).map(|q| j[a][p] * cov[p][q] * j[b][q]).sum::<f64>())
                .sum();
        }
    }
    out
}

/// [`break_even_tokens`] rounded up and clamped to `[min_tokens, max_tokens]`
/// (`INFINITY` → `max_tokens`).
pub fn clamp_threshold(r: f64, min_tokens: u64, max_tokens: u64) -> u64 {
    if !(r < max_tokens as f64) {
        return max_tokens;
    }
    (r.ceil() as u64).clamp(min_tokens, max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coeffs(x0: f64, x1: f64, k1: f64, k2: f64) -> CostModelCoefficients {
        CostModelCoefficients {
            xfer_fixed_ms: x0,
            xfer_ms_per_token: x1,
            prefill_ms_per_token: k1,
            prefill_ms_per_token_ctx: k2,
            abandons_slow_reads: false,
            notices_abandoned_pulls: false,
            notices_read_pulls: false,
            confidence: 1.0,
        }
    }

    /// Brute force: first integer R at which recompute ≥ READ.
    fn brute(c: &CostModelCoefficients) -> u64 {
        (0..10_000_000u64)
            .find(|&r| {
                let r = r as f64;
                r * (c.prefill_ms_per_token + c.prefill_ms_per_token_ctx * r / 2.0)
                    >= c.xfer_fixed_ms + r * c.xfer_ms_per_token
            })
            .unwrap_or(u64::MAX)
    }

    #[test]
    fn root_matches_brute_force() {
        for c in [
            coeffs(10.0, 0.025, 0.16, 5e-6),
            coeffs(10.0, 0.214, 0.16, 5e-6),
            coeffs(10.0, 0.025, 0.02, 0.65e-6),
            coeffs(50.0, 0.001, 0.02, 0.0),
            coeffs(0.0, 0.1, 0.2, 0.0),
        ] {
            let r = break_even_tokens(&c);
            assert_eq!(r.ceil() as u64, brute(&c), "{c:?} -> {r}");
        }
    }

    #[test]
    fn never_and_degenerate() {
        assert_eq!(
            break_even_tokens(&coeffs(10.0, 0.3, 0.2, 0.0)),
            f64::INFINITY
        );
        assert_eq!(
            break_even_tokens(&coeffs(f64::NAN, f64::NAN, f64::NAN, f64::NAN)),
            f64::INFINITY
        );
        assert_eq!(clamp_threshold(f64::INFINITY, 16, 1000), 1000);
        assert_eq!(clamp_threshold(3.2, 16, 1000), 16);
        assert_eq!(clamp_threshold(17.2, 16, 1000), 18);
    }

    #[test]
    fn router_form_matches_exact_descriptor_count_on_average() {
        let x = TransferCoefficients {
            fixed_ms: 10.0,
            ms_per_byte: 2e-8,
            ms_per_descriptor: 5e-4,
        };
        let p = PrefillCoefficients {
            p0_ms: 5.0,
            ms_per_token: 0.16,
            ms_per_token_ctx: 5e-6,
        };
        let s = KvShape {
            bytes_per_token: 262_144,
            block_size_tokens: 16,
            regions_per_block: 128,
        };
        let c = router_coefficients(&x, &p, &s, 0.9);
        // Over one block of R values the linear form equals the mean exact cost.
        let exact: f64 = (1..=16u64)
            .map(|r| x.predict_ms(r * s.bytes_per_token, r.div_ceil(16) * 128))
            .sum::<f64>()
            / 16.0;
        let lin: f64 = (1..=16)
            .map(|r| c.xfer_fixed_ms + r as f64 * c.xfer_ms_per_token)
            .sum::<f64>()
            / 16.0;
        assert!((exact - lin).abs() / exact < 0.01, "{exact} vs {lin}");
        assert!((p.recompute_ms(100.0) - 100.0 * (0.16 + 5e-6 * 50.0)).abs() < 1e-12);
    }
}
