//! Issue 12 (router items 1–7) and issue 17 item 3: what D's answers may do
//! to the client and to the conversation store, against scripted engines
//! (tests/common/mock.rs) and engine-sims.
mod common;

use std::sync::Arc;

use common::mock::*;
use common::*;
use serde_json::{Value, json};

fn chat_body(conv: &str, messages: &[Value], stream: bool) -> Value {
    json!({"model": "mock", "messages": messages, "stream": stream, "max_tokens": 8, "conversation_id": conv})
}

fn has_params(body: &str) -> bool {
    body.contains("\"remote_block_ids\":[[7,8,9]]")
}

/// P: its params; D: `stream` answers from `events(held)` where `held` fits
/// the visible reply "a b c" exactly; non-streaming answers a body.
fn script_d(events: fn(u64) -> Vec<String>, done: bool) -> Script {
    Arc::new(move |path: &str, body: &Value| {
        if path != "/v1/chat/completions" {
            return (404, "application/json", "{}".into());
        }
        let held = n_tokens(body) + 3 - 1;
        if body["stream"] == true {
            sse(&events(held), done)
        } else {
            let text = format!(
                r#"{{"id":"d","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"a b c"}},"logprobs":{{"x":-0.10000000000000001}},"finish_reason":"length"}}],"usage":{{"prompt_tokens":1,"completion_tokens":3}},"kv_transfer_params":{}}}"#,
                d_params(held)
            );
            (200, "application/json", text)
        }
    })
}

fn script_p() -> Script {
    Arc::new(|path: &str, body: &Value| {
        if path != "/v1/chat/completions" {
            return (404, "application/json", "{}".into());
        }
        let attached = !body["kv_transfer_params"]["remote_block_ids"].is_null();
        p_answer(Some(if attached { 10 } else { 0 }))
    })
}

fn params_on_own_chunk(held: u64) -> Vec<String> {
    vec![
        delta("a", None),
        delta(" b", None),
        delta(" c", Some("length")),
        format!(
            r#"{{"id":"d","object":"chat.completion.chunk","choices":[],"kv_transfer_params":{}}}"#,
            d_params(held)
        ),
    ]
}

fn params_on_finish_chunk(held: u64) -> Vec<String> {
    vec![
        delta("a", None),
        delta(" b", None),
        format!(
            r#"{{"id":"d","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":" c"}},"finish_reason":"length"}}],"kv_transfer_params":{}}}"#,
            d_params(held)
        ),
        r#"{"id":"d","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}"#.to_string(),
    ]
}

fn assert_client_clean(text: &str) {
    assert!(
        !text.contains("kv_transfer_params"),
        "params reached the client: {text}"
    );
    for d in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        assert!(
            v["choices"].get(0).is_some() || !v["usage"].is_null(),
            "a chunk without choices or usage reached the client: {d}"
        );
    }
}

/// Issue 12 items 1 and 4: the client never sees D's params (params-only
/// chunk, params on the finish chunk, non-streaming body), and P receives
/// every member D emitted byte for byte.
#[tokio::test]
async fn params_never_reach_the_client_and_reach_p_bit_exact() {
    for (i, events) in [
        params_on_own_chunk as fn(u64) -> Vec<String>,
        params_on_finish_chunk,
    ]
    .into_iter()
    .enumerate()
    {
        let c = MockCluster::start(script_p(), script_d(events, true)).await;
        let conv = format!("conv-{i}");
        let m1 = vec![user(&words(100, "a"))];
        let (st, text) = c.chat(&chat_body(&conv, &m1, true)).await;
        assert_eq!(st, 200, "{text}");
        assert_client_clean(&text);
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert!(text.contains("\"usage\"") || i == 0, "usage chunks pass");
        let m2 = vec![
            m1[0].clone(),
            assistant("a b c"),
            user("four five six seven"),
        ];
        let (st, text) = c.chat(&chat_body(&conv, &m2, false)).await;
        assert_eq!(st, 200);
        assert!(!text.contains("kv_transfer_params"), "{text}");
        assert!(
            text.contains(r#""logprobs":{"x":-0.10000000000000001}"#),
            "the rest of D's body is forwarded exactly: {text}"
        );
        assert_eq!(c.metric(PULLED).await, 1.0, "events {i}");
        let to_p = c.p.bodies("/v1/chat/completions");
        let reuse = &to_p[1];
        assert!(has_params(reuse), "{reuse}");
        for exact in [
            r#""remote_blocks_expiry_time":1214.2449693849999"#,
            r#""x_vendor":{"ratio":1.50}"#,
            r#""dcp_size":1"#,
        ] {
            assert!(reuse.contains(exact), "{exact} not passed exactly: {reuse}");
        }
    }
}

/// Issue 12 item 2: a stream that ends with an error event is not stored,
/// even with params and [DONE] after it.
#[tokio::test]
async fn stream_with_error_event_is_not_stored() {
    fn events(held: u64) -> Vec<String> {
        let mut e = params_on_own_chunk(held);
        e.insert(
            3,
            r#"{"error":{"message":"engine overloaded","type":"InternalServerError","code":500}}"#
                .into(),
        );
        e
    }
    let c = MockCluster::start(script_p(), script_d(events, true)).await;
    let (st, text) = c
        .chat(&chat_body("conv-err", &[user("hi there")], true))
        .await;
    assert_eq!(st, 200);
    assert!(
        text.contains("engine overloaded"),
        "the error reaches the client"
    );
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
    assert_eq!(
        c.metric("kvloop_router_store_skipped_total{reason=\"error_event\"}")
            .await,
        1.0
    );
    // And a stream cut before [DONE] is not stored either.
    let c = MockCluster::start(script_p(), script_d(params_on_own_chunk, false)).await;
    c.chat(&chat_body("conv-cut", &[user("hi there")], true))
        .await;
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
}

/// Issue 12 item 3, request side: `include_reasoning: false` hides tokens D
/// holds; such a turn is never stored (engine-sim).
#[tokio::test]
async fn hidden_reasoning_is_never_stored() {
    let c = Cluster::start(Opts::default()).await;
    for stream in [false, true] {
        let body = json!({"model": "sim-model", "messages": [user(&words(100, "a"))], "max_tokens": 8,
            "stream": stream, "conversation_id": format!("conv-r{stream}"), "include_reasoning": false});
        let (st, _) = post(
            &c.http,
            &format!("{}/v1/chat/completions", c.router.url()),
            None,
            &body,
            stream,
        )
        .await;
        assert_eq!(st, 200);
    }
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
    assert_eq!(
        c.metric("kvloop_router_store_skipped_total{reason=\"hidden_reasoning\"}")
            .await,
        2.0
    );
}

/// Issue 12 item 3, token mode: D's `remote_num_tokens` covering more than
/// the prompt plus the visible reply (hidden tokens) is not stored.
#[tokio::test]
async fn token_mode_refuses_params_covering_unseen_tokens() {
    fn hidden(held: u64) -> Vec<String> {
        params_on_own_chunk(held + 40) // 40 reasoning tokens the client never saw
    }
    let c = MockCluster::start(script_p(), script_d(hidden, true)).await;
    c.chat(&chat_body("conv-h", &[user("hi there")], true))
        .await;
    assert_eq!(c.metric("kvloop_router_store_entries").await, 0.0);
    assert_eq!(
        c.metric("kvloop_router_store_skipped_total{reason=\"hidden_tokens\"}")
            .await,
        1.0
    );
    // Control: the same answer with a consistent count is stored.
    let c = MockCluster::start(script_p(), script_d(params_on_own_chunk, true)).await;
    c.chat(&chat_body("conv-ok", &[user("hi there")], true))
        .await;
    assert_eq!(c.metric("kvloop_router_store_entries").await, 1.0);
}

/// Issue 12 item 5: `/version`, `max_model_len` in `/v1/models`, 404 with an
/// OpenAI error body for a model no engine serves.
#[tokio::test]
async fn openai_surface_version_models_and_unknown_model() {
    let engine = |max_len: Option<u64>| -> Script {
        Arc::new(move |path: &str, body: &Value| match path {
            "/version" => (200, "application/json", r#"{"version":"0.32.0"}"#.into()),
            "/v1/models" => {
                let mut m = json!({"id": "mock", "object": "model", "owned_by": "vllm"});
                if let Some(l) = max_len {
                    m["max_model_len"] = json!(l);
                }
                (
                    200,
                    "application/json",
                    json!({"object": "list", "data": [m]}).to_string(),
                )
            }
            _ if max_len.is_some() => p_answer(None),
            _ => script_d(params_on_own_chunk, true)(path, body),
        })
    };
    let c = MockCluster::start(engine(Some(4096)), engine(None)).await;
    let (st, v) = c.get("/version").await;
    assert_eq!((st, v["version"].as_str()), (200, Some("0.32.0")), "{v}");
    let (st, m) = c.get("/v1/models").await;
    assert_eq!(st, 200);
    assert_eq!(m["data"][0]["id"], "mock");
    assert_eq!(m["data"][0]["max_model_len"], 4096, "{m}");
    let mut body = chat_body("conv-m", &[user("hi")], false);
    body["model"] = json!("no-such-model");
    let (st, text) = c.chat(&body).await;
    assert_eq!(st, 404, "{text}");
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["code"], 404);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-model")
    );
    assert_eq!(
        c.p.bodies("/v1/chat/completions").len(),
        0,
        "no engine was asked"
    );
    let (st, _) = c.chat(&chat_body("conv-m", &[user("hi")], false)).await;
    assert_eq!(st, 200, "a served model still works");
    // A bad field is named in `param`; an unknown path or method gets an
    // OpenAI error body too.
    let (st, text) = post_chat(&c.http, &c.router.url(), &json!({"messages": 1})).await;
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("messages")),
        "{e}"
    );
    let (st, e) = c.get("/v2/nothing").await;
    assert_eq!((st, e["error"]["code"].as_u64()), (404, Some(404)), "{e}");
    let (st, e) = c.get("/v1/chat/completions").await;
    assert_eq!((st, e["error"]["code"].as_u64()), (405, Some(405)), "{e}");
}

/// Issue 12 item 6: a turn whose entry the sweeper already dropped at its
/// TTL is counted `expired`, not `no_entry`.
#[tokio::test]
async fn turn_after_sweep_counts_expired() {
    let c = Cluster::start(Opts::default()).await;
    let m1 = vec![user(&words(100, "a"))];
    let (_, a1) = c.chat(None, "conv-sw", &m1, false, json!({})).await;
    c.clock.advance(450_000);
    // /metrics sweeps: the entry leaves the store before the turn arrives.
    assert_eq!(
        c.metric("kvloop_router_store_evictions_total{cause=\"expired\"}")
            .await,
        1.0
    );
    let m2 = vec![m1[0].clone(), assistant(&a1), user("more")];
    c.chat(None, "conv-sw", &m2, false, json!({})).await;
    assert_eq!(c.metric(EXPIRED).await, 1.0);
    assert_eq!(c.metric(NO_ENTRY).await, 1.0, "only turn 1");
}

/// Issue 12 item 7 (router side): P's reports of pulls reach per-pair
/// metrics; a pair whose pulls keep being declined raises an alarm and
/// degrades /health.
#[tokio::test]
async fn declined_pulls_raise_a_pair_alarm() {
    let declining: Script = Arc::new(|_, _body: &Value| p_answer(Some(0)));
    // (P reports 0 tokens not computed: it declined every READ and recomputed)
    let c = MockCluster::start(declining, script_d(params_on_own_chunk, true)).await;
    for i in 0..3 {
        let conv = format!("conv-{i}");
        let m1 = vec![user(&words(100, "a"))];
        c.chat(&chat_body(&conv, &m1, false)).await;
        let m2 = vec![
            m1[0].clone(),
            assistant("a b c"),
            user("four five six seven"),
        ];
        c.chat(&chat_body(&conv, &m2, false)).await;
    }
    assert_eq!(c.metric(PULLED).await, 3.0);
    let pair = "prefill_engine_id=\"p0\",decode_engine_id=\"d0\"";
    assert_eq!(
        c.metric(&format!(
            "kvloop_router_pulls_total{{{pair},outcome=\"declined\"}}"
        ))
        .await,
        3.0
    );
    assert_eq!(
        c.metric(&format!("kvloop_router_pull_alarm{{{pair}}}"))
            .await,
        1.0
    );
    let (st, h) = c.get("/health").await;
    assert_eq!(st, 200);
    assert_eq!(h["status"], "degraded", "{h}");
    assert_eq!(h["warnings"][0]["kind"], "pulls_failing");
}

/// Pulls P reports as read are counted per pair (engine-sim reports them).
#[tokio::test]
async fn pulls_read_are_counted_per_pair() {
    let c = Cluster::start(Opts::default()).await;
    let m1 = vec![user(&words(100, "a"))];
    let (_, a1) = c.chat(None, "conv-p", &m1, false, json!({})).await;
    let m2 = vec![m1[0].clone(), assistant(&a1), user(&words(20, "b"))];
    c.chat(None, "conv-p", &m2, false, json!({})).await;
    assert_eq!(
        c.metric("kvloop_router_pulls_total{prefill_engine_id=\"p0\",decode_engine_id=\"d0\",outcome=\"read\"}").await,
        1.0
    );
    let h: Value = c.get_json("/health").await;
    assert_eq!(h["status"], "ok", "{h}");
}

/// Issue 17 item 3: decode answers that should have carried params and did
/// not (stock vLLM 0.32 streaming) are counted, warned about, and degrade
/// /health with the likely cause.
#[tokio::test]
async fn decode_answers_without_params_are_reported() {
    fn no_params(_: u64) -> Vec<String> {
        vec![delta("a", None), delta(" b c", Some("stop"))]
    }
    let c = MockCluster::start(script_p(), script_d(no_params, true)).await;
    c.chat(&chat_body("conv-np", &[user("hi there")], true))
        .await;
    assert_eq!(
        c.metric("kvloop_router_decode_params_missing_total{engine_id=\"d0\"}")
            .await,
        1.0
    );
    let (_, h) = c.get("/health").await;
    assert_eq!(h["status"], "degraded", "{h}");
    let w = &h["warnings"][0];
    assert_eq!(w["kind"], "decode_params_missing");
    assert!(
        w["detail"].as_str().unwrap().contains("kvloop-vllm plugin"),
        "{w}"
    );
}

/// Issue 11 item 2: a 400 from P with D's params attached is not retried
/// (the request itself is refused); the client gets P's 400.
#[tokio::test]
async fn a_400_from_prefill_is_not_retried() {
    let p: Script = Arc::new(|_, body: &Value| {
        if body["kv_transfer_params"]["remote_block_ids"].is_null() {
            p_answer(None)
        } else {
            (
                400,
                "application/json",
                r#"{"error":{"message":"bad params","code":400}}"#.into(),
            )
        }
    });
    let c = MockCluster::start(p, script_d(params_on_own_chunk, true)).await;
    let m1 = vec![user(&words(100, "a"))];
    c.chat(&chat_body("conv-4", &m1, false)).await;
    let m2 = vec![
        m1[0].clone(),
        assistant("a b c"),
        user("four five six seven"),
    ];
    let (st, text) = c.chat(&chat_body("conv-4", &m2, false)).await;
    assert_eq!(st, 400, "{text}");
    assert_eq!(c.metric("kvloop_router_prefill_retries_total").await, 0.0);
    assert_eq!(c.p.bodies("/v1/chat/completions").len(), 2);
}
