//! The real binaries as processes: two `kvloop-engine-sim` (P, D) and
//! `kvloop-router` with a TOML config, a multi-turn streamed conversation.
mod common;

use std::path::PathBuf;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_binaries_multi_turn() {
    let p = start_sim_process("prefill", "p0");
    let d = start_sim_process("decode", "d0");
    let cfg = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"t\"\nhealth_interval_ms = 200\n\n{}",
        p0_d0_registry(&p, &d)
    );
    let path = std::env::temp_dir().join(format!("kvloop-router-test-{}.toml", std::process::id()));
    std::fs::write(&path, cfg).unwrap();
    let router_bin = PathBuf::from(env!("CARGO_BIN_EXE_kvloop-router"));
    let r = start_bin(&router_bin, &["--config", path.to_str().unwrap()]);
    let base = format!("http://{}", r.get("http").unwrap());
    let http = reqwest::Client::new();
    let url = format!("{base}/v1/chat/completions");

    let mut messages = vec![user(&words(200, "w"))];
    for turn in 0..4 {
        let body =
            json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": 12});
        let r = http
            .post(&url)
            .header("x-session-id", "conv-proc")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let answer: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        assert!(!answer.is_empty(), "turn {turn}: {text}");
        messages.push(assistant(&answer));
        messages.push(user(&words(30, &format!("t{turn}x"))));
    }
    assert_eq!(metric(&http, &base, NO_ENTRY).await, 1.0);
    assert_eq!(metric(&http, &base, PULLED).await, 3.0);
    let h: serde_json::Value = http
        .get(format!("{base}/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
    let stats: serde_json::Value = http
        .get(format!("http://{}/sim/stats", p.get("http").unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["reads_ok"], 3);
    let _ = std::fs::remove_file(&path);
}
