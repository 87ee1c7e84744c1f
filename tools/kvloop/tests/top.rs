//! `kvloop top` against two real agents probing each other: `--once
//! --json`, and the live view in a real terminal (tmux send-keys /
//! capture-pane).
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Two agents probing each other; waits (bounded) until A has a fit of B
/// and returns them with that `--once --json` snapshot of A.
fn pair(dir: &std::path::Path) -> (Daemon, Daemon, Value) {
    let (pa, pb) = (free_port(), free_port());
    let ca = agent_toml(
        dir,
        "node-a",
        pa,
        &format!("[[peers]]\nname = \"node-b\"\nhttp = \"127.0.0.1:{pb}\""),
    );
    let cb = agent_toml(
        dir,
        "node-b",
        pb,
        &format!("[[peers]]\nname = \"node-a\"\nhttp = \"127.0.0.1:{pa}\""),
    );
    let a = Daemon::start("kvloop-agent", &ca, &dir.join("a.log"));
    let b = Daemon::start("kvloop-agent", &cb, &dir.join("b.log"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = once(&a.http);
        let ok = v["paths"].as_array().unwrap().iter().any(|p| {
            p["peer"] == "node-b"
                && p["bandwidth_gbps"].is_f64()
                && p["probe_reads"].as_u64() > Some(0)
        });
        if ok {
            return (a, b, v);
        }
        assert!(
            Instant::now() < deadline,
            "no fit of node-b within 60 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn once(agent: &str) -> Value {
    let o = kvloop(
        &[],
        &["top", "--once", "--json", agent],
        Duration::from_secs(30),
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)))
}

#[test]
fn top_once_json_shows_the_paths_and_probe_latency() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, v) = pair(dir.path());
    let p = v["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["peer"] == "node-b")
        .unwrap()
        .clone();
    assert_eq!(p["agent"], "node-a", "{p}");
    assert!(p["bandwidth_gbps"].as_f64().unwrap() > 0.0, "{p}");
    assert!(
        p["p99_us"].as_f64().unwrap() >= p["p50_us"].as_f64().unwrap(),
        "{p}"
    );
    assert_eq!(p["path_valid"], true, "{p}");
    // An agent that is not there is listed as an error, exit status 1.
    let gone = format!("127.0.0.1:{}", free_port());
    let o = kvloop(
        &[],
        &["top", "--once", "--json", &gone],
        Duration::from_secs(30),
    );
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["errors"][0][0], gone.as_str(), "{v}");
}

fn tmux(sock: &str, args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .arg("-L")
        .arg(sock)
        .args(args)
        .output()
        .expect("tmux")
}

fn screen(sock: &str) -> String {
    String::from_utf8_lossy(&tmux(sock, &["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
}

/// Waits (bounded) until the pane shows `what`.
fn wait_for(sock: &str, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = screen(sock);
        if s.contains(what) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "pane never showed {what:?}:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "needs tmux"]
fn top_live_view_in_tmux_sorts_filters_and_quits() {
    need_tool("tmux");
    let dir = tempfile::tempdir().unwrap();
    let (a, _b, _) = pair(dir.path());
    let sock = format!("tl-top-{}", std::process::id());
    let cmd = format!("{KVLOOP} top {} --interval-ms 300 --seconds 60", a.http);
    let o = tmux(
        &sock,
        &[
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "120",
            "-y",
            "35",
            &cmd,
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = wait_for(&sock, "node-b");
    assert!(s.contains("kvloop top: paths"), "{s}");
    assert!(s.contains("sort: path"), "{s}");
    tmux(&sock, &["send-keys", "-t", "top", "s"]);
    wait_for(&sock, "sort: bandwidth");
    tmux(
        &sock,
        &[
            "send-keys",
            "-t",
            "top",
            "/",
            "n",
            "o",
            "d",
            "e",
            "-",
            "x",
            "Enter",
        ],
    );
    let s = wait_for(&sock, "filter: node-x");
    assert!(
        !s.lines()
            .any(|l| l.contains("node-a") && l.contains("node-b")),
        "{s}"
    );
    tmux(&sock, &["send-keys", "-t", "top", "a"]);
    wait_for(&sock, "alarms only: on");
    tmux(&sock, &["send-keys", "-t", "top", "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tmux(&sock, &["has-session", "-t", "top"]).status.success() {
        assert!(
            Instant::now() < deadline,
            "kvloop top did not quit on q:\n{}",
            screen(&sock)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = tmux(&sock, &["kill-server"]);
}
