//! A posted transfer: its copy pairs, the regions it pins, and its completion.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use kvxfer_core::{Notification, XferStatus};

use crate::agent::{AgentShared, Pin};
use crate::faults::Faults;

const IN_PROGRESS: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// One host copy, both sides inside pinned regions.
pub use kvxfer_host_mem::copy_pool::CopyPair;

/// Where the notification goes once the data is visible.
#[derive(Debug)]
pub struct PendingNotification {
    pub target: Weak<AgentShared>,
    pub note: Notification,
}

/// Shared by the transport and the copy workers.
#[derive(Debug)]
pub struct XferState {
    pub pairs: Vec<CopyPair>,
    /// The CUDA device whose context copies run in, when either side is GPU memory.
    pub device: Option<u32>,
    /// Jobs not yet finished.
    remaining: AtomicUsize,
    state: AtomicU8,
    error: Mutex<Option<String>>,
    pins: Mutex<Vec<Pin>>,
    notification: Mutex<Option<PendingNotification>>,
    /// The peer that must stay alive for the copies to be valid.
    peer: Weak<AgentShared>,
    faults: Faults,
}

impl XferState {
    pub fn new(
        pairs: Vec<CopyPair>,
        device: Option<u32>,
        jobs: usize,
        pins: Vec<Pin>,
        notification: Option<PendingNotification>,
        peer: Weak<AgentShared>,
        faults: Faults,
    ) -> Arc<Self> {
        Arc::new(XferState {
            pairs,
            device,
            remaining: AtomicUsize::new(jobs),
            state: AtomicU8::new(IN_PROGRESS),
            error: Mutex::new(None),
            pins: Mutex::new(pins),
            notification: Mutex::new(notification),
            peer,
            faults,
        })
    }

    /// A transfer that failed before any byte moved.
    pub fn failed(reason: String) -> Arc<Self> {
        let x = XferState::new(
            Vec::new(),
            None,
            0,
            Vec::new(),
            None,
            Weak::new(),
            Faults::default(),
        );
        *x.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
        x.state.store(FAILED, Ordering::SeqCst);
        x
    }

    /// True when the peer is still there (checked before each job copies).
    pub fn peer_alive(&self) -> bool {
        self.peer.upgrade().is_some_and(|p| p.is_alive())
    }

    /// Records a failure; the first reason wins.
    pub fn fail(&self, reason: impl Into<String>) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(reason.into());
        }
    }

    pub fn has_failed(&self) -> bool {
        self.error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Called by each job when done; the last one completes the transfer.
    pub fn job_done(self: &Arc<Self>) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Copies are over: the regions may be deregistered from now on.
            self.pins.lock().unwrap_or_else(|e| e.into_inner()).clear();
            if self.has_failed() || !self.faults.maybe_hold(self) {
                self.finish();
            }
        }
    }

    /// Completes: on success, delivers the notification (data first, then the message).
    pub fn finish(&self) {
        if self.state.load(Ordering::SeqCst) != IN_PROGRESS {
            return;
        }
        if !self.has_failed() && !self.peer_alive() {
            self.fail("peer vanished before the transfer completed");
        }
        if self.has_failed() {
            self.state.store(FAILED, Ordering::SeqCst);
            return;
        }
        let pending = self
            .notification
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(p) = pending {
            if let Some(target) = p.target.upgrade() {
                for _ in 0..self.faults.notification_copies() {
                    target.deliver(p.note.clone());
                }
            }
        }
        self.state.store(DONE, Ordering::SeqCst);
    }

    /// Cancels a transfer being released: jobs not started yet skip their copies, and this
    /// returns once no job copies any more, so nothing lands after the release; false if
    /// copies still ran after `bound`.
    pub fn cancel(&self, bound: std::time::Duration) -> bool {
        if self.state.load(Ordering::SeqCst) == IN_PROGRESS {
            self.fail("released while in progress");
        }
        let start = std::time::Instant::now();
        while self.remaining.load(Ordering::Acquire) > 0 {
            if start.elapsed() > bound {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        true
    }

    pub fn status(&self) -> XferStatus {
        match self.state.load(Ordering::SeqCst) {
            DONE => XferStatus::Done,
            FAILED => XferStatus::Failed(
                self.error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
                    .unwrap_or_else(|| "failed".into()),
            ),
            _ => XferStatus::InProgress,
        }
    }
}
