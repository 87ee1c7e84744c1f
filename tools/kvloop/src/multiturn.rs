//! `kvloop bench multiturn`: multi-turn chat load against an OpenAI-compatible
//! server (vLLM, the kvloop router, or `kvloop-engine-sim`), with vLLM's
//! `benchmarks/multi_turn` inputs or built-in agentic coding conversations
//! made from source files on this machine. A thin wrapper over
//! `kvloop-loadgen`: prints the summary table, writes `report.json` and
//! `ttft.png` under `--out-dir`; `--append` merges this run (one mode label)
//! into an existing report so several modes end up in one table and chart.
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{Input, agentic, chart, client, generate, input, report};

/// Flags of `kvloop bench multiturn`.
#[derive(Clone, Debug, Args)]
pub struct BenchMultiturnArgs {
    /// Server base URL (`/v1/chat/completions` is appended).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// vLLM multi_turn input: a conversation list or a generate_conversations
    /// JSON. Without it, agentic coding conversations are generated.
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Mode label of this run (e.g. OFF, fixed, adaptive).
    #[arg(long, default_value = "run")]
    pub mode: String,
    /// Model name sent (default: first id of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Seed of the generators.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Agentic: target prompt tokens of each conversation's first request.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2048u64, 4096, 8192, 16384, 24576])]
    pub prefix_tokens: Vec<u64>,
    /// Agentic: conversations per prefix length.
    #[arg(long, default_value_t = 2)]
    pub conversations_per_prefix: usize,
    /// Agentic: user turns (requests) per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Agentic: tokens of each later turn's tool output, at least.
    #[arg(long, default_value_t = 512)]
    pub tool_output_tokens: u64,
    /// Agentic: each later turn's tool output is also at least this
    /// fraction of the conversation's prefix (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub tool_output_fraction: f64,
    /// Agentic: tokens of each reference answer (max_tokens).
    #[arg(long, default_value_t = 64)]
    pub answer_tokens: u64,
    /// Agentic: source roots to take files from (default: rust-src of the
    /// rustup toolchains and ~/.cargo/registry/src; also $KVLOOP_LOADGEN_SOURCES).
    #[arg(long)]
    pub source_root: Vec<PathBuf>,
    /// Tokenizer for client-side counts: cl100k_base or o200k_base.
    #[arg(long, default_value = "cl100k_base")]
    pub tokenizer: String,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 1)]
    pub max_concurrency: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 10_000)]
    pub max_requests: usize,
    /// No request starts after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub max_duration_s: u64,
    /// Bound on one request, seconds.
    #[arg(long, default_value_t = 300)]
    pub request_timeout_s: u64,
    /// Cap on max_tokens per request.
    #[arg(long)]
    pub max_output_tokens: Option<u64>,
    /// Extra JSON object merged into every request body.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Send conversation ids unchanged (default: `<id>@<mode>`).
    #[arg(long)]
    pub raw_ids: bool,
    /// Ask the server's /tokenize for its prompt-token count before each request.
    #[arg(long)]
    pub server_tokenize: bool,
    /// Prompt count used for buckets: auto (server's when every request has
    /// one), client, or server.
    #[arg(long, default_value = "auto")]
    pub bucket_by: String,
    /// Prompt-length bucket lower edges, tokens.
    #[arg(long, value_delimiter = ',')]
    pub bucket_edges: Vec<u64>,
    /// Output directory for report.json and ttft.png.
    #[arg(long, default_value = "target/kvloop-bench")]
    pub out_dir: PathBuf,
    /// Merge into an existing <out-dir>/report.json (same mode label replaces).
    #[arg(long)]
    pub append: bool,
    /// Write the conversations (vLLM list format) here and exit without sending.
    #[arg(long)]
    pub dump_conversations: Option<PathBuf>,
}

/// Runs `kvloop bench multiturn`.
pub async fn run(a: BenchMultiturnArgs) -> Result<()> {
    let tok = TokenCounter::by_name(&a.tokenizer).with_context(|| {
        format!(
            "--tokenizer: expected cl100k_base or o200k_base, got {}",
            a.tokenizer
        )
    })?;
    let convs = match &a.input {
        Some(path) => match input::read_input_file(path)
            .with_context(|| format!("--input {}", path.display()))?
        {
            Input::Conversations(c) => c,
            Input::Generate(spec) => generate::generate_conversations(&spec, &tok, a.seed)?,
        },
        None => {
            let roots = if a.source_root.is_empty() {
                agentic::default_source_roots()
            } else {
                a.source_root.clone()
            };
            let corpus = agentic::SourceCorpus::discover(&roots, 4000)?;
            let spec = agentic::AgenticSpec {
                prefix_tokens: a.prefix_tokens.clone(),
                conversations_per_prefix: a.conversations_per_prefix,
                user_turns: a.turns,
                tool_output_tokens: a.tool_output_tokens,
                tool_output_fraction: a.tool_output_fraction,
                answer_tokens: a.answer_tokens,
                seed: a.seed,
            };
            agentic::generate_agentic(&spec, &corpus, &tok)?
        }
    };
    if convs.is_empty() {
        bail!("no conversations to send");
    }
    if let Some(path) = &a.dump_conversations {
        let text = serde_json::to_string_pretty(&input::conversations_to_json(&convs))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} conversations to {}", convs.len(), path.display());
        return Ok(());
    }
    let mut cfg = client::ClientConfig::new(&a.url);
    cfg.model = a.model.clone();
    cfg.max_concurrency = a.max_concurrency;
    cfg.max_requests = a.max_requests;
    cfg.max_duration = Duration::from_secs(a.max_duration_s);
    cfg.request_timeout = Duration::from_secs(a.request_timeout_s);
    cfg.max_output_tokens = a.max_output_tokens;
    cfg.tag_ids_with_mode = !a.raw_ids;
    cfg.server_tokenize = a.server_tokenize;
    let prompt_count = match a.bucket_by.as_str() {
        "auto" => report::PromptCount::Auto,
        "client" => report::PromptCount::Client,
        "server" => report::PromptCount::Server,
        other => bail!("--bucket-by: expected auto, client or server, got {other}"),
    };
    if let Some(extra) = &a.extra_body {
        match serde_json::from_str(extra) {
            Ok(serde_json::Value::Object(o)) => cfg.extra_body = o,
            _ => bail!("--extra-body: expected a JSON object, got {extra}"),
        }
    }
    let report_path = a.out_dir.join("report.json");
    let mut rep = if a.append && report_path.exists() {
        report::Report::read_json(&report_path)?
    } else {
        let edges = if a.bucket_edges.is_empty() {
            report::default_bucket_edges_tokens()
        } else {
            a.bucket_edges.clone()
        };
        report::Report::new(edges, tok.name())
    };
    rep.prompt_count = prompt_count;
    let requests: usize = convs.iter().map(|c| c.user_turns()).sum();
    eprintln!(
        "mode {}: {} conversations, {} requests to {}",
        a.mode,
        convs.len(),
        requests,
        a.url
    );
    let run = client::run_mode(&a.mode, &convs, &cfg, &tok).await?;
    let failed = run.records.iter().filter(|r| r.error.is_some()).count();
    rep.push(run);
    print!("{}", rep.render_table());
    rep.write_json(&report_path)?;
    let png = a.out_dir.join("ttft.png");
    chart::write_ttft_chart(&rep, &png, "TTFT vs prompt length")?;
    eprintln!("wrote {} and {}", report_path.display(), png.display());
    if failed > 0 {
        eprintln!("{failed} request(s) failed; see the `error` fields in the report");
    }
    Ok(())
}
