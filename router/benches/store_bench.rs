//! Store cost on the routing path, per request: the memory store versus Redis
//! (a `redis-server` this bench starts on a free loopback port, in a temporary
//! directory, without persistence; stopped by PID). One "request" is what the
//! router does per turn of a conversation: one take (`GETDEL`) and one insert
//! (`SET ... PX ... GET`), each awaited. Prints latency percentiles and the
//! process CPU time per request, sequential and with 64 concurrent tasks.
//!
//! `cargo bench -p kvloop-router --bench store_bench` (env
//! `KVLOOP_BENCH_QUICK=1` for a short run). Needs `redis-server` (fails
//! without it).
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvloop_router::RouterConfig;
use kvloop_router::fingerprint::Fingerprint;
use kvloop_router::metrics::Metrics;
use kvloop_router::params::KvParams;
use kvloop_router::store::{ConvKey, ConversationStore, Lookup, Store, StoredTurn};
use serde_json::json;

fn turn(i: u32) -> StoredTurn {
    let p = KvParams::parse(&json!({"remote_engine_id": "d0", "remote_request_id": format!("req-{i}"),
        "remote_block_ids": [(0..64u32).map(|b| b * 3 + i).collect::<Vec<_>>()], "remote_port": 5601,
        "tp_size": 1}))
    .unwrap();
    StoredTurn {
        params: p.compact(),
        decode_engine: 1,
        remote_num_tokens: 1000 + i,
        fingerprint: Fingerprint {
            tokens_len: 1000,
            tokens_hash: 0xdead_beef_u64 * u64::from(i),
            history_len: 8,
            history_hash: 42,
        },
        expires_at_ms: 0,
        stored_at_unix_ms: 0,
    }
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

/// `n` requests over `convs` conversations from `tasks` concurrent tasks.
async fn run(store: Arc<Store>, n: usize, convs: usize, tasks: usize) -> (Vec<f64>, f64, f64) {
    let cpu0 = kvloop_tests::process_cpu_s("self");
    let t0 = Instant::now();
    let per = n / tasks;
    let hs: Vec<_> = (0..tasks)
        .map(|t| {
            let s = store.clone();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per);
                let mut found = 0usize;
                for i in 0..per {
                    let c = (t * per + i) % convs;
                    let key = ConvKey::new("tenant-a", &format!("conv-{c}"));
                    let t = Instant::now();
                    if let Ok(Lookup::Found(_)) = s.take(&key, 0).await {
                        found += 1;
                    }
                    s.insert(key, turn(i as u32), 0).await.expect("insert");
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                (lat, found)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    for h in hs {
        let (l, _) = h.await.unwrap();
        all.extend(l);
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = kvloop_tests::process_cpu_s("self") - cpu0;
    (all, wall, cpu)
}

fn main() {
    let quick = std::env::var("KVLOOP_BENCH_QUICK").is_ok();
    let n = if quick { 5_000 } else { 50_000 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let redis = kvloop_tests::RedisServer::start()
        .expect("redis-server (Debian package redis-server) must be installed");
    let port = redis.port();
    rt.block_on(async {
        let ids = vec!["p0".to_string(), "d0".to_string()];
        let mem = Arc::new(
            Store::from_config(&RouterConfig::default(), ids.clone(), &Metrics::new()).unwrap(),
        );
        let cfg = RouterConfig {
            store: format!("redis://127.0.0.1:{port}/0"),
            ..RouterConfig::default()
        };
        let red = Arc::new(Store::from_config(&cfg, ids, &Metrics::new()).unwrap());
        let t0 = Instant::now();
        while !red.health().up {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "store never connected"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "store cost per request (take + insert, awaited), {n} requests over 1000 conversations"
        );
        println!("| backend | tasks | p50 µs | p90 µs | p99 µs | req/s | CPU µs/req |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for (name, s) in [("memory", &mem), ("redis", &red)] {
            for tasks in [1usize, 64] {
                let _ = run(s.clone(), n / 10, 1000, tasks).await; // warm-up
                let (mut lat, wall, cpu) = run(s.clone(), n, 1000, tasks).await;
                println!(
                    "| {name} | {tasks} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} |",
                    pct(&mut lat, 0.5),
                    pct(&mut lat, 0.9),
                    pct(&mut lat, 0.99),
                    n as f64 / wall,
                    cpu / n as f64 * 1e6
                );
            }
        }
    });
}
