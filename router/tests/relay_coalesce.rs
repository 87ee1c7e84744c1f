//! The relay's coalescing (`router/src/relay.rs`, `Relay`): D's events that
//! arrive together leave in few writes, byte for byte and in order; the
//! first bytes are never held; a stream D breaks still ends in an error
//! after what was gathered.
mod common;

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use common::mock::*;
use futures_util::{StreamExt, stream};
use kvloop_router::registry::{EngineConfig, Role};
use kvloop_router::{ManualClock, RouterConfig};
use serde_json::json;

const EVENTS: usize = 32;

/// The SSE events D sends, each one its own HTTP chunk, all at once.
fn events() -> Vec<String> {
    let mut v: Vec<String> = (0..EVENTS)
        .map(|i| format!("data: {}\n\n", delta(&format!("t{i} "), None)))
        .collect();
    v.push(format!("data: {}\n\n", delta("", Some("length"))));
    v.push("data: [DONE]\n\n".into());
    v
}

/// A D whose chat answer is `events()`; with `break_after`, the body fails
/// after that many events.
async fn start_d(break_after: Option<usize>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let app = Router::new().fallback(move || async move {
        let mut items: Vec<Result<Bytes, std::io::Error>> =
            events().into_iter().map(|e| Ok(Bytes::from(e))).collect();
        let body = match break_after {
            None => Body::from_stream(stream::iter(items)),
            Some(n) => {
                items.truncate(n);
                // The break comes after the events were sent (hyper drops
                // what it has not written yet when a body fails).
                let fail = stream::once(async {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    Err(std::io::Error::other("D went away"))
                });
                Body::from_stream(stream::iter(items).chain(fail))
            }
        };
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    });
    let (addr, stop) = serve(app).await;
    (format!("http://{addr}"), stop)
}

async fn router(d_url: &str, p: &MockEngine) -> kvloop_router::RunningRouter {
    let cfg = RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        engines: vec![
            EngineConfig::new("p0", Role::Prefill, &p.url(), "127.0.0.1", 5601),
            EngineConfig::new("d0", Role::Decode, d_url, "127.0.0.1", 5602),
        ],
        ..RouterConfig::default()
    };
    kvloop_router::start(cfg, Box::new(Arc::new(ManualClock::default())))
        .await
        .expect("router starts")
}

fn p_script() -> Script {
    Arc::new(|_: &str, _: &serde_json::Value| p_answer(None))
}

/// (chunks the client received, their bytes, whether the body ended in an error).
async fn stream_through(url: &str) -> (usize, Vec<u8>, bool) {
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}],
        "stream": true, "max_tokens": 40, "conversation_id": "c1"});
    let mut r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (mut chunks, mut bytes) = (0, Vec::new());
    loop {
        match r.chunk().await {
            Ok(Some(c)) => {
                chunks += 1;
                bytes.extend_from_slice(&c);
            }
            Ok(None) => return (chunks, bytes, false),
            Err(_) => return (chunks, bytes, true),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn events_that_arrive_together_leave_in_few_writes() {
    let p = MockEngine::start(p_script()).await;
    let (d_url, _stop) = start_d(None).await;
    let r = router(&d_url, &p).await;
    let (chunks, bytes, broken) = stream_through(&r.url()).await;
    assert!(!broken);
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        events().concat(),
        "every event forwarded byte for byte, in order"
    );
    eprintln!(
        "{} events reached the client in {chunks} chunks",
        EVENTS + 2
    );
    assert!(
        chunks <= EVENTS / 4,
        "{} events arriving together were written in {chunks} chunks",
        EVENTS + 2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_broken_stream_forwards_what_came_then_fails() {
    let p = MockEngine::start(p_script()).await;
    let (d_url, _stop) = start_d(Some(10)).await;
    let r = router(&d_url, &p).await;
    let (_, bytes, broken) = stream_through(&r.url()).await;
    assert!(broken, "the client sees D's break as a body error");
    let text = String::from_utf8(bytes).unwrap();
    assert_eq!(
        text,
        events()[..10].concat(),
        "what D sent before its break, byte for byte"
    );
}
