//! `kvloop demo` (`kvloop demo loop`, `kvloop demo slow-link`): kvloop's main
//! job on real input. Two "nodes" (network namespaces joined by a veth when
//! root, loopback otherwise); a prefill engine P on node A and a decode engine
//! D on node B (`kvloop-engine-sim` with real KV memory, registered with its
//! node's agent, `kvloop-agent`, in managed mode: the agents keep the leases
//! and do the READs, so every KV block really moves over the link by
//! libfabric READs between the agents, and is verified byte-exact by the
//! engine on arrival); the router (`kvloop-router`) on node A; agentic multi-turn
//! coding conversations from `kvloop-loadgen` sent through the router in
//! three modes:
//!
//! - **OFF**: no D→P reuse (the router's recompute threshold is 10⁹ tokens,
//!   so it never attaches D's params; P recomputes every prompt).
//! - **fixed**: vLLM's static threshold, 64 tokens.
//! - **adaptive**: thresholds pushed by the node agent of P's node, fitted
//!   from its active probes and from the engines' own READs it performed.
//!
//! Prints the TTFT table (prompt length, TTFT OFF, TTFT ON (fixed), speed-up,
//! adaptive, measured D→P transfer), writes `report.json` and `ttft.png`
//! under `--out-dir` (default `target/kvloop-demo`), and stops every process
//! and namespace it started, also on Ctrl-C.
//!
//! `slow-link`: the same with `tc tbf` lowering node B's egress (what P reads
//! from D) mid-run of every mode.
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_cli::child::ReadyChild;
use kvloop_cli::netns::NodePair;
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{agentic, chart, client, report};
use serde_json::{Value, json};

/// Router recompute threshold of the OFF mode: larger than any prompt, so the
/// router never attaches D's params.
pub const OFF_THRESHOLD_TOKENS: u64 = 1_000_000_000;
/// vLLM's static `kv_recompute_threshold` default (the fixed mode).
pub const FIXED_THRESHOLD_TOKENS: u64 = 64;

/// Default output directory.
pub const DEFAULT_OUT_DIR: &str = "target/kvloop-demo";

/// Flags of `kvloop demo` / `kvloop demo loop` / `kvloop demo slow-link`.
#[derive(Clone, Debug, Args)]
pub struct DemoArgs {
    /// Use loopback even when root.
    #[arg(long)]
    pub loopback: bool,
    /// Prefill cost profile of the engines (`qwen3-32b-h200`, `glm-5-fp8-h200`).
    #[arg(long, default_value = "qwen3-32b-h200")]
    pub profile: String,
    /// Multiplies simulated compute time (0.5: twice as fast as real time;
    /// TTFTs are reported as measured, transfers are never scaled).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Target prompt tokens of each conversation's first request.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2048u64, 4096, 8192, 16384, 24576])]
    pub prefix_tokens: Vec<u64>,
    /// Conversations per prefix length.
    #[arg(long, default_value_t = 2)]
    pub conversations_per_prefix: usize,
    /// User turns per conversation (turn 1 has nothing to reuse).
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Tokens of each later turn's tool output (the new part of a turn), at least.
    #[arg(long, default_value_t = 512)]
    pub tool_output_tokens: u64,
    /// Each later turn's tool output is also at least this fraction of the
    /// conversation's prefix. Default 0.35: the published ON TTFTs imply
    /// about 9k new of 24k prompt tokens per turn (Qwen3-32B); with only a
    /// few hundred new tokens per turn the speed-up is far larger than
    /// published.
    #[arg(long, default_value_t = 0.35)]
    pub tool_output_fraction: f64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: u64,
    /// Simulated decode time per output token, µs (scaled by --time-scale).
    #[arg(long, default_value_t = 2000)]
    pub decode_us_per_token: u64,
    /// Scaled KV bytes per token (see kvloop-engine-sim's `kv` module).
    #[arg(long, default_value_t = 2048)]
    pub kv_bytes_per_token: u64,
    /// KV capacity of each engine, tokens.
    #[arg(long, default_value_t = 262_144)]
    pub kv_capacity_tokens: u64,
    /// Modes to run, in order (OFF, fixed, adaptive).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["OFF".to_string(), "fixed".into(), "adaptive".into()])]
    pub modes: Vec<String>,
    /// Slow-link scenario: rate node B's egress is lowered to, mid-run of each mode.
    #[arg(long, default_value = "200mbit")]
    pub slow_rate: String,
    /// Output directory (report.json, ttft.png, logs/); slow-link writes
    /// under `<default>/slow-link` unless given.
    #[arg(long, default_value = DEFAULT_OUT_DIR)]
    pub out_dir: PathBuf,
    /// Directory of kvloop-engine-sim, kvloop-router, kvloop-agent (default: next to this binary).
    #[arg(long, env = "KVLOOP_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Bound on each mode's run, seconds.
    #[arg(long, default_value_t = 240)]
    pub max_mode_s: u64,
    /// Generator seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// One row of `report.json` (`rows`): one mode at one prompt-length bucket.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    /// `OFF`, `fixed` or `adaptive`.
    pub mode: String,
    /// Median prompt tokens of the bucket's requests (client count, cl100k).
    pub prompt_tokens: u64,
    /// Bucket lower edge, tokens.
    pub bucket_lo_tokens: u64,
    /// Requests in the bucket (errors included).
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Median TTFT, ms.
    pub ttft_ms_p50: Option<f64>,
    /// Median D→P READ time (claim + transfer) of the bucket's reuses, ms.
    pub transfer_ms_p50: Option<f64>,
    /// Median P→D READ time, ms.
    pub p2d_transfer_ms_p50: Option<f64>,
    /// Recompute threshold in force (router static or agent-pushed), tokens.
    pub threshold_tokens: Option<u64>,
}

/// Where the nodes are.
struct Topology {
    pair: Option<NodePair>,
    ip_a: IpAddr,
    ip_b: IpAddr,
}

impl Topology {
    fn cmd(&self, node_b: bool, program: &Path) -> Command {
        match &self.pair {
            Some(p) => NodePair::command_in(if node_b { &p.ns_b } else { &p.ns_a }, program),
            None => Command::new(program),
        }
    }
    fn describe(&self) -> &'static str {
        if self.pair.is_some() {
            "two network namespaces joined by a veth"
        } else {
            "loopback"
        }
    }
    fn tc(&self, args: &[&str]) -> Result<()> {
        let Some(p) = &self.pair else {
            bail!("the slow-link scenario needs two namespaces (root, without --loopback)")
        };
        let out = Command::new("tc")
            .args(["-n", &p.ns_b])
            .args(args)
            .output()
            .context("running tc")?;
        if !out.status.success() {
            bail!(
                "tc {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
    fn limit(&self, rate: &str) -> Result<()> {
        self.pair.as_ref().expect("checked").limit_rate_b(rate)
    }
    fn unlimit(&self) {
        if let Some(p) = &self.pair {
            let _ = self.tc(&["qdisc", "del", "dev", &p.dev_b, "root"]);
        }
    }
}

fn bin_dir(a: &DemoArgs) -> Result<PathBuf> {
    match &a.bin_dir {
        Some(d) => Ok(d.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_path_buf()),
    }
}

fn need_bin(dir: &Path, name: &str) -> Result<PathBuf> {
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found: build it first (`cargo build --release -p kvloop-engine-sim -p kvloop-router`, or `make build`) or set KVLOOP_BIN_DIR",
            p.display()
        );
    }
    Ok(p)
}

/// Runs the demo (`slow_link`: the slow-link scenario). Blocking: it runs
/// its own tokio runtime on a thread placed in node A's namespace.
pub fn run(mut a: DemoArgs, slow_link: bool) -> Result<()> {
    if slow_link && a.out_dir == Path::new(DEFAULT_OUT_DIR) {
        // Keep the main demo's report next to this one.
        a.out_dir = a.out_dir.join("slow-link");
    }
    // Ctrl-C / SIGTERM set a flag the demo polls; dropping the demo future
    // then stops the children and removes the namespaces.
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let root = unsafe { libc::geteuid() } == 0;
    let pair = if root && !a.loopback {
        Some(NodePair::create(std::process::id() % 10_000)?)
    } else {
        if slow_link {
            bail!(
                "kvloop demo slow-link needs root (network namespaces and tc); run as root without --loopback"
            );
        }
        None
    };
    let topo = match &pair {
        Some(p) => Topology {
            ip_a: IpAddr::V4(p.addr_a),
            ip_b: IpAddr::V4(p.addr_b),
            pair: None,
        },
        None => Topology {
            pair: None,
            ip_a: "127.0.0.1".parse().unwrap(),
            ip_b: "127.0.0.1".parse().unwrap(),
        },
    };
    let topo = Topology { pair, ..topo };
    let ns_a = topo.pair.as_ref().map(|p| p.ns_a.clone());
    // Everything the demo does over the network happens in node A (where the
    // router and P are): a thread joins A's namespace and runs a runtime.
    let result = std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            if let Some(ns) = &ns_a {
                join_netns(ns)?;
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async {
                let stop = async {
                    while !INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                tokio::select! {
                    r = run_async(&a, &topo, slow_link) => r,
                    _ = stop => {
                        eprintln!("interrupted: stopping everything the demo started");
                        bail!("interrupted")
                    }
                }
            })
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("demo thread panicked")))
    });
    topo.unlimit();
    drop(topo);
    result
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn join_netns(ns: &str) -> Result<()> {
    let f = std::fs::File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("opening /run/netns/{ns}"))?;
    // SAFETY: setns on this thread only, with a valid fd.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) };
    if rc != 0 {
        bail!("setns({ns}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

async fn get_json(http: &reqwest::Client, url: &str) -> Result<Value> {
    let r = http
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    if !r.status().is_success() {
        bail!("GET {url}: {}", r.status());
    }
    r.json().await.with_context(|| format!("GET {url}: JSON"))
}

/// Router token shared by the demo's routers and agents.
const ADMIN_TOKEN: &str = "kvloop-demo";

/// TOML of one demo agent. Agent A (node of P) pushes the (p0, d0)
/// threshold to `router`; both probe each other with READs of the engines'
/// block shape (4 regions of `16 × slot` bytes).
#[allow(clippy::too_many_arguments)]
fn agent_toml(
    name: &str,
    ip: IpAddr,
    http_port: u16,
    socket: &Path,
    peer: &str,
    peer_http: &str,
    router: Option<&str>,
    kv_bytes_per_token: u64,
) -> String {
    let layers = 4u64;
    let block_len = kv_bytes_per_token / layers * 16;
    let mut t = format!(
        r#"agent_id = "{name}"
node_addr = "{ip}"
http_listen = "{ip}:{http_port}"
socket_path = "{sock}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
push_period_ms = 500

[probe]
period_ms = 200
num_regions = {layers}
num_blocks = 128
block_len_bytes = {block_len}
block_size_tokens = 16
small_blocks = 1
large_blocks = 64
max_bytes_per_s = 67108864

[[peers]]
name = "{peer}"
http = "{peer_http}"
"#,
        sock = socket.display()
    );
    if let Some(r) = router {
        t.push_str(&format!(
            r#"
[[routers]]
url = "http://{r}"
token = "{ADMIN_TOKEN}"

[[pairs]]
prefill_engine_id = "p0"
decode_engine_id = "d0"
decode_peer = "{peer}"
bytes_per_token = {kv_bytes_per_token}
block_size_tokens = 16
regions_per_block = {layers}
"#
        ));
    }
    t
}

/// A free TCP port on `ip` (bound and released; used for the adaptive
/// router, whose URL the agent must know before it starts).
fn free_port(ip: IpAddr) -> Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}

async fn run_async(a: &DemoArgs, topo: &Topology, slow_link: bool) -> Result<()> {
    let t_start = Instant::now();
    let dir = bin_dir(a)?;
    let sim = need_bin(&dir, "kvloop-engine-sim")?;
    let router_bin = need_bin(&dir, "kvloop-router")?;
    let agent_bin = need_bin(&dir, "kvloop-agent")?;
    let logs = a.out_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    for m in &a.modes {
        if !["OFF", "fixed", "adaptive"].contains(&m.as_str()) {
            bail!("--modes: unknown mode `{m}`; expected OFF, fixed, adaptive");
        }
    }
    println!(
        "kvloop demo{}: node A {} (router, P) / node B {} (D), {}",
        if slow_link { " slow-link" } else { "" },
        topo.ip_a,
        topo.ip_b,
        topo.describe()
    );
    println!(
        "profile {} at time scale {}, KV {} B/token (scaled), conversations: prefixes {:?} × {} × {} turns",
        a.profile,
        a.time_scale,
        a.kv_bytes_per_token,
        a.prefix_tokens,
        a.conversations_per_prefix,
        a.turns
    );

    // Conversations (real source files of this machine, nothing downloaded).
    let tok = TokenCounter::default_counter();
    let corpus = agentic::SourceCorpus::discover(&agentic::default_source_roots(), 4000)
        .context("finding source files for the agentic conversations")?;
    let spec = agentic::AgenticSpec {
        prefix_tokens: a.prefix_tokens.clone(),
        conversations_per_prefix: a.conversations_per_prefix,
        user_turns: a.turns,
        tool_output_tokens: a.tool_output_tokens,
        tool_output_fraction: a.tool_output_fraction,
        answer_tokens: a.answer_tokens,
        seed: a.seed,
    };
    let convs = agentic::generate_agentic(&spec, &corpus, &tok)?;

    // Agents (one per node): they host the engines' KV memory (managed
    // mode), do their READs, probe the link and fit the cost model; agent A
    // pushes the (p0, d0) threshold to the adaptive router, whose address
    // is chosen now.
    let adaptive_router = format!("{}:{}", topo.ip_a, free_port(topo.ip_a)?);
    let mut agents = Vec::new();
    let (sock_a, sock_b) = {
        let (port_a, port_b) = if topo.pair.is_some() {
            (9470, 9470)
        } else {
            (free_port(topo.ip_a)?, free_port(topo.ip_b)?)
        };
        let sock_a =
            std::env::temp_dir().join(format!("kvloop-demo-{}-a.sock", std::process::id()));
        let sock_b =
            std::env::temp_dir().join(format!("kvloop-demo-{}-b.sock", std::process::id()));
        let http_a = format!("{}:{port_a}", topo.ip_a);
        let http_b = format!("{}:{port_b}", topo.ip_b);
        let ta = agent_toml(
            "node-a",
            topo.ip_a,
            port_a,
            &sock_a,
            "node-b",
            &http_b,
            Some(&adaptive_router),
            a.kv_bytes_per_token,
        );
        let tb = agent_toml(
            "node-b",
            topo.ip_b,
            port_b,
            &sock_b,
            "node-a",
            &http_a,
            None,
            a.kv_bytes_per_token,
        );
        for (name, toml, node_b) in [("agent-a", ta, false), ("agent-b", tb, true)] {
            let path = a.out_dir.join(format!("{name}.toml"));
            std::fs::write(&path, toml)?;
            let mut c = topo.cmd(node_b, &agent_bin);
            c.arg("--config").arg(&path).env("RUST_LOG", "warn");
            agents.push(ReadyChild::start(
                name,
                c,
                Some(&logs.join(format!("{name}.log"))),
                Duration::from_secs(60),
            )?);
        }
        println!(
            "agents: node-a {http_a}, node-b {http_b} (hosting the engines' KV, probing each other; node-a pushes to {adaptive_router})"
        );
        (sock_a, sock_b)
    };

    // Engines.
    let engine = |role: &str, id: &str, ip: IpAddr, node_b: bool| -> Result<ReadyChild> {
        let mut c = topo.cmd(node_b, &sim);
        c.args(["--role", role, "--engine-id", id])
            .args(["--http-addr", &format!("{ip}:0")])
            .args(["--side-channel-addr", &format!("{ip}:0")])
            .args(["--profile", &a.profile])
            .args(["--time-scale", &a.time_scale.to_string()])
            .args(["--kv-mode", "agent", "--tokenizer", "pieces"])
            .arg("--agent-socket")
            .arg(if node_b { &sock_b } else { &sock_a })
            .args(["--kv-bytes-per-token", &a.kv_bytes_per_token.to_string()])
            .args(["--kv-capacity-tokens", &a.kv_capacity_tokens.to_string()])
            .args(["--decode-us-per-token", &a.decode_us_per_token.to_string()])
            .env("RUST_LOG", "warn");
        ReadyChild::start(
            id,
            c,
            Some(&logs.join(format!("{id}.log"))),
            Duration::from_secs(30),
        )
    };
    let p = engine("prefill", "p0", topo.ip_a, false)?;
    let d = engine("decode", "d0", topo.ip_b, true)?;
    let p_url = format!("http://{}", p.get("http")?);
    let d_url = format!("http://{}", d.get("http")?);
    let p_side: std::net::SocketAddr = p.get("side_channel")?.parse()?;
    let d_side: std::net::SocketAddr = d.get("side_channel")?.parse()?;
    let config = format!(
        r#"listen = "{ip_a}:0"
admin_token = "{ADMIN_TOKEN}"
prefix_check = "tokens"
health_interval_ms = 1000

[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "{p_url}"
side_channel_host = "{p_host}"
side_channel_port = {p_port}
tp_size = 1
block_size_tokens = 16

[[engines]]
engine_id = "d0"
role = "decode"
http_url = "{d_url}"
side_channel_host = "{d_host}"
side_channel_port = {d_port}
tp_size = 1
block_size_tokens = 16
"#,
        ip_a = topo.ip_a,
        p_host = p_side.ip(),
        p_port = p_side.port(),
        d_host = d_side.ip(),
        d_port = d_side.port(),
    );
    let config_path = a.out_dir.join("router.toml");
    std::fs::write(&config_path, config)?;

    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut rep = report::Report::new(bucket_edges(&a.prefix_tokens), tok.name());
    let mut thresholds: BTreeMap<String, Option<u64>> = BTreeMap::new();
    let mut transfers: BTreeMap<String, (Vec<Value>, Vec<Value>)> = BTreeMap::new();
    // Modes not run (none since the agents are always there; the report
    // keeps the field).
    let skipped: Vec<String> = Vec::new();
    for mode in &a.modes {
        let threshold = match mode.as_str() {
            "OFF" => OFF_THRESHOLD_TOKENS,
            // adaptive: static 64 until the agent's first push.
            _ => FIXED_THRESHOLD_TOKENS,
        };
        let mut rc = topo.cmd(false, &router_bin);
        rc.arg("--config")
            .arg(&config_path)
            .args(["--kv-recompute-threshold", &threshold.to_string()])
            .env("RUST_LOG", "warn");
        if mode == "adaptive" {
            rc.args(["--listen", &adaptive_router]);
        }
        let router = ReadyChild::start(
            "router",
            rc,
            Some(&logs.join(format!("router-{mode}.log"))),
            Duration::from_secs(20),
        )?;
        let router_url = format!("http://{}", router.get("http")?);
        wait_healthy(&http, &router_url).await?;
        if mode == "adaptive" {
            // The agent pushes every 500 ms once its model is fitted.
            // In slow-link, an earlier mode's slowdown may still be in the
            // agent's model: wait until the threshold reflects the restored
            // link (below 4096 tokens) so the slowdown is seen again.
            let t = Instant::now();
            let mut th = None;
            while t.elapsed() < Duration::from_secs(30) {
                th = router_threshold(&http, &router_url).await;
                if th.is_some_and(|v| !slow_link || v < 4096) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            match th {
                Some(v) => println!(
                    "  agent-pushed threshold in force: {v} tokens (after {:.1} s)",
                    t.elapsed().as_secs_f64()
                ),
                None => println!(
                    "  no agent-pushed threshold within 30 s: the router uses its static 64"
                ),
            }
        }
        let p_before = get_json(&http, &format!("{p_url}/sim/reads")).await?;
        let d_before = get_json(&http, &format!("{d_url}/sim/reads")).await?;
        let mut cfg = client::ClientConfig::new(&router_url);
        cfg.model = Some("sim-model".into());
        cfg.max_concurrency = 1;
        cfg.max_duration = Duration::from_secs(a.max_mode_s);
        cfg.request_timeout = Duration::from_secs(60);
        cfg.max_output_tokens = Some(a.answer_tokens);
        cfg.tag_ids_with_mode = true;
        let requests: usize = convs.iter().map(|c| c.user_turns()).sum();
        if mode == "adaptive" {
            println!(
                "mode {mode}: agent-pushed threshold (static {threshold} until a push), {requests} requests …"
            );
        } else {
            println!("mode {mode}: threshold {threshold} tokens, {requests} requests …");
        }
        let t_mode = Instant::now();
        let run_fut = client::run_mode(mode, &convs, &cfg, &tok);
        let run = if slow_link {
            // Lower the link once half of this mode's requests reached P
            // (conversations run shortest prefix first, so the longest
            // ones run on the slow link).
            let p_base = get_json(&http, &format!("{p_url}/sim/stats")).await?["requests"]
                .as_u64()
                .unwrap_or(0);
            let switch_at = p_base + (requests as u64).div_ceil(2);
            let half = async {
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if let Ok(v) = get_json(&http, &format!("{p_url}/sim/stats")).await
                        && v["requests"].as_u64().unwrap_or(0) >= switch_at
                    {
                        break;
                    }
                }
            };
            tokio::pin!(run_fut);
            tokio::select! {
                r = &mut run_fut => r?,
                _ = half => {
                    topo.limit(&a.slow_rate)?;
                    println!("  link B→A lowered to {} (tc tbf)", a.slow_rate);
                    if mode == "adaptive" {
                        let watch = async {
                            let t = Instant::now();
                            let mut last = None;
                            loop {
                                tokio::time::sleep(Duration::from_millis(500)).await;
                                let v = router_threshold(&http, &router_url).await;
                                if v != last {
                                    println!(
                                        "  t+{:.1} s after the slowdown: threshold {} tokens",
                                        t.elapsed().as_secs_f64(),
                                        v.map_or("(none in force)".into(), |v| v.to_string())
                                    );
                                    last = v;
                                }
                            }
                        };
                        tokio::select! {
                            r = &mut run_fut => r?,
                            _ = watch => unreachable!(),
                        }
                    } else {
                        run_fut.await?
                    }
                }
            }
        } else {
            run_fut.await?
        };
        topo.unlimit();
        let failed = run.records.iter().filter(|r| r.error.is_some()).count();
        println!(
            "mode {mode}: done in {:.1} s, {failed} failed",
            t_mode.elapsed().as_secs_f64()
        );
        let pushed = if mode == "adaptive" {
            router_threshold(&http, &router_url).await
        } else {
            Some(threshold)
        };
        thresholds.insert(mode.clone(), pushed);
        let p_after = get_json(&http, &format!("{p_url}/sim/reads")).await?;
        let d_after = get_json(&http, &format!("{d_url}/sim/reads")).await?;
        transfers.insert(
            mode.clone(),
            (
                new_entries(&p_before, &p_after),
                new_entries(&d_before, &d_after),
            ),
        );
        rep.push(run);
        drop(router);
    }
    let p_stats = get_json(&http, &format!("{p_url}/sim/stats")).await?;
    let d_stats = get_json(&http, &format!("{d_url}/sim/stats")).await?;
    let verified = p_stats["verified_blocks"].as_u64().unwrap_or(0)
        + d_stats["verified_blocks"].as_u64().unwrap_or(0);
    let mismatched = p_stats["mismatched_blocks"].as_u64().unwrap_or(0)
        + d_stats["mismatched_blocks"].as_u64().unwrap_or(0);
    drop(p);
    drop(d);
    drop(agents);
    for side in ["a", "b"] {
        // An agent removes its socket on SIGTERM; a killed one leaves it.
        let _ = std::fs::remove_file(
            std::env::temp_dir().join(format!("kvloop-demo-{}-{side}.sock", std::process::id())),
        );
    }

    let rows = rows(&rep, &transfers, &thresholds);
    println!();
    print!("{}", render_table(&rows, &skipped));
    println!("KV blocks verified byte-exact: {verified} (D→P and P→D), mismatched: {mismatched}");
    let json_path = a.out_dir.join("report.json");
    let png = a.out_dir.join("ttft.png");
    let out = json!({
        "scenario": if slow_link { "slow-link" } else { "loop" },
        "topology": topo.describe(),
        "profile": a.profile,
        "time_scale": a.time_scale,
        "kv_bytes_per_token": a.kv_bytes_per_token,
        "kv_scaling": "real Qwen3-32B KV: 256 KiB/token (32 KiB per GPU at TP 8); scaled to kv_bytes_per_token so transfers cost tens of ms on a veth",
        "modes_skipped": skipped,
        "slow_rate": if slow_link { Some(a.slow_rate.clone()) } else { None },
        "rows": rows,
        "verified_blocks": verified,
        "mismatched_blocks": mismatched,
        "engines": {"p0": p_stats, "d0": d_stats},
        "reads": transfers.iter().map(|(m, (p, d))| (m.clone(), json!({"p0": p, "d0": d}))).collect::<serde_json::Map<String, Value>>(),
        "wall_s": t_start.elapsed().as_secs_f64(),
        "loadgen": rep.to_json(),
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&out)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    chart::write_ttft_chart(
        &rep,
        &png,
        &format!("TTFT vs prompt length ({})", a.profile),
    )?;
    println!(
        "wrote {} and {} ({:.0} s)",
        json_path.display(),
        png.display(),
        t_start.elapsed().as_secs_f64()
    );
    if mismatched > 0 {
        bail!("{mismatched} KV blocks mismatched");
    }
    Ok(())
}

/// Bucket edges: 0 and ¾ of every prefix length after the first, so each
/// conversation's turns stay in its prefix's bucket.
pub fn bucket_edges(prefix_tokens: &[u64]) -> Vec<u64> {
    let mut v: Vec<u64> = prefix_tokens.iter().skip(1).map(|p| p * 3 / 4).collect();
    v.insert(0, 0);
    v
}

fn new_entries(before: &Value, after: &Value) -> Vec<Value> {
    let n = before.as_array().map_or(0, Vec::len);
    after
        .as_array()
        .map(|a| a.iter().skip(n).cloned().collect())
        .unwrap_or_default()
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Summary rows per mode and bucket; transfer times bucketed by the engine's
/// own prompt token count with the same edges.
fn rows(
    rep: &report::Report,
    transfers: &BTreeMap<String, (Vec<Value>, Vec<Value>)>,
    thresholds: &BTreeMap<String, Option<u64>>,
) -> Vec<Row> {
    let edges = &rep.bucket_edges_tokens;
    let bucket = |t: u64| edges.partition_point(|&e| e <= t).saturating_sub(1);
    rep.summaries()
        .into_iter()
        .map(|s| {
            let b = bucket(s.bucket_lo_tokens);
            let pick = |entries: &[Value]| {
                median(
                    entries
                        .iter()
                        .filter(|e| e["tokens"].as_u64().unwrap_or(0) > 0)
                        .filter(|e| bucket(e["prompt_tokens"].as_u64().unwrap_or(0)) == b)
                        .filter_map(|e| e["transfer_ms"].as_f64())
                        .collect(),
                )
            };
            let (d2p, p2d) = transfers
                .get(&s.mode)
                .map(|(p, d)| (pick(p), pick(d)))
                .unwrap_or((None, None));
            Row {
                mode: s.mode.clone(),
                prompt_tokens: s.prompt_tokens,
                bucket_lo_tokens: s.bucket_lo_tokens,
                requests: s.count,
                errors: s.errors,
                ttft_ms_p50: s.ttft_ms_p50,
                transfer_ms_p50: d2p,
                p2d_transfer_ms_p50: p2d,
                threshold_tokens: thresholds.get(&s.mode).copied().flatten(),
            }
        })
        .collect()
}

/// The TTFT table in the published format plus the adaptive and transfer columns.
pub fn render_table(rows: &[Row], skipped: &[String]) -> String {
    let mut buckets: Vec<u64> = rows.iter().map(|r| r.bucket_lo_tokens).collect();
    buckets.sort_unstable();
    buckets.dedup();
    let find = |mode: &str, b: u64| {
        rows.iter()
            .find(|r| r.mode == mode && r.bucket_lo_tokens == b)
    };
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0} ms"));
    let adaptive_skipped = skipped.iter().any(|m| m == "adaptive");
    let mut s = format!(
        "{:>14} {:>10} {:>14} {:>9} {:>12} {:>10} {:>14}\n",
        "prompt tokens", "TTFT OFF", "TTFT ON(fixed)", "speed-up", "adaptive", "D→P ms", "P→D ms"
    );
    for b in buckets {
        let off = find("OFF", b);
        let fixed = find("fixed", b);
        let adaptive = find("adaptive", b);
        let prompt = fixed.or(off).or(adaptive).map_or(b, |r| r.prompt_tokens);
        let speed = match (
            off.and_then(|r| r.ttft_ms_p50),
            fixed.and_then(|r| r.ttft_ms_p50),
        ) {
            (Some(o), Some(f)) if f > 0.0 => format!("{:.2}×", o / f),
            _ => "-".into(),
        };
        let ad = if adaptive_skipped {
            "n/a".to_string()
        } else {
            ms(adaptive.and_then(|r| r.ttft_ms_p50))
        };
        s.push_str(&format!(
            "{:>14} {:>10} {:>14} {:>9} {:>12} {:>10} {:>14}\n",
            prompt,
            ms(off.and_then(|r| r.ttft_ms_p50)),
            ms(fixed.and_then(|r| r.ttft_ms_p50)),
            speed,
            ad,
            ms(fixed.and_then(|r| r.transfer_ms_p50)),
            ms(fixed.or(off).and_then(|r| r.p2d_transfer_ms_p50)),
        ));
    }
    if adaptive_skipped {
        s.push_str("adaptive: n/a (node agents not available to this demo)\n");
    }
    s
}

async fn wait_healthy(http: &reqwest::Client, url: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if http
            .get(format!("{url}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("router at {url} not healthy within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn router_threshold(http: &reqwest::Client, url: &str) -> Option<u64> {
    let v: Value = http
        .get(format!("{url}/admin/thresholds"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    // The (p0, d0) entry when it is in force (pushed and not lapsed).
    v["pairs"].as_array()?.iter().find_map(|p| {
        (p["prefill_engine_id"] == "p0" && p["decode_engine_id"] == "d0" && p["in_force"] == true)
            .then(|| p["threshold_tokens"].as_u64())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edges_keep_turns_in_their_prefix_bucket() {
        assert_eq!(bucket_edges(&[2048, 4096, 24576]), vec![0, 3072, 18432]);
    }

    #[test]
    fn table_has_speed_up_and_marks_adaptive_unavailable() {
        let row = |mode: &str, ttft: f64| Row {
            mode: mode.into(),
            prompt_tokens: 24_600,
            bucket_lo_tokens: 18_432,
            requests: 6,
            errors: 0,
            ttft_ms_p50: Some(ttft),
            transfer_ms_p50: (mode == "fixed").then_some(40.0),
            p2d_transfer_ms_p50: Some(45.0),
            threshold_tokens: Some(64),
        };
        let t = render_table(
            &[row("OFF", 800.0), row("fixed", 400.0)],
            &["adaptive".into()],
        );
        assert!(t.contains("2.00×"), "{t}");
        assert!(t.contains("n/a"), "{t}");
        assert!(t.contains("40 ms"), "{t}");
    }
}
