//! Host memory for a KV cache: a private anonymous mapping with transparent huge pages
//! advised and every page touched up front, as an engine's preallocated cache should be
//! (numpy advises huge pages for large arrays too). Page size matters to transports that
//! reach memory through the kernel: UCX's CMA pins it page by page. The bench and the
//! benchmarks allocate their caches with it.

use std::ops::{Deref, DerefMut};

/// An anonymous mapping, unmapped on drop.
pub struct HostMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; access goes through &self / &mut self.
unsafe impl Send for HostMem {}
unsafe impl Sync for HostMem {}

impl HostMem {
    /// `len` bytes, each set to `byte`. Panics if the system cannot map them (callers size
    /// caches up front, before any transfer).
    pub fn new(len: usize, byte: u8) -> HostMem {
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

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// True when `[addr, addr + len)` lies inside this memory.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr()
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr() + self.len as u64)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_writable_and_bounded() {
        let mut m = HostMem::new(3 << 20, 7);
        assert_eq!(m.len(), 3 << 20);
        assert!(m.iter().all(|&b| b == 7));
        m[5] = 9;
        assert_eq!(m.as_slice()[5], 9);
        let a = m.addr();
        assert!(m.contains(a, 3 << 20));
        assert!(!m.contains(a, (3 << 20) + 1));
        assert!(!m.contains(a - 1, 1));
        assert!(!m.contains(u64::MAX, 2));
        assert!(HostMem::new(0, 1).is_empty());
    }
}
