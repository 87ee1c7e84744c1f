//! End to end over two network namespaces ("nodes" A and B joined by a
//! veth): one `kvloop-agent` per namespace, a running `kvloop-router` on
//! node A, `tc tbf` on B's egress (what A READs from B). The agents probe
//! each other; A's engine reports prefill timings; A pushes the threshold of
//! pair (p0 on A, d0 on B) to the router. Lowering the link rate mid-run
//! raises the threshold the router holds within 10 s.
//!
//! Prints the convergence time and the threshold at three link rates.
//! Needs root (namespaces, tc): `#[ignore]`d, fails when run without it.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{get_in_ns, require_root, start_netns_agents, start_router_in_ns, workspace_bin};
use kvloop_agent::client::AgentClient;
use kvloop_cli::netns::NodePair;

const TOKEN: &str = "e2e-secret";
const BYTES_PER_TOKEN: u64 = 8192; // 2 regions × 64 KiB per 16-token block
/// Synthetic prefill cost reported by "engine" p0:
/// `t = P0 + n·(K1 + K2·(ctx + n/2))` ms, `n` computed tokens, `ctx` reused.
const P0_MS: f64 = 5.0;
const K1: f64 = 0.05;
const K2: f64 = 2e-5;

/// The router's pushed threshold for (p0, d0), if in force.
fn router_threshold(ns: &str, router: &str) -> Option<u64> {
    let (st, body) = get_in_ns(ns, router, "/admin/thresholds", Some(TOKEN))?;
    if st != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["pairs"].as_array()?.iter().find_map(|p| {
        (p["prefill_engine_id"] == "p0" && p["decode_engine_id"] == "d0" && p["in_force"] == true)
            .then(|| p["threshold_tokens"].as_u64())
            .flatten()
    })
}

fn agent_config(
    dir: &Path,
    name: &str,
    addr: &str,
    peer: &str,
    peer_addr: &str,
    router: Option<&str>,
) -> std::path::PathBuf {
    let sock = dir.join(format!("{name}.sock"));
    let mut t = format!(
        r#"
agent_id = "{name}"
node_addr = "{addr}"
http_listen = "{addr}:9470"
socket_path = "{sock}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
push_period_ms = 500
[probe]
period_ms = 300
num_regions = 2
num_blocks = 32
block_len_bytes = 65536
small_blocks = 8
large_blocks = 24
max_bytes_per_s = 67108864
[[peers]]
name = "{peer}"
http = "{peer_addr}:9470"
"#,
        sock = sock.display()
    );
    if let Some(r) = router {
        t.push_str(&format!(
            r#"
[[routers]]
url = "http://{r}"
token = "{TOKEN}"
[[pairs]]
prefill_engine_id = "p0"
decode_engine_id = "d0"
decode_peer = "{peer}"
bytes_per_token = {BYTES_PER_TOKEN}
block_size_tokens = 16
regions_per_block = 2
"#
        ));
    }
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, t).unwrap();
    p
}

/// Samples of the synthetic prefill model, deterministic ±3 % ripple.
fn prefill_samples(round: u64) -> Vec<(u64, u64, u64)> {
    let mut v = Vec::new();
    for (i, n) in [256u64, 512, 1024, 2048, 4096, 8192].iter().enumerate() {
        let ctx = [0u64, 0, 1024, 0, 2048, 0][i];
        let ms = P0_MS + *n as f64 * (K1 + K2 * (ctx as f64 + *n as f64 / 2.0));
        let ripple = 1.0 + 0.03 * (((round * 7 + i as u64) % 5) as f64 - 2.0) / 2.0;
        v.push((n + ctx, ctx, (ms * ripple * 1e3) as u64));
    }
    v
}

/// Waits until the router's threshold has been stable (±5 %) for `stable`,
/// feeding prefill samples; returns (threshold, seconds until the first
/// value of the stable run ≥ `min_rise` × `from` was seen, if `from` given).
async fn settle(
    client: &AgentClient,
    ns: &str,
    router: &str,
    round: &mut u64,
    from: Option<u64>,
    limit: Duration,
) -> (Option<u64>, Option<f64>) {
    let t0 = Instant::now();
    let mut first_rise: Option<f64> = None;
    let mut last: Option<u64> = None;
    let mut stable_since = Instant::now();
    while t0.elapsed() < limit {
        *round += 1;
        for (p, r, us) in prefill_samples(*round) {
            client.record_prefill("p0", p, r, us).await.unwrap();
        }
        let th = router_threshold(ns, router);
        if let (Some(f), Some(t), None) = (from, th, first_rise)
            && t as f64 >= 1.3 * f as f64
        {
            first_rise = Some(t0.elapsed().as_secs_f64());
        }
        match (last, th) {
            (Some(a), Some(b)) if (a as f64 - b as f64).abs() <= 0.05 * a as f64 => {}
            _ => stable_since = Instant::now(),
        }
        last = th;
        if th.is_some()
            && stable_since.elapsed() >= Duration::from_secs(4)
            && (from.is_none() || first_rise.is_some())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    (last, first_rise)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (network namespaces, tc)"]
async fn lowering_the_link_rate_raises_the_pushed_threshold() {
    require_root("lowering_the_link_rate_raises_the_pushed_threshold");
    let pair = NodePair::create(9000 + std::process::id() % 900).expect("network namespaces");
    pair.limit_rate_b("1gbit").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = pair.addr_a.to_string();
    let router_addr = format!("{a}:8800");
    let _router = start_router_in_ns(dir.path(), &pair.ns_a, &router_addr, TOKEN);
    let (mut agent_a, mut agent_b) =
        start_netns_agents(&pair, dir.path(), |dir, name, addr, peer, peer_addr| {
            let router = (name == "node-a").then_some(router_addr.as_str());
            agent_config(dir, name, addr, peer, peer_addr, router)
        });
    let client = AgentClient::connect(&agent_a.socket, "e2e-p0")
        .await
        .unwrap();

    let mut round = 0;
    let mut table: Vec<(String, Option<u64>, Option<f64>)> = Vec::new();
    let (t1, _) = settle(
        &client,
        &pair.ns_a,
        &router_addr,
        &mut round,
        None,
        Duration::from_secs(40),
    )
    .await;
    let t1 = t1.expect("a threshold pushed to the router within 40 s at 1gbit");
    table.push(("1gbit".into(), Some(t1), None));

    // Lower the rate mid-run: the pushed threshold must rise within 10 s.
    let lowered = Instant::now();
    pair.limit_rate_b("300mbit").unwrap();
    let mut rose_after = None;
    while lowered.elapsed() < Duration::from_secs(10) {
        round += 1;
        for (p, r, us) in prefill_samples(round) {
            client.record_prefill("p0", p, r, us).await.unwrap();
        }
        if let Some(t) = router_threshold(&pair.ns_a, &router_addr)
            && t as f64 >= 1.3 * t1 as f64
        {
            rose_after = Some(lowered.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (text, _) = client.explain("p0", "d0").await.unwrap();
    eprintln!("--- explain after lowering the rate ---\n{text}");
    let rose_after = rose_after.unwrap_or_else(|| {
        panic!("threshold pushed to the router did not rise ≥ 1.3 × {t1} within 10 s of tbf 1gbit → 300mbit")
    });
    let (t2, _) = settle(
        &client,
        &pair.ns_a,
        &router_addr,
        &mut round,
        None,
        Duration::from_secs(20),
    )
    .await;
    table.push(("300mbit".into(), t2, Some(rose_after)));

    pair.limit_rate_b("150mbit").unwrap();
    let (t3, rise3) = settle(
        &client,
        &pair.ns_a,
        &router_addr,
        &mut round,
        t2,
        Duration::from_secs(25),
    )
    .await;
    table.push(("150mbit".into(), t3, rise3));

    // kvloop explain through the CLI, from node A.
    let out = NodePair::command_in(&pair.ns_a, &workspace_bin("kvloop"))
        .args([
            "explain",
            "--pair",
            "p0,d0",
            "--agent",
            &format!("{a}:9470"),
        ])
        .output()
        .unwrap();
    let explain = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvloop explain: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        explain.contains("threshold:") && explain.contains("transfer:"),
        "{explain}"
    );

    // The bandwidth alarm metric exists for the path (veth says 10 Gbit/s).
    let (_, metrics) = get_in_ns(&pair.ns_a, &format!("{a}:9470"), "/metrics", None).unwrap();
    assert!(
        metrics.contains("kvloop_agent_path_bandwidth_alarm{peer=\"node-b\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("kvloop_agent_pushes_total"), "{metrics}");
    // The threshold's rise (a threshold or model change after a refit) was
    // pushed at once, not at the next period.
    assert!(
        metrics.contains("kvloop_agent_pushes_early_total{reason="),
        "{metrics}"
    );

    eprintln!(
        "\n| link rate (tbf on B egress) | threshold pushed (tokens) | rise seen after (s) |"
    );
    eprintln!("|---|---|---|");
    for (rate, t, s) in &table {
        eprintln!(
            "| {rate} | {} | {} |",
            t.map_or("-".into(), |t| t.to_string()),
            s.map_or("-".into(), |s| format!("{s:.1}"))
        );
    }
    let bw_line: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvloop_agent_path_"))
        .collect();
    eprintln!("{}", bw_line.join("\n"));
    assert!(
        t2.is_some_and(|t2| t2 > t1),
        "threshold rose from {t1}: {table:?}"
    );

    // The link under the path goes down: the path is invalidated at once and
    // the router gets "recompute" (the cost model's max_threshold_tokens).
    let down = Instant::now();
    let st = std::process::Command::new("ip")
        .args(["-n", &pair.ns_b, "link", "set", &pair.dev_b, "down"])
        .status()
        .unwrap();
    assert!(st.success());
    let mut invalidated_after = None;
    while down.elapsed() < Duration::from_secs(10) {
        if router_threshold(&pair.ns_a, &router_addr) == Some(131_072) {
            invalidated_after = Some(down.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let invalidated_after =
        invalidated_after.expect("link down: router holds the recompute threshold within 10 s");
    eprintln!("link down -> router threshold 131072 after {invalidated_after:.2} s");
    assert!(agent_a.stop() && agent_b.stop(), "agents stop cleanly");
}
