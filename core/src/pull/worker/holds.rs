//! Prefill-side holds: a finished request's blocks stay held until every reader noted its
//! READ (notes counted per sender, only from agents that fetched our metadata) or its lease
//! expired.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::time::Duration;

use super::PullWorker;
use crate::pull::notify::{self, PullNote};
use crate::tally::Tally;
use crate::transport::Transport;

pub(super) struct Held {
    readers: Option<u32>,
    /// The agents whose read-done notes were counted, each once.
    senders: Vec<String>,
    deadline: Duration,
}

impl Held {
    fn new(deadline: Duration) -> Self {
        Held {
            readers: None,
            senders: Vec::new(),
            deadline,
        }
    }

    /// Counts `from`'s note naming `readers`; false (nothing counted) for a sender already
    /// counted or a reader count that contradicts the first note's.
    fn count(&mut self, from: &str, readers: u32) -> bool {
        if self.readers.is_some_and(|r| r != readers) || self.senders.iter().any(|s| s == from) {
            return false;
        }
        self.readers = Some(readers);
        self.senders.push(from.to_string());
        true
    }

    fn all_read(&self) -> bool {
        self.readers
            .is_some_and(|r| self.senders.len() >= r as usize)
    }
}

impl<T: Transport> PullWorker<T> {
    /// Holds each finished request's blocks for its readers, counting the notes that came
    /// before the hold.
    pub(super) fn start_holds(&mut self, hold: &[String]) {
        let now = self.clock.now();
        for req_id in hold {
            let mut held = Held::new(now.saturating_add(self.config.lease));
            if let Some(early) = self.early.remove(req_id) {
                held.senders = early.senders;
                held.readers = early.readers;
            }
            self.hold_or_free(req_id.clone(), held);
        }
    }

    pub(super) fn poll_notifications(&mut self) {
        let mut notes = Vec::new();
        if self.transport.drain_notifications(&mut notes).is_err() {
            return;
        }
        let now = self.clock.now();
        for n in notes {
            let note = notify::parse(&n.message);
            if note.is_some() && !self.readers.contains(&n.from) {
                // Only a decode that fetched our metadata reads (and frees) our blocks.
                self.metrics.refused_notes.tally(1);
                tracing::debug!(from = %n.from, "note from an agent that never fetched our metadata dropped");
                continue;
            }
            match note {
                Some(PullNote::Read { req_id, readers }) => {
                    if let Some(mut held) = self.held.remove(req_id) {
                        if !held.count(&n.from, readers) {
                            self.metrics.refused_notes.tally(1);
                        }
                        self.hold_or_free(req_id.to_string(), held);
                    } else {
                        // Arrived before the scheduler told us to hold: keep it, never drop.
                        let early = self
                            .early
                            .entry(req_id.to_string())
                            .or_insert_with(|| Held::new(now.saturating_add(self.config.lease)));
                        if !early.count(&n.from, readers) {
                            self.metrics.refused_notes.tally(1);
                        }
                    }
                }
                Some(PullNote::Heartbeat { req_id }) => {
                    if let Some(h) = self.held.get_mut(req_id) {
                        h.deadline = now.saturating_add(self.config.lease);
                    }
                }
                None => self.unknown_notifications.tally(1),
            }
        }
    }
    pub(super) fn hold_or_free(&mut self, req_id: String, held: Held) {
        if held.all_read() {
            self.finished.sending.push(req_id);
        } else {
            self.held.insert(req_id, held);
        }
    }
    pub(super) fn expire_leases(&mut self) {
        let now = self.clock.now();
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.held.remove(&id);
            self.metrics.expired_leases.tally(1);
            tracing::warn!(req = %id, "lease expired: freeing blocks no decode read");
            self.finished.sending.push(id);
        }
        // Early notes for requests never held are forgotten after a lease.
        self.early.retain(|_, h| h.deadline > now);
    }
}
