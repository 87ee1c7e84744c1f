//! Property tests: the fits never panic and never produce NaN, whatever the input.

use kvloop_costmodel::*;
use proptest::prelude::*;
use std::time::Duration;

fn source() -> impl Strategy<Value = SampleSource> {
    prop_oneof![
        Just(SampleSource::Ebpf),
        Just(SampleSource::Userspace),
        Just(SampleSource::ActiveProbe)
    ]
}

/// (time offset ms, bytes, descriptors, latency ns, source)
fn transfer() -> impl Strategy<Value = (u64, u64, u64, u64, SampleSource)> {
    (
        0u64..200_000,
        prop_oneof![1u64..1_000, 1u64..1 << 40, Just(u64::MAX)],
        prop_oneof![1u64..10, 1u64..u64::MAX],
        prop_oneof![1u64..1_000, 1u64..10_000_000_000, Just(u64::MAX)],
        source(),
    )
}

/// (time offset ms, prompt, reused fraction, latency ns)
fn prefill() -> impl Strategy<Value = (u64, u64, f64, u64)> {
    (
        0u64..200_000,
        prop_oneof![1u64..100, 1u64..1 << 20, Just(u64::MAX)],
        0.0f64..1.0,
        prop_oneof![1u64..1_000, 1u64..100_000_000_000, Just(u64::MAX)],
    )
}

fn check(m: &CostModel, now: Instant) -> Result<(), TestCaseError> {
    let cfg = m.config().clone();
    for pt in m.pair_thresholds(Duration::from_secs(10)) {
        prop_assert!(
            pt.threshold_tokens >= cfg.min_threshold_tokens
                && pt.threshold_tokens <= cfg.max_threshold_tokens
        );
        if let Some(c) = &pt.model {
            for v in [
                c.xfer_fixed_ms,
                c.xfer_ms_per_token,
                c.prefill_ms_per_token,
                c.prefill_ms_per_token_ctx,
            ] {
                prop_assert!(v.is_finite() && v >= 0.0, "{c:?}");
            }
            prop_assert!((0.0..=1.0).contains(&c.confidence), "{c:?}");
        }
    }
    let ex = m.explain("p", "d", now).expect("pair");
    prop_assert!(ex.confidence.is_finite());
    if let Some(b) = ex.break_even_tokens {
        prop_assert!(b.is_finite() && b >= 0.0);
    }
    if let Some(se) = ex.break_even_se_rel {
        prop_assert!(se.is_finite() && se >= 0.0);
    }
    serde_json::to_string(&ex).expect("serializes");
    let _ = ex.to_string();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn fits_never_panic_or_nan(
        xs in prop::collection::vec(transfer(), 0..120),
        ps in prop::collection::vec(prefill(), 0..120),
        updates in prop::collection::vec(0u64..400_000, 1..8),
    ) {
        let mut m = CostModel::new(CostModelConfig::default()).unwrap();
        m.upsert_pair(PairSpec {
            prefill_engine_id: "p".into(),
            decode_engine_id: "d".into(),
            decode_peer: "n".into(),
            shape: KvShape { bytes_per_token: 262_144, block_size_tokens: 16, regions_per_block: 128 },
        }).unwrap();
        for (t, bytes, descriptors, lat, source) in xs {
            let s = TransferSample {
                at: Instant::from_millis(t),
                bytes,
                descriptors,
                latency: Duration::from_nanos(lat),
                source,
            };
            m.record_transfer("n", Direction::Inbound, s).unwrap();
        }
        for (t, prompt, frac, lat) in ps {
            let reused = ((prompt as f64 * frac) as u64).min(prompt - 1);
            let s = PrefillSample {
                at: Instant::from_millis(t),
                prompt_tokens: prompt,
                reused_tokens: reused,
                latency: Duration::from_nanos(lat),
                source: SampleSource::Ebpf,
            };
            m.record_prefill("p", s).unwrap();
        }
        let mut updates = updates;
        updates.sort();
        for u in updates {
            let now = Instant::from_millis(u);
            m.update(now);
            check(&m, now)?;
        }
    }

    #[test]
    fn break_even_never_nan(x0 in any::<f64>(), x1 in any::<f64>(), k1 in any::<f64>(), k2 in any::<f64>()) {
        let c = CostModelCoefficients {
            xfer_fixed_ms: x0,
            xfer_ms_per_token: x1,
            prefill_ms_per_token: k1,
            prefill_ms_per_token_ctx: k2,
            confidence: 1.0,
            abandons_slow_reads: false,
            notices_abandoned_pulls: false,
            notices_read_pulls: false,
        };
        let r = break_even_tokens(&c);
        prop_assert!(!r.is_nan() && r >= 0.0, "{c:?} -> {r}");
        let t = clamp_threshold(r, 16, 131_072);
        prop_assert!((16..=131_072).contains(&t));
        let se = break_even_se_tokens(&c, [[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]);
        prop_assert!(se.is_finite() && se >= 0.0);
    }
}
