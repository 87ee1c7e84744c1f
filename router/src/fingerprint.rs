//! Prefix fingerprints for the prefix safety check (docs/protocol.md Router rule 3).
//! Pure: no I/O.
//!
//! The router does not keep whole prompts. It keeps, per stored turn, hashes
//! (XXH3-64) of what D's blocks cover:
//!
//! - **tokens**: the previous turn's prompt token ids (`n` tokens and the hash
//!   of all `n`), when they were known (engine `/tokenize` or a token-id
//!   prompt). The next prompt must start with exactly those tokens.
//! - **history**: the previous turn's messages plus the assistant's answer
//!   (chat), or prompt text plus completion text (completions). The next
//!   request must start with exactly that history. This also covers the
//!   generated tail, whose token ids the router never sees.
//!
//! A turn is attachable when every fingerprint both sides have matches, at
//! least one was compared, and the new prompt is not shorter than
//! `remote_num_tokens` (when its token count is known).
use serde_json::Value;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

/// Hash of a token id sequence (little-endian u32s).
pub fn hash_tokens(tokens: &[u32]) -> u64 {
    // Fed 256 ids at a time: the same digest as id by id (a streaming
    // hash), for a tenth of the instructions.
    let mut h = Xxh3::new();
    let mut buf = [0u8; 1024];
    for chunk in tokens.chunks(256) {
        for (b, t) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.digest()
}

/// Streaming hasher of a conversation history. Messages are encoded as
/// `role 0xFF content 0xFE` (bytes 0xFE/0xFF never occur in UTF-8); a
/// non-string content is encoded as its compact JSON text.
#[derive(Clone)]
pub struct HistoryHasher {
    h: Xxh3,
    len: u32,
}

impl Default for HistoryHasher {
    fn default() -> Self {
        Self {
            h: Xxh3::new(),
            len: 0,
        }
    }
}

impl HistoryHasher {
    /// Add one whole chat message.
    pub fn message(&mut self, m: &Value) {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        self.h.update(role.as_bytes());
        self.h.update(&[0xff]);
        match m.get("content") {
            Some(Value::String(s)) => self.h.update(s.as_bytes()),
            Some(Value::Null) | None => {}
            Some(other) => self.h.update(other.to_string().as_bytes()),
        }
        self.h.update(&[0xfe]);
        self.len += 1;
    }
    /// Add an assistant message whose content is `text`.
    pub fn assistant(&mut self, text: &str) {
        self.h.update(b"assistant\xff");
        self.h.update(text.as_bytes());
        self.h.update(&[0xfe]);
        self.len += 1;
    }
    /// Add raw text (completions prompt or answer); `len` counts bytes.
    pub fn text(&mut self, s: &str) {
        self.h.update(s.as_bytes());
        self.len += s.len() as u32;
    }
    /// `(len, hash)`: messages covered (chat) or bytes covered (completions).
    pub fn finish(&self) -> (u32, u64) {
        (self.len, self.h.digest())
    }
}

/// What the router knows of a new request's prompt.
#[derive(Debug, Clone, Copy)]
pub enum History<'a> {
    /// Chat messages.
    Chat(&'a [Value]),
    /// Completions prompt text.
    Text(&'a str),
    /// No comparable history (e.g. a token-id prompt).
    None,
}

impl History<'_> {
    /// Hash of the first `len` units (messages or bytes), or `None` when the
    /// history is shorter or not comparable.
    pub fn prefix_hash(&self, len: u32) -> Option<u64> {
        match self {
            History::Chat(msgs) => {
                let len = len as usize;
                if msgs.len() < len {
                    return None;
                }
                let mut h = HistoryHasher::default();
                msgs[..len].iter().for_each(|m| h.message(m));
                Some(h.finish().1)
            }
            History::Text(s) => {
                let b = s.as_bytes();
                (b.len() >= len as usize).then(|| xxh3_64(&b[..len as usize]))
            }
            History::None => None,
        }
    }
}

/// Fingerprint of what a stored turn's D blocks cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fingerprint {
    /// Previous prompt's token count (0: unknown).
    pub tokens_len: u32,
    /// [`hash_tokens`] of those tokens.
    pub tokens_hash: u64,
    /// History units covered (0: unknown).
    pub history_len: u32,
    /// Hash of that history (including the answer).
    pub history_hash: u64,
}

/// Outcome of a prefix comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixCheck {
    /// The new prompt extends what D holds.
    Extends,
    /// It does not (edited or different history).
    Mismatch,
    /// It is shorter than `remote_num_tokens`.
    Shorter,
    /// Nothing comparable on both sides: never attach.
    Unverifiable,
}

/// Compare a new prompt against a stored fingerprint.
pub fn check_prefix(
    fp: &Fingerprint,
    remote_num_tokens: u64,
    tokens: Option<&[u32]>,
    history: History<'_>,
) -> PrefixCheck {
    let mut compared = false;
    if let Some(t) = tokens {
        if (t.len() as u64) < remote_num_tokens {
            return PrefixCheck::Shorter;
        }
        if fp.tokens_len > 0 {
            let n = fp.tokens_len as usize;
            if t.len() < n || hash_tokens(&t[..n]) != fp.tokens_hash {
                return PrefixCheck::Mismatch;
            }
            compared = true;
        }
    }
    if fp.history_len > 0 && !matches!(history, History::None) {
        match history.prefix_hash(fp.history_len) {
            Some(h) if h == fp.history_hash => compared = true,
            _ => return PrefixCheck::Mismatch,
        }
    }
    if compared {
        PrefixCheck::Extends
    } else {
        PrefixCheck::Unverifiable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stored fingerprints outlive a router version: the digest is the
    /// xxh3-64 of the ids' little-endian bytes, however they are fed.
    #[test]
    fn token_hash_is_xxh3_of_the_le_bytes() {
        for n in [0usize, 1, 255, 256, 257, 1000] {
            let t: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(40_503)).collect();
            let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(hash_tokens(&t), xxh3_64(&bytes), "{n} ids");
        }
    }
    use serde_json::json;

    #[test]
    fn chat_history_with_answer_matches_next_turn() {
        let turn1 = [json!({"role": "user", "content": "hi"})];
        let mut h = HistoryHasher::default();
        turn1.iter().for_each(|m| h.message(m));
        // the answer arrives in streamed pieces
        let mut h2 = h.clone();
        h2.assistant("hello there");
        let (len, hash) = h2.finish();
        let fp = Fingerprint {
            history_len: len,
            history_hash: hash,
            ..Default::default()
        };
        let turn2 = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello there"}),
            json!({"role": "user", "content": "more"}),
        ];
        assert_eq!(
            check_prefix(&fp, 0, None, History::Chat(&turn2)),
            PrefixCheck::Extends
        );
        let mut edited = turn2.clone();
        edited[0]["content"] = json!("HI");
        assert_eq!(
            check_prefix(&fp, 0, None, History::Chat(&edited)),
            PrefixCheck::Mismatch
        );
        assert_eq!(
            check_prefix(&fp, 0, None, History::Chat(&turn2[..1])),
            PrefixCheck::Mismatch
        );
    }

    #[test]
    fn tokens_must_extend_and_not_be_shorter() {
        let t1 = [1u32, 2, 3];
        let fp = Fingerprint {
            tokens_len: 3,
            tokens_hash: hash_tokens(&t1),
            ..Default::default()
        };
        assert_eq!(
            check_prefix(&fp, 4, Some(&[1, 2, 3, 9, 9]), History::None),
            PrefixCheck::Extends
        );
        assert_eq!(
            check_prefix(&fp, 4, Some(&[1, 2, 4, 9, 9]), History::None),
            PrefixCheck::Mismatch
        );
        assert_eq!(
            check_prefix(&fp, 6, Some(&[1, 2, 3, 9, 9]), History::None),
            PrefixCheck::Shorter
        );
        assert_eq!(
            check_prefix(&Fingerprint::default(), 0, Some(&[1]), History::None),
            PrefixCheck::Unverifiable
        );
    }

    #[test]
    fn text_prefix() {
        let mut h = HistoryHasher::default();
        h.text("once upon");
        h.text(" a time");
        let (len, hash) = h.finish();
        let fp = Fingerprint {
            history_len: len,
            history_hash: hash,
            ..Default::default()
        };
        assert_eq!(
            check_prefix(&fp, 0, None, History::Text("once upon a time, more")),
            PrefixCheck::Extends
        );
        assert_eq!(
            check_prefix(&fp, 0, None, History::Text("once upon a tim")),
            PrefixCheck::Mismatch
        );
    }
}
