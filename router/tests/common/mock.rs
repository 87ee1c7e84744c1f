//! Scripted engines for the router's reply-handling tests: every request is
//! recorded with its raw body; answers come from a closure of the test.
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use kvloop_router::registry::{EngineConfig, Role};
use kvloop_router::{ManualClock, RouterConfig, RunningRouter};
use serde_json::{Value, json};

/// `(status, content type, body)`.
pub type Answer = (u16, &'static str, String);
/// The script: path and parsed body of a request → the answer.
pub type Script = Arc<dyn Fn(&str, &Value) -> Answer + Send + Sync>;

#[derive(Clone)]
struct Shared {
    script: Script,
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

pub struct MockEngine {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn handle(State(s): State<Shared>, uri: Uri, body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body).to_string();
    s.seen
        .lock()
        .unwrap()
        .push((uri.path().to_string(), text.clone()));
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let (status, ct, out) = match uri.path() {
        "/health" => (200, "application/json", "{}".to_string()),
        "/tokenize" => match kvloop_engine_sim::tokenize_body(&v) {
            Ok(t) => (
                200,
                "application/json",
                json!({"tokens": t, "count": t.len()}).to_string(),
            ),
            Err(e) => (400, "application/json", json!({"error": e}).to_string()),
        },
        p => (s.script)(p, &v),
    };
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap())
        .header("content-type", ct)
        .body(Body::from(out))
        .unwrap()
}

/// Serves `app` on 127.0.0.1 (a free port) until the sender drops.
pub async fn serve(app: Router) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(l, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    (addr, tx)
}

impl MockEngine {
    pub async fn start(script: Script) -> MockEngine {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().fallback(handle).with_state(Shared {
            script,
            seen: seen.clone(),
        });
        let (addr, tx) = serve(app).await;
        MockEngine {
            addr,
            seen,
            _stop: tx,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Raw bodies of the requests to `path`, in order.
    pub fn bodies(&self, path: &str) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

/// A router in front of one scripted P (`p0`) and one scripted D (`d0`).
pub struct MockCluster {
    pub p: MockEngine,
    pub d: MockEngine,
    pub router: RunningRouter,
    pub clock: Arc<ManualClock>,
    pub http: reqwest::Client,
}

impl MockCluster {
    pub async fn start(p: Script, d: Script) -> MockCluster {
        let p = MockEngine::start(p).await;
        let d = MockEngine::start(d).await;
        let cfg = one_pair_config(&p.url(), &d.url());
        let clock = Arc::new(ManualClock::default());
        let router = kvloop_router::start(cfg, Box::new(clock.clone()))
            .await
            .expect("router starts");
        MockCluster {
            p,
            d,
            router,
            clock,
            http: reqwest::Client::new(),
        }
    }

    pub async fn metric(&self, series: &str) -> f64 {
        super::metric(&self.http, &self.router.url(), series).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.router.url()))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// POST a chat body; (status, raw response text).
    pub async fn chat(&self, body: &Value) -> (u16, String) {
        post_chat(&self.http, &self.router.url(), body).await
    }
}

/// A router config with one prefill engine `p0` at `p_url` and one decode
/// engine `d0` at `d_url`, listening on a free loopback port.
pub fn one_pair_config(p_url: &str, d_url: &str) -> RouterConfig {
    RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        engines: vec![
            EngineConfig::new("p0", Role::Prefill, p_url, "127.0.0.1", 5601),
            EngineConfig::new("d0", Role::Decode, d_url, "127.0.0.1", 5602),
        ],
        ..RouterConfig::default()
    }
}

/// POST a chat body to the router at `router_url`; (status, raw response text).
pub async fn post_chat(http: &reqwest::Client, router_url: &str, body: &Value) -> (u16, String) {
    let r = http
        .post(format!("{router_url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// P's answer: one token, P's own params, and (when given) what it reports
/// it did not compute (`usage.prompt_tokens_details.cached_tokens`).
pub fn p_answer(cached: Option<u64>) -> Answer {
    let mut usage = json!({"prompt_tokens": 10, "completion_tokens": 1});
    if let Some(c) = cached {
        usage["prompt_tokens_details"] = json!({"cached_tokens": c});
    }
    let v = json!({"id": "p", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
        "usage": usage,
        "kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": "p0", "remote_request_id": "p-1",
            "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": 5601}});
    (200, "application/json", v.to_string())
}

/// D's params text (raw, as an engine writes it): `held` tokens, an expiry
/// time serde_json's default float parsing does not round-trip, unknown keys.
pub fn d_params(held: u64) -> String {
    format!(
        r#"{{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":"d0","remote_request_id":"d-1","remote_block_ids":[[7,8,9]],"remote_host":"127.0.0.1","remote_port":5602,"tp_size":1,"remote_num_tokens":{held},"remote_blocks_expiry_time":1214.2449693849999,"dcp_size":1,"x_vendor":{{"ratio":1.50}}}}"#
    )
}

/// An SSE body from data payloads (and `[DONE]` when `done`).
pub fn sse(payloads: &[String], done: bool) -> Answer {
    let mut s = String::new();
    for p in payloads {
        s.push_str("data: ");
        s.push_str(p);
        s.push_str("\n\n");
    }
    if done {
        s.push_str("data: [DONE]\n\n");
    }
    (200, "text/event-stream", s)
}

/// A chat stream chunk with a content delta (and a finish reason).
pub fn delta(content: &str, finish: Option<&str>) -> String {
    json!({"id": "d", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}).to_string()
}

/// Tokens the engine-sim tokenizer gives a chat body.
pub fn n_tokens(body: &Value) -> u64 {
    kvloop_engine_sim::tokenize_body(body).unwrap().len() as u64
}

/// A scripted engine on a hand-written HTTP/1.1 loop (keep-alive,
/// `Content-Length` bodies) that resets the connection (`SO_LINGER` 0, an
/// RST) under the first `resets` POSTs after reading them whole: what the
/// router sees when an engine drops a reused keep-alive connection as the
/// request arrives, or its process goes away mid-request.
pub struct ResettingEngine {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ResettingEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ResettingEngine {
    pub async fn start(script: Script, resets: usize) -> ResettingEngine {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let resets = Arc::new(std::sync::atomic::AtomicUsize::new(resets));
        let seen2 = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = l.accept().await {
                let (script, seen, resets) = (script.clone(), seen2.clone(), resets.clone());
                tokio::spawn(serve_raw(conn, script, seen, resets));
            }
        });
        ResettingEngine { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Paths of the POSTs that arrived whole (reset ones included), in order.
    pub fn posts(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect()
    }
}

async fn serve_raw(
    mut conn: tokio::net::TcpStream,
    script: Script,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    resets: Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut words = head.split_whitespace();
        let (method, path) = (
            words.next().unwrap_or("").to_string(),
            words.next().unwrap_or("").to_string(),
        );
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 8192];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).to_string();
        buf.drain(..head_end + len);
        let (status, ct, out) = if method == "POST" {
            seen.lock().unwrap().push((path.clone(), body.clone()));
            let reset = resets
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if reset {
                let _ = conn.set_zero_linger();
                return;
            }
            let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            (script)(&path, &v)
        } else {
            (200, "application/json", "{}".to_string())
        };
        let reply = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {ct}\r\ncontent-length: {}\r\n\r\n{out}",
            out.len()
        );
        if conn.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}
