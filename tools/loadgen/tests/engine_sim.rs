//! One real run against `kvloop-engine-sim` (decode role, streaming chat) on
//! loopback, with agentic conversations made from this workspace's sources.
use std::path::PathBuf;

use kvloop_engine_sim::{Role, SimConfig, spawn};
use kvloop_loadgen::agentic::{AgenticSpec, SourceCorpus, generate_agentic};
use kvloop_loadgen::client::{ClientConfig, run_mode};
use kvloop_loadgen::report::{PromptCount, Report, default_bucket_edges_tokens};
use kvloop_loadgen::tokenizer::TokenCounter;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_run_against_engine_sim() {
    let sim = spawn(SimConfig {
        role: Role::Decode,
        engine_id: "d0".into(),
        prefill_us_per_token: 1,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let tok = TokenCounter::default_counter();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let corpus = SourceCorpus::discover(&[root], 1000).unwrap();
    let spec = AgenticSpec {
        prefix_tokens: vec![1024, 4096],
        conversations_per_prefix: 2,
        user_turns: 3,
        tool_output_tokens: 200,
        tool_output_fraction: 0.0,
        answer_tokens: 16,
        seed: 1,
    };
    let convs = generate_agentic(&spec, &corpus, &tok).unwrap();
    let mut cfg = ClientConfig::new(sim.url());
    cfg.max_concurrency = 2;
    cfg.server_tokenize = true;
    cfg.request_timeout = std::time::Duration::from_secs(30);
    let run = run_mode("OFF", &convs, &cfg, &tok).await.unwrap();
    assert_eq!(run.records.len(), 12);
    assert!(
        run.records.iter().all(|r| r.error.is_none()),
        "{:?}",
        run.records
    );
    assert!(
        run.records
            .iter()
            .all(|r| r.ttft_ms.is_some() && r.output_tokens > 0)
    );
    assert_eq!(sim.engine.stats().requests, 12);
    // The simulator's own prompt count (from its /tokenize) is recorded.
    assert!(
        run.records
            .iter()
            .all(|r| r.server_prompt_tokens.is_some_and(|n| n > 0))
    );
    let mut rep = Report::new(default_bucket_edges_tokens(), tok.name());
    rep.push(run);
    println!("{}", rep.render_table());
    assert!(rep.uses_server_counts());
    rep.prompt_count = PromptCount::Client;
    assert!(!rep.uses_server_counts());
    println!("{}", rep.render_table());
    assert!(rep.summaries().iter().any(|s| s.bucket_lo_tokens == 4096));
}
