//! The loaded eBPF object: its programs, the maps user space reads or
//! writes, and the links of attached programs. Owned by [`crate::Probes`]
//! behind a mutex.

use std::num::NonZeroU32;
use std::path::Path;

use aya::maps::{HashMap as AyaHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf};
use aya::programs::{
    TracePoint, UProbe,
    trace_point::TracePointLinkId,
    uprobe::{UProbeLinkId, UProbeScope},
};
use aya::{Ebpf, EbpfLoader};
use kvloop_common::{LatencyHist, PrefillHistKey, RetransmitKey, XferHistKey, counter, enable};

use crate::state::{HistogramSnapshot, RetransmitCount, Snapshot, XferHistLabels, retransmit_peer};
use crate::{ProbeError, Source};

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

/// An attached program: (program name, link).
pub(crate) enum Link {
    Tp(String, TracePointLinkId),
    Up(String, UProbeLinkId),
}

/// The loaded object and the maps user space uses.
pub(crate) struct Kernel {
    pub(crate) ebpf: Ebpf,
    pub(crate) xfer_hist: PerCpuHashMap<MapData, XferHistKey, LatencyHist>,
    pub(crate) prefill_hist: PerCpuHashMap<MapData, PrefillHistKey, LatencyHist>,
    pub(crate) retransmits: PerCpuHashMap<MapData, RetransmitKey, u64>,
    pub(crate) counters: PerCpuArray<MapData, u64>,
    pub(crate) prefill_ports: AyaHashMap<MapData, u16, u8>,
    pub(crate) server_tgids: AyaHashMap<MapData, u32, u8>,
    pub(crate) links: Vec<Link>,
    /// Human-readable attach points, for diagnostics.
    pub(crate) attached: Vec<String>,
    /// [`enable`] bits in effect.
    pub(crate) enabled: u32,
}

/// [`ProbeError::Load`] of `program` with the whole error chain.
pub(crate) fn load_err(program: &str, e: impl std::error::Error) -> ProbeError {
    ProbeError::Load {
        program: program.to_string(),
        message: error_chain(&e),
    }
}

/// [`ProbeError::Map`] of `map` with the whole error chain.
pub(crate) fn map_err(map: &str, e: impl std::error::Error) -> ProbeError {
    ProbeError::Map {
        map: map.to_string(),
        message: error_chain(&e),
    }
}

/// `e` and its sources, joined by ": ".
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Kernel {
    /// Loads `object` (the eBPF ELF), writes `kcfg` into its `CONFIG` map and
    /// loads every program; returns the kernel side and the event ring.
    ///
    /// # Errors
    /// [`ProbeError::Load`] (privilege, verifier), [`ProbeError::Map`].
    pub(crate) fn open(
        object: &[u8],
        kcfg: kvloop_common::ProbeConfig,
    ) -> Result<(Self, RingBuf<MapData>), ProbeError> {
        crate::offsets::raise_memlock();
        let mut ebpf = EbpfLoader::new()
            .load(object)
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
        let kernel = Self {
            ebpf,
            xfer_hist,
            prefill_hist,
            retransmits,
            counters,
            prefill_ports,
            server_tgids,
            links: Vec::new(),
            attached: Vec::new(),
            enabled: kcfg.enabled,
        };
        Ok((kernel, ring))
    }

    /// Attaches `program` (a uprobe or uretprobe) at `symbol` of `target`,
    /// for every process (`pid = None`) or one.
    ///
    /// # Errors
    /// [`ProbeError::Invalid`] for pid 0, [`ProbeError::Attach`].
    pub(crate) fn attach_uprobe(
        &mut self,
        program: &str,
        symbol: &str,
        target: &Path,
        pid: Option<u32>,
    ) -> Result<(), ProbeError> {
        let k = self;
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

    /// Attaches the enabled tracepoint programs not attached yet.
    ///
    /// # Errors
    /// [`ProbeError::Load`], [`ProbeError::Attach`].
    pub(crate) fn attach_tracepoints(&mut self) -> Result<(), ProbeError> {
        let k = self;
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

    /// Detaches every attached program.
    ///
    /// # Errors
    /// [`ProbeError::Load`] when a program cannot be detached.
    pub(crate) fn detach_all(&mut self) -> Result<(), ProbeError> {
        let k = self;
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

    /// Adds the kernel histograms, retransmit counts and counters to `snap`.
    pub(crate) fn read_into(&self, snap: &mut Snapshot) {
        let k = self;
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
}
