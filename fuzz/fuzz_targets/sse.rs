//! `SseParser` on arbitrary bytes cut into arbitrary chunks: the first byte
//! says how many cut points follow (0..=15), each one byte scaled to the
//! stream's length; the rest is the stream. The events must not depend on
//! where the chunks split (one push, the chosen cuts, one byte per push),
//! and the blocks' raw bytes must add up to the stream exactly.
#![no_main]

use kvloop_router_api::{SseEvent, SseParser};
use libfuzzer_sys::fuzz_target;

fn parse<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Vec<SseEvent> {
    let mut p = SseParser::new();
    let mut out = Vec::new();
    for c in chunks {
        out.extend(p.push(c));
    }
    out.extend(p.finish());
    assert_eq!(p.finish(), None, "finish twice returns nothing more");
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 16).min(rest.len());
    let (cuts, stream) = rest.split_at(n);
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) * stream.len() / 255)
        .collect();
    at.sort_unstable();
    let mut chunks = Vec::with_capacity(at.len() + 2);
    let mut prev = 0;
    for &i in &at {
        chunks.push(&stream[prev..i]);
        prev = i;
    }
    chunks.push(&stream[prev..]);

    let whole = parse([stream]);
    let raw: Vec<u8> = whole.iter().flat_map(|e| e.raw.iter().copied()).collect();
    assert_eq!(raw, stream, "raw bytes add up to the stream");
    for e in &whole {
        assert!(!e.raw.is_empty(), "no empty block");
    }
    assert_eq!(parse(chunks), whole, "split at {at:?}");
    if stream.len() <= 4096 {
        assert_eq!(parse(stream.chunks(1)), whole, "one byte per push");
    }
    let mut with_empty = vec![&[][..]];
    with_empty.push(stream);
    with_empty.push(&[]);
    assert_eq!(parse(with_empty), whole, "empty pushes");
});
