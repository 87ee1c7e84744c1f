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
//!
//! `--hold`: after the report, the loop keeps running for `kvloop doctor`,
//! `ping` and `top` ([`hold`]).
//!
//! The processes it starts log warnings and errors to `<out-dir>/logs`;
//! `KVLOOP_DEMO_LOG` sets another filter for them (`RUST_LOG` syntax, e.g.
//! `info` or `kvloop_agent=debug,warn`: [`child_log_filter`]).
//!
//! Files: [`topology`] (where the nodes are, the binaries), [`cluster`] (the
//! agents, engines and routers it starts), [`workload`] (the modes run
//! through the router), [`report`] (the table, `report.json`, the chart),
//! [`hold`] (`--hold`).
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_cli::netns::NodePair;

mod cluster;
mod hold;
mod report;
mod topology;
mod workload;
pub mod xpyd;

use topology::Topology;

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
    /// After the report, keep the nodes, agents, engines and the last
    /// mode's router running for `kvloop doctor` / `ping` / `top` (see
    /// `hold.json` under `--out-dir`) until Ctrl-C, SIGTERM or `--hold-max-s`.
    #[arg(long)]
    pub hold: bool,
    /// Bound on `--hold`, seconds.
    #[arg(long, default_value_t = 3600)]
    pub hold_max_s: u64,
}

/// Runs the demo (`slow_link`: the slow-link scenario). Blocking: it runs
/// its own tokio runtime on a thread placed in node A's namespace.
pub fn run(mut a: DemoArgs, slow_link: bool) -> Result<()> {
    if slow_link && a.out_dir == Path::new(DEFAULT_OUT_DIR) {
        // Keep the main demo's report next to this one.
        a.out_dir = a.out_dir.join("slow-link");
    }
    // Ctrl-C / SIGTERM set a flag the demo polls; dropping the demo future
    // then stops the children and removes the namespaces (during `--hold`
    // the flag ends the hold, and the demo stops as it would without one).
    hold::install_signals();
    // SAFETY: geteuid has no preconditions and cannot fail.
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
                    while !hold::interrupted_outside_hold() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                tokio::select! {
                    r = workload::run_async(&a, &topo, slow_link) => r,
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

/// Log filter of the processes a demo starts (`RUST_LOG` syntax):
/// `KVLOOP_DEMO_LOG` where set, else `warn`.
pub fn child_log_filter() -> String {
    std::env::var("KVLOOP_DEMO_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| "warn".into())
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
