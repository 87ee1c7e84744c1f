//! Router benchmarks (loopback only, bounded in count and time). Prints tables.
//!
//! 1. **Proxy overhead**: the same work done by the client itself (P request,
//!    then D request with P's params: "direct") versus through the router, side
//!    by side at rising open-loop request rates; then the maximum closed-loop
//!    request rate of both. Engines are `kvloop-engine-sim` with zero simulated
//!    costs, so the difference is the router's added latency.
//! 2. **Store**: 1,000,000 conversations in the store; bytes per entry
//!    (counted by a global allocator) and `take`/`insert` latency percentiles.
//!
//! `cargo bench -p kvloop-router --bench router_bench` (env
//! `KVLOOP_BENCH_QUICK=1` for a short run; `KVLOOP_BENCH_ONLY=proxy|store|multiturn`).
use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use kvloop_engine_sim::{Role as SimRole, SimConfig};
use kvloop_router::fingerprint::Fingerprint;
use kvloop_router::params::{KvParams, no_reuse_prefill_params};
use kvloop_router::registry::{EngineConfig, Role};
use kvloop_router::store::{ConvKey, Lookup, MemoryStore, StoredTurn};
use kvloop_router::{MonotonicClock, RouterConfig};
use serde_json::{Value, json};

struct Counting;

static ALLOCATED: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees hold; the counter is a side effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `l`.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        ALLOCATED.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` was allocated by this allocator (i.e. `System`) with `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` was allocated by `System` with `l`; the caller upholds
        // `realloc`'s contract for `new`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn quick() -> bool {
    std::env::var("KVLOOP_BENCH_QUICK").is_ok_and(|v| v == "1")
}

// ---------------------------------------------------------------- proxy

#[derive(Clone)]
struct Target {
    http: reqwest::Client,
    router: String,
    p: String,
    d: String,
}

fn body(i: u64) -> Value {
    json!({"model": "sim-model", "prompt": format!("request {i} says hello to the engines"), "max_tokens": 4})
}

/// What the router does, done by the client: P (max_tokens 1, no-reuse
/// params), then D with P's params.
async fn direct(t: &Target, i: u64) -> bool {
    let mut pb = body(i);
    pb["max_tokens"] = json!(1);
    pb["stream"] = json!(false);
    pb["kv_transfer_params"] = no_reuse_prefill_params();
    let Ok(r) = t
        .http
        .post(format!("{}/v1/completions", t.p))
        .json(&pb)
        .send()
        .await
    else {
        return false;
    };
    let Ok(v) = r.json::<Value>().await else {
        return false;
    };
    let mut db = body(i);
    db["kv_transfer_params"] = v["kv_transfer_params"].clone();
    match t
        .http
        .post(format!("{}/v1/completions", t.d))
        .json(&db)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
        _ => false,
    }
}

async fn via_router(t: &Target, i: u64) -> bool {
    match t
        .http
        .post(format!("{}/v1/completions", t.router))
        .json(&body(i))
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
        _ => false,
    }
}

async fn one(t: &Target, routed: bool, i: u64) -> bool {
    if routed {
        via_router(t, i).await
    } else {
        direct(t, i).await
    }
}

struct RateResult {
    lat_us: Vec<f64>,
    errors: u64,
    achieved_rps: f64,
}

/// Open loop at `rate` requests/s for `secs` (at most `max_n` requests),
/// alternating between the direct and the routed path in slices of ~100 ms so
/// both see the same machine noise. Latency is measured from the scheduled
/// send time (no coordinated omission). Returns (direct, router).
async fn open_loop(t: &Target, rate: f64, secs: f64, max_n: u64) -> (RateResult, RateResult) {
    let n = ((rate * secs) as u64).min(max_n).max(2);
    let slice = ((rate * 0.1) as u64).max(5);
    let start = Instant::now() + Duration::from_millis(5);
    let mut handles = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let t = t.clone();
        let routed = (i / slice) % 2 == 1;
        handles.push(tokio::spawn(async move {
            let ok = one(&t, routed, i).await;
            (routed, ok, at.elapsed().as_secs_f64() * 1e6)
        }));
    }
    let mut out = [
        RateResult {
            lat_us: Vec::new(),
            errors: 0,
            achieved_rps: 0.0,
        },
        RateResult {
            lat_us: Vec::new(),
            errors: 0,
            achieved_rps: 0.0,
        },
    ];
    for h in handles {
        let (routed, ok, us) = h.await.unwrap();
        let r = &mut out[usize::from(routed)];
        if ok { r.lat_us.push(us) } else { r.errors += 1 }
    }
    let rps = n as f64 / start.elapsed().as_secs_f64();
    let [mut d, mut r] = out;
    d.achieved_rps = rps;
    r.achieved_rps = rps;
    (d, r)
}

/// Closed loop: `conc` workers for `secs`; requests per second completed.
async fn closed_loop(t: &Target, routed: bool, conc: usize, secs: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut hs = Vec::new();
    for w in 0..conc {
        let t = t.clone();
        hs.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut i = w as u64 * 1_000_000;
            while Instant::now() < deadline {
                if one(&t, routed, i).await {
                    n += 1;
                }
                i += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for h in hs {
        total += h.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn proxy_bench() {
    // Engines and router on their own runtimes (threads), the client on another.
    let engines_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let router_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sim = |role, id: &str| SimConfig {
        role,
        engine_id: id.into(),
        prefill_us_per_token: 0,
        transfer_us_per_token: 0,
        decode_us_per_token: 0,
        ..SimConfig::default()
    };
    let (p, d) = engines_rt.block_on(async {
        let p = kvloop_engine_sim::spawn(sim(SimRole::Prefill, "p0"))
            .await
            .unwrap();
        let d = kvloop_engine_sim::spawn(sim(SimRole::Decode, "d0"))
            .await
            .unwrap();
        (p, d)
    });
    let cfg = RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        health_interval_ms: 5_000,
        engines: vec![
            EngineConfig::new(
                "p0",
                Role::Prefill,
                &p.url(),
                "127.0.0.1",
                p.side_channel_addr.port(),
            ),
            EngineConfig::new(
                "d0",
                Role::Decode,
                &d.url(),
                "127.0.0.1",
                d.side_channel_addr.port(),
            ),
        ],
        ..RouterConfig::default()
    };
    let router = router_rt
        .block_on(kvloop_router::start(
            cfg,
            Box::new(MonotonicClock::default()),
        ))
        .unwrap();
    let t = Target {
        http: reqwest::Client::builder()
            .http1_only()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .build()
            .unwrap(),
        router: router.url(),
        p: p.url(),
        d: d.url(),
    };
    let (secs, max_n) = if quick() { (0.5, 1000) } else { (2.0, 8000) };
    let rates: &[f64] = if quick() {
        &[250.0, 1000.0]
    } else {
        &[100.0, 250.0, 500.0, 1000.0, 2000.0]
    };
    println!(
        "\n## Proxy overhead: direct (client does P then D) vs through the router, open loop, loopback, paths alternating every ~100 ms"
    );
    println!(
        "cores: {}, engine-sim with zero simulated cost, completions, max_tokens 4, no conversation id",
        num_cpus()
    );
    println!(
        "(router CPU/request: CPU time of the router runtime's single worker thread / routed requests; independent of machine load)"
    );
    println!(
        "| offered req/s | direct p50 µs | direct p99 µs | router p50 µs | router p99 µs | added p50 µs | added p99 µs | router CPU/request µs | achieved req/s (both) | errors d/r |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let rh = router_rt.handle().clone();
    let eh = engines_rt.handle().clone();
    client_rt.block_on(async {
        // warm up connections
        for i in 0..200 {
            direct(&t, i).await;
            via_router(&t, i).await;
        }
        for &rate in rates {
            let cpu0 = rh.spawn(async { thread_cpu_ns() }).await.unwrap();
            let (mut dr, mut rr) = open_loop(&t, rate, secs, max_n).await;
            let cpu1 = rh.spawn(async { thread_cpu_ns() }).await.unwrap();
            let cpu_us = (cpu1 - cpu0) as f64 / 1e3 / (rr.lat_us.len() as f64 + rr.errors as f64).max(1.0);
            let (d50, d99) = (pct(&mut dr.lat_us, 0.5), pct(&mut dr.lat_us, 0.99));
            let (r50, r99) = (pct(&mut rr.lat_us, 0.5), pct(&mut rr.lat_us, 0.99));
            println!(
                "| {rate:.0} | {d50:.0} | {d99:.0} | {r50:.0} | {r99:.0} | {:.0} | {:.0} | {cpu_us:.1} | {:.0} | {}/{} |",
                r50 - d50,
                r99 - d99,
                rr.achieved_rps,
                dr.errors,
                rr.errors
            );
        }
        let secs = if quick() { 1.0 } else { 3.0 };
        println!("\n## Maximum request rate (closed loop, 32 concurrent clients, {secs} s) and CPU per request");
        println!("(CPU: per runtime worker thread, /proc/thread-self/schedstat; the client runtime, the router runtime and the engines' runtime have one worker each)");
        println!("| path | req/s | client CPU µs/req | router CPU µs/req | engines CPU µs/req |");
        println!("|---|---:|---:|---:|---:|");
        let ch = tokio::runtime::Handle::current();
        for (label, routed) in [("direct (P then D)", false), ("through router", true)] {
            let cpu = |h: &tokio::runtime::Handle| h.spawn(async { thread_cpu_ns() });
            let (c0, r0, e0) = (cpu(&ch).await.unwrap(), cpu(&rh).await.unwrap(), cpu(&eh).await.unwrap());
            let rps = closed_loop(&t, routed, 32, secs).await;
            let (c1, r1, e1) = (cpu(&ch).await.unwrap(), cpu(&rh).await.unwrap(), cpu(&eh).await.unwrap());
            let n = rps * secs;
            let per = |a: u64, b: u64| (b - a) as f64 / 1e3 / n;
            println!("| {label} | {rps:.0} | {:.1} | {:.1} | {:.1} |", per(c0, c1), per(r0, r1), per(e0, e1));
        }
    });
    drop(router);
    router_rt.shutdown_timeout(Duration::from_secs(1));
    drop((p, d));
    engines_rt.shutdown_timeout(Duration::from_secs(1));
}

/// CPU time of the calling thread, ns (`/proc/thread-self/schedstat`, first field).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

// ---------------------------------------------------------------- store

fn d_params(i: u64) -> Value {
    // A 1,000-token conversation at block size 16: 63 blocks, allocated in two runs.
    let base = (i * 64) as u32 % 1_000_000;
    let mut blocks: Vec<u32> = (base..base + 40).collect();
    blocks.extend(base + 100..base + 123);
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_block_ids": [blocks],
           "remote_engine_id": "d0", "remote_request_id": format!("cmpl-{i:016x}-0"),
           "remote_host": "10.0.0.12", "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 1000,
           "remote_blocks_expiry_time": 123456.75})
}

fn conv_id(i: u64) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        i,
        i & 0xffff,
        i & 0xfff,
        (i >> 12) & 0xfff,
        i * 7919
    )
}

fn store_bench() {
    let n: u64 = if quick() { 200_000 } else { 1_000_000 };
    let turns: Vec<StoredTurn> = (0..4)
        .map(|i| StoredTurn {
            params: KvParams::parse(&d_params(i)).unwrap().compact(),
            decode_engine: 0,
            remote_num_tokens: 1000,
            fingerprint: Fingerprint {
                tokens_len: 900,
                tokens_hash: i,
                history_len: 5,
                history_hash: i,
            },
            expires_at_ms: 0,
            stored_at_unix_ms: 0,
        })
        .collect();
    let sample_json = serde_json::to_string(&d_params(0)).unwrap().len();
    let before = ALLOCATED.load(Ordering::Relaxed);
    let mut store = MemoryStore::new(NonZeroUsize::new(n as usize).unwrap(), 450_000);
    let t_fill = Instant::now();
    let mut insert_ns = Vec::with_capacity(100_000);
    for i in 0..n {
        // each entry owns its own params (clone = fresh heap allocations)
        let turn = StoredTurn {
            params: KvParams::parse(&d_params(i)).unwrap().compact(),
            ..turns[(i % 4) as usize].clone()
        };
        let key = ConvKey::new("tenant-7", &conv_id(i));
        let t0 = Instant::now();
        store.insert(key, turn, 0);
        if i % (n / 100_000).max(1) == 0 {
            insert_ns.push(t0.elapsed().as_nanos() as f64);
        }
    }
    let fill_s = t_fill.elapsed().as_secs_f64();
    let after = ALLOCATED.load(Ordering::Relaxed);
    let per_entry = (after - before) as f64 / n as f64;
    // lookups (take + put back, as a turn would), random keys
    let samples = 100_000u64;
    let mut take_ns = Vec::with_capacity(samples as usize);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..samples {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % n;
        let key = ConvKey::new("tenant-7", &conv_id(i));
        let t0 = Instant::now();
        let l = store.take(&key, 1);
        take_ns.push(t0.elapsed().as_nanos() as f64);
        if let Lookup::Found(t) = l {
            store.insert(key, t, 1);
        }
    }
    let mut miss_ns = Vec::with_capacity(samples as usize);
    for i in 0..samples {
        let key = ConvKey::new("tenant-7", &conv_id(n + i));
        let t0 = Instant::now();
        let _ = store.take(&key, 1);
        miss_ns.push(t0.elapsed().as_nanos() as f64);
    }
    println!(
        "\n## Conversation store: {n} entries (D params of a 1,000-token turn, 63 blocks in 2 runs; JSON {sample_json} bytes)"
    );
    println!("| metric | value |");
    println!("|---|---:|");
    println!("| entries | {} |", store.len());
    println!("| heap bytes per entry (key, params, LRU node, hash table) | {per_entry:.0} |");
    println!("| fill time, s | {fill_s:.2} |");
    println!(
        "| insert p50 / p99, ns | {:.0} / {:.0} |",
        pct(&mut insert_ns, 0.5),
        pct(&mut insert_ns, 0.99)
    );
    println!(
        "| take (hit) p50 / p99, ns | {:.0} / {:.0} |",
        pct(&mut take_ns, 0.5),
        pct(&mut take_ns, 0.99)
    );
    println!(
        "| take (miss) p50 / p99, ns | {:.0} / {:.0} |",
        pct(&mut miss_ns, 0.5),
        pct(&mut miss_ns, 0.99)
    );
    drop(store);
}

// ---------------------------------------------------------------- multi-turn

/// Client-side TTFT of a streamed chat turn (first content chunk), µs, and the answer.
async fn chat_turn(
    http: &reqwest::Client,
    url: &str,
    conv: &str,
    messages: &[Value],
) -> Option<(f64, String)> {
    let body = json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": 32, "conversation_id": conv});
    let t0 = Instant::now();
    let mut r = http.post(url).json(&body).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    let mut ttft = None;
    let mut buf = Vec::new();
    while let Some(c) = r.chunk().await.ok()? {
        if ttft.is_none() && c.windows(9).any(|w| w == b"\"content\"") {
            ttft = Some(t0.elapsed().as_secs_f64() * 1e6);
        }
        buf.extend_from_slice(&c);
    }
    let text = String::from_utf8_lossy(&buf);
    let answer: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    Some((ttft?, answer))
}

fn words(n: usize, tag: &str) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Multi-turn conversations through the router with simulated costs, once with
/// the static threshold (64: pulls) and once with an unreachable threshold
/// (always recompute), side by side; prints TTFT by turn and the decision counters.
fn multi_turn_bench() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (many, turns, first_words) = if quick() {
        (8usize, 3usize, 1000usize)
    } else {
        (32, 5, 2000)
    };
    let levels: Vec<usize> = match std::env::var("KVLOOP_BENCH_CONVS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(c) => vec![c],
        None => vec![1, many],
    };
    println!(
        "\n## Multi-turn: conversations × {turns} turns, first prompt {first_words} words, +64 words/turn, 32 output tokens, streamed"
    );
    println!(
        "engine-sim: prefill 20 µs/token (real sleep), READ 2 µs/token, decode 50 µs/token; client-side TTFT"
    );
    println!(
        "| concurrent conversations | threshold | turn | requests | TTFT p50 ms | TTFT p99 ms |"
    );
    println!("|---:|---|---:|---:|---:|---:|");
    for (convs, (label, threshold)) in levels
        .iter()
        .flat_map(|&c| [("static 64 (pull)", 64u64), ("never pull", u64::MAX)].map(|x| (c, x)))
    {
        rt.block_on(async {
            let sim = |role, id: &str| SimConfig {
                role,
                engine_id: id.into(),
                prefill_us_per_token: 20,
                transfer_us_per_token: 2,
                decode_us_per_token: 50,
                ..SimConfig::default()
            };
            let p = kvloop_engine_sim::spawn(sim(SimRole::Prefill, "p0"))
                .await
                .unwrap();
            let d = kvloop_engine_sim::spawn(sim(SimRole::Decode, "d0"))
                .await
                .unwrap();
            let cfg = RouterConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                kv_recompute_threshold: threshold,
                engines: vec![
                    EngineConfig::new(
                        "p0",
                        Role::Prefill,
                        &p.url(),
                        "127.0.0.1",
                        p.side_channel_addr.port(),
                    ),
                    EngineConfig::new(
                        "d0",
                        Role::Decode,
                        &d.url(),
                        "127.0.0.1",
                        d.side_channel_addr.port(),
                    ),
                ],
                ..RouterConfig::default()
            };
            let router = kvloop_router::start(cfg, Box::new(MonotonicClock::default()))
                .await
                .unwrap();
            let url = format!("{}/v1/chat/completions", router.url());
            let http = reqwest::Client::new();
            let mut hs = Vec::new();
            for c in 0..convs {
                let (http, url) = (http.clone(), url.clone());
                hs.push(tokio::spawn(async move {
                    let conv = format!("conv-{c}");
                    let mut msgs = vec![
                        json!({"role": "user", "content": words(first_words, &format!("c{c}w"))}),
                    ];
                    let mut out = Vec::new();
                    for turn in 0..turns {
                        let Some((ttft, answer)) = chat_turn(&http, &url, &conv, &msgs).await
                        else {
                            break;
                        };
                        out.push((turn, ttft));
                        msgs.push(json!({"role": "assistant", "content": answer}));
                        msgs.push(
                            json!({"role": "user", "content": words(64, &format!("c{c}t{turn}u"))}),
                        );
                    }
                    out
                }));
            }
            let mut by_turn: Vec<Vec<f64>> = vec![Vec::new(); turns];
            for h in hs {
                for (turn, ttft) in h.await.unwrap() {
                    by_turn[turn].push(ttft / 1000.0);
                }
            }
            for (turn, v) in by_turn.iter_mut().enumerate() {
                println!(
                    "| {convs} | {label} | {} | {} | {:.1} | {:.1} |",
                    turn + 1,
                    v.len(),
                    pct(v, 0.5),
                    pct(v, 0.99)
                );
            }
            let m = http
                .get(format!("{}/metrics", router.url()))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let counters: Vec<String> = m
                .lines()
                .filter(|l| {
                    l.starts_with("kvloop_router_decisions_total")
                        || l.starts_with("kvloop_router_store_entries")
                })
                .map(|l| l.replace("kvloop_router_", ""))
                .collect();
            println!(
                "| {convs} | {label} | counters | {} | | |",
                counters.join(", ")
            );
        });
    }
}

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    let only = std::env::var("KVLOOP_BENCH_ONLY").unwrap_or_default();
    let _ = Arc::new(());
    if only.is_empty() || only == "store" {
        store_bench();
    }
    if only.is_empty() || only == "proxy" {
        proxy_bench();
    }
    if only.is_empty() || only == "multiturn" {
        multi_turn_bench();
    }
}
