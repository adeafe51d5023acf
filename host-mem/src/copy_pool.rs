//! Host copies off the caller's thread: a pool of copy workers, and how a transfer's pieces
//! are cut into jobs for it. Transports that copy host memory themselves (the loopback, and
//! UCX between same-host peers in shared memory) complete asynchronously through it.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};

use crate::copy;

/// Jobs per worker a large transfer is cut into: small enough that the last job of a
/// transfer does not leave the other workers idle for long, large enough that queueing costs
/// nothing next to the copy.
const JOBS_PER_WORKER: u64 = 8;

/// One host copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPair {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// A transfer cut into jobs.
#[derive(Debug, PartialEq, Eq)]
pub struct Split {
    /// `(start, end)` of each job in the transfer's pairs, in order, covering all of them.
    pub bounds: Vec<(usize, usize)>,
    /// Streaming stores when the whole transfer is too large to stay in cache.
    pub method: copy::Method,
}

/// Cuts pairs into jobs of about `total / (JOBS_PER_WORKER * workers)` bytes (at least
/// `min_bytes`), so every worker gets a share of a large transfer.
pub fn split(pairs: &[CopyPair], workers: usize, min_bytes: u64) -> Split {
    let total: u64 = pairs.iter().map(|p| p.len).fold(0, u64::saturating_add);
    let target = (total / (JOBS_PER_WORKER * workers.max(1) as u64))
        .max(min_bytes)
        .max(1);
    let mut bounds = Vec::new();
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, p) in pairs.iter().enumerate() {
        acc = acc.saturating_add(p.len);
        if acc >= target {
            bounds.push((start, i + 1));
            start = i + 1;
            acc = 0;
        }
    }
    if start < pairs.len() {
        bounds.push((start, pairs.len()));
    }
    Split {
        bounds,
        method: copy::method_for(total),
    }
}

/// Copies `pairs` with `method`, then fences so the stores are visible before the caller
/// publishes completion.
///
/// # Safety
/// Every pair's source must be readable and its destination writable for `len` bytes for
/// the whole call.
pub unsafe fn copy_pairs(pairs: &[CopyPair], method: copy::Method) {
    for p in pairs {
        // SAFETY: the caller's promise; `copy` tolerates overlap.
        unsafe { copy::copy(p.dst as *mut u8, p.src as *const u8, p.len as usize, method) };
    }
    copy::fence(method);
}

/// A job: any work a copy worker runs.
pub type Job = Box<dyn FnOnce() + Send>;

/// Worker threads fed by a channel; dropping the pool lets them finish queued jobs and joins.
pub struct CopyPool {
    sender: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl CopyPool {
    /// `threads` workers (at least one), named `kvxfer-copy-{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        let (sender, receiver) = unbounded::<Job>();
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let rx: Receiver<Job> = receiver.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kvxfer-copy-{name}-{i}"))
                .spawn(move || {
                    batch_scheduling();
                    for job in rx {
                        job();
                    }
                })?;
            workers.push(handle);
        }
        Ok(CopyPool {
            sender: Some(sender),
            workers,
        })
    }

    /// How many workers run.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Queues a job; hands it back only if the workers are gone, which cannot happen while
    /// `self` exists.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        match &self.sender {
            Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
            None => Err(job),
        }
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        self.sender.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Marks the calling copy worker as batch work (Linux `SCHED_BATCH`): a worker woken by a
/// new job then does not preempt the thread that posted it, which on a machine with fewer
/// cores than workers plus engine threads would stall the engine in the middle of posting
/// (the post of a 256 MiB request took 1.5 ms instead of 0.2 on 2 cores). Copies still get
/// their full share of the cores; a failure only loses that preference.
fn batch_scheduling() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            tracing::debug!(
                "copy worker keeps its scheduling policy: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(lens: &[u64]) -> Vec<CopyPair> {
        lens.iter()
            .map(|&len| CopyPair {
                src: 0,
                dst: 0,
                len,
            })
            .collect()
    }

    #[test]
    fn a_large_transfer_gives_every_worker_several_jobs_covering_all_pairs() {
        let p = pairs(&[1 << 20; 256]);
        let s = split(&p, 2, 1 << 20);
        assert_eq!(s.bounds.len(), 16);
        assert_eq!(s.bounds[0].0, 0);
        assert_eq!(s.bounds.last().unwrap().1, p.len());
        assert!(s.bounds.windows(2).all(|w| w[0].1 == w[1].0));
        assert_eq!(
            s.method == copy::Method::Streaming,
            copy::streaming_supported()
        );
    }

    #[test]
    fn a_small_transfer_is_one_plain_job() {
        let p = pairs(&[4096; 64]);
        let s = split(&p, 4, 1 << 20);
        assert_eq!(s.bounds, vec![(0, 64)]);
        assert_eq!(s.method, copy::Method::Plain);
    }

    #[test]
    fn min_job_bytes_bounds_the_cut() {
        let s = split(&pairs(&[1 << 20; 8]), 4, 4 << 20);
        assert_eq!(s.bounds, vec![(0, 4), (4, 8)]);
    }

    #[test]
    fn no_pairs_no_jobs() {
        assert!(split(&[], 2, 1).bounds.is_empty());
    }

    #[test]
    fn copied_pairs_land_and_jobs_run_on_the_workers() {
        let src: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 256];
        let p = [
            CopyPair {
                src: src.as_ptr() as u64 + 16,
                dst: dst.as_mut_ptr() as u64,
                len: 32,
            },
            CopyPair {
                src: src.as_ptr() as u64,
                dst: dst.as_mut_ptr() as u64 + 200,
                len: 8,
            },
        ];
        // SAFETY: both pairs lie in the two vectors.
        unsafe { copy_pairs(&p, copy::Method::Plain) };
        assert_eq!(&dst[..32], &src[16..48]);
        assert_eq!(&dst[200..208], &src[..8]);
        assert_eq!(dst[32], 0);
        let pool = CopyPool::new(2, "t").unwrap();
        assert_eq!(pool.workers(), 2);
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..4 {
            let tx = tx.clone();
            assert!(
                pool.submit(Box::new(move || {
                    let name = std::thread::current().name().map(str::to_owned);
                    tx.send((i, name)).unwrap();
                }))
                .is_ok()
            );
        }
        let mut got: Vec<_> = rx.iter().take(4).collect();
        got.sort();
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert!(got.iter().all(|g| {
            g.1.as_deref()
                .is_some_and(|n| n.starts_with("kvxfer-copy-t-"))
        }));
    }

    /// The scheduling policy of each thread named `name` in this process, from
    /// `/proc/self/task/*/stat` (field 41).
    #[cfg(target_os = "linux")]
    fn policies_of(name: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim_end() != name {
                continue;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap();
            // Fields after the parenthesised name, which may hold spaces: field 3 onwards.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            out.push(rest.split(' ').nth(41 - 3).unwrap().parse().unwrap());
        }
        out
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn copy_workers_are_batch_work() {
        // Thread names show truncated to 15 bytes: both workers are "kvxfer-copy-zq-".
        let pool = CopyPool::new(2, "zq").unwrap();
        // The workers set their policy as they start: wait for both.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = Vec::new();
        while std::time::Instant::now() < deadline {
            seen = policies_of("kvxfer-copy-zq-");
            if seen.len() == 2 && seen.iter().all(|&p| p == libc::SCHED_BATCH as u32) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(seen, vec![libc::SCHED_BATCH as u32; 2]);
        drop(pool);
    }
}
