//! One room on the prefill side of the push connector, without I/O: the engine's side (how
//! many pages, aux and state indices), the decode destinations that asked for it, the
//! chunks sent so far and the WRITEs in flight, and the status they add up to.
//! [`super::PushPrefill`] validates what decodes send, posts the WRITEs and polls them; the
//! `push_prefill_room` fuzz target drives a room directly.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::time::Duration;

use super::messages::RoomRequest;
use super::prefill::PushError;
use super::status::RoomStatus;
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
    sent: usize,
    chunk: u32,
    xfers: Vec<XferId>,
    last_sent: bool,
    error: Option<String>,
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
            sent: 0,
            chunk: 0,
            xfers: Vec::new(),
            last_sent: false,
            error: None,
        }
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

    /// The agents of the decode destinations.
    pub fn dest_agents(&self) -> impl Iterator<Item = &str> {
        self.dests.keys().map(String::as_str)
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

    /// A decode destination asked for the room; `problem` is what validating it against the
    /// decode's registration found, `required` as in [`PrefillRoom::set_engine`]. A final
    /// room ignores it.
    pub fn add_dest(&mut self, req: RoomRequest, problem: Option<String>, required: usize) {
        if self.status.is_final() {
            return;
        }
        let problem = problem.or_else(|| self.total.and_then(|t| validate_len(&req, t)));
        self.dests.insert(req.agent.clone(), req);
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
        Some(std::mem::take(&mut self.xfers))
    }

    /// Lays out the next chunk of `pages` pages of room `room`: refused unless the room
    /// waits for input or transfers, or when more pages are given than are left.
    pub fn next_chunk(&self, room: u64, pages: usize) -> Result<Chunk, PushError> {
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
            is_last: pages == left,
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
                self.sent.tally(chunk.pages);
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
