//! engine-sim's engine-side rules (docs/protocol.md), over real loopback sockets.
use kvloop_engine_sim::{Role, SimConfig, spawn};
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
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn invalid_params_mean_local_recompute_not_a_crash() {
    let p = spawn(cfg(Role::Prefill, "p0")).await.unwrap();
    let url = format!("{}/v1/completions", p.url());
    for bad in [
        json!({"do_remote_decode": true, "remote_block_ids": [], "remote_engine_id": "d0", "remote_host": "h", "remote_port": 1, "remote_request_id": "r", "remote_num_tokens": 3}),
        json!({"do_remote_decode": true, "remote_block_ids": [[1]], "remote_host": "h", "remote_port": 1, "remote_request_id": "r", "remote_num_tokens": 3}),
        json!({"do_remote_decode": true, "remote_block_ids": [[1]], "remote_engine_id": "d0", "remote_port": 1, "remote_request_id": "r", "remote_num_tokens": 3}),
        json!({"do_remote_decode": true, "remote_block_ids": [[1]], "remote_engine_id": "d0", "remote_host": "h", "remote_request_id": "r", "remote_num_tokens": 3}),
    ] {
        let (st, v) = post(
            &url,
            json!({"prompt": "a b c d", "max_tokens": 1, "kv_transfer_params": bad}),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(v["kvloop_sim"]["reused_tokens"], 0);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true);
    }
    assert_eq!(p.engine.stats().invalid_params, 4);
}

#[tokio::test]
async fn decode_params_are_single_use_and_expire() {
    let p = spawn(cfg(Role::Prefill, "p0")).await.unwrap();
    let mut dc = cfg(Role::Decode, "d0");
    dc.decoder_kv_blocks_ttl_ms = 5_300; // expires within the 5 s margin after ~300 ms
    let d = spawn(dc).await.unwrap();
    let prompt = "w ".repeat(40);
    // P → D
    let (_, pr) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    let (st, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 8, "kv_transfer_params": pr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(d.engine.stats().reused_tokens, 40, "D read P's 40 tokens");
    assert_eq!(
        p.engine.stats().holds,
        0,
        "P's blocks freed by the READ notification"
    );
    let kv = dr["kv_transfer_params"].clone();
    assert_eq!(kv["remote_num_tokens"], 47);
    assert!(kv["remote_blocks_expiry_time"].is_f64());
    // D → P, next turn: read once ...
    let next = format!("{prompt} tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 more words");
    let (_, r1) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": kv}),
    )
    .await;
    assert_eq!(r1["kvloop_sim"]["reused_tokens"], 47);
    // ... a replay is declined and recomputed
    let (st, r2) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": kv}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(r2["kvloop_sim"]["reused_tokens"], 0);
    assert_eq!(p.engine.stats().reads_declined, 1);
    // Blocks expiring within the safety margin are not read.
    let (_, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 8}),
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let (_, r3) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": dr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(r3["kvloop_sim"]["reused_tokens"], 0);
    assert_eq!(p.engine.stats().reads_declined, 2);
    assert_eq!(d.engine.stats().side_reads_refused, 2);
}

#[tokio::test]
async fn tokenize_matches_generation_prompt_count() {
    let p = spawn(cfg(Role::Prefill, "p0")).await.unwrap();
    let msgs = json!([{"role": "user", "content": "hello there friend"}]);
    let (_, t) = post(
        &format!("{}/tokenize", p.url()),
        json!({"model": "m", "messages": msgs}),
    )
    .await;
    assert_eq!(t["count"], 5); // <|user|> hello there friend <|assistant|>
    let (_, r) = post(
        &format!("{}/v1/chat/completions", p.url()),
        json!({"messages": msgs, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r["usage"]["prompt_tokens"], 5);
}

/// A custom `KvTransfer` sees every READ with the reader's destination blocks.
#[tokio::test]
async fn pluggable_transfer_gets_local_and_remote_blocks() {
    use kvloop_engine_sim::{KvTransfer, ReadFuture, ReadRequest, spawn_with_transfer};
    use std::sync::{Arc, Mutex};
    #[derive(Default)]
    struct Recording(Mutex<Vec<ReadRequest>>);
    impl KvTransfer for Recording {
        fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
            let n = req.num_tokens;
            self.0.lock().unwrap().push(req);
            Box::pin(async move { Ok(n) })
        }
    }
    let rec = Arc::new(Recording::default());
    let p = spawn_with_transfer(cfg(Role::Prefill, "p0"), rec.clone())
        .await
        .unwrap();
    let kv = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_block_ids": [[7, 8, 9]],
                    "remote_engine_id": "d0", "remote_request_id": "d0-req-1", "remote_host": "[::1]",
                    "remote_port": 5601, "remote_num_tokens": 40});
    let (st, r) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": "w ".repeat(50), "max_tokens": 1, "kv_transfer_params": kv}),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(r["kvloop_sim"]["reused_tokens"], 40);
    let reqs = rec.0.lock().unwrap();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].remote_block_ids, vec![7, 8, 9]);
    assert_eq!(
        reqs[0].local_block_ids.len(),
        3,
        "ceil(40 / 16) destination blocks"
    );
    assert_eq!(reqs[0].remote_host, "[::1]");
    // P's own params list all 4 blocks of its 50-token prompt, starting with the READ's destinations.
    let own: Vec<u32> =
        serde_json::from_value(r["kv_transfer_params"]["remote_block_ids"][0].clone()).unwrap();
    assert_eq!(own.len(), 4);
    assert_eq!(&own[..3], &reqs[0].local_block_ids[..]);
}
