//! End to end against an in-process mock OpenAI-compatible SSE server on
//! 127.0.0.1: the headers and body the client sends, the server's answer fed
//! back as history, limits, failures, and the merged multi-mode report.
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use kvloop_loadgen::client::{ClientConfig, run_mode};
use kvloop_loadgen::report::{Report, default_bucket_edges_tokens};
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{Conversation, Message, chart};
use serde_json::{Value, json};

/// One request the mock saw: its `X-Session-ID` header and its body.
type SeenRequest = (Option<String>, Value);

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<SeenRequest>>>);

/// The answer the mock gives: unique per conversation and turn, so the test
/// can find it in the next request's history.
fn answer_for(cid: &str, n_messages: usize) -> String {
    format!("answer of {cid} after {n_messages} messages")
}

async fn chat(State(seen): State<Seen>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    let sid = headers
        .get("x-session-id")
        .map(|h| h.to_str().unwrap().to_string());
    seen.0.lock().unwrap().push((sid, v.clone()));
    let cid = v["conversation_id"].as_str().unwrap_or("").to_string();
    if cid.starts_with("fail") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "simulated failure").into_response();
    }
    let n = v["messages"].as_array().map_or(0, Vec::len);
    let words: Vec<String> = answer_for(&cid, n).split(' ').map(str::to_string).collect();
    let mut out = String::new();
    let chunk = |delta: Value, fin: Value| {
        format!(
            "data: {}\n\n",
            json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]})
        )
    };
    out.push_str(&chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    ));
    for (i, w) in words.iter().enumerate() {
        let piece = if i == 0 { w.clone() } else { format!(" {w}") };
        out.push_str(&chunk(json!({"content": piece}), Value::Null));
    }
    out.push_str(&chunk(json!({}), json!("length")));
    out.push_str(&format!(
        "data: {}\n\n",
        json!({"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 1000 + n, "completion_tokens": words.len()}})
    ));
    out.push_str(&format!("data: {}\n\n", json!({"object": "chat.completion.chunk", "choices": [], "kv_transfer_params": {"remote_num_tokens": n}})));
    out.push_str("data: [DONE]\n\n");
    // Split the stream into small pieces so events straddle reads.
    let pieces: Vec<Result<bytes::Bytes, std::convert::Infallible>> = out
        .into_bytes()
        .chunks(37)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-kvloop-decision", "recompute")
        .header("x-kvloop-transfer-ms", format!("{}", 10 * n))
        .body(Body::from_stream(futures_util::stream::iter(pieces)))
        .unwrap()
}

async fn spawn_mock() -> (String, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"data": [{"id": "mock-model"}]})) }),
        )
        .route("/v1/chat/completions", post(chat))
        .with_state(seen.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let l = l.tap_io(|s| {
        let _ = s.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn conversations() -> Vec<Conversation> {
    (0..3)
        .map(|i| Conversation {
            id: format!("conv{i}"),
            messages: vec![
                Message::new("system", "be brief"),
                Message::new(
                    "user",
                    format!(
                        "first question {i} {}",
                        "lorem ipsum ".repeat(100 * (i + 1))
                    ),
                ),
                Message::new("assistant", "REFERENCE one two three four five six seven"),
                Message::new("user", "second question"),
                Message::new("assistant", "REFERENCE short"),
                Message::new("user", "third question"),
            ],
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_session_and_feeds_answers_back() {
    let (url, seen) = spawn_mock().await;
    let tok = TokenCounter::default_counter();
    let mut cfg = ClientConfig::new(&url);
    cfg.request_timeout = std::time::Duration::from_secs(30);
    cfg.max_concurrency = 2;
    cfg.extra_body.insert("cache_salt".into(), json!("s1"));
    let convs = conversations();
    let run = run_mode("OFF", &convs, &cfg, &tok).await.unwrap();
    assert_eq!(run.records.len(), 9);
    assert!(
        run.records.iter().all(|r| r.error.is_none()),
        "{:?}",
        run.records
    );
    let seen = seen.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 9);
    for (sid, body) in &seen {
        let cid = body["conversation_id"].as_str().unwrap();
        assert_eq!(
            sid.as_deref(),
            Some(cid),
            "X-Session-ID equals the body's conversation_id"
        );
        assert!(cid.ends_with("@OFF"), "{cid}");
        assert_eq!(body["model"], "mock-model");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["cache_salt"], "s1");
        let msgs = body["messages"].as_array().unwrap();
        let n = msgs.len();
        assert_eq!(msgs[0]["role"], "system");
        assert_eq!(msgs[n - 1]["role"], "user");
        // History: the server's own earlier answers, never the references.
        for (k, m) in msgs.iter().enumerate() {
            assert!(!m["content"].as_str().unwrap().contains("REFERENCE"));
            if m["role"] == "assistant" {
                assert_eq!(m["content"], answer_for(cid, k), "answer fed back at {k}");
            }
        }
        let expected_max = match n {
            2 => tok.count("REFERENCE one two three four five six seven") as u64,
            4 => tok.count("REFERENCE short") as u64,
            6 => 64, // no reference after the last user turn: default
            _ => panic!("{n} messages"),
        };
        assert_eq!(body["max_tokens"], expected_max, "{n} messages");
    }
    for r in &run.records {
        let ttft = r.ttft_ms.expect("ttft");
        assert!(ttft > 0.0 && ttft <= r.latency_ms);
        let n_messages = 2 * r.turn + 2;
        assert_eq!(r.server_prompt_tokens, Some(1000 + n_messages as u64));
        assert_eq!(
            r.output_tokens,
            answer_for(&r.conversation_id, n_messages)
                .split(' ')
                .count() as u64
        );
        assert!(r.tpot_ms.is_some());
        assert!(r.input_tokens > 0);
        assert_eq!(r.server_info["x-kvloop-decision"], "recompute");
        assert_eq!(
            r.server_info["kv_transfer_params"]["remote_num_tokens"],
            n_messages
        );
    }
    // Turns of one conversation grow in input tokens.
    for c in ["conv0@OFF", "conv1@OFF", "conv2@OFF"] {
        let t: Vec<u64> = run
            .records
            .iter()
            .filter(|r| r.conversation_id == c)
            .map(|r| r.input_tokens)
            .collect();
        assert_eq!(t.len(), 3);
        assert!(t[0] < t[1] && t[1] < t[2], "{c}: {t:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_failures_are_recorded() {
    let (url, seen) = spawn_mock().await;
    let tok = TokenCounter::default_counter();
    let mut convs = conversations();
    convs[1].id = "fail-me".into();
    let mut cfg = ClientConfig::new(&url);
    cfg.model = Some("m".into());
    cfg.request_timeout = std::time::Duration::from_secs(30);
    cfg.tag_ids_with_mode = false;
    let run = run_mode("x", &convs, &cfg, &tok).await.unwrap();
    // conv0: 3 turns, fail-me: 1 failed turn ends it, conv2: 3 turns.
    assert_eq!(run.records.len(), 7);
    let failed: Vec<_> = run.records.iter().filter(|r| r.error.is_some()).collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].conversation_id, "fail-me");
    assert!(failed[0].error.as_ref().unwrap().contains("500"));
    assert!(
        seen.0
            .lock()
            .unwrap()
            .iter()
            .all(|(_, b)| b["model"] == "m")
    );
    // Bounded in count.
    cfg.max_requests = 4;
    let run = run_mode("y", &conversations(), &cfg, &tok).await.unwrap();
    assert_eq!(run.records.len(), 4);
    // Bounded in time: nothing starts after the deadline.
    cfg.max_requests = 1000;
    cfg.max_duration = std::time::Duration::ZERO;
    let run = run_mode("z", &conversations(), &cfg, &tok).await.unwrap();
    assert!(run.records.is_empty());
    // Bad configuration is an error naming the field.
    let mut bad = ClientConfig::new("ftp://127.0.0.1:1");
    bad.model = Some("m".into());
    let e = run_mode("b", &convs, &bad, &tok).await.unwrap_err();
    assert!(e.to_string().contains("base_url"), "{e}");
    let mut bad = ClientConfig::new(&url);
    bad.max_concurrency = 0;
    assert!(
        run_mode("b", &convs, &bad, &tok)
            .await
            .unwrap_err()
            .to_string()
            .contains("max_concurrency")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_modes_merge_into_one_report_and_chart() {
    let (url, _) = spawn_mock().await;
    let tok = TokenCounter::default_counter();
    let mut cfg = ClientConfig::new(&url);
    cfg.request_timeout = std::time::Duration::from_secs(30);
    let convs = conversations();
    let mut rep = Report::new(default_bucket_edges_tokens(), tok.name());
    for mode in ["OFF", "fixed", "adaptive"] {
        let mut run = run_mode(mode, &convs, &cfg, &tok).await.unwrap();
        run.meta.insert("threshold_tokens".into(), json!(64));
        rep.push(run);
    }
    assert_eq!(rep.modes(), ["OFF", "fixed", "adaptive"]);
    let table = rep.render_table();
    println!("{table}");
    for m in ["OFF", "fixed", "adaptive", "TTFT p50", "x adaptive"] {
        assert!(table.contains(m), "{m} missing from\n{table}");
    }
    let later = rep.summaries_where(|r| r.turn > 0);
    assert_eq!(
        later
            .iter()
            .filter(|r| r.mode == "OFF")
            .map(|r| r.count)
            .sum::<usize>(),
        6
    );
    assert!(rep.render_table_where(|r| r.turn > 0).contains("x fixed"));
    let rows = rep.summaries();
    assert_eq!(
        rows.iter()
            .filter(|r| r.mode == "OFF")
            .map(|r| r.count)
            .sum::<usize>(),
        9
    );
    assert!(
        rows.iter()
            .all(|r| r.ttft_ms_p50.is_some() && r.errors == 0)
    );
    // Numeric server-reported values are summarized per bucket.
    assert!(
        rows.iter()
            .all(|r| r.server_p50.contains_key("x-kvloop-transfer-ms"))
    );
    assert!(
        rows.iter()
            .all(|r| !r.server_p50.contains_key("x-kvloop-decision"))
    );
    let dir = std::env::temp_dir().join(format!("kvloop-loadgen-report-{}", std::process::id()));
    let json_path = dir.join("report.json");
    rep.write_json(&json_path).unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let s0 = &v["summary"][0];
    for k in [
        "mode",
        "prompt_tokens",
        "ttft_ms_p50",
        "ttft_ms_p90",
        "tpot_ms_p50",
        "latency_ms_p50",
        "count",
    ] {
        assert!(!s0[k].is_null(), "summary field {k}");
    }
    assert_eq!(v["runs"][2]["meta"]["threshold_tokens"], 64);
    let back = Report::read_json(&json_path).unwrap();
    assert_eq!(back.modes(), rep.modes());
    assert_eq!(back.summaries().len(), rep.summaries().len());
    assert_eq!(back.runs[1].records.len(), 9);
    let png = dir.join("ttft.png");
    chart::write_ttft_chart(&rep, &png, "TTFT vs prompt length").unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    std::fs::remove_dir_all(&dir).unwrap();
}
