//! [`urgent_push`] against the simulator: a steady path rarely asks for an
//! early push, and a regime change asks for one at the first refit after
//! the change detector found it. The driver pushes at most once per
//! simulated second (the agent's `push_period_ms`), earlier when
//! `urgent_push` says so, and refits every 250 ms.

mod common;
use common::*;
use kvloop_costmodel::*;
use std::time::Duration;

/// Over `steady_s` of a steady 40 Gbit/s path and then `after_s` after its
/// bandwidth is divided by `factor`: early pushes before the step, early
/// pushes after it, and the seconds from the step to the first of those.
fn early_pushes(
    factor: f64,
    noise_rel: f64,
    steady_s: u32,
    after_s: u32,
) -> (u32, u32, Option<f64>) {
    let params = SimParams {
        seed: 1,
        noise_rel,
        ..SimParams::default()
    };
    let mut sim = Sim::new(params, CostModelConfig::default(), link(40.0), PREFILL_TP1);
    sim.run_for(Duration::from_secs(60));
    let tick = Duration::from_millis(250);
    let mut pushed = sim.model.pair_thresholds(Duration::from_millis(1));
    let mut last_push = sim.now;
    let (mut before, mut after, mut first) = (0, 0, None);
    let step_tick = steady_s * 4;
    for i in 0..(steady_s + after_s) * 4 {
        if i == step_tick {
            sim.xfer = link(40.0 / factor);
        }
        sim.run_for(tick);
        let now = sim.model.pair_thresholds(Duration::from_millis(1));
        if urgent_push(&pushed, &now).is_some() {
            if i < step_tick {
                before += 1;
            } else {
                after += 1;
                first.get_or_insert(f64::from(i - step_tick + 1) * 0.25);
            }
        } else if sim.now.saturating_duration_since(last_push) < Duration::from_secs(1) {
            continue;
        }
        pushed = now;
        last_push = sim.now;
    }
    (before, after, first)
}

#[test]
fn steady_paths_rarely_push_early_and_steps_push_at_detection() {
    eprintln!(
        "| noise | step | early pushes in 120 s steady | first early push after the step, s |"
    );
    eprintln!("|---|---|---:|---:|");
    for noise in [0.2, 0.5, 0.8] {
        for factor in [10.0, 0.25] {
            let (before, after, first) = early_pushes(factor, noise, 120, 20);
            let step = if factor > 1.0 {
                "10× slower"
            } else {
                "4× faster"
            };
            let at = first.map_or("-".to_string(), |s| format!("{s:.2}"));
            eprintln!("| ±{:.0} % | {step} | {before} | {at} |", noise * 100.0);
            // 480 refits, 120 periodic pushes: early ones are the exception.
            assert!(
                before <= 6,
                "±{noise} ÷{factor}: {before} early pushes on a steady path"
            );
            assert!(
                after >= 1,
                "±{noise} ÷{factor}: the step was not pushed early"
            );
            let first = first.unwrap();
            assert!(
                first <= 5.0,
                "±{noise} ÷{factor}: first early push {first} s after the step"
            );
        }
    }
}
