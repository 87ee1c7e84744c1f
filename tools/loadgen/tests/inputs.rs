//! vLLM multi_turn input readers: both shapes, good and bad input; the
//! generate_conversations expansion on real text (this crate's sources).
use std::path::PathBuf;

use kvloop_loadgen::generate::{BASE_PROMPT, generate_conversations};
use kvloop_loadgen::input::{Input, parse_input, read_input_file};
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{LoadgenError, dist::Distribution};
use serde_json::{Value, json};

fn field_of(e: LoadgenError) -> String {
    match e {
        LoadgenError::Field { field, .. } => field,
        other => panic!("expected a field error, got {other}"),
    }
}

#[test]
fn conversation_list_parses() {
    let text = r#"[
      {"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]},
      {"id": "b", "messages": [{"role": "user", "content": "x"}]}
    ]"#;
    let Input::Conversations(c) = parse_input(text).unwrap() else {
        panic!()
    };
    assert_eq!(c.len(), 2);
    assert_eq!(c[0].id, "a");
    assert_eq!(c[0].messages.len(), 4);
    assert_eq!(c[0].user_turns(), 2);
    assert_eq!(c[1].messages[0].content, "x");
}

#[test]
fn conversation_list_errors_name_the_field() {
    let cases: &[(Value, &str)] = &[
        (
            json!([{"messages": [{"role": "user", "content": "x"}]}]),
            "[0].id",
        ),
        (
            json!([{"id": 3, "messages": [{"role": "user", "content": "x"}]}]),
            "[0].id",
        ),
        (json!([{"id": "a"}]), "[0].messages"),
        (json!([{"id": "a", "messages": []}]), "[0].messages"),
        (
            json!([{"id": "a", "messages": [{"role": "user"}]}]),
            "[0].messages[0].content",
        ),
        (
            json!([{"id": "a", "messages": [{"role": "robot", "content": "x"}]}]),
            "[0].messages[0].role",
        ),
        (
            json!([{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}]),
            "[0].messages",
        ),
        (
            json!([{"id": "a", "messages": [{"role": "user", "content": "x"}]},
                   {"id": "a", "messages": [{"role": "user", "content": "y"}]}]),
            "[1].id",
        ),
        (json!([1]), "[0]"),
        (json!(3), "$"),
        (json!({"filetype": "other"}), "filetype"),
        (json!({"foo": 1}), "filetype"),
    ];
    for (v, field) in cases {
        let e = parse_input(&v.to_string()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), *field, "{v}: {msg}");
        assert!(msg.contains(field), "{msg}");
    }
    assert!(matches!(parse_input("{nope"), Err(LoadgenError::Json(_))));
}

fn spec_json(files: &[PathBuf]) -> Value {
    json!({
        "filetype": "generate_conversations",
        "num_conversations": 6,
        "text_files": files,
        "print_stats": false,
        "prompt_input": {
            "num_turns": {"distribution": "uniform", "min": 3, "max": 6},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 100},
            "prefix_num_tokens": {"distribution": "lognormal", "average": 400, "max": 1000},
            "num_tokens": {"distribution": "uniform", "min": 60, "max": 80}
        },
        "prompt_output": {"num_tokens": {"distribution": "poisson", "alpha": 30, "max": 50}}
    })
}

fn crate_sources() -> Vec<PathBuf> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    v.sort();
    v
}

#[test]
fn generate_spec_errors_name_the_field() {
    let files = crate_sources();
    let base = spec_json(&files);
    let edits: &[(&str, Value, &str)] = &[
        ("/num_conversations", json!(0), "num_conversations"),
        ("/text_files", json!([]), "text_files"),
        ("/text_files", json!([1]), "text_files[0]"),
        ("/print_stats", json!("yes"), "print_stats"),
        (
            "/prompt_input/num_turns",
            json!({"min": 1}),
            "prompt_input.num_turns.distribution",
        ),
        (
            "/prompt_input/num_turns",
            json!({"distribution": "gamma"}),
            "prompt_input.num_turns.distribution",
        ),
        (
            "/prompt_input/num_turns",
            json!({"distribution": "uniform", "min": 0, "max": 3}),
            "prompt_input.num_turns.min",
        ),
        (
            "/prompt_input/num_turns",
            json!({"distribution": "uniform", "min": 5, "max": 3}),
            "prompt_input.num_turns.max",
        ),
        (
            "/prompt_input/num_tokens",
            json!({"distribution": "constant"}),
            "prompt_input.num_tokens.value",
        ),
        (
            "/prompt_input/num_tokens",
            json!({"distribution": "zipf", "alpha": 1.0}),
            "prompt_input.num_tokens.alpha",
        ),
        (
            "/prompt_input/num_tokens",
            json!({"distribution": "poisson", "alpha": "x"}),
            "prompt_input.num_tokens.alpha",
        ),
        (
            "/prompt_input/prefix_num_tokens",
            json!({"distribution": "lognormal", "average": 100, "median_ratio": 1.5}),
            "prompt_input.prefix_num_tokens.median_ratio",
        ),
        (
            "/prompt_input/prefix_num_tokens",
            json!({"distribution": "lognormal", "sigma": 1}),
            "prompt_input.prefix_num_tokens.mean",
        ),
        (
            "/prompt_output/num_tokens",
            json!({"distribution": "poisson", "alpha": 10, "max": -1}),
            "prompt_output.num_tokens.max",
        ),
        (
            "/prompt_output/num_tokens",
            json!({"distribution": "constant", "value": -1}),
            "prompt_output.num_tokens.value",
        ),
    ];
    for (ptr, val, field) in edits {
        let mut v = base.clone();
        *v.pointer_mut(ptr).unwrap() = val.clone();
        let e = parse_input(&v.to_string()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), *field, "{ptr}={val}: {msg}");
    }
    let mut v = base.clone();
    v["prompt_input"]
        .as_object_mut()
        .unwrap()
        .remove("prefix_num_tokens");
    assert_eq!(
        field_of(parse_input(&v.to_string()).unwrap_err()),
        "prompt_input.prefix_num_tokens"
    );
    let mut v = base.clone();
    v.as_object_mut().unwrap().remove("prompt_output");
    assert_eq!(
        field_of(parse_input(&v.to_string()).unwrap_err()),
        "prompt_output"
    );
}

#[test]
fn generate_spec_parses_vllm_example() {
    // The shape of vLLM's benchmarks/multi_turn/generate_multi_turn.json.
    let text = r#"{"filetype": "generate_conversations", "num_conversations": 24,
      "text_files": ["pg1184.txt"], "print_stats": false,
      "prompt_input": {"num_turns": {"distribution": "uniform", "min": 12, "max": 18},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160}},
      "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}}}"#;
    let Input::Generate(s) = parse_input(text).unwrap() else {
        panic!()
    };
    assert_eq!(s.num_conversations, 24);
    assert_eq!(
        s.num_turns,
        Distribution::Uniform {
            min: 12.0,
            max: 18.0,
            integer: true
        }
    );
    assert_eq!(
        s.common_prefix_num_tokens,
        Distribution::Constant { value: 500.0 }
    );
    assert!(
        matches!(s.prefix_num_tokens, Distribution::Lognormal { average: Some(a), max: Some(m), .. } if a == 1000.0 && m == 5000.0)
    );
}

#[test]
fn generate_conversations_on_real_text_is_deterministic_and_sized() {
    let tok = TokenCounter::default_counter();
    let dir = std::env::temp_dir().join(format!("kvloop-loadgen-gen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Relative text file names resolve against the JSON file's directory.
    let mut names = Vec::new();
    for (i, f) in crate_sources().iter().enumerate() {
        let name = format!("text{i}.txt");
        std::fs::copy(f, dir.join(&name)).unwrap();
        names.push(PathBuf::from(name));
    }
    let json_path = dir.join("gen.json");
    std::fs::write(&json_path, spec_json(&names).to_string()).unwrap();
    let Input::Generate(spec) = read_input_file(&json_path).unwrap() else {
        panic!()
    };
    let a = generate_conversations(&spec, &tok, 7).unwrap();
    let b = generate_conversations(&spec, &tok, 7).unwrap();
    let c = generate_conversations(&spec, &tok, 8).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.len(), 6);
    let common: String = a[0].messages[0].content.chars().take(200).collect();
    for (i, conv) in a.iter().enumerate() {
        assert_eq!(conv.id, format!("CONV_ID_{i}"));
        let n = conv.messages.len();
        assert!((4..=6).contains(&n) && n % 2 == 0, "{n} messages");
        for (j, m) in conv.messages.iter().enumerate() {
            assert_eq!(m.role, if j % 2 == 0 { "user" } else { "assistant" });
        }
        // Common prefix in front of every first turn.
        assert!(conv.messages[0].content.starts_with(&common));
        for (j, m) in conv.messages.iter().enumerate().skip(2).step_by(2) {
            assert!(m.content.contains(BASE_PROMPT), "turn {j}");
            let t = tok.count(&m.content);
            assert!((55..=90).contains(&t), "user turn {j} has {t} tokens");
        }
        for m in conv.messages.iter().skip(1).step_by(2) {
            let t = tok.count(&m.content);
            assert!((1..=55).contains(&t), "answer has {t} tokens");
        }
        let first = tok.count(&conv.messages[0].content);
        assert!(
            first > 160 && first < 1000 + 100 + 90 + 20,
            "first turn {first} tokens"
        );
    }
    // Too little text: the error names the field that needed it.
    let mut big = spec.clone();
    big.prefix_num_tokens = Distribution::Constant {
        value: 10_000_000.0,
    };
    match generate_conversations(&big, &tok, 7) {
        Err(LoadgenError::NotEnoughText { field, .. }) => {
            assert_eq!(field, "prompt_input.prefix_num_tokens")
        }
        other => panic!("{other:?}"),
    }
    let mut missing = spec.clone();
    missing.text_files.push(dir.join("absent.txt"));
    assert!(matches!(
        generate_conversations(&missing, &tok, 7),
        Err(LoadgenError::Io { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
