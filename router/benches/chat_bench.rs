//! The routing path at 400 req/s (issue 13 item 4): multi-turn chat
//! conversations (bodies 4–8 kB, 16-token streams, `conversation_id`), open
//! loop, sent directly (the client does P then D itself) and through a
//! `kvloop-router` process with the in-memory store and with Redis (prefix
//! check by tokens, and by history), side by side in one run. Engines are
//! in-process `kvloop-engine-sim`s with zero simulated cost, so the
//! differences are the router's. Loopback only; bounded in count and time.
//!
//! Prints: achieved rate, TTFT p50/p99 (scheduled send → first content
//! chunk, so no coordinated omission), what the router adds over direct,
//! and the router process's CPU per request (`/proc/<pid>/stat` utime +
//! stime over the run). Redis rows need `redis-server` (Debian package;
//! `kvloop_tests::RedisServer`: loopback, temporary directory, no
//! persistence, stopped by PID).
//!
//! Placement: on a machine of 2 or more CPUs the router (and Redis) run on
//! the last CPU and the engines and the client on the others, as a router
//! with a core of its own in a deployment; without it, the router's added
//! latency is mostly waiting for a CPU the engines hold
//! (`KVLOOP_BENCH_PIN=0` shares every CPU).
//!
//! `cargo bench -p kvloop-router --bench chat_bench` (`KVLOOP_BENCH_QUICK=1`:
//! 4 s per row instead of 15; `KVLOOP_BENCH_RATE`: requests/s, default 400;
//! `KVLOOP_BENCH_BASELINE_ROUTER=<path>`: another `kvloop-router` binary,
//! e.g. one built from an earlier commit, measured in the same run before
//! each router row, as path `baseline`; `KVLOOP_BENCH_ROUNDS=N`: the
//! whole set of rows N times, then the median and range of each row's
//! added latency and CPU over the rounds, each round against its own
//! direct row: on a shared 2-core VM one round's CPU per request moves by
//! ±30 %).
use std::collections::VecDeque;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvloop_engine_sim::{Role as SimRole, SimConfig};
use kvloop_router::params::no_reuse_prefill_params;
use kvloop_tests::ReadyChild;
use serde_json::{Value, json};

const CONVERSATIONS: usize = 96;
const ANSWER_TOKENS: u64 = 16;
/// How long the decode engine keeps an answer's blocks for a READ, ms
/// (engine-sim's `decoder_kv_blocks_ttl_ms`, and the routers' setting of it).
const DECODE_KV_TTL_MS: u64 = 60_000;

fn quick() -> bool {
    std::env::var("KVLOOP_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

/// One conversation: its id and messages; restarted (new id) before a
/// body would pass 8 kB.
struct Conv {
    id: String,
    generation: u32,
    n: usize,
    messages: Vec<Value>,
}

fn text(bytes: usize, tag: &str) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(&format!("{tag}{i} "));
        i += 1;
    }
    s
}

impl Conv {
    fn new(n: usize) -> Self {
        let mut c = Conv {
            id: String::new(),
            generation: 0,
            n,
            messages: Vec::new(),
        };
        c.restart();
        c
    }
    fn restart(&mut self) {
        self.generation += 1;
        self.id = format!("bench-{}-{}", self.n, self.generation);
        self.messages = vec![
            json!({"role": "user", "content": text(4000, &format!("c{}g{}w", self.n, self.generation))}),
        ];
    }
    fn body_len(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m["content"].as_str().map_or(0, str::len) + 32)
            .sum()
    }
    fn next_turn(&mut self, answer: String) {
        self.messages
            .push(json!({"role": "assistant", "content": answer}));
        let k = self.messages.len();
        self.messages
            .push(json!({"role": "user", "content": text(600, &format!("c{}t{k}u", self.n))}));
        if self.body_len() > 7600 {
            self.restart();
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Direct,
    Router,
}

struct Sample {
    ttft_us: f64,
}

/// Streams one chat request; returns (ttft µs from `at`, answer).
async fn stream(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    at: Instant,
) -> Option<(f64, String)> {
    let mut r = http.post(url).json(body).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    let mut ttft = None;
    let mut buf = Vec::new();
    while let Some(c) = r.chunk().await.ok()? {
        if ttft.is_none() && c.windows(9).any(|w| w == b"\"content\"") {
            ttft = Some(at.elapsed().as_secs_f64() * 1e6);
        }
        buf.extend_from_slice(&c);
    }
    let answer: String = String::from_utf8_lossy(&buf)
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

/// One turn of `c` by `path`.
async fn turn(
    http: &reqwest::Client,
    path: Path,
    base: &str,
    p: &str,
    d: &str,
    c: &Conv,
    at: Instant,
) -> Option<(f64, String)> {
    let body = json!({"model": "sim-model", "messages": c.messages, "stream": true,
                      "max_tokens": ANSWER_TOKENS, "conversation_id": c.id});
    match path {
        Path::Router => stream(http, &format!("{base}/v1/chat/completions"), &body, at).await,
        Path::Direct => {
            // What the router does, done by the client: P with no-reuse
            // params (max_tokens 1), then D streaming with P's params.
            let mut pb = body.clone();
            pb["max_tokens"] = json!(1);
            pb["stream"] = json!(false);
            pb["kv_transfer_params"] = no_reuse_prefill_params();
            let v: Value = http
                .post(format!("{p}/v1/chat/completions"))
                .json(&pb)
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let mut db = body;
            db["kv_transfer_params"] = v["kv_transfer_params"].clone();
            stream(http, &format!("{d}/v1/chat/completions"), &db, at).await
        }
    }
}

/// Open loop at `rate` for `secs`: every tick an idle conversation sends
/// its next turn. Returns (samples, errors, ticks with no idle conversation).
async fn open_loop(
    path: Path,
    base: String,
    p: String,
    d: String,
    rate: f64,
    secs: f64,
) -> (Vec<Sample>, u64, u64) {
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let idle: Arc<Mutex<VecDeque<Conv>>> =
        Arc::new(Mutex::new((0..CONVERSATIONS).map(Conv::new).collect()));
    let n = (rate * secs) as u64;
    let start = Instant::now() + Duration::from_millis(5);
    let mut handles = Vec::new();
    let mut starved = 0;
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let Some(mut c) = idle.lock().unwrap().pop_front() else {
            starved += 1;
            continue;
        };
        let (http, base, p, d, idle) = (
            http.clone(),
            base.clone(),
            p.clone(),
            d.clone(),
            idle.clone(),
        );
        handles.push(tokio::spawn(async move {
            let r = turn(&http, path, &base, &p, &d, &c, at).await;
            let out = r.as_ref().map(|x| x.0);
            match r {
                Some((_, answer)) => c.next_turn(answer),
                None => c.restart(),
            }
            idle.lock().unwrap().push_back(c);
            out
        }));
    }
    let mut samples = Vec::new();
    let mut errors = 0;
    for h in handles {
        match h.await.unwrap() {
            Some(t) => samples.push(Sample { ttft_us: t }),
            None => errors += 1,
        }
    }
    (samples, errors, starved)
}

/// The CPU the router and Redis get, when pinning (2 or more CPUs and
/// `KVLOOP_BENCH_PIN` not `0`): the last one; this thread (and the threads
/// it starts: engines, client) gets the others.
fn pin() -> Option<usize> {
    if std::env::var("KVLOOP_BENCH_PIN").is_ok_and(|v| v == "0") {
        return None;
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    if n < 2 {
        return None;
    }
    let router_cpu = n - 1;
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // inside it for indices below CPU_SETSIZE (n is the process's CPUs).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..router_cpu {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return None;
        }
    }
    Some(router_cpu)
}

/// One row's measurement.
struct RowResult {
    n: usize,
    rate: f64,
    p50: f64,
    p99: f64,
    /// Router CPU per request, µs (NaN for the direct path).
    cpu_us: f64,
    errors: u64,
    starved: u64,
}

/// The store column: `redis` for a Redis URL.
fn store_label(store: &str) -> &str {
    if store.starts_with("redis") {
        "redis"
    } else {
        store
    }
}

fn num(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.0}")
    }
}

/// A `kvloop-router` process from `bin` with config `cfg`, on `cpu` when pinning.
fn start_router(bin: &str, cfg: &std::path::Path, cpu: Option<usize>) -> ReadyChild {
    let mut c = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string(), bin]);
            c
        }
        None => Command::new(bin),
    };
    c.arg("--config").arg(cfg).env("RUST_LOG", "warn");
    ReadyChild::start("router", c, None, Duration::from_secs(20)).expect("router starts")
}

/// Warms up for 1 s, then runs the open loop for `secs` through `router`
/// (direct when `None`) and measures TTFT and the router's CPU.
fn measure(
    client_rt: &tokio::runtime::Runtime,
    router: Option<&ReadyChild>,
    pu: &str,
    du: &str,
    rate: f64,
    secs: f64,
) -> RowResult {
    let url = router.map_or(String::new(), |c| {
        format!("http://{}", c.get("http").unwrap())
    });
    let kind = if router.is_some() {
        Path::Router
    } else {
        Path::Direct
    };
    let run = |secs| {
        client_rt.block_on(open_loop(
            kind,
            url.clone(),
            pu.into(),
            du.into(),
            rate,
            secs,
        ))
    };
    run(1.0);
    let cpu0 = router.map_or(0.0, |c| kvloop_tests::process_cpu_s(&c.pid().to_string()));
    let t0 = Instant::now();
    let (samples, errors, starved) = run(secs);
    let wall = t0.elapsed().as_secs_f64();
    let cpu = router.map_or(f64::NAN, |c| {
        kvloop_tests::process_cpu_s(&c.pid().to_string()) - cpu0
    });
    let n = samples.len();
    let mut t: Vec<f64> = samples.iter().map(|s| s.ttft_us).collect();
    RowResult {
        n,
        rate: n as f64 / wall,
        p50: pct(&mut t, 0.5),
        p99: pct(&mut t, 0.99),
        cpu_us: cpu * 1e6 / (n.max(1) as f64),
        errors,
        starved,
    }
}

fn main() {
    let router_cpu = pin();
    let rate: f64 = std::env::var("KVLOOP_BENCH_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400.0);
    let secs = if quick() { 4.0 } else { 15.0 };
    // Engines on their own runtime (1 thread), the client on another.
    let engines_rt = tokio::runtime::Builder::new_multi_thread()
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
        // D keeps every answer's blocks for a READ until the TTL (the
        // direct rows never READ them: 6000 answers of ~100 blocks a row),
        // so the defaults (1M blocks, 480 s) ran D out of blocks in the
        // second round: D then answered with empty `remote_block_ids` and
        // the routed rows lost their reuse. 60 s (the routers are told the
        // same) and 4M blocks hold every row of every round.
        decoder_kv_blocks_ttl_ms: DECODE_KV_TTL_MS,
        num_blocks: 1 << 22,
        ..SimConfig::default()
    };
    let (p, d) = engines_rt.block_on(async {
        (
            kvloop_engine_sim::spawn(sim(SimRole::Prefill, "p0"))
                .await
                .unwrap(),
            kvloop_engine_sim::spawn(sim(SimRole::Decode, "d0"))
                .await
                .unwrap(),
        )
    });
    let redis = match router_cpu {
        Some(cpu) => kvloop_tests::RedisServer::start_with(None, move |bin: &std::path::Path| {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(bin);
            c
        }),
        None => kvloop_tests::RedisServer::start(),
    }
    .ok();
    if redis.is_none() {
        println!("(redis-server not found or not starting: the Redis rows are not run)");
    }
    let router_toml = |store: &str, check: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\nprefix_check = \"{check}\"\nstore = \"{store}\"\nhealth_interval_ms = 1000\n\
             decoder_kv_blocks_ttl_ms = {DECODE_KV_TTL_MS}\nttl_safety_margin_ms = 10000\n\
             [[engines]]\nengine_id = \"p0\"\nrole = \"prefill\"\nhttp_url = \"{}\"\nside_channel_host = \"127.0.0.1\"\nside_channel_port = {}\n\
             [[engines]]\nengine_id = \"d0\"\nrole = \"decode\"\nhttp_url = \"{}\"\nside_channel_host = \"127.0.0.1\"\nside_channel_port = {}\n",
            p.url(),
            p.side_channel_addr.port(),
            d.url(),
            d.side_channel_addr.port()
        )
    };
    let mut routed: Vec<(String, &str)> = vec![("memory".into(), "tokens")];
    if let Some(port) = redis.as_ref().map(kvloop_tests::RedisServer::port) {
        routed.push((format!("redis://127.0.0.1:{port}/0"), "tokens"));
        routed.push((format!("redis://127.0.0.1:{port}/0"), "history"));
    }
    let baseline_bin = std::env::var("KVLOOP_BENCH_BASELINE_ROUTER").ok();
    if let Some(b) = &baseline_bin {
        println!("(baseline rows: {b})");
    }
    let mut rows: Vec<(&str, String, &str)> = vec![("direct", "-".into(), "-")];
    for (store, check) in routed {
        if baseline_bin.is_some() {
            rows.push(("baseline", store.clone(), check));
        }
        rows.push(("router", store, check));
    }
    println!(
        "\n## Routing path at {rate:.0} req/s: {CONVERSATIONS} multi-turn chat conversations (bodies 4–8 kB, {ANSWER_TOKENS}-token streams), {secs:.0} s per row"
    );
    println!(
        "engine-sim with zero simulated cost (in process); router as its own process; TTFT from the scheduled send"
    );
    match router_cpu {
        Some(c) => println!(
            "router and Redis on CPU {c}, engines and client on the other CPUs (KVLOOP_BENCH_PIN=0: shared)"
        ),
        None => println!("every process shares every CPU"),
    }
    let rounds: usize = std::env::var("KVLOOP_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    println!(
        "| round | path | store | prefix check | requests | req/s | TTFT p50 µs | TTFT p99 µs | added p50 µs | added p99 µs | router CPU µs/req | errors | starved ticks |"
    );
    println!("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let tmp = std::env::temp_dir().join(format!("kvloop-chat-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    // Each routed row's binary and config, written once for every round.
    let routers: Vec<Option<(&str, std::path::PathBuf)>> = rows
        .iter()
        .enumerate()
        .map(|(i, (path, store, check))| {
            let bin = match (*path, &baseline_bin) {
                ("direct", _) => return None,
                ("baseline", Some(b)) => b.as_str(),
                _ => env!("CARGO_BIN_EXE_kvloop-router"),
            };
            let cfg = tmp.join(format!("router-{i}.toml"));
            std::fs::write(&cfg, router_toml(store, check)).unwrap();
            Some((bin, cfg))
        })
        .collect();
    // Per row: (added p50, added p99, CPU µs/req) of every round.
    let mut per_row: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); rows.len()];
    for round in 1..=rounds {
        let mut base: Option<(f64, f64)> = None;
        for (i, (path, store, check)) in rows.iter().enumerate() {
            let router = routers[i]
                .as_ref()
                .map(|(bin, cfg)| start_router(bin, cfg, router_cpu));
            let r = measure(&client_rt, router.as_ref(), &p.url(), &d.url(), rate, secs);
            drop(router);
            let (a50, a99) = match base {
                Some((b50, b99)) => (r.p50 - b50, r.p99 - b99),
                None => {
                    base = Some((r.p50, r.p99));
                    (f64::NAN, f64::NAN)
                }
            };
            per_row[i].push((a50, a99, r.cpu_us));
            let store_label = store_label(store);
            println!(
                "| {round} | {path} | {store_label} | {check} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} |",
                r.n,
                r.rate,
                r.p50,
                r.p99,
                num(a50),
                num(a99),
                num(r.cpu_us),
                r.errors,
                r.starved
            );
        }
    }
    if rounds > 1 {
        println!("\n## Median of {rounds} rounds (min–max), each round against its own direct row");
        println!(
            "| path | store | prefix check | added p50 µs | added p99 µs | router CPU µs/req |"
        );
        println!("|---|---|---|---:|---:|---:|");
        for ((path, store, check), v) in rows.iter().zip(&per_row).skip(1) {
            let col = |f: fn(&(f64, f64, f64)) -> f64| {
                let mut x: Vec<f64> = v.iter().map(f).collect();
                let median = pct(&mut x, 0.5); // sorts x
                format!("{median:.0} ({:.0}–{:.0})", x[0], x[x.len() - 1])
            };
            let store_label = store_label(store);
            println!(
                "| {path} | {store_label} | {check} | {} | {} | {} |",
                col(|t| t.0),
                col(|t| t.1),
                col(|t| t.2)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    drop(redis);
    drop((p, d));
    engines_rt.shutdown_timeout(Duration::from_secs(1));
}
