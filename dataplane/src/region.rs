//! Memory regions that hold KV-cache blocks.
//!
//! * [`HostRegion`], [`RegionDesc`], [`MemoryKind`]: defined in
//!   `kvloop-kv-types` (memfd-backed host memory) and re-exported here.
//! * `CudaRegion` (feature `cuda`): device memory allocated through cudarc
//!   with the driver loaded dynamically; exercised only where a GPU exists.
//! * [`KvRegion`]: either, as owned by a [`crate::TransferEngine`].
pub use kvloop_kv_types::region::*;

#[cfg(feature = "cuda")]
use crate::error::{DataplaneError, Result};

/// CUDA device memory region (feature `cuda`): a buffer this process
/// allocated ([`CudaRegion::new`]) or an engine's memory opened from its
/// CUDA IPC handle ([`CudaRegion::from_ipc`], managed mode: the agent
/// registers and READs the engine's own GPU KV). The driver library is
/// loaded at run time by cudarc, so this compiles everywhere and fails with
/// a clear error where no GPU/driver exists.
#[cfg(feature = "cuda")]
pub struct CudaRegion {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    /// The allocation (`None`: an IPC mapping, closed on drop).
    buf: Option<cudarc::driver::CudaSlice<u8>>,
    device: i32,
    ptr: u64,
    len: usize,
}

#[cfg(feature = "cuda")]
fn device_context(device: i32) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    let ordinal = usize::try_from(device).map_err(|_| DataplaneError::Config {
        field: "device",
        expected: format!("a CUDA device ordinal ≥ 0, got {device}"),
    })?;
    cudarc::driver::CudaContext::new(ordinal).map_err(|e| DataplaneError::Config {
        field: "device",
        expected: format!("a usable CUDA device ordinal ({e})"),
    })
}

#[cfg(feature = "cuda")]
impl CudaRegion {
    /// Allocates `len_bytes` of device memory on `device`.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] naming `device` when no CUDA driver or device
    /// is available.
    pub fn new(device: i32, len_bytes: usize) -> Result<Self> {
        use cudarc::driver::DevicePtr;
        let ctx = device_context(device)?;
        let stream = ctx.default_stream();
        let buf = stream
            .alloc_zeros::<u8>(len_bytes)
            .map_err(|e| DataplaneError::Config {
                field: "len_bytes",
                expected: format!("an allocatable device buffer ({e})"),
            })?;
        let (ptr, _sync) = buf.device_ptr(&stream);
        let ptr = ptr as u64;
        drop(_sync);
        Ok(Self {
            ctx,
            buf: Some(buf),
            device,
            ptr,
            len: len_bytes,
        })
    }

    /// Opens another process's device memory from its CUDA IPC handle
    /// (`cudaIpcMemHandle_t`, 64 bytes: what an engine's
    /// `cudaIpcGetMemHandle` gives) on `device`, `len_bytes` long from the
    /// handle's base (`cuIpcOpenMemHandle`, lazy peer access). The mapping
    /// is closed (`cuIpcCloseMemHandle`) when the region drops; the owner
    /// must keep its allocation alive until then. A process cannot open a
    /// handle it exported itself (CUDA's rule).
    ///
    /// # Errors
    /// [`DataplaneError::Config`] naming `device` (no driver or device) or
    /// `handle` (the driver refused it).
    pub fn from_ipc(device: i32, handle: &[u8; 64], len_bytes: usize) -> Result<Self> {
        use cudarc::driver::sys;
        let ctx = device_context(device)?;
        ctx.bind_to_thread().map_err(|e| DataplaneError::Config {
            field: "device",
            expected: format!("a usable CUDA device ordinal ({e})"),
        })?;
        // SAFETY: CUipcMemHandle is a plain C struct of bytes; all zeroes
        // is a valid value, overwritten below.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle.iter()) {
            *d = *s as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer, an initialized handle, and the
        // device's context bound to this thread.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(DataplaneError::Config {
                field: "handle",
                expected: format!("a CUDA IPC handle this process may open ({r:?})"),
            });
        }
        Ok(Self {
            ctx,
            buf: None,
            device,
            ptr: ptr as u64,
            len: len_bytes,
        })
    }

    /// Device address of the region.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CUDA device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Opened from an IPC handle (else allocated here).
    pub fn is_ipc(&self) -> bool {
        self.buf.is_none()
    }
}

#[cfg(feature = "cuda")]
impl Drop for CudaRegion {
    fn drop(&mut self) {
        if self.buf.is_none() && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and
            // is closed once; the backends deregistered it before the
            // engine drops its regions.
            let _ = unsafe {
                cudarc::driver::sys::cuIpcCloseMemHandle(
                    self.ptr as cudarc::driver::sys::CUdeviceptr,
                )
            };
        }
    }
}

/// One KV region owned by a [`crate::TransferEngine`].
pub enum KvRegion {
    /// Host memory (memfd).
    Host(HostRegion),
    /// CUDA device memory (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(CudaRegion),
}

impl KvRegion {
    /// The host region, when this is one.
    pub fn as_host(&self) -> Option<&HostRegion> {
        match self {
            Self::Host(h) => Some(h),
            #[cfg(feature = "cuda")]
            Self::Cuda(_) => None,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(h) => h.len(),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.len(),
        }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Address, length and kind, as the backends see it.
    pub fn desc(&self) -> RegionDesc {
        match self {
            Self::Host(h) => RegionDesc::from(h),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => RegionDesc::from(c),
        }
    }
}

impl From<HostRegion> for KvRegion {
    fn from(h: HostRegion) -> Self {
        Self::Host(h)
    }
}

#[cfg(feature = "cuda")]
impl From<&CudaRegion> for RegionDesc {
    fn from(r: &CudaRegion) -> Self {
        Self {
            addr: r.device_ptr(),
            len_bytes: r.len() as u64,
            kind: MemoryKind::Cuda { device: r.device() },
        }
    }
}
