//! Where a streaming D puts its `kv_transfer_params` (`--stream-params`),
//! and the keys vLLM's NixlConnector emits that every engine's params carry.
use kvloop_engine_sim::{Role, SimConfig, StreamParams, spawn};
use serde_json::{Value, json};

fn cfg(role: Role, id: &str, placement: StreamParams) -> SimConfig {
    SimConfig {
        role,
        engine_id: id.into(),
        prefill_us_per_token: 1,
        stream_params: placement,
        ..SimConfig::default()
    }
}

/// The `data:` events of a streamed answer, `[DONE]` as a string.
async fn stream(url: &str, body: Value) -> Vec<Value> {
    let text = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.into())))
        .collect()
}

/// The index of the event that carries `kv_transfer_params`, if any, and the
/// params; asserts there is at most one.
fn params_event(events: &[Value]) -> Option<(usize, Value)> {
    let with: Vec<(usize, Value)> = events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.get("kv_transfer_params").map(|p| (i, p.clone())))
        .collect();
    assert!(with.len() <= 1, "params more than once: {events:?}");
    with.into_iter().next()
}

fn finish_index(events: &[Value]) -> usize {
    events
        .iter()
        .position(|e| e["choices"][0]["finish_reason"].is_string())
        .expect("a finish chunk")
}

#[tokio::test]
async fn own_chunk_finish_chunk_and_none_place_the_params_as_configured() {
    for api in ["/v1/completions", "/v1/chat/completions"] {
        let body = if api == "/v1/completions" {
            json!({"prompt": "a b c d e f", "max_tokens": 3, "stream": true})
        } else {
            json!({"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3, "stream": true})
        };
        // Own chunk (the default): after the finish chunk, empty choices.
        let d = spawn(cfg(Role::Decode, "d0", StreamParams::OwnChunk))
            .await
            .unwrap();
        let ev = stream(&format!("{}{api}", d.url()), body.clone()).await;
        let (i, p) = params_event(&ev).expect("params streamed");
        assert_eq!(i, finish_index(&ev) + 1, "{ev:?}");
        assert_eq!(ev[i]["choices"], json!([]), "{ev:?}");
        assert_eq!(p["do_remote_decode"], true);
        assert_eq!(ev.last().unwrap(), "[DONE]");
        // Finish chunk: on the chunk that carries finish_reason.
        let d = spawn(cfg(Role::Decode, "d1", StreamParams::FinishChunk))
            .await
            .unwrap();
        let ev = stream(&format!("{}{api}", d.url()), body.clone()).await;
        let (i, p) = params_event(&ev).expect("params streamed");
        assert_eq!(i, finish_index(&ev), "{ev:?}");
        assert_eq!(p["remote_engine_id"], "d1");
        assert!(
            ev.iter()
                .all(|e| e == "[DONE]" || e["choices"] != json!([])),
            "no chunk without choices: {ev:?}"
        );
        assert_eq!(ev.last().unwrap(), "[DONE]");
        assert_eq!(d.engine.stats().holds, 1);
        // None: no params streamed; D still holds the blocks (until the TTL).
        let d = spawn(cfg(Role::Decode, "d2", StreamParams::None))
            .await
            .unwrap();
        let ev = stream(&format!("{}{api}", d.url()), body.clone()).await;
        assert!(params_event(&ev).is_none(), "{ev:?}");
        assert_eq!(ev.last().unwrap(), "[DONE]");
        assert_eq!(d.engine.stats().holds, 1);
    }
}

#[tokio::test]
async fn an_abnormal_finish_streams_no_params_whatever_the_placement() {
    for placement in [StreamParams::OwnChunk, StreamParams::FinishChunk] {
        let d = spawn(cfg(Role::Decode, "d0", placement)).await.unwrap();
        let ev = stream(
            &format!("{}/v1/completions", d.url()),
            json!({"prompt": "a b c", "max_tokens": 2, "stream": true, "sim": {"finish_reason": "abort"}}),
        )
        .await;
        assert!(params_event(&ev).is_none(), "{ev:?}");
        assert_eq!(d.engine.stats().holds, 0);
    }
}

#[tokio::test]
async fn every_params_carry_vllms_parallel_layout_and_transfer_mode() {
    let mut pc = cfg(Role::Prefill, "p0", StreamParams::OwnChunk);
    pc.dcp_size = 2;
    pc.pp_size = 3;
    let p = spawn(pc).await.unwrap();
    let d = spawn(cfg(Role::Decode, "d0", StreamParams::OwnChunk))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let post = |url: String, body: Value| {
        let client = client.clone();
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            r.json::<Value>().await.unwrap()
        }
    };
    let prompt = "w ".repeat(40);
    let pr = post(
        format!("{}/v1/completions", p.url()),
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    let pp = &pr["kv_transfer_params"];
    assert_eq!(pp["dcp_size"], 2, "{pp}");
    assert_eq!(pp["pp_size"], 3, "{pp}");
    assert_eq!(pp["transfer_mode"], "pull", "{pp}");
    // Nothing reused on a first turn: 0 cached, as an integer.
    assert_eq!(pp["remote_prefill_cached_tokens"], 0, "{pp}");
    let dr = post(
        format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": pp}),
    )
    .await;
    let dp = &dr["kv_transfer_params"];
    assert_eq!(dp["dcp_size"], 1, "{dp}");
    assert_eq!(dp["pp_size"], 1, "{dp}");
    assert_eq!(dp["transfer_mode"], "pull", "{dp}");
    assert!(dp.get("remote_prefill_cached_tokens").is_none(), "{dp}");
    // Turn 2 on P reads D's blocks: the cached count is what it read.
    let prompt2 = format!("{prompt} tok0 tok1 tok2 more words");
    let pr2 = post(
        format!("{}/v1/completions", p.url()),
        json!({"prompt": prompt2, "max_tokens": 1, "kv_transfer_params": dp}),
    )
    .await;
    let reused = pr2["kvloop_sim"]["reused_tokens"].as_u64().unwrap();
    assert!(reused > 0, "{pr2}");
    assert_eq!(
        pr2["kv_transfer_params"]["remote_prefill_cached_tokens"], reused,
        "{pr2}"
    );
}
