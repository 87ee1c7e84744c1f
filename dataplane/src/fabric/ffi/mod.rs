//! The libfabric FFI boundary: every call into libfabric (and kvloop's C
//! helpers in `csrc/kvl_helpers.c`) goes through this module. The raw
//! bindings ([`sys`]) are crate-private; the safe types here own the
//! provider objects and close them once.
//!
//! * [`Endpoint`]: fabric, domain, AV, CQ and an enabled RDM endpoint.
//! * [`Mr`]: one memory registration (see [`Endpoint::register`]).
pub(crate) mod sys;

mod endpoint;
mod mr;

use std::ffi::CStr;

pub(crate) use endpoint::Endpoint;
pub(crate) use mr::Mr;

use crate::error::{DataplaneError, Result};

/// libfabric error text for a (positive or negative) `FI_E*` code.
pub fn fi_error_string(code: i64) -> String {
    // SAFETY: fi_strerror accepts any code and returns a pointer to a static,
    // NUL-terminated string.
    unsafe { CStr::from_ptr(sys::fi_strerror(code.unsigned_abs() as i32)) }
        .to_string_lossy()
        .into_owned()
}

/// `Ok(ret)` for a non-negative libfabric return code, else
/// [`DataplaneError::Backend`] naming `op`.
pub(crate) fn check(backend: &str, op: &'static str, ret: i64) -> Result<i64> {
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

/// Closes a libfabric object; null is ignored.
///
/// # Safety
/// `f` is null or the `fid` of a live object this process opened, not closed
/// before, and not used afterwards (nor any object bound to it that needs it).
pub(crate) unsafe fn close_fid(f: *mut sys::fid) {
    if !f.is_null() {
        // SAFETY: the caller guarantees `f` is a live object closed only here.
        unsafe { sys::fi_close(f) };
    }
}
