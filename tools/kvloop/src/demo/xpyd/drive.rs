//! The cluster demo's client: `concurrency` workers, each running whole
//! conversations (streamed chat completions with `conversation_id`), turn
//! `k` of conversation `c` sent to replica `(c + k) % 2`, so consecutive
//! turns alternate between the two router replicas and only the shared
//! store (Redis) lets a turn reuse the previous one's KV. A replica that
//! refuses the connection is skipped for the other; a request that fails
//! (in flight on a killed replica) is recorded and its turn sent once more
//! to the other replica, as a client with a retry policy would.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvloop_loadgen::sse::{SseParser, StreamEvent, parse_event};
use kvloop_loadgen::{Conversation, Message};
use serde_json::json;

use super::unix_ms;
use std::sync::Mutex;

/// One request as the client saw it.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Rec {
    /// Conversation index.
    pub(super) conv: usize,
    /// User turn (0-based).
    pub(super) turn: usize,
    /// Replica it went to.
    pub(super) replica: usize,
    /// `x-request-id` sent.
    pub(super) request_id: String,
    /// Sent, Unix ms.
    pub(super) sent_unix_ms: f64,
    /// Sent, ms since the run began.
    pub(super) t_ms: f64,
    /// Time to the first content chunk, ms.
    pub(super) ttft_ms: Option<f64>,
    /// Error, if it failed.
    pub(super) error: Option<String>,
    /// A retry of this turn after a failure.
    pub(super) retry: bool,
    /// Sent to the other replica because its own refused the connection.
    pub(super) failed_over: bool,
    /// The `x-kvloop-route` header.
    pub(super) route: Option<String>,
}

/// The replicas' base URLs and which the client believes up.
pub(super) struct Replicas {
    pub(super) urls: [String; 2],
    up: [AtomicBool; 2],
}

impl Replicas {
    pub(super) fn new(urls: [String; 2]) -> Self {
        Self {
            urls,
            up: [AtomicBool::new(true), AtomicBool::new(true)],
        }
    }
}

/// What a run needs.
pub(super) struct Drive {
    pub(super) http: reqwest::Client,
    pub(super) replicas: Replicas,
    pub(super) tag: String,
    pub(super) answer_tokens: u64,
    pub(super) deadline: Instant,
    pub(super) start: Instant,
    /// Requests finished (events are scheduled on it).
    pub(super) done: AtomicUsize,
    pub(super) records: Mutex<Vec<Rec>>,
    seq: AtomicUsize,
}

impl Drive {
    pub(super) fn new(
        http: reqwest::Client,
        urls: [String; 2],
        tag: &str,
        answer_tokens: u64,
        max_s: u64,
    ) -> Self {
        let start = Instant::now();
        Self {
            http,
            replicas: Replicas::new(urls),
            tag: tag.into(),
            answer_tokens,
            deadline: start + Duration::from_secs(max_s),
            start,
            done: AtomicUsize::new(0),
            records: Mutex::new(Vec::new()),
            seq: AtomicUsize::new(0),
        }
    }

    /// Runs every conversation with `concurrency` workers.
    pub(super) async fn run(self: &Arc<Self>, convs: &Arc<Vec<Conversation>>, concurrency: usize) {
        let next = Arc::new(AtomicUsize::new(0));
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..concurrency.max(1) {
            let (me, convs, next) = (self.clone(), convs.clone(), next.clone());
            set.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = convs.get(i) else { break };
                    if Instant::now() >= me.deadline {
                        break;
                    }
                    me.conversation(i, c).await;
                }
            });
        }
        while set.join_next().await.is_some() {}
    }

    async fn conversation(&self, ci: usize, c: &Conversation) {
        let cid = format!("{}@{}", c.id, self.tag);
        let mut history: Vec<Message> = Vec::new();
        let mut skip_reference = false;
        let mut turn = 0;
        for m in &c.messages {
            match m.role.as_str() {
                "user" => {
                    if Instant::now() >= self.deadline {
                        return;
                    }
                    history.push(m.clone());
                    let mut answer = None;
                    for retry in [false, true] {
                        let rec = self.send(ci, turn, &cid, &history, retry).await;
                        let ok = rec.0.error.is_none();
                        self.records.lock().expect("records").push(rec.0);
                        self.done.fetch_add(1, Ordering::Relaxed);
                        if ok {
                            answer = Some(rec.1);
                            break;
                        }
                    }
                    let Some(answer) = answer else { return };
                    history.push(Message::new("assistant", answer));
                    skip_reference = true;
                    turn += 1;
                }
                "assistant" if skip_reference => skip_reference = false,
                _ => {
                    skip_reference = false;
                    history.push(m.clone());
                }
            }
        }
    }

    /// Sends one turn: to replica `(conv + turn) % 2` (the other one on a
    /// retry, or when this one refuses connections).
    async fn send(
        &self,
        ci: usize,
        turn: usize,
        cid: &str,
        history: &[Message],
        retry: bool,
    ) -> (Rec, String) {
        let mut replica = (ci + turn + usize::from(retry)) % 2;
        let mut failed_over = false;
        if !self.replicas.up[replica].load(Ordering::Relaxed) {
            replica = 1 - replica;
            failed_over = true;
        }
        let request_id = format!("{}-{}", self.tag, self.seq.fetch_add(1, Ordering::Relaxed));
        let mut rec = Rec {
            conv: ci,
            turn,
            replica,
            request_id,
            sent_unix_ms: unix_ms(),
            t_ms: self.start.elapsed().as_secs_f64() * 1e3,
            ttft_ms: None,
            error: None,
            retry,
            failed_over,
            route: None,
        };
        let body = json!({
            "model": "sim-model", "messages": history, "stream": true,
            "max_tokens": self.answer_tokens, "conversation_id": cid,
        });
        let mut answer = String::new();
        let t0 = Instant::now();
        let mut r = self.stream(replica, &body, &mut rec, &mut answer, t0).await;
        if let Err((true, _)) = &r {
            // Connection refused: this replica is down; the other one.
            self.replicas.up[replica].store(false, Ordering::Relaxed);
            rec.replica = 1 - replica;
            rec.failed_over = true;
            r = self
                .stream(1 - replica, &body, &mut rec, &mut answer, t0)
                .await;
        }
        if let Err((_, e)) = r {
            rec.error = Some(e);
        }
        (rec, answer)
    }

    /// Marks replica `i` up (after a restart).
    pub(super) fn mark_up(&self, i: usize) {
        self.replicas.up[i].store(true, Ordering::Relaxed);
    }

    /// `Err((connect_failed, message))`.
    async fn stream(
        &self,
        replica: usize,
        body: &serde_json::Value,
        rec: &mut Rec,
        answer: &mut String,
        t0: Instant,
    ) -> Result<(), (bool, String)> {
        let url = format!("{}/v1/chat/completions", self.replicas.urls[replica]);
        let resp = self
            .http
            .post(&url)
            .header("x-request-id", &rec.request_id)
            .json(body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .map_err(|e| (e.is_connect(), format!("POST {url}: {e}")))?;
        if !resp.status().is_success() {
            let st = resp.status();
            let text = resp.text().await.unwrap_or_default();
            return Err((
                false,
                format!("HTTP {st}: {}", text.chars().take(200).collect::<String>()),
            ));
        }
        rec.route = resp
            .headers()
            .get("x-kvloop-route")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut resp = resp;
        let mut parser = SseParser::new();
        let mut done = false;
        while !done {
            let chunk = match resp.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => return Err((false, format!("reading stream: {e}"))),
            };
            for data in parser.push(&chunk) {
                match parse_event(&data).map_err(|e| (false, e))? {
                    StreamEvent::Done => done = true,
                    StreamEvent::Error(e) => return Err((false, format!("error in stream: {e}"))),
                    StreamEvent::Chunk(c) => {
                        if rec.ttft_ms.is_none() && !c.content.is_empty() {
                            rec.ttft_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
                        }
                        answer.push_str(&c.content);
                    }
                }
            }
        }
        if !done {
            return Err((false, "stream ended before [DONE]".into()));
        }
        Ok(())
    }
}

/// The value of `key=` in an `x-kvloop-route` line (top-level keys only).
pub(super) fn route_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let head = line.split(" chosen=(").next().unwrap_or(line);
    head.split(' ')
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

#[cfg(test)]
mod tests {
    use super::route_field;

    #[test]
    fn route_fields_are_read_from_the_header_line() {
        let l = "reason=predicted_pull decision=pulled prefill=p0 decode=d1 action=pull reused=4096 reusable=4096 prev_decode=d2 chosen=(p0 pull ttft=1ms queue=0 reuse=0 suffix=1) runner_up=(p1 recompute ttft=9ms queue=0 reuse=0 suffix=1)";
        assert_eq!(route_field(l, "prefill"), Some("p0"));
        assert_eq!(route_field(l, "reusable"), Some("4096"));
        assert_eq!(route_field(l, "prev_decode"), Some("d2"));
        assert_eq!(route_field(l, "reuse"), None);
        assert_eq!(
            route_field("reason=round_robin action=recompute", "prev_decode"),
            None
        );
    }
}
