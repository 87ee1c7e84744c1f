//! The agent's local-API frames: a stream of `u32` little-endian length
//! headers and bodies, each body decoded as a `Request` (what the agent
//! does) and as a `Response` (what a client does); the whole input is also
//! decoded as one body. What decodes must encode to a body that decodes to
//! an equal value. The bodies are slices of the input: nothing allocates
//! the announced length.
#![no_main]

use kvloop_agent_api::proto::{decode_request, decode_response, frame_len};
use libfuzzer_sys::fuzz_target;

fn body(b: &[u8]) {
    if let Ok(req) = decode_request(b) {
        let wire = serde_json::to_vec(&req).expect("a request serializes");
        assert_eq!(decode_request(&wire).expect("re-decodes"), req);
    }
    if let Ok(resp) = decode_response(b) {
        let wire = serde_json::to_vec(&resp).expect("a response serializes");
        assert_eq!(decode_response(&wire).expect("re-decodes"), resp);
    }
}

fuzz_target!(|data: &[u8]| {
    body(data);
    let mut rest = data;
    while let Some((head, tail)) = rest.split_first_chunk::<4>() {
        let Ok(len) = frame_len(*head) else {
            return;
        };
        // A cut-off body (the stream ended inside it) is decoded as far as it goes.
        let (b, tail) = tail.split_at(len.min(tail.len()));
        body(b);
        rest = tail;
    }
});
