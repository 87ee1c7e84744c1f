//! The side channel's messages and framing, without I/O: what two engines
//! exchange over their TCP side channel (handshake metadata, read hints,
//! owner notifications) and the pure decoding of its frames. The async
//! reader and writer are `kvloop_dataplane::sidechannel`'s, which
//! re-exports everything here at the same paths (and [`BackendMetadata`],
//! [`RemoteRegion`] as `kvloop_dataplane::backend`'s).
//!
//! Frames are a 4-byte big-endian length ([`frame_len`]) followed by one
//! JSON [`Message`] of at most [`MAX_FRAME_BYTES`] ([`decode_message`]).
//!
//! One handshake serves both directions: the connecting engine sends
//! [`Message::Hello`], the accepting engine checks compatibility and answers
//! [`Message::Welcome`] (its own metadata) or [`Message::Refuse`]; after a
//! welcome each can READ from the other.
use serde::{Deserialize, Serialize};

use crate::error::{DataplaneError, Result};
use crate::layout::KvLayout;

/// Side-channel protocol version. Engines with a different major version
/// refuse each other at handshake.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame accepted, bytes (NIXL metadata blobs are a few KiB).
pub const MAX_FRAME_BYTES: u32 = 16 << 20;

/// What a peer needs to know about one of an engine's registered regions to
/// READ from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteRegion {
    /// Address the READ must name for offset 0 of the region: the virtual
    /// address when the provider uses `FI_MR_VIRT_ADDR` (and for NIXL), else 0.
    pub base_addr: u64,
    /// Remote memory key (`fi_mr_key`); 0 for NIXL, which carries keys in its
    /// own metadata blob.
    pub key: u64,
    /// Region length in bytes.
    pub len_bytes: u64,
    /// Device ordinal for device memory (NIXL `devId`); 0 for host memory.
    pub device_id: u64,
}

/// One rail of a multi-rail libfabric engine: its endpoint and its own
/// registrations of the engine's regions (each rail is a domain of its own,
/// with its own memory keys).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RailEndpoint {
    /// Endpoint address (`fi_getname`), inserted into the reader's AV.
    pub address: Vec<u8>,
    /// The regions as registered on this rail's domain, in layout order.
    pub regions: Vec<RemoteRegion>,
}

/// Backend description sent at handshake, versioned with the side channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendMetadata {
    /// libfabric used directly.
    Libfabric {
        /// Provider name as libfabric reports it, e.g. `tcp;ofi_rxm`, `shm`, `efa`.
        provider: String,
        /// Endpoint address (`fi_getname`), inserted into the reader's AV.
        address: Vec<u8>,
        /// Registered regions, in layout order.
        regions: Vec<RemoteRegion>,
        /// Rails after the first (whose endpoint is `address` and whose
        /// registrations are `regions`), in rail order: one endpoint per NIC
        /// (`FabricConfig::rails`). Absent (empty) for a single-rail engine,
        /// which keeps its metadata byte-identical to engines without rails.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        rails: Vec<RailEndpoint>,
    },
    /// NIXL agent.
    Nixl {
        /// NIXL backend plugin, e.g. `UCX`, `LIBFABRIC`.
        plugin: String,
        /// The NIXL agent name (unique per engine).
        agent_name: String,
        /// `getLocalMD()` blob, loaded with `loadRemoteMD()` by the reader.
        metadata: Vec<u8>,
        /// Registered regions, in layout order.
        regions: Vec<RemoteRegion>,
    },
}

impl BackendMetadata {
    /// Regions of the remote engine, in layout order.
    pub fn regions(&self) -> &[RemoteRegion] {
        match self {
            Self::Libfabric { regions, .. } | Self::Nixl { regions, .. } => regions,
        }
    }

    /// Every rail of a libfabric engine, first rail first, as (endpoint
    /// address, regions); empty for NIXL.
    pub fn fabric_rails(&self) -> Vec<(&[u8], &[RemoteRegion])> {
        match self {
            Self::Libfabric {
                address,
                regions,
                rails,
                ..
            } => std::iter::once((address.as_slice(), regions.as_slice()))
                .chain(
                    rails
                        .iter()
                        .map(|r| (r.address.as_slice(), r.regions.as_slice())),
                )
                .collect(),
            Self::Nixl { .. } => Vec::new(),
        }
    }

    /// Short description, e.g. `libfabric/tcp;ofi_rxm` or `nixl/UCX`.
    pub fn describe(&self) -> String {
        match self {
            Self::Libfabric { provider, .. } => format!("libfabric/{provider}"),
            Self::Nixl { plugin, .. } => format!("nixl/{plugin}"),
        }
    }
}

/// What one engine tells another about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineMetadata {
    /// Side-channel protocol version ([`PROTOCOL_VERSION`]).
    pub version: u32,
    /// Engine id, unique in the cluster (vLLM's `engine_id`).
    pub engine_id: String,
    /// KV layout of the engine.
    pub layout: KvLayout,
    /// Backend description.
    pub backend: BackendMetadata,
}

/// A side-channel message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Message {
    /// First message of the connecting engine.
    Hello {
        /// The connecting engine's metadata.
        engine: EngineMetadata,
    },
    /// Acceptance, with the accepting engine's metadata.
    Welcome {
        /// The accepting engine's metadata.
        engine: EngineMetadata,
    },
    /// Refusal; the connection closes after it.
    Refuse {
        /// Field that made the engines incompatible.
        field: String,
        /// Human-readable reason.
        reason: String,
    },
    /// Sent by a reader just before it posts a READ of `bytes` from the
    /// receiving engine: the owner's progress thread stays awake (spins) for
    /// about as long as the READ should take, since providers such as
    /// `tcp;ofi_rxm` move data only while the serving side progresses and a
    /// one-sided READ gives the server no completion to wake up for.
    ReadHint {
        /// Bytes the READ will move.
        bytes: u64,
    },
    /// Owner notification `"<owner request id>:<count>"` (see [`crate::notify`]).
    Notify {
        /// The notification string.
        notif: String,
    },
}

/// One frame: the 4-byte big-endian length, then `m` as JSON.
pub fn encode_message(m: &Message) -> Vec<u8> {
    let body = serde_json::to_vec(m).expect("side-channel messages always serialize");
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    buf
}

/// The body length a frame header announces.
///
/// # Errors
/// [`DataplaneError::Protocol`] naming `length` when it exceeds
/// [`MAX_FRAME_BYTES`].
pub fn frame_len(header: [u8; 4], peer: &str) -> Result<usize> {
    let len = u32::from_be_bytes(header);
    if len > MAX_FRAME_BYTES {
        return Err(DataplaneError::Protocol {
            peer: peer.into(),
            field: "length".into(),
            reason: format!("frame of {len} bytes exceeds the maximum {MAX_FRAME_BYTES}"),
        });
    }
    Ok(len as usize)
}

/// Decodes one frame body.
///
/// # Errors
/// [`DataplaneError::Protocol`] with serde's description of the bad field.
pub fn decode_message(body: &[u8], peer: &str) -> Result<Message> {
    serde_json::from_slice(body).map_err(|e| DataplaneError::Protocol {
        peer: peer.into(),
        field: "message".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fabric(rails: Vec<RailEndpoint>) -> BackendMetadata {
        BackendMetadata::Libfabric {
            provider: "tcp;ofi_rxm".into(),
            address: vec![1, 2],
            regions: vec![RemoteRegion {
                base_addr: 0,
                key: 1,
                len_bytes: 4096,
                device_id: 0,
            }],
            rails,
        }
    }

    #[test]
    fn single_rail_metadata_keeps_the_old_wire_format() {
        // What an engine without rails sent before rails existed decodes as
        // one rail, and a single-rail engine sends exactly that.
        let old = r#"{"type":"libfabric","provider":"tcp;ofi_rxm","address":[1,2],"regions":[{"base_addr":0,"key":1,"len_bytes":4096,"device_id":0}]}"#;
        let md: BackendMetadata = serde_json::from_str(old).unwrap();
        assert_eq!(md, fabric(Vec::new()));
        assert_eq!(serde_json::to_string(&md).unwrap(), old);
        assert_eq!(md.fabric_rails().len(), 1);
        // Two rails: the second one's address and keys travel in `rails`.
        let two = fabric(vec![RailEndpoint {
            address: vec![3],
            regions: vec![RemoteRegion {
                base_addr: 0,
                key: 9,
                len_bytes: 4096,
                device_id: 0,
            }],
        }]);
        let back: BackendMetadata =
            serde_json::from_str(&serde_json::to_string(&two).unwrap()).unwrap();
        assert_eq!(back, two);
        let r = back.fabric_rails();
        assert_eq!(r.len(), 2);
        assert_eq!((r[1].0, r[1].1[0].key), (&[3u8][..], 9));
    }

    #[test]
    fn frames_decode_without_io() {
        let m = Message::Notify {
            notif: "r:1".into(),
        };
        let frame = encode_message(&m);
        let len = frame_len(frame[..4].try_into().unwrap(), "t").unwrap();
        assert_eq!(len, frame.len() - 4);
        assert_eq!(decode_message(&frame[4..], "t").unwrap(), m);
        let e = frame_len((MAX_FRAME_BYTES + 1).to_be_bytes(), "t").unwrap_err();
        assert!(e.to_string().contains("length"), "{e}");
        assert_eq!(
            frame_len(MAX_FRAME_BYTES.to_be_bytes(), "t").unwrap(),
            16 << 20
        );
    }
}
