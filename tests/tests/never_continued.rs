//! Fault matrix (issue 12): 10,000 conversations that never send a second
//! turn. Real processes on loopback: a prefill engine P and a decode engine
//! D (`kvloop-engine-sim`, D keeping finished requests' blocks for a short
//! `--decoder-kv-blocks-ttl-ms`) behind `kvloop-router` with a small
//! `store_capacity` and the same TTL. Every turn is answered; the router's
//! conversation store stays within its capacity (LRU evictions counted),
//! its memory stays bounded, and once the TTL has passed D holds no blocks
//! and the router no entries (expirations counted). Bounded in count
//! (10,000 requests, 16 at a time) and time (a 240 s deadline, failing).
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvloop_tests::{ReadyChild, bin, free_port};
use serde_json::{Value, json};

const CONVERSATIONS: u64 = 10_000;
const CONCURRENCY: u64 = 16;
/// Below what arrives within one TTL, so that both LRU eviction and
/// expiry happen.
const STORE_CAPACITY: u64 = 100;
const TTL_MS: u64 = 3000;
const DEADLINE: Duration = Duration::from_secs(240);

fn engine(dir: &std::path::Path, role: &str, id: &str, http: u16, side: u16) -> ReadyChild {
    let mut cmd = Command::new(bin("kvloop-engine-sim"));
    cmd.args(["--role", role, "--engine-id", id])
        .args(["--http-addr", &format!("127.0.0.1:{http}")])
        .args(["--side-channel-addr", &format!("127.0.0.1:{side}")])
        .args(["--prefill-us-per-token", "1"])
        .args(["--decoder-kv-blocks-ttl-ms", &TTL_MS.to_string()])
        .env("RUST_LOG", "warn");
    ReadyChild::start(
        id,
        cmd,
        Some(&dir.join(format!("{id}.log"))),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Sum of the series of `name` in Prometheus text whose labels contain `label`.
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Resident memory of process `pid`, KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

async fn get_text(http: &reqwest::Client, url: &str) -> String {
    http.get(url).send().await.unwrap().text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_never_continued_conversations_stay_bounded_and_are_released_by_ttl() {
    let dir = std::env::temp_dir().join(format!("kvloop-never-continued-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (p_http, p_side, d_http, d_side, r_port) = (
        free_port("127.0.0.1"),
        free_port("127.0.0.1"),
        free_port("127.0.0.1"),
        free_port("127.0.0.1"),
        free_port("127.0.0.1"),
    );
    let _p = engine(&dir, "prefill", "p0", p_http, p_side);
    let _d = engine(&dir, "decode", "d0", d_http, d_side);
    std::fs::write(
        dir.join("router.toml"),
        format!(
            r#"listen = "127.0.0.1:{r_port}"
admin_token = "nc"
store_capacity = {STORE_CAPACITY}
decoder_kv_blocks_ttl_ms = {TTL_MS}
ttl_safety_margin_ms = 500
health_interval_ms = 200

[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "http://127.0.0.1:{p_http}"
side_channel_host = "127.0.0.1"
side_channel_port = {p_side}

[[engines]]
engine_id = "d0"
role = "decode"
http_url = "http://127.0.0.1:{d_http}"
side_channel_host = "127.0.0.1"
side_channel_port = {d_side}
"#
        ),
    )
    .unwrap();
    let mut cmd = Command::new(bin("kvloop-router"));
    cmd.arg("--config")
        .arg(dir.join("router.toml"))
        .env("RUST_LOG", "warn");
    let router = ReadyChild::start(
        "router",
        cmd,
        Some(&dir.join("router.log")),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let base = format!("http://127.0.0.1:{r_port}");
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let ok = http
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "router not healthy; logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let router_pid = router.pid();
    let rss_start_kib = rss_kib(router_pid);

    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    let start = Instant::now();
    for _ in 0..CONCURRENCY {
        let (next, failed, http, base) = (next.clone(), failed.clone(), http.clone(), base.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= CONVERSATIONS || start.elapsed() > DEADLINE {
                    return;
                }
                let prompt: String = (0..40).map(|w| format!(" c{i}w{w}")).collect();
                let r = http
                    .post(format!("{base}/v1/completions"))
                    .json(
                        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2,
                                  "conversation_id": format!("never-{i}")}),
                    )
                    .send()
                    .await;
                let ok = match r {
                    Ok(r) if r.status().is_success() => r
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["choices"][0]["text"].is_string()),
                    _ => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let took = start.elapsed();
    let sent = next.load(Ordering::Relaxed).min(CONVERSATIONS);
    assert_eq!(
        sent, CONVERSATIONS,
        "only {sent} requests within {DEADLINE:?}"
    );
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed turns; logs in {}",
        dir.display()
    );

    let m = get_text(&http, &format!("{base}/metrics")).await;
    let entries = metric(&m, "kvloop_router_store_entries", "");
    let lru = metric(&m, "kvloop_router_store_evictions_total", "cause=\"lru\"");
    let expired = metric(
        &m,
        "kvloop_router_store_evictions_total",
        "cause=\"expired\"",
    );
    let rss_end_kib = rss_kib(router_pid);
    let d_holds = get_json(&http, &format!("http://127.0.0.1:{d_http}/sim/stats")).await["holds"]
        .as_u64()
        .unwrap();
    eprintln!(
        "never-continued: {CONVERSATIONS} conversations in {:.1} s; router store {entries} entries \
         (capacity {STORE_CAPACITY}), {lru} LRU evictions, {expired} expired, RSS {rss_start_kib} -> {rss_end_kib} KiB; \
         D holds {d_holds}",
        took.as_secs_f64()
    );
    assert!(
        entries <= STORE_CAPACITY as f64,
        "store holds {entries} > capacity {STORE_CAPACITY}"
    );
    // Every stored turn is still stored, or was evicted (LRU) or expired.
    assert!(
        lru + expired + entries >= CONVERSATIONS as f64,
        "turns unaccounted: {entries} stored, {lru} LRU, {expired} expired"
    );
    assert!(lru > 0.0, "capacity {STORE_CAPACITY} never reached");
    assert!(
        rss_end_kib < rss_start_kib + 128 * 1024,
        "router RSS grew from {rss_start_kib} to {rss_end_kib} KiB"
    );

    // After the TTL: D released every hold, the router dropped every entry.
    let deadline = Instant::now() + Duration::from_millis(TTL_MS * 4 + 5000);
    loop {
        let holds = get_json(&http, &format!("http://127.0.0.1:{d_http}/sim/stats")).await["holds"]
            .as_u64()
            .unwrap();
        let m = get_text(&http, &format!("{base}/metrics")).await;
        let entries = metric(&m, "kvloop_router_store_entries", "");
        let expired = metric(
            &m,
            "kvloop_router_store_evictions_total",
            "cause=\"expired\"",
        );
        if holds == 0 && entries == 0.0 {
            eprintln!(
                "never-continued: after the TTL D holds 0 blocks, the router 0 entries ({expired} expired)"
            );
            assert!(expired > 0.0, "no expiry counted: {m}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the TTL: D still holds {holds} requests' blocks, the router {entries} entries"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
