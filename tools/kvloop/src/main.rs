//! `kvloop`: operator and debugging CLI.
mod bench;
mod demo;
mod demo_dataplane;
mod explain;
mod multiturn;
mod node;
mod trace;

use kvloop_cli::{doctor, engine_args, ping, top};

use clap::{Parser, Subcommand};

/// kvloop: KV-cache transfers between prefill and decode nodes.
#[derive(Parser)]
#[command(name = "kvloop", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start-up; the size of the argument structs does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run one transfer engine driven by JSON-line commands on stdin.
    Node(engine_args::EngineArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Demos (real local runs); without a subcommand: `loop`.
    Demo(DemoCli),
    /// Why a (P, D) pair has its recompute threshold (asks the P node's agent), or (`--router`) why a router sent its last turns where it did.
    Explain(explain::ExplainArgs),
    /// Stream READ and prefill events live from the eBPF probes.
    Trace(trace::TraceArgs),
    /// Check this node against the known pitfalls (pass / warn / fail, with fixes).
    Doctor(doctor::DoctorArgs),
    /// READ latency and bandwidth against a peer agent's probe engine (ib_read_lat style).
    Ping(ping::PingArgs),
    /// Live view of agents: paths, probe READ latency, thresholds, router decisions.
    Top(top::TopArgs),
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct DemoCli {
    #[command(subcommand)]
    cmd: Option<DemoCmd>,
    #[command(flatten)]
    args: demo::DemoArgs,
}

#[derive(Subcommand)]
enum DemoCmd {
    /// The main demo: router, P and D engines with real KV, TTFT table OFF / fixed / adaptive.
    Loop(demo::DemoArgs),
    /// The main demo with the link slowed (tc tbf) mid-run.
    SlowLink(demo::DemoArgs),
    /// D→P and P→D READs between two local nodes, verified.
    Dataplane(demo_dataplane::DemoDataplaneArgs),
    /// An emulated xPyD cluster (2 P, 3 D, two router replicas on Redis,
    /// one slow path): round robin + fixed 64, round robin + adaptive and
    /// kvloop's selection side by side.
    Cluster(Box<demo::xpyd::ClusterArgs>),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// READ throughput/latency vs raw libfabric and memcpy.
    Read(Box<bench::BenchReadArgs>),
    /// Multi-turn chat load (vLLM multi_turn inputs or agentic conversations): TTFT table, JSON, PNG.
    Multiturn(Box<multiturn::BenchMultiturnArgs>),
}

fn main() -> anyhow::Result<()> {
    // NIXL/UCX read their environment at start-up: set it before any thread.
    // SAFETY: single-threaded here.
    unsafe { kvloop_dataplane::nixl::prepare_env(&kvloop_dataplane::nixl::default_lib_dir()) };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Node(a) => node::run(a).await,
            Cmd::Explain(a) => tokio::task::spawn_blocking(move || explain::run(a)).await?,
            Cmd::Trace(a) => trace::run(a).await,
            Cmd::Doctor(a) => std::process::exit(doctor::run(a).await?),
            Cmd::Ping(a) => std::process::exit(ping::run(a).await?),
            Cmd::Top(a) => std::process::exit(top::run(a).await?),
            Cmd::Bench(BenchCmd::Read(a)) => bench::run(*a).await,
            Cmd::Bench(BenchCmd::Multiturn(a)) => multiturn::run(*a).await,
            Cmd::Demo(DemoCli { cmd, args }) => match cmd {
                Some(DemoCmd::Dataplane(a)) => {
                    tokio::task::spawn_blocking(move || demo_dataplane::run(a)).await?
                }
                Some(DemoCmd::Cluster(a)) => {
                    tokio::task::spawn_blocking(move || demo::xpyd::run(*a)).await?
                }
                Some(DemoCmd::SlowLink(a)) => {
                    tokio::task::spawn_blocking(move || demo::run(a, true)).await?
                }
                Some(DemoCmd::Loop(a)) => {
                    tokio::task::spawn_blocking(move || demo::run(a, false)).await?
                }
                None => tokio::task::spawn_blocking(move || demo::run(args, false)).await?,
            },
        }
    })
}
