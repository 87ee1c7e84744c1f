//! `kvloop demo dataplane`: two "nodes" (network namespaces joined by a veth
//! when root, loopback otherwise), a prefill engine P and a decode engine D
//! as separate `kvloop node` processes; D→P (next turn: P reads D's retained
//! blocks) and P→D (after a prefill: D reads P's fresh blocks) READs on each
//! backend, every block verified byte-exact.
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use kvloop_cli::child::NodeChild;
use kvloop_cli::engine_args::{BackendArg, EngineArgs};
use kvloop_cli::netns::NodePair;
use serde_json::json;

/// Flags of `kvloop demo dataplane`.
#[derive(Clone, Debug, Args)]
pub struct DemoDataplaneArgs {
    /// Use loopback even when root.
    #[arg(long)]
    pub loopback: bool,
    /// Blocks per READ.
    #[arg(long, default_value_t = 64)]
    pub blocks: u64,
    /// Bytes per block per region (Qwen3-32B: 16 tokens × 8 KV heads × 128 × 2 B = 32 KiB per layer half).
    #[arg(long, default_value_t = 32768)]
    pub block_bytes: u64,
    /// Regions (layers × K/V).
    #[arg(long, default_value_t = 8)]
    pub regions: u32,
}

/// Runs the demo; fails when any block mismatches.
pub fn run(a: DemoDataplaneArgs) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let pair = if root && !a.loopback {
        Some(NodePair::create(std::process::id() % 10_000)?)
    } else {
        None
    };
    let (ns_p, ns_d, ip_p, ip_d) = match &pair {
        Some(p) => (
            Some(p.ns_a.clone()),
            Some(p.ns_b.clone()),
            p.addr_a.to_string(),
            p.addr_b.to_string(),
        ),
        None => (None, None, "127.0.0.1".to_string(), "127.0.0.1".to_string()),
    };
    println!(
        "kvloop dataplane demo: node P {} / node D {} ({})",
        ip_p,
        ip_d,
        if pair.is_some() {
            "two network namespaces joined by a veth"
        } else {
            "loopback"
        }
    );
    let exe = std::env::current_exe()?;
    let mut backends = vec![("libfabric", "tcp;ofi_rxm"), ("nixl", "UCX")];
    if pair.is_none() {
        backends.insert(1, ("libfabric", "shm"));
    }
    println!(
        "{:<22} {:<5} {:>7} {:>10} {:>10} {:>9} {:>10}",
        "backend", "dir", "blocks", "bytes", "time µs", "GB/s", "verified"
    );
    let mut total_bad = 0u64;
    for (backend, provider) in backends {
        let nb = (2 * a.blocks).max(8);
        let engine = EngineArgs {
            engine_id: String::new(),
            listen: "127.0.0.1:0".parse()?,
            backend: if backend == "nixl" {
                BackendArg::Nixl
            } else {
                BackendArg::Libfabric
            },
            provider: if backend == "libfabric" {
                provider
            } else {
                "tcp;ofi_rxm"
            }
            .into(),
            nixl_plugin: if backend == "nixl" { provider } else { "UCX" }.into(),
            num_regions: a.regions,
            num_blocks: nb as u32,
            block_bytes: a.block_bytes,
            block_size_tokens: 16,
            fill_tag: 0,
            busy_poll: false,
            rails: Vec::new(),
            read_timeout_ms: 5000,
        };
        let args = |id: &str, ip: &str, tag: u64| -> Vec<String> {
            std::iter::once("node".to_string())
                .chain(engine.child_args(id, &format!("{ip}:0"), tag))
                .collect()
        };
        let cmd = |ns: &Option<String>, v: Vec<String>| {
            let mut c = match ns {
                Some(ns) => NodePair::command_in(ns, &exe),
                None => std::process::Command::new(&exe),
            };
            c.args(v);
            c
        };
        let mut d = NodeChild::spawn(cmd(&ns_d, args("decode-0", &ip_d, 2)))?;
        let mut p = NodeChild::spawn(cmd(&ns_p, args("prefill-0", &ip_p, 1)))?;
        p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))?;
        p.wait_event("connected", Duration::from_secs(20))?;
        std::thread::sleep(Duration::from_millis(100));
        // D→P: P reads the decode node's retained blocks 0..n (stride 1: contiguous runs).
        let d2p: Vec<_> = (0..a.blocks).map(|i| json!([i, a.blocks + i])).collect();
        p.send(
            &json!({"cmd": "read", "peer": "decode-0", "pairs": d2p, "direction": "d2p",
                       "notify": {"owner_request_id": "demo-turn-1", "count": 1}, "verify_tag": 2}),
        )?;
        let r1 = p.wait_event("read", Duration::from_secs(30))?;
        let n = d.wait_event("notification", Duration::from_secs(10))?;
        // P→D: D reads P's blocks 0..n into its blocks n..2n.
        let p2d: Vec<_> = (0..a.blocks).map(|i| json!([i, a.blocks + i])).collect();
        d.send(&json!({"cmd": "read", "peer": "prefill-0", "pairs": p2d, "direction": "p2d", "verify_tag": 1}))?;
        let r2 = d.wait_event("read", Duration::from_secs(30))?;
        for (dir, r) in [("D→P", &r1), ("P→D", &r2)] {
            if r["ok"] != true {
                bail!("{backend}/{provider} {dir} READ failed: {}", r["error"]);
            }
            let bytes = r["bytes"].as_u64().unwrap_or(0);
            let us = r["elapsed_us"].as_u64().unwrap_or(1).max(1);
            let bad = r["mismatched_blocks"].as_u64().unwrap_or(u64::MAX);
            total_bad += bad;
            println!(
                "{:<22} {:<5} {:>7} {:>10} {:>10} {:>9.2} {:>6}/{:<3}",
                format!("{backend}/{provider}"),
                dir,
                a.blocks,
                bytes,
                us,
                bytes as f64 / us as f64 / 1e3,
                r["verified_blocks"],
                a.blocks
            );
        }
        println!(
            "    owner notification at D: {} from {}",
            n["owner_request_id"], n["from"]
        );
    }
    drop(pair);
    if total_bad > 0 {
        bail!("{total_bad} blocks mismatched");
    }
    println!("all blocks verified byte-exact");
    Ok(())
}
