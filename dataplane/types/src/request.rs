//! A READ request, the owner notification it may ask for, and what a
//! successful READ did: the values the dataplane's callers (engines, the
//! agent's local API) exchange.
use kvloop_common::Direction;
use serde::{Deserialize, Serialize};

use crate::layout::BlockPair;

/// A READ of blocks from a remote engine into local blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// Engine id of the block owner (must have completed a handshake).
    pub peer_engine_id: String,
    /// (remote block, local block) pairs; every region of each block is read.
    pub blocks: Vec<BlockPair>,
    /// Direction, for probes and metrics.
    #[serde(with = "direction_serde")]
    pub direction: Direction,
    /// When set, the owner is notified `"<owner request id>:<count>"` after
    /// the READ completed successfully.
    pub notify: Option<OwnerNotify>,
    /// Timeout; `None` uses the engine's `read_timeout_ms`.
    pub timeout_ms: Option<u64>,
}

/// Owner notification to send after a successful READ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerNotify {
    /// The owner's request id whose blocks are read.
    pub owner_request_id: String,
    /// Total notifications the owner should expect for this request.
    pub count: u32,
}

mod direction_serde {
    use kvloop_common::Direction;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(d: &Direction, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.label())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Direction, D::Error> {
        let s = String::deserialize(d)?;
        Ok(match s.as_str() {
            "d2p" => Direction::DecodeToPrefill,
            "p2d" => Direction::PrefillToDecode,
            "probe" => Direction::Probe,
            "unknown" => Direction::Unknown,
            other => {
                return Err(serde::de::Error::custom(format!(
                    "direction `{other}`: expected d2p, p2d, probe or unknown"
                )));
            }
        })
    }
}

/// What a successful READ did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ReadOutcome {
    /// Process-unique READ id (also in the probe arguments).
    pub xfer_id: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// Descriptors (block pairs × regions).
    pub descriptors: u32,
    /// Post → completion, measured in user space, µs.
    pub elapsed_us: u64,
}
