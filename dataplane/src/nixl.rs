//! NIXL backend: `nixl-sys` built with `stub-api` (no NIXL headers needed at
//! build time), the real `libnixl_capi.so` loaded at run time from the
//! `nixl-cu12` wheel's libraries (see `scripts/bootstrap.sh nixl`). The
//! plugin is `UCX` here; `LIBFABRIC` is the one to select on EFA nodes
//! (UCX on EFA falls back to software paths: public report ai-dynamo/nixl#909).
//!
//! All NIXL calls of one agent are serialised by a mutex (nixl-sys documents
//! that concurrent use may deadlock). The task awaiting a READ polls the
//! status of posted transfer requests itself for up to `caller_spin_us`
//! (one caller at a time, as in the libfabric backend); a progress thread
//! polls them when no caller does. `raw.rs` is the raw NIXL loop that
//! `kvloop bench read` compares against.
pub mod raw;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp,
    XferRequest, XferStatus,
};
use serde::{Deserialize, Serialize};

use crate::backend::{
    BackendMetadata, Completion, PeerSlot, RemoteRegion, TransferBackend, mismatch,
};
use crate::error::{DataplaneError, Result};
use crate::layout::Segment;
use crate::region::{MemoryKind, RegionDesc};

/// Configuration of the NIXL backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NixlConfig {
    /// NIXL backend plugin: `UCX` (default), `LIBFABRIC` on EFA nodes.
    #[serde(default = "default_plugin")]
    pub plugin: String,
    /// Folder holding `libnixl_capi.so` and `plugins/`. Default:
    /// `$KVLOOP_NIXL_DIR/.nixl_cu12.mesonpy.libs`, else
    /// `~/.cache/kvloop/nixl-cu12-1.5.1/.nixl_cu12.mesonpy.libs`.
    #[serde(default)]
    pub lib_dir: Option<PathBuf>,
    /// Caller-driven progress: the task awaiting a READ polls the transfer
    /// requests' status itself for up to this long before the progress
    /// thread takes over, µs; 0 leaves it all to the thread. Default 1000.
    #[serde(default = "default_caller_spin_us")]
    pub caller_spin_us: u64,
}

fn default_caller_spin_us() -> u64 {
    1000
}

fn default_plugin() -> String {
    "UCX".into()
}

impl Default for NixlConfig {
    fn default() -> Self {
        Self {
            plugin: default_plugin(),
            lib_dir: None,
            caller_spin_us: default_caller_spin_us(),
        }
    }
}

/// The folder the NIXL runtime libraries are looked up in (see [`NixlConfig::lib_dir`]).
pub fn default_lib_dir() -> PathBuf {
    let base = std::env::var_os("KVLOOP_NIXL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/root".into());
            home.join(".cache/kvloop/nixl-cu12-1.5.1")
        });
    base.join(".nixl_cu12.mesonpy.libs")
}

/// Sets the environment NIXL and UCX read at start-up when it is not set
/// already: `NIXL_PLUGIN_DIR=<lib_dir>/plugins` and `UCX_MODULES=^ib*` (without
/// the latter, processes segfault at exit inside a bundled InfiniBand module
/// on machines without IB, measured on libfabric 1.17 / NIXL 1.5).
///
/// # Safety
/// Modifies the process environment: call it at process start, before any
/// other thread exists (as `kvloop` and `kvloop-agent` do first thing in `main`).
pub unsafe fn prepare_env(lib_dir: &Path) {
    if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
        // SAFETY: the caller runs this before any other thread exists.
        unsafe { std::env::set_var("NIXL_PLUGIN_DIR", lib_dir.join("plugins")) };
    }
    if std::env::var_os("UCX_MODULES").is_none() {
        // SAFETY: as above: no other thread exists yet.
        unsafe { std::env::set_var("UCX_MODULES", "^ib*") };
    }
}

/// Loads `libnixl_capi.so` from `lib_dir` (by absolute path, so no
/// `LD_LIBRARY_PATH` is needed: the library's RPATH finds its neighbours) and
/// checks that nixl-sys resolves to it.
///
/// # Errors
/// [`DataplaneError::NixlUnavailable`] with what is missing and how to get it.
pub fn load_runtime(lib_dir: &Path) -> Result<()> {
    let lib = lib_dir.join("libnixl_capi.so");
    if !lib.exists() {
        return Err(DataplaneError::NixlUnavailable(format!(
            "{} not found; run `scripts/bootstrap.sh nixl` (or set KVLOOP_NIXL_DIR)",
            lib.display()
        )));
    }
    let c = CString::new(lib.to_string_lossy().as_bytes()).expect("path without NUL");
    // SAFETY: dlopen of a library path; the handle is kept for the process lifetime.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlopen failed, so dlerror returns a NUL-terminated message.
        let err = unsafe { std::ffi::CStr::from_ptr(libc::dlerror()) }
            .to_string_lossy()
            .into_owned();
        return Err(DataplaneError::NixlUnavailable(format!(
            "dlopen {}: {err}",
            lib.display()
        )));
    }
    if nixl_sys::is_stub() {
        return Err(DataplaneError::NixlUnavailable(
            "nixl-sys resolved no real libnixl_capi.so (stub API only)".into(),
        ));
    }
    Ok(())
}

#[derive(Debug)]
struct Desc {
    addr: u64,
    len: u64,
    kind: MemoryKind,
}

impl MemoryRegion for Desc {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Desc {
    fn mem_type(&self) -> MemType {
        match self.kind {
            MemoryKind::Host => MemType::Dram,
            MemoryKind::Cuda { .. } => MemType::Vram,
        }
    }
    fn device_id(&self) -> u64 {
        match self.kind {
            MemoryKind::Host => 0,
            MemoryKind::Cuda { device } => device as u64,
        }
    }
}

struct AgentBox {
    agent: Agent,
    _regs: Vec<RegistrationHandle>,
}
// SAFETY: every use of the agent goes through the backend's mutex.
unsafe impl Send for AgentBox {}

struct PendingXfer {
    req: XferRequest,
    done: Completion,
}
// SAFETY: transfer requests are only touched under the agent mutex.
unsafe impl Send for PendingXfer {}

/// A loaded remote agent: its NIXL name and its regions.
type NixlPeer = (String, Vec<RemoteRegion>);

struct Shared {
    agent: Mutex<AgentBox>,
    pending: Mutex<Vec<PendingXfer>>,
    peers: Mutex<Vec<Option<NixlPeer>>>,
    stop: AtomicBool,
    /// A caller holds the driver role: the progress thread stays off.
    driving: AtomicBool,
}

/// The NIXL transfer backend.
pub struct NixlBackend {
    shared: Arc<Shared>,
    plugin: String,
    agent_name: String,
    local: Vec<RegionDesc>,
    caller_spin: Duration,
    thread: Option<JoinHandle<()>>,
}

fn nixl_err(plugin: &str, op: &'static str, e: nixl_sys::NixlError) -> DataplaneError {
    DataplaneError::Backend {
        backend: format!("nixl {plugin}"),
        op,
        code: -1,
        message: e.to_string(),
    }
}

impl NixlBackend {
    /// Loads the runtime, creates an agent named after `engine_id`, creates
    /// the `cfg.plugin` backend and registers `regions`.
    ///
    /// # Errors
    /// [`DataplaneError::NixlUnavailable`] when the runtime is missing (never
    /// aborts the process); [`DataplaneError::Backend`] when NIXL refuses.
    pub fn new(engine_id: &str, cfg: NixlConfig, regions: &[RegionDesc]) -> Result<Self> {
        let dir = cfg.lib_dir.clone().unwrap_or_else(default_lib_dir);
        load_runtime(&dir)?;
        if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
            return Err(DataplaneError::NixlUnavailable(format!(
                "NIXL_PLUGIN_DIR is not set: export NIXL_PLUGIN_DIR={} and UCX_MODULES='^ib*' \
                 (or call kvloop_dataplane::nixl::prepare_env at process start)",
                dir.join("plugins").display()
            )));
        }
        let p = &cfg.plugin;
        let agent_name = format!("{engine_id}-{}", std::process::id());
        let agent = Agent::new(&agent_name).map_err(|e| nixl_err(p, "createAgent", e))?;
        let (_mems, params) = agent
            .get_plugin_params(p)
            .map_err(|e| nixl_err(p, "getPluginParams", e))?;
        agent
            .create_backend(p, &params)
            .map_err(|e| DataplaneError::Config {
                field: "plugin",
                expected: format!("a NIXL backend plugin that loads here (`{p}` failed: {e})"),
            })?;
        let mut regs = Vec::with_capacity(regions.len());
        for r in regions {
            let d = Desc {
                addr: r.addr,
                len: r.len_bytes,
                kind: r.kind,
            };
            regs.push(
                agent
                    .register_memory(&d, None)
                    .map_err(|e| nixl_err(p, "registerMem", e))?,
            );
        }
        let shared = Arc::new(Shared {
            agent: Mutex::new(AgentBox { agent, _regs: regs }),
            pending: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            driving: AtomicBool::new(false),
        });
        let s2 = shared.clone();
        let plugin = p.clone();
        let thread = std::thread::Builder::new()
            .name("kvloop-nixl-progress".into())
            .spawn(move || progress_loop(&s2, &plugin))
            .map_err(|e| DataplaneError::io("spawn NIXL progress thread", e))?;
        tracing::info!(plugin = %cfg.plugin, agent = %agent_name, "NIXL agent ready");
        Ok(Self {
            shared,
            plugin: cfg.plugin,
            agent_name,
            local: regions.to_vec(),
            caller_spin: Duration::from_micros(cfg.caller_spin_us),
            thread: Some(thread),
        })
    }
}

/// Polls every posted request's status once, resolving those that ended.
/// Returns whether any is still in progress.
fn poll_pending(s: &Shared, plugin: &str) -> bool {
    let mut pending = std::mem::take(&mut *s.pending.lock());
    if pending.is_empty() {
        return false;
    }
    let mut still = Vec::with_capacity(pending.len());
    {
        let a = s.agent.lock();
        for p in pending.drain(..) {
            match a.agent.get_xfer_status(&p.req) {
                Ok(XferStatus::InProgress) => still.push(p),
                Ok(XferStatus::Success) => p.done.complete(Ok(())),
                Err(e) => p.done.complete(Err(nixl_err(plugin, "getXferStatus", e))),
            }
        }
    }
    if still.is_empty() {
        return false;
    }
    s.pending.lock().extend(still);
    true
}

fn progress_loop(s: &Shared, plugin: &str) {
    while !s.stop.load(Ordering::Acquire) {
        if s.driving.load(Ordering::Acquire) || !poll_pending(s, plugin) {
            std::thread::sleep(Duration::from_micros(20));
            continue;
        }
        std::hint::spin_loop();
    }
}

impl TransferBackend for NixlBackend {
    fn name(&self) -> String {
        format!("nixl {}", self.plugin)
    }

    fn kind(&self) -> kvloop_common::BackendKind {
        kvloop_common::BackendKind::Nixl
    }

    fn metadata(&self) -> BackendMetadata {
        let a = self.shared.agent.lock();
        let metadata = a.agent.get_local_md().unwrap_or_default();
        BackendMetadata::Nixl {
            plugin: self.plugin.clone(),
            agent_name: self.agent_name.clone(),
            metadata,
            regions: self
                .local
                .iter()
                .map(|r| RemoteRegion {
                    base_addr: r.addr,
                    key: 0,
                    len_bytes: r.len_bytes,
                    device_id: match r.kind {
                        MemoryKind::Host => 0,
                        MemoryKind::Cuda { device } => device as u64,
                    },
                })
                .collect(),
        }
    }

    fn check_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<()> {
        match peer {
            BackendMetadata::Nixl {
                plugin, metadata, ..
            } => {
                if *plugin != self.plugin {
                    return Err(mismatch(
                        engine_id,
                        "plugin",
                        self.plugin.clone(),
                        plugin.clone(),
                    ));
                }
                if metadata.is_empty() {
                    return Err(mismatch(
                        engine_id,
                        "metadata",
                        "a NIXL metadata blob".into(),
                        "empty".into(),
                    ));
                }
                Ok(())
            }
            other => Err(mismatch(
                engine_id,
                "backend",
                format!("nixl/{}", self.plugin),
                other.describe(),
            )),
        }
    }

    fn add_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<PeerSlot> {
        let BackendMetadata::Nixl {
            metadata, regions, ..
        } = peer
        else {
            unreachable!("check_peer refuses other backends")
        };
        let name = {
            let a = self.shared.agent.lock();
            a.agent
                .load_remote_md(metadata)
                .map_err(|e| DataplaneError::Handshake {
                    peer: engine_id.into(),
                    reason: format!("loadRemoteMD: {e}"),
                })?
        };
        let mut peers = self.shared.peers.lock();
        peers.push(Some((name, regions.clone())));
        Ok(PeerSlot(peers.len() - 1))
    }

    fn remove_peer(&self, slot: PeerSlot) {
        let taken = self
            .shared
            .peers
            .lock()
            .get_mut(slot.0)
            .and_then(Option::take);
        if let Some((name, _)) = taken {
            let a = self.shared.agent.lock();
            let _ = a.agent.invalidate_remote_md(&name);
        }
    }

    fn quiesce(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.shared.pending.lock().is_empty() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    fn caller_spin(&self) -> Duration {
        self.caller_spin
    }

    fn drive_begin(&self) -> bool {
        !self.shared.driving.swap(true, Ordering::AcqRel)
    }

    fn drive(&self) {
        poll_pending(&self.shared, &self.plugin);
    }

    fn drive_end(&self) {
        // The progress thread polls again within its 20 µs nap.
        self.shared.driving.store(false, Ordering::Release);
    }

    fn post_read(&self, slot: PeerSlot, segments: &[Segment], done: Completion) {
        let p = &self.plugin;
        let Some((remote_agent, remote_regions)) =
            self.shared.peers.lock().get(slot.0).and_then(|x| x.clone())
        else {
            done.complete(Err(DataplaneError::PeerGone {
                engine_id: format!("slot {}", slot.0),
                reason: "peer removed".into(),
            }));
            return;
        };
        let build = || -> Result<XferRequest> {
            let mt = |k: MemoryKind| {
                if k == MemoryKind::Host {
                    MemType::Dram
                } else {
                    MemType::Vram
                }
            };
            let mut local = XferDescList::new(mt(self.local[0].kind))
                .map_err(|e| nixl_err(p, "xferDescList", e))?;
            let mut remote = XferDescList::new(mt(self.local[0].kind))
                .map_err(|e| nixl_err(p, "xferDescList", e))?;
            for s in segments {
                let l = &self.local[s.region as usize];
                let r = &remote_regions[s.region as usize];
                let dev = match l.kind {
                    MemoryKind::Host => 0,
                    MemoryKind::Cuda { device } => device as u64,
                };
                local.add_desc(
                    (l.addr + s.local_offset) as usize,
                    s.len_bytes as usize,
                    dev,
                );
                remote.add_desc(
                    (r.base_addr + s.remote_offset) as usize,
                    s.len_bytes as usize,
                    r.device_id,
                );
            }
            let a = self.shared.agent.lock();
            let req = a
                .agent
                .create_xfer_req(XferOp::Read, &local, &remote, &remote_agent, None)
                .map_err(|e| nixl_err(p, "createXferReq", e))?;
            a.agent
                .post_xfer_req(&req, None)
                .map_err(|e| nixl_err(p, "postXferReq", e))?;
            Ok(req)
        };
        match build() {
            Ok(req) => self.shared.pending.lock().push(PendingXfer { req, done }),
            Err(e) => done.complete(Err(e)),
        }
    }
}

impl Drop for NixlBackend {
    fn drop(&mut self) {
        if !self.quiesce(Duration::from_secs(2)) {
            tracing::warn!(
                "NIXL backend dropped with transfers in flight: leaking the agent and registrations"
            );
            self.shared.stop.store(true, Ordering::Release);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
            std::mem::forget(self.shared.clone());
            return;
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for p in self.shared.pending.lock().drain(..) {
            p.done.complete(Err(DataplaneError::Shutdown));
        }
    }
}
