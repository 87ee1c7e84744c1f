//! Summaries of one or several runs (modes) of the same conversation set:
//! per mode and prompt-length bucket, count, TTFT p50/p90, TPOT p50, latency
//! p50; a text table and a JSON report.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client::{ModeRun, RequestRecord};
use crate::{LoadgenError, Result};

/// Default bucket lower edges, tokens: 0, 1k, 2k, 4k, 8k, 12k, 16k, 20k, 24k,
/// 32k, 48k, 64k, 128k (bucket i is `[edges[i], edges[i+1])`, the last one open).
/// The agentic generator aims its first turns at or just above the sweep's
/// prefix lengths, so each lands in the bucket that starts there.
pub fn default_bucket_edges_tokens() -> Vec<u64> {
    vec![
        0, 1024, 2048, 4096, 8192, 12288, 16384, 20480, 24576, 32768, 49152, 65536, 131072,
    ]
}

/// Percentile `q` in [0, 1] of `xs` with linear interpolation between closest
/// ranks (numpy's default); `None` for an empty slice.
pub fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

/// One row of the summary: one mode, one prompt-length bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketSummary {
    /// Mode label.
    pub mode: String,
    /// Bucket lower edge, tokens (inclusive).
    pub bucket_lo_tokens: u64,
    /// Bucket upper edge, tokens (exclusive); `None` for the last bucket.
    pub bucket_hi_tokens: Option<u64>,
    /// Median prompt tokens of the bucket's requests (the count chosen by
    /// [`Report::prompt_count`]).
    pub prompt_tokens: u64,
    /// Requests in the bucket (including failed ones).
    pub count: usize,
    /// Failed requests in the bucket.
    pub errors: usize,
    /// TTFT median, ms (successful requests).
    pub ttft_ms_p50: Option<f64>,
    /// TTFT 90th percentile, ms.
    pub ttft_ms_p90: Option<f64>,
    /// TPOT median, ms.
    pub tpot_ms_p50: Option<f64>,
    /// Latency median, ms.
    pub latency_ms_p50: Option<f64>,
    /// Median of every numeric [`RequestRecord::server_info`] entry (a JSON
    /// number or a string that parses as one, e.g. a header
    /// `x-kvloop-transfer-ms: 42`) over the bucket's successful requests.
    ///
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub server_p50: BTreeMap<String, f64>,
}

fn server_p50(records: &[&&RequestRecord]) -> BTreeMap<String, f64> {
    let mut values: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in records {
        for (k, v) in &r.server_info {
            let x = match v {
                Value::Number(n) => n.as_f64(),
                Value::String(s) => s.trim().parse::<f64>().ok(),
                _ => None,
            };
            if let Some(x) = x.filter(|x| x.is_finite()) {
                values.entry(k.clone()).or_default().push(x);
            }
        }
    }
    values
        .into_iter()
        .filter_map(|(k, v)| percentile(&v, 0.5).map(|p| (k, p)))
        .collect()
}

/// Which prompt-token count places a request in a bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptCount {
    /// The server's count (`usage.prompt_tokens` or `/tokenize`) when every
    /// request of the report has one, else the client's.
    #[default]
    Auto,
    /// The client's tokenizer count ([`RequestRecord::input_tokens`]).
    Client,
    /// The server's count, falling back to the client's where missing.
    Server,
}

/// Runs of the same conversation set under several modes, merged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Tokenizer used for client-side counts (e.g. `cl100k_base`).
    pub tokenizer: String,
    /// Bucket lower edges, tokens, ascending.
    pub bucket_edges_tokens: Vec<u64>,
    /// The runs, in the order pushed.
    pub runs: Vec<ModeRun>,
    /// Which count buckets requests (default [`PromptCount::Auto`]).
    #[serde(default)]
    pub prompt_count: PromptCount,
}

impl Report {
    /// An empty report; `bucket_edges_tokens` is sorted and deduplicated, and
    /// gets a 0 edge when missing.
    pub fn new(mut bucket_edges_tokens: Vec<u64>, tokenizer: &str) -> Self {
        bucket_edges_tokens.push(0);
        bucket_edges_tokens.sort_unstable();
        bucket_edges_tokens.dedup();
        Self {
            tokenizer: tokenizer.into(),
            bucket_edges_tokens,
            runs: Vec::new(),
            prompt_count: PromptCount::Auto,
        }
    }

    /// True when buckets use the server's prompt-token counts (see [`PromptCount`]).
    pub fn uses_server_counts(&self) -> bool {
        match self.prompt_count {
            PromptCount::Client => false,
            PromptCount::Server => true,
            PromptCount::Auto => {
                let mut all = self.runs.iter().flat_map(|r| &r.records).peekable();
                all.peek().is_some() && all.all(|r| r.server_prompt_tokens.is_some())
            }
        }
    }

    /// Prompt tokens of `r` under this report's [`PromptCount`] choice.
    pub fn prompt_tokens_of(&self, r: &RequestRecord) -> u64 {
        if self.uses_server_counts() {
            r.server_prompt_tokens.unwrap_or(r.input_tokens)
        } else {
            r.input_tokens
        }
    }

    /// Adds a run; a run with the same mode label as an earlier one replaces it.
    pub fn push(&mut self, run: ModeRun) {
        if let Some(r) = self.runs.iter_mut().find(|r| r.mode == run.mode) {
            *r = run;
        } else {
            self.runs.push(run);
        }
    }

    /// Mode labels in order.
    pub fn modes(&self) -> Vec<&str> {
        self.runs.iter().map(|r| r.mode.as_str()).collect()
    }

    fn bucket_of(&self, tokens: u64) -> usize {
        self.bucket_edges_tokens
            .partition_point(|&e| e <= tokens)
            .saturating_sub(1)
    }

    /// Summary rows, by mode (in push order) then bucket (ascending); empty
    /// buckets are left out.
    pub fn summaries(&self) -> Vec<BucketSummary> {
        self.summaries_where(|_| true)
    }

    /// [`Report::summaries`] over the requests `keep` accepts, e.g.
    /// `|r| r.turn > 0` for the turns that can reuse an earlier turn's KV cache.
    pub fn summaries_where(&self, keep: impl Fn(&RequestRecord) -> bool) -> Vec<BucketSummary> {
        let server = self.uses_server_counts();
        let count = |r: &RequestRecord| {
            if server {
                r.server_prompt_tokens.unwrap_or(r.input_tokens)
            } else {
                r.input_tokens
            }
        };
        let mut out = Vec::new();
        for run in &self.runs {
            let mut by_bucket: Vec<Vec<&RequestRecord>> =
                vec![Vec::new(); self.bucket_edges_tokens.len()];
            for r in run.records.iter().filter(|r| keep(r)) {
                by_bucket[self.bucket_of(count(r))].push(r);
            }
            for (b, rs) in by_bucket.iter().enumerate() {
                if rs.is_empty() {
                    continue;
                }
                let ok: Vec<_> = rs.iter().filter(|r| r.error.is_none()).collect();
                let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
                let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_ms).collect();
                let lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
                let prompts: Vec<f64> = rs.iter().map(|r| count(r) as f64).collect();
                out.push(BucketSummary {
                    mode: run.mode.clone(),
                    bucket_lo_tokens: self.bucket_edges_tokens[b],
                    bucket_hi_tokens: self.bucket_edges_tokens.get(b + 1).copied(),
                    prompt_tokens: percentile(&prompts, 0.5).unwrap_or(0.0).round() as u64,
                    count: rs.len(),
                    errors: rs.len() - ok.len(),
                    ttft_ms_p50: percentile(&ttft, 0.5),
                    ttft_ms_p90: percentile(&ttft, 0.9),
                    tpot_ms_p50: percentile(&tpot, 0.5),
                    latency_ms_p50: percentile(&lat, 0.5),
                    server_p50: server_p50(&ok),
                });
            }
        }
        out
    }

    /// The summary as text: one row per mode and bucket, then (with two or
    /// more modes) a comparison of TTFT p50 per bucket with each mode's
    /// speed-up over the first mode.
    pub fn render_table(&self) -> String {
        self.render_table_where(|_| true)
    }

    /// [`Report::render_table`] over the requests `keep` accepts.
    pub fn render_table_where(&self, keep: impl Fn(&RequestRecord) -> bool) -> String {
        let f = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
        let bucket = |lo: u64, hi: Option<u64>| match hi {
            Some(h) => format!("[{lo}, {h})"),
            None => format!("[{lo}, inf)"),
        };
        let rows = self.summaries_where(keep);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "prompt tokens counted by {}",
            if self.uses_server_counts() {
                "the server"
            } else {
                self.tokenizer.as_str()
            }
        );
        let _ = writeln!(
            s,
            "{:<10} {:>16} {:>6} {:>4} {:>8} {:>10} {:>10} {:>9} {:>11}",
            "mode",
            "prompt bucket",
            "n",
            "err",
            "prompt",
            "TTFT p50",
            "TTFT p90",
            "TPOT p50",
            "latency p50"
        );
        let _ = writeln!(
            s,
            "{:<10} {:>16} {:>6} {:>4} {:>8} {:>10} {:>10} {:>9} {:>11}",
            "", "(tokens)", "", "", "(p50)", "(ms)", "(ms)", "(ms)", "(ms)"
        );
        for r in &rows {
            let _ = writeln!(
                s,
                "{:<10} {:>16} {:>6} {:>4} {:>8} {:>10} {:>10} {:>9} {:>11}",
                r.mode,
                bucket(r.bucket_lo_tokens, r.bucket_hi_tokens),
                r.count,
                r.errors,
                r.prompt_tokens,
                f(r.ttft_ms_p50),
                f(r.ttft_ms_p90),
                f(r.tpot_ms_p50),
                f(r.latency_ms_p50)
            );
        }
        let modes = self.modes();
        if modes.len() >= 2 {
            let _ = writeln!(s);
            let w = modes.iter().map(|m| m.len() + 5).max().unwrap_or(0).max(12);
            let mut head = format!("{:>16} {:>8}", "prompt bucket", "prompt");
            for m in &modes {
                head.push_str(&format!(" {:>w$}", format!("TTFT {m}")));
            }
            for m in &modes[1..] {
                head.push_str(&format!(" {:>w$}", format!("x {m}")));
            }
            let _ = writeln!(s, "{head}");
            let mut buckets: Vec<(u64, Option<u64>)> = rows
                .iter()
                .map(|r| (r.bucket_lo_tokens, r.bucket_hi_tokens))
                .collect();
            buckets.sort();
            buckets.dedup();
            for (lo, hi) in buckets {
                let get = |m: &str| {
                    rows.iter()
                        .find(|r| r.mode == m && r.bucket_lo_tokens == lo)
                };
                let prompt = get(modes[0]).map_or(0, |r| r.prompt_tokens);
                let mut line = format!("{:>16} {:>8}", bucket(lo, hi), prompt);
                let ttft: Vec<Option<f64>> = modes
                    .iter()
                    .map(|m| get(m).and_then(|r| r.ttft_ms_p50))
                    .collect();
                for t in &ttft {
                    line.push_str(&format!(" {:>w$}", f(*t)));
                }
                for t in &ttft[1..] {
                    let x = match (ttft[0], *t) {
                        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                        _ => "-".into(),
                    };
                    line.push_str(&format!(" {x:>w$}"));
                }
                let _ = writeln!(s, "{line}");
            }
        }
        s
    }

    /// The JSON report: `{"tokenizer", "bucket_edges_tokens", "summary":
    /// [BucketSummary...], "runs": [{"mode", "wall_ms", "meta", "records"}...]}`.
    pub fn to_json(&self) -> Value {
        json!({
            "tokenizer": self.tokenizer,
            "prompt_count": self.prompt_count,
            "prompt_tokens_counted_by": if self.uses_server_counts() { "server" } else { "client" },
            "bucket_edges_tokens": self.bucket_edges_tokens,
            "summary": self.summaries(),
            "runs": self.runs,
        })
    }

    /// Reads a report written by [`Report::write_json`] (the `summary` is recomputed).
    pub fn read_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| LoadgenError::io(path, e))?;
        Ok(serde_json::from_str(&text)?)
    }

    /// Writes [`Report::to_json`] (pretty), creating parent directories.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| LoadgenError::io(d, e))?;
        }
        let text = serde_json::to_string_pretty(&self.to_json())?;
        std::fs::write(path, text).map_err(|e| LoadgenError::io(path, e))
    }
}
