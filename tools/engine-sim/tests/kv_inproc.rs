//! Real KV (`kv_mode inproc`): memfd regions, real READs over libfabric
//! `tcp;ofi_rxm` on loopback in both directions, every block verified.
use kvloop_engine_sim::{KvMode, Role, SimConfig, TokenizerKind, spawn};
use serde_json::{Value, json};

async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

fn cfg(role: Role, id: &str) -> SimConfig {
    SimConfig {
        role,
        engine_id: id.into(),
        prefill_us_per_token: 1,
        kv_mode: KvMode::Inproc,
        kv_capacity_tokens: 8192,
        tokenizer: TokenizerKind::Pieces,
        ..SimConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_moves_both_ways_and_every_block_is_verified() {
    let p = spawn(cfg(Role::Prefill, "p0")).await.unwrap();
    let d = spawn(cfg(Role::Decode, "d0")).await.unwrap();
    let prompt = (0..300)
        .map(|i| format!("word{i}::x"))
        .collect::<Vec<_>>()
        .join(" ");
    let (st, pr) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200, "{pr}");
    let n_prompt = pr["usage"]["prompt_tokens"].as_u64().unwrap();
    // P→D: D reads P's fresh blocks.
    let (st, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 8, "kv_transfer_params": pr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200, "{dr}");
    let ds = d.engine.stats();
    assert_eq!(ds.reused_tokens, n_prompt, "{ds:?}");
    assert_eq!(ds.verified_blocks, n_prompt.div_ceil(16));
    assert_eq!(ds.mismatched_blocks, 0);
    // D→P next turn: P reads D's retained blocks (prompt + generated).
    let answer = dr["choices"][0]["text"].as_str().unwrap().to_string();
    let next = format!("{prompt}{answer} and more words here");
    let (st, r1) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": dr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200, "{r1}");
    let held = dr["kv_transfer_params"]["remote_num_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(r1["kvloop_sim"]["reused_tokens"], held);
    let ps = p.engine.stats();
    assert_eq!(ps.verified_blocks, held.div_ceil(16), "{ps:?}");
    assert_eq!(ps.mismatched_blocks, 0);
    // D frees the blocks on P's owner notification.
    for _ in 0..50 {
        if d.engine.stats().holds == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The READ log and metrics.
    let log: Value = reqwest::get(format!("{}/sim/reads", p.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(log[0]["direction"], "d2p");
    assert!(log[0]["bytes"].as_u64().unwrap() >= held * 2048);
    let m = reqwest::get(format!("{}/metrics", p.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:prompt_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:nixl_xfer_time_seconds_count",
        "kvloop_sim_verified_blocks_total",
        "kvloop_sim_mismatched_blocks_total 0",
    ] {
        assert!(m.contains(name), "{name} missing in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_kv_is_detected_and_recomputed() {
    let p = spawn(cfg(Role::Prefill, "p1")).await.unwrap();
    let d = spawn(cfg(Role::Decode, "d1")).await.unwrap();
    let prompt = "alpha beta gamma ".repeat(40);
    let (_, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 4}),
    )
    .await;
    // A next turn whose prefix differs from what D holds: the params are
    // wrong for it, the READ blocks do not match, P recomputes.
    let other = format!("{} tok0 tok1 tok2 more", "delta ".repeat(120));
    let (st, r) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": other, "max_tokens": 1, "kv_transfer_params": dr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(r["kvloop_sim"]["reused_tokens"], 0, "{r}");
    let s = p.engine.stats();
    assert!(s.mismatched_blocks > 0, "{s:?}");
    assert_eq!(s.reads_ok, 1);
}

#[tokio::test]
async fn agent_mode_without_a_socket_and_bad_profile_are_refused_with_the_field_named() {
    let mut c = cfg(Role::Prefill, "p2");
    c.kv_mode = KvMode::Agent;
    let e = spawn(c).await.err().unwrap();
    assert!(e.to_string().contains("agent_socket"), "{e}");
    let mut c = cfg(Role::Prefill, "p3");
    c.kv_mode = KvMode::None;
    c.profile = Some("gpt-9".into());
    let e = spawn(c).await.err().unwrap();
    assert!(e.to_string().contains("profile"), "{e}");
}
