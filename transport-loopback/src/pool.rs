//! The loopback's copy jobs on `kvxfer_core`'s copy-worker pool: host memcpy off the
//! caller's thread, so completion is truly asynchronous.

use std::sync::Arc;

use kvxfer_host_mem::copy;
use kvxfer_host_mem::copy_pool::{self, CopyPool as Workers};

use crate::xfer::XferState;

pub use kvxfer_host_mem::copy_pool::{Split, split};

/// A slice of a transfer's pairs for one worker.
pub struct Job {
    pub xfer: Arc<XferState>,
    pub start: usize,
    pub end: usize,
    /// How its host pieces are copied (the same for every job of a transfer).
    pub method: copy::Method,
}

/// The loopback's workers.
pub struct CopyPool(Workers);

impl CopyPool {
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        Workers::new(threads, name).map(CopyPool)
    }

    pub fn workers(&self) -> usize {
        self.0.workers()
    }

    /// Queues a job. Workers only stop when the pool is dropped, so sending cannot fail
    /// while `self` exists; a failure is reported on the transfer all the same.
    pub fn submit(&self, job: Job) {
        let xfer = Arc::clone(&job.xfer);
        if self.0.submit(Box::new(move || run(&job))).is_err() {
            xfer.fail("copy pool stopped");
            xfer.job_done();
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
                // SAFETY: every pair was validated at post time to lie inside a region
                // registered (by us or the peer) as host memory, and those regions are
                // pinned by the transfer until all its jobs are done: deregistration waits
                // for the pins, and registrants promise the memory stays valid until
                // deregistration. The copy fences before `job_done` publishes completion.
                unsafe { copy_pool::copy_pairs(&x.pairs[job.start..job.end], job.method) };
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
