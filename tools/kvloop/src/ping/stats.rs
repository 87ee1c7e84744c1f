//! Pure parts of `kvloop ping`: latency statistics in the manner of
//! `ib_read_lat` (min, max, typical = median, average, stdev, 99 % and
//! 99.9 %), bandwidth as `ib_read_bw` reports it, and the adaptation of the
//! local layout to a peer's refusal.
use kvloop_dataplane::KvLayout;
use serde::Serialize;

/// Statistics of one row (one READ size), µs and GB/s.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Payload bytes per READ.
    pub bytes: u64,
    /// Blocks per READ.
    pub blocks: u32,
    /// Descriptors per READ (block pairs × regions, as the dataplane counts them).
    pub descriptors: u32,
    /// Segments posted per READ after coalescing adjacent blocks.
    pub segments: u32,
    /// READs that completed.
    pub reads: u64,
    /// READs that failed (timeouts, backend errors).
    pub failed: u64,
    /// Fastest READ, µs.
    pub min_us: f64,
    /// Slowest READ, µs.
    pub max_us: f64,
    /// Median READ (`t_typical` of `ib_read_lat`), µs.
    pub typical_us: f64,
    /// Mean READ, µs.
    pub avg_us: f64,
    /// Standard deviation, µs.
    pub stdev_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Completed bytes over the row's wall time, GB/s (10^9 B/s).
    pub bw_gbps: f64,
    /// Completed READs over the row's wall time, per second.
    pub reads_per_s: f64,
}

/// Nearest-rank percentile `q` in `[0, 1]` of sorted `v` (0 when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The row's statistics from its READ latencies (µs, any order), its
/// failures and its wall time (s).
#[allow(clippy::too_many_arguments)]
pub fn summarize(
    bytes: u64,
    blocks: u32,
    descriptors: u32,
    segments: u32,
    lat_us: &[f64],
    failed: u64,
    wall_s: f64,
) -> Summary {
    let mut v = lat_us.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let avg = if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / n
    };
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    let per_s = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
    Summary {
        bytes,
        blocks,
        descriptors,
        segments,
        reads: v.len() as u64,
        failed,
        min_us: v.first().copied().unwrap_or(0.0),
        max_us: v.last().copied().unwrap_or(0.0),
        typical_us: percentile(&v, 0.5),
        avg_us: avg,
        stdev_us: var.sqrt(),
        p99_us: percentile(&v, 0.99),
        p999_us: percentile(&v, 0.999),
        bw_gbps: per_s(n * bytes as f64) / 1e9,
        reads_per_s: per_s(n),
    }
}

/// Header of the table (columns of `ib_read_lat`, then `ib_read_bw`'s).
pub fn header() -> String {
    format!(
        "{:>10} {:>7} {:>6} {:>5} {:>7} {:>6} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "#bytes",
        "#blocks",
        "#desc",
        "#seg",
        "#reads",
        "#fail",
        "t_min[us]",
        "t_max[us]",
        "t_typical[us]",
        "t_avg[us]",
        "t_stdev[us]",
        "99%[us]",
        "99.9%[us]",
        "BW[GB/s]"
    )
}

/// One row of the table.
pub fn row(s: &Summary) -> String {
    format!(
        "{:>10} {:>7} {:>6} {:>5} {:>7} {:>6} {:>10.2} {:>10.2} {:>12.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>9.3}",
        s.bytes,
        s.blocks,
        s.descriptors,
        s.segments,
        s.reads,
        s.failed,
        s.min_us,
        s.max_us,
        s.typical_us,
        s.avg_us,
        s.stdev_us,
        s.p99_us,
        s.p999_us,
        s.bw_gbps
    )
}

/// The local layout to retry with after the peer refused ours with
/// `reason` (a handshake refusal carrying the peer's
/// `layout mismatch ...: field `F` is OURS there, THEIRS here`): `layout`
/// with field `F` set to the peer's value. `None` when the reason names
/// no layout field kvloop can adapt.
pub fn adapt_layout(layout: &KvLayout, reason: &str) -> Option<KvLayout> {
    let tail = reason.rsplit_once("layout mismatch")?.1;
    let field = tail.split('`').nth(3)?;
    let theirs = tail.rsplit_once(" there, ")?.1;
    let theirs: u64 = theirs.split_whitespace().next()?.parse().ok()?;
    let mut l = *layout;
    match field {
        "block_len_bytes" => l.block_len_bytes = theirs,
        "num_regions" => l.num_regions = u32::try_from(theirs).ok()?,
        "block_size_tokens" => l.block_size_tokens = u32::try_from(theirs).ok()?,
        _ => return None,
    }
    (l != *layout).then_some(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_moments_of_a_known_sample() {
        let lat: Vec<f64> = (1..=1000).map(f64::from).collect();
        let s = summarize(65536, 1, 2, 2, &lat, 3, 2.0);
        assert_eq!(s.min_us, 1.0);
        assert_eq!(s.max_us, 1000.0);
        assert_eq!(s.typical_us, 500.0);
        assert_eq!(s.p99_us, 990.0);
        assert_eq!(s.p999_us, 999.0);
        assert!((s.avg_us - 500.5).abs() < 1e-9);
        assert!((s.stdev_us - 288.8194).abs() < 1e-3, "{}", s.stdev_us);
        assert_eq!(s.reads, 1000);
        assert_eq!(s.failed, 3);
        // 1000 READs of 64 KiB in 2 s.
        assert!((s.bw_gbps - 1000.0 * 65536.0 / 2.0 / 1e9).abs() < 1e-12);
        assert_eq!(s.reads_per_s, 500.0);
        let e = summarize(1, 1, 1, 1, &[], 1, 0.0);
        assert_eq!((e.reads, e.avg_us, e.bw_gbps), (0, 0.0, 0.0));
    }

    #[test]
    fn a_layout_refusal_is_adapted_to_the_peer() {
        let l = KvLayout {
            num_regions: 2,
            num_blocks: 64,
            block_len_bytes: 65536,
            block_size_tokens: 16,
        };
        let reason = "handshake with 127.0.0.1:5600 failed: refused by peer: field \
                      `block_len_bytes`: layout mismatch with engine `ping.x`: field \
                      `block_len_bytes` is 65536 there, 4096 here";
        let a = adapt_layout(&l, reason).unwrap();
        assert_eq!(a.block_len_bytes, 4096);
        assert_eq!(a.num_regions, 2);
        let reason = "refused by peer: field `num_regions`: layout mismatch with engine \
                      `ping.x`: field `num_regions` is 2 there, 1 here";
        assert_eq!(adapt_layout(&l, reason).unwrap().num_regions, 1);
        assert_eq!(adapt_layout(&l, "connect: Connection refused"), None);
        let same = "layout mismatch with engine `x`: field `num_regions` is 2 there, 2 here";
        assert_eq!(adapt_layout(&l, same), None);
    }
}
