//! Host memory another process on this machine can map: a sealed `memfd` mapped shared.
//!
//! An engine that allocates its host KV cache here lets a same-host peer's transport copy
//! blocks straight between the two caches (two streaming copies in parallel reach the
//! machine's copy ceiling) instead of going through the kernel per piece (CMA). The owner
//! advertises an [`Export`] per registered region; the peer checks it names this machine,
//! opens `/proc/<pid>/fd/<fd>` only after the link names the memfd's random token, checks the
//! file it got is that memfd (size, and sealed so it can never shrink under a mapping), and
//! maps it ([`PeerFile`]). Whatever the peer's metadata says, a copy can then only touch
//! that mapping; a check that fails leaves the transport on its ordinary path.

use std::ffi::CString;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use crate::host_mem::HostMemError;

/// Random bytes naming one allocation (in its memfd's name).
pub type Token = [u8; 16];

/// What a peer needs to map a registered region of a [`SharedHostMem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The owning process.
    pub pid: u32,
    /// Its descriptor of the memfd.
    pub fd: i32,
    /// The memfd's token.
    pub token: Token,
    /// Size of the memfd (all of it is mapped).
    pub file_len: u64,
    /// Where the region starts in the memfd.
    pub offset: u64,
}

struct Live {
    addr: u64,
    len: u64,
    fd: i32,
    token: Token,
}

/// Allocations of this process, for [`export_of`].
static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<Live>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

fn memfd_name(token: &Token) -> String {
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    format!("kvxfer-shm-{hex}")
}

/// How `/proc/<pid>/fd/<fd>` reads for the memfd of `token`.
fn memfd_link(token: &Token) -> String {
    format!("/memfd:{} (deleted)", memfd_name(token))
}

/// Host memory in a sealed memfd, mapped shared; unmapped (and no longer exported) on drop.
/// Peers that mapped it keep their mapping of the file, never this process's memory.
pub struct SharedHostMem {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: plain memory owned by this value; access goes through &self / &mut self.
unsafe impl Send for SharedHostMem {}
unsafe impl Sync for SharedHostMem {}

fn os_error(len: usize) -> HostMemError {
    HostMemError::Map {
        len,
        source: std::io::Error::last_os_error(),
    }
}

impl SharedHostMem {
    /// `len` bytes, each set to `byte`. Panics where [`SharedHostMem::try_new`] fails: for
    /// tests and benchmarks with fixed sizes.
    pub fn new(len: usize, byte: u8) -> SharedHostMem {
        Self::try_new(len, byte).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `len` bytes (at least one), each set to `byte` (so every page is there up front, as in
    /// [`crate::host_mem::HostMem`]), or why not.
    pub fn try_new(len: usize, byte: u8) -> Result<SharedHostMem, HostMemError> {
        Self::try_new_near(len, byte, None)
    }

    /// Like [`SharedHostMem::try_new`], mapped at `at` when that range is free (elsewhere
    /// otherwise): for tests whose helper processes map the same memory at the same address.
    pub fn try_new_near(
        len: usize,
        byte: u8,
        at: Option<u64>,
    ) -> Result<SharedHostMem, HostMemError> {
        if let Some(available) = crate::host_mem::mem_available()
            && len as u64 > available
        {
            return Err(HostMemError::TooLarge {
                requested: len as u64,
                available,
            });
        }
        let map_len = len.max(1);
        let token: Token = rand::random();
        let name = CString::new(memfd_name(&token)).expect("no NUL in a hex name");
        // SAFETY: a valid C string; the descriptor is owned below.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(os_error(len));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(map_len).map_err(|_| HostMemError::TooLarge {
            requested: len as u64,
            available: i64::MAX as u64,
        })?;
        // SAFETY: plain calls on our descriptor. The seals make the size final: a mapping of
        // it (ours or a peer's) can never fault past the end.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), size) != 0
                || libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                ) != 0
            {
                return Err(os_error(len));
            }
        }
        let map = |addr: u64, flags: i32| {
            // SAFETY: maps the whole file just sized, never over an existing mapping
            // (`MAP_FIXED_NOREPLACE` fails instead); checked by the caller.
            unsafe {
                libc::mmap(
                    addr as *mut libc::c_void,
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | flags,
                    fd.as_raw_fd(),
                    0,
                )
            }
        };
        let mut ptr = match at {
            Some(a) => map(a, libc::MAP_FIXED_NOREPLACE),
            None => libc::MAP_FAILED,
        };
        if ptr == libc::MAP_FAILED {
            ptr = map(0, 0);
        }
        if ptr == libc::MAP_FAILED {
            return Err(os_error(len));
        }
        // SAFETY: advice on the mapping just made; a no-op where shmem has no huge pages.
        unsafe { libc::madvise(ptr, map_len, libc::MADV_HUGEPAGE) };
        let mut m = SharedHostMem {
            ptr: ptr.cast(),
            len,
            fd,
        };
        m.fill(byte);
        live().push(Live {
            addr: m.addr(),
            len: map_len as u64,
            fd: m.fd.as_raw_fd(),
            token,
        });
        Ok(m)
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The memfd (for tests that map it in a helper process).
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self
    }
}

impl Deref for SharedHostMem {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped read-write for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for SharedHostMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for SharedHostMem {
    fn drop(&mut self) {
        let addr = self.addr();
        live().retain(|l| l.addr != addr);
        // SAFETY: unmaps exactly the mapping made in `try_new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}

/// The export of `[addr, addr + len)` when it lies in one live [`SharedHostMem`] of this
/// process.
pub fn export_of(addr: u64, len: u64) -> Option<Export> {
    let end = addr.checked_add(len)?;
    live()
        .iter()
        .find(|l| addr >= l.addr && end <= l.addr.saturating_add(l.len))
        .map(|l| Export {
            pid: std::process::id(),
            fd: l.fd,
            token: l.token,
            file_len: l.len,
            offset: addr - l.addr,
        })
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`): peers that report the same
/// one run on this kernel. `None` where the system does not say.
pub fn host_id() -> Option<Token> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    parse_boot_id(&text)
}

fn parse_boot_id(text: &str) -> Option<Token> {
    let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(id)
}

/// A peer's memfd mapped into this process; unmapped on drop.
#[derive(Debug)]
pub struct PeerFile {
    ptr: *mut u8,
    len: usize,
    /// The owning process, to tell a copy that it read a dead peer's memory.
    owner: OwnedFd,
}

// SAFETY: a mapping owned by this value; copies through it are the caller's business.
unsafe impl Send for PeerFile {}
unsafe impl Sync for PeerFile {}

impl PeerFile {
    /// Maps the memfd `e` names, or says why not: another process's descriptor, a link
    /// that is not the memfd of `e.token`, a size other than `e.file_len`, or a file that
    /// could shrink.
    pub fn attach(e: &Export) -> Result<PeerFile, String> {
        let len = usize::try_from(e.file_len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| format!("memfd size {}", e.file_len))?;
        if e.fd < 0 {
            return Err(format!("descriptor {}", e.fd));
        }
        let pid = libc::pid_t::try_from(e.pid).map_err(|_| format!("pid {}", e.pid))?;
        // The process first: the link check below then proves this is the memfd's owner.
        // SAFETY: a plain system call; the descriptor is owned below.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if raw < 0 {
            return Err(format!(
                "pidfd_open({pid}): {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let owner = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        let want = memfd_link(&e.token);
        let path = format!("/proc/{}/fd/{}", e.pid, e.fd);
        // The link is checked before opening, so no other kind of file is ever opened.
        let link = std::fs::read_link(&path).map_err(|err| format!("{path}: {err}"))?;
        if link.as_os_str() != want.as_str() {
            return Err(format!("{path} is not the advertised memfd"));
        }
        let c = CString::new(path.clone()).expect("no NUL in a /proc path");
        // SAFETY: a valid C string; the descriptor is owned below.
        let raw = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK,
            )
        };
        if raw < 0 {
            return Err(format!("{path}: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // The descriptor may have changed between the check and the open: check what we got.
        let ours = std::fs::read_link(format!("/proc/self/fd/{raw}")).map_err(|e| e.to_string())?;
        if ours.as_os_str() != want.as_str() {
            return Err(format!("{path} changed while opening"));
        }
        // SAFETY: `st` is written by fstat on our descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != e.file_len {
            return Err(format!(
                "memfd holds {} bytes, {} advertised",
                st.st_size, e.file_len
            ));
        }
        // SAFETY: plain call on our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("memfd can shrink: a mapping of it could fault".into());
        }
        // SAFETY: maps the whole file, whose size is final; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(PeerFile {
            ptr: ptr.cast(),
            len,
            owner,
        })
    }

    /// Whether the process that owns the memfd is still running: bytes copied from a dead
    /// peer's memory are not a transfer (CMA would have failed).
    pub fn owner_alive(&self) -> bool {
        running(&self.owner)
    }

    /// Address in this process of `[offset, offset + len)` of the file, when it lies inside.
    pub fn at(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len as u64).then(|| self.ptr as u64 + offset)
    }
}

/// Whether the process of a pidfd is still running.
fn running(pidfd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait. A pidfd is readable once its process exited.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n == 0
}

impl Drop for PeerFile {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `attach`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_of_an_allocation_is_exported_and_maps_the_same_bytes() {
        let mut m = SharedHostMem::new(3 << 20, 7);
        assert!(m.iter().all(|&b| b == 7));
        let e = export_of(m.addr() + 4096, 8192).expect("inside");
        assert_eq!(e.offset, 4096);
        assert_eq!(e.file_len, 3 << 20);
        assert_eq!(e.pid, std::process::id());
        assert!(
            export_of(m.addr() + (3 << 20) - 1, 2).is_none(),
            "past the end"
        );
        assert!(export_of(u64::MAX, 2).is_none());
        let f = PeerFile::attach(&e).expect("attach");
        let p = f.at(e.offset, 8192).expect("in the file") as *mut u8;
        m[4096] = 42;
        // SAFETY: 8192 bytes mapped at `p`.
        unsafe {
            assert_eq!(*p, 42, "the peer sees the owner's store");
            *p.add(1) = 43;
        }
        assert_eq!(m[4097], 43, "the owner sees the peer's store");
        assert!(f.owner_alive());
        assert_eq!(f.at(0, 3 << 20), Some(f.ptr as u64));
        assert_eq!(f.at(1, 3 << 20), None);
        assert_eq!(f.at(u64::MAX, 2), None);
        let addr = m.addr();
        drop(m);
        assert!(export_of(addr, 1).is_none(), "gone with its memory");
        // SAFETY: the peer's mapping outlives the owner's.
        unsafe { assert_eq!(*p, 42) };
    }

    #[test]
    fn attach_refuses_what_the_export_does_not_name() {
        let m = SharedHostMem::new(1 << 20, 0);
        let e = export_of(m.addr(), 1).unwrap();
        let mut wrong_token = e;
        wrong_token.token[0] ^= 1;
        assert!(
            PeerFile::attach(&wrong_token)
                .unwrap_err()
                .contains("not the advertised")
        );
        let bigger = Export {
            file_len: e.file_len + 4096,
            ..e
        };
        assert!(
            PeerFile::attach(&bigger)
                .unwrap_err()
                .contains("advertised")
        );
        let other_fd = Export { fd: 0, ..e };
        assert!(PeerFile::attach(&other_fd).is_err());
        assert!(PeerFile::attach(&Export { fd: -1, ..e }).is_err());
        assert!(PeerFile::attach(&Export { file_len: 0, ..e }).is_err());
        let no_process = Export { pid: u32::MAX, ..e };
        assert!(PeerFile::attach(&no_process).is_err());
    }

    #[test]
    fn an_unsealed_memfd_is_refused() {
        let token: Token = rand::random();
        let name = CString::new(memfd_name(&token)).unwrap();
        // SAFETY: a valid C string.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let e = Export {
            pid: std::process::id(),
            fd: raw,
            token,
            file_len: 4096,
            offset: 0,
        };
        assert!(PeerFile::attach(&e).unwrap_err().contains("shrink"));
    }

    #[test]
    fn a_peer_file_knows_when_its_owner_exited() {
        let m = SharedHostMem::new(4096, 5);
        let e = export_of(m.addr(), 4096).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        // The child inherits nothing (CLOEXEC); attach to our own memfd with the child's
        // pid instead: its fd table lacks it, so the link check refuses it.
        let theirs = Export {
            pid: child.id(),
            ..e
        };
        assert!(PeerFile::attach(&theirs).is_err());
        let f = PeerFile::attach(&e).unwrap();
        assert!(f.owner_alive());
        // The liveness check on the child's pidfd, before and after it ends.
        // SAFETY: a plain system call; the descriptor is owned below.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor.
        let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        assert!(running(&pidfd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!running(&pidfd), "the child exited");
    }

    #[test]
    fn boot_ids_parse_to_sixteen_bytes() {
        let id = parse_boot_id("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
        assert_eq!(id[0], 0x0f);
        assert_eq!(id[15], 0xf0);
        assert!(parse_boot_id("0f1e").is_none());
        assert!(parse_boot_id("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").is_none());
        assert!(host_id().is_some(), "Linux reports a boot id");
        assert_eq!(host_id(), host_id());
    }
}
