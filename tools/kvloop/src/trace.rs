//! `kvloop trace`: streams transfer and prefill events live from the eBPF
//! ring buffer (kvloop's READ sites in any process running a binary that
//! links the dataplane, NIXL's transfer-request calls in `libnixl.so`, and
//! prefill requests on configured ports), filtered by peer, direction and
//! minimum latency.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use kvloop_probes::{ProbeConfig, Probes, TraceFilter};

/// Flags of `kvloop trace`.
#[derive(Clone, Debug, Args)]
pub struct TraceArgs {
    /// Binaries whose READ sites to probe (every process running them).
    /// Default: the kvloop binaries next to this one (kvloop, kvloop-agent,
    /// kvloop-engine-sim) that exist.
    #[arg(long = "binary")]
    pub binaries: Vec<PathBuf>,
    /// Only this process id.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Also probe NIXL's transfer-request calls in this `libnixl.so`
    /// (default: the runtime from `scripts/bootstrap.sh nixl`, when present).
    #[arg(long)]
    pub nixl_lib: Option<PathBuf>,
    /// Do not probe NIXL.
    #[arg(long)]
    pub no_nixl: bool,
    /// Prefill server ports to time.
    #[arg(long = "prefill-port")]
    pub prefill_ports: Vec<u16>,
    /// Only events with this peer engine id.
    #[arg(long)]
    pub peer: Option<String>,
    /// Only this direction: d2p, p2d, probe, unknown.
    #[arg(long)]
    pub direction: Option<String>,
    /// Only events at least this slow, µs.
    #[arg(long)]
    pub min_latency_us: Option<u64>,
    /// Stop after this many seconds (default: until Ctrl-C).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Stop after this many events.
    #[arg(long)]
    pub count: Option<u64>,
}

/// Runs the trace.
pub async fn run(a: TraceArgs) -> Result<()> {
    let filter = TraceFilter::from_cli(a.peer.clone(), a.direction.as_deref(), a.min_latency_us)?;
    let probes = Probes::load(ProbeConfig {
        prefill_ports: a.prefill_ports.clone(),
        ..Default::default()
    })
    .context("loading the eBPF probes (needs root or CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN)")?;
    let mut bins = a.binaries.clone();
    if bins.is_empty() {
        let me = std::env::current_exe()?;
        let dir = me.parent().map(PathBuf::from).unwrap_or_default();
        for name in ["kvloop", "kvloop-agent", "kvloop-engine-sim"] {
            let p = dir.join(name);
            if p.exists() {
                bins.push(p);
            }
        }
    }
    for b in &bins {
        probes
            .attach_transfer_sites(b, a.pid)
            .with_context(|| format!("attaching READ sites in {}", b.display()))?;
        eprintln!("kvloop trace: READ sites in {}", b.display());
    }
    if !a.no_nixl {
        let lib = a
            .nixl_lib
            .clone()
            .unwrap_or_else(|| kvloop_dataplane::nixl::default_lib_dir().join("libnixl.so"));
        if lib.exists() {
            let syms = probes
                .attach_nixl(&lib, a.pid)
                .with_context(|| format!("attaching {}", lib.display()))?;
            eprintln!(
                "kvloop trace: NIXL {} ({} calls)",
                lib.display(),
                syms.len()
            );
        } else if a.nixl_lib.is_some() {
            anyhow::bail!("--nixl-lib {}: not found", lib.display());
        }
    }
    let mut stream = probes.trace(filter);
    let start = Instant::now();
    let mut n = 0u64;
    loop {
        if a.seconds
            .is_some_and(|s| start.elapsed() >= Duration::from_secs(s))
            || a.count.is_some_and(|c| n >= c)
        {
            break;
        }
        tokio::select! {
            ev = stream.next() => match ev {
                Some(ev) => {
                    println!("{}", ev.line());
                    n += 1;
                }
                None => break,
            },
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    if stream.lagged() > 0 {
        eprintln!(
            "kvloop trace: {} events dropped (ring buffer full or reader too slow)",
            stream.lagged()
        );
    }
    Ok(())
}
