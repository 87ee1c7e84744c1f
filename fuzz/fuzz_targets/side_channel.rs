//! The side channel's frames: a stream of `u32` big-endian length headers
//! and JSON `Message` bodies (`frame_len`, `decode_message`); the whole
//! input is also decoded as one body. What decodes must encode
//! (`encode_message`) to a frame that decodes to an equal message. The
//! bodies are slices of the input: nothing allocates the announced length.
#![no_main]

use kvloop_kv_types::sidechannel::{decode_message, encode_message, frame_len};
use libfuzzer_sys::fuzz_target;

fn body(b: &[u8]) {
    let Ok(m) = decode_message(b, "fuzz") else {
        return;
    };
    let frame = encode_message(&m);
    let (head, wire) = frame.split_first_chunk::<4>().expect("a header");
    assert_eq!(
        frame_len(*head, "fuzz").expect("within the limit"),
        wire.len()
    );
    assert_eq!(decode_message(wire, "fuzz").expect("re-decodes"), m);
}

fuzz_target!(|data: &[u8]| {
    body(data);
    let mut rest = data;
    while let Some((head, tail)) = rest.split_first_chunk::<4>() {
        let Ok(len) = frame_len(*head, "fuzz") else {
            return;
        };
        let (b, tail) = tail.split_at(len.min(tail.len()));
        body(b);
        rest = tail;
    }
});
