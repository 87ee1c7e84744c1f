//! Agentic conversations from real files: determinism, prefix accuracy,
//! tool outputs that are real file contents.
use std::path::PathBuf;

use kvloop_loadgen::agentic::{
    AgenticSpec, PREFIX_OVERSHOOT_TOKENS, SourceCorpus, default_source_roots, generate_agentic,
};
use kvloop_loadgen::tokenizer::TokenCounter;

fn workspace_corpus() -> SourceCorpus {
    // The workspace's own sources: always present where the tests build.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    SourceCorpus::discover(&[root], 2000).unwrap()
}

#[test]
fn deterministic_for_a_seed_and_sized_to_the_prefix() {
    let tok = TokenCounter::default_counter();
    let corpus = workspace_corpus();
    let spec = AgenticSpec {
        prefix_tokens: vec![2048, 8192],
        conversations_per_prefix: 2,
        user_turns: 3,
        tool_output_tokens: 300,
        tool_output_fraction: 0.0,
        answer_tokens: 40,
        seed: 11,
    };
    let a = generate_agentic(&spec, &corpus, &tok).unwrap();
    assert_eq!(a, generate_agentic(&spec, &corpus, &tok).unwrap());
    let other = generate_agentic(
        &AgenticSpec {
            seed: 12,
            ..spec.clone()
        },
        &corpus,
        &tok,
    )
    .unwrap();
    assert_ne!(a, other);
    assert_eq!(a.len(), 4);
    assert_eq!(a[0].id, "agentic-p2048-c0");
    assert_eq!(a[3].id, "agentic-p8192-c1");
    for c in &a {
        let prefix: usize = c.id[9..c.id.find("-c").unwrap()].parse().unwrap();
        let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "user",
                "assistant",
                "user",
                "assistant"
            ]
        );
        let first = tok.count_chat(&c.messages[..2]);
        assert!(
            first >= prefix && first <= prefix + PREFIX_OVERSHOOT_TOKENS + 16,
            "{}: first request {first} tokens for prefix {prefix}",
            c.id
        );
        for m in c.messages.iter().skip(2).step_by(2) {
            let t = tok.count(&m.content);
            assert!((20..=42).contains(&t), "answer {t} tokens");
        }
        for m in c.messages.iter().skip(3).step_by(2) {
            assert!(m.content.starts_with("Tool result:\n### `cat "));
            let t = tok.count(&m.content);
            assert!(t <= 300 + 80, "tool turn {t} tokens");
        }
    }
}

#[test]
fn tool_outputs_are_real_file_contents() {
    let tok = TokenCounter::default_counter();
    let corpus = workspace_corpus();
    let spec = AgenticSpec {
        prefix_tokens: vec![4096],
        conversations_per_prefix: 1,
        user_turns: 2,
        ..AgenticSpec::default()
    };
    let c = &generate_agentic(&spec, &corpus, &tok).unwrap()[0];
    let tool = &c.messages[3].content;
    let display = tool
        .split('`')
        .nth(1)
        .unwrap()
        .strip_prefix("cat ")
        .unwrap();
    let (path, _) = corpus
        .files
        .iter()
        .find(|(_, d)| d == display)
        .expect("file in corpus");
    let body = tool.split_once("```\n").unwrap().1;
    let head: String = body.chars().take(200).collect();
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.starts_with(&head), "{display}: {head:?}");
}

#[test]
fn default_roots_find_toolchain_or_registry_sources() {
    let roots = default_source_roots();
    assert!(
        !roots.is_empty(),
        "no rust-src and no cargo registry on this machine"
    );
    let corpus = SourceCorpus::discover(&roots, 500).unwrap();
    assert_eq!(corpus.files.len(), 500);
    let tok = TokenCounter::default_counter();
    let spec = AgenticSpec {
        prefix_tokens: vec![2048],
        conversations_per_prefix: 1,
        user_turns: 2,
        ..AgenticSpec::default()
    };
    let c = generate_agentic(&spec, &corpus, &tok).unwrap();
    assert!(tok.count_chat(&c[0].messages[..2]) >= 2048);
}

#[test]
fn empty_roots_are_an_error() {
    let dir = std::env::temp_dir().join(format!("kvloop-loadgen-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = SourceCorpus::discover(std::slice::from_ref(&dir), 10).unwrap_err();
    assert!(e.to_string().contains("no source files"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tool_outputs_grow_with_the_prefix_when_a_fraction_is_set() {
    let tok = TokenCounter::default_counter();
    let corpus = workspace_corpus();
    let spec = AgenticSpec {
        prefix_tokens: vec![2048, 8192],
        conversations_per_prefix: 1,
        user_turns: 2,
        tool_output_tokens: 100,
        tool_output_fraction: 0.25,
        answer_tokens: 20,
        seed: 3,
    };
    assert_eq!(spec.tool_output_tokens_for(8192), 2048);
    assert_eq!(spec.tool_output_tokens_for(100), 100);
    let convs = generate_agentic(&spec, &corpus, &tok).unwrap();
    for (c, prefix) in convs.iter().zip([2048usize, 8192]) {
        // The later user turn: tool blocks of about a quarter of the prefix
        // (several files when one is short), plus wrappers and a question.
        let later = tok.count(&c.messages[3].content);
        let want = prefix / 4;
        assert!(
            later >= want * 95 / 100 && later <= want + want / 4 + 200,
            "{}: later turn {later} tokens, want about {want}",
            c.id
        );
    }
    let bad = AgenticSpec {
        tool_output_fraction: f64::NAN,
        ..spec
    };
    let e = generate_agentic(&bad, &corpus, &tok).unwrap_err();
    assert!(e.to_string().contains("tool_output_fraction"), "{e}");
}
