//! Readers for vLLM's `benchmarks/multi_turn` input files.
//!
//! Two shapes are accepted (see `docs/protocol.md`, last section, and
//! vLLM's `benchmarks/multi_turn/bench_dataset.py`):
//!
//! 1. a JSON list of conversations `[{"id": str, "messages": [{"role": str,
//!    "content": str}, ...]}, ...]` (ShareGPT converted to OpenAI roles);
//! 2. a JSON object `{"filetype": "generate_conversations", "num_conversations",
//!    "text_files", "prompt_input": {"num_turns", "common_prefix_num_tokens"?,
//!    "prefix_num_tokens", "num_tokens"}, "prompt_output": {"num_tokens"},
//!    "print_stats"?}` whose leaves are [`Distribution`]s.
//!
//! Parsing is pure (no I/O) apart from [`read_input_file`]. Every error names
//! the JSON path of the bad field.
use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dist::Distribution;
use crate::{LoadgenError, Result};

/// One chat message in OpenAI format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Message text.
    pub content: String,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// One conversation: an id (sent as `conversation_id` / `X-Session-ID`) and
/// its messages. Assistant messages are references only: the client sends
/// the server's real answer as history instead and uses the reference's token
/// count as `max_tokens` for that turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    /// Unique id.
    pub id: String,
    /// Messages in order.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// Number of user turns (requests the client sends for this conversation).
    pub fn user_turns(&self) -> usize {
        self.messages.iter().filter(|m| m.role == "user").count()
    }
}

/// Description of synthetic conversations (`"filetype": "generate_conversations"`).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateSpec {
    /// Conversations to generate (> 0).
    pub num_conversations: usize,
    /// Text files the prompts are cut from, resolved against the input file's
    /// directory when relative (see [`read_input_file`]).
    pub text_files: Vec<PathBuf>,
    /// Messages per conversation (user + assistant), `prompt_input.num_turns`.
    /// Raised to at least 2 and rounded up to an even number when sampled.
    pub num_turns: Distribution,
    /// Tokens of text shared by the first user turn of every conversation,
    /// `prompt_input.common_prefix_num_tokens` (optional, default constant 0).
    pub common_prefix_num_tokens: Distribution,
    /// Tokens of per-conversation context in the first user turn,
    /// `prompt_input.prefix_num_tokens`.
    pub prefix_num_tokens: Distribution,
    /// Tokens of each user turn, `prompt_input.num_tokens`.
    pub user_num_tokens: Distribution,
    /// Tokens of each answer (`max_tokens`), `prompt_output.num_tokens`.
    pub output_num_tokens: Distribution,
    /// `print_stats` (informational).
    pub print_stats: bool,
}

/// A parsed input file.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A conversation list, ready to send.
    Conversations(Vec<Conversation>),
    /// A description to expand with [`crate::generate::generate_conversations`].
    Generate(Box<GenerateSpec>),
}

/// Parses either input shape from JSON text.
///
/// Errors: [`LoadgenError::Json`] when the text is not JSON,
/// [`LoadgenError::Field`] naming the first bad field otherwise.
pub fn parse_input(text: &str) -> Result<Input> {
    let v: Value = serde_json::from_str(text)?;
    parse_input_value(&v)
}

/// Parses either input shape from a JSON value (see [`parse_input`]).
pub fn parse_input_value(v: &Value) -> Result<Input> {
    match v {
        Value::Array(_) => Ok(Input::Conversations(parse_conversations(v)?)),
        Value::Object(o) => match o.get("filetype") {
            Some(Value::String(s)) if s == "generate_conversations" => {
                Ok(Input::Generate(Box::new(parse_generate_spec(v)?)))
            }
            Some(_) => Err(LoadgenError::field(
                "filetype",
                "the string \"generate_conversations\"",
            )),
            None => Err(LoadgenError::field(
                "filetype",
                "a conversation list (JSON array) or an object with \"filetype\": \"generate_conversations\"",
            )),
        },
        _ => Err(LoadgenError::field(
            "$",
            "a conversation list (JSON array) or a generate_conversations object",
        )),
    }
}

/// Reads and parses an input file; relative `text_files` of a
/// `generate_conversations` description are resolved against the file's
/// directory (falling back to the path as given when that does not exist).
pub fn read_input_file(path: &Path) -> Result<Input> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadgenError::io(path, e))?;
    let mut input = parse_input(&text)?;
    if let Input::Generate(spec) = &mut input {
        let dir = path.parent().unwrap_or(Path::new("."));
        for f in &mut spec.text_files {
            if f.is_relative() {
                let joined = dir.join(&*f);
                if joined.exists() {
                    *f = joined;
                }
            }
        }
    }
    Ok(input)
}

/// Parses the conversation list shape. Ids must be unique strings; every
/// conversation needs at least one message and at least one `user` message;
/// roles must be `system`, `user`, `assistant` or `tool`.
pub fn parse_conversations(v: &Value) -> Result<Vec<Conversation>> {
    let list = v
        .as_array()
        .ok_or_else(|| LoadgenError::field("$", "a JSON array of conversations"))?;
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let obj = item.as_object().ok_or_else(|| {
            LoadgenError::field(format!("[{i}]"), "an object with \"id\" and \"messages\"")
        })?;
        let id = match obj.get("id") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(LoadgenError::field(format!("[{i}].id"), "a string")),
            None => {
                return Err(LoadgenError::field(
                    format!("[{i}].id"),
                    "a string (missing)",
                ));
            }
        };
        if !seen.insert(id.clone()) {
            return Err(LoadgenError::field(
                format!("[{i}].id"),
                format!("a unique id (\"{id}\" appears more than once)"),
            ));
        }
        let msgs = obj
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| LoadgenError::field(format!("[{i}].messages"), "a list of messages"))?;
        if msgs.is_empty() {
            return Err(LoadgenError::field(
                format!("[{i}].messages"),
                "at least one message",
            ));
        }
        let mut messages = Vec::with_capacity(msgs.len());
        for (j, m) in msgs.iter().enumerate() {
            let path = format!("[{i}].messages[{j}]");
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| LoadgenError::field(format!("{path}.role"), "a string"))?;
            if !matches!(role, "system" | "user" | "assistant" | "tool") {
                return Err(LoadgenError::field(
                    format!("{path}.role"),
                    format!("one of system, user, assistant, tool (got \"{role}\")"),
                ));
            }
            let content = m
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| LoadgenError::field(format!("{path}.content"), "a string"))?;
            messages.push(Message::new(role, content));
        }
        if !messages.iter().any(|m| m.role == "user") {
            return Err(LoadgenError::field(
                format!("[{i}].messages"),
                "at least one user message",
            ));
        }
        out.push(Conversation { id, messages });
    }
    Ok(out)
}

/// Parses the `generate_conversations` shape (the `filetype` is checked).
pub fn parse_generate_spec(v: &Value) -> Result<GenerateSpec> {
    let o = v
        .as_object()
        .ok_or_else(|| LoadgenError::field("$", "a JSON object"))?;
    if o.get("filetype").and_then(Value::as_str) != Some("generate_conversations") {
        return Err(LoadgenError::field(
            "filetype",
            "the string \"generate_conversations\"",
        ));
    }
    let num_conversations = o
        .get("num_conversations")
        .and_then(Value::as_u64)
        .filter(|&n| n > 0)
        .ok_or_else(|| LoadgenError::field("num_conversations", "an integer > 0"))?
        as usize;
    let files = o
        .get("text_files")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
        .ok_or_else(|| LoadgenError::field("text_files", "a non-empty list of file names"))?;
    let mut text_files = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let s = f.as_str().ok_or_else(|| {
            LoadgenError::field(format!("text_files[{i}]"), "a file name (string)")
        })?;
        text_files.push(PathBuf::from(s));
    }
    let print_stats = match o.get("print_stats") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(LoadgenError::field("print_stats", "true or false")),
    };
    let section = |name: &str| {
        o.get(name)
            .filter(|s| s.is_object())
            .ok_or_else(|| LoadgenError::field(name, "an object of distributions"))
    };
    let pi = section("prompt_input")?;
    let po = section("prompt_output")?;
    let dist = |sec: &Value, sec_name: &str, sub: &str, optional: bool| -> Result<Distribution> {
        let path = format!("{sec_name}.{sub}");
        match sec.get(sub) {
            None if optional => Ok(Distribution::Constant { value: 0.0 }),
            None => Err(LoadgenError::field(path, "a distribution object (missing)")),
            Some(d) => Distribution::from_json(d, &path),
        }
    };
    Ok(GenerateSpec {
        num_conversations,
        text_files,
        num_turns: dist(pi, "prompt_input", "num_turns", false)?,
        common_prefix_num_tokens: dist(pi, "prompt_input", "common_prefix_num_tokens", true)?,
        prefix_num_tokens: dist(pi, "prompt_input", "prefix_num_tokens", false)?,
        user_num_tokens: dist(pi, "prompt_input", "num_tokens", false)?,
        output_num_tokens: dist(po, "prompt_output", "num_tokens", false)?,
        print_stats,
    })
}

/// Serializes conversations in the list shape (what [`parse_conversations`] reads).
pub fn conversations_to_json(convs: &[Conversation]) -> Value {
    serde_json::to_value(convs).expect("conversations serialize")
}
