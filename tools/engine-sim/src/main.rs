//! `kvloop-engine-sim`: run one simulated vLLM-protocol engine (P or D role).
//!
//! Prints one line `READY http=<addr> side_channel=<addr>` on stdout once both
//! listeners are bound, so a parent process can use port 0.
#![forbid(unsafe_code)]

use clap::Parser;
use kvloop_engine_sim::{SimConfig, spawn};
use std::io::Write;

#[derive(Parser)]
#[command(
    name = "kvloop-engine-sim",
    about = "vLLM-protocol engine simulator (P or D role)"
)]
struct Cli {
    #[command(flatten)]
    config: SimConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let h = spawn(cli.config).await?;
    println!(
        "READY http={} side_channel={}",
        h.http_addr, h.side_channel_addr
    );
    std::io::stdout().flush()?;
    tokio::signal::ctrl_c().await?;
    Ok(())
}
