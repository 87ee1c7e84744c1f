//! `policy = "predicted_ttft"` on the request path, against real engine-sims:
//! with cost models pushed for both (P, D) pairs, the turn that can reuse
//! D's blocks is pulled through the prefill engine whose path from D is fast.
mod common;

use common::*;
use kvloop_router::config::Policy;
use kvloop_router_api::{CostModelCoefficients, PairThreshold, ThresholdUpdate};
use serde_json::json;

fn pair(p: &str, xfer_ms_per_token: f64) -> PairThreshold {
    PairThreshold {
        prefill_engine_id: p.into(),
        decode_engine_id: "d0".into(),
        threshold_tokens: 64,
        valid_for_ms: 3_600_000,
        model: Some(CostModelCoefficients {
            xfer_fixed_ms: 0.01,
            xfer_ms_per_token,
            // the sims compute 1 µs per token
            prefill_ms_per_token: 0.001,
            prefill_ms_per_token_ctx: 0.0,
            confidence: 1.0,
            abandons_slow_reads: false,
            notices_abandoned_pulls: false,
            notices_read_pulls: false,
        }),
    }
}

#[tokio::test]
async fn predicted_ttft_pulls_over_the_fast_path() {
    let c = Cluster::start(Opts {
        n_prefill: 2,
        tweak: |cfg| cfg.policy = Policy::PredictedTtft,
        ..Opts::default()
    })
    .await;
    let url = format!("{}{}", c.router.url(), kvloop_router_api::THRESHOLDS_PATH);
    let push = ThresholdUpdate {
        agent_url: None,
        agent_id: "node-a".into(),
        seq: 1,
        // D → p0 slow (0.1 ms per token), D → p1 fast.
        pairs: vec![pair("p0", 0.1), pair("p1", 0.000_01)],
    };
    let r = c
        .http
        .put(&url)
        .bearer_auth(TOKEN)
        .json(&push)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    // One lone turn first, so that round robin would send every turn 2 to p0.
    let (st, _) = c.chat(None, "warm", &[user("hi")], false, json!({})).await;
    assert_eq!(st, 200);
    for conv in ["conv-a", "conv-b", "conv-c"] {
        let m1 = vec![user(&words(100, "a"))];
        let (st, a1) = c.chat(None, conv, &m1, false, json!({})).await;
        assert_eq!(st, 200, "{a1}");
        let m2 = vec![m1[0].clone(), assistant(&a1), user(&words(20, "b"))];
        let (st, _) = c.chat(None, conv, &m2, true, json!({})).await;
        assert_eq!(st, 200);
    }
    assert_eq!(c.metric(PULLED).await, 3.0);
    assert_eq!(c.p_stats(1).reads_ok, 3, "every pull went through p1");
    assert_eq!(c.p_stats(0).reads_ok, 0);
}

#[tokio::test]
async fn predicted_ttft_without_models_falls_back_to_round_robin_and_threshold() {
    let c = Cluster::start(Opts {
        n_prefill: 2,
        tweak: |cfg| cfg.policy = Policy::PredictedTtft,
        ..Opts::default()
    })
    .await;
    for conv in ["conv-a", "conv-b"] {
        let m1 = vec![user(&words(100, "a"))];
        let (st, a1) = c.chat(None, conv, &m1, false, json!({})).await;
        assert_eq!(st, 200, "{a1}");
        let m2 = vec![m1[0].clone(), assistant(&a1), user(&words(20, "b"))];
        assert_eq!(c.chat(None, conv, &m2, false, json!({})).await.0, 200);
    }
    assert_eq!(c.metric(PULLED).await, 2.0, "109 reusable ≥ static 64");
    assert_eq!(c.p_stats(0).reads_ok + c.p_stats(1).reads_ok, 2);
}

#[tokio::test]
async fn predicted_ttft_without_models_alternates_the_prefill_engines() {
    // Without a model every turn falls back to round robin. The `/tokenize`
    // pick steps its own counter: with two prefill engines, sharing it
    // sent every fallback turn to the same one.
    let c = Cluster::start(Opts {
        n_prefill: 2,
        tweak: |cfg| cfg.policy = Policy::PredictedTtft,
        ..Opts::default()
    })
    .await;
    for i in 0..6 {
        let m = vec![user(&words(50, &format!("t{i}")))];
        let (st, a) = c
            .chat(None, &format!("conv-{i}"), &m, false, json!({}))
            .await;
        assert_eq!(st, 200, "{a}");
    }
    let (p0, p1) = (c.p_stats(0).requests, c.p_stats(1).requests);
    assert_eq!((p0, p1), (3, 3), "six first turns alternate over p0 and p1");
}

#[tokio::test]
async fn pull_notices_are_authenticated_and_validated() {
    let c = Cluster::start(Opts::default()).await;
    for (path, cause, metric) in [
        (
            kvloop_router_api::PULL_ABANDONED_PATH,
            "abandoned",
            "kvloop_router_pull_notices_total",
        ),
        (
            kvloop_router_api::PULL_READ_PATH,
            "read",
            "kvloop_router_pull_read_notices_total",
        ),
    ] {
        let url = format!("{}{path}", c.router.url());
        let notice = json!({"agent_id": "node-a", "prefill_engine_id": "p0",
            "decode_engine_id": "d0", "decode_request_id": "cmpl-1",
            "after_ms": 127, "cause": cause});
        let send = |token: &'static str, body: serde_json::Value| {
            c.http.post(&url).bearer_auth(token).json(&body).send()
        };
        assert_eq!(send("wrong", notice.clone()).await.unwrap().status(), 401);
        let mut bad = notice.clone();
        bad["after_ms"] = json!("soon");
        let r = send(TOKEN, bad).await.unwrap();
        assert_eq!(r.status(), 400, "{path}");
        let text = r.text().await.unwrap();
        assert!(text.contains("body.after_ms: expected"), "{text}");
        // No such pull outstanding here (another replica's): accepted, counted.
        assert_eq!(send(TOKEN, notice).await.unwrap().status(), 204);
        for (reason, n) in [("unknown", 1.0), ("rejected", 1.0), ("unauthorized", 1.0)] {
            let series = format!("{metric}{{reason=\"{reason}\"}}");
            assert_eq!(c.metric(&series).await, n, "{series}");
        }
    }
    // The router keeps serving.
    let (st, _) = c.chat(None, "after", &[user("hi")], false, json!({})).await;
    assert_eq!(st, 200);
}
