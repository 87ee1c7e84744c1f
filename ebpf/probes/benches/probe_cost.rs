//! Probe overhead, side by side in one run (`cargo bench -p kvloop-probes`):
//!
//! 1. Per-call cost of the USDT-style NOP sites (`kvloop_probe_read_post` /
//!    `_done`) with no probe, with the kvloop uprobes attached, and detached
//!    again. Target: ≤ 1 µs per probed event.
//! 2. READ throughput through kvloop's dataplane (two engines in this
//!    process) at 64 KiB and 1 MiB on `tcp;ofi_rxm`, `shm` and NIXL (UCX),
//!    every probe detached vs what the agent attaches for its own READs
//!    (tracepoints + USDT sites), alternating rounds, with this process's
//!    CPU time per READ and the CPU the probes add per READ. Target: ≤ 1 %
//!    of a 64 KiB READ's CPU. On NIXL a third mode also attaches the
//!    observe-mode library probes (`postXferReq` / `getXferStatus`) to this
//!    process's own libnixl: they exist to time stock engines' READs, and
//!    every `getXferStatus` call traps, so a caller that polls it in a loop
//!    (kvloop's caller-driven progress) pays one trap per poll.
//!
//! `KVLOOP_BENCH_PROGRAMS=1` adds one row per BPF program that ran in each
//! attached mode (runs per READ, ns per run). `KVLOOP_BENCH_SITE_SAMPLE_EVERY` sets the READ-site sampling of small
//! READs (default 16, the agent's default; 1 probes every READ, as a process
//! that never sets it).
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
        weight: 1,
        _pad: [0; 4],
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
    println!("Each mode: 7 rounds of 10,000 READs, interleaved; min and median of the rounds");
    println!("(min = least disturbed by other tenants of the machine).\n");
    println!("| mode | calls | min ns/call | median ns/call | added per probed call (min) |");
    println!("|---|---:|---:|---:|---:|");
    site_cost(10_000); // warm-up
    let mut rows: Vec<(&str, Vec<f64>)> = vec![
        ("no probe attached", Vec::new()),
        ("empty BPF program (uprobe mechanism alone)", Vec::new()),
        ("kvloop programs, in-kernel histogram only", Vec::new()),
        (
            "kvloop programs, histogram + ring-buffer event per READ",
            Vec::new(),
        ),
    ];
    // histogram-only configuration: events sampled 1 in 1,000,000
    let sparse = probes.as_ref().and_then(|_| {
        Probes::load(ProbeConfig {
            xfer_sample_every: 1_000_000,
            prefill: false,
            retransmit: false,
            ..Default::default()
        })
        .ok()
    });
    if let Some(sp) = &sparse {
        sp.detach_all().unwrap();
    }
    for _ in 0..7 {
        rows[0].1.push(site_cost(10_000));
        if let (Some(p), Some(sp)) = (&probes, &sparse) {
            p.attach_calibration(&exe, Some(pid)).unwrap();
            site_cost(200);
            rows[1].1.push(site_cost(10_000));
            p.detach_all().unwrap();
            sp.attach_transfer_sites(&exe, Some(pid)).unwrap();
            site_cost(200);
            rows[2].1.push(site_cost(10_000));
            sp.detach_all().unwrap();
            p.attach_transfer_sites(&exe, Some(pid)).unwrap();
            site_cost(200);
            rows[3].1.push(site_cost(10_000));
            p.detach_all().unwrap();
        }
    }
    let stat = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (v[0], v[v.len() / 2])
    };
    let (base_min, _) = stat(&rows[0].1);
    // The uprobe mechanism alone (trap, return, an empty program), ns per hit.
    let mut trap_ns = if rows[1].1.is_empty() {
        0.0
    } else {
        stat(&rows[1].1).0 - base_min
    };
    for (name, v) in &rows {
        if v.is_empty() {
            continue;
        }
        let (mn, md) = stat(v);
        let added = if *name == rows[0].0 {
            "-".to_string()
        } else {
            format!("{:.0} ns", mn - base_min)
        };
        println!(
            "| {name} | {} | {mn:.1} | {md:.1} | {added} |",
            2 * 10_000 * v.len()
        );
    }
    drop(sparse);
    if let Some(p) = &probes {
        // time inside the programs alone (kernel BPF run-time statistics)
        if let Ok(_stats) = kvloop_probes::enable_run_time_stats() {
            let before = p.program_stats();
            p.attach_calibration(&exe, Some(pid)).unwrap();
            site_cost(20_000);
            p.detach_all().unwrap();
            p.attach_transfer_sites(&exe, Some(pid)).unwrap();
            site_cost(20_000);
            p.detach_all().unwrap();
            for (name, runs, ns) in stats_since(p, &before) {
                if name == "kvloop_noop" && runs > 0 {
                    // The empty program's own time is counted by the stats.
                    trap_ns = (trap_ns - ns as f64 / runs as f64).max(0.0);
                }
                if runs > 0 && (name.starts_with("kvloop_read") || name == "kvloop_noop") {
                    println!(
                        "| (time inside `{name}`, BPF stats) | {runs} | {:.1} | - | - |",
                        ns as f64 / runs as f64
                    );
                }
            }
        }
        println!("\n(target: ≤ 1000 ns added per probed call)");
    }

    let every: u32 = std::env::var("KVLOOP_BENCH_SITE_SAMPLE_EVERY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usdt::DEFAULT_SITE_SAMPLE_EVERY);
    usdt::set_site_sampling(every, usdt::DEFAULT_SITE_FULL_BYTES);
    println!("\n## READ throughput through the dataplane, probes detached vs attached\n");
    println!(
        "Site sampling: READs under {} KiB probed 1 in {every} (KVLOOP_BENCH_SITE_SAMPLE_EVERY; 1 = every READ).",
        usdt::DEFAULT_SITE_FULL_BYTES >> 10
    );
    println!(
        "CPU µs/READ: this process's CPU time (every thread, user + kernel, both engines) per READ."
    );
    println!(
        "Probe CPU accounted: uprobe hits × the trap cost measured above ({trap_ns:.0} ns, the empty program's own time taken out)\n\
         + time inside every program (kernel BPF run-time statistics), per READ and as a share of the detached CPU per READ.\n\
         CPU added, measured: median over paired rounds of attached − detached, and its share of detached (noisy on a shared machine).\n"
    );
    println!(
        "| backend | READ size | probes | READs | GiB/s | p50 µs | CPU µs/READ | probe CPU per READ, accounted | CPU added per READ, measured | throughput change |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let nixl_ok = nixl_dir.join("libnixl.so").exists();
    if std::env::var("KVLOOP_BENCH_SITES_ONLY").is_ok() {
        return;
    }
    for backend in ["tcp;ofi_rxm", "shm", "nixl"] {
        if backend == "nixl" && !nixl_ok {
            println!(
                "| nixl | - | - | - | - | - | - | - | runtime missing at {} |",
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
                (&exe, pid),
                &nixl_dir,
                trap_ns,
            ));
            if let Err(e) = r {
                println!("| {backend} | {size} | - | - | - | - | - | - | error: {e} |");
            }
        }
    }
}

/// Runs and ns inside each program since `before` (a
/// [`Probes::program_stats`] snapshot).
fn stats_since(p: &Probes, before: &[(String, u64, u64)]) -> Vec<(String, u64, u64)> {
    p.program_stats()
        .into_iter()
        .map(|(name, runs, ns)| {
            let (r0, n0) = before
                .iter()
                .find(|(n, _, _)| *n == name)
                .map_or((0, 0), |(_, r, t)| (*r, *t));
            (name, runs - r0, ns - n0)
        })
        .collect()
}

struct Round {
    reads: u64,
    bytes: u64,
    elapsed: Duration,
    lat_us: Vec<f64>,
    /// CPU time of this process (every thread, user + kernel) in the round.
    cpu: Duration,
}

impl Round {
    fn cpu_us_per_read(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.reads.max(1) as f64
    }
}

/// CPU time of this process, every thread (`CLOCK_PROCESS_CPUTIME_ID`):
/// uprobe traps and BPF programs run in the kernel on the probed thread, so
/// they are counted here.
fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

async fn throughput(
    backend: &str,
    size: u64,
    secs: f64,
    probes: Option<&Probes>,
    (exe, pid): (&std::path::Path, u32),
    nixl_dir: &std::path::Path,
    trap_ns: f64,
) -> anyhow::Result<()> {
    use kvloop_dataplane::fabric::FabricConfig;
    use kvloop_dataplane::nixl::NixlConfig;
    use kvloop_dataplane::{
        BackendConfig, BlockPair, EngineConfig, HostRegion, KvLayout, ReadRequest, TransferEngine,
    };
    let cfg = match backend {
        "nixl" => BackendConfig::Nixl(NixlConfig::default()),
        provider => BackendConfig::Libfabric(FabricConfig {
            provider: provider.into(),
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
        let cpu0 = process_cpu();
        let mut r = Round {
            reads: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
            lat_us: Vec::new(),
            cpu: Duration::ZERO,
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
        r.cpu = process_cpu() - cpu0;
        anyhow::Ok(r)
    };
    round(Duration::from_millis(200)).await?; // warm-up
    // What is attached in each mode: 0 nothing; 1 what the agent loads for
    // its own READs (tracepoints + the READ sites); 2 (NIXL) also the
    // observe-mode library probes on this process's libnixl, which the
    // NIXL backend polls (`getXferStatus`) while it drives a READ.
    let modes: &[&str] = if backend == "nixl" {
        &[
            "detached",
            "attached (tracepoints + sites)",
            "attached (+ NIXL lib, observe mode)",
        ]
    } else {
        &["detached", "attached (tracepoints + sites)"]
    };
    let attach = |mode: usize| -> anyhow::Result<()> {
        if let Some(pr) = probes {
            pr.detach_all()?;
            if mode >= 1 {
                pr.attach_tracepoints()?;
                pr.attach_transfer_sites(exe, Some(pid))?;
            }
            if mode >= 2 {
                pr.attach_nixl(nixl_dir.join("libnixl.so"), Some(pid))?;
            }
        }
        Ok(())
    };
    // ABAB… rounds (ABCABC… with three modes), 6 of each: the change is the
    // median of the per-round ratios to the detached round before it
    // (robust to drift in machine load).
    let n_modes = if probes.is_some() { modes.len() } else { 1 };
    let mut rounds: Vec<Vec<Round>> = (0..n_modes).map(|_| Vec::new()).collect();
    // Per mode and program: runs and ns inside it (BPF run-time
    // statistics; tracepoints count every process's hits).
    let mut per_program: Vec<std::collections::BTreeMap<String, (u64, u64)>> =
        vec![Default::default(); n_modes];
    let _stats = probes.and_then(|_| kvloop_probes::enable_run_time_stats().ok());
    let dur = Duration::from_secs_f64(secs / 6.0);
    for _ in 0..6 {
        for (m, rs) in rounds.iter_mut().enumerate() {
            attach(m)?;
            let before = probes.map(Probes::program_stats);
            rs.push(round(dur).await?);
            if let (Some(pr), Some(before)) = (probes, before) {
                for (name, runs, ns) in stats_since(pr, &before) {
                    let e = per_program[m].entry(name).or_default();
                    e.0 += runs;
                    e.1 += ns;
                }
            }
        }
    }
    attach(0)?;
    let summarize = |rs: &[Round]| {
        let reads: u64 = rs.iter().map(|r| r.reads).sum();
        let bytes: u64 = rs.iter().map(|r| r.bytes).sum();
        let el: f64 = rs.iter().map(|r| r.elapsed.as_secs_f64()).sum();
        let mut lat: Vec<f64> = rs.iter().flat_map(|r| r.lat_us.iter().copied()).collect();
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let p50 = lat.get(lat.len() / 2).copied().unwrap_or(0.0);
        let cpu: f64 = rs.iter().map(|r| r.cpu.as_secs_f64()).sum();
        (
            reads,
            bytes as f64 / el / (1u64 << 30) as f64,
            p50,
            cpu * 1e6 / reads.max(1) as f64,
        )
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (r0, g0, l0, c0) = summarize(&rounds[0]);
    println!(
        "| {backend} | {} KiB | detached | {r0} | {g0:.2} | {l0:.1} | {c0:.2} | - | - | - |",
        size / 1024
    );
    for (m, on) in rounds.iter().enumerate().skip(1) {
        let off = &rounds[0];
        let (r1, g1, l1, c1) = summarize(on);
        let med = median(
            off.iter()
                .zip(on)
                .map(|(a, b)| {
                    let ta = a.bytes as f64 / a.elapsed.as_secs_f64();
                    let tb = b.bytes as f64 / b.elapsed.as_secs_f64();
                    tb / ta
                })
                .collect(),
        );
        // CPU added per READ: median of the paired rounds' differences.
        let added_med = median(
            off.iter()
                .zip(on)
                .map(|(a, b)| b.cpu_us_per_read() - a.cpu_us_per_read())
                .collect(),
        );
        // Uprobe hits (each pays the trap) and ns inside every program.
        let (hits, prog_ns) = per_program[m]
            .iter()
            .fold((0, 0), |(u, t), (name, (runs, ns))| {
                let uprobe = name.starts_with("kvloop_read") || name.starts_with("nixl_");
                (u + if uprobe { *runs } else { 0 }, t + ns)
            });
        let acc_us = (hits as f64 * trap_ns + prog_ns as f64) / 1e3 / r1.max(1) as f64;
        println!(
            "| {backend} | {} KiB | {} | {r1} | {g1:.2} | {l1:.1} | {c1:.2} | {acc_us:.3} µs ({:.2} %; {:.2} uprobe hits/READ) | {added_med:+.2} µs ({:+.1} %) | {:+.1} % (median of {} paired rounds; all-rounds {:+.1} %) |",
            size / 1024,
            modes[m],
            acc_us / c0 * 100.0,
            hits as f64 / r1.max(1) as f64,
            added_med / c0 * 100.0,
            (med - 1.0) * 100.0,
            off.len(),
            (g1 / g0 - 1.0) * 100.0
        );
        if std::env::var_os("KVLOOP_BENCH_PROGRAMS").is_some() {
            for (name, (runs, ns)) in per_program[m].iter().filter(|(_, v)| v.0 > 0) {
                println!(
                    "|  |  | `{name}` | {runs} runs | {:.2} runs/READ | {:.0} ns/run | {:.3} µs/READ |  |  |  |",
                    *runs as f64 / r1.max(1) as f64,
                    *ns as f64 / *runs as f64,
                    *ns as f64 / 1e3 / r1.max(1) as f64
                );
            }
        }
    }
    Ok(())
}
