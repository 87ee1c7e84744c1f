//! Token counting with a real BPE tokenizer embedded in a crate.
//!
//! Choice: `tiktoken-rs` 0.7, whose BPE rank files are compiled into the
//! crate (`include_str!`), so counting works offline with nothing downloaded
//! at run time. Default encoding `cl100k_base`: its pre-tokenizer regex is
//! the one Qwen2/Qwen3's byte-level BPE uses (apart from Qwen splitting
//! digits), and its vocabulary size (100k) is the closest of the embedded ones
//! to Qwen3's 151k, so prompt lengths in tokens are comparable to the
//! published Qwen3-32B sweep. `o200k_base` (GPT-4o) is available too.
//! The ranks are parsed once per process (a few hundred ms) and shared.
use serde::Serialize;
use tiktoken_rs::CoreBPE;

use crate::Message;

/// Per-message overhead added by [`TokenCounter::count_chat`]: OpenAI's
/// documented estimate for chat formatting (3 tokens per message, 3 priming
/// the reply; "How to count tokens with tiktoken", OpenAI cookbook).
pub const CHAT_TOKENS_PER_MESSAGE: usize = 3;
/// Tokens priming the assistant reply, same source as [`CHAT_TOKENS_PER_MESSAGE`].
pub const CHAT_REPLY_PRIMING_TOKENS: usize = 3;

/// Embedded encodings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Encoding {
    /// `cl100k_base` (GPT-3.5/4).
    Cl100kBase,
    /// `o200k_base` (GPT-4o).
    O200kBase,
}

/// A shared, cheap-to-copy token counter.
#[derive(Clone, Copy)]
pub struct TokenCounter {
    bpe: &'static CoreBPE,
    encoding: Encoding,
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCounter")
            .field("encoding", &self.encoding)
            .finish()
    }
}

impl TokenCounter {
    /// The counter for `encoding` (parsed once per process).
    pub fn new(encoding: Encoding) -> Self {
        let bpe = match encoding {
            Encoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
            Encoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
        };
        Self { bpe, encoding }
    }

    /// `cl100k_base` (see the module docs for why).
    pub fn default_counter() -> Self {
        Self::new(Encoding::Cl100kBase)
    }

    /// Parses `cl100k_base` or `o200k_base`; `None` for anything else.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "cl100k_base" | "cl100k" => Some(Self::new(Encoding::Cl100kBase)),
            "o200k_base" | "o200k" => Some(Self::new(Encoding::O200kBase)),
            _ => None,
        }
    }

    /// Encoding name, e.g. `cl100k_base`.
    pub fn name(&self) -> &'static str {
        match self.encoding {
            Encoding::Cl100kBase => "cl100k_base",
            Encoding::O200kBase => "o200k_base",
        }
    }

    /// Token ids of `text` (special-token strings are treated as plain text).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Number of tokens of `text`.
    pub fn count(&self, text: &str) -> usize {
        self.encode(text).len()
    }

    /// Text of `tokens`; a multi-byte character cut at either end becomes U+FFFD.
    pub fn decode_lossy(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = self
            .bpe
            ._decode_native_and_split(tokens.to_vec())
            .flatten()
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Prompt tokens of a chat request: content tokens plus
    /// [`CHAT_TOKENS_PER_MESSAGE`] per message plus [`CHAT_REPLY_PRIMING_TOKENS`].
    pub fn count_chat(&self, messages: &[Message]) -> usize {
        messages
            .iter()
            .map(|m| self.count(&m.content) + CHAT_TOKENS_PER_MESSAGE)
            .sum::<usize>()
            + CHAT_REPLY_PRIMING_TOKENS
    }
}
