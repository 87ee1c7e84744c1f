//! Measurements of the cost model on synthetic streams with known truth.
//!
//! `cargo run --release -p kvloop-costmodel --example sim_report`
//!
//! Prints: threshold vs true break-even at several link rates and prefill
//! profiles; convergence time after bandwidth ÷ 4; threshold changes
//! (flapping) over 10 minutes of steady noisy traffic. Every run is seeded.
//! `KVLOOP_COSTMODEL_TOML=path` runs it with a cost model config from a TOML
//! file (the `[cost_model]` table's fields) instead of the defaults.

#[path = "../tests/common/mod.rs"]
mod common;
use common::*;
use kvloop_costmodel::*;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

fn cfg() -> CostModelConfig {
    match std::env::var("KVLOOP_COSTMODEL_TOML") {
        Ok(path) => {
            let text =
                std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
            let c: CostModelConfig =
                toml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
            c.validate().unwrap_or_else(|e| panic!("{path}: {e}"));
            c
        }
        Err(_) => CostModelConfig::default(),
    }
}

fn main() {
    let seeds: Vec<u64> = (1..=5).collect();
    println!(
        "KV bytes/token (Qwen3-32B, bf16): 64 layers × 8 KV heads × 128 dim × 2 × 2 B = {} B",
        SHAPE.bytes_per_token
    );
    println!(
        "noise ±20 % multiplicative (uniform); active probes every 250 ms (1/64/8/256 blocks); READs 5/s; prefills 10/s\n"
    );

    println!(
        "## Threshold vs true break-even after 60 s (and 300 s) of samples, {} seeds",
        seeds.len()
    );
    println!(
        "| link | prefill | truth R* | threshold @60 s (min..max) | max err @60 s | se @60 s | threshold @300 s (min..max) | max err @300 s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (gbit, prefill, name) in [
        (400.0, PREFILL_TP1, "TP=1"),
        (100.0, PREFILL_TP1, "TP=1"),
        (10.0, PREFILL_TP1, "TP=1"),
        (1.0, PREFILL_TP1, "TP=1"),
        (100.0, PREFILL_TP8, "TP=8"),
        (10.0, PREFILL_TP8, "TP=8"),
        (1.0, PREFILL_TP8, "TP=8"),
    ] {
        let mut at60 = Vec::new();
        let mut at300 = Vec::new();
        let mut se = Vec::new();
        let mut truth = 0;
        for &seed in &seeds {
            let mut sim = Sim::new(
                SimParams {
                    seed,
                    ..SimParams::default()
                },
                cfg(),
                link(gbit),
                prefill,
            );
            sim.run_for(60 * S);
            truth = sim.truth();
            at60.push(sim.threshold());
            se.push(sim.explain().break_even_se_rel.unwrap_or(0.0));
            sim.run_for(240 * S);
            at300.push(sim.threshold());
        }
        let err = |v: &[u64]| v.iter().map(|&t| rel_err(t, truth)).fold(0.0, f64::max) * 100.0;
        let mm = |v: &[u64]| format!("{}..{}", v.iter().min().unwrap(), v.iter().max().unwrap());
        println!(
            "| {gbit} Gbit/s | {name} | {truth} | {} | {:.1} % | {:.1} % | {} | {:.1} % |",
            mm(&at60),
            err(&at60),
            se.iter().copied().fold(0.0, f64::max) * 100.0,
            mm(&at300),
            err(&at300)
        );
    }

    println!(
        "\n## Convergence after bandwidth ÷ 4 (60 s warm-up; 60 s after), time until the threshold is within 10 % of the new truth and stays there"
    );
    println!(
        "| before → after | prefill | truth before → after | per-seed: first within 10 % (s) | per-seed: within 10 % for good (s) | max (s) | threshold 60 s after (min..max) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (gbit, prefill, name) in [
        (100.0, PREFILL_TP1, "TP=1"),
        (40.0, PREFILL_TP1, "TP=1"),
        (400.0, PREFILL_TP8, "TP=8"),
        (400.0, PREFILL_TP1, "TP=1"),
    ] {
        let mut times = Vec::new();
        let mut finals = Vec::new();
        let mut reached = Vec::new();
        let mut tb = 0;
        let mut ta = 0;
        for &seed in &seeds {
            let res = step_convergence(
                SimParams {
                    seed,
                    ..SimParams::default()
                },
                prefill,
                gbit,
                4.0,
                60 * S,
                60 * S,
                cfg(),
            );
            let (conv, truth, sim) = (res.converged, res.truth, res.sim);
            reached.push(res.reached.map(|d| d.as_secs_f64()));
            let c0 = Sim::new(SimParams::default(), cfg(), link(gbit), prefill);
            tb = c0.truth();
            ta = truth;
            finals.push(sim.threshold());
            times.push(conv.map(|d| d.as_secs_f64()));
        }
        let fmtv = |v: &[Option<f64>]| -> String {
            v.iter()
                .map(|t| t.map_or("never".into(), |t| format!("{t:.2}")))
                .collect::<Vec<String>>()
                .join(", ")
        };
        let max = times
            .iter()
            .map(|t| t.unwrap_or(f64::INFINITY))
            .fold(0.0, f64::max);
        println!(
            "| {gbit} → {} Gbit/s | {name} | {tb} → {ta} | {} | {} | {max:.2} | {}..{} |",
            gbit / 4.0,
            fmtv(&reached),
            fmtv(&times),
            finals.iter().min().unwrap(),
            finals.iter().max().unwrap()
        );
    }

    println!(
        "\n## Flapping: threshold changes during 600 s of steady traffic after a 180 s warm-up (windows full)"
    );
    println!(
        "(reversals: changes whose direction is opposite to the previous change, counted over the whole 780 s)"
    );
    println!(
        "| link | prefill | noise | outliers | changes after warm-up per seed | total | changes during warm-up (all seeds) | reversals (all seeds) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (gbit, prefill, name, noise, outliers) in [
        (100.0, PREFILL_TP1, "TP=1", 0.2, 0.0),
        (10.0, PREFILL_TP1, "TP=1", 0.2, 0.0),
        (100.0, PREFILL_TP8, "TP=8", 0.2, 0.0),
        (100.0, PREFILL_TP1, "TP=1", 0.2, 0.05),
        (10.0, PREFILL_TP1, "TP=1", 0.2, 0.05),
    ] {
        let mut counts = Vec::new();
        let mut warm = 0;
        let mut reversals = 0;
        for &seed in &seeds {
            let params = SimParams {
                seed,
                noise_rel: noise,
                outlier_frac: outliers,
                ..SimParams::default()
            };
            let mut sim = Sim::new(params, cfg(), link(gbit), prefill);
            sim.run_for(180 * S);
            let t0 = sim.now;
            sim.run_for(600 * S);
            counts.push(sim.changes_since(t0));
            warm += sim.changes.len() - sim.changes_since(t0);
            reversals += count_reversals(&sim.changes);
        }
        println!(
            "| {gbit} Gbit/s | {name} | ±{:.0} % | {:.0} % ×10 | {:?} | {} | {warm} | {reversals} |",
            noise * 100.0,
            outliers * 100.0,
            counts,
            counts.iter().sum::<usize>()
        );
    }

    // Cost of one update (release build), for the agent's CPU budget.
    let mut sim = Sim::new(SimParams::default(), cfg(), link(100.0), PREFILL_TP1);
    sim.run_for(120 * S);
    let t = std::time::Instant::now();
    let n = 200;
    for i in 0..n {
        sim.model.update(sim.now + Duration::from_millis(i));
    }
    println!(
        "\nupdate() with full windows (1 pair, 2 models): {:.3} ms per call",
        t.elapsed().as_secs_f64() * 1e3 / n as f64
    );
}
