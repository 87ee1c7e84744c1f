//! Validation, compact storage and rewriting of `kv_transfer_params`
//! (shared/PROTOCOL.md, "kv_transfer_params"). Pure: no I/O.
//!
//! The object is kept opaque: unknown keys pass through untouched; only the
//! fields the router needs are checked or overwritten.
use serde_json::{Map, Value};

/// A malformed `kv_transfer_params` object: names the field and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params.{field}: expected {expected}")]
pub struct ParamsError {
    /// Field path below `kv_transfer_params` (`"."` for the object itself).
    pub field: &'static str,
    /// What the field must look like.
    pub expected: &'static str,
}

fn err(field: &'static str, expected: &'static str) -> ParamsError {
    ParamsError { field, expected }
}

/// Block ids as sent: one list per KV-cache group, or (old versions) one flat list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockIds {
    /// `[[g0...], [g1...]]`.
    Grouped(Vec<Vec<u32>>),
    /// `[b0, b1, ...]`.
    Flat(Vec<u32>),
}

impl BlockIds {
    /// Total block ids over all groups.
    pub fn len(&self) -> usize {
        match self {
            BlockIds::Grouped(g) => g.iter().map(Vec::len).sum(),
            BlockIds::Flat(f) => f.len(),
        }
    }
    /// True when no block id is present.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn to_value(&self) -> Value {
        match self {
            BlockIds::Grouped(g) => {
                Value::Array(g.iter().map(|x| Value::from(x.clone())).collect())
            }
            BlockIds::Flat(f) => Value::from(f.clone()),
        }
    }
}

/// A validated `kv_transfer_params` object as returned by an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct KvParams {
    /// Every key except `remote_block_ids` (kept parsed in `block_ids`).
    rest: Map<String, Value>,
    /// The block ids.
    pub block_ids: BlockIds,
    /// `remote_engine_id`.
    pub engine_id: String,
    /// `remote_num_tokens`, when present.
    pub num_tokens: Option<u64>,
}

fn block_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

impl KvParams {
    /// Validate an engine's `kv_transfer_params` object.
    ///
    /// Requires: an object; `remote_engine_id` a non-empty string;
    /// `remote_request_id` a string; `remote_block_ids` a non-empty array of
    /// block ids (u32) or of arrays of block ids; `remote_port` an integer in
    /// `0..=65535`. When present: `remote_host` a string or null; `tp_size` a
    /// positive integer; `remote_num_tokens` a non-negative integer;
    /// `do_remote_decode`/`do_remote_prefill` booleans;
    /// `remote_blocks_expiry_time` a number or null; `transfer_mode` `"pull"`
    /// or `"push"`.
    ///
    /// # Errors
    /// [`ParamsError`] naming the first bad field.
    pub fn parse(v: &Value) -> Result<Self, ParamsError> {
        let obj = v.as_object().ok_or(err(".", "a JSON object"))?;
        let engine_id = match obj.get("remote_engine_id") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => return Err(err("remote_engine_id", "a non-empty string")),
        };
        if !matches!(obj.get("remote_request_id"), Some(Value::String(_))) {
            return Err(err("remote_request_id", "a string"));
        }
        let block_ids = match obj.get("remote_block_ids") {
            Some(Value::Array(a)) if !a.is_empty() => {
                if a.iter().all(Value::is_array) {
                    let mut groups = Vec::with_capacity(a.len());
                    for g in a {
                        let g = g.as_array().expect("checked");
                        let ids: Option<Vec<u32>> = g.iter().map(block_id).collect();
                        groups.push(ids.ok_or(err(
                            "remote_block_ids",
                            "block ids as integers in 0..=4294967295",
                        ))?);
                    }
                    BlockIds::Grouped(groups)
                } else {
                    let ids: Option<Vec<u32>> = a.iter().map(block_id).collect();
                    BlockIds::Flat(ids.ok_or(err(
                        "remote_block_ids",
                        "block ids as integers in 0..=4294967295",
                    ))?)
                }
            }
            _ => {
                return Err(err(
                    "remote_block_ids",
                    "a non-empty array of block ids or of arrays of block ids",
                ));
            }
        };
        if block_ids.is_empty() {
            return Err(err("remote_block_ids", "at least one block id"));
        }
        match obj.get("remote_port").and_then(Value::as_u64) {
            Some(p) if p <= 65535 => {}
            _ => return Err(err("remote_port", "an integer in 0..=65535")),
        }
        match obj.get("remote_host") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            _ => return Err(err("remote_host", "a string")),
        }
        match obj.get("tp_size") {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64().is_some_and(|x| x >= 1) => {}
            _ => return Err(err("tp_size", "a positive integer")),
        }
        let num_tokens = match obj.get("remote_num_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .ok_or(err("remote_num_tokens", "a non-negative integer"))?,
            ),
        };
        for f in ["do_remote_decode", "do_remote_prefill"] {
            match obj.get(f) {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                _ => {
                    return Err(err(
                        if f == "do_remote_decode" {
                            "do_remote_decode"
                        } else {
                            "do_remote_prefill"
                        },
                        "a boolean",
                    ));
                }
            }
        }
        match obj.get("remote_blocks_expiry_time") {
            None | Some(Value::Null) | Some(Value::Number(_)) => {}
            _ => return Err(err("remote_blocks_expiry_time", "a number or null")),
        }
        match obj.get("transfer_mode") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "pull" || s == "push" => {}
            _ => return Err(err("transfer_mode", "\"pull\" or \"push\"")),
        }
        let mut rest = obj.clone();
        rest.remove("remote_block_ids");
        Ok(Self {
            rest,
            block_ids,
            engine_id,
            num_tokens,
        })
    }

    /// The object to send to the next engine, with `remote_host` replaced by
    /// `host` (already bracketed for IPv6) and the direction flags set.
    pub fn to_request_value(
        &self,
        host: &str,
        do_remote_decode: bool,
        do_remote_prefill: bool,
    ) -> Value {
        let mut m = self.rest.clone();
        m.insert("remote_block_ids".into(), self.block_ids.to_value());
        m.insert("remote_host".into(), Value::String(host.to_string()));
        m.insert("do_remote_decode".into(), Value::Bool(do_remote_decode));
        m.insert("do_remote_prefill".into(), Value::Bool(do_remote_prefill));
        Value::Object(m)
    }

    /// Compact form for the conversation store (block ids run-length encoded,
    /// other keys as compact JSON, `remote_host` dropped: it is rewritten from
    /// the registry on use).
    pub fn compact(&self) -> CompactParams {
        let mut rest = self.rest.clone();
        rest.remove("remote_host");
        rest.remove("remote_engine_id");
        rest.remove("remote_num_tokens");
        let mut runs = Vec::new();
        let (flat, groups): (bool, Vec<&[u32]>) = match &self.block_ids {
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
                while i + (len as usize) < g.len() && g[i + len as usize] == start.wrapping_add(len)
                {
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
            rest: serde_json::to_string(&Value::Object(rest))
                .expect("serializable")
                .into_boxed_str(),
        }
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

    /// True when `runs` follows the layout above, expands to at most `max_ids`
    /// block ids, and `rest` is a JSON object: checked on values read back
    /// from a shared store, which [`CompactParams::expand`] would otherwise
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
            && serde_json::from_str::<Map<String, Value>>(&self.rest).is_ok()
    }

    /// Rebuild the full object, with `remote_engine_id`, `remote_num_tokens`,
    /// `remote_host` (from the registry) and the flags of a D→P reuse request
    /// (`do_remote_decode: true`, `do_remote_prefill: false`).
    pub fn expand(&self, engine_id: &str, num_tokens: u64, host: &str) -> Value {
        let mut m: Map<String, Value> = serde_json::from_str(&self.rest).unwrap_or_default();
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
        m.insert("remote_block_ids".into(), blocks);
        m.insert("remote_engine_id".into(), Value::String(engine_id.into()));
        m.insert("remote_num_tokens".into(), Value::from(num_tokens));
        m.insert("remote_host".into(), Value::String(host.into()));
        m.insert("do_remote_decode".into(), Value::Bool(true));
        m.insert("do_remote_prefill".into(), Value::Bool(false));
        Value::Object(m)
    }
}

/// The "no reuse" prefill shape (PROTOCOL.md "Router → P, no reuse").
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
