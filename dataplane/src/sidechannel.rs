//! The side channel: a TCP connection between two engines that carries the
//! handshake (versioned metadata: engine id, KV layout, backend description)
//! and owner notifications. Frames are a 4-byte big-endian length followed by
//! one JSON [`Message`] of at most [`MAX_FRAME_BYTES`].
//!
//! The messages and the pure framing ([`frame_len`], [`decode_message`]) are
//! defined in `kvloop-kv-types` (fuzzed without libfabric or NIXL: `make
//! fuzz`) and re-exported here; this module adds the async reader and writer.
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{DataplaneError, Result};

pub use kvloop_kv_types::sidechannel::{
    EngineMetadata, MAX_FRAME_BYTES, Message, PROTOCOL_VERSION, decode_message, encode_message,
    frame_len,
};

/// Writes one frame.
///
/// # Errors
/// [`DataplaneError::Io`] on a write failure.
pub async fn write_message<W: AsyncWrite + Unpin>(w: &mut W, m: &Message) -> Result<()> {
    w.write_all(&encode_message(m))
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
    let len = frame_len(len, peer)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| DataplaneError::io("side channel read", e))?;
    decode_message(&body, peer).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendMetadata, RemoteRegion};
    use crate::layout::KvLayout;

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
                rails: Vec::new(),
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
