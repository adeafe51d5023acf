//! Host memory for a KV cache: a private anonymous mapping with transparent huge pages
//! advised and every page touched up front, as an engine's preallocated cache should be
//! (numpy advises huge pages for large arrays too). Page size matters to transports that
//! reach memory through the kernel: UCX's CMA pins it page by page. The bench and the
//! benchmarks allocate their caches with it.

use std::ops::{Deref, DerefMut};

/// Why host memory could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum HostMemError {
    /// More than the system reports available (`MemAvailable`), refused before mapping:
    /// touching every page of it would only end in the OOM killer.
    #[error("{requested} bytes of host memory requested, {available} available")]
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// `MemAvailable` in bytes.
        available: u64,
    },
    /// The kernel refused the mapping.
    #[error("cannot map {len} bytes: {source}")]
    Map {
        /// Bytes asked for.
        len: usize,
        /// The kernel's reason.
        source: std::io::Error,
    },
}

/// An anonymous mapping, unmapped on drop.
pub struct HostMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; access goes through &self / &mut self.
unsafe impl Send for HostMem {}
unsafe impl Sync for HostMem {}

impl HostMem {
    /// `len` bytes, each set to `byte`. Panics where [`HostMem::try_new`] fails: for tests
    /// and benchmarks with fixed sizes; sizes from a user go through `try_new`.
    pub fn new(len: usize, byte: u8) -> HostMem {
        Self::try_new(len, byte).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `len` bytes, each set to `byte`, or why not: more than the system has available, or
    /// a mapping the kernel refuses.
    pub fn try_new(len: usize, byte: u8) -> Result<HostMem, HostMemError> {
        if let Some(available) = mem_available() {
            let requested = len as u64;
            if requested > available {
                return Err(HostMemError::TooLarge {
                    requested,
                    available,
                });
            }
        }
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
        if ptr == libc::MAP_FAILED {
            return Err(HostMemError::Map {
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: advice on the mapping just made; without THP it is a no-op.
        unsafe { libc::madvise(ptr, map_len, libc::MADV_HUGEPAGE) };
        let mut m = HostMem {
            ptr: ptr.cast(),
            len,
        };
        m.fill(byte);
        Ok(m)
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

/// `MemAvailable` from `/proc/meminfo`, in bytes; `None` where the system does not say.
pub(crate) fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&info)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
        m.as_mut_slice()[6] = 8;
        assert_eq!(m[6], 8);
        assert_eq!(m.as_mut_slice().len(), 3 << 20);
        let a = m.addr();
        assert_eq!(a, m.as_ptr() as u64);
        assert!(m.contains(a, 3 << 20));
        assert!(!m.contains(a, (3 << 20) + 1));
        assert!(!m.contains(a - 1, 1));
        assert!(!m.contains(u64::MAX, 2));
        assert!(HostMem::new(0, 1).is_empty());
    }

    #[test]
    fn more_than_is_available_is_refused_before_mapping() {
        let available = mem_available().expect("/proc/meminfo says MemAvailable");
        let over = usize::try_from(available + (1 << 30)).unwrap();
        match HostMem::try_new(over, 0) {
            Err(HostMemError::TooLarge {
                requested,
                available: a,
            }) => {
                assert_eq!(requested, over as u64);
                assert!(a < requested);
            }
            other => panic!("{:?}", other.map(|m| m.len())),
        }
        let e = HostMem::try_new(usize::MAX, 0)
            .map(|m| m.len())
            .unwrap_err();
        assert!(e.to_string().contains("requested"), "{e}");
    }

    #[test]
    fn mem_available_is_parsed_in_bytes() {
        let info = "MemTotal:       24683880 kB\nMemFree:  1 kB\nMemAvailable:   24053296 kB\n";
        assert_eq!(parse_mem_available(info), Some(24_053_296 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
        assert_eq!(
            parse_mem_available("MemAvailable: 18446744073709551615 kB\n"),
            None
        );
    }
}
