//! The `kv_transfer_params` an engine emits for blocks it holds, with the
//! keys vLLM's NixlConnector (pull mode) emits: the reader's coordinates
//! (`remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
//! `remote_block_ids` per KV-cache group), the parallel layout (`tp_size`,
//! `dcp_size`, `pp_size`), `remote_num_tokens`, `transfer_mode` (`"pull"`:
//! the reader READs; vLLM's push scheduler says `"push"`), on D the expiry of
//! the held blocks (`remote_blocks_expiry_time`, seconds on D's process
//! clock), and on P `remote_prefill_cached_tokens` (the prompt tokens P did
//! not compute: its prefix-cache and connector hits, here the tokens read
//! from D; vLLM's D reports it as the request's cached tokens).
use serde_json::{Value, json};

use crate::config::{Role, SimConfig};

/// The transfer mode engine-sim implements (the reader READs the blocks).
pub const TRANSFER_MODE: &str = "pull";

/// The blocks one request holds for a reader.
#[derive(Debug, Clone)]
pub struct HeldBlocks<'a> {
    /// The holding engine's request id.
    pub request_id: &'a str,
    /// Block ids (one KV-cache group).
    pub block_ids: Vec<u32>,
    /// Tokens the blocks cover.
    pub num_tokens: u64,
    /// P only: prompt tokens not computed (read from D).
    pub cached_tokens: Option<u64>,
    /// D only: when the hold expires, seconds on D's process clock.
    pub expiry_s: Option<f64>,
}

/// The params describing `held` for a reader of an engine configured by
/// `cfg`, whose side channel is `host:port`.
pub fn kv_transfer_params(cfg: &SimConfig, host: &str, port: u16, held: HeldBlocks<'_>) -> Value {
    let decode = cfg.role == Role::Decode;
    let mut p = json!({
        "do_remote_decode": decode,
        "do_remote_prefill": !decode,
        "remote_block_ids": [held.block_ids],
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": held.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": cfg.tp_size,
        "dcp_size": cfg.dcp_size,
        "pp_size": cfg.pp_size,
        "remote_num_tokens": held.num_tokens,
        "transfer_mode": TRANSFER_MODE,
    });
    if decode && let Some(expiry) = held.expiry_s {
        p["remote_blocks_expiry_time"] = json!(expiry);
    }
    if !decode && let Some(cached) = held.cached_tokens {
        p["remote_prefill_cached_tokens"] = json!(cached);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(cached: Option<u64>, expiry: Option<f64>) -> HeldBlocks<'static> {
        HeldBlocks {
            request_id: "r1",
            block_ids: vec![3, 4],
            num_tokens: 20,
            cached_tokens: cached,
            expiry_s: expiry,
        }
    }

    #[test]
    fn prefill_params_carry_vllms_keys_and_the_cached_count() {
        let cfg = SimConfig {
            engine_id: "p0".into(),
            tp_size: 2,
            dcp_size: 4,
            pp_size: 3,
            ..SimConfig::default()
        };
        let p = kv_transfer_params(&cfg, "10.0.0.1", 5600, held(Some(7), None));
        assert_eq!(p["do_remote_prefill"], true);
        assert_eq!(p["do_remote_decode"], false);
        assert_eq!(p["remote_block_ids"], json!([[3, 4]]));
        assert_eq!(p["tp_size"], 2);
        assert_eq!(p["dcp_size"], 4);
        assert_eq!(p["pp_size"], 3);
        assert_eq!(p["transfer_mode"], "pull");
        assert_eq!(p["remote_num_tokens"], 20);
        assert!(p["remote_prefill_cached_tokens"].is_u64(), "{p}");
        assert_eq!(p["remote_prefill_cached_tokens"], 7);
        assert!(p.get("remote_blocks_expiry_time").is_none(), "{p}");
    }

    #[test]
    fn decode_params_carry_the_expiry_and_no_cached_count() {
        let cfg = SimConfig {
            role: Role::Decode,
            engine_id: "d0".into(),
            ..SimConfig::default()
        };
        let p = kv_transfer_params(&cfg, "10.0.0.2", 5601, held(Some(7), Some(12.5)));
        assert_eq!(p["do_remote_decode"], true);
        assert_eq!(p["dcp_size"], 1);
        assert_eq!(p["pp_size"], 1);
        assert_eq!(p["transfer_mode"], "pull");
        assert_eq!(p["remote_blocks_expiry_time"], 12.5);
        assert!(p.get("remote_prefill_cached_tokens").is_none(), "{p}");
    }
}
