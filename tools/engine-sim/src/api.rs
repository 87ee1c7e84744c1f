//! What the OpenAI handlers and the decoder share: which API a request came
//! through, the fixed `created` stamp, the generated words and the `"sim"`
//! test knobs of a request body.
use serde_json::Value;

/// The `created` timestamp of every response (fixed: responses are deterministic).
pub(crate) const CREATED: u64 = 1_700_000_000;

/// The OpenAI API a request came through.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Api {
    /// OpenAI's `object` of a response (`chunk`: a streamed chunk).
    pub(crate) fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completions, _) => "text_completion",
        }
    }
}

/// Whether the request body's `"sim"` object sets knob `name` to true.
pub(crate) fn knob(body: &Value, name: &str) -> bool {
    body.get("sim")
        .and_then(|s| s.get(name))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// The words D generates for `max_tokens` tokens: `tok0 tok1 …`.
pub(crate) fn words(max_tokens: u64) -> Vec<String> {
    (0..max_tokens).map(|i| format!("tok{i}")).collect()
}
