//! Robust, time-decayed, relative-error weighted least squares for a model
//! linear in three coefficients, `y ≈ x · β`.
//!
//! Why this estimator (and not Theil–Sen): Theil–Sen is a one-regressor
//! estimator (O(n²) pairs; its multi-regressor variants are costly and lose
//! the simple breakdown guarantee), while the transfer and prefill models have
//! three coefficients. An M-estimator by iteratively reweighted least squares
//! (IRLS) takes the time-decay weights as plain multiplicative weights, costs
//! O(n) per iteration, and is robust in two stages:
//!
//! 1. Huber weights (convex loss, unique minimum): starting from the plain
//!    weighted fit, it moves to where the *majority of the weight* is. After a
//!    step change this is what lets the fit follow once the new regime holds
//!    most of the (decayed) weight.
//! 2. Tukey bisquare weights (redescending): gross outliers (a READ that hit a
//!    retransmit, a prefill queued behind another) get weight 0 instead of a
//!    bounded pull.
//!
//! Residuals are *relative* (`(y - ŷ) / (ŷ + f)`, weights `1/(ŷ + f)²`):
//! latencies span orders of magnitude (a 1-block probe vs a 64k-token READ)
//! and their noise is multiplicative, so absolute residuals would let the
//! largest transfers decide everything and leave the fixed cost unmeasured.
//! `f` ([`FitParams::noise_floor`], ms) is the absolute part of the noise: a
//! busy node delays any READ's completion by its scheduling jitter (about a
//! millisecond on the 2-core VM of `make demo-cluster`), which is ±200 % of
//! a 0.5 ms probe and nothing to a 30 ms READ. Without it, the small probes'
//! jitter set the residual scale of the whole path (0.56–0.97 in
//! `make demo-cluster`), which kept its confidence near the router's floor
//! and blunted the change detector. The scale is the MAD of the relative
//! residuals (×1.4826), floored so that noiseless data never gives a zero
//! scale.
//!
//! Identifiability: before fitting, each coefficient (in order) is checked for
//! whether its column is distinguishable from the earlier free columns (pivot
//! of the normalized weighted normal matrix ≥ `min_pivot`). A coefficient that
//! is not (all READs of one size: bandwidth; descriptors proportional to bytes:
//! per-descriptor cost) is fixed at its prior and only the rest is fitted.
//! Coefficients are constrained ≥ 0 (a negative one is fixed at 0 and the rest
//! refitted, as in non-negative least squares).

// Small dense linear algebra reads best with explicit indices.
#![allow(clippy::needless_range_loop)]

/// Number of coefficients.
pub(crate) const K: usize = 3;

/// Huber tuning constant (95 % efficiency under Gaussian noise).
const HUBER_K: f64 = 1.345;
/// Tukey bisquare tuning constant (95 % efficiency under Gaussian noise).
const BISQUARE_C: f64 = 4.685;
const HUBER_ITERS: usize = 5;
const BISQUARE_ITERS: usize = 5;

/// One observation: regressors `x`, response `y` (ms), weight `w` (time decay
/// × source weight).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub x: [f64; K],
    pub y: f64,
    pub w: f64,
}

/// Fit parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FitParams {
    /// Value of a coefficient that cannot be identified from the data.
    pub prior: [f64; K],
    /// Smallest pivot of a fitted column (see module docs).
    pub min_pivot: f64,
    /// Floor of the relative residual scale.
    pub min_sigma: f64,
    /// Floor of predictions and observations, ms (keeps `1/ŷ²` finite).
    pub floor_y: f64,
    /// Absolute part of the noise, ms, added to a prediction or an
    /// observation to scale its residual (see the module docs; 0: purely
    /// relative).
    pub noise_floor: f64,
}

impl FitParams {
    /// Scale of a residual at `y` ms: `max(y, floor_y) + noise_floor`.
    pub(crate) fn scale_at(&self, y: f64) -> f64 {
        y.max(self.floor_y) + self.noise_floor.max(0.0)
    }
}

/// Result of [`robust_fit`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Fit {
    /// Coefficients; fixed ones hold their prior (or 0 when clamped).
    pub beta: [f64; K],
    /// Whether each coefficient was identified by the data (not fixed).
    pub identified: [bool; K],
    /// Robust scale of the relative residuals.
    pub sigma_rel: f64,
    /// Rows that kept a non-zero weight.
    pub inliers: usize,
    /// Rows rejected as outliers (bisquare weight 0).
    pub rejected: usize,
    /// Kish effective sample size of the inliers under the decay weights.
    pub n_eff: f64,
    /// Covariance of `beta` (sandwich estimate under relative noise of scale
    /// `sigma_rel`); rows and columns of fixed coefficients are 0.
    pub cov: [[f64; K]; K],
}

/// Solves the `n × n` system `a · x = b` (Gaussian elimination with partial
/// pivoting). `None` when singular or not finite.
fn solve_small<const N: usize>(
    mut a: [[f64; N]; N],
    mut b: [f64; N],
    n: usize,
) -> Option<[f64; N]> {
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if !(a[piv][col].abs() > 1e-300) {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        for row in col + 1..n {
            let f = a[row][col] / a[col][col];
            for k in col..n {
                a[row][k] -= f * a[col][k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; N];
    for row in (0..n).rev() {
        let mut s = b[row];
        for k in row + 1..n {
            s -= a[row][k] * x[k];
        }
        x[row] = s / a[row][row];
    }
    x[..n].iter().all(|v| v.is_finite()).then_some(x)
}

/// Which columns the data identify (see module docs). Column 0 is the
/// intercept and is identified whenever there is data.
fn identifiable(rows: &[Row], p: &FitParams) -> [bool; K] {
    let mut m = [[0.0f64; K]; K];
    for r in rows {
        let v = r.w / (p.scale_at(r.y) * p.scale_at(r.y));
        for i in 0..K {
            for j in 0..K {
                m[i][j] += v * r.x[i] * r.x[j];
            }
        }
    }
    let d: Vec<f64> = (0..K).map(|i| m[i][i].sqrt()).collect();
    let mut free = [false; K];
    let mut idx: Vec<usize> = Vec::new();
    for j in 0..K {
        if !(d[j] > 0.0 && d[j].is_finite()) {
            continue;
        }
        let corr = |a: usize, b: usize| m[a][b] / (d[a] * d[b]);
        let pivot = if idx.is_empty() {
            1.0
        } else {
            let n = idx.len();
            let mut a = [[0.0; K]; K];
            let mut b = [0.0; K];
            for (ii, &i) in idx.iter().enumerate() {
                for (kk, &k) in idx.iter().enumerate() {
                    a[ii][kk] = corr(i, k);
                }
                b[ii] = corr(i, j);
            }
            match solve_small(a, b, n) {
                Some(s) => 1.0 - (0..n).map(|ii| b[ii] * s[ii]).sum::<f64>(),
                None => 0.0,
            }
        };
        if pivot >= p.min_pivot {
            free[j] = true;
            idx.push(j);
        }
    }
    free
}

/// Weighted least squares on the free columns with per-row weights `u`;
/// fixed columns hold `fixed`. Negative free coefficients are fixed at 0 and
/// the rest refitted. Returns the coefficients and the final free mask.
fn wls(rows: &[Row], u: &[f64], free: [bool; K], fixed: [f64; K]) -> Option<([f64; K], [bool; K])> {
    let mut free = free;
    let mut beta = fixed;
    for _ in 0..=K {
        let mut idx = [0usize; K];
        let mut n = 0;
        for j in 0..K {
            if free[j] {
                idx[n] = j;
                n += 1;
            }
        }
        if n == 0 {
            return Some((beta, free));
        }
        let mut fixed_beta = [0.0; K];
        for j in 0..K {
            if !free[j] {
                fixed_beta[j] = beta[j];
            }
        }
        // Accumulate the full K×K normal matrix (cheap, branch-free), then
        // pick the free block.
        let mut full = [[0.0; K]; K];
        let mut rhs = [0.0; K];
        let mut total = 0.0;
        for (r, &ui) in rows.iter().zip(u) {
            if ui <= 0.0 {
                continue;
            }
            total += ui;
            let x = &r.x;
            let yr = r.y - (fixed_beta[0] * x[0] + fixed_beta[1] * x[1] + fixed_beta[2] * x[2]);
            let ux = [ui * x[0], ui * x[1], ui * x[2]];
            for i in 0..K {
                for k in i..K {
                    full[i][k] += ux[i] * x[k];
                }
                rhs[i] += ux[i] * yr;
            }
        }
        if !(total > 0.0) {
            return None;
        }
        let mut a = [[0.0; K]; K];
        let mut b = [0.0; K];
        for ii in 0..n {
            for kk in 0..n {
                let (i, k) = (idx[ii].min(idx[kk]), idx[ii].max(idx[kk]));
                a[ii][kk] = full[i][k];
            }
            b[ii] = rhs[idx[ii]];
            // Tiny ridge for numerical safety only (1e-9 of each diagonal).
            a[ii][ii] *= 1.0 + 1e-9;
        }
        let s = solve_small(a, b, n)?;
        let mut clamped = false;
        for ii in 0..n {
            beta[idx[ii]] = s[ii];
        }
        for &j in &idx[..n] {
            if beta[j] < 0.0 {
                beta[j] = 0.0;
                free[j] = false;
                clamped = true;
            }
        }
        if !clamped {
            return Some((beta, free));
        }
    }
    Some((beta, free))
}

/// Weighted median of `(value, weight)` pairs; 0 when empty.
fn weighted_median(v: &mut [(f64, f64)]) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = v.iter().map(|x| x.1).sum();
    if !(total > 0.0) {
        return 0.0;
    }
    let mut acc = 0.0;
    for &(val, w) in v.iter() {
        acc += w;
        if acc >= total / 2.0 {
            return val;
        }
    }
    v.last().map_or(0.0, |x| x.0)
}

fn predict(beta: &[f64; K], x: &[f64; K]) -> f64 {
    beta[0] * x[0] + beta[1] * x[1] + beta[2] * x[2]
}

/// Covariance of the free coefficients: `A⁻¹ B A⁻¹` with
/// `A = Σ uᵢ xᵢxᵢᵀ`, `B = Σ uᵢ² σ² ŷᵢ² xᵢxᵢᵀ` (relative noise: `Var yᵢ = σ² ŷᵢ²`,
/// `ŷᵢ` here the residual's scale, prediction + noise floor).
fn covariance(rows: &[Row], u: &[f64], yhat: &[f64], sigma: f64, free: [bool; K]) -> [[f64; K]; K] {
    let idx: Vec<usize> = (0..K).filter(|&j| free[j]).collect();
    let n = idx.len();
    let mut cov = [[0.0; K]; K];
    if n == 0 {
        return cov;
    }
    let mut a = [[0.0; K]; K];
    let mut b = [[0.0; K]; K];
    for ((r, &ui), &yh) in rows.iter().zip(u).zip(yhat) {
        for (ii, &i) in idx.iter().enumerate() {
            for (kk, &k) in idx.iter().enumerate() {
                a[ii][kk] += ui * r.x[i] * r.x[k];
                b[ii][kk] += ui * ui * sigma * sigma * yh * yh * r.x[i] * r.x[k];
            }
        }
    }
    // A⁻¹ column by column.
    let mut ainv = [[0.0; K]; K];
    for c in 0..n {
        let mut e = [0.0; K];
        e[c] = 1.0;
        match solve_small(a, e, n) {
            Some(col) => {
                for r in 0..n {
                    ainv[r][c] = col[r];
                }
            }
            None => return cov,
        }
    }
    for (ii, &i) in idx.iter().enumerate() {
        for (kk, &k) in idx.iter().enumerate() {
            let mut s = 0.0;
            for p in 0..n {
                for q in 0..n {
                    s += ainv[ii][p] * b[p][q] * ainv[q][kk];
                }
            }
            cov[i][k] = if s.is_finite() { s } else { 0.0 };
        }
    }
    cov
}

/// Robust fit (see module docs). `warm`: the previous fit's coefficients, to
/// start from (fewer Huber iterations); `None` after a detected change.
/// `None` when no row is usable or the system is singular. Never returns
/// non-finite coefficients.
pub(crate) fn robust_fit(rows_in: &[Row], p: &FitParams, warm: Option<[f64; K]>) -> Option<Fit> {
    let rows: Vec<Row> = rows_in
        .iter()
        .copied()
        .filter(|r| {
            r.x.iter().all(|v| v.is_finite())
                && r.y.is_finite()
                && r.y > 0.0
                && r.w.is_finite()
                && r.w > 0.0
        })
        .collect();
    if rows.is_empty() {
        return None;
    }
    let identified0 = identifiable(&rows, p);
    let mut fixed = p.prior;
    for j in 0..K {
        if !fixed[j].is_finite() || fixed[j] < 0.0 {
            fixed[j] = 0.0;
        }
    }
    let warm = warm.filter(|w| w.iter().all(|v| v.is_finite() && *v >= 0.0));
    let (mut beta, mut free) = match warm {
        Some(mut w) => {
            for j in 0..K {
                if !identified0[j] {
                    w[j] = fixed[j];
                }
            }
            (w, identified0)
        }
        None => {
            // Start: relative least squares against the observations.
            let u0: Vec<f64> = rows
                .iter()
                .map(|r| r.w / (p.scale_at(r.y) * p.scale_at(r.y)))
                .collect();
            wls(&rows, &u0, identified0, fixed)?
        }
    };
    let huber_iters = if warm.is_some() { 1 } else { HUBER_ITERS };
    let bisquare_iters = if warm.is_some() { 3 } else { BISQUARE_ITERS };
    let mut resid = vec![0.0; rows.len()];
    // Per row: the residual's scale at the prediction (`ŷ + f`).
    let mut yhat = vec![0.0; rows.len()];
    let mut u = vec![0.0; rows.len()];
    let mut scratch: Vec<(f64, f64)> = Vec::with_capacity(rows.len());
    let residuals = |beta: &[f64; K], resid: &mut [f64], yhat: &mut [f64]| {
        for (i, r) in rows.iter().enumerate() {
            let pred = predict(beta, &r.x).max(p.floor_y);
            yhat[i] = p.scale_at(pred);
            resid[i] = (r.y - pred) / yhat[i];
        }
    };
    let scale = |resid: &[f64], scratch: &mut Vec<(f64, f64)>| -> f64 {
        scratch.clear();
        scratch.extend(resid.iter().zip(&rows).map(|(e, r)| (e.abs(), r.w)));
        (1.4826 * weighted_median(scratch)).max(p.min_sigma)
    };
    // Huber phase: scale re-estimated each iteration.
    let mut sigma = p.min_sigma;
    for _ in 0..huber_iters {
        residuals(&beta, &mut resid, &mut yhat);
        sigma = scale(&resid, &mut scratch);
        for i in 0..rows.len() {
            let z = (resid[i] / sigma).abs();
            let q = if z <= HUBER_K { 1.0 } else { HUBER_K / z };
            u[i] = rows[i].w * q / (yhat[i] * yhat[i]);
        }
        match wls(&rows, &u, identified0, fixed) {
            Some((b, f)) => {
                beta = b;
                free = f;
            }
            None => break,
        }
    }
    // Bisquare phase: scale fixed at the Huber estimate (M-estimation with a
    // preliminary scale).
    residuals(&beta, &mut resid, &mut yhat);
    if huber_iters == 0 {
        sigma = scale(&resid, &mut scratch);
    }
    for _ in 0..bisquare_iters {
        for i in 0..rows.len() {
            let z = (resid[i] / sigma).abs();
            let q = if z < BISQUARE_C {
                let t = 1.0 - (z / BISQUARE_C).powi(2);
                t * t
            } else {
                0.0
            };
            u[i] = rows[i].w * q / (yhat[i] * yhat[i]);
        }
        let Some((b, f)) = wls(&rows, &u, identified0, fixed) else {
            break;
        };
        let change = b
            .iter()
            .zip(&beta)
            .map(|(n, o)| (n - o).abs() / o.abs().max(1e-12))
            .fold(0.0, f64::max);
        beta = b;
        free = f;
        residuals(&beta, &mut resid, &mut yhat);
        if change < 1e-6 {
            break;
        }
    }
    let final_sigma = scale(&resid, &mut scratch);
    let (mut sw, mut sw2, mut inliers) = (0.0, 0.0, 0usize);
    for i in 0..rows.len() {
        let z = (resid[i] / sigma).abs();
        if z < BISQUARE_C {
            inliers += 1;
            sw += rows[i].w;
            sw2 += rows[i].w * rows[i].w;
            let t = 1.0 - (z / BISQUARE_C).powi(2);
            u[i] = rows[i].w * t * t / (yhat[i] * yhat[i]);
        } else {
            u[i] = 0.0;
        }
    }
    let n_eff = if sw2 > 0.0 { sw * sw / sw2 } else { 0.0 };
    if !beta.iter().all(|b| b.is_finite()) || !final_sigma.is_finite() {
        return None;
    }
    let cov = covariance(&rows, &u, &yhat, final_sigma, free);
    Some(Fit {
        beta,
        identified: free,
        sigma_rel: final_sigma,
        inliers,
        rejected: rows.len() - inliers,
        n_eff,
        cov,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(prior: [f64; K]) -> FitParams {
        FitParams {
            prior,
            min_pivot: 0.01,
            min_sigma: 1e-3,
            floor_y: 1e-6,
            noise_floor: 0.0,
        }
    }

    #[test]
    fn exact_data_recovers_coefficients() {
        let truth = [2.0, 0.5, 0.01];
        let rows: Vec<Row> = (1..40)
            .map(|i| {
                let x = [1.0, i as f64 * 3.0, ((i * 7) % 11) as f64 * 10.0];
                Row {
                    x,
                    y: predict(&truth, &x),
                    w: 1.0,
                }
            })
            .collect();
        let f = robust_fit(&rows, &params([0.0; K]), None).unwrap();
        for j in 0..K {
            assert!(
                (f.beta[j] - truth[j]).abs() < 1e-6 * truth[j].max(1.0),
                "{f:?}"
            );
        }
        assert_eq!(f.identified, [true; K]);
        assert_eq!(f.rejected, 0);
    }

    #[test]
    fn constant_size_fixes_slope_at_prior() {
        let rows: Vec<Row> = (0..20)
            .map(|_| Row {
                x: [1.0, 100.0, 1.0],
                y: 12.0,
                w: 1.0,
            })
            .collect();
        let f = robust_fit(&rows, &params([0.0, 0.1, 0.0]), None).unwrap();
        assert_eq!(f.identified, [true, false, false]);
        assert!((f.beta[1] - 0.1).abs() < 1e-12);
        assert!((f.beta[0] - 2.0).abs() < 1e-6, "{f:?}");
    }

    #[test]
    fn gross_outliers_are_rejected() {
        let truth = [5.0, 0.2, 0.0];
        let rows: Vec<Row> = (1..=100)
            .map(|i| {
                let x = [1.0, (i * 10) as f64, 0.0];
                let y = predict(&truth, &x) * if i % 20 == 0 { 10.0 } else { 1.0 };
                Row { x, y, w: 1.0 }
            })
            .collect();
        let f = robust_fit(&rows, &params([0.0; K]), None).unwrap();
        assert!(
            (f.beta[0] - 5.0).abs() < 1e-3 && (f.beta[1] - 0.2).abs() < 1e-5,
            "{f:?}"
        );
        assert_eq!(f.rejected, 5);
    }
}
