//! A link that gets faster again (a restored link, congestion that ends) is
//! followed as fast as one that gets slower: the change detector weighs a
//! READ k× faster than predicted like one k× slower (`ratio_residual` in
//! `src/samples.rs`). Before, under ±80 % noise, a 4× faster link took
//! 9–24 s to detect against 2–3 s for a 4× slower one.

mod common;
use common::*;
use kvloop_costmodel::*;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

/// Seconds from a bandwidth step (÷`factor` at 60 s, 40 Gbit/s before) until
/// the transfer model's change detector fires, and in which direction.
fn detection(factor: f64, noise_rel: f64, seed: u64) -> Option<(f64, bool)> {
    let params = SimParams {
        seed,
        noise_rel,
        ..SimParams::default()
    };
    let r = step_convergence(
        params,
        PREFILL_TP1,
        40.0,
        factor,
        60 * S,
        20 * S,
        CostModelConfig::default(),
    );
    let ex = r.sim.explain();
    let cp = ex.transfer.as_ref()?.summary.last_change_point.clone()?;
    let after = cp
        .detected_at
        .saturating_duration_since(Instant::from_millis(60_000));
    Some((after.as_secs_f64(), cp.slower))
}

#[test]
fn faster_and_slower_links_are_detected_alike() {
    eprintln!("| noise | 4× slower: detected after s | 4× faster: detected after s |");
    eprintln!("|---|---|---|");
    for noise in [0.2, 0.5, 0.8] {
        let mut row = Vec::new();
        for factor in [4.0, 0.25] {
            let mut ts = Vec::new();
            for seed in 1..=3 {
                let (t, slower) = detection(factor, noise, seed)
                    .unwrap_or_else(|| panic!("noise {noise} ×{factor} seed {seed}: no change"));
                assert_eq!(slower, factor > 1.0, "noise {noise} ×{factor} seed {seed}");
                assert!(t <= 6.0, "noise {noise} ×{factor} seed {seed}: {t} s");
                ts.push(format!("{t:.1}"));
            }
            row.push(ts.join(" / "));
        }
        eprintln!("| ±{:.0} % | {} | {} |", noise * 100.0, row[0], row[1]);
    }
}

/// No regime change is found in a steady link under ±50 % noise.
#[test]
fn steady_noise_is_not_a_change() {
    for seed in 1..=2 {
        let params = SimParams {
            seed,
            noise_rel: 0.5,
            ..SimParams::default()
        };
        let mut sim = Sim::new(params, CostModelConfig::default(), link(40.0), PREFILL_TP1);
        sim.run_for(300 * S);
        let ex = sim.explain();
        let t = ex.transfer.as_ref().expect("a transfer fit");
        assert!(t.summary.last_change_point.is_none(), "seed {seed}\n{ex}");
    }
}
