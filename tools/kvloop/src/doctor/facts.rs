//! What `kvloop doctor` gathers about a node before judging it: plain data,
//! filled in by [`super::gather`] (all the I/O) and judged by the pure
//! functions of [`super::checks`]. Every field is what was observed, or the
//! error text of the observation that failed.
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

/// The transfer backend the node's agent uses (from its `agent.toml`, or
/// the agent's default when no configuration was given).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Backend {
    /// kvloop's libfabric backend with this provider (`efa`, `tcp;ofi_rxm`, `shm`).
    Libfabric {
        /// Provider string as configured (components separated by `;`).
        provider: String,
    },
    /// NIXL with this backend plugin (`LIBFABRIC`, `UCX`).
    Nixl {
        /// Plugin name as configured.
        plugin: String,
    },
}

/// One RDMA device under `/sys/class/infiniband`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RdmaDevice {
    /// Device name (`rdmap16s27`, `efa_0`, `mlx5_0`).
    pub name: String,
    /// Kernel driver (basename of `device/driver`), `efa` for EFA.
    pub driver: Option<String>,
    /// Counters readable under `ports/*/hw_counters/`, or why not.
    pub counters: Result<usize, String>,
}

impl RdmaDevice {
    /// Whether this is an EFA device (driver `efa`, or an `rdmap*`/`efa*`
    /// name when the driver link is unreadable).
    pub fn is_efa(&self) -> bool {
        match &self.driver {
            Some(d) => d == "efa",
            None => self.name.starts_with("rdmap") || self.name.starts_with("efa"),
        }
    }
}

/// One router of the agent's configuration and what it answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RouterProbe {
    /// Base URL as configured.
    pub url: String,
    /// HTTP status of `GET {url}/health`, or the connection error.
    pub health: Result<u16, String>,
    /// Whether a token was configured (or given in `KVLOOP_AGENT_ROUTER_TOKEN`).
    pub token_set: bool,
    /// HTTP status of `PUT {url}/admin/thresholds` with the token and the
    /// body `{}` (the router checks the token first: 401 for a wrong one,
    /// 400 for a right one with that empty body), or the connection error.
    pub token: Result<u16, String>,
}

/// The clock of one peer agent against ours, from the HTTP `Date` header of
/// its `/healthz` (one-second resolution).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClockProbe {
    /// Peer name.
    pub peer: String,
    /// `(offset, uncertainty)` in ms: the peer's clock minus ours at the
    /// middle of the request, and the half-width of the interval it lies in
    /// (500 ms of `Date` truncation plus half the round trip); or the error.
    pub offset: Result<(f64, f64), String>,
}

/// Result of trying the uprobes on one engine process (`--pid`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UprobeProbe {
    /// The engine's pid.
    pub pid: u32,
    /// What was probed: `libnixl.so` path seen through `/proc/<pid>/root`,
    /// or `/proc/<pid>/exe` (kvloop's READ sites).
    pub target: String,
    /// The symbols attached, or the attach error.
    pub result: Result<Vec<String>, String>,
}

/// Everything observed on the node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Facts {
    /// Providers listed by `fi_info -l`, or why it could not run.
    pub fi_providers: Result<Vec<String>, String>,
    /// The agent's backend, and where it came from (`agent.toml path` or `default`).
    pub backend: (Backend, String),
    /// RDMA devices, or why `/sys/class/infiniband` could not be listed
    /// (absent directory: empty list).
    pub rdma_devices: Result<Vec<RdmaDevice>, String>,
    /// `FI_EFA_USE_DEVICE_RDMA` in kvloop's environment.
    pub efa_use_device_rdma: Option<String>,
    /// NIXL plugin directory (`--nixl-plugin-dir` or `NIXL_PLUGIN_DIR`).
    pub nixl_plugin_dir: Option<PathBuf>,
    /// `libplugin_*.so` names found there (`UCX`, `LIBFABRIC`), or the error.
    pub nixl_plugins: Result<Vec<String>, String>,
    /// NIXL plugins mapped into the `--pid` engine (from `/proc/<pid>/maps`):
    /// `(pid, plugin names)`, or the error.
    pub engine_plugins: Option<(u32, Result<Vec<String>, String>)>,
    /// `RLIMIT_MEMLOCK` soft limit, bytes (`None`: unlimited).
    pub memlock_bytes: Option<u64>,
    /// `HugePages_Total` from `/proc/meminfo`.
    pub hugepages_total: Option<u64>,
    /// Effective capabilities (`CapEff` of `/proc/self/status`).
    pub cap_eff: u64,
    /// Kernel release `(major, minor)`.
    pub kernel: Option<(u32, u32)>,
    /// `/sys/kernel/btf/vmlinux` is readable.
    pub btf: bool,
    /// tracefs mount with `events/` (`/sys/kernel/tracing` or
    /// `/sys/kernel/debug/tracing`).
    pub tracefs: Option<PathBuf>,
    /// Uprobe attach on `--pid`.
    pub uprobe: Option<UprobeProbe>,
    /// Side channels the node advertises to peers: `(engine, address)`
    /// (the agent's probe and hosted engines from `/v1/engines`, else
    /// `node_addr` of the configuration).
    pub side_channels: Result<Vec<(String, SocketAddr)>, String>,
    /// Peers of the configuration: `(name, HTTP address)`.
    pub peers: Vec<(String, SocketAddr)>,
    /// Routers of the configuration.
    pub routers: Vec<RouterProbe>,
    /// Clock offsets to the peers.
    pub clocks: Vec<ClockProbe>,
}

/// Linux capability bit numbers (`include/uapi/linux/capability.h`).
pub mod cap {
    /// `CAP_IPC_LOCK`.
    pub const IPC_LOCK: u32 = 14;
    /// `CAP_SYS_PTRACE`.
    pub const SYS_PTRACE: u32 = 19;
    /// `CAP_SYS_ADMIN`.
    pub const SYS_ADMIN: u32 = 21;
    /// `CAP_PERFMON` (Linux 5.8).
    pub const PERFMON: u32 = 38;
    /// `CAP_BPF` (Linux 5.8).
    pub const BPF: u32 = 39;

    /// Whether bit `c` is set in `eff`.
    pub fn has(eff: u64, c: u32) -> bool {
        eff & (1u64 << c) != 0
    }
}
