//! The real binaries as processes: two `kvloop-engine-sim` (P, D) and
//! `kvloop-router` with a TOML config, a multi-turn streamed conversation.
mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::json;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start a binary and read its `READY key=value ...` line.
fn start(bin: &PathBuf, args: &[&str]) -> (Proc, Vec<(String, String)>) {
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert!(line.starts_with("READY"), "{}: {line:?}", bin.display());
    let kv = line
        .split_whitespace()
        .skip(1)
        .filter_map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    (Proc(child), kv)
}

fn engine_sim_bin() -> PathBuf {
    let router = PathBuf::from(env!("CARGO_BIN_EXE_kvloop-router"));
    let bin = router.with_file_name("kvloop-engine-sim");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "kvloop-engine-sim"]);
        if router
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n == "release")
        {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("cargo runs");
        assert!(st.success(), "building kvloop-engine-sim failed");
    }
    assert!(bin.exists(), "{} missing after build", bin.display());
    bin
}

fn get<'a>(kv: &'a [(String, String)], k: &str) -> &'a str {
    &kv.iter().find(|(a, _)| a == k).unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_binaries_multi_turn() {
    let sim = engine_sim_bin();
    let (_p, pkv) = start(
        &sim,
        &[
            "--role",
            "prefill",
            "--engine-id",
            "p0",
            "--prefill-us-per-token",
            "1",
        ],
    );
    let (_d, dkv) = start(
        &sim,
        &[
            "--role",
            "decode",
            "--engine-id",
            "d0",
            "--prefill-us-per-token",
            "1",
        ],
    );
    let side = |kv: &[(String, String)]| {
        get(kv, "side_channel")
            .rsplit_once(':')
            .map(|(h, p)| (h.to_string(), p.to_string()))
            .unwrap()
    };
    let (ph, pp) = side(&pkv);
    let (dh, dp) = side(&dkv);
    let cfg = format!(
        r#"listen = "127.0.0.1:0"
admin_token = "t"
health_interval_ms = 200

[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "http://{}"
side_channel_host = "{ph}"
side_channel_port = {pp}

[[engines]]
engine_id = "d0"
role = "decode"
http_url = "http://{}"
side_channel_host = "{dh}"
side_channel_port = {dp}
"#,
        get(&pkv, "http"),
        get(&dkv, "http")
    );
    let path = std::env::temp_dir().join(format!("kvloop-router-test-{}.toml", std::process::id()));
    std::fs::write(&path, cfg).unwrap();
    let router_bin = PathBuf::from(env!("CARGO_BIN_EXE_kvloop-router"));
    let (_r, rkv) = start(&router_bin, &["--config", path.to_str().unwrap()]);
    let base = format!("http://{}", get(&rkv, "http"));
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
        .get(format!("http://{}/sim/stats", get(&pkv, "http")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["reads_ok"], 3);
    let _ = std::fs::remove_file(&path);
}
