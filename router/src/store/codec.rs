//! Keys and values of the shared (Redis) store. Pure: no I/O.
//!
//! Key: `<prefix>:conv:<tenant byte length>:<tenant>:<conversation_id>`; the
//! length prefix keeps tenants apart whatever bytes the ids contain (tenant
//! `a:b` + conversation `c` and tenant `a` + conversation `b:c` differ).
//!
//! Value: compact JSON `{"v":1,"d":"<decode engine id>","n":<remote_num_tokens>,
//! "f":[tokens_len,tokens_hash,history_len,history_hash],"p":<CompactParams>}`.
//! The decode engine is stored by id, not by registry index, so replicas whose
//! registries list engines in another order agree. Integers are written and
//! read as integers (serde_json keeps u64 exact), so the params survive
//! bit-exact.
use serde::{Deserialize, Serialize};

use super::{ConvKey, StoredTurn};
use crate::fingerprint::Fingerprint;
use crate::params::CompactParams;

/// Version written in every value; values of another version read as missing.
pub const VALUE_VERSION: u8 = 1;

/// Largest block id count a stored value may expand to (guards a corrupt
/// value): 16 Mi blocks, far above any engine's KV cache.
pub const MAX_BLOCK_IDS: u64 = 1 << 24;

/// A value read back from the store that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not the JSON shape above (the message says where).
    #[error("stored value: {0}")]
    Json(String),
    /// Written by another version of the router.
    #[error("stored value: version {0}, expected {VALUE_VERSION}")]
    Version(u8),
    /// The params' block runs are malformed or too large.
    #[error("stored value: malformed block id runs")]
    Params,
    /// The decode engine is not in this router's registry.
    #[error("stored value: decode engine {0:?} is not in the registry")]
    UnknownEngine(String),
}

#[derive(Serialize, Deserialize)]
struct Wire<'a> {
    v: u8,
    #[serde(borrow)]
    d: std::borrow::Cow<'a, str>,
    n: u32,
    f: (u32, u64, u32, u64),
    p: CompactParams,
    /// Stored at, Unix ms (absent in values written before it: 0).
    #[serde(default)]
    s: u64,
}

/// Redis key of `key` under `prefix`.
pub fn redis_key(prefix: &str, key: &ConvKey) -> String {
    let (t, c) = (key.tenant(), key.conversation_id());
    format!("{prefix}:conv:{}:{t}:{c}", t.len())
}

/// Encode a turn; `decode_engine_id` is the registry id of `turn.decode_engine`.
pub fn encode(turn: &StoredTurn, decode_engine_id: &str) -> Vec<u8> {
    let fp = &turn.fingerprint;
    serde_json::to_vec(&Wire {
        v: VALUE_VERSION,
        d: decode_engine_id.into(),
        n: turn.remote_num_tokens,
        f: (
            fp.tokens_len,
            fp.tokens_hash,
            fp.history_len,
            fp.history_hash,
        ),
        p: turn.params.clone(),
        s: turn.stored_at_unix_ms,
    })
    .expect("serializable")
}

/// Decode a value; `index_of` maps an engine id to its registry index. The
/// turn's `expires_at_ms` is set to `now_ms` (the remaining TTL is Redis's).
///
/// # Errors
/// [`DecodeError`] when the value is not usable.
pub fn decode(
    bytes: &[u8],
    now_ms: u64,
    index_of: impl Fn(&str) -> Option<u16>,
) -> Result<StoredTurn, DecodeError> {
    let w: Wire<'_> =
        serde_json::from_slice(bytes).map_err(|e| DecodeError::Json(e.to_string()))?;
    if w.v != VALUE_VERSION {
        return Err(DecodeError::Version(w.v));
    }
    if !w.p.well_formed(MAX_BLOCK_IDS) {
        return Err(DecodeError::Params);
    }
    let decode_engine =
        index_of(&w.d).ok_or_else(|| DecodeError::UnknownEngine(w.d.to_string()))?;
    Ok(StoredTurn {
        params: w.p,
        decode_engine,
        remote_num_tokens: w.n,
        fingerprint: Fingerprint {
            tokens_len: w.f.0,
            tokens_hash: w.f.1,
            history_len: w.f.2,
            history_hash: w.f.3,
        },
        expires_at_ms: now_ms,
        stored_at_unix_ms: w.s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::KvParams;
    use serde_json::json;

    fn turn() -> StoredTurn {
        let p = KvParams::parse(&json!({"remote_engine_id": "d1", "remote_request_id": "r-\u{1F600}\"x",
            "remote_block_ids": [[1, 2, 3, 9, 4294967295u32], [7]], "remote_port": 5601, "tp_size": 2,
            "remote_num_tokens": 77, "opaque": {"a": [1.5, null]}}))
        .unwrap();
        StoredTurn {
            params: p.compact(),
            decode_engine: 1,
            remote_num_tokens: 77,
            fingerprint: Fingerprint {
                tokens_len: 70,
                tokens_hash: u64::MAX - 3,
                history_len: 4,
                history_hash: 0x8000_0000_0000_0001,
            },
            expires_at_ms: 123,
            stored_at_unix_ms: 1_764_000_000_123,
        }
    }

    fn idx(id: &str) -> Option<u16> {
        ["p0", "d1"].iter().position(|e| *e == id).map(|i| i as u16)
    }

    #[test]
    fn round_trips_bit_exact() {
        let t = turn();
        let b = encode(&t, "d1");
        let back = decode(&b, 500, idx).unwrap();
        assert_eq!(back.params, t.params);
        assert_eq!(back.fingerprint, t.fingerprint);
        assert_eq!((back.decode_engine, back.remote_num_tokens), (1, 77));
        assert_eq!(
            back.params.expand("d1", 77, "h"),
            t.params.expand("d1", 77, "h")
        );
        assert_eq!(back.stored_at_unix_ms, t.stored_at_unix_ms);
        assert!(b.len() < 320, "{} bytes", b.len());
        // A value written before the store time was carried: unknown (0).
        let old = String::from_utf8(b)
            .unwrap()
            .replace(",\"s\":1764000000123", "");
        assert!(!old.contains("\"s\""), "{old}");
        assert_eq!(
            decode(old.as_bytes(), 500, idx).unwrap().stored_at_unix_ms,
            0
        );
    }

    #[test]
    fn rejects_unusable_values() {
        let b = encode(&turn(), "d9");
        assert_eq!(
            decode(&b, 0, idx).unwrap_err(),
            DecodeError::UnknownEngine("d9".into())
        );
        assert!(matches!(decode(b"{", 0, idx), Err(DecodeError::Json(_))));
        let v2 = String::from_utf8(encode(&turn(), "d1"))
            .unwrap()
            .replace("\"v\":1", "\"v\":2");
        assert_eq!(
            decode(v2.as_bytes(), 0, idx).unwrap_err(),
            DecodeError::Version(2)
        );
        let bad = br#"{"v":1,"d":"d1","n":1,"f":[0,0,0,0],"p":{"runs":[2,1,5],"flat":false,"rest":"{}"}}"#;
        assert_eq!(decode(bad, 0, idx).unwrap_err(), DecodeError::Params);
        let huge = br#"{"v":1,"d":"d1","n":1,"f":[0,0,0,0],"p":{"runs":[1,1,0,4294967295],"flat":false,"rest":"{}"}}"#;
        assert_eq!(decode(huge, 0, idx).unwrap_err(), DecodeError::Params);
    }

    #[test]
    fn keys_keep_tenants_apart() {
        let a = redis_key("kv", &ConvKey::new("a:b", "c"));
        let b = redis_key("kv", &ConvKey::new("a", "b:c"));
        assert_ne!(a, b);
        assert_eq!(a, "kv:conv:3:a:b:c");
    }
}
