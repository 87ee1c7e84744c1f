//! `--hold`: after its report, a demo keeps its nodes, agents, engines and a
//! router running so `kvloop doctor`, `kvloop ping` and `kvloop top` can be
//! pointed at a real loop (docs/operator-guide.md, "Troubleshooting").
//!
//! It writes `hold.json` under `--out-dir` (every node's namespace, agent
//! address and configuration, the routers, the engines, and the commands to
//! try), prints the same commands, and waits for Ctrl-C / SIGTERM or
//! `--hold-max-s`, whichever comes first; then the demo stops everything it
//! started as it does without `--hold`.
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

/// Set by SIGINT / SIGTERM once [`install_signals`] ran.
pub(super) static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Set while a demo holds: an interruption then ends the hold (a clean
/// stop, exit status 0) instead of failing the run.
pub(super) static HOLDING: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// SIGINT and SIGTERM set [`INTERRUPTED`] (the demo polls it, then stops
/// its children and removes its namespaces).
pub(super) fn install_signals() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// True when the demo was interrupted outside a hold (it must stop now).
pub(super) fn interrupted_outside_hold() -> bool {
    INTERRUPTED.load(Ordering::Relaxed) && !HOLDING.load(Ordering::Relaxed)
}

/// One node of a held demo.
#[derive(Clone, Debug, Serialize)]
pub(super) struct HeldNode {
    /// Node name (`node-a`, `p0`, ...).
    pub(super) name: String,
    /// Its network namespace; none on loopback.
    pub(super) netns: Option<String>,
    /// The argv prefix that runs a command on this node (empty on
    /// loopback): `nsenter --net=/run/netns/NS` where the node needs no
    /// `/etc/netns/NS` files (`ip netns exec` mounts a fresh sysfs, where
    /// tracefs is missing and doctor would report it), else `ip netns exec
    /// NS` (the cluster's nodes resolve the routers' name from
    /// `/etc/netns/NS/hosts`).
    pub(super) enter: Vec<String>,
    /// Its agent's HTTP address (`host:port`).
    pub(super) agent_http: String,
    /// Its agent's `agent.toml`.
    pub(super) agent_config: String,
}

/// What a held demo leaves running (`hold.json`).
#[derive(Clone, Debug, Serialize)]
pub(super) struct Held {
    /// The demo's PID (SIGTERM ends the hold).
    pub(super) pid: u32,
    /// The nodes with an agent.
    pub(super) nodes: Vec<HeldNode>,
    /// Router URLs (`http://host:port`), reachable from the first node's
    /// namespace.
    pub(super) routers: Vec<String>,
    /// Engines: `(engine_id, http URL)`.
    pub(super) engines: Vec<(String, String)>,
    /// Commands to try, each runnable as printed.
    pub(super) commands: Vec<String>,
}

impl Held {
    /// Fills [`Held::commands`]: doctor on the first node, ping from it to
    /// the second node's agent, top over every agent, explain of the first
    /// router's last turns (the demos' admin token), each entering the
    /// first node by [`HeldNode::enter`].
    pub(super) fn with_commands(mut self) -> Self {
        let exe = std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "kvloop".into());
        let on = |n: &HeldNode| {
            let mut v = n.enter.clone();
            v.push(exe.clone());
            v.join(" ")
        };
        let mut c = Vec::new();
        if let Some(first) = self.nodes.first() {
            c.push(format!(
                "{} doctor --config {}",
                on(first),
                first.agent_config
            ));
            if let Some(second) = self.nodes.get(1) {
                c.push(format!("{} ping {} -c 20", on(first), second.agent_http));
            }
            let agents: Vec<&str> = self.nodes.iter().map(|n| n.agent_http.as_str()).collect();
            let routers: Vec<String> = self
                .routers
                .iter()
                .map(|r| format!("--router {r}"))
                .collect();
            c.push(format!(
                "{} top {} {}",
                on(first),
                routers.join(" "),
                agents.join(" ")
            ));
            if let Some(r) = self.routers.first() {
                c.push(format!(
                    "{} explain --router {r} --token {} --last 5",
                    on(first),
                    super::cluster::ADMIN_TOKEN
                ));
            }
        }
        self.commands = c;
        self
    }
}

/// Writes `out_dir/hold.json`, prints what runs and the commands, and waits
/// until Ctrl-C / SIGTERM or `max_s` seconds.
///
/// # Errors
/// When `hold.json` cannot be written.
pub(super) async fn hold(out_dir: &Path, held: &Held, max_s: u64) -> Result<()> {
    HOLDING.store(true, Ordering::Relaxed);
    let path = out_dir.join("hold.json");
    std::fs::write(&path, serde_json::to_string_pretty(held)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!(
        "\nholding (up to {max_s} s; Ctrl-C or `kill {}` ends it):",
        held.pid
    );
    for n in &held.nodes {
        println!(
            "  {} agent {} (netns {}, config {})",
            n.name,
            n.agent_http,
            n.netns.as_deref().unwrap_or("-"),
            n.agent_config
        );
    }
    for r in &held.routers {
        println!("  router {r}");
    }
    println!("try:");
    for c in &held.commands {
        println!("  {c}");
    }
    println!("(written to {})", path.display());
    let end = Instant::now() + Duration::from_secs(max_s);
    while !INTERRUPTED.load(Ordering::Relaxed) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("hold ended: stopping everything the demo started");
    let _ = std::fs::remove_file(&path);
    Ok(())
}
