//! Memory registration: one code path for every provider's mode bits (ask
//! for `LOCAL|VIRT_ADDR|ALLOCATED|PROV_KEY|ENDPOINT`; always read the key
//! back with `fi_mr_key`; remote base = VA under `FI_MR_VIRT_ADDR`, else 0;
//! always pass `fi_mr_desc`; bind + enable under `FI_MR_ENDPOINT`).
use std::ffi::c_void;
use std::ptr;

use super::{Endpoint, check, close_fid, sys};
use crate::backend::RemoteRegion;
use crate::error::{DataplaneError, Result};
use crate::region::{MemoryKind, RegionDesc};

impl Endpoint {
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
}

struct MrGuard(*mut sys::fid_mr);
impl Drop for MrGuard {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a registration opened by `register` that failed
        // to complete setup; it was handed out to nobody and is closed once.
        unsafe { close_fid(&mut (*self.0).fid) };
    }
}

/// One memory registration, closed on drop.
pub(crate) struct Mr {
    /// The registration.
    pub(crate) mr: *mut sys::fid_mr,
    /// `fi_mr_desc`, passed with every local IOV into it.
    pub(crate) desc: *mut c_void,
    /// Local virtual address of offset 0.
    pub(crate) addr: u64,
    /// What peers need to READ it.
    pub(crate) remote: RemoteRegion,
}

// SAFETY: the registration belongs to a domain opened with FI_THREAD_SAFE;
// its handle and descriptor may be used from any thread.
unsafe impl Send for Mr {}
// SAFETY: as for Send: only read after construction.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: `self.mr` is our live registration; Drop runs once, and the
        // backend drops registrations before the endpoint (field order).
        unsafe { close_fid(&mut (*self.mr).fid) };
    }
}
