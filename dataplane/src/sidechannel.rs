//! The side channel: a TCP connection between two engines that carries the
//! handshake (versioned metadata: engine id, KV layout, backend description)
//! and owner notifications. Frames are a 4-byte big-endian length followed by
//! one JSON [`Message`] of at most [`MAX_FRAME_BYTES`].
//!
//! One handshake serves both directions: the connecting engine sends
//! [`Message::Hello`], the accepting engine checks compatibility and answers
//! [`Message::Welcome`] (its own metadata) or [`Message::Refuse`]; after a
//! welcome each can READ from the other.
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::BackendMetadata;
use crate::error::{DataplaneError, Result};
use crate::layout::KvLayout;

/// Side-channel protocol version. Engines with a different major version
/// refuse each other at handshake.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame accepted, bytes (NIXL metadata blobs are a few KiB).
pub const MAX_FRAME_BYTES: u32 = 16 << 20;

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

/// Writes one frame.
///
/// # Errors
/// [`DataplaneError::Io`] on a write failure.
pub async fn write_message<W: AsyncWrite + Unpin>(w: &mut W, m: &Message) -> Result<()> {
    let body = serde_json::to_vec(m).expect("side-channel messages always serialize");
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)
        .await
        .map_err(|e| DataplaneError::io("side channel write", e))?;
    w.flush()
        .await
        .map_err(|e| DataplaneError::io("side channel flush", e))
}

/// Reads one frame; `Ok(None)` on a clean end of stream.
///
/// # Errors
/// [`DataplaneError::Protocol`] naming `length` or the JSON field at fault;
/// [`DataplaneError::Io`] on a read failure.
pub async fn read_message<R: AsyncRead + Unpin>(r: &mut R, peer: &str) -> Result<Option<Message>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(DataplaneError::io("side channel read", e)),
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME_BYTES {
        return Err(DataplaneError::Protocol {
            peer: peer.into(),
            field: "length".into(),
            reason: format!("frame of {len} bytes exceeds the maximum {MAX_FRAME_BYTES}"),
        });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)
        .await
        .map_err(|e| DataplaneError::io("side channel read", e))?;
    decode_message(&body, peer).map(Some)
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
    use crate::backend::RemoteRegion;

    fn md() -> EngineMetadata {
        EngineMetadata {
            version: PROTOCOL_VERSION,
            engine_id: "d0".into(),
            layout: KvLayout {
                num_regions: 1,
                num_blocks: 4,
                block_len_bytes: 4096,
                block_size_tokens: 16,
            },
            backend: BackendMetadata::Libfabric {
                provider: "shm".into(),
                address: vec![1, 2, 3],
                regions: vec![RemoteRegion {
                    base_addr: 0x1000,
                    key: 7,
                    len_bytes: 16384,
                    device_id: 0,
                }],
            },
        }
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let m = Message::Hello { engine: md() };
        write_message(&mut a, &m).await.unwrap();
        write_message(
            &mut a,
            &Message::Notify {
                notif: "r:1".into(),
            },
        )
        .await
        .unwrap();
        drop(a);
        assert_eq!(read_message(&mut b, "t").await.unwrap(), Some(m));
        assert!(matches!(
            read_message(&mut b, "t").await.unwrap(),
            Some(Message::Notify { .. })
        ));
        assert_eq!(read_message(&mut b, "t").await.unwrap(), None);
    }

    #[tokio::test]
    async fn oversized_and_malformed_frames_name_the_field() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&(MAX_FRAME_BYTES + 1).to_be_bytes())
            .await
            .unwrap();
        let e = read_message(&mut b, "t").await.unwrap_err().to_string();
        assert!(e.contains("length"), "{e}");
        let e = decode_message(br#"{"type":"notify","notif":3}"#, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("notif") || e.contains("string"), "{e}");
        let e = decode_message(br#"{"type":"hello"}"#, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("engine"), "{e}");
    }
}
