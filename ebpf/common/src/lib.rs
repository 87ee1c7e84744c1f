//! `#[repr(C)]` types shared by kvloop's eBPF programs (`ebpf/`) and user space
//! (`dataplane/`, `agent/`).
//!
//! Everything here is `no_std`, `Copy`, has a fixed layout and no padding that
//! carries meaning, so that the same bytes are read in the kernel and in user
//! space.
#![no_std]

/// Length of the peer (remote engine id) field in probe arguments, bytes.
/// Longer engine ids are truncated; shorter ones are NUL-padded.
pub const PEER_LEN: usize = 32;

#[cfg(not(target_arch = "bpf"))]
pub mod usdt;

pub mod maps;
pub use maps::*;

/// Direction of a KV-block READ, seen from the reader.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Not known to the dataplane (for example an active probe READ).
    Unknown = 0,
    /// The prefill node reads the decode node's retained blocks (next turn of a
    /// conversation).
    DecodeToPrefill = 1,
    /// The decode node reads the prefill node's fresh blocks (the usual P/D path).
    PrefillToDecode = 2,
    /// Agent-to-agent active probe READ shaped like a KV transfer.
    Probe = 3,
}

/// The operation of a NIXL transfer (`nixl_xfer_op_t`), as the NIXL library
/// probes read it from the request handle; [`XferOp::Unknown`] at kvloop's
/// own sites, which know the [`Direction`] instead.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// Not known (kvloop sites, or the request could not be read).
    Unknown = 0,
    /// `NIXL_READ`: the local agent reads the remote agent's memory.
    Read = 1,
    /// `NIXL_WRITE`: the local agent writes into the remote agent's memory.
    Write = 2,
}

impl XferOp {
    /// Decodes the event byte; unknown values map to [`XferOp::Unknown`].
    pub const fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Read,
            2 => Self::Write,
            _ => Self::Unknown,
        }
    }

    /// From NIXL's `nixl_xfer_op_t` value (`NIXL_READ` = 0, `NIXL_WRITE` = 1,
    /// `src/api/cpp/nixl_types.h` of NIXL).
    pub const fn from_nixl(v: u32) -> Self {
        match v {
            0 => Self::Read,
            1 => Self::Write,
            _ => Self::Unknown,
        }
    }

    /// Label used in traces: `read`, `write`, `unknown`.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Unknown => "unknown",
        }
    }
}

impl Direction {
    /// Decodes the wire byte; unknown values map to [`Direction::Unknown`].
    pub const fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::DecodeToPrefill,
            2 => Self::PrefillToDecode,
            3 => Self::Probe,
            _ => Self::Unknown,
        }
    }

    /// Short label used in metrics and logs: `d2p`, `p2d`, `probe`, `unknown`.
    pub const fn label(self) -> &'static str {
        match self {
            Self::DecodeToPrefill => "d2p",
            Self::PrefillToDecode => "p2d",
            Self::Probe => "probe",
            Self::Unknown => "unknown",
        }
    }
}

/// Which transfer backend posted a READ.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// libfabric used directly (providers `efa`, `tcp;ofi_rxm`, `shm`).
    Libfabric = 1,
    /// NIXL (`UCX` or `LIBFABRIC` backend plugin).
    Nixl = 2,
}

/// Argument of the dataplane's USDT-style probe sites
/// `kvloop_probe_read_post` and `kvloop_probe_read_done` (first argument, a
/// pointer to this struct, in `rdi` on x86-64).
///
/// One probed READ is one call to `post` and one call to `done` with the
/// same `xfer_id` in the same process; a READ that stands for `weight` READs
/// (small READs are sampled, [`crate::usdt::site_weight`]) counts `weight`
/// times in the histograms. Layout (24 bytes + `PEER_LEN` + 8):
///
/// | offset | field |
/// |---|---|
/// | 0 | `xfer_id` u64 |
/// | 8 | `bytes` u64 |
/// | 16 | `descriptors` u32 |
/// | 20 | `direction` u8 ([`Direction`]) |
/// | 21 | `backend` u8 ([`BackendKind`]) |
/// | 22 | `status` i16 (0 = success, else a negative errno-style code; 0 at post) |
/// | 24 | `peer` [u8; 32] remote engine id |
/// | 56 | `weight` u32 (READs this one stands for; 0 is read as 1) |
/// | 60 | reserved, 4 bytes of 0 |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadProbeArgs {
    /// Process-unique id of this READ.
    pub xfer_id: u64,
    /// Payload bytes moved by this READ (sum over descriptors).
    pub bytes: u64,
    /// Number of (remote, local) descriptor pairs in the READ.
    pub descriptors: u32,
    /// [`Direction`] as a byte.
    pub direction: u8,
    /// [`BackendKind`] as a byte.
    pub backend: u8,
    /// 0 on success; a negative errno-style code on failure; 0 at post time.
    pub status: i16,
    /// Remote engine id, NUL-padded, truncated to [`PEER_LEN`] bytes.
    pub peer: [u8; PEER_LEN],
    /// READs this one stands for in the histograms: 1, or N when it is the
    /// one probed READ of N small ones (0 is read as 1).
    pub weight: u32,
    /// Reserved, 0.
    pub _pad: [u8; 4],
}

impl ReadProbeArgs {
    /// Builds the peer field from an engine id (truncated, NUL-padded).
    pub fn peer_from_str(engine_id: &str) -> [u8; PEER_LEN] {
        let mut out = [0u8; PEER_LEN];
        let b = engine_id.as_bytes();
        let n = if b.len() < PEER_LEN {
            b.len()
        } else {
            PEER_LEN
        };
        let mut i = 0;
        while i < n {
            out[i] = b[i];
            i += 1;
        }
        out
    }
}

/// Status codes carried in [`ReadProbeArgs::status`].
pub mod status {
    /// The READ completed and all bytes landed.
    pub const OK: i16 = 0;
    /// The READ timed out (`-ETIMEDOUT`).
    pub const TIMED_OUT: i16 = -110;
    /// The provider or backend reported an error (`-EIO`).
    pub const IO_ERROR: i16 = -5;
    /// The READ was cancelled before completion (`-ECANCELED`).
    pub const CANCELLED: i16 = -125;
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn layout_is_stable() {
        assert_eq!(core::mem::size_of::<ReadProbeArgs>(), 24 + PEER_LEN + 8);
        assert_eq!(core::mem::offset_of!(ReadProbeArgs, status), 22);
        assert_eq!(core::mem::offset_of!(ReadProbeArgs, peer), 24);
        assert_eq!(core::mem::offset_of!(ReadProbeArgs, weight), 56);
    }

    #[test]
    fn peer_truncates_and_pads() {
        let p = ReadProbeArgs::peer_from_str("decode-0");
        assert_eq!(&p[..8], b"decode-0");
        assert!(p[8..].iter().all(|&b| b == 0));
        let long = "x".repeat(40);
        assert_eq!(ReadProbeArgs::peer_from_str(&long), [b'x'; PEER_LEN]);
    }
}
