//! The demo's summary: rows per mode and prompt-length bucket, the TTFT
//! table, `report.json` and the chart.
use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvloop_loadgen::{chart, report};
use serde_json::{Value, json};

use super::DemoArgs;
use super::topology::Topology;

/// One row of `report.json` (`rows`): one mode at one prompt-length bucket.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    /// `OFF`, `fixed` or `adaptive`.
    pub mode: String,
    /// Median prompt tokens of the bucket's requests (client count, cl100k).
    pub prompt_tokens: u64,
    /// Bucket lower edge, tokens.
    pub bucket_lo_tokens: u64,
    /// Requests in the bucket (errors included).
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Median TTFT, ms.
    pub ttft_ms_p50: Option<f64>,
    /// Median D→P READ time (claim + transfer) of the bucket's reuses, ms.
    pub transfer_ms_p50: Option<f64>,
    /// Median P→D READ time, ms.
    pub p2d_transfer_ms_p50: Option<f64>,
    /// Recompute threshold in force (router static or agent-pushed), tokens.
    pub threshold_tokens: Option<u64>,
}

/// Everything the demo measured, filled in mode by mode.
pub(super) struct Summary {
    /// The load generator's report (every mode's run).
    pub(super) rep: report::Report,
    /// Threshold in force per mode (router static or agent-pushed), tokens.
    pub(super) thresholds: BTreeMap<String, Option<u64>>,
    /// New READ-log entries per mode: (P's, D's).
    pub(super) transfers: BTreeMap<String, (Vec<Value>, Vec<Value>)>,
    /// Modes not run.
    pub(super) skipped: Vec<String>,
    /// P's `/sim/stats` after the last mode.
    pub(super) p_stats: Value,
    /// D's `/sim/stats` after the last mode.
    pub(super) d_stats: Value,
}

impl Summary {
    /// Prints the table, writes `report.json` and `ttft.png` under
    /// `--out-dir`.
    ///
    /// # Errors
    /// Writing a file, or any KV block that mismatched.
    pub(super) fn finish(
        self,
        a: &DemoArgs,
        topo: &Topology,
        slow_link: bool,
        t_start: Instant,
    ) -> Result<()> {
        let count =
            |k: &str| self.p_stats[k].as_u64().unwrap_or(0) + self.d_stats[k].as_u64().unwrap_or(0);
        let (verified, mismatched) = (count("verified_blocks"), count("mismatched_blocks"));
        let rows = rows(&self.rep, &self.transfers, &self.thresholds);
        println!();
        print!("{}", render_table(&rows, &self.skipped));
        println!(
            "KV blocks verified byte-exact: {verified} (D→P and P→D), mismatched: {mismatched}"
        );
        let json_path = a.out_dir.join("report.json");
        let png = a.out_dir.join("ttft.png");
        let out = json!({
            "scenario": if slow_link { "slow-link" } else { "loop" },
            "topology": topo.describe(),
            "profile": a.profile,
            "time_scale": a.time_scale,
            "kv_bytes_per_token": a.kv_bytes_per_token,
            "kv_scaling": "real Qwen3-32B KV: 256 KiB/token (32 KiB per GPU at TP 8); scaled to kv_bytes_per_token so transfers cost tens of ms on a veth",
            "modes_skipped": self.skipped,
            "slow_rate": if slow_link { Some(a.slow_rate.clone()) } else { None },
            "rows": rows,
            "verified_blocks": verified,
            "mismatched_blocks": mismatched,
            "engines": {"p0": self.p_stats, "d0": self.d_stats},
            "reads": self.transfers.iter().map(|(m, (p, d))| (m.clone(), json!({"p0": p, "d0": d}))).collect::<serde_json::Map<String, Value>>(),
            "wall_s": t_start.elapsed().as_secs_f64(),
            "loadgen": self.rep.to_json(),
        });
        std::fs::write(&json_path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", json_path.display()))?;
        chart::write_ttft_chart(
            &self.rep,
            &png,
            &format!("TTFT vs prompt length ({})", a.profile),
        )?;
        println!(
            "wrote {} and {} ({:.0} s)",
            json_path.display(),
            png.display(),
            t_start.elapsed().as_secs_f64()
        );
        if mismatched > 0 {
            bail!("{mismatched} KV blocks mismatched");
        }
        Ok(())
    }
}

/// Bucket edges: 0 and ¾ of every prefix length after the first, so each
/// conversation's turns stay in its prefix's bucket.
pub fn bucket_edges(prefix_tokens: &[u64]) -> Vec<u64> {
    let mut v: Vec<u64> = prefix_tokens.iter().skip(1).map(|p| p * 3 / 4).collect();
    v.insert(0, 0);
    v
}

/// The entries of `after` (a JSON array) past the length of `before`.
pub(super) fn new_entries(before: &Value, after: &Value) -> Vec<Value> {
    let n = before.as_array().map_or(0, Vec::len);
    after
        .as_array()
        .map(|a| a.iter().skip(n).cloned().collect())
        .unwrap_or_default()
}

/// The median (upper middle) of `v`, `None` when empty.
fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Summary rows per mode and bucket; transfer times bucketed by the engine's
/// own prompt token count with the same edges.
fn rows(
    rep: &report::Report,
    transfers: &BTreeMap<String, (Vec<Value>, Vec<Value>)>,
    thresholds: &BTreeMap<String, Option<u64>>,
) -> Vec<Row> {
    let edges = &rep.bucket_edges_tokens;
    let bucket = |t: u64| edges.partition_point(|&e| e <= t).saturating_sub(1);
    rep.summaries()
        .into_iter()
        .map(|s| {
            let b = bucket(s.bucket_lo_tokens);
            let pick = |entries: &[Value]| {
                median(
                    entries
                        .iter()
                        .filter(|e| e["tokens"].as_u64().unwrap_or(0) > 0)
                        .filter(|e| bucket(e["prompt_tokens"].as_u64().unwrap_or(0)) == b)
                        .filter_map(|e| e["transfer_ms"].as_f64())
                        .collect(),
                )
            };
            let (d2p, p2d) = transfers
                .get(&s.mode)
                .map(|(p, d)| (pick(p), pick(d)))
                .unwrap_or((None, None));
            Row {
                mode: s.mode.clone(),
                prompt_tokens: s.prompt_tokens,
                bucket_lo_tokens: s.bucket_lo_tokens,
                requests: s.count,
                errors: s.errors,
                ttft_ms_p50: s.ttft_ms_p50,
                transfer_ms_p50: d2p,
                p2d_transfer_ms_p50: p2d,
                threshold_tokens: thresholds.get(&s.mode).copied().flatten(),
            }
        })
        .collect()
}

/// The TTFT table in the published format plus the adaptive and transfer columns.
pub fn render_table(rows: &[Row], skipped: &[String]) -> String {
    let mut buckets: Vec<u64> = rows.iter().map(|r| r.bucket_lo_tokens).collect();
    buckets.sort_unstable();
    buckets.dedup();
    let find = |mode: &str, b: u64| {
        rows.iter()
            .find(|r| r.mode == mode && r.bucket_lo_tokens == b)
    };
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0} ms"));
    let adaptive_skipped = skipped.iter().any(|m| m == "adaptive");
    let mut s = format!(
        "{:>14} {:>10} {:>14} {:>9} {:>12} {:>10} {:>14}\n",
        "prompt tokens", "TTFT OFF", "TTFT ON(fixed)", "speed-up", "adaptive", "D→P ms", "P→D ms"
    );
    for b in buckets {
        let off = find("OFF", b);
        let fixed = find("fixed", b);
        let adaptive = find("adaptive", b);
        let prompt = fixed.or(off).or(adaptive).map_or(b, |r| r.prompt_tokens);
        let speed = match (
            off.and_then(|r| r.ttft_ms_p50),
            fixed.and_then(|r| r.ttft_ms_p50),
        ) {
            (Some(o), Some(f)) if f > 0.0 => format!("{:.2}×", o / f),
            _ => "-".into(),
        };
        let ad = if adaptive_skipped {
            "n/a".to_string()
        } else {
            ms(adaptive.and_then(|r| r.ttft_ms_p50))
        };
        s.push_str(&format!(
            "{:>14} {:>10} {:>14} {:>9} {:>12} {:>10} {:>14}\n",
            prompt,
            ms(off.and_then(|r| r.ttft_ms_p50)),
            ms(fixed.and_then(|r| r.ttft_ms_p50)),
            speed,
            ad,
            ms(fixed.and_then(|r| r.transfer_ms_p50)),
            ms(fixed.or(off).and_then(|r| r.p2d_transfer_ms_p50)),
        ));
    }
    if adaptive_skipped {
        s.push_str("adaptive: n/a (node agents not available to this demo)\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edges_keep_turns_in_their_prefix_bucket() {
        assert_eq!(bucket_edges(&[2048, 4096, 24576]), vec![0, 3072, 18432]);
    }

    #[test]
    fn table_has_speed_up_and_marks_adaptive_unavailable() {
        let row = |mode: &str, ttft: f64| Row {
            mode: mode.into(),
            prompt_tokens: 24_600,
            bucket_lo_tokens: 18_432,
            requests: 6,
            errors: 0,
            ttft_ms_p50: Some(ttft),
            transfer_ms_p50: (mode == "fixed").then_some(40.0),
            p2d_transfer_ms_p50: Some(45.0),
            threshold_tokens: Some(64),
        };
        let t = render_table(
            &[row("OFF", 800.0), row("fixed", 400.0)],
            &["adaptive".into()],
        );
        assert!(t.contains("2.00×"), "{t}");
        assert!(t.contains("n/a"), "{t}");
        assert!(t.contains("40 ms"), "{t}");
    }
}
