//! `kvloop-router`: the KV-cache-aware P/D router.
//!
//! `kvloop-router --config router.toml [--listen ADDR] [--admin-token T]
//! [--kv-recompute-threshold N] [--prefix-check tokens|history]`
//! Logs go to stderr (`RUST_LOG`, default `info`).
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvloop_router::config::{Policy, PrefixCheckMode};
use kvloop_router::{MonotonicClock, RouterConfig, start};
use tracing::info;

/// mimalloc instead of glibc's malloc: allocation and free were about a
/// sixth of the router's instructions per chat request under glibc
/// (callgrind, `scripts/router_instructions.sh`; docs/operator-guide.md,
/// "Router CPU").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvloop-router",
    about = "KV-cache-aware P/D router (vLLM-compatible)"
)]
struct Cli {
    /// TOML config file (see the `config` module docs); without it, defaults and no engines.
    #[arg(long, env = "KVLOOP_ROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// Listen address (overrides `listen`).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Admin bearer token (overrides `admin_token`).
    #[arg(long, env = "KVLOOP_ROUTER_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Static recompute threshold in tokens (overrides `kv_recompute_threshold`).
    #[arg(long)]
    kv_recompute_threshold: Option<u64>,
    /// Prefix safety check (overrides `prefix_check`).
    #[arg(long, value_enum)]
    prefix_check: Option<PrefixCheckMode>,
    /// Store capacity in conversations (overrides `store_capacity`).
    #[arg(long)]
    store_capacity: Option<usize>,
    /// Conversation store, `memory` or a Redis URL (overrides `store`).
    #[arg(long)]
    store: Option<String>,
    /// P/D selection policy (overrides `policy`).
    #[arg(long, value_enum)]
    policy: Option<Policy>,
    /// Worker threads of the runtime (overrides `worker_threads`).
    #[arg(long)]
    worker_threads: Option<usize>,
    /// Answer with `x-kvloop-route` (sets `route_header`).
    #[arg(long)]
    route_header: bool,
    /// Print the effective config as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let mut cfg = match &cli.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            RouterConfig::from_toml(&text).with_context(|| format!("in {}", p.display()))?
        }
        None => RouterConfig::default(),
    };
    if let Some(v) = cli.listen {
        cfg.listen = v;
    }
    if let Some(v) = cli.admin_token {
        cfg.admin_token = v;
    }
    if let Some(v) = cli.kv_recompute_threshold {
        cfg.kv_recompute_threshold = v;
    }
    if let Some(v) = cli.prefix_check {
        cfg.prefix_check = v;
    }
    if let Some(v) = cli.store_capacity {
        cfg.store_capacity = v;
    }
    if let Some(v) = cli.store {
        cfg.store = v;
    }
    if let Some(v) = cli.policy {
        cfg.policy = v;
    }
    if let Some(v) = cli.worker_threads {
        cfg.worker_threads = v;
    }
    cfg.route_header |= cli.route_header;
    if cli.print_config {
        print!("{}", toml::to_string(&cfg)?);
        return Ok(());
    }
    cfg.validate()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads)
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(serve(cfg))
}

/// Start the router and serve until SIGINT or SIGTERM.
async fn serve(cfg: RouterConfig) -> anyhow::Result<()> {
    let r = start(cfg.clone(), Box::new(MonotonicClock::default())).await?;
    info!(addr = %r.addr, engines = cfg.engines.len(), prefix_check = cfg.prefix_check.as_str(), "kvloop-router listening");
    println!("READY http={}", r.addr);
    shutdown_signal().await;
    info!("shutting down");
    Ok(())
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
