//! The copy-worker pool: host memcpy off the caller's thread, so completion is truly
//! asynchronous.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvxfer_core::host_copy as copy;

use crate::xfer::{CopyPair, XferState};

/// Jobs per worker a large transfer is cut into: small enough that the last job of a
/// transfer does not leave the other workers idle for long, large enough that queueing costs
/// nothing next to the copy.
const JOBS_PER_WORKER: u64 = 8;

/// A slice of a transfer's pairs for one worker.
pub struct Job {
    pub xfer: Arc<XferState>,
    pub start: usize,
    pub end: usize,
    /// How its host pieces are copied (the same for every job of a transfer).
    pub method: copy::Method,
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
    let total: u64 = pairs.iter().map(|p| p.len).sum();
    let target = (total / (JOBS_PER_WORKER * workers.max(1) as u64))
        .max(min_bytes)
        .max(1);
    let mut bounds = Vec::new();
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, p) in pairs.iter().enumerate() {
        acc += p.len;
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

/// Worker threads fed by a channel; dropping the pool lets them finish queued jobs and joins.
pub struct CopyPool {
    sender: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl CopyPool {
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
                        run(&job);
                    }
                })?;
            workers.push(handle);
        }
        Ok(CopyPool {
            sender: Some(sender),
            workers,
        })
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Queues a job. Workers only stop when the pool is dropped, so sending cannot fail
    /// while `self` exists; a failure is reported on the transfer all the same.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = &self.sender {
            if let Err(e) = tx.send(job) {
                let job = e.into_inner();
                job.xfer.fail("copy pool stopped");
                job.xfer.job_done();
            }
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

fn run(job: &Job) {
    let x = &job.xfer;
    if !x.has_failed() && !x.peer_alive() {
        x.fail("peer vanished during the transfer");
    }
    if !x.has_failed() {
        match x.device {
            None => {
                let method = job.method;
                for p in &x.pairs[job.start..job.end] {
                    // SAFETY: every pair was validated at post time to lie inside a region
                    // registered (by us or the peer) as host memory, and those regions are
                    // pinned by the transfer until all its jobs are done: deregistration
                    // waits for the pins, and registrants promise the memory stays valid
                    // until deregistration. `copy` tolerates overlap.
                    unsafe {
                        copy::copy(p.dst as *mut u8, p.src as *const u8, p.len as usize, method);
                    }
                }
                // Streaming stores must be visible before `job_done` publishes completion.
                copy::fence(method);
            }
            Some(device) => gpu_copy(job, device),
        }
    }
    x.job_done();
}

#[cfg(feature = "cuda")]
fn gpu_copy(job: &Job, device: u32) {
    for p in &job.xfer.pairs[job.start..job.end] {
        // SAFETY: as for host copies, both ranges lie in pinned registered regions.
        if let Err(e) = unsafe { crate::cuda::contexts().copy(device, p.dst, p.src, p.len) } {
            job.xfer.fail(e);
            return;
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_copy(job: &Job, _device: u32) {
    // Unreachable in practice: GPU memory cannot be registered without the feature.
    job.xfer
        .fail("GPU copy requested in a build without the `cuda` feature");
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

    #[test]
    fn no_pairs_no_jobs() {
        assert!(split(&[], 2, 1).bounds.is_empty());
    }
}
