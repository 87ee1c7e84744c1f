//! `kvloop ping` against a real `kvloop-agent`'s probe engine on loopback.
mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Runs `kvloop ping --json ARGS`; returns (exit code, JSON lines, stderr).
fn ping(args: &[&str]) -> (i32, Vec<Value>, String) {
    let mut a = vec!["ping", "--json"];
    a.extend_from_slice(args);
    let o = kvloop(&[], &a, Duration::from_secs(60));
    let lines = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    (
        o.status.code().expect("exit code"),
        lines,
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn events<'a>(v: &'a [Value], name: &str) -> Vec<&'a Value> {
    v.iter().filter(|e| e["event"] == name).collect()
}

#[test]
fn ping_reads_from_a_real_agents_probe_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (b, _) = agent(dir.path(), "node-b", "");
    let (code, out, err) = ping(&[&b.http, "-c", "5", "--blocks", "1,4"]);
    assert_eq!(code, 0, "{err}");
    let c = events(&out, "connected");
    assert_eq!(c.len(), 1, "{out:?}");
    assert_eq!(c[0]["engine_id"], "probe.node-b", "{}", c[0]);
    assert_eq!(c[0]["backend"], "libfabric/tcp;ofi_rxm", "{}", c[0]);
    let reads = events(&out, "read");
    assert_eq!(reads.len(), 10, "{out:?}");
    assert!(
        reads
            .iter()
            .all(|r| r["ok"] == true && r["us"].as_f64().unwrap() > 0.0)
    );
    let s = events(&out, "summary");
    assert_eq!(s.len(), 2);
    // Agent probe layout: 2 regions x 64 KiB blocks.
    assert_eq!(s[0]["bytes"], 2 * 65536);
    assert_eq!(s[1]["bytes"], 4 * 2 * 65536);
    assert_eq!(s[1]["descriptors"], 8);
    assert_eq!(s[1]["segments"], 2, "adjacent blocks coalesce per region");
    for r in &s {
        assert_eq!(r["reads"], 5);
        assert_eq!(r["failed"], 0);
        let (min, p50, max) = (
            r["min_us"].as_f64().unwrap(),
            r["typical_us"].as_f64().unwrap(),
            r["max_us"].as_f64().unwrap(),
        );
        assert!(min > 0.0 && min <= p50 && p50 <= max, "{r}");
        assert!(r["bw_gbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    // Strided: one segment per block and region.
    let (code, out, err) = ping(&[&b.http, "-c", "2", "--blocks", "4", "--strided", "-q"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        events(&out, "read").is_empty(),
        "--quiet prints no READ lines"
    );
    assert_eq!(events(&out, "summary")[0]["segments"], 8);
}

#[test]
fn ping_follows_a_probe_layout_other_than_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let (b, _) = agent(
        dir.path(),
        "node-b",
        "[probe]\nnum_regions = 1\nblock_len_bytes = 4096\nnum_blocks = 16\nlarge_blocks = 8",
    );
    let (code, out, err) = ping(&[&b.http, "-c", "3", "--blocks", "2"]);
    assert_eq!(code, 0, "{err}");
    let c = events(&out, "connected")[0];
    assert_eq!(c["num_regions"], 1, "{c}");
    assert_eq!(c["block_len_bytes"], 4096, "{c}");
    assert_eq!(c["remote_blocks"], 16, "{c}");
    assert_eq!(events(&out, "summary")[0]["bytes"], 2 * 4096);
    // More blocks than the peer has: refused before any READ.
    let (code, _, err) = ping(&[&b.http, "-c", "1", "--blocks", "32"]);
    assert_ne!(code, 0);
    assert!(err.contains("the peer has 16 blocks"), "{err}");
}

#[test]
fn ping_is_bounded_by_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (b, _) = agent(dir.path(), "node-b", "");
    let t = Instant::now();
    let (code, out, err) = ping(&[
        &b.http,
        "-c",
        "100000",
        "--blocks",
        "1",
        "--deadline-s",
        "0.5",
        "-q",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let s = events(&out, "summary")[0];
    let n = s["reads"].as_u64().unwrap();
    assert!(n > 0 && n < 100_000, "{s}");
    let (code, _, err) = ping(&[&b.http, "-c", "100001"]);
    assert_ne!(code, 0);
    assert!(err.contains("--count"), "{err}");
}

#[test]
fn ping_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let (b, _) = agent(dir.path(), "node-b", "[probe]\nenabled = false");
    let (code, _, err) = ping(&[&b.http, "-c", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("runs no probe engine"), "{err}");
    assert!(err.contains("--side-channel"), "{err}");
    let (code, _, err) = ping(&[&format!("127.0.0.1:{}", free_port()), "-c", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("/v1/engines"), "{err}");
}
