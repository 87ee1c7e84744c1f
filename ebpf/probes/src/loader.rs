//! [`Probes`]: loading kvloop's eBPF programs (or falling back to user-space
//! timing), attaching them, and reading what they measured. The kernel side
//! is in `kernel.rs`, the offsets it needs in `offsets.rs`, the ring-buffer
//! drain in `drain.rs`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvloop_common::{MAX_PREFILL_PORTS, ReadProbeArgs, site};
use parking_lot::{Mutex, MutexGuard};
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;

use crate::config::ProbeConfig;
use crate::drain::spawn_drain;
use crate::kernel::{Kernel, error_chain, map_err};
use crate::nixl_lib::{NIXL_SYMBOLS, nixl_symbols};
use crate::offsets::read_offsets;
use crate::state::{Snapshot, XferHistLabels, XferSample};
use crate::trace::{Event, TRACE_QUEUE, TraceFilter, TraceStream};
use crate::user::UserState;
use crate::{ProbeError, Source};

#[cfg(not(kvloop_ebpf_skipped))]
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kvloop-ebpf"));
#[cfg(kvloop_ebpf_skipped)]
static EBPF_OBJECT: &[u8] = &[];

pub(crate) struct Inner {
    pub(crate) source: Source,
    pub(crate) fallback_reason: Option<String>,
    kernel: Option<Mutex<Kernel>>,
    pub(crate) user: Mutex<UserState>,
    tx: broadcast::Sender<Event>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probes")
            .field("source", &self.source)
            .finish()
    }
}

/// kvloop's probes: loaded eBPF programs and their maps, or the user-space
/// fallback. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Probes {
    inner: Arc<Inner>,
    drain: Option<JoinHandle<()>>,
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
        let (kernel, ring) = Kernel::open(EBPF_OBJECT, kcfg)?;
        let (tx, _) = broadcast::channel(TRACE_QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let inner = Arc::new(Inner {
            source: Source::Ebpf,
            fallback_reason: None,
            kernel: Some(Mutex::new(kernel)),
            user: Mutex::new(UserState::default()),
            tx,
            stop: stop.clone(),
        });
        let sink = {
            let inner = inner.clone();
            move |batch: Vec<Event>| {
                {
                    let mut u = inner.user.lock();
                    for ev in &batch {
                        u.push(ev);
                    }
                }
                for ev in batch {
                    let _ = inner.tx.send(ev);
                }
            }
        };
        let probes = Self {
            drain: Some(spawn_drain(ring, stop, sink)?),
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
                stop: Arc::new(AtomicBool::new(false)),
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
            Some(k) => Ok(k.lock()),
            None => Err(ProbeError::Unavailable(
                self.inner.fallback_reason.clone().unwrap_or_default(),
            )),
        }
    }

    /// Attaches the enabled tracepoint programs (prefill, retransmit) that are
    /// not attached yet. [`Self::load`] calls it; call it again after
    /// [`Self::detach_all`] to re-attach.
    pub fn attach_tracepoints(&self) -> Result<(), ProbeError> {
        self.kernel()?.attach_tracepoints()
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
        k.attach_uprobe("kvloop_read_post", post, &target, pid)?;
        k.attach_uprobe("kvloop_read_done", done, &target, pid)?;
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
            k.attach_uprobe("kvloop_noop", sym, &target, pid)?;
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
            k.attach_uprobe(enter, sym, &target, pid)?;
            k.attach_uprobe(exit, sym, &target, pid)?;
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

    pub fn detach_all(&self) -> Result<(), ProbeError> {
        self.kernel()?.detach_all()
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
            op: kvloop_common::XferOp::Unknown,
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
            let mut u = self.inner.user.lock();
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
            k.lock().read_into(&mut snap);
        }
        let mut u = self.inner.user.lock();
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
        let probes = Arc::downgrade(&self.inner);
        registry.register_collector(Box::new(crate::metrics::ProbeCollector::new(move || {
            probes
                .upgrade()
                .map(|inner| (Self::snapshot_histograms(&inner), inner.source))
        })));
    }

    pub(crate) fn snapshot_histograms(inner: &Inner) -> Snapshot {
        let mut snap = Snapshot::default();
        if let Some(k) = &inner.kernel {
            k.lock().read_into(&mut snap);
        }
        let u = inner.user.lock();
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
