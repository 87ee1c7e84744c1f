//! Synthetic conversations from a `generate_conversations` description.
//!
//! The layout follows vLLM's `benchmarks/multi_turn/bench_dataset.py` so the
//! same description produces the same shape of load:
//!
//! - turns per conversation from `num_turns`, at least 2, rounded up to even
//!   (user/assistant pairs);
//! - an optional common prefix (`common_prefix_num_tokens`, one sample) put
//!   in front of every conversation's first user turn;
//! - a per-conversation context of `prefix_num_tokens` tokens in the first user
//!   turn, taken from consecutive, non-overlapping parts of the text;
//! - every user turn holds about `num_tokens` tokens: a short unique lead-in,
//!   the instruction "Please rewrite the following text and add more content: "
//!   and text cut from the files;
//! - assistant messages are references of `prompt_output.num_tokens` tokens
//!   (the client uses their length as `max_tokens`).
//!
//! Randomness: a [`ChaCha8Rng`] seeded by the caller, so a seed fixes the
//! result for the same text files and tokenizer.
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::input::GenerateSpec;
use crate::tokenizer::TokenCounter;
use crate::{Conversation, LoadgenError, Message, Result};

/// Instruction text of every generated user turn (as in vLLM's generator).
pub const BASE_PROMPT: &str = "Please rewrite the following text and add more content: ";

/// Reads `spec.text_files`, tokenizes them and generates the conversations.
///
/// Errors: [`LoadgenError::Io`] for an unreadable file,
/// [`LoadgenError::NotEnoughText`] when the files are too short for the samples.
pub fn generate_conversations(
    spec: &GenerateSpec,
    tok: &TokenCounter,
    seed: u64,
) -> Result<Vec<Conversation>> {
    let mut tokens = Vec::new();
    for f in &spec.text_files {
        let text = std::fs::read_to_string(f).map_err(|e| LoadgenError::io(f, e))?;
        tokens.extend(tok.encode(&text));
    }
    generate_from_tokens(spec, &tokens, tok, seed)
}

fn slice<'a>(tokens: &'a [u32], start: usize, len: usize, field: &str) -> Result<&'a [u32]> {
    let end = start + len;
    if end >= tokens.len() {
        return Err(LoadgenError::NotEnoughText {
            field: field.into(),
            start_tokens: start,
            end_tokens: end,
            available_tokens: tokens.len(),
        });
    }
    Ok(&tokens[start..end])
}

/// Pure part of [`generate_conversations`]: `tokens` is the tokenized text of
/// all files, in order.
pub fn generate_from_tokens(
    spec: &GenerateSpec,
    tokens: &[u32],
    tok: &TokenCounter,
    seed: u64,
) -> Result<Vec<Conversation>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = spec.num_conversations;
    let turns: Vec<usize> = spec
        .num_turns
        .sample_n(&mut rng, n)
        .into_iter()
        .map(|t| {
            let t = t.max(2) as usize;
            t + t % 2
        })
        .collect();
    let prefixes = spec.prefix_num_tokens.sample_n(&mut rng, n);
    let base_prompt_tokens = tok.count(BASE_PROMPT);
    let mut base_offset = 0usize;
    let common = spec.common_prefix_num_tokens.sample_n(&mut rng, 1)[0] as usize;
    let common_text = if common > 0 {
        let cut = slice(
            tokens,
            0,
            common.saturating_sub(2),
            "prompt_input.common_prefix_num_tokens",
        )?;
        base_offset += common;
        format!("{}.", tok.decode_lossy(cut))
    } else {
        String::new()
    };
    let mut out = Vec::with_capacity(n);
    for (c, &nturns) in turns.iter().enumerate() {
        let in_counts: Vec<usize> = spec
            .user_num_tokens
            .sample_n(&mut rng, nturns)
            .into_iter()
            .map(|x| (x as usize).max(base_prompt_tokens))
            .collect();
        let out_counts: Vec<usize> = spec
            .output_num_tokens
            .sample_n(&mut rng, nturns)
            .into_iter()
            .map(|x| (x as usize).max(1))
            .collect();
        let max_in = in_counts.iter().copied().max().unwrap_or(0);
        let mut messages = Vec::with_capacity(nturns);
        for t in 0..nturns {
            if t % 2 == 0 {
                let mut content = format!("{c} is a nice number... ");
                if t == 0 && !common_text.is_empty() {
                    content.insert_str(0, &common_text);
                }
                let mut budget = in_counts[t] as i64 - tok.count(&content) as i64;
                if t == 0 && prefixes[c] > 0 {
                    let p = prefixes[c] as usize;
                    let cut = slice(tokens, base_offset, p, "prompt_input.prefix_num_tokens")?;
                    content.push_str(&format!("{c}, "));
                    content.push_str(&tok.decode_lossy(cut));
                    base_offset += p;
                }
                content.push_str(BASE_PROMPT);
                budget -= base_prompt_tokens as i64;
                if budget > 0 {
                    let start = base_offset + t * max_in;
                    let cut = slice(tokens, start, budget as usize, "prompt_input.num_tokens")?;
                    content.push_str(&tok.decode_lossy(cut));
                }
                messages.push(Message::new("user", content));
            } else {
                let cut = slice(tokens, 0, out_counts[t], "prompt_output.num_tokens")?;
                messages.push(Message::new("assistant", tok.decode_lossy(cut)));
            }
        }
        out.push(Conversation {
            id: format!("CONV_ID_{c}"),
            messages,
        });
        base_offset += nturns;
    }
    Ok(out)
}
