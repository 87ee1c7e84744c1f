//! User space of kvloop's eBPF probes: loads and attaches the programs of
//! `ebpf/kvloop-ebpf`, reads their maps, exposes Prometheus metrics and
//! streams ring-buffer events.
//!
//! ```no_run
//! use kvloop_probes::{ProbeConfig, Probes, TraceFilter};
//! # async fn f() -> Result<(), kvloop_probes::ProbeError> {
//! let probes = Probes::load_or_fallback(ProbeConfig::default());
//! probes.attach_transfer_sites("/proc/self/exe", None)?;      // kvloop dataplane sites
//! probes.attach_nixl("/opt/nixl/lib/libnixl.so", None)?;      // NIXL library
//! probes.prefill_port(8100)?;                                  // prefill engine port
//! let snap = probes.snapshot();                                // histograms + samples
//! let mut trace = probes.trace(TraceFilter::default());        // live events
//! let ev = trace.next().await;
//! # Ok(()) }
//! ```
//!
//! Probes (see `ebpf/README.md` for `bpftrace` equivalents):
//! transfer uprobes at `kvloop_probe_read_post` / `kvloop_probe_read_done`
//! (5-byte NOP sites, [`kvloop_common::usdt`]) and at `nixlAgent::postXferReq`
//! / `getXferStatus` / `createXferReq` in `libnixl.so`; prefill timing at
//! `sock:sock_recv_length` → `sock:sock_send_length` with the request head read
//! at `syscalls:sys_exit_{read,recvfrom}`; `tcp:tcp_retransmit_skb`.
//!
//! Where eBPF cannot load (no privilege, no BTF, old kernel),
//! [`Probes::load_or_fallback`] logs why and returns probes whose samples come
//! from [`Probes::observe_read_userspace`] (the agent's own transfers timed in
//! user space); every sample and metric carries its [`Source`].

pub mod attribution;
pub mod btf;
mod config;
mod drain;
mod kernel;
mod loader;
mod metrics;
mod nixl_lib;
mod offsets;
pub mod procfs;
mod state;
pub mod trace;
pub mod tracefs;
mod user;

pub use attribution::{TokenCounts, Unattributed};
pub use config::ProbeConfig;
pub use loader::{Probes, enable_run_time_stats};
pub use state::{
    HistogramSnapshot, PrefillSample, RetransmitCount, Snapshot, XferHistLabels, XferSample,
};
pub use trace::{Event, TraceFilter, TraceStream};

/// How often the ring buffer is drained when the kernel side does not wake
/// the reader (it wakes it only when 256 KiB of events are pending, to keep
/// a wakeup off every READ): events reach [`Probes::trace`] and
/// [`Probes::snapshot`] at most this late.
pub const DRAIN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Where a sample was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// In the kernel by kvloop's eBPF programs.
    Ebpf,
    /// In user space by the agent timing its own transfers (fallback).
    Userspace,
}

impl Source {
    /// Label value: `ebpf` or `userspace`.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Userspace => "userspace",
        }
    }
}

/// Errors of the probe loader.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The crate was built with `AYA_BUILD_SKIP=1`: no eBPF object inside.
    #[error("kvloop-probes was built without its eBPF programs (AYA_BUILD_SKIP=1)")]
    NotBuilt,
    /// tracefs is not mounted and could not be mounted.
    #[error("tracefs: {0}")]
    Tracefs(String),
    /// A tracepoint field or BTF member needed by a program was not found.
    #[error("field offsets: {0}")]
    Offsets(String),
    /// Loading the object or a program into the kernel failed (verifier,
    /// privilege, kernel too old).
    #[error("loading eBPF program `{program}`: {message}")]
    Load {
        /// Program name (`kvloop_read_post`, `prefill_recv`, ...).
        program: String,
        /// The loader's message, verifier log included where there is one.
        message: String,
    },
    /// Attaching a program failed.
    #[error("attaching `{program}` to {target}: {message}")]
    Attach {
        /// Program name.
        program: String,
        /// Tracepoint `category:name` or `binary:symbol`.
        target: String,
        /// The loader's message.
        message: String,
    },
    /// A map operation failed.
    #[error("map `{map}`: {message}")]
    Map {
        /// Map name.
        map: String,
        /// The loader's message.
        message: String,
    },
    /// The operation needs the eBPF probes but they are not loaded (fallback
    /// mode, [`Source::Userspace`]).
    #[error("eBPF probes are not loaded (running on user-space timing): {0}")]
    Unavailable(String),
    /// Bad input from the caller; names the field.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The bad field.
        field: &'static str,
        /// What was expected.
        message: String,
    },
}
