//! The agent's local API on its Unix socket: length-prefixed JSON frames,
//! with file descriptors (memfds of KV regions) passed as `SCM_RIGHTS`
//! ancillary data on the first byte of the frame that needs them.
//!
//! Frame: `u32` little-endian body length (at most [`MAX_FRAME_BYTES`]),
//! then the body, one JSON [`Request`] (client → agent) or [`Response`]
//! (agent → client). Every request gets exactly one response, in order.
//! The first request on a connection should be [`Request::Hello`]; the
//! agent refuses a different [`PROTOCOL_VERSION`].
use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use kvloop_kv_types::{BlockPair, KvLayout, OwnerNotify};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::lease::{LeaseInfo, Released};

/// Version of the local API; [`Request::Hello`] carries it.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest frame body, bytes (16 MiB).
pub const MAX_FRAME_BYTES: usize = 16 << 20;
/// Most file descriptors in one frame.
pub const MAX_FDS: usize = 64;

/// Direction of a managed READ, from the reader's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadDirection {
    /// The prefill engine reads a decode engine's retained blocks.
    D2p,
    /// The decode engine reads a prefill engine's fresh blocks.
    P2d,
}

impl ReadDirection {
    /// The dataplane/probe direction.
    pub fn to_dataplane(self) -> kvloop_common::Direction {
        match self {
            Self::D2p => kvloop_common::Direction::DecodeToPrefill,
            Self::P2d => kvloop_common::Direction::PrefillToDecode,
        }
    }
}

/// GPU memory of one region, as a CUDA IPC handle (feature `cuda`; the agent
/// opens it with cudarc on the engine's device).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaIpcRegion {
    /// CUDA device ordinal.
    pub device: i32,
    /// `cudaIpcMemHandle_t` bytes (64), hex-encoded.
    pub handle_hex: String,
    /// Region length, bytes.
    pub len_bytes: u64,
}

/// Where a registered engine's KV memory comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RegionSource {
    /// One memfd per region in the frame's `SCM_RIGHTS`, in layout order;
    /// `len_bytes[i]` is the length to map of fd `i` (≥ the layout's
    /// region length).
    Memfd {
        /// Length of each region, bytes.
        len_bytes: Vec<u64>,
    },
    /// CUDA IPC handles (feature `cuda`; fails with a clear error otherwise).
    CudaIpc {
        /// One per region.
        regions: Vec<CudaIpcRegion>,
    },
}

/// A request to the agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Opens the conversation; the agent answers [`Reply::Welcome`] or an error
    /// when `version` differs from [`PROTOCOL_VERSION`].
    Hello {
        /// The client's [`PROTOCOL_VERSION`].
        version: u32,
        /// Free-form client name for logs.
        client: String,
    },
    /// Registers an engine's KV memory and layout; the agent starts a
    /// transfer engine for it (side channel on the agent's node address) and
    /// serves remote READs of its blocks. Re-registering an id replaces it.
    /// The registration lasts as long as the connection that made it: when
    /// that connection closes (the engine exited), the engine is
    /// unregistered and its memory no longer served.
    Register {
        /// Engine id, unique in the cluster (vLLM's `engine_id`).
        engine_id: String,
        /// KV layout of the regions.
        layout: KvLayout,
        /// The memory.
        regions: RegionSource,
        /// Side-channel port; 0 or absent picks a free one.
        #[serde(default)]
        side_channel_port: Option<u16>,
    },
    /// Stops an engine's transfer engine and drops its leases.
    Unregister {
        /// Engine id.
        engine_id: String,
    },
    /// Connects a registered engine to a remote engine's side channel
    /// (handshake both ways; afterwards either can READ from the other).
    Connect {
        /// Local engine id.
        engine_id: String,
        /// The remote engine's side-channel address (`remote_host:remote_port`).
        remote: SocketAddr,
    },
    /// READs blocks of a connected remote engine into local blocks.
    Read {
        /// Local (reader) engine id.
        engine_id: String,
        /// Remote (owner) engine id.
        peer_engine_id: String,
        /// (remote, local) block pairs.
        blocks: Vec<BlockPair>,
        /// D→P or P→D.
        direction: ReadDirection,
        /// Owner notification to send after the READ (`"<req>:<count>"`);
        /// also names the owner's lease to check when `check_lease`.
        #[serde(default)]
        notify: Option<OwnerNotify>,
        /// Before reading, renew the owner's lease of `notify.owner_request_id`
        /// through the owner's agent and decline when the blocks expire within
        /// the safety margin. Default false.
        #[serde(default)]
        check_lease: bool,
        /// Timeout, ms (default: the agent's `read_timeout_ms`).
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    /// Sends an owner notification without a READ (release blocks the reader
    /// decided not to read).
    Notify {
        /// Local engine id.
        engine_id: String,
        /// Remote owner engine id.
        peer_engine_id: String,
        /// Owner request id.
        owner_request_id: String,
        /// Notifications the owner expects in total.
        count: u32,
    },
    /// Retains blocks of a local engine's request under a TTL.
    Retain {
        /// Owner engine id (registered here).
        engine_id: String,
        /// Owner request id.
        request_id: String,
        /// Block ids.
        block_ids: Vec<u64>,
        /// TTL, ms; default `lease.default_ttl_ms`.
        #[serde(default)]
        ttl_ms: Option<u64>,
    },
    /// Renews the lease of `peer_engine_id`'s request (local or through the
    /// owner's agent) for `lease_ms`.
    Renew {
        /// Owner engine id.
        peer_engine_id: String,
        /// Owner request id.
        request_id: String,
        /// Requested lease, ms (capped by the owner's `max_lease_ms`).
        lease_ms: u64,
    },
    /// The owner releases retained blocks (it evicts them). Refused with
    /// `lease_in_use` while a reader that renewed the lease has not
    /// notified yet (the owner keeps them and evicts another request).
    Release {
        /// Owner engine id.
        engine_id: String,
        /// Owner request id.
        request_id: String,
    },
    /// Waits up to `timeout_ms` for events of a local engine (owner
    /// notifications received, leases released) and returns them (at most
    /// `max`). Blocks the connection while waiting: use a separate client.
    Events {
        /// Engine id.
        engine_id: String,
        /// Longest wait, ms (0 = return at once).
        timeout_ms: u64,
        /// Most events returned. Default 1024.
        #[serde(default = "default_max_events")]
        max: usize,
    },
    /// Reports a prefill timed by the engine (fed to the cost model as a
    /// user-space sample).
    RecordPrefill {
        /// Prefill engine id.
        engine_id: String,
        /// Prompt tokens.
        prompt_tokens: u64,
        /// Tokens READ instead of computed.
        reused_tokens: u64,
        /// Request received → first token, µs.
        latency_us: u64,
    },
    /// The explanation of a pair's threshold.
    Explain {
        /// Prefill engine id.
        prefill_engine_id: String,
        /// Decode engine id.
        decode_engine_id: String,
    },
    /// Agent status (engines, peers, paths, thresholds).
    Status,
}

fn default_max_events() -> usize {
    1024
}

/// An event of a hosted engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EngineEvent {
    /// An owner notification from a reader.
    Notification {
        /// Reader engine id.
        from_engine_id: String,
        /// Owner request id.
        owner_request_id: String,
        /// Notifications expected in total.
        count: u32,
    },
    /// Retained blocks were released (notified, expired, or by the owner).
    Released(Released),
}

/// A successful answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Answer to [`Request::Hello`].
    Welcome {
        /// The agent's [`PROTOCOL_VERSION`].
        version: u32,
        /// The agent's id (node name).
        agent_id: String,
    },
    /// An engine was registered.
    Registered {
        /// Engine id.
        engine_id: String,
        /// Its side-channel address (what `kv_transfer_params` carries as
        /// `remote_host`/`remote_port`).
        side_channel: SocketAddr,
        /// Backend name.
        backend: String,
    },
    /// Connected to a remote engine.
    Connected {
        /// Its engine id.
        peer_engine_id: String,
    },
    /// A READ completed.
    ReadDone(ReadDone),
    /// Lease state.
    Lease(LeaseInfo),
    /// Events.
    Events {
        /// Oldest first.
        events: Vec<EngineEvent>,
    },
    /// Explanation: rendered text and the structured form.
    Explain {
        /// Human-readable.
        text: String,
        /// `kvloop_costmodel::Explain` as JSON.
        explain: serde_json::Value,
    },
    /// Status as JSON.
    Status(serde_json::Value),
    /// Done, nothing to return.
    Done,
}

/// What a successful managed READ did (the dataplane's `ReadOutcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadDone {
    /// Agent-unique READ id (also in the probe arguments).
    pub xfer_id: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// Descriptors (block pairs × regions).
    pub descriptors: u32,
    /// Post → completion, measured in the agent, µs.
    pub elapsed_us: u64,
}

impl From<kvloop_kv_types::ReadOutcome> for ReadDone {
    fn from(o: kvloop_kv_types::ReadOutcome) -> Self {
        Self {
            xfer_id: o.xfer_id,
            bytes: o.bytes,
            descriptors: o.descriptors,
            elapsed_us: o.elapsed_us,
        }
    }
}

/// What kind of failure an [`ApiError`] is; on the wire a snake_case
/// string (`"bad_request"`, ...). A kind this build does not know (a newer
/// agent) decodes to [`ErrorKind::Other`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// A malformed or inconsistent request; the message names the field.
    BadRequest,
    /// The engine id is not registered with this agent.
    UnknownEngine,
    /// The owner's lease is unknown, expired, expiring within the safety
    /// margin, or does not cover the blocks: recompute.
    Lease,
    /// An owner release refused while a reader that renewed the lease has
    /// not notified yet (keep the blocks, evict another request).
    LeaseInUse,
    /// Protocol versions differ.
    Version,
    /// The caller may not use the agent (its uid; or, on the HTTP API, a
    /// bearer token that is none of `routers[].token`).
    Forbidden,
    /// The agent failed internally.
    Internal,
    /// A dataplane failure without a finer kind (also what agents before
    /// the typed kinds sent for every dataplane failure).
    Dataplane,
    /// The READ names a remote engine the local engine has no handshake
    /// with (never connected, or the connection closed): connect again.
    UnknownPeer,
    /// The READ timed out (its destination blocks are quarantined until
    /// the transfer completes).
    Timeout,
    /// The remote engine went away while the READ was pending.
    PeerGone,
    /// The side-channel handshake failed or was refused.
    Handshake,
    /// The two engines' layouts cannot exchange blocks.
    LayoutMismatch,
    /// A destination block is still the target of an abandoned READ.
    BlockQuarantined,
    /// A block id is outside a layout, or a local block appears twice.
    BlockRange,
    /// The transfer backend (libfabric provider, NIXL plugin) failed.
    Backend,
    /// A kind this build does not know (sent by a newer agent).
    #[serde(other)]
    Other,
}

impl ErrorKind {
    /// The wire name (`"bad_request"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::UnknownEngine => "unknown_engine",
            Self::Lease => "lease",
            Self::LeaseInUse => "lease_in_use",
            Self::Version => "version",
            Self::Forbidden => "forbidden",
            Self::Internal => "internal",
            Self::Dataplane => "dataplane",
            Self::UnknownPeer => "unknown_peer",
            Self::Timeout => "timeout",
            Self::PeerGone => "peer_gone",
            Self::Handshake => "handshake",
            Self::LayoutMismatch => "layout_mismatch",
            Self::BlockQuarantined => "block_quarantined",
            Self::BlockRange => "block_range",
            Self::Backend => "backend",
            Self::Other => "other",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which side of a transfer an error comes from (the dataplane's
/// `ErrorSource`, carried over the socket).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorOrigin {
    /// The agent or the local engine: bad arguments, local resources.
    Local,
    /// The remote engine or its agent: refused handshake, gone, declined.
    Peer,
    /// The transfer backend (libfabric provider or NIXL plugin).
    Backend,
}

/// A failed request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ApiError {
    /// Machine-readable kind.
    pub kind: ErrorKind,
    /// Human-readable, naming the bad field where there is one.
    pub message: String,
    /// Where the failure came from; absent from agents before the typed
    /// kinds and for errors of the API itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<ErrorOrigin>,
    /// Whether sending the same request again may succeed and is safe
    /// (the dataplane's `retry_safe`); `false` when absent.
    #[serde(default)]
    pub retry_safe: bool,
}

impl ApiError {
    /// Builds an error of the local API (no origin, not retry-safe).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            origin: None,
            retry_safe: false,
        }
    }

    /// Sets where the failure came from.
    pub fn with_origin(mut self, origin: ErrorOrigin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// Marks the request as safe to send again.
    pub fn retry_safe(mut self, safe: bool) -> Self {
        self.retry_safe = safe;
        self
    }
}

/// A response frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    /// Success.
    Ok(Reply),
    /// Failure.
    Err(ApiError),
}

/// The body length a frame header (`u32` little-endian) announces.
///
/// # Errors
/// `InvalidData` when it exceeds [`MAX_FRAME_BYTES`].
pub fn frame_len(head: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes: at most {MAX_FRAME_BYTES}"),
        ));
    }
    Ok(len)
}

/// Decodes a frame body sent to the agent.
///
/// # Errors
/// The body is not one JSON [`Request`].
pub fn decode_request(body: &[u8]) -> serde_json::Result<Request> {
    serde_json::from_slice(body)
}

/// Decodes a frame body sent by the agent.
///
/// # Errors
/// The body is not one JSON [`Response`].
pub fn decode_response(body: &[u8]) -> serde_json::Result<Response> {
    serde_json::from_slice(body)
}

/// Writes one frame with `fds` attached.
///
/// # Errors
/// I/O errors; `InvalidInput` for an oversized body or too many fds.
pub async fn write_frame(s: &UnixStream, body: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if body.len() > MAX_FRAME_BYTES || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "frame of {} bytes with {} fds: at most {MAX_FRAME_BYTES} bytes and {MAX_FDS} fds",
                body.len(),
                fds.len()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    let mut off = 0;
    let mut fds_sent = fds.is_empty();
    while off < buf.len() {
        let n = s
            .async_io(Interest::WRITABLE, || {
                let iov = [IoSlice::new(&buf[off..])];
                let rights = [ControlMessage::ScmRights(fds)];
                let cmsgs: &[ControlMessage] = if fds_sent { &[] } else { &rights };
                sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            })
            .await?;
        fds_sent = true;
        off += n;
    }
    Ok(())
}

/// Reads one frame and the fds that came with it; `None` at a clean end of
/// stream before a frame.
///
/// # Errors
/// I/O errors; `InvalidData` for an oversized frame or a stream cut inside
/// a frame.
pub async fn read_frame(s: &UnixStream) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut head = [0u8; 4];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < 4 {
        let n = recv_some(s, &mut head[got..], &mut fds).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "stream ended inside a frame header",
            ));
        }
        got += n;
    }
    let len = frame_len(head)?;
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = recv_some(s, &mut body[got..], &mut fds).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "stream ended inside a frame body",
            ));
        }
        got += n;
    }
    Ok(Some((body, fds)))
}

async fn recv_some(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    s.async_io(Interest::READABLE, || {
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
        let mut iov = [IoSliceMut::new(buf)];
        let msg = recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        let n = msg.bytes;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    for fd in raw {
                        // SAFETY: the kernel just installed these fds in this process.
                        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("ancillary data truncated: at most {MAX_FDS} fds per frame"),
            ));
        }
        Ok(n)
    })
    .await
}

/// Sends a JSON message as a frame.
///
/// # Errors
/// Serialization or I/O errors.
pub async fn send_json<T: Serialize>(s: &UnixStream, msg: &T, fds: &[RawFd]) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    write_frame(s, &body, fds).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_headers_and_bodies_decode_without_a_socket() {
        assert_eq!(frame_len(7u32.to_le_bytes()).unwrap(), 7);
        assert_eq!(
            frame_len((MAX_FRAME_BYTES as u32).to_le_bytes()).unwrap(),
            16 << 20
        );
        let e = frame_len((MAX_FRAME_BYTES as u32 + 1).to_le_bytes()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let hello = br#"{"op":"hello","version":1,"client":"t"}"#;
        assert!(matches!(
            decode_request(hello),
            Ok(Request::Hello { version: 1, .. })
        ));
        assert!(decode_request(br#"{"op":"hello","version":1}"#).is_err());
        assert_eq!(
            decode_response(br#"{"ok":{"reply":"done"}}"#).unwrap(),
            Response::Ok(Reply::Done)
        );
    }

    /// Errors from agents before the typed kinds still decode, and a kind
    /// this build does not know decodes to the catch-all.
    #[test]
    fn error_kinds_stay_backward_readable() {
        let old: ApiError =
            serde_json::from_str(r#"{"kind":"dataplane","message":"READ 3 timed out"}"#).unwrap();
        assert_eq!(old.kind, ErrorKind::Dataplane);
        assert_eq!((old.origin, old.retry_safe), (None, false));
        let newer: ApiError =
            serde_json::from_str(r#"{"kind":"from_the_future","message":"m","origin":"peer"}"#)
                .unwrap();
        assert_eq!(newer.kind, ErrorKind::Other);
        assert_eq!(newer.origin, Some(ErrorOrigin::Peer));
        let e = ApiError::new(ErrorKind::Timeout, "READ 7 timed out")
            .with_origin(ErrorOrigin::Backend)
            .retry_safe(true);
        let wire = serde_json::to_value(&e).unwrap();
        assert_eq!(
            wire,
            serde_json::json!({"kind": "timeout", "message": "READ 7 timed out",
                               "origin": "backend", "retry_safe": true})
        );
        assert_eq!(serde_json::from_value::<ApiError>(wire).unwrap(), e);
        assert_eq!(e.kind.as_str(), "timeout");
        assert_eq!(e.to_string(), "timeout: READ 7 timed out");
        // Every kind's wire name is what serde writes.
        for k in [
            ErrorKind::BadRequest,
            ErrorKind::UnknownEngine,
            ErrorKind::Lease,
            ErrorKind::LeaseInUse,
            ErrorKind::UnknownPeer,
            ErrorKind::BlockQuarantined,
        ] {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
    }
}
