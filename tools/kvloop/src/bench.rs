//! `kvloop bench read`: READ throughput and latency of the transfer engine,
//! side by side in the same run with (a) a raw libfabric READ loop on the
//! same provider and the same descriptor lists (no kvloop layers) and (b)
//! `memcpy` of the same bytes. The serving engine is a second process (in a
//! second network namespace with `--netns`).
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_common::Direction;
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::fabric::raw::RawReader;
use kvloop_dataplane::region::RegionDesc;
use kvloop_dataplane::{BlockPair, HostRegion, ReadRequest, TransferEngine};
use serde::Serialize;
use serde_json::json;

use kvloop_cli::child::NodeChild;
use kvloop_cli::engine_args::{BackendArg, EngineArgs};
use kvloop_cli::netns::NodePair;

/// Flags of `kvloop bench read`.
#[derive(Clone, Debug, Args)]
pub struct BenchReadArgs {
    /// libfabric providers to measure (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["tcp;ofi_rxm".to_string(), "shm".to_string()])]
    pub provider: Vec<String>,
    /// Also measure the NIXL backend with this plugin (no raw baseline).
    #[arg(long)]
    pub nixl: Option<String>,
    /// Block sizes, bytes (suffixes K, M).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["4K".to_string(), "16K".into(), "64K".into(), "256K".into(), "1M".into(), "4M".into(), "16M".into()])]
    pub block_sizes: Vec<String>,
    /// Blocks per READ.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 16])]
    pub blocks_per_read: Vec<usize>,
    /// READs in flight.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 8])]
    pub outstanding: Vec<usize>,
    /// Largest READ measured, bytes (rows above are skipped).
    #[arg(long, default_value_t = 64 << 20)]
    pub max_read_bytes: u64,
    /// Time budget per measurement, ms.
    #[arg(long, default_value_t = 400)]
    pub ms_per_run: u64,
    /// Serve from a second network namespace joined by a veth (root).
    #[arg(long)]
    pub netns: bool,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
    #[arg(long, hide = true)]
    pub netns_inner: Option<String>,
}

/// One row of the result.
#[derive(Debug, Serialize)]
pub struct Row {
    /// `libfabric` or `nixl`.
    pub backend: String,
    /// Provider or plugin.
    pub provider: String,
    /// Block size, bytes.
    pub block_bytes: u64,
    /// Blocks per READ.
    pub blocks_per_read: usize,
    /// READs in flight.
    pub outstanding: usize,
    /// kvloop engine throughput, GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// Raw libfabric loop throughput, GB/s; null for NIXL.
    pub raw_gbps: Option<f64>,
    /// gbps / raw_gbps.
    pub ratio: Option<f64>,
    /// memcpy of the same bytes, GB/s.
    pub memcpy_gbps: f64,
    /// kvloop READ latency p50, µs.
    pub p50_us: f64,
    /// kvloop READ latency p99, µs.
    pub p99_us: f64,
    /// READs measured in the kept kvloop run.
    pub reads: usize,
}

/// Parses `4K`, `16M`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num
        .parse::<u64>()
        .with_context(|| format!("block size `{s}`: expected a number with optional K/M/G"))?
        * mul)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn exe() -> Result<PathBuf> {
    std::env::current_exe().context("locating the kvloop binary")
}

/// Entry point.
pub async fn run(args: BenchReadArgs) -> Result<()> {
    if args.netns && args.netns_inner.is_none() {
        // Re-run this command inside node A's namespace; the target goes to B.
        let tag = std::process::id() % 10_000;
        let pair = NodePair::create(tag)?;
        let mut cmd = NodePair::command_in(&pair.ns_a, &exe()?);
        cmd.args(std::env::args().skip(1));
        cmd.args([
            "--netns-inner",
            &format!(
                "{}/{}/{}/{}",
                pair.ns_a, pair.ns_b, pair.addr_a, pair.addr_b
            ),
        ]);
        let st = cmd
            .status()
            .context("re-running the bench inside the namespace")?;
        drop(pair);
        if !st.success() {
            bail!("bench inside the namespace failed: {st}");
        }
        return Ok(());
    }
    let (ns_b, addr_a, addr_b) = match &args.netns_inner {
        Some(s) => {
            let p: Vec<&str> = s.split('/').collect();
            (Some(p[1].to_string()), p[2].to_string(), p[3].to_string())
        }
        None => (None, "127.0.0.1".to_string(), "127.0.0.1".to_string()),
    };
    let sizes = args
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>>>()?;
    let mut backends: Vec<(BackendArg, String)> = args
        .provider
        .iter()
        .map(|p| (BackendArg::Libfabric, p.clone()))
        .collect();
    if let Some(pl) = &args.nixl {
        backends.push((BackendArg::Nixl, pl.clone()));
    }
    let total_rows: usize = backends.len()
        * sizes
            .iter()
            .map(|&b| {
                args.blocks_per_read
                    .iter()
                    .filter(|&&n| b * n as u64 <= args.max_read_bytes)
                    .count()
            })
            .sum::<usize>()
        * args.outstanding.len();
    let bar = indicatif::ProgressBar::new(total_rows as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap());
    let mut rows = Vec::new();
    for (backend, provider) in &backends {
        for &block in &sizes {
            let bprs: Vec<usize> = args
                .blocks_per_read
                .iter()
                .copied()
                .filter(|&n| block * n as u64 <= args.max_read_bytes)
                .collect();
            let Some(&max_bpr) = bprs.iter().max() else {
                continue;
            };
            let num_blocks = (2 * max_bpr).max(2) as u32;
            let eargs = EngineArgs {
                engine_id: "bench-reader".into(),
                listen: format!("{addr_a}:0").parse()?,
                backend: *backend,
                provider: provider.clone(),
                nixl_plugin: provider.clone(),
                num_regions: 1,
                num_blocks,
                block_bytes: block,
                block_size_tokens: 16,
                fill_tag: 0,
                read_timeout_ms: 30_000,
                busy_poll: false,
            };
            let child_args = eargs.child_args("bench-target", &format!("{addr_b}:0"), 7);
            let mut cmd = match &ns_b {
                Some(ns) => NodePair::command_in(ns, &exe()?),
                None => std::process::Command::new(exe()?),
            };
            // The serving process polls continuously, so that kvloop and the
            // raw loop (which sends no read hints) READ from the same server.
            cmd.arg("node").args(&child_args).arg("--busy-poll");
            let target = NodeChild::spawn(cmd)?;
            let engine = eargs.start().await?;
            engine.connect(target.side_channel().parse()?).await?;
            let raw = match backend {
                BackendArg::Libfabric => {
                    let local = HostRegion::new("bench-raw", (num_blocks as u64 * block) as usize)?;
                    let md = engine
                        .peer_metadata("bench-target")
                        .context("target metadata")?;
                    let cfg = FabricConfig {
                        provider: provider.clone(),
                        bind_node: provider.starts_with("tcp").then(|| addr_a.clone()),
                        ..Default::default()
                    };
                    let r = RawReader::new(&cfg, RegionDesc::from(&local), &md.backend)?;
                    Some((r, local))
                }
                BackendArg::Nixl => None,
            };
            for &bpr in &bprs {
                for &out in &args.outstanding {
                    bar.set_message(format!("{provider} {block} B x{bpr} o{out}"));
                    let row = measure(
                        &engine,
                        raw.as_ref().map(|r| &r.0),
                        *backend,
                        provider,
                        block,
                        bpr,
                        out,
                        &args,
                    )
                    .await?;
                    if args.json {
                        println!("{}", serde_json::to_string(&row)?);
                    }
                    rows.push(row);
                    bar.inc(1);
                }
            }
            drop(target);
        }
    }
    bar.finish_and_clear();
    if !args.json {
        print_table(&rows);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    engine: &TransferEngine,
    raw: Option<&RawReader>,
    backend: BackendArg,
    provider: &str,
    block: u64,
    bpr: usize,
    outstanding: usize,
    args: &BenchReadArgs,
) -> Result<Row> {
    // Strided block ids (remote 0,2,4..; local 1,3,5..) so that no two
    // blocks coalesce: kvloop and raw post the same descriptor lists.
    let pairs: Vec<BlockPair> = (0..bpr as u64)
        .map(|i| BlockPair {
            remote: 2 * i,
            local: 2 * i + 1,
        })
        .collect();
    let bytes_per_read = block * bpr as u64;
    let budget = Duration::from_millis(args.ms_per_run);
    let max_reads = ((512u64 << 20) / bytes_per_read).clamp(16, 4000) as usize;
    // Warm-up.
    kv_run(engine, &pairs, 1, 4.min(max_reads), Duration::from_secs(5)).await?;
    let mut best: Option<(f64, Vec<Duration>)> = None;
    let mut raw_best: Option<f64> = None;
    for _ in 0..2 {
        let (secs, lats) = kv_run(engine, &pairs, outstanding, max_reads, budget).await?;
        let gbps = lats.len() as f64 * bytes_per_read as f64 / secs / 1e9;
        if best.as_ref().is_none_or(|(g, _)| gbps > *g) {
            best = Some((gbps, lats.clone()));
        }
        if let Some(raw) = raw {
            let limits = raw.limits();
            let chunk = limits.max_msg_bytes.max(4096);
            let mut one = Vec::new();
            for p in &pairs {
                let mut off = 0;
                while off < block {
                    let len = (block - off).min(chunk);
                    one.push((0u32, p.remote * block + off, p.local * block + off, len));
                    off += len;
                }
            }
            let n = lats.len().max(4);
            let reads = vec![one; n];
            let t = Instant::now();
            let r = tokio::task::block_in_place(|| {
                raw.run(&reads, outstanding, Duration::from_secs(10))
            })?;
            let g = r.len() as f64 * bytes_per_read as f64 / t.elapsed().as_secs_f64() / 1e9;
            raw_best = Some(raw_best.map_or(g, |b: f64| b.max(g)));
        }
    }
    let (gbps, mut lats) = best.unwrap();
    lats.sort_unstable();
    let memcpy_gbps = memcpy_gbps(bytes_per_read as usize);
    Ok(Row {
        backend: match backend {
            BackendArg::Libfabric => "libfabric".into(),
            BackendArg::Nixl => "nixl".into(),
        },
        provider: provider.to_string(),
        block_bytes: block,
        blocks_per_read: bpr,
        outstanding,
        gbps,
        raw_gbps: raw_best,
        ratio: raw_best.map(|r| gbps / r),
        memcpy_gbps,
        p50_us: pct(&lats, 0.50),
        p99_us: pct(&lats, 0.99),
        reads: lats.len(),
    })
}

/// Runs READs with `outstanding` in flight until `max_reads` or `budget`.
async fn kv_run(
    engine: &TransferEngine,
    pairs: &[BlockPair],
    outstanding: usize,
    max_reads: usize,
    budget: Duration,
) -> Result<(f64, Vec<Duration>)> {
    let issued = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..outstanding {
        let engine = engine.clone();
        let issued = issued.clone();
        let req = ReadRequest {
            peer_engine_id: "bench-target".into(),
            blocks: pairs.to_vec(),
            direction: Direction::DecodeToPrefill,
            notify: None,
            timeout_ms: Some(30_000),
        };
        tasks.push(tokio::spawn(async move {
            let mut lats = Vec::new();
            while issued.fetch_add(1, Ordering::Relaxed) < max_reads && start.elapsed() < budget {
                let t = Instant::now();
                engine.read(&req).await?;
                lats.push(t.elapsed());
            }
            anyhow::Ok(lats)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((start.elapsed().as_secs_f64(), all))
}

fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let reps = ((256usize << 20) / bytes).clamp(4, 10_000);
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    reps as f64 * bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn human(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}K", b >> 10)
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<10} {:<12} {:>6} {:>5} {:>4} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9}",
        "backend",
        "provider",
        "block",
        "blk/R",
        "out",
        "GB/s",
        "raw GB/s",
        "ratio",
        "memcpy",
        "p50 µs",
        "p99 µs"
    );
    for r in rows {
        println!(
            "{:<10} {:<12} {:>6} {:>5} {:>4} {:>9.3} {:>9} {:>6} {:>9.2} {:>9.1} {:>9.1}",
            r.backend,
            r.provider,
            human(r.block_bytes),
            r.blocks_per_read,
            r.outstanding,
            r.gbps,
            r.raw_gbps.map_or("-".into(), |g| format!("{g:.3}")),
            r.ratio.map_or("-".into(), |g| format!("{g:.2}")),
            r.memcpy_gbps,
            r.p50_us,
            r.p99_us
        );
    }
    let _ = json!({});
}
