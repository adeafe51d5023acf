//! Private anonymous memory with huge pages advised, as an engine's host cache would be:
//! what benchmarks move, so transports are measured on realistic pages.

/// An anonymous mapping, unmapped on drop.
pub struct AnonMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for AnonMem {}
unsafe impl Sync for AnonMem {}

impl AnonMem {
    /// `len` bytes (at least one page), every page touched.
    pub fn new(len: usize) -> AnonMem {
        let map_len = len.max(1);
        // SAFETY: a fresh private anonymous mapping; failures panic (test memory).
        let ptr = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(
                p,
                libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            // Advice only: without transparent huge pages this is a no-op.
            libc::madvise(p, map_len, libc::MADV_HUGEPAGE);
            p.cast::<u8>()
        };
        let mut m = AnonMem { ptr, len: map_len };
        m.as_mut_slice().fill(1);
        m.len = len;
        m
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of a live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// True when `[addr, addr+len)` lies inside this memory.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr()
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr() + self.len as u64)
    }
}

impl Drop for AnonMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new` (its length is at least `len.max(1)`).
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}
