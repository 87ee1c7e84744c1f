//! The agent-to-agent HTTP API's wire types (`/v1/...` on each agent's
//! HTTP port): what one node agent asks of another. Served by the agent's
//! `http` module; asked by its peer discovery and lease renewals, and by
//! `kvloop doctor` / `kvloop top`.
//!
//! Kept here, beside the local API, so that the agent's server, its peer
//! client and the operator tools share one definition.
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Version of the agent-to-agent API; requests carrying another are
/// refused with `ErrorKind::Version`, peers answering with another are
/// ignored.
pub const API_VERSION: u32 = 1;

/// Prefix of the probe engine's id: `probe.<agent_id>`.
pub const PROBE_ENGINE_PREFIX: &str = "probe.";

/// What a peer agent says about itself at `GET /v1/engines`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnginesInfo {
    /// Agent-to-agent API version ([`API_VERSION`]).
    pub version: u32,
    /// The agent's id.
    pub agent_id: String,
    /// Its probe engine (id, side channel), when probes run.
    pub probe: Option<EngineAddr>,
    /// Engines it hosts.
    pub engines: Vec<EngineAddr>,
    /// Its engine-shaped probe engines: one per distinct layout of the
    /// engines registered with it (managed mode), so that probe READs are
    /// shaped like the real ones. Absent from agents that predate them
    /// (they are probed in the configured shape).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shaped_probes: Vec<ShapedProbeAddr>,
}

/// An engine-shaped probe engine: its id (`probe.<agent_id>.<shape>`), side
/// channel and layout (regions, block length and tokens per block are the
/// registered engines'; `num_blocks` its own).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapedProbeAddr {
    /// Engine id.
    pub engine_id: String,
    /// Side channel (`host:port` of the engine's dataplane handshake).
    pub side_channel: SocketAddr,
    /// The probe engine's layout.
    pub layout: kvloop_kv_types::layout::KvLayout,
}

/// An engine id and its side-channel address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineAddr {
    /// Engine id.
    pub engine_id: String,
    /// Side channel (`host:port` of the engine's dataplane handshake).
    pub side_channel: SocketAddr,
}

/// Body of `POST /v1/leases/renew`: a reader's agent asks the owner's agent
/// to extend the lease of blocks it is about to READ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// [`API_VERSION`] of the caller.
    pub version: u32,
    /// Owner engine id (hosted by the answering agent).
    pub engine_id: String,
    /// Owner request id.
    pub request_id: String,
    /// Requested lease, ms.
    pub lease_ms: u64,
}

/// Path of the retention API on every agent.
pub const RETENTION_PATH: &str = "/v1/leases/retention";

/// Body of `POST /v1/leases/retention`: a router's retention decision for a
/// decode engine's hold of a finished turn (issue 15). `keep_ms` 0 releases
/// it (nobody will pull that turn); above 0 it keeps it that long (a READ
/// may start until then). Sent to any agent: one that does not host
/// `engine_id` forwards it once to the peer that does. Idempotent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionRequest {
    /// [`API_VERSION`] of the caller.
    pub version: u32,
    /// Owner engine id (D).
    pub engine_id: String,
    /// D's request id (`remote_request_id` of D's params).
    pub request_id: String,
    /// Keep this long, ms; 0 releases.
    pub keep_ms: u64,
    /// Set by an agent forwarding it to the owner's agent (never forwarded
    /// again).
    #[serde(default)]
    pub forwarded: bool,
}

/// Answer of `POST /v1/leases/retention`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RetentionAnswer {
    /// Released now.
    Released {
        /// Blocks freed.
        blocks: u64,
    },
    /// A READ in flight holds them; released when it ends, and no new READ
    /// starts.
    Deferred {
        /// How long that READ's renewal still holds them, ms.
        reading_for_ms: u64,
    },
    /// Kept.
    Kept {
        /// Time left, ms.
        expires_in_ms: u64,
    },
    /// Not held (released, expired, never retained here): nothing to do.
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renew_request_refuses_unknown_fields_by_name() {
        let ok: RenewRequest =
            serde_json::from_str(r#"{"version":1,"engine_id":"d0","request_id":"r","lease_ms":5}"#)
                .unwrap();
        assert_eq!(ok.lease_ms, 5);
        let e = serde_json::from_str::<RenewRequest>(
            r#"{"version":1,"engine_id":"d0","request_id":"r","lease_ms":5,"x":1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown field `x`"), "{e}");
    }

    #[test]
    fn engines_info_round_trips() {
        let i = EnginesInfo {
            version: API_VERSION,
            agent_id: "node-a".into(),
            probe: Some(EngineAddr {
                engine_id: format!("{PROBE_ENGINE_PREFIX}node-a"),
                side_channel: "10.0.0.1:5600".parse().unwrap(),
            }),
            engines: vec![],
            shaped_probes: vec![],
        };
        let text = serde_json::to_string(&i).unwrap();
        assert!(
            !text.contains("shaped_probes"),
            "omitted when empty: {text}"
        );
        let back: EnginesInfo = serde_json::from_str(&text).unwrap();
        assert_eq!(back, i);
        let shaped = EnginesInfo {
            shaped_probes: vec![ShapedProbeAddr {
                engine_id: format!("{PROBE_ENGINE_PREFIX}node-a.128x4096x16"),
                side_channel: "10.0.0.1:5601".parse().unwrap(),
                layout: kvloop_kv_types::layout::KvLayout {
                    num_regions: 128,
                    num_blocks: 16,
                    block_len_bytes: 4096,
                    block_size_tokens: 16,
                },
            }],
            ..i
        };
        let back: EnginesInfo =
            serde_json::from_str(&serde_json::to_string(&shaped).unwrap()).unwrap();
        assert_eq!(back, shaped);
    }

    #[test]
    fn retention_answer_is_tagged_by_outcome() {
        let a = RetentionAnswer::Deferred { reading_for_ms: 7 };
        let s = serde_json::to_string(&a).unwrap();
        assert_eq!(s, r#"{"outcome":"deferred","reading_for_ms":7}"#);
        let r: RetentionRequest =
            serde_json::from_str(r#"{"version":1,"engine_id":"d0","request_id":"r","keep_ms":0}"#)
                .unwrap();
        assert!(!r.forwarded);
    }
}
