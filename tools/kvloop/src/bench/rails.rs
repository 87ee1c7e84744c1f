//! `kvloop bench read --rails N`: READ throughput of the transfer engine
//! with 1, 2, 4 … N rails (libfabric endpoints, one per link), against the
//! one-rail throughput. With `--netns` every rail is a veth pair of its own
//! between the reader's and the target's namespaces, each limited by `tc`
//! to `--rail-rate` on the target's egress (what the reader READs), so one
//! rail is link-bound and N rails can reach N× it. Without `--netns` the
//! rails are loopback addresses 127.0.0.1, 127.0.0.2 … (no link limit: CPU
//! and memory bound).
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvloop_cli::engine_args::{BackendArg, EngineArgs, verify};
use kvloop_cli::netns::NodePair;
use kvloop_dataplane::BlockPair;
use serde::Serialize;

use super::{BenchReadArgs, kv_run, netns_inner, parse_size, pct, rerun_in_netns, spawn_target};

/// One row of the rails table.
#[derive(Debug, Serialize)]
pub struct RailRow {
    /// Rails (endpoints on each side).
    pub rails: usize,
    /// Throughput, GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// `gbps` over the one-rail row's.
    pub x_one_rail: f64,
    /// Share of the bytes each rail carried, first rail first (0 to 1).
    pub rail_shares: Vec<f64>,
    /// READ latency p50, ms.
    pub p50_ms: f64,
    /// READs measured.
    pub reads: usize,
}

/// The rail counts measured up to `max`: 1, 2, 4 … and `max`.
pub fn rail_counts(max: usize) -> Result<Vec<usize>> {
    if max == 0 || max > 16 {
        bail!("--rails {max}: expected 1 to 16");
    }
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n < max)
        .collect();
    v.push(max);
    Ok(v)
}

/// Entry point of `--rails`.
pub async fn run(args: BenchReadArgs, max: usize) -> Result<()> {
    let counts = rail_counts(max)?;
    let provider = args
        .provider
        .first()
        .cloned()
        .context("--provider: expected one provider with --rails")?;
    if args.netns && args.netns_inner.is_none() {
        // N veth pairs between two namespaces, each limited to the rate;
        // the bench re-runs inside A, the target goes to B.
        let tag = std::process::id() % 10_000;
        let pair = NodePair::create(tag)?;
        pair.limit_rate_b(&args.rail_rate)?;
        let (mut a, mut b) = (vec![pair.addr_a.to_string()], vec![pair.addr_b.to_string()]);
        for k in 1..max {
            let (x, y, dev) = pair.add_link(k as u32)?;
            pair.limit_rate_dev_b(&dev, &args.rail_rate)?;
            a.push(x.to_string());
            b.push(y.to_string());
        }
        return rerun_in_netns(pair, &a, &b);
    }
    let (ns_b, addrs_a, addrs_b) = match netns_inner(&args) {
        Some((ns_b, a, b)) => (Some(ns_b), a, b),
        None => {
            let lo: Vec<String> = (1..=max).map(|k| format!("127.0.0.{k}")).collect();
            (None, lo.clone(), lo)
        }
    };
    // shm has no addresses: one endpoint per rail, sources left to it.
    let bind = |addrs: &[String], n: usize| -> Vec<String> {
        if provider.starts_with("tcp") {
            addrs[..n].to_vec()
        } else {
            vec![String::new(); n]
        }
    };
    let block = parse_size(&args.rail_block)?;
    let bpr = args.rail_blocks_per_read.max(1);
    let link = match &ns_b {
        Some(_) => format!("one veth pair per rail, each limited to {}", args.rail_rate),
        None => "loopback addresses, no link limit".into(),
    };
    println!(
        "rails over {provider}: {link}; READs of {bpr} × {} B, {} in flight, {} ms per row",
        block, args.rail_outstanding, args.rail_ms
    );
    let mut rows: Vec<RailRow> = Vec::new();
    for &n in &counts {
        let row = measure(
            &args,
            &provider,
            (block, bpr),
            n,
            &ns_b,
            (&addrs_a, &addrs_b),
            &bind,
        )
        .await?;
        let row = RailRow {
            x_one_rail: rows.first().map_or(1.0, |one| row.gbps / one.gbps),
            ..row
        };
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    if !args.json {
        println!(
            "{:>5} {:>9} {:>11} {:>8} {:>7}  rail shares",
            "rails", "GB/s", "× one rail", "p50 ms", "READs"
        );
        for r in &rows {
            let shares: Vec<String> = r
                .rail_shares
                .iter()
                .map(|s| format!("{:.0}%", s * 100.0))
                .collect();
            println!(
                "{:>5} {:>9.3} {:>11.2} {:>8.2} {:>7}  {}",
                r.rails,
                r.gbps,
                r.x_one_rail,
                r.p50_ms,
                r.reads,
                shares.join(" ")
            );
        }
    }
    Ok(())
}

/// One row: a target with `n` rails in `ns_b` (or here), a reader with `n`
/// rails, READs for `--rail-ms`, checked byte for byte at the end.
async fn measure(
    args: &BenchReadArgs,
    provider: &str,
    (block, bpr): (u64, usize),
    n: usize,
    ns_b: &Option<String>,
    (addrs_a, addrs_b): (&[String], &[String]),
    bind: &dyn Fn(&[String], usize) -> Vec<String>,
) -> Result<RailRow> {
    let num_blocks = (2 * bpr) as u32;
    let eargs = EngineArgs {
        engine_id: "bench-reader".into(),
        listen: format!("{}:0", addrs_a[0]).parse()?,
        backend: BackendArg::Libfabric,
        provider: provider.to_string(),
        nixl_plugin: "UCX".into(),
        num_regions: 1,
        num_blocks,
        block_bytes: block,
        block_size_tokens: 16,
        fill_tag: 0,
        read_timeout_ms: 60_000,
        busy_poll: false,
        rails: bind(addrs_a, n),
    };
    let child_args = eargs.child_args_with_rails(
        "bench-target",
        &format!("{}:0", addrs_b[0]),
        7,
        &bind(addrs_b, n),
    );
    let target = spawn_target(ns_b.as_deref(), &child_args)?;
    let engine = eargs.start().await?;
    engine.connect(target.side_channel().parse()?).await?;
    let pairs: Vec<BlockPair> = (0..bpr as u64)
        .map(|i| BlockPair {
            remote: 2 * i,
            local: 2 * i + 1,
        })
        .collect();
    // Warm-up: every rail's connection is set up by its first READ.
    kv_run(&engine, &pairs, n, 2 * n, Duration::from_secs(20)).await?;
    let before = engine.rail_bytes();
    let (secs, lats) = kv_run(
        &engine,
        &pairs,
        args.rail_outstanding.max(1),
        usize::MAX / 2,
        Duration::from_millis(args.rail_ms),
    )
    .await?;
    let after = engine.rail_bytes();
    let (ok, bad) = verify(&engine, 7, &pairs);
    if bad > 0 {
        bail!(
            "{bad} of {} blocks differ from the target's after the READs",
            ok + bad
        );
    }
    let carried: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total = carried.iter().sum::<u64>().max(1) as f64;
    let mut sorted = lats.clone();
    sorted.sort_unstable();
    drop(engine);
    drop(target);
    Ok(RailRow {
        rails: n,
        gbps: lats.len() as f64 * (block * bpr as u64) as f64 / secs / 1e9,
        x_one_rail: 1.0,
        rail_shares: carried.iter().map(|&b| b as f64 / total).collect(),
        p50_ms: pct(&sorted, 0.5) / 1e3,
        reads: lats.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_counts_double_up_to_the_maximum() {
        assert_eq!(rail_counts(1).unwrap(), [1]);
        assert_eq!(rail_counts(4).unwrap(), [1, 2, 4]);
        assert_eq!(rail_counts(6).unwrap(), [1, 2, 4, 6]);
        assert!(rail_counts(0).is_err());
        assert!(rail_counts(17).is_err());
    }
}
