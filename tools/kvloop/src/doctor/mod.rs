//! `kvloop doctor`: checks a node against the known pitfalls of KV transfers
//! and prints pass / warn / fail with the fix for each (issue 16).
//!
//! [`gather`] collects [`facts::Facts`] (sysfs, procfs, `fi_info`, the
//! agent's `agent.toml` and HTTP API, its routers and peers, an eBPF attach
//! on `--pid`); [`checks`] turns them into verdicts without I/O. The exit
//! status is that of the worst result: 0 pass (or skip), 1 warn, 2 fail.
pub mod checks;
pub mod facts;
pub mod gather;

use std::path::PathBuf;

use clap::Args;

use checks::{Check, Level};

/// Flags of `kvloop doctor`.
#[derive(Clone, Debug, Args)]
pub struct DoctorArgs {
    /// The agent's `agent.toml`: backend, node address, peers, routers.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The local agent's HTTP address (`host:port`) for its side channels
    /// (`/v1/engines`); default: `http_listen` of `--config`.
    #[arg(long)]
    pub agent: Option<String>,
    /// An engine process to check: NIXL plugins it mapped, uprobes attachable.
    #[arg(long)]
    pub pid: Option<u32>,
    /// NIXL plugin directory (default: `NIXL_PLUGIN_DIR`).
    #[arg(long)]
    pub nixl_plugin_dir: Option<PathBuf>,
    /// Timeout of each HTTP request (agent, routers, peers), ms.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
    /// One JSON object (`{"worst": ..., "checks": [...]}`) instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// The printed report: one line per check, its fix indented below.
pub fn render(checks: &[Check]) -> String {
    let mut s = String::new();
    for c in checks {
        s.push_str(&format!(
            "[{}] {:<15} {}\n",
            c.level.word(),
            c.name,
            c.detail
        ));
        if let Some(f) = &c.fix {
            s.push_str(&format!("       {:<15} fix: {f}\n", ""));
        }
    }
    let w = checks::worst(checks);
    let n = |l: Level| checks.iter().filter(|c| c.level == l).count();
    s.push_str(&format!(
        "{} pass, {} warn, {} fail, {} skip: {}\n",
        n(Level::Pass),
        n(Level::Warn),
        n(Level::Fail),
        n(Level::Skip),
        match w {
            Level::Pass | Level::Skip => "healthy",
            Level::Warn => "works, with warnings",
            Level::Fail => "BROKEN",
        }
    ));
    s
}

/// Runs the checks and prints them; returns the exit status.
///
/// # Errors
/// An unreadable `--config`, or a failure to start the HTTP client.
pub async fn run(a: DoctorArgs) -> anyhow::Result<i32> {
    let facts = gather::gather(&a).await?;
    let checks = checks::all(&facts);
    let worst = checks::worst(&checks);
    if a.json {
        println!(
            "{}",
            serde_json::json!({"worst": worst, "exit_code": worst.exit_code(),
                               "checks": checks, "facts": facts})
        );
    } else {
        print!("{}", render(&checks));
    }
    Ok(worst.exit_code())
}
