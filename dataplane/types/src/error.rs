//! One error type for the dataplane, recording where a failure came from and
//! whether retrying the same READ is safe (in the style of pingora's errors).
use std::fmt;

/// Which side of a transfer an error comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorSource {
    /// This process: bad arguments, local resources, configuration.
    Local,
    /// The remote engine: refused handshake, gone, declined.
    Peer,
    /// The transfer backend (libfabric provider or NIXL plugin).
    Backend,
}

impl fmt::Display for ErrorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Peer => "peer",
            Self::Backend => "backend",
        })
    }
}

/// Which layout a block id was checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The reader's own layout (destination blocks).
    Local,
    /// The remote engine's layout (source blocks).
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Remote => "remote",
        })
    }
}

/// Every failure of the dataplane. Each variant names the field or peer at
/// fault; [`DataplaneError::source_kind`] and [`DataplaneError::retry_safe`]
/// classify it. A failed READ never leaves the caller with partially written
/// blocks it could mistake for good ones: the caller recomputes.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A block id in a READ request is outside a layout. Nothing was posted.
    #[error(
        "block id {block_id} in field `{field}` is out of range for the {side} layout \
         (expected 0..{num_blocks})"
    )]
    BlockOutOfRange {
        /// Request field, e.g. `blocks[3].remote`.
        field: String,
        /// Which layout.
        side: Side,
        /// The offending block id.
        block_id: u64,
        /// Number of blocks in that layout.
        num_blocks: u64,
    },
    /// Two pairs of one READ write the same local block. Nothing was posted.
    #[error("local block {block_id} appears twice in field `blocks` (at {first} and {second})")]
    DuplicateLocalBlock {
        /// The local block id.
        block_id: u64,
        /// Index of the first pair.
        first: usize,
        /// Index of the second pair.
        second: usize,
    },
    /// A local block is still the target of an abandoned READ (timed out,
    /// or its caller's future dropped) whose completion has not been seen; it
    /// cannot be read into yet.
    #[error(
        "local block {block_id} is quarantined: an earlier READ into it timed out or was cancelled and has not completed"
    )]
    BlockQuarantined {
        /// The local block id.
        block_id: u64,
    },
    /// The READ names an engine this engine has no handshake with.
    #[error("unknown remote engine `{engine_id}` in field `peer_engine_id`: no handshake with it")]
    UnknownPeer {
        /// The engine id named by the request.
        engine_id: String,
    },
    /// Two engines' layouts or backends cannot exchange blocks; refused at
    /// handshake.
    #[error(
        "layout mismatch with engine `{engine_id}`: field `{field}` is {remote} there, {local} here"
    )]
    LayoutMismatch {
        /// The remote engine id.
        engine_id: String,
        /// The field that differs (`block_len_bytes`, `num_regions`, ...).
        field: &'static str,
        /// Local value.
        local: String,
        /// Remote value.
        remote: String,
    },
    /// The side-channel handshake failed or the peer refused it.
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// Address or engine id of the peer.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// A malformed message arrived on the side channel.
    #[error("bad side-channel message from {peer}: field `{field}`: {reason}")]
    Protocol {
        /// Address or engine id of the peer.
        peer: String,
        /// The bad field.
        field: String,
        /// What was expected.
        reason: String,
    },
    /// The READ did not complete within its timeout.
    #[error("READ {xfer_id} from engine `{engine_id}` timed out after {timeout_ms} ms")]
    Timeout {
        /// Process-unique READ id.
        xfer_id: u64,
        /// The remote engine.
        engine_id: String,
        /// The timeout that lapsed.
        timeout_ms: u64,
    },
    /// The backend reported a failure.
    #[error("{backend} {op} failed: {message} (code {code})")]
    Backend {
        /// Backend name, e.g. `libfabric tcp;ofi_rxm` or `nixl UCX`.
        backend: String,
        /// The call that failed, e.g. `fi_readmsg`.
        op: &'static str,
        /// Backend error code (negative `FI_E*` for libfabric).
        code: i64,
        /// Backend's message.
        message: String,
    },
    /// The remote engine went away (connection closed) while a READ was pending.
    #[error("engine `{engine_id}` is gone: {reason}")]
    PeerGone {
        /// The remote engine.
        engine_id: String,
        /// Why it is considered gone.
        reason: String,
    },
    /// Bad configuration or argument.
    #[error("invalid `{field}`: {expected}")]
    Config {
        /// The bad field.
        field: &'static str,
        /// What was expected.
        expected: String,
    },
    /// The NIXL runtime library could not be loaded.
    #[error("NIXL runtime unavailable: {0}")]
    NixlUnavailable(String),
    /// The engine is shutting down.
    #[error("transfer engine is shut down")]
    Shutdown,
    /// An I/O error on the side channel or a memory region.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl DataplaneError {
    /// Where the error came from.
    pub fn source_kind(&self) -> ErrorSource {
        use DataplaneError::*;
        match self {
            BlockOutOfRange { .. }
            | DuplicateLocalBlock { .. }
            | BlockQuarantined { .. }
            | UnknownPeer { .. }
            | Config { .. }
            | NixlUnavailable(_)
            | Shutdown
            | Io { .. } => ErrorSource::Local,
            LayoutMismatch { .. } | Handshake { .. } | Protocol { .. } | PeerGone { .. } => {
                ErrorSource::Peer
            }
            Timeout { .. } | Backend { .. } => ErrorSource::Backend,
        }
    }

    /// Whether posting the same READ again may succeed and is safe. Bounds,
    /// layout and configuration errors never are; a timeout or backend
    /// failure may be, once the quarantine of the destination blocks is over.
    pub fn retry_safe(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::Backend { .. } | Self::Io { .. }
        )
    }

    /// An [`DataplaneError::Io`] with its context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// Result alias of the dataplane.
pub type Result<T, E = DataplaneError> = std::result::Result<T, E>;
