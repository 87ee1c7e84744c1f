//! Memory regions that hold KV-cache blocks.
//!
//! * [`HostRegion`]: page-aligned host memory backed by a memfd, mapped
//!   `MAP_SHARED`, so another process on the node (the agent, in managed mode)
//!   can map the same pages from the fd passed over a Unix socket.
//! * [`RegionDesc`]: a region as the transfer backends see it.
//!
//! Device memory (`CudaRegion`) lives in the dataplane crate (feature `cuda`).
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{DataplaneError, Result};

/// Where a region's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// Host DRAM.
    Host,
    /// CUDA device memory on the given device ordinal.
    Cuda {
        /// CUDA device ordinal.
        device: i32,
    },
}

/// Page-aligned host memory backed by a memfd and mapped shared.
///
/// Reads and writes go through [`HostRegion::write_at`] / [`HostRegion::read_at`]
/// (plain copies through a raw pointer): a remote READ may read the pages at
/// any time, so no Rust reference to the contents is ever handed out.
#[derive(Debug)]
pub struct HostRegion {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and accessed only through raw
// copies; the fd is an owned kernel object.
unsafe impl Send for HostRegion {}
// SAFETY: as for Send: shared access only copies through raw pointers, which
// races with remote READs by design and never creates Rust references.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Creates a memfd of `len_bytes` (rounded up to the page size), named
    /// `name` (visible in `/proc/<pid>/fd`), zero-filled, and maps it.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] for a zero length; [`DataplaneError::Io`]
    /// when `memfd_create`, `ftruncate` or `mmap` fails.
    pub fn new(name: &str, len_bytes: usize) -> Result<Self> {
        if len_bytes == 0 {
            return Err(DataplaneError::Config {
                field: "len_bytes",
                expected: "a region length greater than 0".into(),
            });
        }
        let len = round_up_to_page(len_bytes);
        let cname = CString::new(format!("kvloop:{name}")).map_err(|_| DataplaneError::Config {
            field: "name",
            expected: "a region name without NUL bytes".into(),
        })?;
        // SAFETY: plain syscalls with checked results.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(DataplaneError::io(
                "memfd_create",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd was just returned by memfd_create and is owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on the open fd owned by `fd`; result checked.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(DataplaneError::io(
                "ftruncate memfd",
                std::io::Error::last_os_error(),
            ));
        }
        Self::map(fd, len)
    }

    /// Maps an existing memfd (for example one received over a Unix socket)
    /// of at least `len_bytes`.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] when the fd is smaller than `len_bytes`;
    /// [`DataplaneError::Io`] when `fstat` or `mmap` fails.
    pub fn from_fd(fd: OwnedFd, len_bytes: usize) -> Result<Self> {
        // SAFETY: libc::stat is a plain C struct; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on the open fd owned by `fd`, into a live struct.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(DataplaneError::io(
                "fstat memfd",
                std::io::Error::last_os_error(),
            ));
        }
        if (st.st_size as usize) < len_bytes || len_bytes == 0 {
            return Err(DataplaneError::Config {
                field: "len_bytes",
                expected: format!(
                    "a length between 1 and the fd's size {} bytes, got {len_bytes}",
                    st.st_size
                ),
            });
        }
        Self::map(fd, len_bytes)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self> {
        // SAFETY: mapping a regular fd with a checked result.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DataplaneError::io(
                "mmap memfd",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            fd,
            ptr: NonNull::new(p as *mut u8).expect("mmap returned NULL"),
            len,
        })
    }

    /// Start address of the mapping (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never true for a constructed region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to pass to another process (`SCM_RIGHTS`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Panics
    /// When `offset + data.len()` exceeds the region.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len),
            "write out of region"
        );
        // SAFETY: bounds checked above; raw copy into our own mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        }
    }

    /// Copies `out.len()` bytes from the region at `offset` into `out`.
    ///
    /// # Panics
    /// When `offset + out.len()` exceeds the region.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset.checked_add(out.len()).is_some_and(|e| e <= self.len),
            "read out of region"
        );
        // SAFETY: bounds checked above; raw copy out of our own mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        }
    }

    /// Fills `[offset, offset+len)` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "fill out of region"
        );
        // SAFETY: bounds checked above.
        unsafe { std::ptr::write_bytes(self.as_ptr().add(offset), byte, len) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// The system page size in bytes.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

fn round_up_to_page(n: usize) -> usize {
    let p = page_size();
    n.div_ceil(p) * p
}

/// A region of KV memory as the backends see it: start address, length,
/// and where it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionDesc {
    /// Start address (host virtual address, or CUDA device address).
    pub addr: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// Where the memory lives.
    pub kind: MemoryKind,
}

impl From<&HostRegion> for RegionDesc {
    fn from(r: &HostRegion) -> Self {
        Self {
            addr: r.as_ptr() as u64,
            len_bytes: r.len() as u64,
            kind: MemoryKind::Host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_region_is_page_aligned_and_shareable() {
        let r = HostRegion::new("t", 10_000).unwrap();
        assert_eq!(r.as_ptr() as usize % page_size(), 0);
        assert_eq!(r.len() % page_size(), 0);
        r.write_at(100, b"hello");
        // Map the same memfd a second time, as another process would.
        let dup = r.fd().try_clone_to_owned().unwrap();
        let r2 = HostRegion::from_fd(dup, r.len()).unwrap();
        let mut out = [0u8; 5];
        r2.read_at(100, &mut out);
        assert_eq!(&out, b"hello");
    }

    #[test]
    fn from_fd_rejects_a_length_beyond_the_fd() {
        let r = HostRegion::new("t", 4096).unwrap();
        let dup = r.fd().try_clone_to_owned().unwrap();
        let e = HostRegion::from_fd(dup, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("len_bytes"), "{e}");
    }
}
