//! Same-host peers whose memory is kvxfer shared memory: their memfds are mapped at
//! `load_peer`, and a transfer whose remote side lies entirely in them is a set of host
//! copies on a pool of copy workers (streaming stores for large transfers, as the loopback
//! copies), not UCX requests. UCX's shared-memory transports can only reach an engine's
//! memory through CMA, one system call and page pinning per piece; two copy workers on
//! memory both processes map reach the machine's copy ceiling.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvxfer_core::copy_pool::{self, CopyPair, CopyPool};
use kvxfer_core::shm::PeerFile;
use kvxfer_core::{AddrRange, MemoryKind, Op};

use crate::metadata::AgentMeta;

/// Smallest job handed to one copy worker.
const MIN_JOB_BYTES: u64 = 1 << 20;
/// Most copy workers one agent runs.
const MAX_WORKERS: usize = 4;

/// A peer's regions mapped here: per region of its metadata, the address of the region's
/// start in this process, and the mappings (kept alive by every transfer using them).
#[derive(Default)]
pub struct PeerMaps {
    pub at: Vec<Option<u64>>,
    pub files: Arc<Vec<PeerFile>>,
}

impl PeerMaps {
    /// Maps what a peer shares when it runs on this machine; any check that fails leaves the
    /// region (or the peer) on UCX's ordinary path.
    pub fn attach(meta: &AgentMeta) -> PeerMaps {
        let mut maps = PeerMaps {
            at: vec![None; meta.regions.len()],
            files: Arc::new(Vec::new()),
        };
        let here = kvxfer_core::shm::host_id();
        if meta.host.is_none() || meta.host != here {
            return maps;
        }
        let mut files: Vec<PeerFile> = Vec::new();
        // Exports of one file, in the order its mapping was made.
        let mut tokens = Vec::new();
        for (i, r) in meta.regions.iter().enumerate() {
            let Some(e) = r.shared else { continue };
            let k = match tokens.iter().position(|t| *t == e.token) {
                Some(k) => k,
                None => match PeerFile::attach(&e) {
                    Ok(f) => {
                        files.push(f);
                        tokens.push(e.token);
                        files.len() - 1
                    }
                    Err(why) => {
                        tracing::info!(peer = %meta.name, "not mapping shared memory: {why}");
                        continue;
                    }
                },
            };
            // `decode` checked the region lies in a file of `file_len` bytes and `attach`
            // that the file has that size; `at` checks again.
            maps.at[i] = files[k].at(e.offset, r.range.len);
        }
        maps.files = Arc::new(files);
        maps
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
    regions: &[(MemoryKind, AddrRange)],
    maps: &PeerMaps,
) -> Option<Vec<CopyPair>> {
    if kinds != (MemoryKind::Host, MemoryKind::Host) || local.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(local.len());
    for ((l, r), &k) in local.iter().zip(remote).zip(keys) {
        let base = (*maps.at.get(k)?)?;
        // `check_remote` found `r` inside region `k`, which is mapped in full at `base`.
        let there = base + (r.addr - regions.get(k)?.1.addr);
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

/// The copies of one transfer, shared with the jobs doing them.
pub struct Copies {
    pairs: Vec<CopyPair>,
    remaining: AtomicUsize,
    error: Mutex<Option<String>>,
    /// The peer's mappings stay while a job may copy through them.
    files: Arc<Vec<PeerFile>>,
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

    fn run(&self, start: usize, end: usize, method: kvxfer_core::host_copy::Method) {
        // SAFETY: local ranges lie in our registrations, which cannot be unmapped while the
        // transfer is busy (deregistration and release wait for `running`); remote ranges lie
        // in `files`, mapped in full and sealed against shrinking, alive as long as `self`.
        unsafe { copy_pool::copy_pairs(&self.pairs[start..end], method) };
        if !self.files.first().is_none_or(PeerFile::owner_alive) {
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
    /// Starts copying `pairs` on the workers.
    pub fn start(
        &mut self,
        name: &str,
        pairs: Vec<CopyPair>,
        files: Arc<Vec<PeerFile>>,
    ) -> Result<Arc<Copies>, String> {
        if self.pool.is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let pool = CopyPool::new(cores.min(MAX_WORKERS), name)
                .map_err(|e| format!("copy workers: {e}"))?;
            self.pool = Some(pool);
        }
        let pool = self.pool.as_ref().expect("started above");
        let split = copy_pool::split(&pairs, pool.workers(), MIN_JOB_BYTES);
        let copies = Arc::new(Copies {
            pairs,
            remaining: AtomicUsize::new(split.bounds.len()),
            error: Mutex::new(None),
            files,
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
