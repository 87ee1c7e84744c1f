//! CUDA IPC handle registration (GPU KV memory of an engine).
//!
//! Status: refused, on purpose. The dataplane can register device memory
//! (`kvloop_dataplane::region::KvRegion::Cuda` through
//! `TransferEngine::start_with_regions`, feature `cuda`), but its
//! `CudaRegion` is built only by `CudaRegion::new`, which *allocates* its own
//! buffer; it has no constructor that wraps a device pointer opened elsewhere
//! (here: the engine's memory opened with `cuIpcOpenMemHandle`) and keeps the
//! IPC mapping and its context alive. Registering the opened pointer needs
//! such a constructor in `kvloop-dataplane` (owner: the dataplane), e.g.
//! `CudaRegion::from_ipc(device, ptr, len, close_on_drop)`; until then
//! [`crate::proto::RegionSource::CudaIpc`] is refused with
//! [`unsupported_message`] and engines register host memory (memfd). With
//! feature `cuda`, [`open_ipc_handle`] opens a handle with cudarc (driver
//! loaded at run time); it is exercised only where a GPU exists (none on the
//! build machines).

/// Why a CUDA IPC registration is refused.
pub fn unsupported_message() -> String {
    if cfg!(feature = "cuda") {
        "regions: cuda_ipc registration needs a dataplane CudaRegion that wraps an IPC-opened \
         device pointer (kvloop-dataplane's CudaRegion only allocates its own memory); register \
         host memory with kind = \"memfd\""
            .into()
    } else {
        "regions: cuda_ipc needs kvloop-agent built with feature `cuda` (and a GPU); register \
         host memory with kind = \"memfd\""
            .into()
    }
}

/// Decodes a hex `cudaIpcMemHandle_t` (64 bytes).
///
/// # Errors
/// A message naming `handle_hex` when it is not 128 hex digits.
pub fn decode_handle(hex: &str) -> Result<[u8; 64], String> {
    if hex.len() != 128 {
        return Err(format!(
            "handle_hex: expected 128 hex digits (64 bytes), got {} characters",
            hex.len()
        ));
    }
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("handle_hex: non-hex digits at byte {i}"))?;
    }
    Ok(out)
}

/// Opens a CUDA IPC memory handle on `device`; returns the device pointer.
///
/// # Errors
/// A message when no driver/device is present or the handle is refused.
#[cfg(feature = "cuda")]
pub fn open_ipc_handle(device: i32, handle: [u8; 64]) -> Result<u64, String> {
    use cudarc::driver::sys;
    let ctx = cudarc::driver::CudaContext::new(device as usize)
        .map_err(|e| format!("device {device}: {e}"))?;
    ctx.bind_to_thread()
        .map_err(|e| format!("device {device}: {e}"))?;
    // SAFETY: CUipcMemHandle is a plain C struct of bytes; all zeroes is valid.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (d, s) in h.reserved.iter_mut().zip(handle.iter()) {
        *d = *s as _;
    }
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: FFI call with a valid out-pointer and an initialized handle.
    let r = unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuIpcOpenMemHandle: {r:?}"));
    }
    Ok(ptr as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn handle_hex_is_checked() {
        let ok = "ab".repeat(64);
        assert_eq!(super::decode_handle(&ok).unwrap()[63], 0xab);
        assert!(
            super::decode_handle("ab")
                .unwrap_err()
                .contains("handle_hex")
        );
        assert!(super::decode_handle(&"zz".repeat(64)).is_err());
    }
}
