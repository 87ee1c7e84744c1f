//! One test per router rule of docs/protocol.md, each with its failure case,
//! against real engine-sims on loopback sockets.
mod common;

use common::*;
use kvloop_router_api::{PairThreshold, ThresholdUpdate};
use serde_json::{Value, json};

/// Turn 1 and the messages of turn 2 that extend it.
async fn first_turn(c: &Cluster, tenant: Option<&str>, conv: &str, stream: bool) -> Vec<Value> {
    let m1 = vec![user(&words(100, "a"))];
    let (st, a1) = c.chat(tenant, conv, &m1, stream, json!({})).await;
    assert_eq!(st, 200, "{a1}");
    assert_eq!(a1, "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7");
    vec![m1[0].clone(), assistant(&a1), user(&words(20, "b"))]
}

#[tokio::test]
async fn multi_turn_pulls_with_token_check_and_tokens_header() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-1", false).await;
    assert_eq!(c.metric(NO_ENTRY).await, 1.0);
    assert_eq!(c.metric("kvloop_router_store_entries").await, 1.0);
    assert_eq!(
        c.p_stats(0).last_tokens_header.as_deref(),
        Some("prompt=102,reused=0")
    );
    let (st, _) = c.chat(None, "conv-1", &m2, false, json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(c.metric(PULLED).await, 1.0);
    // D held 102 prompt + 8 generated − 1 = 109 tokens; turn 2 has 132 tokens.
    assert_eq!(
        c.p_stats(0).last_tokens_header.as_deref(),
        Some("prompt=132,reused=109")
    );
    assert_eq!(c.p_stats(0).reads_ok, 1);
    assert_eq!(c.p_stats(0).reused_tokens, 109);
    assert_eq!(
        c.d_stats(0).side_reads_served,
        1,
        "D's blocks read once by P"
    );
    let h: Value = c.get_json("/health").await;
    assert_eq!(h["prefix_check"], "tokens");
}

#[tokio::test]
async fn replayed_params_are_never_attached_twice() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-r", false).await;
    // Turn 2 takes D's params, then D fails: nothing new is stored.
    let (st, _) = c
        .chat(None, "conv-r", &m2, false, json!({"fail_decode": true}))
        .await;
    assert_eq!(st, 502);
    assert_eq!(c.metric(PULLED).await, 1.0);
    // The client retries turn 2: the consumed params must not be attached again.
    let (st, _) = c.chat(None, "conv-r", &m2, false, json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(c.metric(PULLED).await, 1.0, "single use");
    assert_eq!(c.metric(NO_ENTRY).await, 2.0);
    assert_eq!(c.p_stats(0).reads_ok, 1);
    assert_eq!(c.p_stats(0).reads_declined, 0);
}

#[tokio::test]
async fn two_concurrent_turns_of_one_conversation_attach_once() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-c", false).await;
    let (a, b) = tokio::join!(
        c.chat(None, "conv-c", &m2, false, json!({})),
        c.chat(None, "conv-c", &m2, true, json!({}))
    );
    assert_eq!((a.0, b.0), (200, 200));
    assert_eq!(c.metric(PULLED).await, 1.0);
    assert_eq!(c.metric(NO_ENTRY).await, 2.0);
    assert_eq!(c.p_stats(0).reads_ok, 1);
    assert_eq!(
        c.p_stats(0).reads_declined,
        0,
        "no READ of already-read blocks"
    );
}

#[tokio::test]
async fn edited_history_is_recomputed() {
    let c = Cluster::start(Opts::default()).await;
    let mut m2 = first_turn(&c, None, "conv-e", false).await;
    m2[0] = user(&words(100, "A")); // the client rewrote turn 1
    let (st, _) = c.chat(None, "conv-e", &m2, false, json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(c.metric(MISMATCH).await, 1.0);
    assert_eq!(c.metric(PULLED).await, 0.0);
    assert_eq!(c.p_stats(0).reads_ok, 0);
    // An edited assistant answer (same prompt tokens, other generated tail) too.
    let mut m3 = first_turn(&c, None, "conv-e2", false).await;
    m3[1] = assistant("tok0 tok1 EDITED tok3 tok4 tok5 tok6 tok7");
    c.chat(None, "conv-e2", &m3, false, json!({})).await;
    assert_eq!(c.metric(MISMATCH).await, 2.0);
}

#[tokio::test]
async fn edited_history_is_recomputed_in_history_mode() {
    let c = Cluster::start(Opts {
        no_tokenize: true,
        ..Opts::default()
    })
    .await;
    let mut m2 = first_turn(&c, None, "conv-h", false).await;
    let h: Value = c.get_json("/health").await;
    assert_eq!(h["prefix_check"], "history", "fallback is reported");
    assert_eq!(
        c.metric("kvloop_router_prefix_check_mode{mode=\"history\"}")
            .await,
        1.0
    );
    assert_eq!(
        c.p_stats(0).last_tokens_header,
        None,
        "N unknown: no header"
    );
    let good = m2.clone();
    m2[1] = assistant("something else");
    c.chat(None, "conv-h", &m2, false, json!({})).await;
    assert_eq!(c.metric(MISMATCH).await, 1.0);
    // Unedited history still pulls by message comparison.
    let m2b = first_turn(&c, None, "conv-h2", false).await;
    assert_eq!(m2b, good);
    c.chat(None, "conv-h2", &m2b, false, json!({})).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
}

#[tokio::test]
async fn prompt_shorter_than_remote_num_tokens_is_not_attached() {
    let c = Cluster::start(Opts::default()).await;
    let url = format!("{}/v1/completions", c.router.url());
    let t1: Vec<u32> = (0..100).collect();
    let body = |prompt: &Vec<u32>| json!({"model": "sim-model", "prompt": prompt, "max_tokens": 16, "conversation_id": "conv-s"});
    let (st, _) = post(&c.http, &url, None, &body(&t1), false).await;
    assert_eq!(st, 200);
    // D holds 100 + 16 − 1 = 115 tokens. 110 tokens extend the prompt but are fewer.
    let t2: Vec<u32> = (0..110).collect();
    post(&c.http, &url, None, &body(&t2), false).await;
    assert_eq!(c.metric(MISMATCH).await, 1.0);
    assert_eq!(c.p_stats(0).reads_ok, 0);
    // Turn 2 replaced the entry: D now holds 110 + 15 = 125 tokens.
    // 130 tokens extending turn 2: attached, P reads min(125, 130) = 125.
    let t3: Vec<u32> = (0..130).collect();
    post(&c.http, &url, None, &body(&t3), false).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
    assert_eq!(c.p_stats(0).reused_tokens, 125);
}

#[tokio::test]
async fn streaming_forwards_chunks_and_captures_params_from_final_chunk() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-st", true).await;
    assert_eq!(c.metric("kvloop_router_store_entries").await, 1.0);
    let (st, _) = c.chat(None, "conv-st", &m2, true, json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(c.metric(PULLED).await, 1.0);
    // D's params never reach the client (issue 12 item 1): the params-only
    // chunk is dropped, every chunk left has a choice or usage, [DONE] passes.
    let r = c
        .http
        .post(format!("{}/v1/chat/completions", c.router.url()))
        .json(&json!({"model": "sim-model", "messages": [user("x y")], "stream": true, "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(!text.contains("kv_transfer_params"), "{text}");
    for d in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d != "[DONE]" {
            let v: Value = serde_json::from_str(d).unwrap();
            assert!(
                v["choices"].get(0).is_some() || !v["usage"].is_null(),
                "{d}"
            );
        }
    }
}

#[tokio::test]
async fn abnormal_or_rewritable_replies_are_not_stored() {
    let c = Cluster::start(Opts::default()).await;
    let m1 = vec![user(&words(100, "a"))];
    for (i, sim) in [
        json!({"reasoning": true}),
        json!({"tool_call": true}),
        json!({"truncate_stream": true}),
        json!({"finish_reason": "abort"}),
    ]
    .into_iter()
    .enumerate()
    {
        let (st, _) = c
            .chat(None, &format!("conv-ns{i}"), &m1, true, sim.clone())
            .await;
        assert_eq!(st, 200, "{sim}");
        if i != 2 {
            // (a truncated stream has no non-streaming counterpart)
            let (st, _) = c.chat(None, &format!("conv-nj{i}"), &m1, false, sim).await;
            assert_eq!(st, 200);
        }
    }
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
    assert!(
        c.metric("kvloop_router_store_skipped_total{reason=\"rewritable_output\"}")
            .await
            >= 4.0
    );
    assert_eq!(
        c.metric("kvloop_router_store_skipped_total{reason=\"incomplete_stream\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn expired_entries_are_not_attached() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-x", false).await;
    // Store TTL = 480 s − 30 s margin on the router's own clock.
    c.clock.advance(450_000);
    let (st, _) = c.chat(None, "conv-x", &m2, false, json!({})).await;
    assert_eq!(st, 200);
    assert_eq!(c.metric(EXPIRED).await, 1.0);
    assert_eq!(c.metric(PULLED).await, 0.0);
    // Just inside the TTL it is attached.
    let m2 = first_turn(&c, None, "conv-y", false).await;
    c.clock.advance(449_999);
    c.chat(None, "conv-y", &m2, false, json!({})).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
    // The sweeper drops expired entries and counts them.
    first_turn(&c, None, "conv-z", false).await;
    c.clock.advance(450_000);
    assert!(
        c.metric("kvloop_router_store_evictions_total{cause=\"expired\"}")
            .await
            >= 1.0
    );
}

#[tokio::test]
async fn tenants_are_isolated() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, Some("tenant-a"), "shared-id", false).await;
    c.chat(Some("tenant-b"), "shared-id", &m2, false, json!({}))
        .await;
    assert_eq!(c.metric(PULLED).await, 0.0);
    assert_eq!(c.metric(NO_ENTRY).await, 2.0);
    c.chat(Some("tenant-a"), "shared-id", &m2, false, json!({}))
        .await;
    assert_eq!(c.metric(PULLED).await, 1.0);
}

#[tokio::test]
#[ignore = "needs an IPv6 loopback (::1)"]
async fn ipv6_engines_get_bracketed_registry_hosts() {
    if let Err(e) = std::net::TcpListener::bind("[::1]:0") {
        panic!("ipv6_engines_get_bracketed_registry_hosts: needs an IPv6 loopback (::1): {e}");
    }
    let c = Cluster::start(Opts {
        ipv6: true,
        ..Opts::default()
    })
    .await;
    assert!(c.router.url().starts_with("http://[::1]:"));
    let m2 = first_turn(&c, None, "conv-6", false).await;
    // D got P's params with remote_host rewritten from the registry, bracketed.
    assert_eq!(
        c.d_stats(0).last_kv_transfer_params.unwrap()["remote_host"],
        "[::1]"
    );
    assert_eq!(c.d_stats(0).reads_ok, 1, "D read P's blocks via [::1]");
    c.chat(None, "conv-6", &m2, false, json!({})).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
    let p = c.p_stats(0);
    assert_eq!(p.last_kv_transfer_params.unwrap()["remote_host"], "[::1]");
    assert_eq!(
        p.reads_ok, 1,
        "P read D's blocks via [::1] (engine advertised an unroutable host)"
    );
}

#[tokio::test]
async fn prefill_failure_with_params_is_retried_once_without() {
    let c = Cluster::start(Opts::default()).await;
    let m2 = first_turn(&c, None, "conv-pf", false).await;
    let (st, a) = c
        .chat(
            None,
            "conv-pf",
            &m2,
            false,
            json!({"fail_prefill_with_params": true}),
        )
        .await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(c.metric("kvloop_router_prefill_retries_total").await, 1.0);
    // D's hold of turn 1 will not be read: released (counted only, no agent).
    assert_eq!(
        c.metric(r#"kvloop_router_retention_total{action="release",cause="pull_failed",result="unmanaged"}"#)
            .await,
        1.0
    );
    assert_eq!(
        c.p_stats(0).requests,
        3,
        "turn 1, turn 2 with params, retry without"
    );
    assert_eq!(
        c.p_stats(0).last_kv_transfer_params.unwrap()["remote_block_ids"],
        Value::Null
    );
    assert_eq!(
        c.p_stats(0).last_tokens_header.as_deref(),
        Some("prompt=132,reused=0")
    );
    // A prefill failure without params is not retried.
    let (st, _) = c
        .chat(None, "conv-pf2", &m2, false, json!({"fail_prefill": true}))
        .await;
    assert_eq!(st, 502);
    assert_eq!(c.metric("kvloop_router_prefill_retries_total").await, 1.0);
    assert_eq!(c.p_stats(0).requests, 4);
}

#[tokio::test]
async fn decode_failure_does_not_resend_prefill_params() {
    let c = Cluster::start(Opts {
        n_decode: 2,
        ..Opts::default()
    })
    .await;
    let (st, _) = c
        .chat(
            None,
            "conv-df",
            &[user("hello world")],
            false,
            json!({"fail_decode": true}),
        )
        .await;
    assert_eq!(st, 502);
    assert_eq!(
        c.d_stats(0).requests + c.d_stats(1).requests,
        1,
        "P's params went to exactly one D"
    );
    assert_eq!(
        c.p_stats(0).holds,
        1,
        "P's blocks stay under lease; nobody else read them"
    );
    assert_eq!(
        c.metric(
            "kvloop_router_requests_total{endpoint=\"chat_completions\",outcome=\"decode_error\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn params_from_unknown_engines_are_rejected() {
    let c = Cluster::start(Opts {
        misregister_prefill: true,
        ..Opts::default()
    })
    .await;
    let (st, body) = c
        .chat(None, "conv-u", &[user("hello")], false, json!({}))
        .await;
    assert_eq!(st, 502);
    assert!(
        body.contains("kv_transfer_params.remote_engine_id"),
        "{body}"
    );
    assert_eq!(c.d_stats(0).requests, 0);
}

#[tokio::test]
async fn pushed_threshold_applies_until_it_lapses() {
    let c = Cluster::start(Opts::default()).await;
    let url = format!("{}{}", c.router.url(), kvloop_router_api::THRESHOLDS_PATH);
    let push = |seq, thr| ThresholdUpdate {
        agent_url: None,
        agent_id: "node-a".into(),
        seq,
        pairs: vec![PairThreshold {
            prefill_engine_id: "p0".into(),
            decode_engine_id: "d0".into(),
            threshold_tokens: thr,
            valid_for_ms: 10_000,
            model: None,
        }],
    };
    let r = put(&c.http, &url, "wrong", &push(1, 100_000)).await;
    assert_eq!(r.status(), 401);
    let r = put(&c.http, &url, TOKEN, &push(2, 100_000)).await;
    assert_eq!(r.status(), 204);
    let r = put(&c.http, &url, TOKEN, &push(1, 1)).await;
    assert_eq!(r.status(), 204, "stale seq accepted but ignored");
    let mut bad = serde_json::to_value(push(3, 1)).unwrap();
    bad["pairs"][0]["decode_engine_id"] = json!("d9");
    let r = put(&c.http, &url, TOKEN, &bad).await;
    assert_eq!(r.status(), 400);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("pairs[0].decode_engine_id")
    );

    let m2 = first_turn(&c, None, "conv-t", false).await;
    c.chat(None, "conv-t", &m2, false, json!({})).await;
    assert_eq!(
        c.metric(BELOW).await,
        1.0,
        "109 reusable tokens < pushed 100000"
    );
    // After valid_for_ms the static threshold (64) applies again.
    let m2 = first_turn(&c, None, "conv-t2", false).await;
    c.clock.advance(10_000);
    c.chat(None, "conv-t2", &m2, false, json!({})).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
    let got: Value = c
        .http
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["pairs"][0]["in_force"], false);
}

#[tokio::test]
async fn client_supplied_params_get_400_naming_the_field() {
    let c = Cluster::start(Opts::default()).await;
    let url = format!("{}/v1/completions", c.router.url());
    let (st, body) = post(
        &c.http,
        &url,
        None,
        &json!({"prompt": "x", "kv_transfer_params": {"remote_engine_id": 5}}),
        false,
    )
    .await;
    assert_eq!(st, 400);
    assert!(
        body.contains("kv_transfer_params.remote_engine_id"),
        "{body}"
    );
    let (st, body) = post(
        &c.http,
        &url,
        None,
        &json!({"prompt": "x", "conversation_id": 5}),
        false,
    )
    .await;
    assert_eq!(st, 400);
    assert!(body.contains("conversation_id"), "{body}");
    let (st, _) = post(
        &c.http,
        &url,
        None,
        &json!({"prompt": "still serving"}),
        false,
    )
    .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn models_and_health_are_served() {
    let c = Cluster::start(Opts::default()).await;
    let m: Value = c.get_json("/v1/models").await;
    assert_eq!(m["data"][0]["id"], "sim-model");
    let (st, h) = c.get_status_json("/health").await;
    assert_eq!(st, 200, "{h}");
}

/// With `warmup_ms`, a new router is not ready (503, `warming`) until an
/// agent's first threshold push with a pair, yet it serves requests
/// meanwhile (with the static threshold); a push without pairs does not end
/// the warm-up.
#[tokio::test]
async fn warming_until_the_first_threshold_push() {
    let c = Cluster::start(Opts {
        tweak: |cfg| cfg.warmup_ms = 600_000,
        ..Opts::default()
    })
    .await;
    let (st, h) = c.get_status_json("/health").await;
    assert_eq!(st, 503, "{h}");
    assert_eq!(h["status"], "warming");
    assert!(h["warmup_left_ms"].as_u64().unwrap() > 590_000, "{h}");
    let (st, a) = c
        .chat(None, "conv-w", &[user(&words(20, "w"))], false, json!({}))
        .await;
    assert_eq!(st, 200, "served while warming: {a}");
    let url = format!("{}{}", c.router.url(), kvloop_router_api::THRESHOLDS_PATH);
    let mut u = ThresholdUpdate {
        agent_url: None,
        agent_id: "node-a".into(),
        seq: 1,
        pairs: vec![],
    };
    assert_eq!(put(&c.http, &url, TOKEN, &u).await.status(), 204);
    assert_eq!(
        c.get_status_json("/health").await.0,
        503,
        "no pair: still warming"
    );
    u.seq = 2;
    u.pairs.push(PairThreshold {
        prefill_engine_id: "p0".into(),
        decode_engine_id: "d0".into(),
        threshold_tokens: 64,
        valid_for_ms: 10_000,
        model: None,
    });
    assert_eq!(put(&c.http, &url, TOKEN, &u).await.status(), 204);
    let (st, h) = c.get_status_json("/health").await;
    assert_eq!(st, 200, "{h}");
    assert_eq!(h["status"], "ok");
    assert!(h["warmup_left_ms"].is_null(), "{h}");
}

#[tokio::test]
async fn tokens_header_on_every_request_when_configured() {
    let c = Cluster::start(Opts {
        tweak: |cfg| cfg.tokenize_every_request = true,
        ..Opts::default()
    })
    .await;
    let url = format!("{}/v1/completions", c.router.url());
    let (st, _) = post(
        &c.http,
        &url,
        None,
        &json!({"prompt": "one two three", "max_tokens": 2}),
        false,
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(
        c.p_stats(0).last_tokens_header.as_deref(),
        Some("prompt=3,reused=0")
    );
}

#[tokio::test]
async fn lru_bound_evicts_and_counts() {
    let c = Cluster::start(Opts {
        tweak: |cfg| cfg.store_capacity = 2,
        ..Opts::default()
    })
    .await;
    for conv in ["c1", "c2", "c3"] {
        first_turn(&c, None, conv, false).await;
    }
    assert_eq!(c.metric("kvloop_router_store_entries").await, 2.0);
    assert_eq!(
        c.metric("kvloop_router_store_evictions_total{cause=\"lru\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn unhealthy_engines_are_skipped() {
    let mut c = Cluster::start(Opts {
        n_decode: 2,
        tweak: |cfg| cfg.health_interval_ms = 50,
        ..Opts::default()
    })
    .await;
    c.decode[0].stop();
    let mut marked = false;
    for _ in 0..100 {
        let h: Value = c.get_json("/health").await;
        if h["engines"][1]["healthy"] == false {
            marked = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(marked, "d0 never marked unhealthy");
    assert_eq!(
        c.metric("kvloop_router_engine_healthy{engine_id=\"d0\"}")
            .await,
        0.0
    );
    for i in 0..4 {
        let (st, body) = c
            .chat(None, &format!("h{i}"), &[user("hello")], false, json!({}))
            .await;
        assert_eq!(st, 200, "{body}");
    }
    assert_eq!(c.d_stats(1).requests, 4);
}

#[tokio::test]
async fn client_disconnect_mid_stream_is_not_stored() {
    let c = Cluster::start(Opts {
        sim_tweak: |s| s.decode_us_per_token = 20_000,
        ..Opts::default()
    })
    .await;
    let body = |conv: &str| json!({"model": "sim-model", "messages": [user("hello there")], "stream": true, "max_tokens": 20, "conversation_id": conv});
    let url = format!("{}/v1/chat/completions", c.router.url());
    let mut r = c
        .http
        .post(&url)
        .json(&body("conv-dc"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(
        first.starts_with(b"data: "),
        "chunks arrive before the answer is complete"
    );
    drop(r);
    // D's stream would have ended after 20 × 20 ms; give it that time.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
    // Control: the same turn read to the end is stored.
    let r = c
        .http
        .post(&url)
        .json(&body("conv-ok"))
        .send()
        .await
        .unwrap();
    r.text().await.unwrap();
    assert_eq!(c.metric("kvloop_router_store_entries").await, 1.0);
}

/// `PUT url` with a bearer token and a JSON body.
async fn put(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    body: &impl serde::Serialize,
) -> reqwest::Response {
    http.put(url)
        .bearer_auth(token)
        .json(body)
        .send()
        .await
        .unwrap()
}
