//! Cost model against synthetic sample streams with known truth (seeded).

mod common;
use common::*;
use kvloop_costmodel::*;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

fn steady(
    seed: u64,
    gbit: f64,
    prefill: PrefillCoefficients,
    params: SimParams,
    run: Duration,
) -> Sim {
    let mut sim = Sim::new(
        SimParams { seed, ..params },
        CostModelConfig::default(),
        link(gbit),
        prefill,
    );
    sim.run_for(run);
    sim
}

/// Break-evens that are well conditioned (per-token READ cost well below the
/// per-token recompute cost, fixed cost dominating): within 10 % after 60 s.
#[test]
fn threshold_within_10_percent_of_true_break_even() {
    for gbit in [400.0, 100.0, 40.0] {
        for seed in 1..=3 {
            let sim = steady(seed, gbit, PREFILL_TP1, SimParams::default(), 60 * S);
            let (got, want) = (sim.threshold(), sim.truth());
            assert!(
                rel_err(got, want) <= 0.10,
                "{gbit} Gbit/s seed {seed}: threshold {got}, truth {want}\n{}",
                sim.explain()
            );
        }
    }
}

/// Ill-conditioned break-evens (per-token READ cost close to the per-token
/// recompute cost: the break-even is set by the attention term and moves 3–4 %
/// per 1 % error in a per-token cost): within 10 % once the windows are full.
#[test]
fn ill_conditioned_threshold_within_10_percent_after_5_minutes() {
    let params = SimParams {
        update_interval: S,
        ..SimParams::default()
    };
    for (gbit, prefill, name) in [(10.0, PREFILL_TP1, "tp1"), (100.0, PREFILL_TP8, "tp8")] {
        for seed in 1..=2 {
            let sim = steady(seed, gbit, prefill, params.clone(), 300 * S);
            let (got, want) = (sim.threshold(), sim.truth());
            assert!(
                rel_err(got, want) <= 0.10,
                "{gbit} Gbit/s {name} seed {seed}: threshold {got}, truth {want}\n{}",
                sim.explain()
            );
            let se = sim.explain().break_even_se_rel.unwrap();
            assert!(se > 0.02 && se < 0.10, "reported standard error {se}");
        }
    }
}

#[test]
fn slow_links_clamp_to_max_recompute_always() {
    let sim = steady(7, 1.0, PREFILL_TP1, SimParams::default(), 30 * S);
    assert_eq!(sim.truth(), CostModelConfig::default().max_threshold_tokens);
    assert_eq!(
        sim.threshold(),
        CostModelConfig::default().max_threshold_tokens,
        "{}",
        sim.explain()
    );
}

#[test]
fn converges_within_10_s_after_bandwidth_divided_by_4() {
    for (gbit, prefill) in [
        (100.0, PREFILL_TP1),
        (40.0, PREFILL_TP1),
        (400.0, PREFILL_TP1),
    ] {
        for seed in 1..=3 {
            let params = SimParams {
                seed,
                ..SimParams::default()
            };
            let r = step_convergence(
                params,
                prefill,
                gbit,
                4.0,
                60 * S,
                30 * S,
                CostModelConfig::default(),
            );
            let conv = r.converged.unwrap_or_else(|| {
                panic!(
                    "{gbit} Gbit/s seed {seed}: not converged\n{}",
                    r.sim.explain()
                )
            });
            assert!(
                conv <= 10 * S,
                "{gbit}/4 seed {seed}: {} → {} took {conv:?}\n{}",
                r.before,
                r.truth,
                r.sim.explain()
            );
            // The transfer model saw the change, and the move is explained by it.
            let ex = r.sim.explain();
            assert!(
                ex.transfer
                    .as_ref()
                    .unwrap()
                    .summary
                    .last_change_point
                    .as_ref()
                    .unwrap()
                    .slower,
                "{ex}"
            );
            let moved = ex
                .history
                .iter()
                .find(|h| h.at > Instant::from_millis(61_000))
                .expect("a change after the step");
            match &moved.reason {
                ChangeReason::OutsideBand { cause, .. }
                | ChangeReason::RegimeChange { cause, .. } => {
                    // The transfer model moved it. For 400 → 100 Gbit/s (TP=1)
                    // the per-token cost moves the break-even only ~12 %, so
                    // the early post-change fixed-cost estimate can weigh more.
                    if gbit < 400.0 {
                        assert_eq!(*cause, CauseKind::TransferPerTokenCost, "{ex}");
                    } else {
                        assert_ne!(*cause, CauseKind::PrefillCost, "{ex}");
                    }
                }
                ChangeReason::Refined { .. } => {}
                other => panic!("unexpected reason {other:?}"),
            }
        }
    }
    // Ill-conditioned pair (TP=8, 400 → 100 Gbit/s: 907 → 17100 tokens, a
    // 19× move): 10 s after the step the threshold is within 20 % of the new
    // truth; the break-even's standard error there (~7 % with 10 s of
    // samples) is what keeps it from 10 % (see sim_report for the table).
    for seed in 1..=3 {
        let params = SimParams {
            seed,
            ..SimParams::default()
        };
        let r = step_convergence(
            params,
            PREFILL_TP8,
            400.0,
            4.0,
            60 * S,
            10 * S,
            CostModelConfig::default(),
        );
        assert!(
            rel_err(r.sim.threshold(), r.truth) <= 0.2,
            "seed {seed}\n{}",
            r.sim.explain()
        );
    }
}

/// After the windows are full (180 s), 10 minutes of ±20 % noise move the
/// threshold at most once per run (a last refinement), and never back and forth.
#[test]
fn no_flapping_under_20_percent_noise() {
    for (gbit, prefill, outliers) in [
        (100.0, PREFILL_TP1, 0.0),
        (10.0, PREFILL_TP1, 0.0),
        (100.0, PREFILL_TP8, 0.0),
        (100.0, PREFILL_TP1, 0.05),
    ] {
        // One seed here (debug builds are slow); `sim_report` runs 5 seeds.
        for seed in 1..=1 {
            let params = SimParams {
                seed,
                noise_rel: 0.2,
                outlier_frac: outliers,
                update_interval: S,
                ..SimParams::default()
            };
            let mut sim = Sim::new(params, CostModelConfig::default(), link(gbit), prefill);
            sim.run_for(180 * S);
            let t0 = sim.now;
            sim.run_for(600 * S);
            let after: Vec<PairChange> = sim
                .changes
                .iter()
                .filter(|c| c.change.at >= t0)
                .cloned()
                .collect();
            assert!(after.len() <= 1, "{gbit} Gbit/s seed {seed}: {after:#?}");
            assert_eq!(
                count_reversals(&sim.changes[sim.changes.len() - after.len()..]),
                0
            );
        }
    }
}

#[test]
fn robust_to_5_percent_outliers_10x_slower() {
    for seed in 1..=3 {
        let params = SimParams {
            outlier_frac: 0.05,
            outlier_factor: 10.0,
            ..SimParams::default()
        };
        for (gbit, prefill) in [(100.0, PREFILL_TP1), (40.0, PREFILL_TP1)] {
            let sim = steady(seed, gbit, prefill, params.clone(), 60 * S);
            let (got, want) = (sim.threshold(), sim.truth());
            assert!(
                rel_err(got, want) <= 0.10,
                "seed {seed} {gbit}: {got} vs {want}\n{}",
                sim.explain()
            );
            let ex = sim.explain();
            let (t, p) = (ex.transfer.as_ref().unwrap(), ex.prefill.as_ref().unwrap());
            assert!(t.summary.rejected > 0 && p.summary.rejected > 0, "{ex}");
            // Outliers are not mistaken for a regime change.
            assert!(
                t.summary.last_change_point.is_none() && p.summary.last_change_point.is_none(),
                "{ex}"
            );
        }
    }
}

#[test]
fn confidence_falls_with_age_and_threshold_holds_last_good() {
    let mut sim = Sim::new(
        SimParams::default(),
        CostModelConfig::default(),
        link(10.0),
        PREFILL_TP1,
    );
    sim.run_for(30 * S);
    let good = sim.threshold();
    let c0 = sim.explain().confidence;
    assert!(c0 > 0.6, "{c0}");
    sim.feeding = false;
    let mut last = c0;
    for _ in 0..5 {
        sim.run_for(20 * S);
        let c = sim.explain().confidence;
        assert!(c < last, "confidence must fall with age: {c} !< {last}");
        last = c;
    }
    let ex = sim.explain();
    assert!(
        ex.confidence < CostModelConfig::default().min_confidence,
        "{ex}"
    );
    assert_eq!(ex.state, ThresholdState::HeldLowConfidence);
    assert_eq!(
        ex.threshold_tokens, good,
        "holds the last good value, not the static 64"
    );
    // Exported confidence follows.
    let pt = sim.model.pair_thresholds(Duration::from_secs(15));
    assert_eq!(pt[0].model.as_ref().unwrap().confidence, ex.confidence);
    // Fresh samples bring it back.
    sim.feeding = true;
    sim.run_for(10 * S);
    assert!(sim.explain().confidence > 0.6);
    assert_eq!(sim.explain().state, ThresholdState::Estimated);
}

#[test]
fn static_default_before_enough_samples() {
    let mut sim = Sim::new(
        SimParams::default(),
        CostModelConfig::default(),
        link(10.0),
        PREFILL_TP1,
    );
    sim.model.update(sim.now);
    assert_eq!(sim.threshold(), VLLM_STATIC_THRESHOLD_TOKENS);
    assert_eq!(sim.explain().state, ThresholdState::StaticDefault);
    let pt = sim.model.pair_thresholds(Duration::from_secs(15));
    assert_eq!(pt[0].threshold_tokens, 64);
    assert_eq!(pt[0].valid_for_ms, 15_000);
    assert!(pt[0].model.is_none());
}

#[test]
fn single_size_reads_fix_bandwidth_from_history_or_prior() {
    // Only 1-block probes from the start: bandwidth from the config prior.
    let params = SimParams {
        single_size: true,
        ..SimParams::default()
    };
    let mut sim = Sim::new(params, CostModelConfig::default(), link(10.0), PREFILL_TP1);
    sim.run_for(30 * S);
    let t = sim.explain().transfer.expect("fit with fixed bandwidth");
    assert!(!t.summary.identified[1], "bandwidth not identifiable");
    let prior = CostModelConfig::default().prior_bandwidth_bytes_per_s;
    assert!((t.coefficients.bandwidth_bytes_per_s() / prior - 1.0).abs() < 1e-9);
    // The fixed cost absorbs the rest: a + one block's bytes/B ≈ the 1-block latency.
    let want = link(10.0).predict_ms(16 * SHAPE.bytes_per_token, 128);
    let got = t.coefficients.predict_ms(16 * SHAPE.bytes_per_token, 128);
    assert!((got / want - 1.0).abs() < 0.05, "{got} vs {want}");
    assert!(
        t.summary.confidence < 0.5,
        "penalized: {}",
        t.summary.confidence
    );

    // Varied sizes first, then single size: bandwidth from the last good fit.
    let mut sim = Sim::new(
        SimParams::default(),
        CostModelConfig::default(),
        link(40.0),
        PREFILL_TP1,
    );
    sim.run_for(30 * S);
    let learned = sim
        .explain()
        .transfer
        .unwrap()
        .coefficients
        .bandwidth_bytes_per_s();
    sim.params.single_size = true;
    sim.run_for(150 * S); // the varied samples age out (max_sample_age_ms = 120 s)
    let t = sim.explain().transfer.unwrap();
    assert!(!t.summary.identified[1]);
    // Effective bandwidth of the true model with the per-descriptor cost
    // folded in (descriptors ∝ bytes for one block shape).
    let x = link(40.0);
    let per_byte =
        x.ms_per_byte + x.ms_per_descriptor * 128.0 / (16.0 * SHAPE.bytes_per_token as f64);
    let effective = 1e3 / per_byte;
    let kept = t.coefficients.bandwidth_bytes_per_s();
    assert!(
        (learned / effective - 1.0).abs() < 0.1,
        "{learned} vs {effective}"
    );
    assert!(
        (kept / effective - 1.0).abs() < 0.1,
        "{kept} vs {effective}"
    );
}

#[test]
fn invalidated_path_recomputes_then_recovers() {
    let mut sim = Sim::new(
        SimParams::default(),
        CostModelConfig::default(),
        link(100.0),
        PREFILL_TP1,
    );
    sim.run_for(20 * S);
    let before = sim.threshold();
    let ch = sim.model.invalidate_peer(PEER, sim.now, "eth1 down");
    assert_eq!(ch.len(), 1);
    assert_eq!(
        sim.threshold(),
        CostModelConfig::default().max_threshold_tokens
    );
    assert_eq!(sim.explain().state, ThresholdState::Invalidated);
    assert!(sim.model.pair_thresholds(S)[0].model.is_none());
    sim.run_for(10 * S);
    assert_eq!(sim.explain().state, ThresholdState::Estimated);
    assert!(
        rel_err(sim.threshold(), before) <= 0.15,
        "{} vs {before}",
        sim.threshold()
    );
    let kinds: Vec<_> = sim
        .explain()
        .history
        .iter()
        .map(|h| h.reason.clone())
        .collect();
    let inv = kinds
        .iter()
        .position(|k| matches!(k, ChangeReason::PathInvalidated { .. }))
        .expect("invalidation");
    assert!(
        matches!(kinds[inv + 1], ChangeReason::FirstEstimate),
        "{kinds:?}"
    );
}

#[test]
fn explain_renders_and_serializes() {
    let r = step_convergence(
        SimParams::default(),
        PREFILL_TP1,
        40.0,
        4.0,
        30 * S,
        15 * S,
        CostModelConfig::default(),
    );
    let ex = r.sim.explain();
    let text = ex.to_string();
    for needle in [
        "threshold:",
        "transfer:",
        "prefill:",
        "ActiveProbe",
        "Ebpf",
        "change detected",
        "history",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let json = serde_json::to_string(&ex).unwrap();
    let back: Explain = serde_json::from_str(&json).unwrap();
    assert_eq!(back.threshold_tokens, ex.threshold_tokens);
    assert!(
        ex.history.len() >= 2,
        "first estimate + step: {:?}",
        ex.history
    );
}

#[test]
fn bad_samples_are_rejected_with_the_field_named() {
    let mut m = CostModel::new(CostModelConfig::default()).unwrap();
    let ok = TransferSample {
        at: Instant::ZERO,
        bytes: 1,
        descriptors: 1,
        latency: Duration::from_micros(5),
        source: SampleSource::Userspace,
    };
    let e = m
        .record_transfer("x", Direction::Inbound, TransferSample { bytes: 0, ..ok })
        .unwrap_err();
    assert!(e.to_string().contains("`bytes`"), "{e}");
    let e = m
        .record_transfer(
            "x",
            Direction::Inbound,
            TransferSample {
                latency: Duration::ZERO,
                ..ok
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("`latency`"), "{e}");
    let e = m.record_transfer("", Direction::Inbound, ok).unwrap_err();
    assert!(e.to_string().contains("`peer`"), "{e}");
    let p = PrefillSample {
        at: Instant::ZERO,
        prompt_tokens: 10,
        reused_tokens: 10,
        latency: Duration::from_millis(1),
        source: SampleSource::Ebpf,
    };
    let e = m.record_prefill("p", p).unwrap_err();
    assert!(e.to_string().contains("`reused_tokens`"), "{e}");
    let spec = PairSpec {
        prefill_engine_id: "p".into(),
        decode_engine_id: "d".into(),
        decode_peer: "n".into(),
        shape: KvShape {
            bytes_per_token: 1,
            block_size_tokens: 0,
            regions_per_block: 1,
        },
    };
    let e = m.upsert_pair(spec).unwrap_err();
    assert!(e.to_string().contains("block_size_tokens"), "{e}");
}
