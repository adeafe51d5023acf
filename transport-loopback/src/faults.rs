//! Deterministic fault injection for tests: each fault is armed explicitly and consumed in
//! order, so a test knows exactly which transfer or notification it hits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::xfer::XferState;

#[derive(Debug, Default)]
struct Inner {
    fail_next: AtomicUsize,
    /// 0: disarmed; `k + 1`: the post after the next `k` is refused.
    refuse_in: AtomicUsize,
    drop_next: AtomicUsize,
    duplicate_next: AtomicUsize,
    hold: AtomicBool,
    held: Mutex<Vec<Arc<XferState>>>,
    vanish: Mutex<Option<Arc<crate::agent::AgentShared>>>,
}

/// A handle to one agent's fault injection; clone it into the test's thread freely.
#[derive(Debug, Clone, Default)]
pub struct Faults(Arc<Inner>);

fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

impl Faults {
    pub(crate) fn new(agent: Arc<crate::agent::AgentShared>) -> Self {
        let f = Faults::default();
        *f.0.vanish.lock().unwrap_or_else(|e| e.into_inner()) = Some(agent);
        f
    }

    /// The next `n` transfers this agent posts fail (no byte moves).
    pub fn fail_next_transfers(&self, n: usize) {
        self.0.fail_next.store(n, Ordering::SeqCst);
    }

    /// After `k` more posts succeed, the next post this agent makes is refused with an
    /// error (nothing is posted): a setup that fails part-way, after some READs went out.
    pub fn refuse_post_after(&self, k: usize) {
        self.0
            .refuse_in
            .store(k.saturating_add(1), Ordering::SeqCst);
    }

    /// The next `n` notifications this agent sends are lost.
    pub fn drop_next_notifications(&self, n: usize) {
        self.0.drop_next.store(n, Ordering::SeqCst);
    }

    /// The next `n` notifications this agent sends arrive twice.
    pub fn duplicate_next_notifications(&self, n: usize) {
        self.0.duplicate_next.store(n, Ordering::SeqCst);
    }

    /// While on, transfers that finish copying stay `InProgress` (and their notifications
    /// unsent) until [`Faults::release_held`]: a completion delayed for as long as the test
    /// wants, with no clock involved.
    pub fn hold_completions(&self, on: bool) {
        self.0.hold.store(on, Ordering::SeqCst);
    }

    /// Completes every held transfer now (and stops holding).
    pub fn release_held(&self) {
        self.0.hold.store(false, Ordering::SeqCst);
        let held = std::mem::take(&mut *self.0.held.lock().unwrap_or_else(|e| e.into_inner()));
        for x in held {
            x.finish();
        }
    }

    /// Makes the agent vanish as if its process died: peers can no longer load it, and
    /// transfers involving it fail.
    pub fn vanish(&self) {
        if let Some(agent) = self
            .0
            .vanish
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            agent.vanish();
        }
    }

    pub(crate) fn take_failure(&self) -> bool {
        take(&self.0.fail_next)
    }

    /// Counts one post down towards an armed refusal; true for the refused one.
    pub(crate) fn take_refusal(&self) -> bool {
        let before = self
            .0
            .refuse_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        before == Ok(1)
    }

    /// How many copies of a notification to deliver: 0 (dropped), 1, or 2 (duplicated).
    pub(crate) fn notification_copies(&self) -> usize {
        if take(&self.0.drop_next) {
            0
        } else if take(&self.0.duplicate_next) {
            2
        } else {
            1
        }
    }

    /// Holds `x` instead of finishing it when holding is on; returns true if held.
    pub(crate) fn maybe_hold(&self, x: &Arc<XferState>) -> bool {
        let mut held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        if self.0.hold.load(Ordering::SeqCst) {
            held.push(Arc::clone(x));
            true
        } else {
            false
        }
    }
}
