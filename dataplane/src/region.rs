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

/// CUDA device memory region (feature `cuda`). The driver library is loaded at
/// run time by cudarc, so this compiles everywhere and fails at
/// [`CudaRegion::new`] with a clear error where no GPU/driver exists.
#[cfg(feature = "cuda")]
pub struct CudaRegion {
    _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    buf: cudarc::driver::CudaSlice<u8>,
    device: i32,
    ptr: u64,
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
        let ctx = cudarc::driver::CudaContext::new(device as usize).map_err(|e| {
            DataplaneError::Config {
                field: "device",
                expected: format!("a usable CUDA device ordinal ({e})"),
            }
        })?;
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
            _ctx: ctx,
            buf,
            device,
            ptr,
        })
    }

    /// Device address of the allocation.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// CUDA device ordinal.
    pub fn device(&self) -> i32 {
        self.device
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
