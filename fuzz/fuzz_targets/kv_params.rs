//! `KvTransferParams::parse` (and the `RawObject` under it) on arbitrary
//! text. Besides not panicking: what parses serializes to text that parses
//! to an equal value, members untouched by a setter keep their exact text
//! (unknown keys byte for byte), an optional member present and not null
//! is typed (never silently taken as absent), and the setters' values come
//! back.
#![no_main]

use kvloop_router_api::KvTransferParams;
use kvloop_router_api::json::RawObject;
use kvloop_router_api::kv_params::KNOWN_KEYS;
use libfuzzer_sys::fuzz_target;

fn unknown(p: &KvTransferParams) -> Vec<(String, String)> {
    p.unknown()
        .map(|(k, v)| (k.to_string(), v.get().to_string()))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(obj) = RawObject::parse(text) else {
        assert!(KvTransferParams::parse(text).is_err(), "not an object");
        return;
    };
    let json = obj.to_json();
    let again = RawObject::parse(&json).expect("RawObject::to_json re-parses");
    assert_eq!(again, obj, "RawObject round trip");
    assert_eq!(again.to_json(), json, "RawObject::to_json is stable");

    let Ok(p) = KvTransferParams::parse(text) else {
        return;
    };
    assert_eq!(p.raw(), &obj, "every member kept as received");
    let json = p.to_json();
    let q = KvTransferParams::parse(&json).expect("to_json re-parses");
    assert_eq!(q, p, "parse(to_json(p)) == p");
    assert_eq!(q.to_json(), json);
    let expected: Vec<(String, String)> = obj
        .0
        .iter()
        .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()) && k != "transfer_mode")
        .map(|(k, v)| (k.clone(), v.get().to_string()))
        .collect();
    assert_eq!(
        unknown(&p),
        expected,
        "unknown members kept, in order, byte for byte"
    );
    let _ = p.to_raw_value();
    // An optional member present and not null is typed (or the parse failed).
    let present = |k: &str| obj.get(k).is_some_and(|v| v.get() != "null");
    for (k, typed) in [
        ("remote_host", p.remote_host.is_some()),
        ("remote_num_tokens", p.remote_num_tokens.is_some()),
        ("tp_size", p.tp_size.is_some()),
        ("do_remote_decode", p.do_remote_decode.is_some()),
        ("do_remote_prefill", p.do_remote_prefill.is_some()),
        ("remote_blocks_expiry_time", p.remote_blocks_expiry_time.is_some()),
        ("transfer_mode", p.transfer_mode.is_some()),
    ] {
        assert_eq!(present(k), typed, "`{k}` present but not typed");
    }

    // The setters change their members only.
    let mut s = p.clone();
    let host = format!("{}x", p.remote_request_id);
    s.set_remote_host(&host);
    s.set_remote_engine_id(&format!("{}y", p.remote_engine_id));
    s.set_remote_num_tokens(u64::from(p.remote_port) * 3);
    s.set_flags(
        !p.do_remote_decode.unwrap_or(false),
        p.do_remote_prefill != Some(true),
    );
    let r = KvTransferParams::parse(&s.to_json()).expect("set params re-parse");
    assert_eq!(r, s, "setters' values come back");
    assert_eq!(r.remote_host.as_deref(), Some(host.as_str()));
    assert_eq!(
        unknown(&r),
        unknown(&p),
        "setters leave unknown members alone"
    );
    assert_eq!(
        (
            r.remote_block_ids,
            r.remote_port,
            r.tp_size,
            r.transfer_mode
        ),
        (
            p.remote_block_ids,
            p.remote_port,
            p.tp_size,
            p.transfer_mode
        )
    );
    assert_eq!(
        r.remote_blocks_expiry_time.map(f64::to_bits),
        p.remote_blocks_expiry_time.map(f64::to_bits)
    );
});
