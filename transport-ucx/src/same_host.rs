//! Same-host peers whose memory is kvxfer shared memory: their memfds are mapped at
//! `load_peer`, and a transfer whose remote side lies entirely in them is a set of host
//! copies on a pool of copy workers (streaming stores for large transfers, as the loopback
//! copies), not UCX requests. UCX's shared-memory transports can only reach an engine's
//! memory through CMA, one system call and page pinning per piece; two copy workers on
//! memory both processes map reach the machine's copy ceiling.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvxfer_core::{AddrRange, MemoryKind, Op};
use kvxfer_host_mem::copy_pool::{self, CopyPair, CopyPool};
use kvxfer_host_mem::shm::{Owner, PeerFile};

use crate::metadata::AgentMeta;

/// Smallest job handed to one copy worker.
const MIN_JOB_BYTES: u64 = 1 << 20;
/// Most copy workers one agent runs.
const MAX_WORKERS: usize = 4;

/// What other peers already have mapped here, which a new peer must leave room for and
/// may not claim as its own.
#[derive(Default)]
pub struct Mapped {
    /// Their memfds, as `(device, inode)`.
    pub files: HashSet<(u64, u64)>,
    /// How many mappings they hold.
    pub count: usize,
}

/// Bounds on the mappings same-host peers may make this process hold.
#[derive(Clone, Copy)]
pub struct Limits {
    /// Per peer.
    pub per_peer: usize,
    /// For all peers together.
    pub total: usize,
}

/// A peer's regions mapped here: per region of its metadata, the address of its start in
/// this process and in the peer's; the mappings and the peer's process (kept alive by every
/// transfer using them).
#[derive(Default)]
pub struct PeerMaps {
    pub at: Vec<Option<(u64, u64)>>,
    pub files: Arc<Vec<PeerFile>>,
    pub owner: Option<Arc<Owner>>,
}

impl PeerMaps {
    /// Maps what a peer shares when it runs on this machine: one process (the pid of its
    /// first shared region), each region placed where that process maps its memfd. Any
    /// check that fails leaves the region (or the peer) on UCX's ordinary path. `Err` is a
    /// refusal of the whole peer, nothing mapped: more memfds than `limits` leave room for
    /// beside what `others` hold, or one of theirs advertised again under this name.
    pub fn attach(meta: &AgentMeta, limits: Limits, others: &Mapped) -> Result<PeerMaps, String> {
        let mut maps = PeerMaps {
            at: vec![None; meta.regions.len()],
            ..PeerMaps::default()
        };
        let here = kvxfer_host_mem::shm::host_id();
        let Some(pid) = meta.regions.iter().find_map(|r| r.shared.map(|e| e.pid)) else {
            return Ok(maps);
        };
        if meta.host.is_none() || meta.host != here {
            return Ok(maps);
        }
        let wanted: HashSet<_> = meta
            .regions
            .iter()
            .filter_map(|r| r.shared.map(|e| e.token))
            .collect();
        let room = limits.total.saturating_sub(others.count);
        if wanted.len() > limits.per_peer.min(room) {
            return Err(format!(
                "it advertises {} memfds; {} may be mapped per peer and {room} more in all \
                 (max_peer_mappings {}, max_mappings {})",
                wanted.len(),
                limits.per_peer,
                limits.per_peer,
                limits.total
            ));
        }
        let owner = match Owner::open(pid) {
            Ok(o) => o,
            Err(why) => {
                tracing::info!(peer = %meta.name, "not mapping shared memory: {why}");
                return Ok(maps);
            }
        };
        let mut files: Vec<PeerFile> = Vec::new();
        // The mapping of each token mapped so far.
        let mut index: HashMap<kvxfer_host_mem::shm::Token, usize> = HashMap::new();
        for (i, r) in meta.regions.iter().enumerate() {
            let Some(e) = r.shared else { continue };
            let k = match index.get(&e.token) {
                Some(&k) => k,
                None => match PeerFile::attach(&owner, &e) {
                    Ok(f) if others.files.contains(&f.file_id()) => {
                        return Err(format!(
                            "its memfd {} of process {} is mapped for another peer",
                            e.fd, e.pid
                        ));
                    }
                    Ok(f) => {
                        let k = files.len();
                        files.push(f);
                        index.insert(e.token, k);
                        k
                    }
                    Err(why) => {
                        tracing::info!(peer = %meta.name, "not mapping shared memory: {why}");
                        continue;
                    }
                },
            };
            maps.at[i] = files[k]
                .region(&owner, r.range.addr, r.range.len, e.offset)
                .map(|mapped| (mapped, r.range.addr));
        }
        if maps.at.iter().any(Option::is_some) {
            maps.files = Arc::new(files);
            maps.owner = Some(Arc::new(owner));
        } else {
            maps.at.iter_mut().for_each(|a| *a = None);
        }
        Ok(maps)
    }

    /// Whether any region is mapped.
    pub fn any(&self) -> bool {
        self.owner.is_some()
    }

    /// Adds this peer's mappings to `into`.
    pub fn count_into(&self, into: &mut Mapped) {
        into.count += self.files.len();
        into.files.extend(self.files.iter().map(PeerFile::file_id));
    }

    /// Whether the peer's process exited (false when nothing is mapped).
    pub fn owner_exited(&self) -> bool {
        self.owner.as_ref().is_some_and(|o| !o.alive())
    }
}

/// Copy pairs for a transfer whose every remote range lies in a mapped region (`keys[i]`:
/// the region of `remote[i]`), or `None` when one does not. Local ranges were checked
/// against our registrations.
pub fn pairs(
    op: Op,
    kinds: (MemoryKind, MemoryKind),
    local: &[AddrRange],
    remote: &[AddrRange],
    keys: &[usize],
    maps: &PeerMaps,
) -> Option<Vec<CopyPair>> {
    if kinds != (MemoryKind::Host, MemoryKind::Host) || local.is_empty() || !maps.any() {
        return None;
    }
    let mut out = Vec::with_capacity(local.len());
    for ((l, r), &k) in local.iter().zip(remote).zip(keys) {
        let (mapped, start) = (*maps.at.get(k)?)?;
        // `check_remote` found `r` inside region `k`, which starts at `start` in the peer
        // and is mapped in full at `mapped` here.
        let there = mapped + (r.addr - start);
        out.push(match op {
            Op::Read => CopyPair {
                src: there,
                dst: l.addr,
                len: l.len,
            },
            Op::Write => CopyPair {
                src: l.addr,
                dst: there,
                len: l.len,
            },
        });
    }
    Some(out)
}

/// Starts a transfer as copies when every remote range lies in `maps`; `None` leaves it to
/// UCX (a range outside them, device memory, or copy workers that cannot start).
pub fn start(
    copier: &mut Copier,
    op: Op,
    kinds: (MemoryKind, MemoryKind),
    (local, remote): (&[AddrRange], &[AddrRange]),
    keys: &[usize],
    maps: &PeerMaps,
) -> Option<Arc<Copies>> {
    let pairs = pairs(op, kinds, local, remote, keys, maps)?;
    copier
        .start(pairs, maps)
        .map_err(|e| tracing::warn!("same-host copies unavailable, UCX moves it: {e}"))
        .ok()
}

/// The copies of one transfer, shared with the jobs doing them.
pub struct Copies {
    pairs: Vec<CopyPair>,
    remaining: AtomicUsize,
    error: Mutex<Option<String>>,
    /// The peer's mappings stay while a job may copy through them.
    _files: Arc<Vec<PeerFile>>,
    owner: Arc<Owner>,
}

impl Copies {
    /// Whether a job is still copying.
    pub fn running(&self) -> bool {
        self.remaining.load(Ordering::Acquire) > 0
    }

    /// Why the copies failed, once they are over.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn fail(&self, why: &str) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        e.get_or_insert_with(|| why.to_string());
    }

    /// Waits until no job copies any more. Copies of mapped memory cannot block, so this
    /// ends; it is called where memory the jobs touch is about to go.
    pub fn wait(&self) {
        while self.running() {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    fn run(&self, start: usize, end: usize, method: kvxfer_host_mem::copy::Method) {
        // SAFETY: local ranges lie in our registrations, which cannot be unmapped while the
        // transfer is busy (deregistration and release wait for `running`); remote ranges lie
        // in `_files`, mapped in full and sealed against shrinking, alive as long as `self`.
        unsafe { copy_pool::copy_pairs(&self.pairs[start..end], method) };
        if !self.owner.alive() {
            self.fail("the peer process exited during the transfer");
        }
        // Release: the copies (fenced) are visible before `running` reads false.
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The agent's copy workers, started on the first same-host transfer.
#[derive(Default)]
pub struct Copier {
    pool: Option<CopyPool>,
}

impl Copier {
    /// Starts copying `pairs` on the workers (started on first use).
    pub fn start(&mut self, pairs: Vec<CopyPair>, maps: &PeerMaps) -> Result<Arc<Copies>, String> {
        let owner = maps.owner.clone().ok_or("nothing mapped")?;
        if self.pool.is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let pool = CopyPool::new(cores.min(MAX_WORKERS), "ucx")
                .map_err(|e| format!("copy workers: {e}"))?;
            self.pool = Some(pool);
        }
        let pool = self.pool.as_ref().ok_or("no copy workers")?;
        let split = copy_pool::split(&pairs, pool.workers(), MIN_JOB_BYTES);
        let copies = Arc::new(Copies {
            pairs,
            remaining: AtomicUsize::new(split.bounds.len()),
            error: Mutex::new(None),
            _files: Arc::clone(&maps.files),
            owner,
        });
        for (start, end) in split.bounds {
            let c = Arc::clone(&copies);
            if let Err(job) = pool.submit(Box::new(move || c.run(start, end, split.method))) {
                // Workers only stop with the pool: run it here rather than lose it.
                job();
            }
        }
        Ok(copies)
    }
}
