//! Test memory that another process can map at the same address: a `memfd` mapped shared.
//! Buffers live in it so the conformance suite can run one agent in a helper process (see
//! [`crate::remote`]) while the test still reads and checks every byte it owns.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

/// A mapping another process can attach: `/proc/<pid>/fd/<fd>` mapped at `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedMapping {
    /// Process that owns the descriptor.
    pub pid: u32,
    /// The memfd.
    pub fd: i32,
    /// Address of the mapping (the same in every process that attaches it).
    pub base: u64,
    /// Length of the mapping.
    pub len: u64,
}

static MAPPINGS: Mutex<Vec<SharedMapping>> = Mutex::new(Vec::new());

/// Test memory is placed at increasing addresses from here, a part of the address space that
/// neither this process nor a freshly started helper uses (libraries and the kernel's mmap
/// area sit near the top, the heap near the bottom), so the helper can map it at the same
/// address. Addresses are never reused.
static NEXT_BASE: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0x2000_0000_0000);

/// The shared mapping containing `[addr, addr+len)`, if any.
pub fn mapping_of(addr: u64, len: u64) -> Option<SharedMapping> {
    let m = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    m.iter()
        .find(|s| addr >= s.base && addr.checked_add(len).is_some_and(|e| e <= s.base + s.len))
        .copied()
}

/// A shared, zero-filled, page-granular memory block, unmapped on drop.
pub struct SharedMem {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    map_len: usize,
}

// SAFETY: the mapping is plain memory owned by this value.
unsafe impl Send for SharedMem {}
unsafe impl Sync for SharedMem {}

impl SharedMem {
    /// `len` bytes (at least one page is mapped).
    pub fn new(len: usize) -> SharedMem {
        let map_len = len.max(1).next_multiple_of(4096);
        // SAFETY: memfd_create with a static name; ftruncate and mmap on the new descriptor;
        // failures panic (test memory).
        unsafe {
            let raw = libc::memfd_create(c"kvxfer-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(
                raw >= 0,
                "memfd_create: {}",
                std::io::Error::last_os_error()
            );
            let fd = OwnedFd::from_raw_fd(raw);
            assert_eq!(libc::ftruncate(raw, map_len as libc::off_t), 0, "ftruncate");
            let hint = NEXT_BASE.fetch_add(
                (map_len as u64).next_multiple_of(1 << 21) + (1 << 21),
                std::sync::atomic::Ordering::Relaxed,
            );
            let mut ptr = libc::mmap(
                hint as *mut libc::c_void,
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
                raw,
                0,
            );
            if ptr == libc::MAP_FAILED {
                ptr = libc::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    raw,
                    0,
                );
            }
            assert_ne!(
                ptr,
                libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            MAPPINGS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(SharedMapping {
                    pid: std::process::id(),
                    fd: raw,
                    base: ptr as u64,
                    len: map_len as u64,
                });
            SharedMem {
                fd,
                ptr: ptr.cast(),
                len,
                map_len,
            }
        }
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
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        let base = self.ptr as u64;
        MAPPINGS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|m| !(m.base == base && m.fd == self.fd.as_raw_fd()));
        // SAFETY: the mapping created in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
    }
}

/// Attaches a mapping of another process at the same address (helper side). Fails if that
/// address range is taken here.
pub fn attach(m: &SharedMapping) -> std::io::Result<()> {
    let path = format!("/proc/{}/fd/{}\0", m.pid, m.fd);
    // SAFETY: open + mmap with MAP_FIXED_NOREPLACE, which never replaces an existing mapping.
    unsafe {
        let fd = libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let p = libc::mmap(
            m.base as *mut libc::c_void,
            m.len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
            fd,
            0,
        );
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if p == libc::MAP_FAILED {
            return Err(err);
        }
        if p as u64 != m.base {
            libc::munmap(p, m.len as usize);
            return Err(std::io::Error::other("mapped at another address"));
        }
    }
    Ok(())
}

/// Detaches a mapping made by [`attach`].
pub fn detach(m: &SharedMapping) {
    // SAFETY: unmaps exactly what `attach` mapped.
    unsafe { libc::munmap(m.base as *mut libc::c_void, m.len as usize) };
}
