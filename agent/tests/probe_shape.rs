//! Active probes follow the registered engines' layout, through two real
//! agents on loopback: before any engine registers, the agents probe each
//! other in the configured shape (2 descriptors of 64 KiB per block id);
//! once both host an engine of 8 regions × 4 KiB, each opens a probe engine
//! of that shape, lists it at `/v1/engines`, and probes the other in it;
//! the READs' bytes show in `kvloop_agent_rail_bytes_total`.
mod common;

use std::time::{Duration, Instant};

use common::{get_json, get_text, start_two_agents};
use kvloop_agent::client::AgentClient;
use kvloop_dataplane::{HostRegion, KvLayout};

fn engine_layout() -> KvLayout {
    common::kv_layout(8, 32, 4096)
}

fn config(
    dir: &std::path::Path,
    name: &str,
    http: u16,
    peer: &str,
    peer_http: u16,
) -> std::path::PathBuf {
    let probe = "[probe]\nperiod_ms = 200\nlarge_blocks = 4\n";
    common::loopback_agent_toml(dir, name, (http, peer, peer_http), "", probe)
}

/// The summed `kvloop_agent_probe_reads_total` of `shape` with result ok.
async fn ok_probe_reads(http: &str, shape: &str) -> u64 {
    let m = get_text(http, "/metrics").await;
    m.lines()
        .filter(|l| {
            l.starts_with("kvloop_agent_probe_reads_total{")
                && l.contains(&format!("shape=\"{shape}\""))
                && l.contains("result=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

async fn wait_for_reads(http: &str, shape: &str, what: &str) -> u64 {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let n = ok_probe_reads(http, shape).await;
        if n > 0 {
            return n;
        }
        assert!(
            Instant::now() < until,
            "{what}: no ok probe READ of shape {shape} in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_take_the_shape_of_the_engines_both_nodes_host() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b) = start_two_agents(dir.path(), config);

    // No engine yet: the configured shape.
    wait_for_reads(&a.http, "2x65536", "configured shape").await;

    let l = engine_layout();
    let mem = |tag: &str| -> Vec<HostRegion> {
        (0..l.num_regions)
            .map(|r| HostRegion::new(&format!("{tag}{r}"), l.region_len_bytes() as usize).unwrap())
            .collect()
    };
    let (p_mem, d_mem) = (mem("p"), mem("d"));
    let pa = AgentClient::connect(&a.socket, "test-p0").await.unwrap();
    pa.register_memfd("p0", l, &p_mem, None).await.unwrap();
    // A second engine of the same shape opens no second probe engine.
    pa.register_memfd("p1", l, &p_mem, None).await.unwrap();

    // Only A has the shape: A lists it (its probe engine opens in the
    // background of the registration), but still probes B in the
    // configured one.
    let until = Instant::now() + Duration::from_secs(10);
    let info = loop {
        let info: serde_json::Value = get_json(&a.http, "/v1/engines").await;
        if info["shaped_probes"].is_array() || Instant::now() > until {
            break info;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let shaped = info["shaped_probes"]
        .as_array()
        .expect("shaped_probes listed");
    assert_eq!(shaped.len(), 1, "{info}");
    assert_eq!(shaped[0]["layout"]["num_regions"], 8, "{info}");
    assert_eq!(shaped[0]["layout"]["block_len_bytes"], 4096, "{info}");
    assert_eq!(shaped[0]["engine_id"], "probe.node-a.8x4096x16", "{info}");
    assert_eq!(ok_probe_reads(&a.http, "8x4096").await, 0);

    let db = AgentClient::connect(&b.socket, "test-d0").await.unwrap();
    db.register_memfd("d0", l, &d_mem, None).await.unwrap();

    // Both have it now: both probe in it.
    wait_for_reads(&a.http, "8x4096", "A, engine shape").await;
    wait_for_reads(&b.http, "8x4096", "B, engine shape").await;
    // And only in it: the configured shape's count stops growing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = ok_probe_reads(&a.http, "2x65536").await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(ok_probe_reads(&a.http, "2x65536").await, before);

    // The probe READs went over the one (default) rail.
    let m = get_text(&a.http, "/metrics").await;
    let rail0: u64 = m
        .lines()
        .find(|l| l.starts_with("kvloop_agent_rail_bytes_total{") && l.contains("rail=\"0\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("rail 0 bytes in /metrics: {m}"));
    assert!(rail0 > 0, "{m}");

    drop((pa, db));
    assert!(a.stop() && b.stop(), "agents exit on SIGTERM");
}
