//! `kvloop ping PEER`: READs of chosen sizes against a peer agent's probe
//! engine, with per-READ latency, percentiles and bandwidth in the manner of
//! `ib_read_lat` / `ib_read_bw` (issue 16).
//!
//! Standalone: kvloop starts its own transfer engine (kvloop-dataplane) on
//! the local address that routes to the peer, asks the peer agent's
//! `GET /v1/engines` for its probe engine's side channel (or takes
//! `--side-channel`), connects, and READs blocks `0..n` (or every other
//! block with `--strided`, so that no two blocks coalesce into one
//! segment). The local layout starts at the agent's probe default and
//! follows the peer's refusal when its layout differs. Bounded: at most
//! `--count` READs per size and `--deadline-s` in all.
pub mod stats;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_common::Direction;
use kvloop_dataplane::{BlockPair, KvLayout, ReadRequest, TransferEngine};
use serde_json::json;

use crate::engine_args::{BackendArg, EngineArgs};
use stats::Summary;

/// Most READs per size accepted by `--count`.
pub const MAX_COUNT: u64 = 100_000;

/// Flags of `kvloop ping`.
#[derive(Clone, Debug, Args)]
pub struct PingArgs {
    /// The peer agent's HTTP address (`host:port`, its `http_listen`).
    pub peer: Option<String>,
    /// READ from this side channel instead of the peer agent's probe engine.
    #[arg(long)]
    pub side_channel: Option<SocketAddr>,
    /// Blocks per READ, one row each (a block spans every region).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1u32, 8, 32])]
    pub blocks: Vec<u32>,
    /// Read every other block (one segment per block and region) instead of
    /// adjacent blocks (coalesced into one segment per region).
    #[arg(long)]
    pub strided: bool,
    /// READs per size (at most 100000).
    #[arg(short = 'c', long, default_value_t = 10)]
    pub count: u64,
    /// READs in flight (1: latency as ib_read_lat; more: bandwidth as ib_read_bw).
    #[arg(long, default_value_t = 1)]
    pub outstanding: usize,
    /// Pause between READs of one stream, ms.
    #[arg(long, default_value_t = 0)]
    pub interval_ms: u64,
    /// Stop every row after this many seconds in all.
    #[arg(long, default_value_t = 10.0)]
    pub deadline_s: f64,
    /// Timeout of one READ, ms.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
    /// Transfer backend (must match the peer's).
    #[arg(long, value_enum, default_value = "libfabric")]
    pub backend: BackendArg,
    /// libfabric provider (must match the peer's).
    #[arg(long, default_value = "tcp;ofi_rxm")]
    pub provider: String,
    /// NIXL plugin (with `--backend nixl`).
    #[arg(long, default_value = "LIBFABRIC")]
    pub nixl_plugin: String,
    /// Local side-channel address (default: the address that routes to the peer, any port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Only the summary table, no line per READ.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// JSON lines: one `read` object per READ (unless `--quiet`), one `summary` per size.
    #[arg(long)]
    pub json: bool,
}

/// The local address the kernel would use to reach `peer` (no packet sent).
fn route_to(peer: IpAddr) -> Result<IpAddr> {
    let bind: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let s = std::net::UdpSocket::bind(bind)?;
    s.connect((peer, 9))
        .with_context(|| format!("no route to {peer}"))?;
    Ok(s.local_addr()?.ip())
}

async fn probe_side_channel(agent: &str) -> Result<(String, SocketAddr)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()?;
    let info = crate::doctor::gather::engines(&client, agent)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let p = info.probe.with_context(|| {
        format!(
            "agent {} at {agent} runs no probe engine ([probe] enabled = false): \
             give --side-channel of one of its engines",
            info.agent_id
        )
    })?;
    Ok((info.agent_id, p.side_channel))
}

fn engine_args(a: &PingArgs, layout: &KvLayout, listen: SocketAddr) -> EngineArgs {
    EngineArgs {
        engine_id: format!("ping.{}.{}", hostname(), std::process::id()),
        listen,
        backend: a.backend,
        provider: a.provider.clone(),
        nixl_plugin: a.nixl_plugin.clone(),
        num_regions: layout.num_regions,
        num_blocks: layout.num_blocks,
        block_bytes: layout.block_len_bytes,
        block_size_tokens: layout.block_size_tokens,
        fill_tag: 0,
        busy_poll: false,
        rails: Vec::new(),
        read_timeout_ms: a.timeout_ms,
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "host".into())
}

/// Starts the local engine and connects, following layout refusals (at most
/// three: one per layout field).
async fn connect(
    a: &PingArgs,
    sc: SocketAddr,
    listen: SocketAddr,
    max_blocks: u32,
) -> Result<(
    TransferEngine,
    kvloop_dataplane::sidechannel::EngineMetadata,
)> {
    // The agent's probe layout by default (agent/src/config.rs ProbeConfig).
    let mut layout = KvLayout {
        num_regions: 2,
        num_blocks: max_blocks.max(1),
        block_len_bytes: 65536,
        block_size_tokens: 16,
    };
    for _ in 0..4 {
        let engine = engine_args(a, &layout, listen).start().await?;
        match engine.connect(sc).await {
            Ok(md) => return Ok((engine, md)),
            Err(e) => {
                let msg = e.to_string();
                match stats::adapt_layout(&layout, &msg) {
                    Some(l) => layout = l,
                    None => bail!("connecting to {sc}: {msg}"),
                }
            }
        }
    }
    bail!("connecting to {sc}: the peer kept refusing the layout")
}

fn pairs(blocks: u32, strided: bool) -> Vec<BlockPair> {
    let step = if strided { 2 } else { 1 };
    (0..blocks as u64)
        .map(|i| BlockPair {
            remote: i * step,
            local: i * step,
        })
        .collect()
}

/// Runs the READs; returns the exit status (0: every READ completed, 1:
/// some failed).
///
/// # Errors
/// Bad flags, an unreachable peer, a refused handshake.
pub async fn run(a: PingArgs) -> Result<i32> {
    if a.count == 0 || a.count > MAX_COUNT {
        bail!("--count {}: expected 1..={MAX_COUNT}", a.count);
    }
    if a.blocks.is_empty() || a.blocks.contains(&0) {
        bail!("--blocks: expected block counts >= 1");
    }
    if a.outstanding == 0 || a.outstanding > 64 {
        bail!("--outstanding {}: expected 1..=64", a.outstanding);
    }
    let (peer_name, sc) = match (&a.side_channel, &a.peer) {
        (Some(sc), _) => (sc.to_string(), *sc),
        (None, Some(p)) => probe_side_channel(p).await?,
        (None, None) => bail!("give PEER (the peer agent's host:port) or --side-channel"),
    };
    let listen = match a.listen {
        Some(l) => l,
        None => SocketAddr::new(route_to(sc.ip())?, 0),
    };
    let step = if a.strided { 2 } else { 1 };
    let max_blocks = a.blocks.iter().max().copied().unwrap_or(1) * step;
    let (engine, md) = connect(&a, sc, listen, max_blocks).await?;
    let l = *engine.layout();
    let head = format!(
        "kvloop ping {peer_name}: engine {} at {sc} from {}, backend {}; layout {} regions x {} B \
         blocks ({} blocks there)",
        md.engine_id,
        engine.side_channel_addr(),
        md.backend.describe(),
        l.num_regions,
        l.block_len_bytes,
        md.layout.num_blocks
    );
    if a.json {
        println!(
            "{}",
            json!({"event": "connected", "peer": peer_name, "engine_id": md.engine_id,
                   "side_channel": sc.to_string(), "backend": md.backend.describe(),
                   "num_regions": l.num_regions, "block_len_bytes": l.block_len_bytes,
                   "remote_blocks": md.layout.num_blocks})
        );
    } else {
        println!("{head}");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(a.deadline_s.max(0.0));
    let mut rows = Vec::new();
    let mut any_failed = false;
    for &n in &a.blocks {
        let p = pairs(n, a.strided);
        if n * step > md.layout.num_blocks {
            bail!(
                "--blocks {n}{}: the peer has {} blocks",
                if a.strided { " --strided" } else { "" },
                md.layout.num_blocks
            );
        }
        let segs = kvloop_dataplane::layout::segments(&l, &p).len() as u32;
        let s = run_row(&a, &engine, &md.engine_id, &p, segs, deadline).await;
        any_failed |= s.failed > 0;
        if a.json {
            let mut v = serde_json::to_value(&s)?;
            v["event"] = json!("summary");
            println!("{v}");
        }
        rows.push(s);
    }
    if !a.json {
        println!("{}", stats::header());
        for r in &rows {
            println!("{}", stats::row(r));
        }
    }
    Ok(i32::from(any_failed))
}

async fn run_row(
    a: &PingArgs,
    engine: &TransferEngine,
    peer: &str,
    pairs: &[BlockPair],
    segments: u32,
    deadline: Instant,
) -> Summary {
    let req = ReadRequest {
        peer_engine_id: peer.to_string(),
        blocks: pairs.to_vec(),
        direction: Direction::Probe,
        notify: None,
        timeout_ms: Some(a.timeout_ms),
    };
    // One warm-up READ (connection set-up, first registration touch).
    let _ = engine.read(&req).await;
    let issued = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.outstanding {
        let (engine, req, issued) = (engine.clone(), req.clone(), issued.clone());
        let (count, interval, quiet, json) = (a.count, a.interval_ms, a.quiet, a.json);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let (mut failed, mut desc, mut bytes) = (0u64, 0u32, 0u64);
            loop {
                let seq = issued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if seq >= count || Instant::now() >= deadline {
                    break;
                }
                let t = Instant::now();
                let r = engine.read(&req).await;
                let us = t.elapsed().as_secs_f64() * 1e6;
                match r {
                    Ok(o) => {
                        lat.push(us);
                        desc = o.descriptors;
                        bytes = o.bytes;
                        if !quiet {
                            print_read(json, seq + 1, o.bytes, us, &req.peer_engine_id, None);
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        if !quiet {
                            print_read(json, seq + 1, 0, us, &req.peer_engine_id, Some(&e));
                        }
                    }
                }
                if interval > 0 {
                    tokio::time::sleep(Duration::from_millis(interval)).await;
                }
            }
            (lat, failed, desc, bytes)
        }));
    }
    let (mut lat, mut failed, mut desc, mut bytes) = (Vec::new(), 0, 0, 0);
    for t in tasks {
        if let Ok((l, f, d, b)) = t.await {
            lat.extend(l);
            failed += f;
            desc = desc.max(d);
            bytes = bytes.max(b);
        }
    }
    let l = engine.layout();
    if bytes == 0 {
        bytes = pairs.len() as u64 * l.bytes_per_block_id();
        desc = pairs.len() as u32 * l.num_regions;
    }
    let wall = start.elapsed().as_secs_f64();
    stats::summarize(
        bytes,
        pairs.len() as u32,
        desc,
        segments,
        &lat,
        failed,
        wall,
    )
}

fn print_read(
    json: bool,
    seq: u64,
    bytes: u64,
    us: f64,
    peer: &str,
    err: Option<&kvloop_dataplane::DataplaneError>,
) {
    match (json, err) {
        (true, None) => println!(
            "{}",
            json!({"event": "read", "seq": seq, "ok": true, "bytes": bytes, "us": us})
        ),
        (true, Some(e)) => println!(
            "{}",
            json!({"event": "read", "seq": seq, "ok": false, "us": us, "error": e.to_string(),
                   "source": e.source_kind().to_string()})
        ),
        (false, None) => println!("{bytes} bytes from {peer}: read_seq={seq} time={us:.1} us"),
        (false, Some(e)) => {
            println!("read from {peer}: read_seq={seq} failed after {us:.1} us: {e}")
        }
    }
}
