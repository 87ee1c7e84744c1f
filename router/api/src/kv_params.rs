//! `kv_transfer_params`, the object vLLM's NixlConnector (and engine-sim)
//! puts in prefill and decode answers and reads from requests
//! (`docs/operator-guide.md`, "kv_transfer_params"). Pure: no I/O.
//!
//! [`KvTransferParams`] types the fields a router reads or rewrites and keeps
//! every member exactly as the engine sent it ([`RawObject`]): keys it does
//! not know (vLLM 0.32 emits `dcp_size`, `pp_size`,
//! `remote_prefill_cached_tokens`, ...) and the spelling of every number
//! (`"remote_blocks_expiry_time": 1214.2449693849999` reaches the next
//! engine as that text) pass through untouched. Only the setters change
//! members.
use serde_json::Value;
use serde_json::value::RawValue;

use crate::json::{RawObject, to_raw};

/// A malformed `kv_transfer_params` object: names the field and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params{}: expected {expected}", if *.field == "." { String::new() } else { format!(".{}", .field) })]
pub struct ParamsError {
    /// Field path below `kv_transfer_params` (`"."` for the object itself,
    /// shown as `kv_transfer_params: expected …`).
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
    /// The JSON value (`[[..],..]` or `[..]`).
    pub fn to_value(&self) -> Value {
        match self {
            BlockIds::Grouped(g) => {
                Value::Array(g.iter().map(|x| Value::from(x.clone())).collect())
            }
            BlockIds::Flat(f) => Value::from(f.clone()),
        }
    }
}

/// `transfer_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMode {
    /// The reader pulls (READ), vLLM's default.
    Pull,
    /// The owner pushes (WRITE).
    Push,
}

/// A validated `kv_transfer_params` object as emitted by an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferParams {
    /// `remote_engine_id`: the engine holding the blocks.
    pub remote_engine_id: String,
    /// `remote_request_id`: the holder's request id.
    pub remote_request_id: String,
    /// `remote_block_ids`.
    pub remote_block_ids: BlockIds,
    /// `remote_port`: the holder's side-channel port.
    pub remote_port: u16,
    /// `remote_host`: the holder's side-channel host, as advertised.
    pub remote_host: Option<String>,
    /// `remote_num_tokens`: tokens the blocks hold (prompt + generated − 1 on D).
    pub remote_num_tokens: Option<u64>,
    /// `tp_size`.
    pub tp_size: Option<u64>,
    /// `do_remote_decode`.
    pub do_remote_decode: Option<bool>,
    /// `do_remote_prefill`.
    pub do_remote_prefill: Option<bool>,
    /// `remote_blocks_expiry_time`: the holder's deadline on its own clock,
    /// seconds (read only; sent on as received).
    pub remote_blocks_expiry_time: Option<f64>,
    /// `transfer_mode`.
    pub transfer_mode: Option<TransferMode>,
    /// Every member as received, in order (setters keep it in step).
    raw: RawObject,
}

/// Keys [`KvTransferParams`] types; every other key is kept opaque.
pub const KNOWN_KEYS: [&str; 10] = [
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_port",
    "remote_host",
    "remote_num_tokens",
    "tp_size",
    "do_remote_decode",
    "do_remote_prefill",
    "remote_blocks_expiry_time",
];

fn block_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// Member `key` as a [`Value`]: `None` when absent. A member whose raw text
/// serde_json cannot turn into a value (a number beyond `f64`, nesting over
/// 128 deep: [`RawObject`] keeps either) is malformed, not absent.
fn value(raw: &RawObject, key: &'static str) -> Result<Option<Value>, ParamsError> {
    raw.get(key)
        .map(|r| serde_json::from_str(r.get()))
        .transpose()
        .map_err(|_| err(key, UNREADABLE))
}

const UNREADABLE: &str = "a JSON value with numbers in f64 range, nested at most 128 deep";

fn block_ids(v: Option<Value>) -> Result<BlockIds, ParamsError> {
    const IDS: &str = "block ids as integers in 0..=4294967295";
    let ids = match v {
        Some(Value::Array(a)) if !a.is_empty() => {
            if a.iter().all(Value::is_array) {
                let mut groups = Vec::with_capacity(a.len());
                for g in &a {
                    let ids: Option<Vec<u32>> = g
                        .as_array()
                        .expect("checked")
                        .iter()
                        .map(block_id)
                        .collect();
                    groups.push(ids.ok_or(err("remote_block_ids", IDS))?);
                }
                BlockIds::Grouped(groups)
            } else {
                let ids: Option<Vec<u32>> = a.iter().map(block_id).collect();
                BlockIds::Flat(ids.ok_or(err("remote_block_ids", IDS))?)
            }
        }
        _ => {
            return Err(err(
                "remote_block_ids",
                "a non-empty array of block ids or of arrays of block ids",
            ));
        }
    };
    if ids.is_empty() {
        return Err(err("remote_block_ids", "at least one block id"));
    }
    Ok(ids)
}

impl KvTransferParams {
    /// Validate an engine's `kv_transfer_params` object given as JSON text.
    ///
    /// Requires: an object; `remote_engine_id` a non-empty string;
    /// `remote_request_id` a string; `remote_block_ids` a non-empty array of
    /// block ids (u32) or of arrays of block ids; `remote_port` an integer in
    /// `0..=65535`. When present and not null: `remote_host` a string;
    /// `tp_size` a positive integer; `remote_num_tokens` a non-negative
    /// integer; `do_remote_decode`/`do_remote_prefill` booleans;
    /// `remote_blocks_expiry_time` a number; `transfer_mode` `"pull"` or
    /// `"push"`. A member serde_json cannot read (a number beyond `f64`,
    /// nesting over 128 deep) is malformed, also where it is optional.
    ///
    /// # Errors
    /// [`ParamsError`] naming the first bad field.
    pub fn parse(text: &str) -> Result<Self, ParamsError> {
        let raw = RawObject::parse(text).map_err(|_| err(".", "a JSON object"))?;
        Self::from_raw(raw)
    }

    /// [`KvTransferParams::parse`] of an already split object.
    ///
    /// # Errors
    /// [`ParamsError`] naming the first bad field.
    pub fn from_raw(raw: RawObject) -> Result<Self, ParamsError> {
        let get = |k: &'static str| value(&raw, k);
        let remote_engine_id = match get("remote_engine_id")? {
            Some(Value::String(s)) if !s.is_empty() => s,
            _ => return Err(err("remote_engine_id", "a non-empty string")),
        };
        let Some(Value::String(remote_request_id)) = get("remote_request_id")? else {
            return Err(err("remote_request_id", "a string"));
        };
        let remote_block_ids = block_ids(get("remote_block_ids")?)?;
        let remote_port = get("remote_port")?
            .and_then(|v| v.as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .ok_or(err("remote_port", "an integer in 0..=65535"))?;
        let remote_host = match get("remote_host")? {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            _ => return Err(err("remote_host", "a string")),
        };
        let tp_size = match get("tp_size")? {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|&x| x >= 1)
                    .ok_or(err("tp_size", "a positive integer"))?,
            ),
        };
        let remote_num_tokens = match get("remote_num_tokens")? {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .ok_or(err("remote_num_tokens", "a non-negative integer"))?,
            ),
        };
        let flag = |f: &'static str| match get(f)? {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            _ => Err(err(f, "a boolean")),
        };
        let do_remote_decode = flag("do_remote_decode")?;
        let do_remote_prefill = flag("do_remote_prefill")?;
        let remote_blocks_expiry_time = match get("remote_blocks_expiry_time")? {
            None | Some(Value::Null) => None,
            // The raw text through std's correctly rounded parser (serde_json's
            // default float parsing is not).
            Some(Value::Number(_)) => raw
                .get("remote_blocks_expiry_time")
                .and_then(|r| r.get().trim().parse::<f64>().ok()),
            _ => return Err(err("remote_blocks_expiry_time", "a number or null")),
        };
        let transfer_mode = match get("transfer_mode")? {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "pull" => Some(TransferMode::Pull),
            Some(Value::String(s)) if s == "push" => Some(TransferMode::Push),
            _ => return Err(err("transfer_mode", "\"pull\" or \"push\"")),
        };
        Ok(Self {
            remote_engine_id,
            remote_request_id,
            remote_block_ids,
            remote_port,
            remote_host,
            remote_num_tokens,
            tp_size,
            do_remote_decode,
            do_remote_prefill,
            remote_blocks_expiry_time,
            transfer_mode,
            raw,
        })
    }

    /// Set `remote_host` (e.g. from the router's registry).
    pub fn set_remote_host(&mut self, host: &str) {
        self.remote_host = Some(host.to_string());
        self.raw.set_value("remote_host", host);
    }

    /// Set `remote_engine_id`.
    pub fn set_remote_engine_id(&mut self, id: &str) {
        self.remote_engine_id = id.to_string();
        self.raw.set_value("remote_engine_id", id);
    }

    /// Set `remote_num_tokens`.
    pub fn set_remote_num_tokens(&mut self, n: u64) {
        self.remote_num_tokens = Some(n);
        self.raw.set_value("remote_num_tokens", &n);
    }

    /// Set the direction flags `do_remote_decode` and `do_remote_prefill`.
    pub fn set_flags(&mut self, do_remote_decode: bool, do_remote_prefill: bool) {
        self.do_remote_decode = Some(do_remote_decode);
        self.do_remote_prefill = Some(do_remote_prefill);
        self.raw.set_value("do_remote_decode", &do_remote_decode);
        self.raw.set_value("do_remote_prefill", &do_remote_prefill);
    }

    /// Every member as held (received, or changed by a setter).
    pub fn raw(&self) -> &RawObject {
        &self.raw
    }

    /// Members whose keys are not in [`KNOWN_KEYS`] (nor `transfer_mode`), in order.
    pub fn unknown(&self) -> impl Iterator<Item = (&str, &RawValue)> {
        self.raw
            .0
            .iter()
            .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()) && k != "transfer_mode")
            .map(|(k, v)| (k.as_str(), &**v))
    }

    /// The object's JSON text, every untouched member exactly as received.
    pub fn to_json(&self) -> String {
        self.raw.to_json()
    }

    /// [`KvTransferParams::to_json`] as a raw JSON value.
    pub fn to_raw_value(&self) -> Box<RawValue> {
        RawValue::from_string(self.to_json()).expect("an object's text is JSON")
    }
}

/// The raw JSON of `value` (re-exported helper for callers building params).
pub fn raw_json<T: serde::Serialize + ?Sized>(value: &T) -> Box<RawValue> {
    to_raw(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_block_ids":[[5,6,7]],"remote_engine_id":"d0","remote_request_id":"r1","remote_host":"10.0.0.9","remote_port":5600,"tp_size":1,"remote_num_tokens":70,"remote_blocks_expiry_time":1214.2449693849999,"dcp_size":1,"x_unknown":{"k":1.50}}"#;

    #[test]
    fn unknown_keys_and_numbers_are_kept_exactly() {
        let mut p = KvTransferParams::parse(D).unwrap();
        assert_eq!(p.to_json(), D, "untouched: byte for byte");
        assert_eq!(p.remote_blocks_expiry_time, Some(1214.2449693849999));
        p.set_remote_host("[::1]");
        p.set_flags(true, false);
        let out = p.to_json();
        assert!(
            out.contains(r#""remote_blocks_expiry_time":1214.2449693849999"#),
            "{out}"
        );
        assert!(out.contains(r#""x_unknown":{"k":1.50}"#), "{out}");
        assert!(out.contains(r#""remote_host":"[::1]""#), "{out}");
        let unknown: Vec<&str> = p.unknown().map(|(k, _)| k).collect();
        assert_eq!(unknown, ["dcp_size", "x_unknown"]);
    }

    #[test]
    fn names_the_bad_field() {
        for (field, bad) in [
            ("remote_block_ids", "[]"),
            ("remote_block_ids", "[[-1]]"),
            ("remote_port", "70000"),
            ("remote_engine_id", "3"),
            ("tp_size", "0"),
            ("remote_num_tokens", "\"x\""),
            ("transfer_mode", "\"fling\""),
            ("do_remote_prefill", "1"),
        ] {
            let mut o = RawObject::parse(D).unwrap();
            o.set(field, RawValue::from_string(bad.into()).unwrap());
            let e = KvTransferParams::from_raw(o).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
        let e = KvTransferParams::parse("[1]").unwrap_err();
        assert_eq!(e.field, ".");
        assert_eq!(e.to_string(), "kv_transfer_params: expected a JSON object");
        let e = KvTransferParams::parse("{}").unwrap_err();
        assert!(
            e.to_string().starts_with("kv_transfer_params.remote_"),
            "{e}"
        );
    }

    /// Found by `make fuzz` (target `kv_params`): an optional member whose
    /// text serde_json cannot read (`1214.2449e693849999` is beyond `f64`;
    /// nesting over 128 deep) was taken as absent and forwarded unchecked.
    #[test]
    fn unreadable_optional_members_are_malformed_not_absent() {
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        for (field, bad) in [
            ("remote_blocks_expiry_time", "1214.2449e693849999"),
            ("remote_num_tokens", "1e400"),
            ("tp_size", deep.as_str()),
            ("remote_host", deep.as_str()),
            ("transfer_mode", deep.as_str()),
            ("do_remote_decode", deep.as_str()),
        ] {
            let mut o = RawObject::parse(D).unwrap();
            o.set(field, RawValue::from_string(bad.into()).unwrap());
            let e = KvTransferParams::from_raw(o)
                .map(|p| p.to_json())
                .unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
        let text = D.replace("1214.2449693849999", "1214.2449e693849999");
        let e = KvTransferParams::parse(&text).unwrap_err();
        assert_eq!(e.field, "remote_blocks_expiry_time", "{e}");
    }
}
