//! A decode connection that breaks before D answers (an RST under a reused
//! keep-alive connection, seen in `make test-vllm` against a loaded vLLM):
//! the router prefills again without reuse and resends to the same D once;
//! P's first params are never sent twice. A second break fails the turn.
mod common;

use std::sync::{Arc, Mutex};

use common::mock::*;
use common::*;
use kvloop_router::ManualClock;
use serde_json::{Value, json};

fn chat_body(conv: &str, messages: &[Value]) -> Value {
    json!({"model": "mock", "messages": messages, "stream": false, "max_tokens": 8, "conversation_id": conv})
}

/// D: "a b c" and its params, holding the prompt and the reply.
fn script_d() -> Script {
    Arc::new(|_, body: &Value| {
        let held = n_tokens(body) + 3 - 1;
        let text = format!(
            r#"{{"id":"d","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"a b c"}},"finish_reason":"length"}}],"usage":{{"prompt_tokens":1,"completion_tokens":3}},"kv_transfer_params":{}}}"#,
            d_params(held)
        );
        (200, "application/json", text)
    })
}

struct Rig {
    p: MockEngine,
    d: ResettingEngine,
    router: kvloop_router::RunningRouter,
    http: reqwest::Client,
    /// Whether each prefill request to P carried D's params, in order.
    pulls: Arc<Mutex<Vec<bool>>>,
}

impl Rig {
    async fn start(resets: usize) -> Rig {
        let pulls = Arc::new(Mutex::new(Vec::new()));
        let seen = pulls.clone();
        let p = MockEngine::start(Arc::new(move |path: &str, body: &Value| {
            if path != "/v1/chat/completions" {
                return (404, "application/json", "{}".into());
            }
            let attached = !body["kv_transfer_params"]["remote_block_ids"].is_null();
            seen.lock().unwrap().push(attached);
            p_answer(Some(if attached { 10 } else { 0 }))
        }))
        .await;
        let d = ResettingEngine::start(script_d(), resets).await;
        let cfg = one_pair_config(&p.url(), &d.url());
        let router = kvloop_router::start(cfg, Box::new(Arc::new(ManualClock::default())))
            .await
            .expect("router starts");
        Rig {
            p,
            d,
            router,
            http: reqwest::Client::new(),
            pulls,
        }
    }

    async fn chat(&self, body: &Value) -> (u16, String) {
        post_chat(&self.http, &self.router.url(), body).await
    }

    async fn retries(&self) -> f64 {
        metric(
            &self.http,
            &self.router.url(),
            "kvloop_router_decode_retries_total",
        )
        .await
    }
}

#[tokio::test]
async fn a_decode_reset_is_retried_once_after_a_fresh_prefill() {
    let rig = Rig::start(1).await;
    let m1 = vec![user(&words(100, "a"))];
    let (st, text) = rig.chat(&chat_body("conv-r", &m1)).await;
    assert_eq!(st, 200, "{text}");
    assert!(text.contains("a b c"), "{text}");
    assert_eq!(rig.retries().await, 1.0);
    assert_eq!(
        *rig.pulls.lock().unwrap(),
        vec![false, false],
        "P prefilled twice, the second time without reuse"
    );
    assert_eq!(rig.d.posts().len(), 2, "D got the request twice");
    assert_eq!(rig.p.bodies("/v1/chat/completions").len(), 2);

    // The retried turn's answer is stored: the next turn pulls D's blocks.
    let m2 = vec![m1[0].clone(), assistant("a b c"), user("four five six")];
    let (st, text) = rig.chat(&chat_body("conv-r", &m2)).await;
    assert_eq!(st, 200, "{text}");
    assert_eq!(*rig.pulls.lock().unwrap(), vec![false, false, true]);
    assert_eq!(rig.retries().await, 1.0);
}

#[tokio::test]
async fn a_second_reset_fails_the_turn_after_one_retry() {
    let rig = Rig::start(2).await;
    let (st, text) = rig
        .chat(&chat_body("conv-f", &[user(&words(100, "b"))]))
        .await;
    assert_eq!(st, 502, "{text}");
    assert!(text.contains("decode"), "{text}");
    assert_eq!(rig.retries().await, 1.0);
    assert_eq!(*rig.pulls.lock().unwrap(), vec![false, false]);
    assert_eq!(rig.d.posts().len(), 2, "one retry, not more");

    // D answers again: the conversation starts over (nothing was stored).
    let (st, text) = rig
        .chat(&chat_body("conv-f", &[user(&words(100, "b"))]))
        .await;
    assert_eq!(st, 200, "{text}");
    assert_eq!(*rig.pulls.lock().unwrap(), vec![false, false, false]);
}
