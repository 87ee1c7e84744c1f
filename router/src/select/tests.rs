use super::*;
use crate::thresholds::ThresholdSource;

fn model(xfer_per_token: f64) -> CostModelCoefficients {
    CostModelCoefficients {
        xfer_fixed_ms: 1.0,
        xfer_ms_per_token: xfer_per_token,
        prefill_ms_per_token: 0.01,
        prefill_ms_per_token_ctx: 0.000_01,
        confidence: 0.9,
        abandons_slow_reads: false,
        notices_abandoned_pulls: false,
        notices_read_pulls: false,
    }
}

fn eff(m: Option<CostModelCoefficients>) -> Effective {
    Effective {
        threshold_tokens: 64,
        source: if m.is_some() {
            ThresholdSource::Pushed
        } else {
            ThresholdSource::Static
        },
        model: m,
    }
}

fn p(index: u16, outstanding_tokens: u64) -> PrefillView {
    PrefillView {
        index,
        healthy: true,
        outstanding_tokens,
        measured_ms_per_token: None,
        queue_ms: None,
    }
}

fn d(index: u16, inflight_streams: u32, kv_usage: Option<f64>) -> DecodeView {
    DecodeView {
        index,
        healthy: true,
        inflight_streams,
        kv_usage,
    }
}

fn turn(prompt: u64, reusable: u64) -> TurnView {
    TurnView {
        prompt_tokens: prompt,
        reusable_tokens: reusable,
        prev_decode: (reusable > 0).then_some(2),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// P0, P1; D2 (the previous D), D3. The path D2 → P0 is slow (0.1 ms per
/// token, about 200 Mbit/s at 2.5 kB per token), D2 → P1 fast.
fn heterogeneous(pp: u16, dd: u16) -> Effective {
    match (pp, dd) {
        (0, 2) => eff(Some(model(0.1))),
        (1, 2) => eff(Some(model(0.001))),
        _ => eff(Some(model(0.01))),
    }
}

#[test]
fn round_robin_rotates_skips_unhealthy_and_uses_the_threshold() {
    let mut ps = vec![p(0, 0), p(1, 0), p(2, 0)];
    ps[1].healthy = false;
    let ds = [d(3, 9, None), d(4, 0, None)];
    let sel =
        |rr, t: &TurnView| select(Policy::RoundRobin, &ps, &ds, t, |_, _| eff(None), rr).unwrap();
    let s = sel(0, &turn(500, 100));
    assert_eq!(
        (s.prefill, s.decode, s.pull, s.reason),
        (0, 3, true, SelectReason::RoundRobin)
    );
    let s = sel(1, &turn(500, 10));
    assert_eq!(
        (s.prefill, s.decode, s.pull),
        (2, 4, false),
        "10 < 64 tokens: recompute"
    );
    assert_eq!((s.chosen, s.runner_up), (None, None));
}

#[test]
fn no_healthy_engine_is_an_error_naming_the_role() {
    let mut ps = [p(0, 0)];
    let mut ds = [d(1, 0, None)];
    ds[0].healthy = false;
    let e = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(10, 0),
        |_, _| eff(None),
        0,
    );
    assert_eq!(e.unwrap_err().role, "decode");
    ps[0].healthy = false;
    let e = select(
        Policy::RoundRobin,
        &ps,
        &ds,
        &turn(10, 0),
        |_, _| eff(None),
        0,
    );
    assert_eq!(e.unwrap_err().to_string(), "no healthy prefill engine");
}

#[test]
fn without_valid_models_predicted_falls_back_to_round_robin_and_threshold() {
    let ps = [p(0, 0), p(1, 0)];
    let ds = [d(2, 0, None), d(3, 0, None)];
    // No P has a model.
    let none = |_, _| eff(None);
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(500, 100), none, 1).unwrap();
    assert_eq!((s.prefill, s.reason), (1, SelectReason::FallbackNoModel));
    assert!(s.pull, "threshold rule: 100 ≥ 64");
    // P1 has no model at all: it borrows P0's to cost its recompute (100
    // tokens: 1.05 ms), cheaper than P0's pull (1 + 0.1 ms).
    let only_p0 = |pp: u16, _| eff((pp == 0).then(|| model(0.001)));
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(500, 100), only_p0, 1).unwrap();
    assert_eq!(
        (s.prefill, s.pull, s.reason),
        (1, false, SelectReason::PredictedRecompute)
    );
    // ... at its own measured cost per token where the router has one.
    let mut slow_p1 = ps;
    slow_p1[1].measured_ms_per_token = Some(0.1);
    let s = select(
        Policy::PredictedTtft,
        &slow_p1,
        &ds,
        &turn(500, 100),
        only_p0,
        1,
    )
    .unwrap();
    assert_eq!(s.prefill, 0, "P1 computes 10× slower");
    // Confidence below the minimum counts as no model.
    let weak = |_, _| {
        let mut m = model(0.001);
        m.confidence = SELECT_MIN_CONFIDENCE / 2.0;
        eff(Some(m))
    };
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(500, 100), weak, 0).unwrap();
    assert_eq!(s.reason, SelectReason::FallbackNoModel);
    // Compute models everywhere, but none for the path from the previous D.
    let no_path = |_, dd: u16| eff((dd != 2).then(|| model(0.001)));
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(500, 100), no_path, 0).unwrap();
    assert_eq!(s.reason, SelectReason::FallbackNoModel);
    // A path model from one P only: the other P keeps its recompute option.
    let p0_path = |pp: u16, dd: u16| eff((dd != 2 || pp == 0).then(|| model(0.001)));
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(5000, 4000),
        p0_path,
        1,
    )
    .unwrap();
    assert_eq!((s.prefill, s.reason), (0, SelectReason::PredictedPull));
    let mut busy = ps;
    busy[0].queue_ms = Some(10_000.0);
    let s = select(
        Policy::PredictedTtft,
        &busy,
        &ds,
        &turn(500, 100),
        p0_path,
        0,
    )
    .unwrap();
    assert_eq!(
        (s.prefill, s.pull, s.reason),
        (1, false, SelectReason::PredictedRecompute),
        "P0's queue outweighs P1 recomputing; P1 has no pull option"
    );
    // ... which is fine when there is nothing to pull.
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(500, 0), no_path, 0).unwrap();
    assert_eq!(s.reason, SelectReason::PredictedRecompute);
}

#[test]
fn queue_sends_the_turn_to_the_idle_prefill_engine() {
    let mut ps = [p(0, 10_000), p(1, 0)];
    let ds = [d(2, 0, None)];
    let m = |_, _| {
        eff(Some(CostModelCoefficients {
            prefill_ms_per_token_ctx: 0.0,
            ..model(0.01)
        }))
    };
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(1000, 0), m, 0).unwrap();
    assert_eq!(
        (s.prefill, s.pull, s.reason),
        (1, false, SelectReason::PredictedRecompute)
    );
    let (c, r) = (s.chosen.unwrap(), s.runner_up.unwrap());
    assert!(close(c.ttft_ms, 10.0) && close(c.queue_ms, 0.0), "{c:?}");
    assert_eq!(r.prefill, 0);
    assert!(close(r.ttft_ms, 110.0) && close(r.queue_ms, 100.0), "{r:?}");
    // The measured rate replaces the model's for the queue: P1 measured slow.
    ps[1].outstanding_tokens = 1_000;
    ps[1].measured_ms_per_token = Some(0.5);
    let s = select(Policy::PredictedTtft, &ps, &ds, &turn(1000, 0), m, 0).unwrap();
    assert_eq!(s.prefill, 0);
    assert!(close(s.runner_up.unwrap().queue_ms, 500.0));
}

#[test]
fn pull_and_prefill_engine_are_chosen_jointly() {
    let ps = [p(0, 0), p(1, 0)];
    let ds = [d(2, 0, None), d(3, 0, None)];
    // r = 1800 reusable of 2000: recompute 1800·(0.01 + 1e-5·900) = 34.2 ms,
    // suffix 200·(0.01 + 1e-5·1900) = 5.8 ms; pull via P1 1 + 1.8 = 2.8 ms,
    // via P0 1 + 180 = 181 ms.
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(2000, 1800),
        heterogeneous,
        0,
    )
    .unwrap();
    assert_eq!(
        (s.prefill, s.pull, s.reason),
        (1, true, SelectReason::PredictedPull)
    );
    let c = s.chosen.unwrap();
    assert!(
        close(c.reuse_ms, 2.8) && close(c.suffix_ms, 5.8) && close(c.ttft_ms, 8.6),
        "{c:?}"
    );
    let r = s.runner_up.unwrap();
    assert_eq!(
        (r.prefill, r.pull),
        (0, false),
        "tie of the recomputes: round-robin order"
    );
    assert!(close(r.ttft_ms, 40.0), "{r:?}");
    // P1 now has 50 ms of queue: recomputing on P0 (40 ms) beats pulling
    // through P1 (58.6 ms) and pulling over the slow path (186.8 ms).
    let ps = [p(0, 0), p(1, 5_000)];
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(2000, 1800),
        heterogeneous,
        0,
    )
    .unwrap();
    assert_eq!(
        (s.prefill, s.pull, s.reason),
        (0, false, SelectReason::PredictedRecompute)
    );
    let r = s.runner_up.unwrap();
    assert_eq!((r.prefill, r.pull), (1, true));
    assert!(close(r.ttft_ms, 58.6), "{r:?}");
}

#[test]
fn short_prefix_recomputes_when_the_read_costs_more() {
    let ps = [p(0, 0)];
    let ds = [d(2, 0, None)];
    // 40 tokens: recompute 40·(0.01 + 1e-5·20) = 0.408 ms < 1 + 0.04 ms pull.
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(100, 40),
        heterogeneous,
        0,
    )
    .unwrap();
    assert_eq!(
        (s.pull, s.reason),
        (false, SelectReason::PredictedRecompute)
    );
    let r = s.runner_up.unwrap();
    assert!(r.pull && close(r.reuse_ms, 1.0 + 40.0 * 0.1), "{r:?}");
}

#[test]
fn decode_engine_by_load() {
    let ps = [p(0, 0)];
    let m = |_, _| eff(Some(model(0.001)));
    let pick = |ds: &[DecodeView], rr| {
        select(Policy::PredictedTtft, &ps, ds, &turn(100, 0), m, rr)
            .unwrap()
            .decode
    };
    let mut ds = vec![
        d(1, 3, None),
        d(2, 1, Some(1.0)),
        d(3, 1, Some(0.1)),
        d(4, 1, None),
        d(5, 1, Some(0.6)),
    ];
    assert_eq!(pick(&ds, 0), 3, "fewest streams, not full, lowest KV usage");
    ds[2].healthy = false;
    assert_eq!(pick(&ds, 0), 5);
    ds[4].healthy = false;
    assert_eq!(pick(&ds, 0), 4, "free blocks unknown beats a full engine");
    let even = [d(1, 0, None), d(2, 0, None), d(3, 0, None)];
    assert_eq!(
        [pick(&even, 0), pick(&even, 1), pick(&even, 5)],
        [1, 2, 3],
        "ties: round robin"
    );
}

#[test]
fn every_decision_is_explained() {
    let ps = [p(0, 0), p(1, 0)];
    let ds = [d(2, 0, None), d(3, 0, None)];
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(2000, 1800),
        heterogeneous,
        0,
    )
    .unwrap();
    // What the route line prints (its format: `crate::explain`'s tests):
    // reason=predicted_pull prefill=e1 decode=e2 action=pull
    // chosen=(e1 pull ttft=8.600ms queue=0.000 reuse=2.800 suffix=5.800)
    // runner_up=(e0 recompute ttft=40.000ms queue=0.000 reuse=34.200 suffix=5.800)
    assert_eq!(
        (s.reason, s.prefill, s.decode, s.pull),
        (SelectReason::PredictedPull, 1, 2, true)
    );
    let ms = |p: &Prediction| {
        let r = |v: f64| (v * 1000.0).round() / 1000.0;
        (
            p.prefill,
            p.pull,
            r(p.ttft_ms),
            r(p.queue_ms),
            r(p.reuse_ms),
            r(p.suffix_ms),
        )
    };
    assert_eq!(ms(&s.chosen.unwrap()), (1, true, 8.6, 0.0, 2.8, 5.8));
    assert_eq!(ms(&s.runner_up.unwrap()), (0, false, 40.0, 0.0, 34.2, 5.8));
    let names: Vec<_> = SelectReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        names,
        [
            "round_robin",
            "predicted_pull",
            "predicted_recompute",
            "fallback_no_model"
        ]
    );
}

#[test]
fn selection_is_deterministic() {
    let ps = [p(0, 123), p(1, 77), p(2, 0)];
    let ds = [d(3, 2, Some(0.5)), d(4, 2, Some(0.5))];
    let run = || {
        select(
            Policy::PredictedTtft,
            &ps,
            &ds,
            &turn(3000, 2500),
            heterogeneous,
            7,
        )
        .unwrap()
    };
    let first = run();
    for _ in 0..100 {
        assert_eq!(run(), first);
    }
}

#[test]
fn a_pull_carries_the_deadline_at_which_p_agent_abandons_it() {
    let ps = [p(0, 0)];
    let ds = [d(2, 0, None)];
    // 10,000 reusable of 10,100: READ 1 + 10,000 × 0.001 = 11 ms; recompute
    // 10,000 × (0.01 + 0.000_01 × 5,000) = 600 ms; suffix 100 × (0.01 +
    // 0.000_01 × 10,050) = 11.05 ms.
    let abandoning = CostModelCoefficients {
        abandons_slow_reads: true,
        notices_abandoned_pulls: false,
        notices_read_pulls: false,
        ..model(0.001)
    };
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(10_100, 10_000),
        |_, _| eff(Some(abandoning.clone())),
        0,
    )
    .unwrap();
    assert!(s.pull);
    let a = s.chosen.unwrap().abandon.expect("the agent abandons");
    // Foreseen abandoned at its first overdue mark (11 + 100 ms: where
    // the agent cuts a READ whose progress shows the path slowed, before
    // recomputing would have finished at 600 ms); then P computes the
    // whole prompt.
    assert!(close(a.after_ms, 111.0), "{a:?}");
    assert!(close(a.compute_ms, 600.0 + 11.05), "{a:?}");
    // The recompute option has none; nor has a pull from an agent that
    // does not abandon.
    assert_eq!(s.runner_up.unwrap().abandon, None);
    let s = select(
        Policy::PredictedTtft,
        &ps,
        &ds,
        &turn(10_100, 10_000),
        |_, _| eff(Some(model(0.001))),
        0,
    )
    .unwrap();
    assert_eq!(s.chosen.unwrap().abandon, None);
}

#[test]
fn a_pull_says_whether_p_agent_notices_its_read_end() {
    let ps = [p(0, 0)];
    let ds = [d(2, 0, None)];
    let pick = |notices_read_pulls| {
        let m = CostModelCoefficients {
            notices_read_pulls,
            ..model(0.001)
        };
        select(
            Policy::PredictedTtft,
            &ps,
            &ds,
            &turn(10_100, 10_000),
            |_, _| eff(Some(m.clone())),
            0,
        )
        .unwrap()
    };
    let s = pick(true);
    assert!(s.pull && s.chosen.unwrap().read_noticed);
    let runner_up = s.runner_up.unwrap();
    assert!(
        !runner_up.pull && !runner_up.read_noticed,
        "a recompute READs nothing"
    );
    assert!(!pick(false).chosen.unwrap().read_noticed);
}
