//! `kvloop-agent`: the per-node kvloop daemon.
//!
//! `kvloop-agent [--config agent.toml] [--agent-id ID] [--node-addr IP]
//! [--http-listen ADDR] [--socket PATH] [--provider P] [--router-token T] [--check]
//! [--print-config]`; every flag also reads a `KVLOOP_AGENT_*` environment
//! variable. Precedence: flag > environment > TOML > default. Logs to stderr
//! (`RUST_LOG`, default `info`; `--log-json` for JSON lines). On start it
//! prints `READY http=<addr> socket=<path>` on stdout. SIGTERM / SIGINT stop
//! it gracefully (servers stop accepting, engines are dropped, the socket is
//! removed).
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvloop_agent::{Agent, AgentConfig, caps, check, http, server, tasks};
use kvloop_dataplane::BackendConfig;

#[derive(Parser)]
#[command(name = "kvloop-agent", version, about = "kvloop per-node agent")]
struct Cli {
    /// TOML config (see the `config` module docs); without it, defaults.
    #[arg(long, env = "KVLOOP_AGENT_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `agent_id`.
    #[arg(long, env = "KVLOOP_AGENT_ID")]
    agent_id: Option<String>,
    /// Overrides `node_addr`.
    #[arg(long, env = "KVLOOP_AGENT_NODE_ADDR")]
    node_addr: Option<std::net::IpAddr>,
    /// Overrides `http_listen`.
    #[arg(long, env = "KVLOOP_AGENT_HTTP_LISTEN")]
    http_listen: Option<std::net::SocketAddr>,
    /// Overrides `socket_path`.
    #[arg(long, env = "KVLOOP_AGENT_SOCKET")]
    socket: Option<PathBuf>,
    /// Overrides the libfabric provider of `backend` (`tcp;ofi_rxm`, `shm`, `efa`).
    #[arg(long, env = "KVLOOP_AGENT_PROVIDER")]
    provider: Option<String>,
    /// Overrides `push_period_ms`.
    #[arg(long, env = "KVLOOP_AGENT_PUSH_PERIOD_MS")]
    push_period_ms: Option<u64>,
    /// Bearer token of every `routers[]` entry (overrides `routers[].token`;
    /// the Kubernetes DaemonSet passes it from the router's Secret).
    #[arg(long, env = "KVLOOP_AGENT_ROUTER_TOKEN", hide_env_values = true)]
    router_token: Option<String>,
    /// Overrides `require_ebpf`.
    #[arg(long, env = "KVLOOP_AGENT_REQUIRE_EBPF")]
    require_ebpf: Option<bool>,
    /// Print readiness JSON (backend, eBPF, privilege, socket dir) and exit;
    /// exit status 1 when a required part is missing.
    #[arg(long)]
    check: bool,
    /// Print the effective config as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Log JSON lines instead of text.
    #[arg(long, env = "KVLOOP_AGENT_LOG_JSON")]
    log_json: bool,
}

fn load_config(cli: &Cli) -> anyhow::Result<AgentConfig> {
    let mut cfg = match &cli.config {
        Some(p) => {
            let t =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            AgentConfig::parse_toml(&t).with_context(|| format!("in {}", p.display()))?
        }
        None => AgentConfig::default(),
    };
    if let Some(v) = &cli.agent_id {
        cfg.agent_id = v.clone();
    }
    if let Some(v) = cli.node_addr {
        cfg.node_addr = v;
    }
    if let Some(v) = cli.http_listen {
        cfg.http_listen = v;
    }
    if let Some(v) = &cli.socket {
        cfg.socket_path = v.clone();
    }
    if let Some(v) = &cli.provider {
        match &mut cfg.backend {
            BackendConfig::Libfabric(f) => f.provider = v.clone(),
            BackendConfig::Nixl(_) => {
                anyhow::bail!("--provider: the configured backend is NIXL, not libfabric")
            }
        }
    }
    if let Some(v) = cli.push_period_ms {
        cfg.push_period_ms = v;
    }
    if let Some(v) = cli.require_ebpf {
        cfg.require_ebpf = v;
    }
    if let Some(v) = &cli.router_token {
        cfg.set_router_token(v);
    }
    match &cli.config {
        Some(p) => cfg
            .validate()
            .with_context(|| format!("in {}", p.display()))?,
        None => cfg.validate()?,
    }
    Ok(cfg)
}

fn main() -> anyhow::Result<()> {
    // NIXL/UCX read their environment at start-up: set it before any thread.
    // SAFETY: single-threaded here.
    unsafe { kvloop_dataplane::nixl::prepare_env(&kvloop_dataplane::nixl::default_lib_dir()) };
    // libfabric's psm provider library (libinfinipath, loaded with libfabric)
    // installs a SIGTERM/SIGINT handler from its constructor that ends the
    // process; tokio's handler would chain to it and no graceful shutdown
    // would happen. Restore the default before tokio registers its own.
    // SAFETY: single-threaded here; plain sigaction resets.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    // netlink-packet-route warns about every attribute newer than itself,
    // once per link dump: silenced whatever RUST_LOG says, unless RUST_LOG
    // names it.
    let env = std::env::var("RUST_LOG").unwrap_or_default();
    let mut filter =
        tracing_subscriber::EnvFilter::try_new(if env.is_empty() { "info" } else { &env })
            .unwrap_or_else(|_| "info".into());
    if !env.contains("netlink_packet_route") {
        filter = filter.add_directive("netlink_packet_route=error".parse().expect("directive"));
    }
    if cli.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    let cfg = load_config(&cli)?;
    if cli.print_config {
        print!("{}", toml::to_string(&cfg)?);
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if cli.check {
        let report = rt.block_on(check::run(&cfg));
        println!("{}", serde_json::to_string_pretty(&report)?);
        std::process::exit(if report.ready { 0 } else { 1 });
    }
    // `run` exits the process itself after a graceful stop.
    rt.block_on(run(cfg))
}

async fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let probes = load_probes(&cfg).await?;
    if let Err(e) = cfg.check_side_channel_reachable() {
        tracing::warn!(error = %e, "engines' side channels unreachable from peers: registrations are refused (see --check)");
    }
    let agent = Agent::new(cfg.clone(), probes).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    agent.metrics().register(&mut registry);
    agent.probes().register_metrics(&mut registry);
    let listener = server::bind(&cfg.socket_path)?;
    let unix = tokio::spawn(server::serve(agent.clone(), listener));
    let tcp = tokio::net::TcpListener::bind(cfg.http_listen)
        .await
        .with_context(|| format!("binding http_listen {}", cfg.http_listen))?;
    let http_addr = tcp.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = http::router(agent.clone(), registry);
    let http_task = tokio::spawn(async move {
        let _ = axum::serve(tcp, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    let loops = tasks::spawn_all(&agent);
    tracing::info!(
        agent_id = %cfg.agent_id, http = %http_addr, socket = %cfg.socket_path.display(),
        probe_engine = ?agent.probe_engine().map(|e| e.side_channel_addr()),
        ebpf = agent.probes().source().label(), read_timing = agent.read_timing_label(),
        "kvloop-agent running"
    );
    println!(
        "READY http={http_addr} socket={}",
        cfg.socket_path.display()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    shutdown.await;
    tracing::info!("shutting down");
    // Stop accepting local and HTTP requests, remove the socket.
    unix.abort();
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), http_task).await;
    let _ = std::fs::remove_file(&cfg.socket_path);
    // The transfer engines are not dropped one by one: a probe or managed
    // READ may still be in flight inside a provider's progress thread, and
    // tearing its registrations down under it is what a process exit does
    // atomically (the kernel unmaps everything at once; peers see their side
    // channels close).
    std::mem::forget(loops);
    std::mem::forget(agent);
    tracing::info!("stopped");
    std::process::exit(0)
}

async fn load_probes(cfg: &AgentConfig) -> anyhow::Result<kvloop_probes::Probes> {
    kvloop_common::usdt::set_site_sampling(cfg.read_site_sample_every, cfg.read_site_full_bytes);
    let pc = kvloop_probes::ProbeConfig {
        transfer: true,
        prefill: !cfg.prefill_ports.is_empty(),
        retransmit: true,
        prefill_ports: cfg.prefill_ports.iter().map(|p| p.port).collect(),
        ..Default::default()
    };
    let probes = tokio::task::spawn_blocking(move || kvloop_probes::Probes::load(pc)).await?;
    let probes = match probes {
        Ok(p) => match p.attach_transfer_sites("/proc/self/exe", None) {
            Ok(()) => p,
            Err(e) => {
                let e = caps::explain(&e.to_string(), caps::Stage::Uprobe);
                if cfg.require_ebpf {
                    anyhow::bail!(
                        "require_ebpf: attaching READ probes to this process failed: {e}"
                    );
                }
                tracing::warn!(
                    error = %e,
                    "attaching READ probes to this process failed: user-space timing of this \
                     agent's READs (source=userspace)"
                );
                p
            }
        },
        Err(e) => {
            let e = caps::explain(&e.to_string(), caps::Stage::Load);
            if cfg.require_ebpf {
                anyhow::bail!("require_ebpf: eBPF probes do not load: {e}");
            }
            tracing::warn!(error = %e, "eBPF probes unavailable: user-space timing of this agent's READs");
            kvloop_probes::Probes::userspace(e)
        }
    };
    Ok(probes)
}

/// Registers SIGTERM/SIGINT handlers now; the future resolves on either.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
