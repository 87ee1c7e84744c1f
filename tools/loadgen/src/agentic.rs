//! Agentic coding conversations built from real source files on this machine.
//!
//! Each conversation looks like a coding agent's session: a system prompt, a
//! first user turn with a task and the files "opened so far" (real files, cut
//! so that the first request has about `prefix_tokens` prompt tokens), then
//! further user turns that each carry one more tool result (`cat <file>`,
//! about `max(tool_output_tokens, tool_output_fraction × prefix)` tokens,
//! several files when one is too short) and a follow-up question. Assistant messages are
//! references of `answer_tokens` tokens (the client uses their length as
//! `max_tokens` and sends the server's real answers as history).
//!
//! The text comes from [`default_source_roots`]: the Rust toolchains' library
//! sources (`rust-src`) and the cargo registry's unpacked crates, so nothing
//! is downloaded. For a given corpus and seed the output is deterministic.
use std::path::{Path, PathBuf};

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::tokenizer::TokenCounter;
use crate::{Conversation, LoadgenError, Message, Result};

/// File name extensions taken as text.
pub const SOURCE_EXTENSIONS: &[&str] = &["rs", "md", "toml", "c", "h", "py", "txt"];
/// Smallest file taken, bytes (tiny files make poor tool outputs).
pub const MIN_FILE_BYTES: u64 = 1024;
/// Largest file taken, bytes (bounds reading cost per conversation).
pub const MAX_FILE_BYTES: u64 = 256 * 1024;
/// Most tokens one file contributes to the first turn's context, so that the
/// prefix is made of several files as in a real agent session.
pub const MAX_TOKENS_PER_CONTEXT_FILE: usize = 4096;

/// Tokens the first turn is aimed above `prefix_tokens` (see [`AgenticSpec::prefix_tokens`]).
pub const PREFIX_OVERSHOOT_TOKENS: usize = 64;

/// Environment variable with extra source roots (`:`-separated), searched first.
pub const SOURCES_ENV: &str = "KVLOOP_LOADGEN_SOURCES";

/// Roots that exist on this machine, in search order: `$KVLOOP_LOADGEN_SOURCES`,
/// every rustup toolchain's `lib/rustlib/src/rust/library`, then
/// `$CARGO_HOME/registry/src` (default `~/.cargo/registry/src`).
pub fn default_source_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(v) = std::env::var(SOURCES_ENV) {
        roots.extend(v.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let rustup = std::env::var_os("RUSTUP_HOME")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".rustup")));
    if let Some(r) = rustup
        && let Ok(rd) = std::fs::read_dir(r.join("toolchains"))
    {
        let mut tcs: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        tcs.sort();
        roots.extend(
            tcs.into_iter()
                .map(|t| t.join("lib/rustlib/src/rust/library")),
        );
    }
    let cargo = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".cargo")));
    if let Some(c) = cargo {
        roots.push(c.join("registry/src"));
    }
    roots.retain(|r| r.is_dir());
    roots.dedup();
    roots
}

/// A list of candidate text files (paths only; contents are read when used).
#[derive(Clone, Debug)]
pub struct SourceCorpus {
    /// `(absolute path, display name)` in a deterministic order.
    pub files: Vec<(PathBuf, String)>,
}

impl SourceCorpus {
    /// Walks `roots` (sorted, skipping hidden directories and `target`) for
    /// files with a [`SOURCE_EXTENSIONS`] extension and a size within
    /// [`MIN_FILE_BYTES`]..=[`MAX_FILE_BYTES`]; keeps at most `max_files`,
    /// evenly spread over everything found.
    ///
    /// Errors: [`LoadgenError::NoSourceFiles`] when nothing qualifies.
    pub fn discover(roots: &[PathBuf], max_files: usize) -> Result<Self> {
        let mut files = Vec::new();
        for root in roots {
            walk(root, root, &mut files);
        }
        if files.is_empty() || max_files == 0 {
            return Err(LoadgenError::NoSourceFiles {
                roots: roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if files.len() > max_files {
            let stride = files.len() as f64 / max_files as f64;
            files = (0..max_files)
                .map(|i| files[(i as f64 * stride) as usize].clone())
                .collect();
        }
        Ok(Self { files })
    }
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = rd.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Ok(ft) = e.file_type() else { continue };
        let path = e.path();
        if ft.is_dir() {
            if !name.starts_with('.') && name != "target" {
                walk(root, &path, out);
            }
        } else if ft.is_file()
            && path
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| SOURCE_EXTENSIONS.contains(&x))
            && e.metadata()
                .is_ok_and(|m| (MIN_FILE_BYTES..=MAX_FILE_BYTES).contains(&m.len()))
        {
            let display = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .display()
                .to_string();
            out.push((path, display));
        }
    }
}

/// Shape of the generated conversations.
#[derive(Clone, Debug, PartialEq)]
pub struct AgenticSpec {
    /// Target prompt tokens of each conversation's first request (system +
    /// first user turn, counted with [`TokenCounter::count_chat`]); the first
    /// request lands in about `[prefix, prefix + PREFIX_OVERSHOOT_TOKENS]`; one group
    /// of conversations per value, e.g. `[2048, 4096, 8192, 16384, 24576]`.
    pub prefix_tokens: Vec<u64>,
    /// Conversations per prefix length.
    pub conversations_per_prefix: usize,
    /// User turns (requests) per conversation, >= 1.
    pub user_turns: usize,
    /// Tokens of each later turn's tool output (at least).
    pub tool_output_tokens: u64,
    /// Each later turn's tool output is also at least this fraction of the
    /// conversation's prefix (0 = off), so that the new part of a turn
    /// scales with the conversation's size as in the published runs: their ON TTFTs imply
    /// about 9k new of 24k tokens for Qwen3-32B and 4k of 20k for GLM-5-FP8
    /// (see kvloop-engine-sim's `profile` module).
    pub tool_output_fraction: f64,
    /// Tokens of each reference answer (`max_tokens` per request).
    pub answer_tokens: u64,
    /// Seed of the ChaCha8 stream choosing files, tasks and questions.
    pub seed: u64,
}

impl AgenticSpec {
    /// Tokens of a later turn's tool output in a conversation of `prefix`
    /// tokens: `max(tool_output_tokens, tool_output_fraction × prefix)`.
    pub fn tool_output_tokens_for(&self, prefix: u64) -> u64 {
        self.tool_output_tokens
            .max((self.tool_output_fraction * prefix as f64).round() as u64)
    }
}

impl Default for AgenticSpec {
    /// 2k…24k prefixes as in the published sweep, 2 conversations each, 4
    /// turns, 512-token tool outputs, 64-token answers, seed 0.
    fn default() -> Self {
        Self {
            prefix_tokens: vec![2048, 4096, 8192, 16384, 24576],
            conversations_per_prefix: 2,
            user_turns: 4,
            tool_output_tokens: 512,
            tool_output_fraction: 0.0,
            answer_tokens: 64,
            seed: 0,
        }
    }
}

const TASKS: &[&str] = &[
    "Find why this code allocates on every call in the hot path and propose a fix.",
    "Add error handling for the failure cases that are silently ignored here.",
    "Explain how the public API of these files fits together, then write a unit test.",
    "There is an off-by-one in one of the bounds checks below; find it and patch it.",
    "Refactor the duplicated logic into a helper without changing behaviour.",
    "Document the invariants these functions rely on and check that callers keep them.",
];

const FOLLOW_UPS: &[&str] = &[
    "Does this file change your diagnosis? Answer briefly.",
    "Which function here should change? Quote its signature.",
    "Propose the smallest patch for the relevant part.",
    "List the callers we still need to read.",
    "Summarize what you learned from this file in three bullet points.",
];

/// Cut of a file: up to `max_tokens` tokens of its text, or `None` when
/// unreadable or not UTF-8.
fn file_cut(tok: &TokenCounter, path: &Path, max_tokens: usize) -> Option<(String, usize)> {
    let text = std::fs::read_to_string(path).ok()?;
    let ids = tok.encode(&text);
    let n = ids.len().min(max_tokens);
    if n == ids.len() {
        Some((text, n))
    } else {
        Some((tok.decode_lossy(&ids[..n]), n))
    }
}

fn tool_block(display: &str, body: &str) -> String {
    format!("### `cat {display}`\n```\n{body}\n```\n\n")
}

/// Generates `prefix_tokens.len() × conversations_per_prefix` conversations,
/// ids `agentic-p<prefix>-c<k>` (see the module docs for their layout).
///
/// Errors: [`LoadgenError::Config`] for `user_turns == 0`;
/// [`LoadgenError::NoSourceFiles`] when no file of the corpus can be read.
pub fn generate_agentic(
    spec: &AgenticSpec,
    corpus: &SourceCorpus,
    tok: &TokenCounter,
) -> Result<Vec<Conversation>> {
    if spec.user_turns == 0 {
        return Err(LoadgenError::Config {
            field: "user_turns".into(),
            message: "must be >= 1".into(),
        });
    }
    if !(spec.tool_output_fraction.is_finite() && (0.0..=4.0).contains(&spec.tool_output_fraction))
    {
        return Err(LoadgenError::Config {
            field: "tool_output_fraction".into(),
            message: format!(
                "expected a number in 0..=4 (fraction of the prefix), got {}",
                spec.tool_output_fraction
            ),
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut out = Vec::new();
    for &prefix in &spec.prefix_tokens {
        for k in 0..spec.conversations_per_prefix {
            let id = format!("agentic-p{prefix}-c{k}");
            out.push(one_conversation(
                spec,
                corpus,
                tok,
                &mut rng,
                id,
                prefix as usize,
            )?);
        }
    }
    Ok(out)
}

fn pick_file<'a>(corpus: &'a SourceCorpus, rng: &mut ChaCha8Rng) -> &'a (PathBuf, String) {
    &corpus.files[rng.random_range(0..corpus.files.len())]
}

fn one_conversation(
    spec: &AgenticSpec,
    corpus: &SourceCorpus,
    tok: &TokenCounter,
    rng: &mut ChaCha8Rng,
    id: String,
    prefix: usize,
) -> Result<Conversation> {
    let no_files = || LoadgenError::NoSourceFiles {
        roots: "(corpus: no readable UTF-8 file)".into(),
    };
    let system = Message::new(
        "system",
        format!(
            "You are a coding agent. You read files with the `cat` tool, reason about the code \
             and answer concisely. Session {id}."
        ),
    );
    let task = *TASKS.choose(rng).expect("tasks");
    let head = format!("Task: {task}\n\nThe files you opened so far follow.\n\n");
    let tail = "Start by stating your plan.";
    let mut used = tok.count_chat(&[
        system.clone(),
        Message::new("user", format!("{head}{tail}")),
    ]);
    let mut body = String::new();
    let mut misses = 0;
    // Fill to `prefix + PREFIX_OVERSHOOT_TOKENS`, so the first request lands
    // at or just above `prefix` despite BPE merges across block joins.
    let target = prefix + PREFIX_OVERSHOOT_TOKENS;
    while used < prefix && misses < 64 {
        let (path, display) = pick_file(corpus, rng);
        let wrapper = tok.count(&tool_block(display, ""));
        let room = target.saturating_sub(used + wrapper);
        if room < 16 {
            break;
        }
        let Some((cut, n)) = file_cut(tok, path, room.min(MAX_TOKENS_PER_CONTEXT_FILE)) else {
            misses += 1;
            continue;
        };
        body.push_str(&tool_block(display, &cut));
        used += wrapper + n;
    }
    if body.is_empty() && prefix > used {
        return Err(no_files());
    }
    let mut messages = vec![system, Message::new("user", format!("{head}{body}{tail}"))];
    for turn in 0..spec.user_turns {
        let (answer, _) = loop {
            let (path, _) = pick_file(corpus, rng);
            if let Some(c) = file_cut(tok, path, spec.answer_tokens as usize) {
                break c;
            }
            misses += 1;
            if misses > 256 {
                return Err(no_files());
            }
        };
        messages.push(Message::new("assistant", answer));
        if turn + 1 == spec.user_turns {
            break;
        }
        let want = spec.tool_output_tokens_for(prefix as u64) as usize;
        let mut block = String::new();
        let mut got = 0;
        while got < want {
            let (path, display) = pick_file(corpus, rng);
            match file_cut(tok, path, want - got) {
                Some((cut, n)) if n > 0 => {
                    block.push_str(&tool_block(display, &cut));
                    got += n;
                }
                _ => {
                    misses += 1;
                    if misses > 256 {
                        return Err(no_files());
                    }
                }
            }
        }
        let q = *FOLLOW_UPS.choose(rng).expect("follow-ups");
        messages.push(Message::new("user", format!("Tool result:\n{block}{q}")));
    }
    Ok(Conversation { id, messages })
}
