//! Loading, attaching and reading kvloop's eBPF programs.

use std::num::NonZeroU32;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use aya::maps::{HashMap as AyaHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf};
use aya::programs::{
    TracePoint, UProbe,
    trace_point::TracePointLinkId,
    uprobe::{UProbeLinkId, UProbeScope},
};
use aya::{Ebpf, EbpfLoader};
use kvloop_common::{
    LatencyHist, MAX_PREFILL_PORTS, PrefillHistKey, ReadProbeArgs, RetransmitKey, XferHistKey,
    counter, enable, site,
};
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;

use crate::state::{
    HistogramSnapshot, RetransmitCount, Snapshot, UserState, XferHistLabels, XferSample,
    retransmit_peer,
};
use crate::trace::{Event, TRACE_QUEUE, TraceFilter, TraceStream};
use crate::tracefs::{self, field_offset};
use crate::{ProbeError, Source, btf::Btf};

/// What to load and how. `Default`: every probe on, every transfer event
/// sampled, no prefill port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Transfer probes (kvloop sites, NIXL library); attach with
    /// [`Probes::attach_transfer_sites`] / [`Probes::attach_nixl`].
    pub transfer: bool,
    /// Prefill socket probes (attached at load; ports via
    /// [`Probes::prefill_port`] or `prefill_ports`).
    pub prefill: bool,
    /// TCP retransmit probe (attached at load).
    pub retransmit: bool,
    /// Send one transfer event out of every `xfer_sample_every` to user space
    /// (1 = all). Histograms always count every READ.
    pub xfer_sample_every: u32,
    /// Prefill server ports to time from the start (at most 16).
    pub prefill_ports: Vec<u16>,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            transfer: true,
            prefill: true,
            retransmit: true,
            xfer_sample_every: 1,
            prefill_ports: Vec::new(),
        }
    }
}

#[cfg(not(kvloop_ebpf_skipped))]
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kvloop-ebpf"));
#[cfg(kvloop_ebpf_skipped)]
static EBPF_OBJECT: &[u8] = &[];

/// Programs attached to tracepoints at load: (program, category, name, enable bit).
const TRACEPOINTS: [(&str, &str, &str, u32); 7] = [
    ("prefill_recv", "sock", "sock_recv_length", enable::PREFILL),
    ("prefill_send", "sock", "sock_send_length", enable::PREFILL),
    (
        "sys_enter_read",
        "syscalls",
        "sys_enter_read",
        enable::PREFILL,
    ),
    (
        "sys_enter_recvfrom",
        "syscalls",
        "sys_enter_recvfrom",
        enable::PREFILL,
    ),
    (
        "sys_exit_read",
        "syscalls",
        "sys_exit_read",
        enable::PREFILL,
    ),
    (
        "sys_exit_recvfrom",
        "syscalls",
        "sys_exit_recvfrom",
        enable::PREFILL,
    ),
    (
        "tcp_retransmit",
        "tcp",
        "tcp_retransmit_skb",
        enable::RETRANSMIT,
    ),
];

/// Uprobe programs.
const UPROBES: [&str; 9] = [
    "kvloop_noop",
    "kvloop_read_post",
    "kvloop_read_done",
    "nixl_create_enter",
    "nixl_create_exit",
    "nixl_post_enter",
    "nixl_post_exit",
    "nixl_status_enter",
    "nixl_status_exit",
];

/// Symbol prefixes (Itanium mangling of `nixlAgent::<method>` const member
/// functions) of the NIXL calls probed, with (entry program, return program).
/// Prefixes, not full names, so that argument-type changes between NIXL
/// versions still match; the argument registers used are documented in
/// `ebpf/README.md`.
const NIXL_SYMBOLS: [(&str, &str, &str); 3] = [
    (
        "_ZNK9nixlAgent13createXferReqE",
        "nixl_create_enter",
        "nixl_create_exit",
    ),
    (
        "_ZNK9nixlAgent11postXferReqE",
        "nixl_post_enter",
        "nixl_post_exit",
    ),
    (
        "_ZNK9nixlAgent13getXferStatusE",
        "nixl_status_enter",
        "nixl_status_exit",
    ),
];

enum Link {
    Tp(String, TracePointLinkId),
    Up(String, UProbeLinkId),
}

struct Kernel {
    ebpf: Ebpf,
    xfer_hist: PerCpuHashMap<MapData, XferHistKey, LatencyHist>,
    prefill_hist: PerCpuHashMap<MapData, PrefillHistKey, LatencyHist>,
    retransmits: PerCpuHashMap<MapData, RetransmitKey, u64>,
    counters: PerCpuArray<MapData, u64>,
    prefill_ports: AyaHashMap<MapData, u16, u8>,
    server_tgids: AyaHashMap<MapData, u32, u8>,
    links: Vec<Link>,
    /// Human-readable attach points, for diagnostics.
    attached: Vec<String>,
    /// [`enable`] bits in effect.
    enabled: u32,
}

pub(crate) struct Inner {
    pub(crate) source: Source,
    pub(crate) fallback_reason: Option<String>,
    kernel: Option<Mutex<Kernel>>,
    pub(crate) user: Mutex<UserState>,
    tx: broadcast::Sender<Event>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// kvloop's probes: loaded eBPF programs and their maps, or the user-space
/// fallback. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Probes {
    inner: Arc<Inner>,
    drain: Option<JoinHandle<()>>,
}

fn load_err(program: &str, e: impl std::error::Error) -> ProbeError {
    ProbeError::Load {
        program: program.to_string(),
        message: error_chain(&e),
    }
}

fn map_err(map: &str, e: impl std::error::Error) -> ProbeError {
    ProbeError::Map {
        map: map.to_string(),
        message: error_chain(&e),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Reads every offset the programs need from tracefs format files and BTF.
pub(crate) fn read_offsets(cfg: &ProbeConfig) -> Result<kvloop_common::ProbeConfig, ProbeError> {
    let tfs = tracefs::ensure_tracefs()?;
    let recv = tracefs::read_format(&tfs, "sock", "sock_recv_length")?;
    let send = tracefs::read_format(&tfs, "sock", "sock_send_length")?;
    let enter_read = tracefs::read_format(&tfs, "syscalls", "sys_enter_read")?;
    let enter_recvfrom = tracefs::read_format(&tfs, "syscalls", "sys_enter_recvfrom")?;
    let exit_read = tracefs::read_format(&tfs, "syscalls", "sys_exit_read")?;
    let exit_recvfrom = tracefs::read_format(&tfs, "syscalls", "sys_exit_recvfrom")?;
    let rt = tracefs::read_format(&tfs, "tcp", "tcp_retransmit_skb")?;
    // sock_recv_length and sock_send_length share one event class; the
    // programs read both with the same offsets, so check they agree.
    for f in ["sk", "protocol", "ret", "flags"] {
        let a = field_offset(&recv, "sock:sock_recv_length", f)?;
        let b = field_offset(&send, "sock:sock_send_length", f)?;
        if a != b {
            return Err(ProbeError::Offsets(format!(
                "field `{f}` is at {a} in sock_recv_length but {b} in sock_send_length"
            )));
        }
    }
    let exit_ret = field_offset(&exit_read, "syscalls:sys_exit_read", "ret")?;
    if field_offset(&exit_recvfrom, "syscalls:sys_exit_recvfrom", "ret")? != exit_ret {
        return Err(ProbeError::Offsets(
            "`ret` differs between sys_exit_read and sys_exit_recvfrom".into(),
        ));
    }
    let btf = Btf::from_sys_fs()?;
    let mut enabled = 0;
    if cfg.transfer {
        enabled |= enable::XFER;
    }
    if cfg.prefill {
        enabled |= enable::PREFILL;
    }
    if cfg.retransmit {
        enabled |= enable::RETRANSMIT;
    }
    Ok(kvloop_common::ProbeConfig {
        enabled,
        xfer_sample_every: cfg.xfer_sample_every.max(1),
        sock_sk_off: field_offset(&recv, "sock:sock_recv_length", "sk")?,
        sock_protocol_off: field_offset(&recv, "sock:sock_recv_length", "protocol")?,
        sock_ret_off: field_offset(&recv, "sock:sock_recv_length", "ret")?,
        sock_flags_off: field_offset(&recv, "sock:sock_recv_length", "flags")?,
        skc_num_off: btf.member_offset("sock_common", "skc_num")?,
        skc_dport_off: btf.member_offset("sock_common", "skc_dport")?,
        skc_daddr_off: btf.member_offset("sock_common", "skc_daddr")?,
        sys_read_buf_off: field_offset(&enter_read, "syscalls:sys_enter_read", "buf")?,
        sys_recvfrom_buf_off: field_offset(&enter_recvfrom, "syscalls:sys_enter_recvfrom", "ubuf")?,
        sys_exit_ret_off: exit_ret,
        rt_family_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "family")?,
        rt_dport_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "dport")?,
        rt_daddr_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "daddr")?,
        rt_daddr_v6_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "daddr_v6")?,
    })
}

fn raise_memlock() {
    let lim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain setrlimit with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        // Harmless on kernels >= 5.11 (memcg accounting), see RECIPES.
        tracing::debug!(
            "setrlimit(RLIMIT_MEMLOCK) failed: {}; continuing (kernel >= 5.11 accounts BPF memory by cgroup)",
            std::io::Error::last_os_error()
        );
    }
}

impl Probes {
    /// Loads every program, writes the configuration (offsets from tracefs and
    /// BTF), attaches the tracepoint programs and starts draining the ring
    /// buffer. Uprobes are attached later by [`Self::attach_transfer_sites`]
    /// and [`Self::attach_nixl`].
    ///
    /// Errors: [`ProbeError::NotBuilt`], [`ProbeError::Tracefs`],
    /// [`ProbeError::Offsets`], [`ProbeError::Load`] (no privilege, verifier),
    /// [`ProbeError::Attach`], [`ProbeError::Invalid`] (more than 16 ports).
    pub fn load(config: ProbeConfig) -> Result<Self, ProbeError> {
        if EBPF_OBJECT.is_empty() {
            return Err(ProbeError::NotBuilt);
        }
        if config.prefill_ports.len() > MAX_PREFILL_PORTS as usize {
            return Err(ProbeError::Invalid {
                field: "prefill_ports",
                message: format!(
                    "at most {MAX_PREFILL_PORTS} ports, got {}",
                    config.prefill_ports.len()
                ),
            });
        }
        let kcfg = read_offsets(&config)?;
        raise_memlock();
        let mut ebpf = EbpfLoader::new()
            .load(EBPF_OBJECT)
            .map_err(|e| load_err("<object>", e))?;

        {
            let mut cfg_map: aya::maps::Array<_, kvloop_common::ProbeConfig> =
                aya::maps::Array::try_from(
                    ebpf.map_mut("CONFIG")
                        .ok_or_else(|| map_err("CONFIG", std::io::Error::other("missing")))?,
                )
                .map_err(|e| map_err("CONFIG", e))?;
            cfg_map.set(0, kcfg, 0).map_err(|e| map_err("CONFIG", e))?;
        }
        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| map_err(name, std::io::Error::other("missing from the object")))
        };
        let xfer_hist = PerCpuHashMap::try_from(take(&mut ebpf, "XFER_HIST")?)
            .map_err(|e| map_err("XFER_HIST", e))?;
        let prefill_hist = PerCpuHashMap::try_from(take(&mut ebpf, "PREFILL_HIST")?)
            .map_err(|e| map_err("PREFILL_HIST", e))?;
        let retransmits = PerCpuHashMap::try_from(take(&mut ebpf, "RETRANSMITS")?)
            .map_err(|e| map_err("RETRANSMITS", e))?;
        let counters = PerCpuArray::try_from(take(&mut ebpf, "COUNTERS")?)
            .map_err(|e| map_err("COUNTERS", e))?;
        let prefill_ports = AyaHashMap::try_from(take(&mut ebpf, "PREFILL_PORTS")?)
            .map_err(|e| map_err("PREFILL_PORTS", e))?;
        let ring =
            RingBuf::try_from(take(&mut ebpf, "EVENTS")?).map_err(|e| map_err("EVENTS", e))?;
        let server_tgids = AyaHashMap::try_from(take(&mut ebpf, "SERVER_TGIDS")?)
            .map_err(|e| map_err("SERVER_TGIDS", e))?;

        for name in UPROBES {
            let p: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or_else(|| load_err(name, std::io::Error::other("missing from the object")))?
                .try_into()
                .map_err(|e| load_err(name, e))?;
            p.load().map_err(|e| load_err(name, e))?;
        }
        for (name, _, _, _) in TRACEPOINTS {
            let p: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| load_err(name, std::io::Error::other("missing from the object")))?
                .try_into()
                .map_err(|e| load_err(name, e))?;
            p.load().map_err(|e| load_err(name, e))?;
        }
        let links = Vec::new();
        let attached = Vec::new();
        let (tx, _) = broadcast::channel(TRACE_QUEUE);
        let inner = Arc::new(Inner {
            source: Source::Ebpf,
            fallback_reason: None,
            kernel: Some(Mutex::new(Kernel {
                ebpf,
                xfer_hist,
                prefill_hist,
                retransmits,
                counters,
                prefill_ports,
                server_tgids,
                links,
                attached,
                enabled: kcfg.enabled,
            })),
            user: Mutex::new(UserState::default()),
            tx,
            stop: AtomicBool::new(false),
        });
        let probes = Self {
            drain: Some(spawn_drain(inner.clone(), ring)?),
            inner,
        };
        probes.attach_tracepoints()?;
        for p in &config.prefill_ports {
            probes.prefill_port(*p)?;
        }
        tracing::info!("eBPF probes loaded (source=ebpf)");
        Ok(probes)
    }

    /// [`Self::load`], or on failure the user-space fallback: logs a warning
    /// naming the cause and returns probes with [`Source::Userspace`] whose
    /// samples come from [`Self::observe_read_userspace`].
    pub fn load_or_fallback(config: ProbeConfig) -> Self {
        match Self::load(config) {
            Ok(p) => p,
            Err(e) => {
                let reason = e.to_string();
                tracing::warn!(
                    "eBPF probes unavailable ({reason}); falling back to user-space timing of this \
                     process's own transfers: no prefill, NIXL-library or retransmit measurements, \
                     every sample labelled source=userspace"
                );
                Self::userspace(reason)
            }
        }
    }

    /// Probes in user-space fallback mode (no kernel programs).
    pub fn userspace(reason: impl Into<String>) -> Self {
        let (tx, _) = broadcast::channel(TRACE_QUEUE);
        Self {
            inner: Arc::new(Inner {
                source: Source::Userspace,
                fallback_reason: Some(reason.into()),
                kernel: None,
                user: Mutex::new(UserState::default()),
                tx,
                stop: AtomicBool::new(false),
            }),
            drain: None,
        }
    }

    /// Where samples come from: [`Source::Ebpf`] or [`Source::Userspace`].
    pub fn source(&self) -> Source {
        self.inner.source
    }

    /// Why eBPF is not used (fallback mode), else `None`.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.inner.fallback_reason.as_deref()
    }

    fn kernel(&self) -> Result<MutexGuard<'_, Kernel>, ProbeError> {
        match &self.inner.kernel {
            Some(k) => Ok(lock(k)),
            None => Err(ProbeError::Unavailable(
                self.inner.fallback_reason.clone().unwrap_or_default(),
            )),
        }
    }

    fn attach_uprobe(
        k: &mut Kernel,
        program: &str,
        symbol: &str,
        target: &Path,
        pid: Option<u32>,
    ) -> Result<(), ProbeError> {
        let scope = match pid {
            None => UProbeScope::AllProcesses,
            Some(p) => UProbeScope::OneProcess(NonZeroU32::new(p).ok_or(ProbeError::Invalid {
                field: "pid",
                message: "expected a process id > 0".into(),
            })?),
        };
        let p: &mut UProbe = k
            .ebpf
            .program_mut(program)
            .ok_or_else(|| load_err(program, std::io::Error::other("missing")))?
            .try_into()
            .map_err(|e| load_err(program, e))?;
        let id = p
            .attach(symbol, target, scope)
            .map_err(|e| ProbeError::Attach {
                program: program.into(),
                target: format!("{}:{symbol}", target.display()),
                message: error_chain(&e),
            })?;
        k.links.push(Link::Up(program.into(), id));
        k.attached.push(format!(
            "uprobe:{}:{symbol}{} -> {program}",
            target.display(),
            pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
        ));
        Ok(())
    }

    /// Attaches the enabled tracepoint programs (prefill, retransmit) that are
    /// not attached yet. [`Self::load`] calls it; call it again after
    /// [`Self::detach_all`] to re-attach.
    pub fn attach_tracepoints(&self) -> Result<(), ProbeError> {
        let mut k = self.kernel()?;
        let k = &mut *k;
        for (name, cat, tp, bit) in TRACEPOINTS {
            if k.enabled & bit == 0
                || k.links
                    .iter()
                    .any(|l| matches!(l, Link::Tp(n, _) if n == name))
            {
                continue;
            }
            let p: &mut TracePoint = k
                .ebpf
                .program_mut(name)
                .ok_or_else(|| load_err(name, std::io::Error::other("missing")))?
                .try_into()
                .map_err(|e| load_err(name, e))?;
            let id = p.attach(cat, tp).map_err(|e| ProbeError::Attach {
                program: name.into(),
                target: format!("{cat}:{tp}"),
                message: error_chain(&e),
            })?;
            k.links.push(Link::Tp(name.into(), id));
            k.attached.push(format!("tracepoint:{cat}:{tp} -> {name}"));
        }
        Ok(())
    }

    /// Attaches the transfer probes to the dataplane's USDT-style sites
    /// `kvloop_probe_read_post` / `kvloop_probe_read_done` in `binary` (a
    /// path; `/proc/<pid>/exe` works), for every process running it
    /// (`pid = None`) or one process.
    ///
    /// Errors: [`ProbeError::Unavailable`] in fallback mode,
    /// [`ProbeError::Attach`] when the binary lacks the symbols (stripped, or
    /// not linked with kvloop-common).
    pub fn attach_transfer_sites(
        &self,
        binary: impl AsRef<Path>,
        pid: Option<u32>,
    ) -> Result<(), ProbeError> {
        let target = canonical(binary.as_ref(), "binary")?;
        let mut k = self.kernel()?;
        let [post, done] = kvloop_common::usdt::SYMBOLS;
        Self::attach_uprobe(&mut k, "kvloop_read_post", post, &target, pid)?;
        Self::attach_uprobe(&mut k, "kvloop_read_done", done, &target, pid)?;
        Ok(())
    }

    /// Per-program run counts and total run time since load, as
    /// `(program, runs, total ns)`. The kernel counts them only while
    /// BPF run-time statistics are enabled (see [`enable_run_time_stats`]).
    pub fn program_stats(&self) -> Vec<(String, u64, u64)> {
        let Ok(k) = self.kernel() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (name, prog) in k.ebpf.programs() {
            if let Ok(info) = prog.info() {
                out.push((
                    name.to_string(),
                    info.run_count(),
                    info.run_time().as_nanos() as u64,
                ));
            }
        }
        out.sort();
        out
    }

    /// Attaches an empty program to both USDT sites of `binary` (for
    /// benchmarks: the cost of the uprobe mechanism alone, to compare with
    /// [`Self::attach_transfer_sites`]).
    pub fn attach_calibration(
        &self,
        binary: impl AsRef<Path>,
        pid: Option<u32>,
    ) -> Result<(), ProbeError> {
        let target = canonical(binary.as_ref(), "binary")?;
        let mut k = self.kernel()?;
        for sym in kvloop_common::usdt::SYMBOLS {
            Self::attach_uprobe(&mut k, "kvloop_noop", sym, &target, pid)?;
        }
        Ok(())
    }

    /// Attaches the NIXL probes to `libnixl.so` at `lib` (entry and return of
    /// `nixlAgent::createXferReq`, `postXferReq`, `getXferStatus`), for every
    /// process using that library (`pid = None`) or one process. Returns the
    /// symbols attached.
    ///
    /// Errors: [`ProbeError::Invalid`] when `lib` cannot be read or lacks the
    /// symbols; [`ProbeError::Attach`]; [`ProbeError::Unavailable`].
    pub fn attach_nixl(
        &self,
        lib: impl AsRef<Path>,
        pid: Option<u32>,
    ) -> Result<Vec<String>, ProbeError> {
        let target = canonical(lib.as_ref(), "lib")?;
        let syms = nixl_symbols(&target)?;
        let mut k = self.kernel()?;
        for ((_, enter, exit), sym) in NIXL_SYMBOLS.iter().zip(&syms) {
            Self::attach_uprobe(&mut k, enter, sym, &target, pid)?;
            Self::attach_uprobe(&mut k, exit, sym, &target, pid)?;
        }
        Ok(syms)
    }

    /// Times requests on server port `port` as prefill requests (first
    /// request bytes → first response bytes per socket). At most 16 ports.
    ///
    /// The processes listening on `port` now (found in `/proc`) get their
    /// request heads captured from the first request on; a server started
    /// later is learnt by the kernel at its first request, whose head is
    /// then missed (that sample is `Unattributed::NoBytes`), or can be named
    /// with [`Self::prefill_server_pid`].
    pub fn prefill_port(&self, port: u16) -> Result<(), ProbeError> {
        if port == 0 {
            return Err(ProbeError::Invalid {
                field: "port",
                message: "expected a TCP port in 1..=65535".into(),
            });
        }
        {
            let mut k = self.kernel()?;
            k.prefill_ports
                .insert(port, 1, 0)
                .map_err(|e| map_err("PREFILL_PORTS", e))?;
        }
        for pid in crate::procfs::listening_pids(port) {
            self.prefill_server_pid(pid)?;
        }
        Ok(())
    }

    /// Declares `pid` a prefill server: the read/recvfrom hooks (which return
    /// at once for other processes) capture its request heads.
    pub fn prefill_server_pid(&self, pid: u32) -> Result<(), ProbeError> {
        let mut k = self.kernel()?;
        k.server_tgids
            .insert(pid, 1, 0)
            .map_err(|e| map_err("SERVER_TGIDS", e))
    }

    /// Stops timing `port`.
    pub fn remove_prefill_port(&self, port: u16) -> Result<(), ProbeError> {
        let mut k = self.kernel()?;
        k.prefill_ports
            .remove(&port)
            .map_err(|e| map_err("PREFILL_PORTS", e))
    }

    /// Attach points in effect (`tracepoint:sock:sock_recv_length -> prefill_recv`, ...).
    pub fn attached(&self) -> Vec<String> {
        self.kernel()
            .map(|k| k.attached.clone())
            .unwrap_or_default()
    }

    /// Detaches every program (the maps and their contents stay). For
    /// overhead comparisons; re-attach with the `attach_*` calls.
    pub fn detach_all(&self) -> Result<(), ProbeError> {
        let mut k = self.kernel()?;
        let links = std::mem::take(&mut k.links);
        for l in links {
            match l {
                Link::Tp(name, id) => {
                    let p: &mut TracePoint = k
                        .ebpf
                        .program_mut(&name)
                        .ok_or_else(|| load_err(&name, std::io::Error::other("missing")))?
                        .try_into()
                        .map_err(|e| load_err(&name, e))?;
                    p.detach(id).map_err(|e| load_err(&name, e))?;
                }
                Link::Up(name, id) => {
                    let p: &mut UProbe = k
                        .ebpf
                        .program_mut(&name)
                        .ok_or_else(|| load_err(&name, std::io::Error::other("missing")))?
                        .try_into()
                        .map_err(|e| load_err(&name, e))?;
                    p.detach(id).map_err(|e| load_err(&name, e))?;
                }
            }
        }
        k.attached.clear();
        Ok(())
    }

    /// Records a READ timed in user space by the caller (the agent's own
    /// transfers in fallback mode; labelled [`Source::Userspace`]).
    /// `latency` is post → completion.
    pub fn observe_read_userspace(&self, args: &ReadProbeArgs, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let sample = XferSample {
            source: Source::Userspace,
            site: site::label(site::USERSPACE),
            tgid: std::process::id(),
            id: args.xfer_id,
            start_ns: 0,
            latency_ns: ns,
            bytes: args.bytes,
            descriptors: args.descriptors,
            direction: kvloop_common::Direction::from_u8(args.direction),
            peer: crate::state::peer_str(&args.peer),
            status: args.status as i32,
        };
        let labels = XferHistLabels {
            direction: sample.direction,
            peer: sample.peer.clone(),
            size_class: Some(kvloop_common::size_class(args.bytes)),
            site: sample.site,
            ok: args.status == 0,
            source: Source::Userspace,
        };
        let ev = Event::Xfer(sample);
        {
            let mut u = lock(&self.inner.user);
            u.user_xfer_hists
                .entry(labels)
                .or_default()
                .observe(ns, args.bytes);
            u.push(&ev);
        }
        let _ = self.inner.tx.send(ev);
    }

    /// Subscribes to the live event stream with `filter`.
    pub fn trace(&self, filter: TraceFilter) -> TraceStream {
        TraceStream {
            rx: self.inner.tx.subscribe(),
            filter,
            lagged: 0,
        }
    }

    /// Cumulative histograms, retransmit and drop counters, and the samples
    /// received since the previous call (see [`Snapshot`]).
    pub fn snapshot(&self) -> Snapshot {
        let mut snap = Snapshot::default();
        if let Some(k) = &self.inner.kernel {
            let k = lock(k);
            read_kernel(&k, &mut snap);
        }
        let mut u = lock(&self.inner.user);
        snap.xfer_histograms.extend(
            u.user_xfer_hists
                .iter()
                .map(|(l, h)| (l.clone(), h.clone())),
        );
        snap.xfers = u.xfers.drain(..).collect();
        snap.prefills = u.prefills.drain(..).collect();
        snap.counters.push(("samples_dropped", u.samples_dropped));
        snap
    }

    /// Registers the probes' metrics (see `ebpf/README.md`) in `registry`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register_collector(Box::new(crate::metrics::ProbeCollector {
            probes: Arc::downgrade(&self.inner),
        }));
    }

    pub(crate) fn snapshot_histograms(inner: &Inner) -> Snapshot {
        let mut snap = Snapshot::default();
        if let Some(k) = &inner.kernel {
            read_kernel(&lock(k), &mut snap);
        }
        let u = lock(&inner.user);
        snap.xfer_histograms.extend(
            u.user_xfer_hists
                .iter()
                .map(|(l, h)| (l.clone(), h.clone())),
        );
        snap.counters.push(("samples_dropped", u.samples_dropped));
        snap.counters
            .push(("prefill_attributed", u.prefill_attributed));
        snap.counters
            .push(("prefill_unattributed", u.prefill_unattributed));
        snap.counters
            .push(("prefill_prompt_tokens", u.prefill_prompt_tokens));
        snap.counters
            .push(("prefill_reused_tokens", u.prefill_reused_tokens));
        snap
    }
}

fn read_kernel(k: &Kernel, snap: &mut Snapshot) {
    for (key, per_cpu) in k.xfer_hist.iter().flatten() {
        let mut h = HistogramSnapshot::default();
        for v in per_cpu.iter() {
            h.add(v);
        }
        snap.xfer_histograms
            .push((XferHistLabels::from_key(&key, Source::Ebpf), h));
    }
    for (key, per_cpu) in k.prefill_hist.iter().flatten() {
        let mut h = HistogramSnapshot::default();
        for v in per_cpu.iter() {
            h.add(v);
        }
        snap.prefill_histograms.push((key.port, h));
    }
    for (key, per_cpu) in k.retransmits.iter().flatten() {
        snap.retransmits.push(RetransmitCount {
            peer: retransmit_peer(&key),
            count: per_cpu.iter().sum(),
        });
    }
    for i in 0..counter::COUNT - 1 {
        if let Ok(v) = k.counters.get(&i, 0) {
            snap.counters
                .push((counter::NAMES[i as usize], v.iter().sum()));
        }
    }
}

/// Finds the full names of the probed NIXL symbols in `lib`'s dynamic symbol
/// table, in [`NIXL_SYMBOLS`] order.
fn nixl_symbols(lib: &Path) -> Result<Vec<String>, ProbeError> {
    use object::{Object, ObjectSymbol};
    let data = std::fs::read(lib).map_err(|e| ProbeError::Invalid {
        field: "lib",
        message: format!("{}: {e}", lib.display()),
    })?;
    let obj = object::File::parse(&*data).map_err(|e| ProbeError::Invalid {
        field: "lib",
        message: format!("{}: not an ELF object: {e}", lib.display()),
    })?;
    let names: Vec<String> = obj
        .dynamic_symbols()
        .chain(obj.symbols())
        .filter(|s| s.is_definition())
        .filter_map(|s| s.name().ok().map(str::to_string))
        .collect();
    NIXL_SYMBOLS
        .iter()
        .map(|(prefix, _, _)| {
            names
                .iter()
                .find(|n| n.starts_with(prefix))
                .cloned()
                .ok_or_else(|| ProbeError::Invalid {
                    field: "lib",
                    message: format!(
                        "{} defines no symbol starting with {prefix} (is it libnixl.so?)",
                        lib.display()
                    ),
                })
        })
        .collect()
}

fn spawn_drain(
    inner: Arc<Inner>,
    mut ring: RingBuf<MapData>,
) -> Result<JoinHandle<()>, ProbeError> {
    std::thread::Builder::new()
        .name("kvloop-probes-drain".into())
        .spawn(move || {
            let fd = ring.as_raw_fd();
            while !inner.stop.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd. The programs wake us only when
                // WAKEUP_BYTES are pending; the timeout drains the rest.
                unsafe { libc::poll(&mut pfd, 1, crate::DRAIN_INTERVAL.as_millis() as i32) };
                let mut batch = Vec::new();
                while let Some(item) = ring.next() {
                    if let Some(ev) = Event::decode(&item) {
                        batch.push(ev);
                    }
                }
                if batch.is_empty() {
                    continue;
                }
                {
                    let mut u = lock(&inner.user);
                    for ev in &batch {
                        u.push(ev);
                    }
                }
                for ev in batch {
                    let _ = inner.tx.send(ev);
                }
            }
        })
        .map_err(|e| ProbeError::Load {
            program: "<drain thread>".into(),
            message: e.to_string(),
        })
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.drain.take() {
            let _ = h.join();
        }
        // Detach now even if a metrics collector still holds the maps.
        if self.inner.kernel.is_some() {
            let _ = self.detach_all();
        }
    }
}

/// Turns on the kernel's BPF run-time statistics (`BPF_ENABLE_STATS`) for as
/// long as the returned fd is open; [`Probes::program_stats`] then reports
/// time spent inside each program. Costs two clock reads per program run.
pub fn enable_run_time_stats() -> Result<std::os::fd::OwnedFd, ProbeError> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| ProbeError::Load {
        program: "<stats>".into(),
        message: error_chain(&e),
    })
}

/// The canonical path of a probe target (uprobes attach by inode path).
///
/// # Errors
/// [`ProbeError::Invalid`] naming `field` when the path does not resolve.
fn canonical(path: &Path, field: &'static str) -> Result<std::path::PathBuf, ProbeError> {
    std::fs::canonicalize(path).map_err(|e| ProbeError::Invalid {
        field,
        message: format!("{}: {e}", path.display()),
    })
}
