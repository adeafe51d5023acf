//! One room on the prefill side of the push connector, without I/O: the engine's side (how
//! many pages, aux and state indices), the decode destinations that asked for it, the
//! chunks sent so far and the WRITEs in flight, and the status they add up to.
//! [`crate::push::PushPrefill`] validates what decodes send, posts the WRITEs and polls them; the
//! `push_prefill_room` fuzz target drives a room directly.
//!
//! Public for the fuzz targets; engines use [`PushPrefill`](crate::push::PushPrefill).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::PushError;
use crate::push::digests::Fold;
use crate::push::messages::RoomRequest;
use crate::push::status::RoomStatus;
use crate::tally::Tally;
use crate::transport::XferId;

/// One room of a prefill rank.
#[derive(Debug)]
pub struct PrefillRoom {
    status: RoomStatus,
    created: Duration,
    total: Option<usize>,
    aux_index: Option<u32>,
    state_indices: Vec<u32>,
    dests: HashMap<String, RoomRequest>,
    /// Destinations this rank serves per room, known once one asked.
    required: Option<usize>,
    sent: usize,
    chunk: u32,
    xfers: Vec<XferId>,
    last_sent: bool,
    error: Option<String>,
    /// Agents that asked for the room after it failed: not destinations, only to be told.
    late: HashSet<String>,
    /// Destinations (and late agents) told that the room failed.
    told: HashSet<String>,
    /// Per destination that asked for content digests: the fold of what was sent to it.
    folds: HashMap<String, Fold>,
}

/// The next chunk of a room, as [`PrefillRoom::next_chunk`] lays it out.
#[derive(Debug, Clone)]
pub struct Chunk {
    /// Index, among the room's pages, of the chunk's first page.
    pub start: usize,
    /// Chunk id (0, 1, …).
    pub id: u32,
    /// Pages in the chunk.
    pub pages: usize,
    /// Pages the chunk completes (its `pages`, or 0 for one layer range of pages whose
    /// other layers follow in later chunks).
    pub advance: usize,
    /// Whether the chunk completes the room (it then carries aux and state too).
    pub is_last: bool,
    /// Destinations that receive data (dummy ones, without pages, are left out).
    pub dests: Vec<RoomRequest>,
    /// The engine's aux index.
    pub aux_index: Option<u32>,
    /// The engine's state indices.
    pub state_indices: Vec<u32>,
}

impl PrefillRoom {
    /// A room first heard of at `now` (from the engine or from a decode).
    pub fn new(now: Duration) -> Self {
        PrefillRoom {
            status: RoomStatus::Bootstrapping,
            created: now,
            total: None,
            aux_index: None,
            state_indices: Vec::new(),
            dests: HashMap::new(),
            required: None,
            sent: 0,
            chunk: 0,
            xfers: Vec::new(),
            last_sent: false,
            error: None,
            late: HashSet::new(),
            told: HashSet::new(),
            folds: HashMap::new(),
        }
    }

    /// The content-digest fold of what was sent to destination `agent` so far.
    pub fn fold_mut(&mut self, agent: &str) -> &mut Fold {
        self.folds.entry(agent.to_string()).or_default()
    }

    /// The room's status.
    pub fn status(&self) -> RoomStatus {
        self.status
    }

    /// Why the room failed.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// Whether a decode asked for the room before the engine added it.
    pub fn requested(&self) -> bool {
        self.total.is_none() && !self.status.is_final() && !self.dests.is_empty()
    }

    /// Whether every decode destination this rank serves has asked for the room (and it
    /// has not failed): an engine that learns of a room's destinations before it knows the
    /// room's size (SGLang's `WaitingForInput` before `init`) may add it now.
    pub fn all_asked(&self) -> bool {
        self.status != RoomStatus::Failed && self.required.is_some_and(|n| self.dests.len() >= n)
    }

    /// The prompt tokens the decode holds already (the same for every destination, or the
    /// room failed), once a destination asked; the engine sends only the tokens after them.
    pub fn decode_prefix(&self) -> Option<u64> {
        self.dests.values().next().map(|d| d.prefix_tokens)
    }

    /// How many of the room's pages each KV cache group takes (empty for a cache of one
    /// group), once a destination with pages asked: the same for every such destination,
    /// or the room failed.
    pub fn decode_group_pages(&self) -> Option<&[u32]> {
        self.dests
            .values()
            .find(|d| !d.pages.is_empty())
            .map(|d| d.group_pages.as_slice())
    }

    /// The agents of the decode destinations.
    pub fn dest_agents(&self) -> impl Iterator<Item = &str> {
        self.dests.keys().map(String::as_str)
    }

    /// Whether the room still needs decode `agent`'s connection: it names `agent` and is
    /// not final, holds WRITEs (to be polled or released), or has a failure to tell
    /// `agent`. A decode no room needs can be forgotten.
    pub fn needs(&self, agent: &str) -> bool {
        let named = self.dests.contains_key(agent) || self.late.contains(agent);
        named
            && (!self.status.is_final()
                || !self.xfers.is_empty()
                || (self.status == RoomStatus::Failed && !self.told.contains(agent)))
    }

    /// Fails the room (also one that succeeded: an abort overrides); the first reason is
    /// kept.
    pub fn fail(&mut self, reason: String) {
        tracing::warn!(%reason, "push room failed");
        self.error.get_or_insert(reason);
        self.status = RoomStatus::Failed;
    }

    /// The engine added the room: `total` pages, then aux and state on the last chunk.
    /// `required` is the number of destinations this rank serves per room, where a
    /// destination that asked already tells it.
    pub fn set_engine(
        &mut self,
        total: usize,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
        required: Option<u32>,
    ) {
        self.total = Some(total);
        self.aux_index = aux_index;
        self.state_indices = state_indices;
        let reason = self.dests.values().find_map(|d| validate_len(d, total));
        if let Some(reason) = reason {
            self.fail(reason);
        } else if required.is_some_and(|n| self.dests.len() >= n as usize) {
            self.status = self.status.update(RoomStatus::WaitingForInput);
        }
    }

    /// Replaces the engine's state indices (sent with the last chunk), for an engine that
    /// knows them only when it sends that chunk.
    pub fn set_state(&mut self, state_indices: Vec<u32>) {
        self.state_indices = state_indices;
    }

    /// A decode destination asked for the room; `problem` is what validating it against the
    /// decode's registration found, `required` as in [`PrefillRoom::set_engine`]. A final
    /// room ignores it.
    pub fn add_dest(&mut self, req: RoomRequest, problem: Option<String>, required: usize) {
        if self.status == RoomStatus::Failed {
            // Noted so that it learns of the failure (`untold_failure`); a failed room's
            // destinations do not change.
            if !self.dests.contains_key(&req.agent) {
                self.late.insert(req.agent);
            }
            return;
        }
        if self.status.is_final() {
            return;
        }
        let problem = problem
            .or_else(|| self.total.and_then(|t| validate_len(&req, t)))
            .or_else(|| {
                // Every destination names the same prefix: the engine sends one suffix.
                self.dests
                    .values()
                    .find(|d| d.prefix_tokens != req.prefix_tokens)
                    .map(|d| {
                        format!(
                            "decode {} holds {} tokens of the prompt, decode {} {}",
                            d.agent, d.prefix_tokens, req.agent, req.prefix_tokens
                        )
                    })
            })
            .or_else(|| {
                // And the same pages per KV cache group: the engine sends one list.
                self.dests
                    .values()
                    .find(|d| {
                        !d.pages.is_empty()
                            && !req.pages.is_empty()
                            && d.group_pages != req.group_pages
                    })
                    .map(|d| {
                        format!(
                            "decode {} takes {:?} pages per KV cache group, decode {} {:?}",
                            d.agent, d.group_pages, req.agent, req.group_pages
                        )
                    })
            });
        self.dests.insert(req.agent.clone(), req);
        self.required = Some(required);
        match problem {
            Some(reason) => self.fail(reason),
            None if self.dests.len() >= required && self.total.is_some() => {
                self.status = self.status.update(RoomStatus::WaitingForInput);
            }
            None => {}
        }
    }

    /// Decode `agent` aborted the room: fails it if `agent` is one of its destinations and
    /// returns the WRITEs to release; `None` (nothing changes) for any other agent.
    pub fn abort_by(&mut self, agent: &str) -> Option<Vec<XferId>> {
        if !self.dests.contains_key(agent) {
            return None;
        }
        self.fail(format!("aborted by decode {agent}"));
        self.told.insert(agent.to_string());
        Some(std::mem::take(&mut self.xfers))
    }

    /// The decode agents still to be told that the room failed, each returned once; none
    /// unless it failed. Without this a decode would wait for data out to its
    /// `waiting_timeout`.
    pub fn untold_failure(&mut self) -> Vec<String> {
        if self.status != RoomStatus::Failed {
            return Vec::new();
        }
        let untold: Vec<String> = self
            .dests
            .keys()
            .chain(&self.late)
            .filter(|a| !self.told.contains(*a))
            .cloned()
            .collect();
        self.told.extend(untold.iter().cloned());
        untold
    }

    /// The destinations with pages for which `tell` holds (decodes that learn of a room's
    /// success from a message, not from the notes on its WRITEs), each returned once, once
    /// the room succeeded.
    pub fn untold_success(&mut self, tell: impl Fn(&str) -> bool) -> Vec<String> {
        if self.status != RoomStatus::Success {
            return Vec::new();
        }
        let untold: Vec<String> = self
            .dests
            .values()
            .filter(|d| !d.pages.is_empty() && !self.told.contains(&d.agent) && tell(&d.agent))
            .map(|d| d.agent.clone())
            .collect();
        self.told.extend(untold.iter().cloned());
        untold
    }

    /// Lays out the next chunk of `pages` pages of room `room`: refused unless the room
    /// waits for input or transfers, once its last chunk went out (its WRITEs may still be
    /// in flight: another "last" chunk would write aux and state again), or when more pages
    /// are given than are left.
    pub fn next_chunk(&self, room: u64, pages: usize) -> Result<Chunk, PushError> {
        self.next_layer_chunk(room, pages, true)
    }

    /// Like [`PrefillRoom::next_chunk`], for a chunk that carries some layers of `pages`:
    /// it completes them (and may complete the room) only if `completes`; otherwise the
    /// same pages come again in the next chunk, with other layers.
    pub fn next_layer_chunk(
        &self,
        room: u64,
        pages: usize,
        completes: bool,
    ) -> Result<Chunk, PushError> {
        if self.last_sent {
            return Err(PushError::AllSent(room));
        }
        if !matches!(
            self.status,
            RoomStatus::WaitingForInput | RoomStatus::Transferring
        ) {
            return Err(PushError::NotReady {
                room,
                status: self.status,
            });
        }
        let left = self.total.unwrap_or(0).saturating_sub(self.sent);
        if pages > left {
            return Err(PushError::TooManyPages {
                room,
                given: pages,
                left,
            });
        }
        Ok(Chunk {
            start: self.sent,
            id: self.chunk,
            pages,
            advance: if completes { pages } else { 0 },
            is_last: completes && pages == left,
            dests: self
                .dests
                .values()
                .filter(|d| !d.pages.is_empty())
                .cloned()
                .collect(),
            aux_index: self.aux_index,
            state_indices: self.state_indices.clone(),
        })
    }

    /// The WRITEs of `chunk` were `posted`; `failure` says why posting stopped early, which
    /// fails the room. Otherwise the chunk counts as sent.
    pub fn chunk_posted(&mut self, chunk: &Chunk, posted: Vec<XferId>, failure: Option<String>) {
        self.xfers.extend(posted);
        match failure {
            Some(e) => self.fail(e),
            None => {
                self.sent.tally(chunk.advance);
                self.chunk.tally(1);
                self.last_sent = chunk.is_last;
                self.status = self.status.update(RoomStatus::Transferring);
            }
        }
    }

    /// Fails the room if it is still bootstrapping `timeout` after it was created; true if
    /// it did. `id` names it in the failure.
    pub fn bootstrap_timed_out(&mut self, id: u64, now: Duration, timeout: Duration) -> bool {
        if self.status == RoomStatus::Bootstrapping && now.saturating_sub(self.created) > timeout {
            self.fail(format!("room {id} still bootstrapping after {timeout:?}"));
            return true;
        }
        false
    }

    /// Whether the room can be forgotten unasked: decodes asked for it but the engine never
    /// added it (it failed at its bootstrap timeout, or a decode's request was refused), and
    /// it ended over twice `timeout` ago, so an engine that was going to add it has.
    pub fn abandoned(&self, now: Duration, timeout: Duration) -> bool {
        self.total.is_none()
            && self.status.is_final()
            && now.saturating_sub(self.created) > timeout.saturating_mul(2)
    }

    /// The WRITEs in flight, for polling; hand back those still in flight with
    /// [`PrefillRoom::keep_xfers`].
    pub fn take_xfers(&mut self) -> Vec<XferId> {
        std::mem::take(&mut self.xfers)
    }

    /// WRITEs still in flight after a poll.
    pub fn keep_xfers(&mut self, still: Vec<XferId>) {
        self.xfers = still;
    }

    /// The room's WRITEs, when it is forgotten.
    pub fn into_xfers(self) -> Vec<XferId> {
        self.xfers
    }

    /// Succeeds once the last chunk was sent and every WRITE finished, or at once when every
    /// destination is a dummy (nothing to send).
    pub fn settle(&mut self) {
        if self.status != RoomStatus::Failed && self.last_sent && self.xfers.is_empty() {
            self.status = self.status.update(RoomStatus::Success);
        }
        if self.status == RoomStatus::WaitingForInput
            && self.dests.values().all(|d| d.pages.is_empty())
        {
            self.last_sent = true;
            self.status = RoomStatus::Success;
        }
    }
}

/// A destination with pages must take exactly the room's pages.
fn validate_len(d: &RoomRequest, total: usize) -> Option<String> {
    (!d.pages.is_empty() && d.pages.len() != total).then(|| {
        format!(
            "decode {} sent {} pages for a room of {total}",
            d.agent,
            d.pages.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest(agent: &str, pages: u32) -> RoomRequest {
        RoomRequest {
            room: 7,
            agent: agent.into(),
            pages: (0..pages).collect(),
            aux_index: None,
            state_indices: Vec::new(),
            digest: false,
            prefix_tokens: 0,
            group_pages: Vec::new(),
        }
    }

    /// A room of `total` pages the engine added, with `dests` (one required per agent).
    fn ready(total: usize, dests: &[(&str, u32)]) -> PrefillRoom {
        let mut r = PrefillRoom::new(Duration::ZERO);
        r.set_engine(total, None, Vec::new(), None);
        for &(a, n) in dests {
            r.add_dest(dest(a, n), None, dests.len());
        }
        r
    }

    /// Every destination learns of a failure once: those known when it failed, one that asks
    /// afterwards; not the decode that aborted it itself, and nobody while the room is fine.
    #[test]
    fn each_destination_is_told_of_a_failure_once() {
        let mut r = ready(4, &[("a", 4), ("b", 4)]);
        assert!(r.untold_failure().is_empty(), "not failed");
        r.fail("broken".into());
        let mut told = r.untold_failure();
        told.sort();
        assert_eq!(told, ["a", "b"]);
        assert!(r.untold_failure().is_empty(), "told twice");
        r.add_dest(dest("c", 4), None, 3);
        assert_eq!(r.untold_failure(), ["c"]);
        assert_eq!(r.status(), RoomStatus::Failed);
        let mut aborted = ready(4, &[("a", 4), ("b", 4)]);
        assert!(aborted.abort_by("a").is_some());
        assert_eq!(aborted.untold_failure(), ["b"]);
        let mut done = ready(1, &[("a", 1)]);
        done.status = RoomStatus::Success;
        done.add_dest(dest("z", 1), None, 1);
        assert!(done.untold_failure().is_empty());
        assert_eq!(
            done.dest_agents().count(),
            1,
            "a finished room takes no destination"
        );
    }

    /// A room needs a destination's connection while it is open, while it holds WRITEs,
    /// and until a failure was told to it (a late asker's too); never another agent's.
    #[test]
    fn a_room_needs_its_destinations_until_it_ended_released_and_told() {
        let mut r = ready(2, &[("a", 2)]);
        assert!(r.needs("a") && !r.needs("b"), "open");
        let c = r.next_chunk(7, 2).expect("chunk");
        r.chunk_posted(&c, vec![XferId(1)], None);
        r.settle();
        assert!(r.needs("a"), "writing");
        r.keep_xfers(Vec::new());
        r.settle();
        assert_eq!(r.status(), RoomStatus::Success);
        assert!(!r.needs("a"), "done");
        let mut f = ready(2, &[("a", 2)]);
        let c = f.next_chunk(7, 1).expect("chunk");
        f.chunk_posted(&c, vec![XferId(2)], None);
        f.fail("broken".into());
        f.add_dest(dest("late", 2), None, 1);
        assert_eq!(f.untold_failure().len(), 2);
        assert!(f.needs("a") && f.needs("late"), "its WRITEs still held");
        assert_eq!(f.take_xfers(), [XferId(2)]);
        assert!(!f.needs("a") && !f.needs("late"), "released and told");
        let mut untold = ready(2, &[("a", 2)]);
        untold.fail("broken".into());
        untold.add_dest(dest("late", 2), None, 1);
        assert!(untold.needs("a") && untold.needs("late"), "not told yet");
        assert!(!untold.needs("b"));
    }

    /// The pages per KV cache group are known once a destination with pages asked (a
    /// dummy one names none); destinations with pages that split them otherwise fail the
    /// room.
    #[test]
    fn destinations_must_agree_on_the_pages_per_group() {
        let with = |agent: &str, counts: Vec<u32>| RoomRequest {
            group_pages: counts,
            ..dest(agent, 2)
        };
        let mut r = ready(2, &[]);
        r.add_dest(dest("dummy", 0), None, 3);
        assert_eq!(
            r.decode_group_pages(),
            None,
            "a dummy destination names none"
        );
        r.add_dest(with("a", vec![1, 1]), None, 3);
        assert_eq!(r.decode_group_pages(), Some(&[1, 1][..]));
        r.add_dest(with("b", vec![1, 1]), None, 3);
        assert_eq!(r.status(), RoomStatus::WaitingForInput);
        let mut split = ready(2, &[]);
        split.add_dest(with("a", vec![1, 1]), None, 2);
        split.add_dest(with("b", vec![2, 0]), None, 2);
        assert_eq!(split.status(), RoomStatus::Failed);
        let e = split.error().unwrap_or_default();
        assert!(
            e.contains("[1, 1] pages per KV cache group") && e.contains("b [2, 0]"),
            "{e}"
        );
    }

    /// The decode's prefix is known once a destination asked; destinations that name
    /// different prefixes fail the room.
    #[test]
    fn destinations_must_agree_on_the_decode_prefix() {
        let mut r = ready(2, &[]);
        assert_eq!(r.decode_prefix(), None);
        let with = |agent: &str, prefix: u64| RoomRequest {
            prefix_tokens: prefix,
            ..dest(agent, 2)
        };
        r.add_dest(with("a", 16), None, 2);
        assert_eq!(r.decode_prefix(), Some(16));
        r.add_dest(with("b", 16), None, 2);
        assert_eq!(r.status(), RoomStatus::WaitingForInput);
        let mut split = ready(2, &[]);
        split.add_dest(with("a", 16), None, 2);
        split.add_dest(with("b", 32), None, 2);
        assert_eq!(split.status(), RoomStatus::Failed);
        let e = split.error().unwrap_or_default();
        assert!(e.contains("holds 16 tokens") && e.contains("b 32"), "{e}");
    }

    /// A destination's fold goes on across chunks; each destination has its own.
    #[test]
    fn each_destination_keeps_one_fold_across_chunks() {
        let mut r = ready(2, &[("a", 2), ("b", 2)]);
        r.fold_mut("a").add(&[1]);
        r.fold_mut("a").add(&[2]);
        let mut both = Fold::new();
        both.add(&[1, 2]);
        assert_eq!(r.fold_mut("a").value(), both.value());
        assert_eq!(r.fold_mut("b").value(), Fold::new().value());
    }

    #[test]
    fn a_room_waits_for_the_engine_and_every_destination() {
        let mut r = PrefillRoom::new(Duration::ZERO);
        assert!(!r.requested());
        assert!(!r.all_asked(), "nobody asked");
        r.add_dest(dest("a", 4), None, 2);
        assert!(r.requested(), "asked before the engine added it");
        assert!(!r.all_asked(), "one of two destinations asked");
        assert_eq!(r.dest_agents().collect::<Vec<_>>(), ["a"]);
        r.set_engine(4, None, Vec::new(), Some(2));
        assert!(!r.requested());
        assert_eq!(
            r.status(),
            RoomStatus::Bootstrapping,
            "one of two destinations"
        );
        r.add_dest(dest("b", 4), None, 2);
        assert_eq!(r.status(), RoomStatus::WaitingForInput);
        assert!(r.all_asked());
        r.fail("broken".into());
        assert!(!r.all_asked(), "a failed room is not ready");
        let mut early = PrefillRoom::new(Duration::ZERO);
        early.add_dest(dest("a", 4), None, 1);
        assert_eq!(
            early.status(),
            RoomStatus::Bootstrapping,
            "no engine side yet"
        );
        assert!(
            early.all_asked(),
            "its one destination asked before the engine added it"
        );
        early.set_engine(4, None, Vec::new(), Some(1));
        assert_eq!(early.status(), RoomStatus::WaitingForInput);
    }

    #[test]
    fn a_destination_with_the_wrong_page_count_or_a_problem_fails_the_room() {
        let r = ready(4, &[("a", 3)]);
        assert_eq!(r.status(), RoomStatus::Failed);
        assert_eq!(r.error(), Some("decode a sent 3 pages for a room of 4"));
        let mut r = PrefillRoom::new(Duration::ZERO);
        r.add_dest(dest("a", 3), None, 1);
        r.set_engine(4, None, Vec::new(), Some(1));
        assert_eq!(
            r.status(),
            RoomStatus::Failed,
            "checked when the engine adds it"
        );
        let mut r = PrefillRoom::new(Duration::ZERO);
        r.add_dest(dest("a", 0), Some("bad index".into()), 1);
        assert_eq!(
            (r.status(), r.error()),
            (RoomStatus::Failed, Some("bad index"))
        );
        r.add_dest(dest("b", 4), None, 1);
        assert_eq!(
            (r.status(), r.error()),
            (RoomStatus::Failed, Some("bad index")),
            "a failed room stays failed; a later destination is only told"
        );
        let r = ready(4, &[("a", 0), ("b", 4)]);
        assert_eq!(
            r.status(),
            RoomStatus::WaitingForInput,
            "a dummy has no page count"
        );
    }

    #[test]
    fn layer_chunks_advance_only_when_they_complete_their_pages() {
        let mut r = ready(3, &[("a", 3)]);
        for (pages, completes, start, id, is_last) in [
            (2, false, 0, 0, false),
            (2, true, 0, 1, false),
            (1, false, 2, 2, false),
            (1, true, 2, 3, true),
        ] {
            let c = r.next_layer_chunk(7, pages, completes).expect("chunk");
            assert_eq!(
                (c.start, c.id, c.pages, c.advance, c.is_last),
                (start, id, pages, if completes { pages } else { 0 }, is_last)
            );
            r.chunk_posted(&c, vec![], None);
        }
        assert!(matches!(
            r.next_layer_chunk(7, 0, false),
            Err(PushError::AllSent(7))
        ));
    }

    #[test]
    fn chunks_fill_the_room_and_the_last_one_is_marked() {
        let mut r = ready(5, &[("a", 5), ("dummy", 0)]);
        assert!(r.next_chunk(7, 6).is_err(), "past the pages");
        let c = r.next_chunk(7, 2).expect("first chunk");
        assert_eq!((c.start, c.id, c.pages, c.is_last), (0, 0, 2, false));
        assert_eq!(c.dests.len(), 1);
        assert_eq!(c.dests[0].agent, "a", "dummies get no data");
        r.chunk_posted(&c, vec![XferId(1)], None);
        assert_eq!(r.status(), RoomStatus::Transferring);
        assert_eq!(r.take_xfers(), [XferId(1)]);
        r.settle();
        assert_eq!(
            r.status(),
            RoomStatus::Transferring,
            "the last chunk is not sent"
        );
        assert!(matches!(
            r.next_chunk(7, 4),
            Err(PushError::TooManyPages {
                given: 4,
                left: 3,
                ..
            })
        ));
        let c = r.next_chunk(7, 3).expect("last chunk");
        assert_eq!((c.start, c.id, c.is_last), (2, 1, true));
        r.chunk_posted(&c, vec![XferId(2), XferId(3)], None);
        r.settle();
        assert_eq!(r.status(), RoomStatus::Transferring, "WRITEs in flight");
        assert!(
            matches!(r.next_chunk(7, 0), Err(PushError::AllSent(7))),
            "a chunk after the last one, while its WRITEs are in flight"
        );
        let mut x = r.take_xfers();
        assert_eq!(x, [XferId(2), XferId(3)]);
        x.remove(0);
        r.keep_xfers(x);
        r.settle();
        assert_eq!(r.status(), RoomStatus::Transferring, "one WRITE in flight");
        assert_eq!(r.take_xfers(), [XferId(3)]);
        r.settle();
        assert_eq!(r.status(), RoomStatus::Success);
        assert!(r.next_chunk(7, 0).is_err(), "a final room takes no chunk");
    }

    #[test]
    fn a_failed_post_fails_the_room_and_keeps_its_writes() {
        let mut r = ready(2, &[("a", 2)]);
        let c = r.next_chunk(7, 2).expect("chunk");
        r.chunk_posted(&c, vec![XferId(9)], Some("post failed".into()));
        r.settle();
        assert_eq!(
            (r.status(), r.error()),
            (RoomStatus::Failed, Some("post failed"))
        );
        assert_eq!(r.into_xfers(), [XferId(9)]);
    }

    #[test]
    fn only_a_destination_aborts_and_gets_the_writes_back() {
        let mut r = ready(2, &[("a", 2)]);
        let c = r.next_chunk(7, 1).expect("chunk");
        r.chunk_posted(&c, vec![XferId(3)], None);
        assert_eq!(r.abort_by("stranger"), None);
        assert_eq!(r.status(), RoomStatus::Transferring);
        assert_eq!(r.abort_by("a"), Some(vec![XferId(3)]));
        assert_eq!(
            (r.status(), r.error()),
            (RoomStatus::Failed, Some("aborted by decode a"))
        );
        assert!(r.into_xfers().is_empty());
    }

    #[test]
    fn a_room_of_dummies_succeeds_at_once_and_a_late_failure_overrides() {
        let mut r = ready(3, &[("a", 0)]);
        r.settle();
        assert_eq!(r.status(), RoomStatus::Success);
        r.fail("aborted by the prefill engine".into());
        assert_eq!(r.status(), RoomStatus::Failed);
        let mut r = PrefillRoom::new(Duration::ZERO);
        r.add_dest(dest("a", 0), None, 1);
        r.settle();
        assert_eq!(
            r.status(),
            RoomStatus::Bootstrapping,
            "not before the engine added it"
        );
    }

    #[test]
    fn bootstrapping_times_out_after_the_timeout_not_at_it() {
        let t = Duration::from_secs(30);
        let mut r = PrefillRoom::new(Duration::ZERO);
        assert!(!r.bootstrap_timed_out(7, t, t));
        assert_eq!(r.status(), RoomStatus::Bootstrapping);
        assert!(r.bootstrap_timed_out(7, t + Duration::from_nanos(1), t));
        assert_eq!(r.error(), Some("room 7 still bootstrapping after 30s"));
        let mut r = ready(1, &[("a", 1)]);
        assert!(
            !r.bootstrap_timed_out(7, t * 2, t),
            "a ready room does not time out"
        );
        assert_eq!(r.status(), RoomStatus::WaitingForInput);
    }
}
