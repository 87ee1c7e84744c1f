//! libfabric backend: one RDM endpoint with `FI_RMA | FI_READ | FI_REMOTE_READ`
//! on a configured provider (`efa` in production; `tcp;ofi_rxm` and `shm`
//! here), kvloop's own bindings (see `build.rs`).
//!
//! * Memory registration: one path for every provider's mode bits (ask for
//!   `LOCAL|VIRT_ADDR|ALLOCATED|PROV_KEY|ENDPOINT`; always read the key back
//!   with `fi_mr_key`; remote base = VA under `FI_MR_VIRT_ADDR`, else 0;
//!   always pass `fi_mr_desc`; bind + enable under `FI_MR_ENDPOINT`).
//! * Limits: outstanding operations ≤ `tx_attr->size`; IOVs per READ ≤
//!   `min(iov_limit, rma_iov_limit)`; each IOV ≤ `max_msg_size`.
//! * Progress: a thread polls the completion queue. It spins while
//!   operations are outstanding or for `spin_us` after the last activity,
//!   then parks with a backoff (`idle_sleep_us` → `idle_sleep_max_us`);
//!   posting wakes it. Both the reader and the serving side
//!   need this progress (tcp moves nothing otherwise).
pub mod raw;
pub mod sys;

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::backend::{
    BackendMetadata, Completion, PeerSlot, RemoteRegion, TransferBackend, mismatch,
};
use crate::error::{DataplaneError, Result};
use crate::layout::Segment;
use crate::region::{MemoryKind, RegionDesc};

/// Configuration of the libfabric backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricConfig {
    /// libfabric provider: `efa`, `tcp;ofi_rxm`, `shm`. Default `tcp;ofi_rxm`.
    #[serde(default = "default_provider")]
    pub provider: String,
    /// Source address to bind (`node` of `fi_getinfo` with `FI_SOURCE`); needed
    /// for `tcp` so that the endpoint listens on the node's address. Default:
    /// none (provider's choice).
    #[serde(default)]
    pub bind_node: Option<String>,
    /// Progress thread: spin this long after the last activity before
    /// waiting, µs. Default 200.
    #[serde(default = "default_spin_us")]
    pub spin_us: u64,
    /// Poll the completion queue continuously, never parking: lowest latency
    /// for serving remote READs at the cost of one busy core. Default false
    /// (readers' hints keep the serving side awake while they READ).
    #[serde(default)]
    pub busy_poll: bool,
    /// Cap on IOVs per READ below the provider's `min(iov_limit,
    /// rma_iov_limit)`. Default: 1 for `shm` (measured here on libfabric 1.17:
    /// a 4-IOV READ of 4 KiB blocks takes a slow path of about 2 ms, while
    /// single-IOV READs complete in about 3 µs each), none otherwise.
    #[serde(default)]
    pub max_iovs_per_read: Option<usize>,
    /// EFA only: `FI_OPT_EFA_RNR_RETRY` set before `fi_enable`; negative
    /// keeps the provider's default. Default 7 (the EFA hardware maximum,
    /// which lets the device retry receiver-not-ready instead of failing).
    #[serde(default = "default_efa_rnr_retry")]
    pub efa_rnr_retry: i32,
    /// Progress thread: first idle park, µs. Default 50.
    #[serde(default = "default_idle_sleep_us")]
    pub idle_sleep_us: u64,
    /// Progress thread: longest idle park after 10 ms without activity, µs.
    /// Bounds the extra latency of the first READ served after a quiet
    /// period. Default 500.
    #[serde(default = "default_idle_sleep_max_us")]
    pub idle_sleep_max_us: u64,
}

fn default_provider() -> String {
    "tcp;ofi_rxm".into()
}
fn default_spin_us() -> u64 {
    200
}
fn default_idle_sleep_us() -> u64 {
    50
}
fn default_efa_rnr_retry() -> i32 {
    7
}
fn default_idle_sleep_max_us() -> u64 {
    500
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            provider: default_provider(),
            bind_node: None,
            spin_us: default_spin_us(),
            idle_sleep_us: default_idle_sleep_us(),
            idle_sleep_max_us: default_idle_sleep_max_us(),
            efa_rnr_retry: default_efa_rnr_retry(),
            max_iovs_per_read: None,
            busy_poll: false,
        }
    }
}

/// libfabric error text for a (positive or negative) `FI_E*` code.
pub fn fi_error_string(code: i64) -> String {
    // SAFETY: fi_strerror returns a static string.
    unsafe { CStr::from_ptr(sys::fi_strerror(code.unsigned_abs() as i32)) }
        .to_string_lossy()
        .into_owned()
}

fn check(backend: &str, op: &'static str, ret: i64) -> Result<i64> {
    if ret < 0 {
        Err(DataplaneError::Backend {
            backend: backend.into(),
            op,
            code: ret,
            message: fi_error_string(ret),
        })
    } else {
        Ok(ret)
    }
}

/// Provider limits read from `fi_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Maximum outstanding transmit operations (`tx_attr->size`).
    pub tx_size: usize,
    /// IOVs per READ (`min(iov_limit, rma_iov_limit)`, at least 1).
    pub iovs_per_read: usize,
    /// Maximum bytes per READ (`ep_attr->max_msg_size`).
    pub max_msg_bytes: u64,
}

/// The open libfabric objects of one endpoint. Freed in reverse order.
pub(crate) struct Endpoint {
    pub(crate) info: *mut sys::fi_info,
    pub(crate) fabric: *mut sys::fid_fabric,
    pub(crate) domain: *mut sys::fid_domain,
    pub(crate) av: *mut sys::fid_av,
    pub(crate) cq: *mut sys::fid_cq,
    pub(crate) ep: *mut sys::fid_ep,
    /// `Some(true)` when efa emulates READ in software, `Some(false)` for
    /// hardware RDMA READ, `None` when unknown (other providers).
    pub(crate) emulated_read: Option<bool>,
    /// CQ wait fd (`FI_WAIT_FD`), when the provider has one.
    pub(crate) wait_fd: Option<i32>,
    pub(crate) provider: String,
    pub(crate) mr_mode: u64,
    pub(crate) limits: Limits,
    pub(crate) address: Vec<u8>,
}

// SAFETY: the endpoint is opened with FI_THREAD_SAFE; libfabric objects may be
// used from any thread.
unsafe impl Send for Endpoint {}
unsafe impl Sync for Endpoint {}

fn close_fid(f: *mut sys::fid) {
    if !f.is_null() {
        // SAFETY: closing an object we opened, once.
        unsafe { sys::fi_close(f) };
    }
}

impl Endpoint {
    /// Opens fabric, domain, AV, CQ and an enabled RDM endpoint on `provider`.
    pub(crate) fn open(cfg: &FabricConfig, hmem: bool) -> Result<Self> {
        let name = format!("libfabric {}", cfg.provider);
        let prov = CString::new(cfg.provider.clone()).map_err(|_| DataplaneError::Config {
            field: "provider",
            expected: "a provider name without NUL bytes".into(),
        })?;
        let node = cfg
            .bind_node
            .as_ref()
            .map(|n| CString::new(n.clone()))
            .transpose()
            .map_err(|_| DataplaneError::Config {
                field: "bind_node",
                expected: "an address without NUL bytes".into(),
            })?;
        let mut info: *mut sys::fi_info = ptr::null_mut();
        // SAFETY: FFI with valid C strings and an out pointer.
        let ret = unsafe {
            sys::kvl_getinfo(
                prov.as_ptr(),
                node.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
                ptr::null(),
                hmem as i32,
                &mut info,
            )
        };
        if ret != 0 || info.is_null() {
            return Err(DataplaneError::Config {
                field: "provider",
                expected: format!(
                    "a libfabric provider that offers FI_EP_RDM with FI_RMA|FI_READ|FI_REMOTE_READ; \
                     fi_getinfo(\"{}\") failed: {} (check `fi_info -p {}`)",
                    cfg.provider,
                    fi_error_string(ret as i64),
                    cfg.provider
                ),
            });
        }
        let mut e = Endpoint {
            info,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            ep: ptr::null_mut(),
            wait_fd: None,
            emulated_read: None,
            // SAFETY: accessors on a valid fi_info.
            provider: unsafe { CStr::from_ptr(sys::kvl_info_prov_name(info)) }
                .to_string_lossy()
                .into_owned(),
            mr_mode: unsafe { sys::kvl_info_mr_mode(info) },
            limits: unsafe {
                Limits {
                    tx_size: sys::kvl_info_tx_size(info).max(1),
                    iovs_per_read: sys::kvl_info_iov_limit(info)
                        .min(sys::kvl_info_rma_iov_limit(info))
                        .max(1),
                    max_msg_bytes: sys::kvl_info_max_msg_size(info) as u64,
                }
            },
            address: Vec::new(),
        };
        let cap = cfg
            .max_iovs_per_read
            .or(if e.provider == "shm" { Some(1) } else { None });
        if let Some(cap) = cap {
            e.limits.iovs_per_read = e.limits.iovs_per_read.min(cap.max(1));
        }
        // SAFETY: the sequence of libfabric calls below follows fi_getinfo(3),
        // fi_fabric(3), fi_domain(3), fi_av(3), fi_cq(3), fi_endpoint(3); every
        // object opened is stored in `e` and closed by Drop on error.
        unsafe {
            check(
                &name,
                "fi_fabric",
                sys::fi_fabric((*info).fabric_attr, &mut e.fabric, ptr::null_mut()) as i64,
            )?;
            check(
                &name,
                "fi_domain",
                sys::fi_domain(e.fabric, info, &mut e.domain, ptr::null_mut()) as i64,
            )?;
            let mut av_attr: sys::fi_av_attr = std::mem::zeroed();
            av_attr.type_ = sys::fi_av_type_FI_AV_TABLE;
            check(
                &name,
                "fi_av_open",
                sys::fi_av_open(e.domain, &mut av_attr, &mut e.av, ptr::null_mut()) as i64,
            )?;
            let mut cq_attr: sys::fi_cq_attr = std::mem::zeroed();
            cq_attr.format = sys::fi_cq_format_FI_CQ_FORMAT_CONTEXT;
            cq_attr.size = (e.limits.tx_size * 2).max(128);
            // No wait object: `fi_cq_sread` on shm (1.17) ignores its timeout,
            // so the progress thread polls and parks instead (see progress_loop).
            cq_attr.wait_obj = sys::fi_wait_obj_FI_WAIT_NONE;
            check(
                &name,
                "fi_cq_open",
                sys::fi_cq_open(e.domain, &mut cq_attr, &mut e.cq, ptr::null_mut()) as i64,
            )?;
            check(
                &name,
                "fi_endpoint",
                sys::fi_endpoint(e.domain, info, &mut e.ep, ptr::null_mut()) as i64,
            )?;
            check(
                &name,
                "fi_ep_bind(av)",
                sys::fi_ep_bind(e.ep, &mut (*e.av).fid, 0) as i64,
            )?;
            check(
                &name,
                "fi_ep_bind(cq)",
                sys::fi_ep_bind(
                    e.ep,
                    &mut (*e.cq).fid,
                    (sys::FI_TRANSMIT | sys::FI_RECV) as u64,
                ) as i64,
            )?;
            if e.provider.starts_with("efa") {
                // RNR retries: EFA's receiver-not-ready retry count (RECIPES.md).
                check(
                    &name,
                    "fi_setopt(FI_OPT_EFA_RNR_RETRY)",
                    sys::kvl_efa_pre_enable(e.ep, cfg.efa_rnr_retry) as i64,
                )?;
            }
            check(&name, "fi_enable", sys::fi_enable(e.ep) as i64)?;
            e.emulated_read = match sys::kvl_efa_emulated_read(e.ep) {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            };
            if e.emulated_read == Some(true) {
                tracing::warn!(provider = %e.provider, "efa emulates RMA READ in software (FI_OPT_EFA_EMULATED_READ): expect protocol-path bandwidth");
            }
            let mut len: usize = 256;
            let mut buf = vec![0u8; len];
            let r = sys::fi_getname(&mut (*e.ep).fid, buf.as_mut_ptr() as *mut c_void, &mut len);
            if r == -(sys::FI_ETOOSMALL as i32) {
                buf.resize(len, 0);
                check(
                    &name,
                    "fi_getname",
                    sys::fi_getname(&mut (*e.ep).fid, buf.as_mut_ptr() as *mut c_void, &mut len)
                        as i64,
                )?;
            } else {
                check(&name, "fi_getname", r as i64)?;
            }
            buf.truncate(len);
            e.address = buf;
        }
        Ok(e)
    }

    pub(crate) fn name(&self) -> String {
        format!("libfabric {}", self.provider)
    }

    /// Registers a region for local use and remote READ; one code path for
    /// every provider's mode bits.
    pub(crate) fn register(&self, region: &RegionDesc, index: usize) -> Result<Mr> {
        let (iface, device) = match region.kind {
            MemoryKind::Host => (0, 0),
            MemoryKind::Cuda { device } => (1, device),
        };
        let mut mr: *mut sys::fid_mr = ptr::null_mut();
        let access =
            (sys::FI_READ | sys::FI_REMOTE_READ | sys::FI_WRITE | sys::FI_REMOTE_WRITE) as u64;
        let name = self.name();
        // SAFETY: registering memory the caller keeps alive for the backend's
        // lifetime (the engine owns both).
        unsafe {
            check(
                &name,
                "fi_mr_regattr",
                sys::kvl_mr_reg(
                    self.domain,
                    region.addr as *mut c_void,
                    region.len_bytes as usize,
                    access,
                    index as u64 + 1,
                    iface,
                    device,
                    &mut mr,
                ) as i64,
            )?;
            let guard = MrGuard(mr);
            if self.mr_mode & sys::FI_MR_ENDPOINT as u64 != 0 {
                check(
                    &name,
                    "fi_mr_bind",
                    sys::fi_mr_bind(mr, &mut (*self.ep).fid, 0) as i64,
                )?;
                check(&name, "fi_mr_enable", sys::fi_mr_enable(mr) as i64)?;
            }
            let key = sys::fi_mr_key(mr);
            if key == u64::MAX
            /* FI_KEY_NOTAVAIL */
            {
                return Err(DataplaneError::Backend {
                    backend: name,
                    op: "fi_mr_key",
                    code: -(sys::FI_ENOKEY as i64),
                    message: "provider returned FI_KEY_NOTAVAIL for a remotely readable region"
                        .into(),
                });
            }
            let desc = sys::fi_mr_desc(mr);
            std::mem::forget(guard);
            let base = if self.mr_mode & sys::FI_MR_VIRT_ADDR as u64 != 0 {
                region.addr
            } else {
                0
            };
            Ok(Mr {
                mr,
                desc,
                addr: region.addr,
                remote: RemoteRegion {
                    base_addr: base,
                    key,
                    len_bytes: region.len_bytes,
                    device_id: device as u64,
                },
            })
        }
    }

    /// Inserts a peer address into the AV.
    pub(crate) fn insert_peer(&self, address: &[u8]) -> Result<u64> {
        let mut fi_addr: sys::fi_addr_t = 0;
        // SAFETY: inserting one address from a buffer we own.
        let n = unsafe {
            sys::fi_av_insert(
                self.av,
                address.as_ptr() as *const c_void,
                1,
                &mut fi_addr,
                0,
                ptr::null_mut(),
            )
        };
        if n != 1 {
            return Err(DataplaneError::Backend {
                backend: self.name(),
                op: "fi_av_insert",
                code: n as i64,
                message: "peer address was not inserted".into(),
            });
        }
        Ok(fi_addr)
    }

    pub(crate) fn remove_peer(&self, fi_addr: u64) {
        let mut a = fi_addr;
        // SAFETY: removing an address we inserted.
        unsafe { sys::fi_av_remove(self.av, &mut a, 1, 0) };
    }

    /// Reads up to `out.len()` completions; returns the op contexts of
    /// successful ones and errors.
    pub(crate) fn poll_cq(&self, out: &mut Vec<(*mut c_void, Option<DataplaneError>)>) -> usize {
        let mut entries: [sys::fi_cq_entry; 32] = unsafe { std::mem::zeroed() };
        // SAFETY: reading into a local array of the CQ's format.
        let n =
            unsafe { sys::fi_cq_read(self.cq, entries.as_mut_ptr() as *mut c_void, entries.len()) };
        if n > 0 {
            for e in &entries[..n as usize] {
                out.push((e.op_context, None));
            }
            return n as usize;
        }
        if n == -(sys::FI_EAVAIL as isize) {
            let mut err: sys::fi_cq_err_entry = unsafe { std::mem::zeroed() };
            // SAFETY: reading one error entry.
            let r = unsafe { sys::fi_cq_readerr(self.cq, &mut err, 0) };
            if r > 0 {
                let msg = unsafe {
                    let s = sys::fi_cq_strerror(
                        self.cq,
                        err.prov_errno,
                        err.err_data,
                        ptr::null_mut(),
                        0,
                    );
                    if s.is_null() {
                        String::new()
                    } else {
                        CStr::from_ptr(s).to_string_lossy().into_owned()
                    }
                };
                out.push((
                    err.op_context,
                    Some(DataplaneError::Backend {
                        backend: self.name(),
                        op: "fi_read completion",
                        code: -(err.err as i64),
                        message: format!("{} ({msg})", fi_error_string(err.err as i64)),
                    }),
                ));
                return 1;
            }
        }
        0
    }

    /// Whether it is safe to block on [`Endpoint::wait_fd`] now
    /// (`fi_trywait`: no completion or progress pending).
    pub(crate) fn try_wait(&self) -> bool {
        let mut fid: *mut sys::fid = unsafe { &mut (*self.cq).fid };
        // SAFETY: one valid fid of ours.
        unsafe { sys::fi_trywait(self.fabric, &mut fid, 1) == 0 }
    }

    /// Posts one vectored READ. Returns the raw libfabric code (0, -FI_EAGAIN, ...).
    ///
    /// # Safety
    /// `local` IOVs must point into registered memory that stays alive until
    /// the completion; `ctx` must stay valid until its completion is read.
    pub(crate) unsafe fn post(
        &self,
        peer: u64,
        local: &[sys::iovec],
        descs: &mut [*mut c_void],
        rma: &[sys::fi_rma_iov],
        ctx: *mut c_void,
    ) -> isize {
        let msg = sys::fi_msg_rma {
            msg_iov: local.as_ptr(),
            desc: descs.as_mut_ptr(),
            iov_count: local.len(),
            addr: peer,
            rma_iov: rma.as_ptr(),
            rma_iov_count: rma.len(),
            context: ctx,
            data: 0,
        };
        unsafe { sys::fi_readmsg(self.ep, &msg, sys::FI_COMPLETION as u64) }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: closing objects in reverse order of opening; null ones skipped.
        unsafe {
            if !self.ep.is_null() {
                close_fid(&mut (*self.ep).fid);
            }
            if !self.cq.is_null() {
                close_fid(&mut (*self.cq).fid);
            }
            if !self.av.is_null() {
                close_fid(&mut (*self.av).fid);
            }
            if !self.domain.is_null() {
                close_fid(&mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                close_fid(&mut (*self.fabric).fid);
            }
            if !self.info.is_null() {
                sys::fi_freeinfo(self.info);
            }
        }
    }
}

struct MrGuard(*mut sys::fid_mr);
impl Drop for MrGuard {
    fn drop(&mut self) {
        // SAFETY: closing a registration that failed to complete setup.
        unsafe { close_fid(&mut (*self.0).fid) };
    }
}

/// One memory registration.
pub(crate) struct Mr {
    pub(crate) mr: *mut sys::fid_mr,
    pub(crate) desc: *mut c_void,
    pub(crate) addr: u64,
    pub(crate) remote: RemoteRegion,
}

unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: closing our registration once.
        unsafe { close_fid(&mut (*self.mr).fid) };
    }
}

/// Per-operation context handed to libfabric. `ctx` comes first so that the
/// provider's `FI_CONTEXT`/`FI_CONTEXT2` scratch space is the struct's start.
#[repr(C)]
struct OpCtx {
    ctx: sys::fi_context2,
    read_id: u64,
}

struct Pending {
    remaining: usize,
    error: Option<DataplaneError>,
    done: Option<Completion>,
}

struct PeerEntry {
    fi_addr: u64,
    regions: Vec<RemoteRegion>,
    /// Set when the peer is being removed: a READ retrying `-FI_EAGAIN` on
    /// it (a dead connection never drains) gives up instead of holding the
    /// peer table for the whole retry window.
    gone: AtomicBool,
}

struct Shared {
    // Field order is drop order: registrations close before the endpoint.
    mrs: Vec<Mr>,
    ep: Endpoint,
    /// Peers by slot. READs are posted under the read lock, so a peer is
    /// never removed while one of its READs is being posted.
    peers: RwLock<Vec<Option<PeerEntry>>>,
    /// AV entries of removed peers, handed to `fi_av_remove` only once no
    /// operation is outstanding: removing an address under in-flight READs
    /// to it crashes inside tcp;ofi_rxm (seen on libfabric 1.17 when a peer
    /// agent exited while this one was probing it).
    retired: Mutex<Vec<u64>>,
    /// `retired` is not empty (checked by the progress loop without locking).
    retired_any: AtomicBool,
    pending: Mutex<HashMap<u64, Pending>>,
    outstanding: AtomicUsize,
    next_read: AtomicU64,
    stop: AtomicBool,
    progress_thread: Mutex<Option<std::thread::Thread>>,
    /// eventfd that posters write to wake a progress thread blocked in poll(2).
    waker: i32,
    /// Spin (serve) until this many ns after `epoch`: set by [`TransferBackend::kick`].
    serve_until_ns: AtomicU64,
    epoch: Instant,
    cfg: FabricConfig,
}

impl Shared {
    /// Removes retired AV entries if nothing is outstanding.
    fn reap_retired(&self) {
        if self.outstanding.load(Ordering::Acquire) > 0 {
            return;
        }
        let mut r = self.retired.lock().unwrap();
        // Re-check under the lock: a READ to a retired address cannot be
        // posted any more (its slot is gone), so `outstanding` reaching 0
        // means the retired addresses carry nothing in flight.
        if self.outstanding.load(Ordering::Acquire) == 0 {
            for fi_addr in r.drain(..) {
                self.ep.remove_peer(fi_addr);
            }
            self.retired_any.store(false, Ordering::Release);
        }
    }

    fn wake(&self) {
        if let Some(t) = self.progress_thread.lock().unwrap().as_ref() {
            t.unpark();
        }
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.waker, &one as *const u64 as *const c_void, 8) };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: closing our eventfd once.
        unsafe { libc::close(self.waker) };
    }
}

/// The libfabric transfer backend.
pub struct FabricBackend {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl FabricBackend {
    /// Opens an endpoint on `cfg.provider`, registers `regions` (in layout
    /// order) and starts the progress thread.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] when the provider is not available;
    /// [`DataplaneError::Backend`] when a libfabric call fails.
    pub fn new(cfg: FabricConfig, regions: &[RegionDesc]) -> Result<Self> {
        let hmem = regions.iter().any(|r| r.kind != MemoryKind::Host);
        let ep = Endpoint::open(&cfg, hmem)?;
        let mut mrs = Vec::with_capacity(regions.len());
        for (i, r) in regions.iter().enumerate() {
            mrs.push(ep.register(r, i)?);
        }
        tracing::info!(
            provider = %ep.provider,
            mr_mode = format_args!("{:#x}", ep.mr_mode),
            tx_size = ep.limits.tx_size,
            iovs_per_read = ep.limits.iovs_per_read,
            max_msg_bytes = ep.limits.max_msg_bytes,
            wait_fd = ep.wait_fd.is_some(),
            "libfabric endpoint open"
        );
        let shared = Arc::new(Shared {
            ep,
            mrs,
            peers: RwLock::new(Vec::new()),
            retired: Mutex::new(Vec::new()),
            retired_any: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            outstanding: AtomicUsize::new(0),
            next_read: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            progress_thread: Mutex::new(None),
            // SAFETY: plain syscall.
            waker: unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
            serve_until_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            cfg,
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvloop-fabric-progress".into())
            .spawn(move || progress_loop(&s2))
            .map_err(|e| DataplaneError::io("spawn progress thread", e))?;
        *shared.progress_thread.lock().unwrap() = Some(thread.thread().clone());
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Provider limits in force.
    pub fn limits(&self) -> Limits {
        self.shared.ep.limits
    }

    /// Whether efa emulates RMA READ in software (`None`: not efa / unknown).
    pub fn emulated_read(&self) -> Option<bool> {
        self.shared.ep.emulated_read
    }

    /// The provider's memory-registration mode bits (`FI_MR_*`).
    pub fn mr_mode(&self) -> u64 {
        self.shared.ep.mr_mode
    }

    /// Accounts `ops` operations of READ `read_id` as finished (completed, or
    /// never posted), keeping the first error; resolves the READ when none
    /// remain.
    fn finish_ops(shared: &Shared, read_id: u64, ops: usize, err: Option<DataplaneError>) {
        let mut pending = shared.pending.lock().unwrap();
        let Some(p) = pending.get_mut(&read_id) else {
            return;
        };
        if p.error.is_none() {
            p.error = err;
        }
        p.remaining -= ops;
        if p.remaining == 0 {
            let p = pending.remove(&read_id).unwrap();
            drop(pending);
            if let Some(done) = p.done {
                done.complete(match p.error {
                    Some(e) => Err(e),
                    None => Ok(()),
                });
            }
        }
    }
}

fn progress_loop(s: &Shared) {
    let mut out = Vec::with_capacity(32);
    let spin = Duration::from_micros(s.cfg.spin_us);
    let min_sleep = Duration::from_micros(s.cfg.idle_sleep_us.max(1));
    let max_sleep = Duration::from_micros(s.cfg.idle_sleep_max_us.max(s.cfg.idle_sleep_us).max(1));
    let mut sleep = min_sleep;
    let mut last_activity = Instant::now();
    while !s.stop.load(Ordering::Acquire) {
        out.clear();
        if s.ep.poll_cq(&mut out) > 0 {
            last_activity = Instant::now();
            sleep = min_sleep;
            for (ctx, err) in out.drain(..) {
                if ctx.is_null() {
                    continue;
                }
                // SAFETY: every context we post is a Box<OpCtx> leaked at post time.
                let op = unsafe { Box::from_raw(ctx as *mut OpCtx) };
                s.outstanding.fetch_sub(1, Ordering::AcqRel);
                FabricBackend::finish_ops(s, op.read_id, 1, err);
            }
            continue;
        }
        if s.outstanding.load(Ordering::Acquire) > 0 {
            last_activity = Instant::now();
            sleep = min_sleep;
            std::hint::spin_loop();
            continue;
        }
        if s.retired_any.load(Ordering::Acquire) {
            s.reap_retired();
        }
        if s.cfg.busy_poll
            || last_activity.elapsed() < spin
            || (s.epoch.elapsed().as_nanos() as u64) < s.serve_until_ns.load(Ordering::Acquire)
        {
            std::hint::spin_loop();
            continue;
        }
        // Idle. With a CQ wait fd: block in poll(2) on it and on the waker
        // eventfd (posting writes it), so remote READs served from our
        // memory are progressed as soon as they arrive. Without one: park
        // (posting unparks), backing off from idle_sleep_us to
        // idle_sleep_max_us; serving-side progress happens on each wake-up.
        if let Some(fd) = s.ep.wait_fd {
            if s.ep.try_wait() {
                let mut fds = [
                    libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: s.waker,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: polling two fds we own; bounded timeout so `stop` is seen.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
                if fds[1].revents != 0 {
                    let mut v: u64 = 0;
                    // SAFETY: draining our eventfd.
                    unsafe { libc::read(s.waker, &mut v as *mut u64 as *mut c_void, 8) };
                }
                last_activity = Instant::now();
            }
            continue;
        }
        std::thread::park_timeout(sleep);
        if last_activity.elapsed() > Duration::from_millis(10) {
            sleep = (sleep * 2).min(max_sleep);
        }
    }
}

impl TransferBackend for FabricBackend {
    fn name(&self) -> String {
        self.shared.ep.name()
    }

    fn kind(&self) -> kvloop_common::BackendKind {
        kvloop_common::BackendKind::Libfabric
    }

    fn metadata(&self) -> BackendMetadata {
        BackendMetadata::Libfabric {
            provider: self.shared.ep.provider.clone(),
            address: self.shared.ep.address.clone(),
            regions: self.shared.mrs.iter().map(|m| m.remote).collect(),
        }
    }

    fn check_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<()> {
        match peer {
            BackendMetadata::Libfabric {
                provider, regions, ..
            } => {
                if *provider != self.shared.ep.provider {
                    return Err(mismatch(
                        engine_id,
                        "provider",
                        self.shared.ep.provider.clone(),
                        provider.clone(),
                    ));
                }
                if regions.len() != self.shared.mrs.len() {
                    return Err(mismatch(
                        engine_id,
                        "regions",
                        self.shared.mrs.len().to_string(),
                        regions.len().to_string(),
                    ));
                }
                Ok(())
            }
            other => Err(mismatch(
                engine_id,
                "backend",
                "libfabric".into(),
                other.describe(),
            )),
        }
    }

    fn add_peer(&self, _engine_id: &str, peer: &BackendMetadata) -> Result<PeerSlot> {
        let BackendMetadata::Libfabric {
            address, regions, ..
        } = peer
        else {
            unreachable!("check_peer refuses other backends")
        };
        let fi_addr = self.shared.ep.insert_peer(address)?;
        let mut peers = self.shared.peers.write().unwrap();
        peers.push(Some(PeerEntry {
            fi_addr,
            regions: regions.clone(),
            gone: AtomicBool::new(false),
        }));
        Ok(PeerSlot(peers.len() - 1))
    }

    fn remove_peer(&self, slot: PeerSlot) {
        if let Some(p) = self
            .shared
            .peers
            .read()
            .unwrap()
            .get(slot.0)
            .and_then(Option::as_ref)
        {
            p.gone.store(true, Ordering::Release);
        }
        // The write lock waits for READs being posted to finish posting.
        let gone = self
            .shared
            .peers
            .write()
            .unwrap()
            .get_mut(slot.0)
            .and_then(Option::take);
        if let Some(p) = gone {
            self.shared.retired.lock().unwrap().push(p.fi_addr);
            self.shared.retired_any.store(true, Ordering::Release);
            self.shared.reap_retired();
        }
    }

    fn kick(&self, expected: Duration) {
        let s = &self.shared;
        // Serve for the expected duration plus the spin window, at most 1 s
        // per hint (a longer READ sends no further hints, but its traffic
        // keeps arriving while we spin; the window is renewed by every hint).
        let until = s.epoch.elapsed()
            + expected.min(Duration::from_secs(1))
            + Duration::from_micros(s.cfg.spin_us);
        s.serve_until_ns
            .fetch_max(until.as_nanos() as u64, Ordering::AcqRel);
        s.wake();
    }

    fn quiesce(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.shared.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline || self.thread.is_none() {
                return false;
            }
            self.shared.wake();
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    fn post_read(&self, slot: PeerSlot, segments: &[Segment], done: Completion) {
        let s = &*self.shared;
        let limits = s.ep.limits;
        // Held until every group is posted: the peer's AV entry stays valid.
        let peers = s.peers.read().unwrap();
        let peer = match peers.get(slot.0).and_then(Option::as_ref) {
            Some(p) => p,
            None => {
                drop(peers);
                done.complete(Err(DataplaneError::PeerGone {
                    engine_id: format!("slot {}", slot.0),
                    reason: "peer removed".into(),
                }));
                return;
            }
        };
        let (fi_addr, remote_regions) = (peer.fi_addr, &peer.regions);
        // Chunk segments to the message size, then group up to
        // `iovs_per_read` chunks per fi_readmsg.
        let max = limits.max_msg_bytes.max(4096);
        let mut chunks: Vec<(u32, u64, u64, u64)> = Vec::new(); // region, remote_off, local_off, len
        for seg in segments {
            let mut off = 0;
            while off < seg.len_bytes {
                let len = (seg.len_bytes - off).min(max);
                chunks.push((
                    seg.region,
                    seg.remote_offset + off,
                    seg.local_offset + off,
                    len,
                ));
                off += len;
            }
        }
        let mut groups: Vec<&[(u32, u64, u64, u64)]> = Vec::new();
        let mut start = 0;
        while start < chunks.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < chunks.len()
                && end - start < limits.iovs_per_read
                && bytes + chunks[end].3 <= max
            {
                bytes += chunks[end].3;
                end += 1;
            }
            groups.push(&chunks[start..end]);
            start = end;
        }
        if groups.is_empty() {
            done.complete(Ok(()));
            return;
        }
        let read_id = s.next_read.fetch_add(1, Ordering::Relaxed);
        s.pending.lock().unwrap().insert(
            read_id,
            Pending {
                remaining: groups.len(),
                error: None,
                done: Some(done),
            },
        );
        let total = groups.len();
        for (gi, g) in groups.iter().enumerate() {
            let mut local = Vec::with_capacity(g.len());
            let mut descs = Vec::with_capacity(g.len());
            let mut rma = Vec::with_capacity(g.len());
            for &(region, roff, loff, len) in g.iter() {
                let mr = &s.mrs[region as usize];
                let rr = remote_regions[region as usize];
                local.push(sys::iovec {
                    iov_base: (mr.addr + loff) as *mut c_void,
                    iov_len: len as usize,
                });
                descs.push(mr.desc);
                rma.push(sys::fi_rma_iov {
                    addr: rr.base_addr + roff,
                    len: len as usize,
                    key: rr.key,
                });
            }
            let ctx = Box::into_raw(Box::new(OpCtx {
                ctx: unsafe { std::mem::zeroed() },
                read_id,
            }));
            // Respect the provider's queue depth (bounded like the EAGAIN
            // retries below; a peer being removed stops the wait).
            let deadline = Instant::now() + Duration::from_secs(5);
            while s.outstanding.load(Ordering::Acquire) >= limits.tx_size
                && Instant::now() < deadline
                && !peer.gone.load(Ordering::Acquire)
            {
                s.wake();
                std::thread::yield_now();
            }
            s.outstanding.fetch_add(1, Ordering::AcqRel);
            let ret = loop {
                // SAFETY: IOVs point into our registrations; ctx lives until its completion.
                let r = unsafe {
                    s.ep.post(fi_addr, &local, &mut descs, &rma, ctx as *mut c_void)
                };
                if r == -(sys::FI_EAGAIN as isize)
                    && Instant::now() < deadline
                    && !peer.gone.load(Ordering::Acquire)
                {
                    s.wake();
                    std::thread::yield_now();
                    continue;
                }
                break r;
            };
            if ret != 0 {
                s.outstanding.fetch_sub(1, Ordering::AcqRel);
                // SAFETY: not posted; reclaim the context.
                drop(unsafe { Box::from_raw(ctx) });
                let err = if peer.gone.load(Ordering::Acquire) {
                    DataplaneError::PeerGone {
                        engine_id: format!("slot {}", slot.0),
                        reason: "peer disconnected while the READ was being posted".into(),
                    }
                } else {
                    DataplaneError::Backend {
                        backend: s.ep.name(),
                        op: "fi_readmsg",
                        code: ret as i64,
                        message: fi_error_string(ret as i64),
                    }
                };
                // Account for this and every group not posted.
                FabricBackend::finish_ops(s, read_id, total - gi, Some(err));
                break;
            }
        }
        s.wake();
    }
}

impl Drop for FabricBackend {
    fn drop(&mut self) {
        // Let in-flight operations finish (bounded) before closing anything:
        // closing an endpoint or registration under an outstanding READ can
        // crash inside the provider.
        let quiet = self.quiesce(Duration::from_secs(2));
        if !quiet {
            tracing::warn!(
                outstanding = self.shared.outstanding.load(Ordering::Acquire),
                "libfabric backend dropped with READs in flight: leaking the endpoint and registrations"
            );
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            self.shared.wake();
            let _ = t.join();
        }
        // Fail whatever is still pending: the endpoint is going away.
        for (_, p) in self.shared.pending.lock().unwrap().drain() {
            if let Some(d) = p.done {
                d.complete(Err(DataplaneError::Shutdown));
            }
        }
        if !quiet {
            // Never close provider objects under in-flight operations.
            std::mem::forget(self.shared.clone());
        }
    }
}
