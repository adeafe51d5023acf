//! Prefill-side notes: read-done notes and heartbeats from agents that fetched this rank's
//! metadata go to its [`Holds`](crate::pull::holds::Holds); others are dropped and counted.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use super::PullWorker;
use crate::pull::notify;
use crate::tally::Tally;
use crate::transport::Transport;

impl<T: Transport> PullWorker<T> {
    /// Holds each finished request's blocks for its readers, counting the notes that came
    /// before the hold.
    pub(super) fn start_holds(&mut self, hold: &[String]) {
        let now = self.clock.now();
        for req_id in hold {
            self.holds.hold(req_id, now, &mut self.finished.sending);
        }
    }

    pub(super) fn poll_notifications(&mut self) {
        let mut notes = Vec::new();
        if self.transport.drain_notifications(&mut notes).is_err() {
            return;
        }
        let now = self.clock.now();
        for n in notes {
            let Some(note) = notify::parse(&n.message) else {
                self.unknown_notifications.tally(1);
                continue;
            };
            if !self.readers.contains(&n.from) && !self.readers.unnamed_allowed() {
                // Only a decode that fetched our metadata reads (and frees) our blocks.
                self.metrics.refused_notes.tally(1);
                tracing::debug!(from = %n.from, "note from an agent that never fetched our metadata dropped");
                continue;
            }
            if !self
                .holds
                .note(&n.from, &note, now, &mut self.finished.sending)
            {
                self.metrics.refused_notes.tally(1);
            }
        }
    }

    pub(super) fn expire_leases(&mut self) {
        let now = self.clock.now();
        let n = self.holds.expire(now, &mut self.finished.sending);
        self.metrics.expired_leases.tally(n);
    }
}
