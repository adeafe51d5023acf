//! The prefill side's holds, without I/O: a finished request's blocks stay held until every
//! reader noted its READ (each sender counted once, all naming the same reader count) or
//! its lease expired; heartbeats extend the lease; notes that arrive before the hold are
//! kept for a lease and counted when it starts. [`super::PullWorker`] feeds it the notes of
//! agents that fetched its metadata; the `pull_holds` fuzz target drives it directly.
//!
//! Public for the fuzz targets; engines use [`PullWorker`](crate::pull::PullWorker).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::time::Duration;

use super::notify::PullNote;

/// Most requests with early notes (notes before their hold) kept at once; notes for further
/// requests are refused, so a flood of made-up request ids cannot grow memory without bound.
pub const MAX_EARLY: usize = 1 << 16;

#[derive(Debug)]
struct Held {
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

/// The holds of one prefill rank. Requests freed are appended to the `freed` list each
/// method takes (the worker's `Finished::sending`).
#[derive(Debug)]
pub struct Holds {
    lease: Duration,
    held: HashMap<String, Held>,
    early: HashMap<String, Held>,
}

impl Holds {
    /// No holds; each lasts `lease` past its start or its last heartbeat.
    pub fn new(lease: Duration) -> Self {
        Holds {
            lease,
            held: HashMap::new(),
            early: HashMap::new(),
        }
    }

    /// Holds `req_id`'s blocks from `now`, counting the notes that came before; frees it at
    /// once if those were all its readers. A request already held keeps the notes counted
    /// and gets a new lease from `now` (the scheduler said again that it is to be held).
    pub fn hold(&mut self, req_id: &str, now: Duration, freed: &mut Vec<String>) {
        if let Some(h) = self.held.get_mut(req_id) {
            h.deadline = now.saturating_add(self.lease);
            return;
        }
        let mut held = Held::new(now.saturating_add(self.lease));
        if let Some(early) = self.early.remove(req_id) {
            held.senders = early.senders;
            held.readers = early.readers;
        }
        self.hold_or_free(req_id.to_string(), held, freed);
    }

    /// Applies `note` from agent `from` at `now`; false when it was refused (a repeat, a
    /// contradicting reader count, or no room for another early request).
    pub fn note(
        &mut self,
        from: &str,
        note: &PullNote<'_>,
        now: Duration,
        freed: &mut Vec<String>,
    ) -> bool {
        // A held request whose id starts with a heartbeat prefix: its read note looks like a
        // heartbeat. (Arriving before its hold, it is taken as the heartbeat, renews nothing,
        // and the blocks wait for their lease.)
        if let Some((req_id, readers)) = super::notify::also_read(note)
            && self.held.contains_key(&req_id)
        {
            let read = PullNote::Read {
                req_id: &req_id,
                readers,
            };
            return self.note(from, &read, now, freed);
        }
        match *note {
            PullNote::Read { req_id, readers } => {
                if let Some(mut held) = self.held.remove(req_id) {
                    let counted = held.count(from, readers);
                    self.hold_or_free(req_id.to_string(), held, freed);
                    return counted;
                }
                // Arrived before the scheduler told us to hold: keep it for a lease.
                if !self.early.contains_key(req_id) && self.early.len() >= MAX_EARLY {
                    return false;
                }
                let lease = self.lease;
                self.early
                    .entry(req_id.to_string())
                    .or_insert_with(|| Held::new(now.saturating_add(lease)))
                    .count(from, readers)
            }
            PullNote::Heartbeat { req_id } => {
                self.renew(req_id, now);
                true
            }
            PullNote::Heartbeats { req_ids } => {
                for id in req_ids.split(',').filter(|id| !id.is_empty()) {
                    self.renew(id, now);
                }
                true
            }
        }
    }

    /// Extends a held request's lease to a full lease from `now`.
    fn renew(&mut self, req_id: &str, now: Duration) {
        if let Some(h) = self.held.get_mut(req_id) {
            h.deadline = now.saturating_add(self.lease);
        }
    }

    /// Frees every hold whose lease ran out by `now` and forgets early notes a lease old;
    /// returns the number of holds freed so.
    pub fn expire(&mut self, now: Duration, freed: &mut Vec<String>) -> u64 {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        let n = expired.len() as u64;
        for id in expired {
            self.held.remove(&id);
            tracing::warn!(req = %id, "lease expired: freeing blocks no decode read");
            freed.push(id);
        }
        self.early.retain(|_, h| h.deadline > now);
        n
    }

    /// Whether `req_id` is held.
    pub fn is_held(&self, req_id: &str) -> bool {
        self.held.contains_key(req_id)
    }

    /// Requests held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Requests with early notes kept.
    pub fn early(&self) -> usize {
        self.early.len()
    }

    /// Forgets every hold and early note (shutdown).
    pub fn clear(&mut self) {
        self.held.clear();
        self.early.clear();
    }

    fn hold_or_free(&mut self, req_id: String, held: Held, freed: &mut Vec<String>) {
        if held.all_read() {
            freed.push(req_id);
        } else {
            self.held.insert(req_id, held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn read(req_id: &str, readers: u32) -> PullNote<'_> {
        PullNote::Read { req_id, readers }
    }

    #[test]
    fn early_notes_are_bounded_and_those_already_kept_still_count() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        for i in 0..MAX_EARLY {
            assert!(h.note("d", &read(&format!("r{i}"), 2), Duration::ZERO, &mut freed));
        }
        assert!(!h.note("d", &read("one-more", 2), Duration::ZERO, &mut freed));
        assert_eq!(h.early(), MAX_EARLY);
        // A second reader of a request already kept is still counted, and its hold frees it.
        assert!(h.note("e", &read("r0", 2), Duration::ZERO, &mut freed));
        h.hold("r0", Duration::ZERO, &mut freed);
        assert_eq!(freed, ["r0"]);
        assert_eq!(h.early(), MAX_EARLY - 1);
        h.expire(LEASE, &mut freed);
        assert_eq!(h.early(), 0, "early notes are forgotten after a lease");
    }

    #[test]
    fn holding_twice_keeps_the_notes_and_renews_the_lease() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        h.hold("r", Duration::ZERO, &mut freed);
        assert!(h.note("d", &read("r", 2), Duration::ZERO, &mut freed));
        h.hold("r", Duration::from_secs(10), &mut freed);
        assert_eq!(h.expire(LEASE, &mut freed), 0, "the lease was not renewed");
        assert!(h.note("e", &read("r", 2), LEASE, &mut freed));
        assert_eq!(freed, ["r"], "the second hold forgot the first note");
    }

    #[test]
    fn a_request_is_freed_by_its_last_distinct_reader_only() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        h.hold("r", Duration::ZERO, &mut freed);
        assert!(h.is_held("r") && !h.is_held("other"));
        assert_eq!((h.held(), h.early()), (1, 0));
        assert!(h.note("d", &read("r", 2), Duration::ZERO, &mut freed));
        assert!(
            !h.note("d", &read("r", 2), Duration::ZERO, &mut freed),
            "repeat counted"
        );
        assert!(
            !h.note("e", &read("r", 3), Duration::ZERO, &mut freed),
            "other count taken"
        );
        assert!(freed.is_empty() && h.is_held("r"));
        assert!(h.note("e", &read("r", 2), Duration::ZERO, &mut freed));
        assert_eq!(freed, ["r"]);
        assert!(!h.is_held("r"));
        assert_eq!((h.held(), h.early()), (0, 0));
    }

    #[test]
    fn notes_before_the_hold_count_when_it_starts() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        assert!(h.note("d", &read("r", 1), Duration::ZERO, &mut freed));
        assert_eq!((h.held(), h.early()), (0, 1));
        assert!(freed.is_empty(), "freed before it was held");
        h.hold("r", Duration::ZERO, &mut freed);
        assert_eq!(freed, ["r"], "the early note did not count");
        assert_eq!((h.held(), h.early()), (0, 0));
    }

    /// A client's request id that starts with `HB:` or `kvxfer-hb:`: its read-done note
    /// frees it (it was read as a heartbeat and the blocks waited for the lease), while a
    /// heartbeat for requests held here still renews them.
    #[test]
    fn read_notes_of_ids_with_a_heartbeat_prefix_free_their_holds() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        let t = |s| Duration::from_secs(s);
        for id in ["HB:x", "kvxfer-hb:y", "a"] {
            h.hold(id, t(0), &mut freed);
        }
        for id in ["HB:x", "kvxfer-hb:y"] {
            let msg = super::super::notify::read_done(id, 1);
            let note = super::super::notify::parse(&msg).expect("parses");
            assert!(h.note("d", &note, t(1), &mut freed), "{id}");
        }
        assert_eq!(freed, ["HB:x", "kvxfer-hb:y"]);
        let hb = super::super::notify::parse(b"HB:a").expect("parses");
        assert!(h.note("d", &hb, t(10), &mut freed));
        assert_eq!(h.expire(t(30), &mut freed), 0, "a was renewed");
        assert_eq!(h.held(), 1);
    }

    #[test]
    fn a_vllm_heartbeat_extends_every_request_it_names() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        let t = |s| Duration::from_secs(s);
        for id in ["a", "b", "c"] {
            h.hold(id, t(0), &mut freed);
        }
        let hb = PullNote::Heartbeats { req_ids: "a,,c,zz" };
        assert!(h.note("d", &hb, t(10), &mut freed));
        assert_eq!(h.expire(t(30), &mut freed), 1);
        assert_eq!(freed, ["b"], "only b was not named");
        assert_eq!(
            h.expire(t(40), &mut freed),
            2,
            "a and c end a lease after the heartbeat"
        );
    }

    #[test]
    fn leases_expire_at_their_deadline_and_heartbeats_extend_them() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        let t = |s| Duration::from_secs(s);
        h.hold("a", t(0), &mut freed);
        h.hold("b", t(0), &mut freed);
        assert!(h.note("d", &PullNote::Heartbeat { req_id: "b" }, t(10), &mut freed));
        assert!(h.note(
            "d",
            &PullNote::Heartbeat { req_id: "none" },
            t(10),
            &mut freed
        ));
        assert_eq!(h.expire(t(29), &mut freed), 0);
        assert!(freed.is_empty());
        assert_eq!(
            h.expire(t(30), &mut freed),
            1,
            "a lease ends at its deadline"
        );
        assert_eq!(freed, ["a"]);
        assert_eq!(
            h.expire(t(39), &mut freed),
            0,
            "the heartbeat did not extend b"
        );
        assert_eq!(h.expire(t(40), &mut freed), 1);
        assert_eq!(freed, ["a", "b"]);
    }

    #[test]
    fn early_notes_last_one_lease() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        assert!(h.note("d", &read("r", 2), Duration::ZERO, &mut freed));
        h.expire(LEASE - Duration::from_nanos(1), &mut freed);
        assert_eq!(h.early(), 1, "forgotten before a lease passed");
        h.expire(LEASE, &mut freed);
        assert_eq!(h.early(), 0);
        assert!(freed.is_empty(), "an early note is not a hold");
    }

    #[test]
    fn clear_forgets_holds_and_early_notes() {
        let mut h = Holds::new(LEASE);
        let mut freed = Vec::new();
        h.hold("a", Duration::ZERO, &mut freed);
        assert!(h.note("d", &read("b", 2), Duration::ZERO, &mut freed));
        h.clear();
        assert_eq!((h.held(), h.early()), (0, 0));
        assert_eq!(h.expire(LEASE, &mut freed), 0);
        assert!(freed.is_empty());
    }
}
