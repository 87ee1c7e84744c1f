//! `kvloop demo cluster` (`make demo-cluster`, issue 13 item 3): an
//! emulated xPyD cluster on one machine, and the same conversations routed
//! by three policies side by side.
//!
//! - **Nodes**: network namespaces on one bridge ([`kvloop_tests::netns_star::NodeStar`]):
//!   `router` (Redis on its loopback, two router replicas on two
//!   addresses), `p0`, `p1` (prefill engines), `d0`, `d1`, `d2` (decode
//!   engines); an agent on every engine node hosts its engine's KV
//!   (managed mode), does its READs (libfabric `tcp;ofi_rxm`) and probes
//!   its peers; P nodes' agents push thresholds and cost models to every
//!   replica behind the name `kvloop-routers` (two A records in the node's
//!   `/etc/hosts`, as a headless Service gives).
//! - **Links** (`heterogeneous` scenario): what `d2` sends to `p1` (the
//!   READs of `p1` from `d2`) is limited to `--slow-rate` (tc); the others
//!   are fast. `homogeneous`: no limit, no events.
//! - **Policies**: `rr + fixed 64` (vLLM's proxy), `rr + adaptive` (the
//!   agents' thresholds), `kvloop` (selection by predicted TTFT); each
//!   with its own two replicas sharing conversations on Redis; the client
//!   alternates replicas turn by turn ([`drive`]).
//! - **Events** (heterogeneous, every policy alike): at 30 % of the
//!   requests replica 1 is SIGKILLed, at 55 % restarted; at 40 % the
//!   `d0 → p0` path is lowered to `--degrade-rate`, at 70 % restored.
//! - **Report** ([`report`]): TTFT p50/p90/p99 per policy and scenario,
//!   decisions by reason, bytes moved, failed requests, regret against the
//!   oracle ([`oracle`]), what each event did, blocks verified;
//!   `report.json` and `ttft.png` under `--out-dir`.
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{Conversation, agentic};
use kvloop_tests::netns_star::NodeStar;
use serde_json::Value;

mod drive;
mod hold;
pub mod oracle;
mod procs;
mod report;

use procs::{Bins, Cluster, KVLOOP, PolicySpec, RR_ADAPTIVE, RR_FIXED};

/// Flags of `kvloop demo cluster`.
#[derive(Clone, Debug, Args)]
pub struct ClusterArgs {
    /// Prefill cost profile of the engines.
    #[arg(long, default_value = "qwen3-32b-h200")]
    pub profile: String,
    /// Multiplies simulated compute time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Prefill engines (one node each).
    #[arg(long, default_value_t = 2)]
    pub prefill_engines: usize,
    /// Decode engines (one node each).
    #[arg(long, default_value_t = 3)]
    pub decode_engines: usize,
    /// Conversations per policy run.
    #[arg(long, default_value_t = 24)]
    pub conversations: usize,
    /// User turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// First-request prompt lengths, cycled over the conversations.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8192u64, 16384, 24576])]
    pub prefix_tokens: Vec<u64>,
    /// Tokens of each later turn's tool output, at least.
    #[arg(long, default_value_t = 512)]
    pub tool_output_tokens: u64,
    /// Each later turn's tool output is also at least this share of the prefix.
    #[arg(long, default_value_t = 0.35)]
    pub tool_output_fraction: f64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 16)]
    pub answer_tokens: u64,
    /// Simulated decode time per output token, µs.
    #[arg(long, default_value_t = 2000)]
    pub decode_us_per_token: u64,
    /// Scaled KV bytes per token.
    #[arg(long, default_value_t = 1024)]
    pub kv_bytes_per_token: u64,
    /// KV capacity of each engine, tokens.
    #[arg(long, default_value_t = 524_288)]
    pub kv_capacity_tokens: u64,
    /// Conversations in flight at once (enough that P queues).
    #[arg(long, default_value_t = 6)]
    pub concurrency: usize,
    /// Rate of the slow path (`d<last>` → `p<last>`), tc syntax.
    #[arg(long, default_value = "200mbit")]
    pub slow_rate: String,
    /// Rate the `d0 → p0` path is lowered to mid-run, tc syntax.
    #[arg(long, default_value = "100mbit")]
    pub degrade_rate: String,
    /// Scenarios to run, in order.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["heterogeneous".to_string(), "homogeneous".into()])]
    pub scenarios: Vec<String>,
    /// Leave out the replica kill and the link degradation.
    #[arg(long)]
    pub no_events: bool,
    /// Output directory (report.json, ttft.png, logs/).
    #[arg(long, default_value = "target/kvloop-demo/cluster")]
    pub out_dir: PathBuf,
    /// Directory of kvloop-engine-sim, kvloop-router, kvloop-agent (default: next to this binary).
    #[arg(long, env = "KVLOOP_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Bound on each policy's run, seconds.
    #[arg(long, default_value_t = 300)]
    pub max_policy_s: u64,
    /// Generator seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// After the report, run the kvloop policy's two router replicas again
    /// and keep the whole cluster up for `kvloop doctor` / `ping` / `top`
    /// (see `hold.json` under `--out-dir`) until Ctrl-C, SIGTERM or
    /// `--hold-max-s`.
    #[arg(long)]
    pub hold: bool,
    /// Bound on `--hold`, seconds.
    #[arg(long, default_value_t = 3600)]
    pub hold_max_s: u64,
}

/// The policies, in the order they run.
const POLICIES: [PolicySpec; 3] = [RR_FIXED, RR_ADAPTIVE, KVLOOP];

/// What one policy's run left.
#[derive(Debug, serde::Serialize)]
struct PolicyRun {
    policy: &'static str,
    scenario: String,
    wall_s: f64,
    records: Vec<drive::Rec>,
    /// New `/sim/prefills` entries, by P.
    prefills: Vec<(String, Value)>,
    /// New `/sim/reads` entries of every engine (P: d2p, D: p2d).
    reads: Vec<(String, Value)>,
    events: Vec<Event>,
}

/// An event of a run.
#[derive(Debug, Clone, serde::Serialize)]
struct Event {
    what: String,
    t_ms: f64,
    unix_ms: f64,
    done: usize,
}

/// Runs the demo (blocking; its runtime runs on a thread in the router
/// node's namespace). Needs root.
pub fn run(a: ClusterArgs) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("kvloop demo cluster needs root (network namespaces and tc)");
    }
    for s in &a.scenarios {
        if !["heterogeneous", "homogeneous"].contains(&s.as_str()) {
            bail!("--scenarios: unknown `{s}`; expected heterogeneous, homogeneous");
        }
    }
    if a.prefill_engines < 2 || a.decode_engines < 2 {
        bail!("--prefill-engines and --decode-engines: expected at least 2 each");
    }
    let mut names = vec!["router".to_string()];
    names.extend((0..a.prefill_engines).map(|i| format!("p{i}")));
    names.extend((0..a.decode_engines).map(|i| format!("d{i}")));
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let star = NodeStar::create(std::process::id() % 10_000, &refs)?;
    let router_ns = star.node("router").ns.clone();
    let result = std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            kvloop_cli::netns::NodePair::join(&router_ns);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(run_async(&a, &star))
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("demo thread panicked")))
    });
    drop(star);
    result
}

async fn run_async(a: &ClusterArgs, star: &NodeStar) -> Result<()> {
    let t_start = Instant::now();
    let dir = match &a.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_path_buf(),
    };
    let need = |n: &str| -> Result<PathBuf> {
        let p = dir.join(n);
        if !p.exists() {
            bail!(
                "{} not found: `make build` first, or set KVLOOP_BIN_DIR",
                p.display()
            );
        }
        Ok(p)
    };
    let bins = Bins {
        sim: need("kvloop-engine-sim")?,
        router: need("kvloop-router")?,
        agent: need("kvloop-agent")?,
    };
    let logs = a.out_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let tok = TokenCounter::default_counter();
    let convs = Arc::new(conversations(a, &tok)?);
    println!(
        "kvloop demo cluster: {} P + {} D engine-sims ({}, time scale {}), one agent per node, 2 router replicas on Redis, {} nodes on one bridge",
        a.prefill_engines,
        a.decode_engines,
        a.profile,
        a.time_scale,
        star.nodes.len()
    );
    println!(
        "workload: {} conversations × {} turns, prefixes {:?} tokens, {} in flight; KV {} B/token (scaled)",
        convs.len(),
        a.turns,
        a.prefix_tokens,
        a.concurrency,
        a.kv_bytes_per_token
    );
    let cluster = procs::start(a, star, &bins, &logs)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let slow_from = format!("d{}", a.decode_engines - 1);
    let slow_to = format!("p{}", a.prefill_engines - 1);
    let mut runs = Vec::new();
    for scenario in &a.scenarios {
        let hetero = scenario == "heterogeneous";
        if hetero {
            star.limit_path(&slow_from, star.node(&slow_to).addr, &a.slow_rate)?;
            println!(
                "\nscenario {scenario}: {slow_from} → {slow_to} limited to {} (tc); other paths fast",
                a.slow_rate
            );
        } else {
            star.unlimit(&slow_from);
            println!("\nscenario {scenario}: every path fast");
        }
        // The agents' probes see the paths as they are now.
        tokio::time::sleep(Duration::from_secs(6)).await;
        for spec in &POLICIES {
            let ctx = RunCtx {
                a,
                star,
                bins: &bins,
                cluster: &cluster,
                logs: &logs,
                http: &http,
                scenario,
                events: hetero && !a.no_events,
            };
            runs.push(ctx.run(spec, &convs).await?);
        }
    }
    star.unlimit(&slow_from);
    let stats = collect_stats(&http, &cluster).await;
    let topo = report::Topology {
        slow_path: format!("{slow_from}→{slow_to}"),
        slow_rate: a.slow_rate.clone(),
        degrade_path: "d0→p0".into(),
        degrade_rate: a.degrade_rate.clone(),
        router_addrs: cluster.router_addrs.map(IpAddr::V4).to_vec(),
    };
    let finished = report::finish(a, &topo, &runs, &stats, t_start);
    if a.hold && finished.is_ok() {
        hold::hold(a, star, &bins, &cluster, &logs, &http).await?;
    }
    drop(cluster);
    finished
}

/// Conversations (source files of this machine; nothing downloaded).
fn conversations(a: &ClusterArgs, tok: &TokenCounter) -> Result<Vec<Conversation>> {
    let corpus = agentic::SourceCorpus::discover(&agentic::default_source_roots(), 4000)
        .context("finding source files for the agentic conversations")?;
    let per = a.conversations.div_ceil(a.prefix_tokens.len().max(1));
    let spec = agentic::AgenticSpec {
        prefix_tokens: a.prefix_tokens.clone(),
        conversations_per_prefix: per,
        user_turns: a.turns,
        tool_output_tokens: a.tool_output_tokens,
        tool_output_fraction: a.tool_output_fraction,
        answer_tokens: a.answer_tokens,
        seed: a.seed,
    };
    let mut v = agentic::generate_agentic(&spec, &corpus, tok)?;
    // Interleave the prefix lengths (generated grouped by length).
    let k = a.prefix_tokens.len().max(1);
    let mut mixed = Vec::with_capacity(v.len());
    for i in 0..per {
        for j in 0..k {
            if let Some(c) = v.get_mut(j * per + i) {
                mixed.push(std::mem::replace(
                    c,
                    Conversation {
                        id: String::new(),
                        messages: Vec::new(),
                    },
                ));
            }
        }
    }
    mixed.truncate(a.conversations);
    Ok(mixed)
}

/// Every engine's `/sim/stats` at the end.
async fn collect_stats(http: &reqwest::Client, c: &Cluster) -> Vec<(String, Value)> {
    let mut v = Vec::new();
    for e in c.engines() {
        let s = get_json(http, &format!("{}/sim/stats", e.url))
            .await
            .unwrap_or(Value::Null);
        v.push((e.id.clone(), s));
    }
    v
}

mod run;
use super::workload::get_json;
use run::RunCtx;

/// Wall-clock time, Unix ms (the engines log in it too).
fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}
