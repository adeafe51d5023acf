//! The copy-worker pool: host memcpy off the caller's thread, so completion is truly
//! asynchronous.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};

use crate::xfer::XferState;

/// A slice of a transfer's pairs for one worker.
pub struct Job {
    pub xfer: Arc<XferState>,
    pub start: usize,
    pub end: usize,
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

fn run(job: &Job) {
    let x = &job.xfer;
    if !x.has_failed() && !x.peer_alive() {
        x.fail("peer vanished during the transfer");
    }
    if !x.has_failed() {
        match x.device {
            None => {
                for p in &x.pairs[job.start..job.end] {
                    // SAFETY: every pair was validated at post time to lie inside a region
                    // registered (by us or the peer) as host memory, and those regions are
                    // pinned by the transfer until all its jobs are done: deregistration
                    // waits for the pins, and registrants promise the memory stays valid
                    // until deregistration. `copy` tolerates overlap.
                    unsafe {
                        std::ptr::copy(p.src as *const u8, p.dst as *mut u8, p.len as usize);
                    }
                }
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
