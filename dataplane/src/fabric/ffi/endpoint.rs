//! The endpoint: fabric, domain, AV, CQ and an enabled RDM endpoint with
//! `FI_RMA | FI_READ | FI_REMOTE_READ` on one provider, opened in the order
//! of fi_getinfo(3), fi_fabric(3), fi_domain(3), fi_av(3), fi_cq(3),
//! fi_endpoint(3) and closed in reverse.
use std::ffi::{CStr, CString, c_void};
use std::ptr;

use super::{check, close_fid, fi_error_string, sys};
use crate::error::{DataplaneError, Result};
use crate::fabric::config::{FabricConfig, Limits};

/// One completion read from the CQ: the operation's context and its error.
pub(crate) type CqEvent = (*mut c_void, Option<DataplaneError>);

/// The open libfabric objects of one endpoint. Freed in reverse order.
pub(crate) struct Endpoint {
    /// `fi_getinfo`'s answer (freed last).
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
    /// Provider name as libfabric reports it, e.g. `tcp;ofi_rxm`.
    pub(crate) provider: String,
    /// `FI_MR_*` mode bits of the domain.
    pub(crate) mr_mode: u64,
    /// Limits in force (the provider's, capped by the configuration).
    pub(crate) limits: Limits,
    /// `fi_getname`: what peers insert into their AV.
    pub(crate) address: Vec<u8>,
}

// SAFETY: the endpoint is opened with FI_THREAD_SAFE; libfabric objects may be
// used from any thread.
unsafe impl Send for Endpoint {}
// SAFETY: as for Send (FI_THREAD_SAFE); the Rust-side fields are read-only
// after `open`.
unsafe impl Sync for Endpoint {}

/// NUL-terminated copies of the provider and bind node names.
fn c_names(cfg: &FabricConfig) -> Result<(CString, Option<CString>)> {
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
    Ok((prov, node))
}

/// `fi_getinfo` for an RDM endpoint with RMA READ on `cfg.provider`.
fn getinfo(cfg: &FabricConfig, hmem: bool) -> Result<*mut sys::fi_info> {
    let (prov, node) = c_names(cfg)?;
    let mut info: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: valid NUL-terminated strings (or null) and an out pointer that
    // lives for the call.
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
    Ok(info)
}

impl Endpoint {
    /// Opens fabric, domain, AV, CQ and an enabled RDM endpoint on `provider`.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] when the provider is not available;
    /// [`DataplaneError::Backend`] naming the libfabric call that failed.
    pub(crate) fn open(cfg: &FabricConfig, hmem: bool) -> Result<Self> {
        let info = getinfo(cfg, hmem)?;
        // SAFETY: `info` is the valid fi_info just returned; `Endpoint` owns
        // it from here (freed by Drop, also on the error paths below).
        let mut e = unsafe { Self::from_info(info) };
        let cap = cfg
            .max_iovs_per_read
            .or(if e.provider == "shm" { Some(1) } else { None });
        if let Some(cap) = cap {
            e.limits.iovs_per_read = e.limits.iovs_per_read.min(cap.max(1));
        }
        if cfg.max_op_bytes > 0 {
            e.limits.max_msg_bytes = e.limits.max_msg_bytes.min(cfg.max_op_bytes);
        }
        let name = e.name();
        e.open_objects(&name)?;
        e.bind_and_enable(cfg, &name)?;
        e.address = e.read_name(&name)?;
        Ok(e)
    }

    /// An endpoint holding only `info`, with the provider's name, MR mode and
    /// limits read from it.
    ///
    /// # Safety
    /// `info` is a valid `fi_info` from `fi_getinfo`, owned by the result.
    unsafe fn from_info(info: *mut sys::fi_info) -> Self {
        // SAFETY: accessors reading fields of the valid fi_info (caller).
        let (provider, mr_mode, limits) = unsafe {
            (
                CStr::from_ptr(sys::kvl_info_prov_name(info))
                    .to_string_lossy()
                    .into_owned(),
                sys::kvl_info_mr_mode(info),
                Limits {
                    tx_size: sys::kvl_info_tx_size(info).max(1),
                    iovs_per_read: sys::kvl_info_iov_limit(info)
                        .min(sys::kvl_info_rma_iov_limit(info))
                        .max(1),
                    max_msg_bytes: sys::kvl_info_max_msg_size(info) as u64,
                },
            )
        };
        Endpoint {
            info,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            ep: ptr::null_mut(),
            wait_fd: None,
            emulated_read: None,
            provider,
            mr_mode,
            limits,
            address: Vec::new(),
        }
    }

    /// Opens fabric, domain, AV (`FI_AV_TABLE`), CQ and the endpoint object.
    fn open_objects(&mut self, name: &str) -> Result<()> {
        let info = self.info;
        // SAFETY: `info` is valid; each out pointer is a field of `self`, so
        // every object opened is closed by Drop, also when a later call fails.
        unsafe {
            check(
                name,
                "fi_fabric",
                sys::fi_fabric((*info).fabric_attr, &mut self.fabric, ptr::null_mut()) as i64,
            )?;
            check(
                name,
                "fi_domain",
                sys::fi_domain(self.fabric, info, &mut self.domain, ptr::null_mut()) as i64,
            )?;
            let mut av_attr: sys::fi_av_attr = std::mem::zeroed();
            av_attr.type_ = sys::fi_av_type_FI_AV_TABLE;
            check(
                name,
                "fi_av_open",
                sys::fi_av_open(self.domain, &mut av_attr, &mut self.av, ptr::null_mut()) as i64,
            )?;
            let mut cq_attr: sys::fi_cq_attr = std::mem::zeroed();
            cq_attr.format = sys::fi_cq_format_FI_CQ_FORMAT_CONTEXT;
            cq_attr.size = (self.limits.tx_size * 2).max(128);
            // No wait object: `fi_cq_sread` on shm (1.17) ignores its timeout,
            // so the progress thread polls and parks instead (see progress_loop).
            cq_attr.wait_obj = sys::fi_wait_obj_FI_WAIT_NONE;
            check(
                name,
                "fi_cq_open",
                sys::fi_cq_open(self.domain, &mut cq_attr, &mut self.cq, ptr::null_mut()) as i64,
            )?;
            check(
                name,
                "fi_endpoint",
                sys::fi_endpoint(self.domain, info, &mut self.ep, ptr::null_mut()) as i64,
            )?;
        }
        Ok(())
    }

    /// Binds the AV and CQ, sets EFA options, enables the endpoint and reads
    /// whether efa emulates READ.
    fn bind_and_enable(&mut self, cfg: &FabricConfig, name: &str) -> Result<()> {
        // SAFETY: `ep`, `av` and `cq` were opened by `open_objects` and stay
        // open (owned by `self`) for these calls.
        unsafe {
            check(
                name,
                "fi_ep_bind(av)",
                sys::fi_ep_bind(self.ep, &mut (*self.av).fid, 0) as i64,
            )?;
            check(
                name,
                "fi_ep_bind(cq)",
                sys::fi_ep_bind(
                    self.ep,
                    &mut (*self.cq).fid,
                    (sys::FI_TRANSMIT | sys::FI_RECV) as u64,
                ) as i64,
            )?;
            if self.provider.starts_with("efa") {
                // RNR retries: EFA's receiver-not-ready retry count.
                check(
                    name,
                    "fi_setopt(FI_OPT_EFA_RNR_RETRY)",
                    sys::kvl_efa_pre_enable(self.ep, cfg.efa_rnr_retry) as i64,
                )?;
            }
            check(name, "fi_enable", sys::fi_enable(self.ep) as i64)?;
            self.emulated_read = match sys::kvl_efa_emulated_read(self.ep) {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            };
        }
        if self.emulated_read == Some(true) {
            tracing::warn!(provider = %self.provider, "efa emulates RMA READ in software (FI_OPT_EFA_EMULATED_READ): expect protocol-path bandwidth");
        }
        Ok(())
    }

    /// `fi_getname` of the enabled endpoint, growing the buffer once if the
    /// provider asks for more.
    fn read_name(&self, name: &str) -> Result<Vec<u8>> {
        let mut len: usize = 256;
        let mut buf = vec![0u8; len];
        // SAFETY: `ep` is open and enabled; `buf` has `len` writable bytes.
        let r = unsafe {
            sys::fi_getname(
                &mut (*self.ep).fid,
                buf.as_mut_ptr() as *mut c_void,
                &mut len,
            )
        };
        if r == -(sys::FI_ETOOSMALL as i32) {
            buf.resize(len, 0);
            // SAFETY: as above, with the buffer grown to the length asked for.
            let r = unsafe {
                sys::fi_getname(
                    &mut (*self.ep).fid,
                    buf.as_mut_ptr() as *mut c_void,
                    &mut len,
                )
            };
            check(name, "fi_getname", r as i64)?;
        } else {
            check(name, "fi_getname", r as i64)?;
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// `libfabric <provider>`.
    pub(crate) fn name(&self) -> String {
        format!("libfabric {}", self.provider)
    }

    /// Inserts a peer address into the AV.
    pub(crate) fn insert_peer(&self, address: &[u8]) -> Result<u64> {
        let mut fi_addr: sys::fi_addr_t = 0;
        // SAFETY: the AV is open; `address` is a buffer of one provider
        // address (from the peer's fi_getname) and `fi_addr` an out slot for one.
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
        // SAFETY: the AV is open and `a` is an address we inserted into it.
        unsafe { sys::fi_av_remove(self.av, &mut a, 1, 0) };
    }

    /// Reads up to 32 completions into `out`; returns how many (an error
    /// completion counts as one, with its error).
    pub(crate) fn poll_cq(&self, out: &mut Vec<CqEvent>) -> usize {
        self.poll_cq_with(|ev| out.push(ev))
    }

    /// As [`Endpoint::poll_cq`], handing each completion to `f` instead of
    /// collecting them (no allocation on the caller-driven path).
    pub(crate) fn poll_cq_with(&self, mut f: impl FnMut(CqEvent)) -> usize {
        // SAFETY: fi_cq_entry is a plain C struct; all-zero is a valid value.
        let mut entries: [sys::fi_cq_entry; 32] = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is open (owned by self) and was opened with
        // FI_CQ_FORMAT_CONTEXT; `entries` has room for `entries.len()` of them.
        let n =
            unsafe { sys::fi_cq_read(self.cq, entries.as_mut_ptr() as *mut c_void, entries.len()) };
        if n > 0 {
            for e in &entries[..n as usize] {
                f((e.op_context, None));
            }
            return n as usize;
        }
        if n == -(sys::FI_EAVAIL as isize)
            && let Some(ev) = self.read_cq_error()
        {
            f(ev);
            return 1;
        }
        0
    }

    /// One error completion (after `fi_cq_read` returned `-FI_EAVAIL`).
    fn read_cq_error(&self) -> Option<CqEvent> {
        // SAFETY: fi_cq_err_entry is a plain C struct; all-zero is valid.
        let mut err: sys::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is open; `err` is a valid out parameter.
        let r = unsafe { sys::fi_cq_readerr(self.cq, &mut err, 0) };
        if r <= 0 {
            return None;
        }
        // SAFETY: the CQ is open and `err` was just filled by fi_cq_readerr;
        // the returned string (if any) is NUL-terminated and owned by the
        // provider for at least this call.
        let msg = unsafe {
            let s = sys::fi_cq_strerror(self.cq, err.prov_errno, err.err_data, ptr::null_mut(), 0);
            if s.is_null() {
                String::new()
            } else {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            }
        };
        Some((
            err.op_context,
            Some(DataplaneError::Backend {
                backend: self.name(),
                op: "fi_read completion",
                code: -(err.err as i64),
                message: format!("{} ({msg})", fi_error_string(err.err as i64)),
            }),
        ))
    }

    /// Whether it is safe to block on [`Endpoint::wait_fd`] now
    /// (`fi_trywait`: no completion or progress pending).
    pub(crate) fn try_wait(&self) -> bool {
        // SAFETY: the CQ is open (owned by self); taking its fid's address.
        let mut fid: *mut sys::fid = unsafe { &mut (*self.cq).fid };
        // SAFETY: one valid fid of ours, on our fabric.
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
        // SAFETY: the endpoint is open and enabled; the caller keeps the IOVs'
        // memory and `ctx` alive until the completion (function contract);
        // `msg` and the arrays it points to live for the call.
        unsafe { sys::fi_readmsg(self.ep, &msg, sys::FI_COMPLETION as u64) }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: closing the objects we opened, each once, in reverse order of
        // opening (endpoint before what it is bound to); null ones skipped.
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
