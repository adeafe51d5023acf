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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use crate::mem::HostMemError;

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
///
/// Other processes (and transports) write these bytes whenever they like, so no Rust
/// reference to them is ever handed out: a `&[u8]` would promise that nothing changes them
/// while it lives. Bytes go in and out by explicit copies ([`SharedHostMem::copy_in`],
/// [`SharedHostMem::copy_out`]), and engines take the raw address.
pub struct SharedHostMem {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the value owns a mapping and a descriptor, neither tied to a thread. It gives out
// no references into the memory, only copies through raw pointers, which are as sound from
// any thread as they are against the other processes that write the same file.
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
    /// [`crate::mem::HostMem`]), or why not.
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
        if let Some(available) = crate::mem::mem_available()
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
        let m = SharedHostMem {
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

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the size is zero (it never is: at least one byte is mapped).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start as a pointer, for engines and transports that address the memory
    /// themselves; what they do through it is theirs to make sound.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: `len` bytes mapped read-write for the life of self; a raw write, so no
        // reference claims the bytes are ours alone.
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) };
    }

    /// Copies `bytes` in at `offset`; false (nothing copied) where they do not fit.
    pub fn copy_in(&self, offset: usize, bytes: &[u8]) -> bool {
        if !self.fits(offset, bytes.len()) {
            return false;
        }
        // SAFETY: `[offset, offset + len)` lies in the mapping (checked); `bytes` is our own
        // memory, never inside this mapping's file as a Rust slice of it is never made.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) };
        true
    }

    /// Copies the bytes at `offset` out into `out`; false (nothing copied) where they do not
    /// fit. A peer writing meanwhile may leave a mix of old and new bytes, never a fault.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) -> bool {
        if !self.fits(offset, out.len()) {
            return false;
        }
        // SAFETY: as in `copy_in`, the other way.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        true
    }

    fn fits(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
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

/// A same-host peer process: watched through a pidfd (so a copy can tell that it read a dead
/// peer's memory), and its mappings as they were when it was loaded.
#[derive(Debug)]
pub struct Owner {
    pid: u32,
    pidfd: OwnedFd,
    /// Its file mappings, parsed once and sorted by start (each region's check is then a
    /// binary search, not a pass over a maps file that may hold ~65k lines).
    maps: Vec<MapsLine>,
}

impl Owner {
    /// Opens process `pid`, or says why not (gone, another user's, no pidfd support).
    pub fn open(pid: u32) -> Result<Owner, String> {
        let id = libc::pid_t::try_from(pid).map_err(|_| format!("pid {pid}"))?;
        // SAFETY: a plain system call; the descriptor is owned below.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, id, 0) };
        if raw < 0 {
            return Err(format!(
                "pidfd_open({pid}): {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        // Read after the pidfd: if `pid` was reused since, these are the new process's maps,
        // which then do not place the advertised memfds.
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(|e| format!("/proc/{pid}/maps: {e}"))?;
        Ok(Owner {
            pid,
            pidfd,
            maps: parse_maps(&text),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process is still running.
    pub fn alive(&self) -> bool {
        running(&self.pidfd)
    }

    /// Whether the process maps byte `offset` of file `(dev, inode)` at `addr`, and the
    /// following `len` bytes in the same mapping.
    fn places(&self, file: (u64, u64), addr: u64, len: u64, offset: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        // Mappings do not overlap: only the last one starting at or below `addr` can hold it.
        let i = self.maps.partition_point(|m| m.start <= addr);
        i.checked_sub(1)
            .and_then(|i| self.maps.get(i))
            .is_some_and(|m| {
                m.file == file
                    && end <= m.end
                    && m.offset.checked_add(addr - m.start) == Some(offset)
            })
    }
}

/// The file mappings of a maps file, sorted by start (anonymous ones, inode 0, left out).
fn parse_maps(text: &str) -> Vec<MapsLine> {
    let mut maps: Vec<MapsLine> = text
        .lines()
        .filter_map(parse_maps_line)
        .filter(|m| m.file.1 != 0 && m.start < m.end)
        .collect();
    maps.sort_by_key(|m| m.start);
    maps
}

/// One line of `/proc/<pid>/maps`: `start-end perms offset major:minor inode path`.
#[derive(Debug)]
struct MapsLine {
    start: u64,
    end: u64,
    offset: u64,
    /// `(device, inode)`, the device as `makedev(major, minor)`.
    file: (u64, u64),
}

fn parse_maps_line(line: &str) -> Option<MapsLine> {
    let mut f = line.split_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let _perms = f.next()?;
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let (major, minor) = f.next()?.split_once(':')?;
    let inode: u64 = f.next()?.parse().ok()?;
    let dev = libc::makedev(
        u32::from_str_radix(major, 16).ok()?,
        u32::from_str_radix(minor, 16).ok()?,
    );
    Some(MapsLine {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset,
        file: (dev, inode),
    })
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

/// A peer's memfd mapped into this process; unmapped on drop.
#[derive(Debug)]
pub struct PeerFile {
    ptr: *mut u8,
    len: usize,
    /// `(device, inode)` of the file.
    file: (u64, u64),
}

// SAFETY: a mapping owned by this value; copies through it are the caller's business.
unsafe impl Send for PeerFile {}
unsafe impl Sync for PeerFile {}

fn fstat(fd: &OwnedFd) -> Result<libc::stat, String> {
    // SAFETY: `st` is written by fstat on a live descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    Ok(st)
}

fn open_fd(path: &str, flags: i32) -> Result<OwnedFd, String> {
    let c = CString::new(path).map_err(|_| "NUL in a path".to_string())?;
    // SAFETY: a valid C string; the descriptor is owned below.
    let raw = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(format!("{path}: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A memfd of `want` bytes, all of them allocated (a sparse file would fault pages into this
/// process's memory).
fn check_size(st: &libc::stat, want: u64) -> Result<(), String> {
    let blocks = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
    if st.st_mode & libc::S_IFMT != libc::S_IFREG
        || u64::try_from(st.st_size).ok() != Some(want)
        || blocks < want
    {
        return Err(format!(
            "memfd holds {} bytes ({blocks} allocated), {want} advertised",
            st.st_size
        ));
    }
    Ok(())
}

impl PeerFile {
    /// Maps the memfd `e` names in process `owner`, or says why not. The file must be the
    /// memfd of `e.token` (its link checked on a path-only descriptor, so nothing else is
    /// ever opened for reading or writing), on tmpfs, of `e.file_len` bytes with every page
    /// allocated (a sparse file would fault pages into this process's memory), and sealed so
    /// it cannot shrink under the mapping. Size and pages are checked again once the seal is
    /// seen, on the descriptor mapped, and the mapping is as long as that file is then: a
    /// copy through it cannot reach past the file's end (a fault that kills the process).
    pub fn attach(owner: &Owner, e: &Export) -> Result<PeerFile, String> {
        Self::attach_with(owner, e, || {})
    }

    /// [`PeerFile::attach`], running `meanwhile` between the first look at the file and
    /// opening it: where a test plays a peer that changes the file in that window.
    fn attach_with(
        owner: &Owner,
        e: &Export,
        meanwhile: impl FnOnce(),
    ) -> Result<PeerFile, String> {
        let len = usize::try_from(e.file_len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| format!("memfd size {}", e.file_len))?;
        if e.fd < 0 || e.pid != owner.pid {
            return Err(format!("descriptor {} of process {}", e.fd, e.pid));
        }
        let want = memfd_link(&e.token);
        let path = format!("/proc/{}/fd/{}", e.pid, e.fd);
        let handle = open_fd(&path, libc::O_PATH)?;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", handle.as_raw_fd()))
            .map_err(|err| format!("{path}: {err}"))?;
        if link.as_os_str() != want.as_str() {
            return Err(format!("{path} is not the advertised memfd"));
        }
        let st = fstat(&handle)?;
        // SAFETY: `sfs` is written by fstatfs on a live descriptor.
        let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatfs(handle.as_raw_fd(), &mut sfs) } != 0
            || sfs.f_type != libc::TMPFS_MAGIC
        {
            return Err(format!("{path} is not on tmpfs"));
        }
        check_size(&st, e.file_len)?;
        meanwhile();
        // Now the file itself, through the checked handle.
        let fd = open_fd(
            &format!("/proc/self/fd/{}", handle.as_raw_fd()),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK,
        )?;
        let again = fstat(&fd)?;
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
            return Err(format!("{path} changed while opening"));
        }
        // SAFETY: plain call on our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("memfd can shrink: a mapping of it could fault".into());
        }
        // Sealed now, so what this says holds for as long as the file lives: the owner may
        // have truncated it between the first look and the seal.
        check_size(&fstat(&fd)?, e.file_len)?;
        // SAFETY: maps the whole file (`len` is its size, which can no longer shrink);
        // checked below.
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
            file: (st.st_dev as u64, st.st_ino as u64),
        })
    }

    /// The file, as `(device, inode)`: the same memfd advertised by two peers is one file.
    pub fn file_id(&self) -> (u64, u64) {
        self.file
    }

    /// Address in this process of the owner's region `[addr, addr + len)`, which it says is
    /// byte `offset` on of this file: only when the owner maps the file there (so a region
    /// cannot name other bytes of the file than its own) and the range lies inside it.
    pub fn region(&self, owner: &Owner, addr: u64, len: u64, offset: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len as u64 && owner.places(self.file, addr, len, offset))
            .then(|| self.ptr as u64 + offset)
    }
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

    fn me() -> Owner {
        Owner::open(std::process::id()).unwrap()
    }

    #[test]
    fn a_region_of_an_allocation_is_exported_and_maps_the_same_bytes() {
        let m = SharedHostMem::new(3 << 20, 7);
        let mut all = vec![0u8; 3 << 20];
        assert!(m.copy_out(0, &mut all));
        assert!(all.iter().all(|&b| b == 7));
        assert_eq!(m.len(), 3 << 20);
        assert!(!m.is_empty());
        let e = export_of(m.addr() + 4096, 8192).expect("inside");
        assert_eq!(e.offset, 4096);
        assert_eq!(e.file_len, 3 << 20);
        assert_eq!(e.pid, std::process::id());
        assert!(
            export_of(m.addr() + (3 << 20) - 1, 2).is_none(),
            "past the end"
        );
        assert!(export_of(u64::MAX, 2).is_none());
        let owner = me();
        assert!(owner.alive());
        let f = PeerFile::attach(&owner, &e).expect("attach");
        let p = f
            .region(&owner, m.addr() + 4096, 8192, 4096)
            .expect("placed") as *mut u8;
        assert!(m.copy_in(4096, &[42]));
        // SAFETY: 8192 bytes mapped at `p`.
        unsafe {
            assert_eq!(*p, 42, "the peer sees the owner's store");
            *p.add(1) = 43;
        }
        let mut two = [0u8; 2];
        assert!(m.copy_out(4096, &mut two));
        assert_eq!(two, [42, 43], "the owner sees the peer's store");
        let whole = f.region(&owner, m.addr(), 3 << 20, 0);
        assert_eq!(whole, Some(f.ptr as u64));
        // Other bytes of the file than the owner maps at that address, or past its end.
        assert_eq!(f.region(&owner, m.addr() + 4096, 8192, 0), None);
        assert_eq!(f.region(&owner, m.addr(), 8192, 4096), None);
        assert_eq!(f.region(&owner, m.addr() + 1, 3 << 20, 1), None);
        assert_eq!(f.region(&owner, u64::MAX, 2, 0), None);
        // Where the owner maps another file at that offset.
        let other = SharedHostMem::new(1 << 20, 0);
        let owner = me();
        assert_eq!(f.region(&owner, other.addr(), 4096, 0), None);
        assert!(f.region(&owner, m.addr(), 4096, 0).is_some());
        assert_eq!(f.region(&owner, m.addr(), 1, u64::MAX), None);
        let token = e.token;
        let addr = m.addr();
        drop(m);
        assert!(
            export_of(addr, 1).is_none_or(|e| e.token != token),
            "gone with its memory"
        );
        // SAFETY: the peer's mapping outlives the owner's.
        unsafe { assert_eq!(*p, 42) };
    }

    #[test]
    fn copies_in_and_out_stay_inside_the_memory() {
        let m = SharedHostMem::new(4096, 1);
        assert!(m.copy_in(4094, &[9, 8]));
        let mut out = [0u8; 3];
        assert!(m.copy_out(4093, &mut out));
        assert_eq!(out, [1, 9, 8]);
        assert!(!m.copy_in(4095, &[0, 0]), "one byte past the end");
        assert!(!m.copy_out(usize::MAX, &mut out), "an offset that wraps");
        assert!(m.copy_out(4096, &mut []), "nothing, at the end");
        m.fill(3);
        assert!(m.copy_out(4093, &mut out));
        assert_eq!(out, [3, 3, 3]);
        // SAFETY: the first byte of the mapping.
        assert_eq!(unsafe { *m.as_ptr() }, 3);
    }

    #[test]
    fn attach_refuses_what_the_export_does_not_name() {
        let m = SharedHostMem::new(1 << 20, 0);
        let e = export_of(m.addr(), 1).unwrap();
        let owner = me();
        let mut wrong_token = e;
        wrong_token.token[0] ^= 1;
        let err = PeerFile::attach(&owner, &wrong_token).unwrap_err();
        assert!(err.contains("not the advertised"), "{err}");
        let smaller = Export {
            file_len: e.file_len - 4096,
            ..e
        };
        assert!(
            PeerFile::attach(&owner, &smaller)
                .unwrap_err()
                .contains("advertised"),
            "a file larger than advertised, every page allocated"
        );
        let bigger = Export {
            file_len: e.file_len + 4096,
            ..e
        };
        assert!(
            PeerFile::attach(&owner, &bigger)
                .unwrap_err()
                .contains("advertised")
        );
        assert!(PeerFile::attach(&owner, &Export { fd: 0, ..e }).is_err());
        assert!(PeerFile::attach(&owner, &Export { fd: -1, ..e }).is_err());
        assert!(PeerFile::attach(&owner, &Export { file_len: 0, ..e }).is_err());
        let other = Export {
            pid: e.pid + 1,
            ..e
        };
        assert!(PeerFile::attach(&owner, &other).is_err(), "not the owner's");
        assert!(Owner::open(u32::MAX).is_err());
        assert!(PeerFile::attach(&owner, &e).is_ok());
    }

    /// A memfd of `len` bytes named for `token`, sealed or not, allocated or sparse.
    fn memfd(token: &Token, len: i64, sealed: bool, allocated: bool) -> OwnedFd {
        let name = CString::new(memfd_name(token)).unwrap();
        // SAFETY: a valid C string.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor, then plain calls on it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        unsafe {
            assert_eq!(libc::ftruncate(raw, len), 0);
            if allocated {
                assert_eq!(libc::fallocate(raw, 0, 0, len), 0);
            }
            if sealed {
                assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            }
        }
        fd
    }

    #[test]
    fn unsealed_and_sparse_memfds_are_refused() {
        let token: Token = rand::random();
        let export = |fd: &OwnedFd| Export {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            token,
            file_len: 1 << 16,
            offset: 0,
        };
        let owner = me();
        let unsealed = memfd(&token, 1 << 16, false, true);
        let err = PeerFile::attach(&owner, &export(&unsealed)).unwrap_err();
        assert!(err.contains("shrink"), "{err}");
        let sparse = memfd(&token, 1 << 16, true, false);
        let err = PeerFile::attach(&owner, &export(&sparse)).unwrap_err();
        assert!(err.contains("allocated"), "{err}");
        let good = memfd(&token, 1 << 16, true, true);
        assert!(PeerFile::attach(&owner, &export(&good)).is_ok());
    }

    #[test]
    fn a_memfd_truncated_before_its_seal_is_refused() {
        // The owner's file is whole and allocated at the first look, then truncated to half
        // and sealed before the peer opens it: mapped at the advertised size, the first copy
        // past the new end would kill the process.
        let token: Token = rand::random();
        let len = 1i64 << 16;
        let fd = memfd(&token, len, false, true);
        let e = Export {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            token,
            file_len: len as u64,
            offset: 0,
        };
        let owner = me();
        let shrink = || {
            // SAFETY: plain calls on the test's own memfd.
            unsafe {
                assert_eq!(libc::ftruncate(fd.as_raw_fd(), len / 2), 0);
                assert_eq!(
                    libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
                    0
                );
            }
        };
        let err = PeerFile::attach_with(&owner, &e, shrink).unwrap_err();
        assert!(err.contains("32768 bytes"), "{err}");
        // The same file, advertised at the size it now has, maps.
        let f = PeerFile::attach(
            &owner,
            &Export {
                file_len: (len / 2) as u64,
                ..e
            },
        )
        .unwrap();
        assert_eq!(f.len, (len / 2) as usize);
    }

    #[test]
    fn an_owner_knows_when_its_process_exited() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let owner = Owner::open(child.id()).unwrap();
        assert_eq!(owner.pid(), child.id());
        assert!(owner.alive());
        // Our memfd named as the child's: the child's fd table lacks it.
        let m = SharedHostMem::new(4096, 5);
        let e = export_of(m.addr(), 4096).unwrap();
        let theirs = Export {
            pid: child.id(),
            ..e
        };
        assert!(PeerFile::attach(&owner, &theirs).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!owner.alive(), "the child exited");
    }

    #[test]
    fn maps_lines_parse_with_device_and_offset() {
        let l = parse_maps_line(
            "7f00a000-7f00c000 rw-s 00002000 00:01 4242  /memfd:kvxfer-shm-ab (deleted)",
        )
        .unwrap();
        assert_eq!(
            (l.start, l.end, l.offset),
            (0x7f00_a000, 0x7f00_c000, 0x2000)
        );
        assert_eq!(l.file, (libc::makedev(0, 1), 4242));
        assert!(parse_maps_line("7f00a000 rw-s 0 00:01 1").is_none());
        assert!(parse_maps_line("x-y rw-s 0 00:01 1").is_none());
        assert!(parse_maps_line("1-2 rw-s 0 0001 1").is_none());
    }

    /// A maps file of `n` one-page file mappings, every other one of file `(0:1, 7)` at
    /// offset = its index in pages, listed out of order.
    fn many_maps(n: u64) -> String {
        let mut lines: Vec<String> = (0..n)
            .map(|i| {
                let start = 0x1000_0000 + i * 0x2000;
                let inode = if i % 2 == 0 { 7 } else { 8 };
                format!(
                    "{start:x}-{:x} rw-s {:08x} 00:01 {inode} /memfd:x",
                    start + 0x1000,
                    i * 0x1000
                )
            })
            .collect();
        lines.reverse();
        lines.push("7fff0000-7fff1000 rw-p 00000000 00:00 0 [stack]".into());
        lines.join("\n")
    }

    #[test]
    fn placements_are_looked_up_in_maps_parsed_once() {
        // ~65k mappings and as many regions: one parse and a binary search each (a parse of
        // the whole file per region took minutes and held the transport's lock throughout).
        let n = 1u64 << 16;
        let owner = Owner {
            pid: 0,
            pidfd: me().pidfd,
            maps: parse_maps(&many_maps(n)),
        };
        assert_eq!(
            owner.maps.len() as u64,
            n,
            "the anonymous mapping is left out"
        );
        let file = (libc::makedev(0, 1), 7);
        let mut placed = 0;
        for i in 0..n {
            let start = 0x1000_0000 + i * 0x2000;
            if owner.places(file, start + 16, 64, i * 0x1000 + 16) {
                placed += 1;
            }
        }
        assert_eq!(placed, n / 2, "the mappings of file 7, each where it is");
        // Past a mapping's end, between mappings, another offset, before the first.
        assert!(!owner.places(file, 0x1000_0000 + 0x1000 - 8, 16, 0x1000 - 8));
        assert!(!owner.places(file, 0x1000_0000 + 0x1800, 8, 0x1800));
        assert!(!owner.places(file, 0x1000_0000, 8, 0x1000));
        assert!(!owner.places(file, 0x1000, 8, 0));
        assert!(!owner.places(file, u64::MAX - 4, 8, 0));
        assert!(
            owner.places(file, 0x1000_0000, 0x1000, 0),
            "a whole mapping"
        );
        // An empty line for the same start, listed after the mapping, is no mapping.
        let text = "1000-2000 rw-s 00000000 00:01 7 /memfd:x\n1000-1000 rw-s 00000000 00:01 7 /x";
        let owner = Owner {
            pid: 0,
            pidfd: me().pidfd,
            maps: parse_maps(text),
        };
        assert!(owner.places(file, 0x1000, 16, 0));
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
