//! Validation, compact storage and rewriting of `kv_transfer_params`
//! (`docs/operator-guide.md`, "kv_transfer_params"). Pure: no I/O.
//!
//! The object is [`kvloop_router_api::KvTransferParams`]: the fields the
//! router needs are typed, every member (unknown keys, every number's exact
//! text) is kept as received and passes to the next engine unchanged; only
//! `remote_host`, the direction flags and, on reuse, `remote_engine_id` and
//! `remote_num_tokens` are overwritten.
use kvloop_router_api::json::RawObject;
pub use kvloop_router_api::kv_params::{BlockIds, KvTransferParams, ParamsError};
use serde_json::Value;
use serde_json::value::RawValue;

/// An engine's validated params ([`KvTransferParams`], which it derefs to).
#[derive(Debug, Clone, PartialEq)]
pub struct KvParams(pub KvTransferParams);

impl std::ops::Deref for KvParams {
    type Target = KvTransferParams;
    fn deref(&self) -> &KvTransferParams {
        &self.0
    }
}

impl KvParams {
    /// Validate params given as JSON text (the router's engine paths: every
    /// member is kept exactly). See [`KvTransferParams::parse`].
    ///
    /// # Errors
    /// [`ParamsError`] naming the first bad field.
    pub fn parse_json(text: &str) -> Result<Self, ParamsError> {
        KvTransferParams::parse(text).map(Self)
    }

    /// Validate params given as a `serde_json::Value` (tests, client bodies).
    /// Numbers have already gone through `serde_json`'s float parsing here.
    ///
    /// # Errors
    /// [`ParamsError`] naming the first bad field.
    pub fn parse(v: &Value) -> Result<Self, ParamsError> {
        Self::parse_json(&v.to_string())
    }

    /// The object to send to the next engine, with `remote_host` replaced by
    /// `host` (already bracketed for IPv6) and the direction flags set;
    /// every other member exactly as received.
    pub fn to_request_json(
        &self,
        host: &str,
        do_remote_decode: bool,
        do_remote_prefill: bool,
    ) -> Box<RawValue> {
        let mut p = self.0.clone();
        p.set_remote_host(host);
        p.set_flags(do_remote_decode, do_remote_prefill);
        p.to_raw_value()
    }

    /// See [`compact`].
    pub fn compact(&self) -> CompactParams {
        compact(self)
    }
}

/// Compact form for the conversation store (block ids run-length encoded,
/// other members as their exact JSON text, `remote_host`, `remote_engine_id`
/// and `remote_num_tokens` dropped: they are rewritten on use).
pub fn compact(p: &KvTransferParams) -> CompactParams {
    let mut rest = p.raw().clone();
    for k in [
        "remote_block_ids",
        "remote_host",
        "remote_engine_id",
        "remote_num_tokens",
    ] {
        rest.remove(k);
    }
    let mut runs = Vec::new();
    let (flat, groups): (bool, Vec<&[u32]>) = match &p.remote_block_ids {
        BlockIds::Grouped(g) => (false, g.iter().map(Vec::as_slice).collect()),
        BlockIds::Flat(f) => (true, vec![f.as_slice()]),
    };
    runs.push(groups.len() as u32);
    for g in groups {
        let at = runs.len();
        runs.push(0);
        let mut i = 0;
        let mut n = 0u32;
        while i < g.len() {
            let start = g[i];
            let mut len = 1u32;
            while i + (len as usize) < g.len() && g[i + len as usize] == start.wrapping_add(len) {
                len += 1;
            }
            runs.push(start);
            runs.push(len);
            n += 1;
            i += len as usize;
        }
        runs[at] = n;
    }
    CompactParams {
        runs: runs.into_boxed_slice(),
        flat,
        rest: rest.to_json().into_boxed_str(),
    }
}

/// Stored form of D's params: block id runs plus the other keys as JSON text.
/// Layout of `runs`: `[n_groups, (n_runs, (start, len) × n_runs) × n_groups]`.
/// Serde form (for a shared store): `{"runs": [u32...], "flat": bool, "rest": "<json>"}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CompactParams {
    runs: Box<[u32]>,
    flat: bool,
    rest: Box<str>,
}

impl CompactParams {
    /// Heap bytes owned by this value (for the store's memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.runs.len() * 4 + self.rest.len()
    }

    /// `remote_request_id` of D's params: the request id under which D
    /// (its agent, in managed mode) holds the blocks. `None` when absent or
    /// not a string.
    pub fn remote_request_id(&self) -> Option<String> {
        let m = RawObject::parse(&self.rest).ok()?;
        serde_json::from_str::<String>(m.get("remote_request_id")?.get()).ok()
    }

    /// Block ids held per group (every group holds the same blocks of its
    /// layer group; the first one's count), from the runs.
    pub fn block_count(&self) -> u64 {
        let Some((&n_groups, tail)) = self.runs.split_first() else {
            return 0;
        };
        if n_groups == 0 {
            return 0;
        }
        let Some((&n, r)) = tail.split_first() else {
            return 0;
        };
        r.get(..2 * n as usize)
            .map_or(0, |p| p.chunks(2).map(|c| u64::from(c[1])).sum())
    }

    /// True when `runs` follows the layout above, expands to at most `max_ids`
    /// block ids, and `rest` is a JSON object: checked on values read back
    /// from a shared store, which [`CompactParams::expand_json`] would otherwise
    /// index out of bounds.
    pub fn well_formed(&self, max_ids: u64) -> bool {
        let Some((&n_groups, mut tail)) = self.runs.split_first() else {
            return false;
        };
        let mut total = 0u64;
        for _ in 0..n_groups {
            let Some((&n, r)) = tail.split_first() else {
                return false;
            };
            let Some(pairs) = r.get(..2 * n as usize) else {
                return false;
            };
            total += pairs.chunks(2).map(|p| u64::from(p[1])).sum::<u64>();
            tail = &r[2 * n as usize..];
        }
        tail.is_empty()
            && total <= max_ids
            && (!self.flat || n_groups == 1)
            && RawObject::parse(&self.rest).is_ok()
    }

    /// Rebuild the full object as JSON text, with `remote_engine_id`,
    /// `remote_num_tokens`, `remote_host` (from the registry) and the flags of
    /// a D→P reuse request (`do_remote_decode: true`, `do_remote_prefill:
    /// false`); every other member exactly as D sent it.
    pub fn expand_json(&self, engine_id: &str, num_tokens: u64, host: &str) -> Box<RawValue> {
        let mut m = RawObject::parse(&self.rest).unwrap_or_default();
        let mut groups = Vec::new();
        let mut i = 1;
        for _ in 0..self.runs.first().copied().unwrap_or(0) {
            let n = self.runs[i] as usize;
            i += 1;
            let mut ids = Vec::new();
            for _ in 0..n {
                let (start, len) = (self.runs[i], self.runs[i + 1]);
                ids.extend((0..len).map(|k| start.wrapping_add(k)));
                i += 2;
            }
            groups.push(ids);
        }
        let blocks = if self.flat {
            Value::from(groups.into_iter().next().unwrap_or_default())
        } else {
            Value::Array(groups.into_iter().map(Value::from).collect())
        };
        m.set_value("remote_block_ids", &blocks);
        m.set_value("remote_engine_id", engine_id);
        m.set_value("remote_num_tokens", &num_tokens);
        m.set_value("remote_host", host);
        m.set_value("do_remote_decode", &true);
        m.set_value("do_remote_prefill", &false);
        RawValue::from_string(m.to_json()).expect("an object's text is JSON")
    }

    /// [`CompactParams::expand_json`] as a `serde_json::Value` (tests;
    /// numbers go through serde_json's float parsing).
    pub fn expand(&self, engine_id: &str, num_tokens: u64, host: &str) -> Value {
        serde_json::from_str(self.expand_json(engine_id, num_tokens, host).get())
            .expect("valid JSON")
    }
}

/// The "no reuse" prefill shape (docs/protocol.md "Router → P, no reuse").
pub fn no_reuse_prefill_params() -> Value {
    serde_json::json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// Bracket an IPv6 literal (`::1` → `[::1]`); other hosts unchanged.
pub fn bracket_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stored_params_reach_p_bit_exact() {
        let d = r#"{"remote_block_ids":[[5,6]],"remote_engine_id":"d0","remote_request_id":"r1","remote_host":"10.0.0.9","remote_port":5600,"remote_num_tokens":70,"remote_blocks_expiry_time":1214.2449693849999,"x":[1.50,1e3]}"#;
        let p = KvParams::parse_json(d).unwrap();
        let out = p.compact().expand_json("d0", 70, "h").get().to_string();
        assert!(
            out.contains(r#""remote_blocks_expiry_time":1214.2449693849999"#),
            "{out}"
        );
        assert!(out.contains(r#""x":[1.50,1e3]"#), "{out}");
        let to_d = p.to_request_json("h", false, true).get().to_string();
        assert!(to_d.contains("1214.2449693849999"), "{to_d}");
    }

    #[test]
    fn request_id_and_block_count_of_stored_params() {
        let p = KvParams::parse(&d_params()).unwrap().compact();
        assert_eq!(p.remote_request_id().as_deref(), Some("r1"));
        assert_eq!(p.block_count(), 5);
    }

    fn d_params() -> Value {
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_block_ids": [[5,6,7,9,10]],
               "remote_engine_id": "d0", "remote_request_id": "r1", "remote_host": "10.0.0.9",
               "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 70,
               "remote_blocks_expiry_time": 123.5, "x_unknown": {"k": 1}})
    }

    #[test]
    fn compact_round_trip_keeps_unknown_keys_and_rewrites_host() {
        let p = KvParams::parse(&d_params()).unwrap();
        let c = p.compact();
        let v = c.expand("d0", 70, "[::1]");
        assert_eq!(v["remote_block_ids"], json!([[5, 6, 7, 9, 10]]));
        assert_eq!(v["remote_host"], "[::1]");
        assert_eq!(v["x_unknown"], json!({"k": 1}));
        assert_eq!(v["remote_blocks_expiry_time"], json!(123.5));
        assert_eq!(v["do_remote_prefill"], json!(false));
        assert_eq!(v["remote_num_tokens"], json!(70));
    }

    #[test]
    fn flat_block_ids_stay_flat() {
        let mut v = d_params();
        v["remote_block_ids"] = json!([1, 2, 3]);
        let p = KvParams::parse(&v).unwrap();
        assert_eq!(
            p.compact().expand("d0", 1, "h")["remote_block_ids"],
            json!([1, 2, 3])
        );
    }

    #[test]
    fn names_the_bad_field() {
        for (field, bad) in [
            ("remote_block_ids", json!([])),
            ("remote_block_ids", json!([[-1]])),
            ("remote_port", json!(70000)),
            ("remote_engine_id", json!(3)),
            ("tp_size", json!(0)),
            ("remote_num_tokens", json!("x")),
            ("transfer_mode", json!("fling")),
        ] {
            let mut v = d_params();
            v[field] = bad;
            let e = KvParams::parse(&v).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("kv_transfer_params.{field}: expected"))
            );
        }
        assert_eq!(KvParams::parse(&json!([1])).unwrap_err().field, ".");
    }

    #[test]
    fn brackets_ipv6() {
        assert_eq!(bracket_host("fd00::2"), "[fd00::2]");
        assert_eq!(bracket_host("[fd00::2]"), "[fd00::2]");
        assert_eq!(bracket_host("10.1.2.3"), "10.1.2.3");
        assert_eq!(bracket_host("node-a"), "node-a");
    }
}
