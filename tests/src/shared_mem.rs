//! Test memory that another process can map at the same address: a `memfd` mapped shared.
//! Buffers live in it so the conformance suite can run one agent in a helper process (see
//! [`crate::remote`]) while the test still reads and checks every byte it owns.

use std::sync::Mutex;

use kvxfer_host_mem::shm::SharedHostMem;

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

/// A shared, zero-filled, page-granular memory block, unmapped on drop. It is kvxfer shared
/// memory ([`kvxfer_host_mem::shm`]): transports that copy between same-host peers' shared
/// memory do so for every test buffer.
pub struct SharedMem {
    mem: SharedHostMem,
    len: usize,
}

impl SharedMem {
    /// `len` bytes (at least one page is mapped).
    pub fn new(len: usize) -> SharedMem {
        let map_len = len.max(1).next_multiple_of(4096);
        let hint = NEXT_BASE.fetch_add(
            (map_len as u64).next_multiple_of(1 << 21) + (1 << 21),
            std::sync::atomic::Ordering::Relaxed,
        );
        let mem = SharedHostMem::try_new_near(map_len, 0, Some(hint))
            .unwrap_or_else(|e| panic!("test memory: {e}"));
        MAPPINGS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(SharedMapping {
                pid: std::process::id(),
                fd: mem.fd(),
                base: mem.addr(),
                len: map_len as u64,
            });
        SharedMem { mem, len }
    }

    /// The bytes. Tests look at them only while no transfer touches them.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of the mapping, alive with `self`; see above.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.len) }
    }

    /// The bytes, mutably; as [`SharedMem::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` is the only handle here.
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr(), self.len) }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.mem.addr()
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        let (base, fd) = (self.mem.addr(), self.mem.fd());
        MAPPINGS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|m| !(m.base == base && m.fd == fd));
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
