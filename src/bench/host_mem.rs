//! The bench's cache memory: private anonymous mappings with transparent huge pages advised,
//! every page touched up front — as an engine's preallocated host cache is (numpy, which the
//! peer scripts use, advises huge pages for large arrays too). Page size matters to
//! transports that reach memory through the kernel (UCX's CMA pins it page by page).

use std::ops::{Deref, DerefMut};

/// An anonymous mapping, unmapped on drop.
pub(crate) struct HostMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; access goes through &self / &mut self.
unsafe impl Send for HostMem {}
unsafe impl Sync for HostMem {}

impl HostMem {
    /// `len` bytes, each set to `byte`. Panics if the system cannot map them (the bench
    /// sizes its caches from the model, before any transfer).
    pub(crate) fn new(len: usize, byte: u8) -> HostMem {
        let map_len = len.max(1);
        // SAFETY: a fresh private anonymous mapping, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "cannot map {map_len} bytes: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: advice on the mapping just made; without THP it is a no-op.
        unsafe { libc::madvise(ptr, map_len, libc::MADV_HUGEPAGE) };
        let mut m = HostMem {
            ptr: ptr.cast(),
            len,
        };
        m.fill(byte);
        m
    }
}

impl Deref for HostMem {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped read-write for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for HostMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}
