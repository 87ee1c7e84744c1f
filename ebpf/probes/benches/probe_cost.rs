//! Probe overhead, side by side in one run (`cargo bench -p kvloop-probes`):
//!
//! 1. Per-call cost of the USDT-style NOP sites (`kvloop_probe_read_post` /
//!    `_done`) with no probe, with the kvloop uprobes attached, and detached
//!    again. Target: ≤ 1 µs per probed event.
//! 2. READ throughput through kvloop's dataplane (two engines in this
//!    process) at 64 KiB and 1 MiB, every probe detached vs attached
//!    (tracepoints + USDT sites, + NIXL library probes on the NIXL backend),
//!    alternating rounds. Target: ≤ 1 % loss at ≥ 64 KiB.
//!
//! Needs root for the attached rows (prints why and only the detached rows
//! otherwise). `KVLOOP_BENCH_SECS` sets the seconds per throughput round
//! (default 1.0). NIXL needs the runtime (`scripts/bootstrap.sh nixl`).
use std::time::{Duration, Instant};

use kvloop_common::{BackendKind, Direction, ReadProbeArgs, usdt};
use kvloop_probes::{ProbeConfig, Probes};

fn site_cost(pairs: u64) -> f64 {
    let mut a = ReadProbeArgs {
        xfer_id: 0,
        bytes: 65536,
        descriptors: 1,
        direction: Direction::PrefillToDecode as u8,
        backend: BackendKind::Libfabric as u8,
        status: 0,
        peer: ReadProbeArgs::peer_from_str("bench"),
    };
    let t = Instant::now();
    for i in 0..pairs {
        a.xfer_id = i;
        usdt::read_post(&a);
        usdt::read_done(&a);
    }
    t.elapsed().as_nanos() as f64 / (2 * pairs) as f64
}

fn main() {
    let nixl_dir = kvloop_dataplane::nixl::default_lib_dir();
    // SAFETY: first thing in main, no other thread yet.
    unsafe { kvloop_dataplane::nixl::prepare_env(&nixl_dir) };
    let secs: f64 = std::env::var("KVLOOP_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);

    let probes = match Probes::load(ProbeConfig::default()) {
        Ok(p) => Some(p),
        Err(e) => {
            println!("eBPF probes unavailable ({e}): attached rows skipped");
            None
        }
    };
    if let Some(p) = &probes {
        p.detach_all().unwrap();
    }
    let exe = std::fs::canonicalize("/proc/self/exe").unwrap();
    let pid = std::process::id();

    println!("\n## USDT NOP sites: cost per call (one READ = 2 calls)\n");
    println!("| mode | calls | ns per call | added per probed call |");
    println!("|---|---:|---:|---:|");
    site_cost(10_000); // warm-up
    let base = site_cost(1_000_000);
    println!("| no probe attached | {} | {base:.1} | - |", 2_000_000);
    if let Some(p) = &probes {
        p.attach_calibration(&exe, Some(pid)).unwrap();
        site_cost(1_000);
        let att = site_cost(50_000);
        println!(
            "| empty BPF program attached (uprobe mechanism alone) | {} | {att:.1} | {:.1} ns |",
            100_000,
            att - base
        );
        p.detach_all().unwrap();
        // histogram only: events sampled 1 in 1,000,000 (a second load)
        let sparse = Probes::load(ProbeConfig {
            xfer_sample_every: 1_000_000,
            prefill: false,
            retransmit: false,
            ..Default::default()
        })
        .unwrap();
        sparse.attach_transfer_sites(&exe, Some(pid)).unwrap();
        site_cost(1_000);
        let att = site_cost(50_000);
        println!(
            "| kvloop uprobes attached, in-kernel histogram only | {} | {att:.1} | {:.1} ns |",
            100_000,
            att - base
        );
        drop(sparse);
        p.attach_transfer_sites(&exe, Some(pid)).unwrap();
        site_cost(1_000);
        let att = site_cost(50_000);
        println!(
            "| kvloop uprobes attached, histogram + ring-buffer event per READ | {} | {att:.1} | {:.1} ns |",
            100_000,
            att - base
        );
        if std::env::var("KVLOOP_BENCH_DEBUG").is_ok() {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
            for l in maps.lines().filter(|l| l.contains("uprobe")) {
                println!("maps: {l}");
            }
            let f = kvloop_common::usdt::kvloop_probe_read_post as *const u8;
            // SAFETY: reading our own code bytes
            println!("site bytes: {:02x?} at {f:p}", unsafe {
                std::slice::from_raw_parts(f, 6)
            });
        }
        p.detach_all().unwrap();
        let again = site_cost(1_000_000);
        // time inside the programs alone (kernel BPF run-time statistics)
        if let Ok(_stats) = kvloop_probes::enable_run_time_stats() {
            p.attach_transfer_sites(&exe, Some(pid)).unwrap();
            site_cost(20_000);
            p.detach_all().unwrap();
            for (name, runs, ns) in p.program_stats() {
                if runs > 0 && name.starts_with("kvloop_read") {
                    println!(
                        "| (in-program time of `{name}`) | {runs} | - | {:.1} ns |",
                        ns as f64 / runs as f64
                    );
                }
            }
        }
        println!("| detached again | {} | {again:.1} | - |", 2_000_000);
        let snap = p.snapshot();
        let seen: u64 = snap
            .counters
            .iter()
            .filter(|(n, _)| *n == "xfer_samples")
            .map(|(_, v)| v)
            .sum();
        println!(
            "\n(kernel counted {seen} READs while attached; target ≤ 1000 ns added per probed call)"
        );
    }

    println!("\n## READ throughput through the dataplane, probes detached vs attached\n");
    println!("| backend | READ size | probes | READs | GiB/s | p50 µs | change |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let nixl_ok = nixl_dir.join("libnixl.so").exists();
    if std::env::var("KVLOOP_BENCH_SITES_ONLY").is_ok() {
        return;
    }
    for backend in ["shm", "nixl"] {
        if backend == "nixl" && !nixl_ok {
            println!(
                "| nixl | - | - | - | - | - | runtime missing at {} |",
                nixl_dir.display()
            );
            continue;
        }
        for size in [64 * 1024u64, 1024 * 1024] {
            let r = rt.block_on(throughput(
                backend,
                size,
                secs,
                probes.as_ref(),
                &exe,
                pid,
                &nixl_dir,
            ));
            if let Err(e) = r {
                println!("| {backend} | {size} | - | - | - | - | error: {e} |");
            }
        }
    }
}

struct Round {
    reads: u64,
    bytes: u64,
    elapsed: Duration,
    lat_us: Vec<f64>,
}

async fn throughput(
    backend: &str,
    size: u64,
    secs: f64,
    probes: Option<&Probes>,
    exe: &std::path::Path,
    pid: u32,
    nixl_dir: &std::path::Path,
) -> anyhow::Result<()> {
    use kvloop_dataplane::fabric::FabricConfig;
    use kvloop_dataplane::nixl::NixlConfig;
    use kvloop_dataplane::{
        BackendConfig, BlockPair, EngineConfig, HostRegion, KvLayout, ReadRequest, TransferEngine,
    };
    let cfg = match backend {
        "nixl" => BackendConfig::Nixl(NixlConfig::default()),
        _ => BackendConfig::Libfabric(FabricConfig {
            provider: "shm".into(),
            ..Default::default()
        }),
    };
    let layout = KvLayout {
        num_regions: 1,
        num_blocks: 16,
        block_len_bytes: size,
        block_size_tokens: 16,
    };
    let mut engines = Vec::new();
    for id in ["bench-p", "bench-d"] {
        let regions = vec![HostRegion::new(
            &format!("{id}-{size}"),
            layout.region_len_bytes() as usize,
        )?];
        engines.push(
            TransferEngine::start(
                EngineConfig {
                    engine_id: id.into(),
                    side_channel_addr: "127.0.0.1:0".parse().unwrap(),
                    backend: cfg.clone(),
                    layout,
                    read_timeout_ms: 10_000,
                    handshake_timeout_ms: 10_000,
                },
                regions,
            )
            .await?,
        );
    }
    let (p, d) = (&engines[0], &engines[1]);
    p.connect(d.side_channel_addr()).await?;
    let round = |dur: Duration| async move {
        let t = Instant::now();
        let mut r = Round {
            reads: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
            lat_us: Vec::new(),
        };
        while t.elapsed() < dur {
            let i = r.reads;
            let t1 = Instant::now();
            let out = p
                .read(&ReadRequest {
                    peer_engine_id: "bench-d".into(),
                    blocks: vec![BlockPair {
                        remote: i % 16,
                        local: (i + 3) % 16,
                    }],
                    direction: Direction::DecodeToPrefill,
                    notify: None,
                    timeout_ms: None,
                })
                .await?;
            r.lat_us.push(t1.elapsed().as_secs_f64() * 1e6);
            r.reads += 1;
            r.bytes += out.bytes;
        }
        r.elapsed = t.elapsed();
        anyhow::Ok(r)
    };
    round(Duration::from_millis(200)).await?; // warm-up
    let attach = |on: bool| -> anyhow::Result<()> {
        if let Some(pr) = probes {
            pr.detach_all()?;
            if on {
                pr.attach_tracepoints()?;
                pr.attach_transfer_sites(exe, Some(pid))?;
                if backend == "nixl" {
                    pr.attach_nixl(nixl_dir.join("libnixl.so"), Some(pid))?;
                }
            }
        }
        Ok(())
    };
    // ABAB rounds: detached, attached, detached, attached
    let mut off = Vec::new();
    let mut on = Vec::new();
    let dur = Duration::from_secs_f64(secs / 2.0);
    for _ in 0..2 {
        attach(false)?;
        off.push(round(dur).await?);
        if probes.is_some() {
            attach(true)?;
            on.push(round(dur).await?);
        }
    }
    attach(false)?;
    let summarize = |rs: &[Round]| {
        let reads: u64 = rs.iter().map(|r| r.reads).sum();
        let bytes: u64 = rs.iter().map(|r| r.bytes).sum();
        let el: f64 = rs.iter().map(|r| r.elapsed.as_secs_f64()).sum();
        let mut lat: Vec<f64> = rs.iter().flat_map(|r| r.lat_us.iter().copied()).collect();
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let p50 = lat.get(lat.len() / 2).copied().unwrap_or(0.0);
        (reads, bytes as f64 / el / (1u64 << 30) as f64, p50)
    };
    let (r0, g0, l0) = summarize(&off);
    println!(
        "| {backend} | {} KiB | detached | {r0} | {g0:.2} | {l0:.1} | - |",
        size / 1024
    );
    if !on.is_empty() {
        let (r1, g1, l1) = summarize(&on);
        let what = if backend == "nixl" {
            "attached (tracepoints + sites + NIXL lib)"
        } else {
            "attached (tracepoints + sites)"
        };
        println!(
            "| {backend} | {} KiB | {what} | {r1} | {g1:.2} | {l1:.1} | {:+.1} % |",
            size / 1024,
            (g1 / g0 - 1.0) * 100.0
        );
    }
    Ok(())
}
