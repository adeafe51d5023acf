//! Prefill-side notes: read-done notes and heartbeats from agents that fetched this rank's
//! metadata go to its [`Holds`](crate::pull::holds::Holds); others are dropped and counted.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::Arc;

use super::PullWorker;
use crate::pull::holds::Holds;
use crate::pull::notify;
use crate::pull::scheduler::Hold;
use crate::pull::stamps::{Stamp, StampTable};
use crate::sidechannel::{KnownReaders, Listener};
use crate::tally::Tally;
use crate::transport::Transport;

/// What the prefill side keeps: the listener that serves this rank's metadata, the decode
/// agents that fetched it, the holds, their stamps, and what to report freed.
pub(super) struct Serving {
    pub(super) listener: Option<Listener>,
    /// Decode agents that fetched this rank's metadata: the only senders of notes counted.
    pub(super) readers: Arc<KnownReaders>,
    pub(super) holds: Holds,
    /// Requests whose blocks may be freed, since the last step.
    pub(super) sending: Vec<String>,
    /// The stamp table decodes check after reading, and the stamp of each held request,
    /// cleared from the table before its blocks are reported free.
    pub(super) stamps: StampTable,
    pub(super) stamped: HashMap<String, Stamp>,
    /// Notifications that were not kvxfer pull messages.
    pub(super) unknown_notifications: u64,
}

impl Serving {
    /// Serving on `listener`, nothing held.
    pub(super) fn new(listener: Listener, holds: Holds, stamps: StampTable) -> Self {
        Serving {
            readers: listener.readers(),
            listener: Some(listener),
            holds,
            sending: Vec::new(),
            stamps,
            stamped: HashMap::new(),
            unknown_notifications: 0,
        }
    }
}

impl<T: Transport> PullWorker<T> {
    /// Holds each finished request's blocks for its readers, counting the notes that came
    /// before the hold.
    /// Each hold's stamp is in the table when the hold starts (with content digests, after
    /// its blocks' entries), and stays until [`PullWorker::unstamp_freed`] sees the request
    /// freed.
    pub(super) fn start_holds(&mut self, hold: &[Hold]) {
        let now = self.clock.now();
        for h in hold {
            if let Some(old) = self.serving.stamped.insert(h.req_id.clone(), h.stamp) {
                // Held again: the new reference replaces the old one.
                self.serving.stamps.release(old);
            }
            if let Some(d) = &self.digests {
                // The entries first: a decode that finds the stamp finds them written.
                let start = std::time::Instant::now();
                d.publish(&h.req_id, &h.block_ids);
                self.metrics.digest_time.tally(start.elapsed());
            }
            self.serving.stamps.set(h.stamp);
            self.serving
                .holds
                .hold(&h.req_id, now, &mut self.serving.sending);
        }
    }

    /// Clears the stamps of the requests about to be reported free, so that a decode reading
    /// their blocks from now on (the engine may reuse them) finds its reference refuted.
    pub(super) fn unstamp_freed(&mut self) {
        for id in &self.serving.sending {
            if let Some(stamp) = self.serving.stamped.remove(id) {
                self.serving.stamps.release(stamp);
            }
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
                self.serving.unknown_notifications.tally(1);
                continue;
            };
            if !self.serving.readers.contains(&n.from) && !self.serving.readers.unnamed_allowed() {
                // Only a decode that fetched our metadata reads (and frees) our blocks.
                self.metrics.refused_notes.tally(1);
                tracing::debug!(from = %n.from, "note from an agent that never fetched our metadata dropped");
                continue;
            }
            if !self
                .serving
                .holds
                .note(&n.from, &note, now, &mut self.serving.sending)
            {
                self.metrics.refused_notes.tally(1);
            }
        }
    }

    pub(super) fn expire_leases(&mut self) {
        let now = self.clock.now();
        let n = self.serving.holds.expire(now, &mut self.serving.sending);
        self.metrics.expired_leases.tally(n);
    }
}
