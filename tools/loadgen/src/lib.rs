//! Multi-turn load generator for OpenAI-compatible servers (`kvloop bench multiturn`).
//!
//! Pieces, library first (the CLI in `tools/kvloop` is a thin wrapper):
//!
//! - [`input`]: readers for vLLM's `benchmarks/multi_turn` inputs — the
//!   OpenAI-format conversation list (`[{"id", "messages": [{"role", "content"}]}]`)
//!   and the `{"filetype": "generate_conversations", ...}` description.
//! - [`dist`]: the distributions of that description (`constant`, `uniform`,
//!   `lognormal`, `zipf`, `poisson`), sampled from a seeded ChaCha8 stream.
//! - [`tokenizer`]: token counting with a real BPE tokenizer embedded in the
//!   `tiktoken-rs` crate (nothing downloaded at run time).
//! - [`generate`]: synthetic conversations per the `generate_conversations` description.
//! - [`agentic`]: agentic coding conversations whose tool outputs are real
//!   source files found on this machine (Rust toolchain sources, cargo registry).
//! - [`client`]: runs conversations against `/v1/chat/completions` (streaming
//!   SSE), feeding the server's answer back as history, and records TTFT,
//!   TPOT, latency, input and output tokens per request.
//! - [`report`]: several runs labelled by mode (`OFF`, `fixed`, `adaptive`, …)
//!   merged into one summary table and one JSON report; [`chart`] draws TTFT
//!   versus prompt length per mode as a PNG.
//!
//! Typical use (what the demo calls):
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvloop_loadgen::LoadgenError> {
//! use kvloop_loadgen::{agentic, chart, client, report, tokenizer::TokenCounter};
//! let tok = TokenCounter::default_counter();
//! let corpus = agentic::SourceCorpus::discover(&agentic::default_source_roots(), 4000)?;
//! let spec = agentic::AgenticSpec { prefix_tokens: vec![2048, 8192, 24576], ..Default::default() };
//! let convs = agentic::generate_agentic(&spec, &corpus, &tok)?;
//! let mut rep = report::Report::new(report::default_bucket_edges_tokens(), tok.name());
//! for mode in ["OFF", "fixed", "adaptive"] {
//!     // (re)configure the system under test for `mode` here
//!     let mut cfg = client::ClientConfig::new("http://127.0.0.1:8000");
//!     cfg.max_concurrency = 2;
//!     cfg.server_tokenize = true; // bucket by the engine's own prompt count
//!     rep.push(client::run_mode(mode, &convs, &cfg, &tok).await?);
//! }
//! println!("{}", rep.render_table());
//! // Turns after the first are the ones that can reuse D's KV cache:
//! println!("{}", rep.render_table_where(|r| r.turn > 0));
//! rep.write_json("target/kvloop-demo/report.json".as_ref())?;
//! chart::write_ttft_chart(&rep, "target/kvloop-demo/ttft.png".as_ref(), "TTFT vs prompt length")?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
pub mod agentic;
pub mod bars;
pub mod chart;
pub mod client;
pub mod dist;
pub mod error;
pub mod generate;
pub mod input;
pub mod report;
pub mod sse;
pub mod tokenizer;

pub use error::LoadgenError;
pub use input::{Conversation, Input, Message};

/// Result alias of this crate.
pub type Result<T, E = LoadgenError> = std::result::Result<T, E>;
