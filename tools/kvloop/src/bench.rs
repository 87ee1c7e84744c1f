//! `kvloop bench read`: READ throughput and latency of the transfer engine,
//! side by side in the same run with (a) a raw loop on the same backend and
//! the same descriptor lists (no kvloop layers): raw libfabric on the same
//! provider, raw NIXL on the same plugin; and (b) `memcpy` of the same bytes. The serving engine is a second process (in a
//! second network namespace with `--netns`).
mod rails;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_common::Direction;
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::fabric::raw::RawReader;
use kvloop_dataplane::nixl::NixlConfig;
use kvloop_dataplane::nixl::raw::RawNixlReader;
use kvloop_dataplane::region::RegionDesc;
use kvloop_dataplane::{BlockPair, HostRegion, ReadRequest, TransferEngine};
use serde::Serialize;

use kvloop_cli::child::NodeChild;
use kvloop_cli::engine_args::{BackendArg, EngineArgs};
use kvloop_cli::netns::NodePair;

/// Flags of `kvloop bench read`.
#[derive(Clone, Debug, Args)]
pub struct BenchReadArgs {
    /// libfabric providers to measure (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["tcp;ofi_rxm".to_string(), "shm".to_string()])]
    pub provider: Vec<String>,
    /// Also measure the NIXL backend with this plugin (against a raw NIXL
    /// loop on the same plugin).
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
    /// vLLM-shaped rows instead of the block-size rows: KV registered per
    /// layer and per K/V, one region each, `LAYERSxKVxBYTES` (e.g. `64x2x4K`)
    /// or a preset: `qwen3-32b-tp8` (64 layers × K/V × 4 KiB: 16 tokens ×
    /// 1 KV head × 128 dims × 2 bytes per rank) or `qwen3-32b-tp1` (× 32 KiB,
    /// 8 KV heads); source: Qwen3-32B's `config.json` (64 layers, 8 KV heads,
    /// head_dim 128, bf16) and vLLM's block of 16 tokens.
    #[arg(long, value_delimiter = ',')]
    pub layout: Vec<String>,
    /// Blocks per READ of the `--layout` rows (each block is one descriptor
    /// per region).
    #[arg(long, value_delimiter = ',', default_values_t = vec![100usize, 500, 2000])]
    pub layout_blocks: Vec<usize>,
    /// Largest READ of the `--layout` rows, bytes (rows above are skipped).
    #[arg(long, default_value_t = 1 << 30)]
    pub max_layout_read_bytes: u64,
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
    /// Measure rails instead: READs over 1, 2, 4 … up to N libfabric rails
    /// (endpoints) on the first `--provider`, printed as rails | GB/s | ×
    /// one rail. With `--netns`, one veth pair per rail, each limited to
    /// `--rail-rate`; otherwise loopback addresses 127.0.0.1 … (no limit).
    #[arg(long)]
    pub rails: Option<usize>,
    /// `--rails --netns`: each rail's link rate (tc syntax), on the
    /// target's egress.
    #[arg(long, default_value = "400mbit")]
    pub rail_rate: String,
    /// `--rails`: block size, bytes (suffixes K, M).
    #[arg(long, default_value = "256K")]
    pub rail_block: String,
    /// `--rails`: blocks per READ.
    #[arg(long, default_value_t = 16)]
    pub rail_blocks_per_read: usize,
    /// `--rails`: READs in flight.
    #[arg(long, default_value_t = 4)]
    pub rail_outstanding: usize,
    /// `--rails`: time per row, ms.
    #[arg(long, default_value_t = 3000)]
    pub rail_ms: u64,
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
    /// The `--layout` of the row; null for the block-size rows.
    pub layout: Option<String>,
    /// Regions (layers × K/V for a layout; 1 otherwise).
    pub regions: u32,
    /// Block size per region, bytes.
    pub block_bytes: u64,
    /// Blocks per READ.
    pub blocks_per_read: usize,
    /// READs in flight.
    pub outstanding: usize,
    /// kvloop engine throughput, GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// Raw loop throughput (raw libfabric, or raw NIXL for the NIXL rows), GB/s.
    pub raw_gbps: Option<f64>,
    /// gbps / raw_gbps.
    pub ratio: Option<f64>,
    /// memcpy of the same bytes, GB/s.
    pub memcpy_gbps: f64,
    /// Descriptors (block × region) per READ.
    pub descriptors_per_read: u64,
    /// kvloop descriptors READ per second, millions.
    pub mdesc_per_s: f64,
    /// Raw loop descriptors READ per second, millions.
    pub raw_mdesc_per_s: Option<f64>,
    /// kvloop READ latency p50, µs.
    pub p50_us: f64,
    /// kvloop READ latency p99, µs.
    pub p99_us: f64,
    /// READs measured in the kept kvloop run.
    pub reads: usize,
    /// CPU time of this (reading) process per READ in the kept kvloop run,
    /// µs: every thread (tokio workers and the progress thread).
    pub cpu_us_per_read: f64,
    /// The same for the kept raw run (the kvloop engine's idle progress
    /// thread included).
    pub raw_cpu_us_per_read: Option<f64>,
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

/// One shape of READ rows: regions × block bytes, and the blocks per READ.
#[derive(Clone, Debug)]
struct Shape {
    layout: Option<String>,
    regions: u32,
    block_bytes: u64,
    blocks_per_read: Vec<usize>,
}

/// Parses a `--layout`: a preset or `LAYERSxKVxBYTES`; returns (regions,
/// block bytes per region).
pub fn parse_layout(s: &str) -> Result<(u32, u64)> {
    match s {
        "qwen3-32b-tp8" => return Ok((128, 4 << 10)),
        "qwen3-32b-tp1" => return Ok((128, 32 << 10)),
        _ => {}
    }
    let parts: Vec<&str> = s.split('x').collect();
    let [layers, kv, bytes] = parts.as_slice() else {
        bail!(
            "--layout `{s}`: expected qwen3-32b-tp8, qwen3-32b-tp1 or LAYERSxKVxBYTES (e.g. 64x2x4K)"
        );
    };
    let layers: u32 = layers
        .parse()
        .with_context(|| format!("--layout `{s}`: LAYERS must be a number"))?;
    let kv: u32 = kv
        .parse()
        .with_context(|| format!("--layout `{s}`: KV must be 1 (MLA) or 2 (K and V)"))?;
    if !(1..=2).contains(&kv) || layers == 0 {
        bail!("--layout `{s}`: expected LAYERS ≥ 1 and KV of 1 or 2");
    }
    Ok((layers * kv, parse_size(bytes)?))
}

pub(crate) fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

pub(crate) fn exe() -> Result<PathBuf> {
    std::env::current_exe().context("locating the kvloop binary")
}

/// Re-runs this command inside node A's namespace of `pair` (the target
/// goes to B), telling the inner run each side's addresses (one per rail)
/// through `--netns-inner=A/B/a1,a2…/b1,b2…`; the namespaces go when it ends.
pub(crate) fn rerun_in_netns(pair: NodePair, addrs_a: &[String], addrs_b: &[String]) -> Result<()> {
    let mut cmd = NodePair::command_in(&pair.ns_a, &exe()?);
    cmd.args(std::env::args().skip(1));
    cmd.arg(format!(
        "--netns-inner={}/{}/{}/{}",
        pair.ns_a,
        pair.ns_b,
        addrs_a.join(","),
        addrs_b.join(",")
    ));
    let st = cmd
        .status()
        .context("re-running the bench inside the namespace")?;
    drop(pair);
    if !st.success() {
        bail!("bench inside the namespace failed: {st}");
    }
    Ok(())
}

/// The serving `kvloop node` (in namespace `ns` when given) with
/// `child_args`. It polls continuously, so that kvloop and the raw loop
/// (which sends no read hints) READ from the same server.
pub(crate) fn spawn_target(ns: Option<&str>, child_args: &[String]) -> Result<NodeChild> {
    let mut cmd = match ns {
        Some(ns) => NodePair::command_in(ns, &exe()?),
        None => std::process::Command::new(exe()?),
    };
    cmd.arg("node").args(child_args).arg("--busy-poll");
    NodeChild::spawn(cmd)
}

/// What `--netns-inner` says: node B's namespace and each side's addresses.
pub(crate) fn netns_inner(args: &BenchReadArgs) -> Option<(String, Vec<String>, Vec<String>)> {
    let p: Vec<&str> = args.netns_inner.as_deref()?.split('/').collect();
    let list = |i: usize| p[i].split(',').map(str::to_string).collect::<Vec<_>>();
    Some((p[1].to_string(), list(2), list(3)))
}

/// Entry point.
pub async fn run(args: BenchReadArgs) -> Result<()> {
    if let Some(n) = args.rails {
        return rails::run(args, n).await;
    }
    if args.netns && args.netns_inner.is_none() {
        // Re-run this command inside node A's namespace; the target goes to B.
        let pair = NodePair::create(std::process::id() % 10_000)?;
        let (a, b) = (pair.addr_a.to_string(), pair.addr_b.to_string());
        return rerun_in_netns(pair, &[a], &[b]);
    }
    let (ns_b, addr_a, addr_b) = match netns_inner(&args) {
        Some((ns_b, a, b)) => (Some(ns_b), a[0].clone(), b[0].clone()),
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
    let shapes: Vec<Shape> = if args.layout.is_empty() {
        sizes
            .iter()
            .map(|&b| Shape {
                layout: None,
                regions: 1,
                block_bytes: b,
                blocks_per_read: args
                    .blocks_per_read
                    .iter()
                    .copied()
                    .filter(|&n| b * n as u64 <= args.max_read_bytes)
                    .collect(),
            })
            .collect()
    } else {
        args.layout
            .iter()
            .map(|l| {
                let (regions, b) = parse_layout(l)?;
                Ok(Shape {
                    layout: Some(l.clone()),
                    regions,
                    block_bytes: b,
                    blocks_per_read: args
                        .layout_blocks
                        .iter()
                        .copied()
                        .filter(|&n| regions as u64 * b * n as u64 <= args.max_layout_read_bytes)
                        .collect(),
                })
            })
            .collect::<Result<_>>()?
    };
    let total_rows: usize = backends.len()
        * shapes
            .iter()
            .map(|s| s.blocks_per_read.len())
            .sum::<usize>()
        * args.outstanding.len();
    let bar = indicatif::ProgressBar::new(total_rows as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap());
    let mut rows = Vec::new();
    for (backend, provider) in &backends {
        for shape in &shapes {
            let block = shape.block_bytes;
            let bprs = &shape.blocks_per_read;
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
                num_regions: shape.regions,
                num_blocks,
                block_bytes: block,
                block_size_tokens: 16,
                fill_tag: 0,
                read_timeout_ms: 30_000,
                busy_poll: false,
                rails: Vec::new(),
            };
            let child_args = eargs.child_args("bench-target", &format!("{addr_b}:0"), 7);
            let target = spawn_target(ns_b.as_deref(), &child_args)?;
            let engine = eargs.start().await?;
            engine.connect(target.side_channel().parse()?).await?;
            // The raw reader's one local buffer holds the regions back to back.
            let local = HostRegion::new(
                "bench-raw",
                (shape.regions as u64 * num_blocks as u64 * block) as usize,
            )?;
            let md = engine
                .peer_metadata("bench-target")
                .context("target metadata")?;
            let raw = match backend {
                BackendArg::Libfabric => {
                    let cfg = FabricConfig {
                        provider: provider.clone(),
                        bind_node: provider.starts_with("tcp").then(|| addr_a.clone()),
                        ..Default::default()
                    };
                    Raw::Fabric(RawReader::new(&cfg, RegionDesc::from(&local), &md.backend)?)
                }
                BackendArg::Nixl => {
                    let cfg = NixlConfig {
                        plugin: provider.clone(),
                        ..Default::default()
                    };
                    Raw::Nixl(RawNixlReader::new(
                        &cfg,
                        RegionDesc::from(&local),
                        &md.backend,
                    )?)
                }
            };
            for &bpr in bprs {
                for &out in &args.outstanding {
                    bar.set_message(format!(
                        "{provider} {}x{block} B x{bpr} o{out}",
                        shape.regions
                    ));
                    let row = measure(
                        &engine,
                        &raw,
                        (*backend, provider),
                        shape,
                        num_blocks,
                        (bpr, out),
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
            drop(raw);
            drop(local);
            drop(target);
        }
    }
    bar.finish_and_clear();
    if !args.json {
        print_table(&rows);
    }
    Ok(())
}

async fn measure(
    engine: &TransferEngine,
    raw: &Raw,
    (backend, provider): (BackendArg, &str),
    shape: &Shape,
    num_blocks: u32,
    (bpr, outstanding): (usize, usize),
    args: &BenchReadArgs,
) -> Result<Row> {
    let block = shape.block_bytes;
    let regions = shape.regions as u64;
    // Strided block ids (remote 0,2,4..; local 1,3,5..) so that no two
    // blocks coalesce: kvloop and raw post the same descriptor lists.
    let pairs: Vec<BlockPair> = (0..bpr as u64)
        .map(|i| BlockPair {
            remote: 2 * i,
            local: 2 * i + 1,
        })
        .collect();
    let descriptors = bpr as u64 * regions;
    let bytes_per_read = block * descriptors;
    let budget = Duration::from_millis(args.ms_per_run);
    // Bounded in count and time; small READs run for the time budget.
    let max_reads = ((512u64 << 20) / bytes_per_read).clamp(16, 200_000) as usize;
    // Warm-up.
    kv_run(engine, &pairs, 1, 4.min(max_reads), Duration::from_secs(5)).await?;
    let mut best: Option<(f64, Vec<Duration>, f64)> = None;
    let mut raw_best: Option<(f64, f64)> = None;
    for _ in 0..2 {
        let cpu0 = process_cpu();
        let (secs, lats) = kv_run(engine, &pairs, outstanding, max_reads, budget).await?;
        let cpu_us = (process_cpu() - cpu0).as_secs_f64() * 1e6 / lats.len().max(1) as f64;
        let gbps = lats.len() as f64 * bytes_per_read as f64 / secs / 1e9;
        if best.as_ref().is_none_or(|(g, _, _)| gbps > *g) {
            best = Some((gbps, lats.clone(), cpu_us));
        }
        // libfabric splits blocks at the provider's largest message; NIXL
        // takes whole blocks.
        let chunk = match raw {
            Raw::Fabric(r) => r.limits().max_msg_bytes.max(4096),
            Raw::Nixl(_) => block,
        };
        let mut one = Vec::new();
        for r in 0..regions {
            for p in &pairs {
                let mut off = 0;
                while off < block {
                    let len = (block - off).min(chunk);
                    let local = (r * num_blocks as u64 + p.local) * block + off;
                    one.push((r as u32, p.remote * block + off, local, len));
                    off += len;
                }
            }
        }
        let n = lats.len().max(4);
        let reads = vec![one; n];
        let cpu0 = process_cpu();
        let t = Instant::now();
        let r = tokio::task::block_in_place(|| match raw {
            Raw::Fabric(raw) => raw.run(&reads, outstanding, Duration::from_secs(10)),
            Raw::Nixl(raw) => raw.run(&reads, outstanding, Duration::from_secs(10)),
        })?;
        let g = r.len() as f64 * bytes_per_read as f64 / t.elapsed().as_secs_f64() / 1e9;
        let cpu_us = (process_cpu() - cpu0).as_secs_f64() * 1e6 / r.len().max(1) as f64;
        if raw_best.is_none_or(|(b, _)| g > b) {
            raw_best = Some((g, cpu_us));
        }
    }
    let (gbps, mut lats, cpu_us_per_read) = best.unwrap();
    let raw_cpu_us_per_read = raw_best.map(|(_, c)| c);
    let raw_best = raw_best.map(|(g, _)| g);
    lats.sort_unstable();
    let memcpy_gbps = memcpy_gbps(bytes_per_read as usize);
    Ok(Row {
        backend: match backend {
            BackendArg::Libfabric => "libfabric".into(),
            BackendArg::Nixl => "nixl".into(),
        },
        provider: provider.to_string(),
        layout: shape.layout.clone(),
        regions: shape.regions,
        block_bytes: block,
        blocks_per_read: bpr,
        outstanding,
        gbps,
        raw_gbps: raw_best,
        ratio: raw_best.map(|r| gbps / r),
        memcpy_gbps,
        descriptors_per_read: descriptors,
        mdesc_per_s: gbps * 1e9 / block as f64 / 1e6,
        raw_mdesc_per_s: raw_best.map(|g| g * 1e9 / block as f64 / 1e6),
        p50_us: pct(&lats, 0.50),
        p99_us: pct(&lats, 0.99),
        reads: lats.len(),
        cpu_us_per_read,
        raw_cpu_us_per_read,
    })
}

/// The baseline loop of a row's backend.
enum Raw {
    Fabric(RawReader),
    Nixl(RawNixlReader),
}

/// CPU time of this process, every thread (`CLOCK_PROCESS_CPUTIME_ID`).
fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Runs READs with `outstanding` in flight until `max_reads` or `budget`.
pub(crate) async fn kv_run(
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
        "{:<10} {:<12} {:>4} {:>6} {:>5} {:>4} {:>9} {:>9} {:>6} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "backend",
        "provider",
        "regs",
        "block",
        "blk/R",
        "out",
        "GB/s",
        "raw GB/s",
        "ratio",
        "Mdesc/s",
        "raw Md/s",
        "memcpy",
        "p50 µs",
        "p99 µs",
        "CPU µs/R",
        "raw CPU"
    );
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".into(), |g| format!("{g:.prec$}"));
    for r in rows {
        println!(
            "{:<10} {:<12} {:>4} {:>6} {:>5} {:>4} {:>9.3} {:>9} {:>6} {:>8.3} {:>8} {:>9.2} {:>9.1} {:>9.1} {:>8.1} {:>8}",
            r.backend,
            r.provider,
            r.regions,
            human(r.block_bytes),
            r.blocks_per_read,
            r.outstanding,
            r.gbps,
            opt(r.raw_gbps, 3),
            opt(r.ratio, 2),
            r.mdesc_per_s,
            opt(r.raw_mdesc_per_s, 3),
            r.memcpy_gbps,
            r.p50_us,
            r.p99_us,
            r.cpu_us_per_read,
            opt(r.raw_cpu_us_per_read, 1)
        );
    }
}
