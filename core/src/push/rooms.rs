//! The room API both sides of a push transfer answer alike, so that an engine (and the
//! Python binding, which binds it once for both classes) drives a prefill rank and a decode
//! rank the same way.

use super::RoomStatus;

/// A push side's rooms, by room id.
pub trait Rooms {
    /// Which side this is, as messages name it: `prefill` or `decode`.
    const SIDE: &'static str;

    /// The room's status, or `None` for a room this rank has not heard of.
    fn status(&self, room: u64) -> Option<RoomStatus>;

    /// Why the room failed, once it did.
    fn error(&self, room: u64) -> Option<String>;

    /// Gives up on the room. A prefill rank fails it, releases its WRITEs and tells the
    /// decodes it alone writes into; a decode rank tells its prefill ranks, which acknowledge
    /// once they stopped writing into it.
    fn abort(&mut self, room: u64);

    /// Forgets the room (a live one is aborted first).
    fn remove_room(&mut self, room: u64);

    /// Processes what arrived (control messages, transfer completions, notifications),
    /// timeouts and liveness. Never blocks.
    fn poll(&mut self);
}

impl<T: crate::Transport> Rooms for super::PushPrefill<T> {
    const SIDE: &'static str = "prefill";

    fn status(&self, room: u64) -> Option<RoomStatus> {
        super::PushPrefill::status(self, room)
    }

    fn error(&self, room: u64) -> Option<String> {
        super::PushPrefill::error(self, room)
    }

    fn abort(&mut self, room: u64) {
        super::PushPrefill::abort(self, room)
    }

    fn remove_room(&mut self, room: u64) {
        super::PushPrefill::remove_room(self, room)
    }

    fn poll(&mut self) {
        super::PushPrefill::poll(self)
    }
}

impl<T: crate::Transport> Rooms for super::PushDecode<T> {
    const SIDE: &'static str = "decode";

    fn status(&self, room: u64) -> Option<RoomStatus> {
        super::PushDecode::status(self, room)
    }

    fn error(&self, room: u64) -> Option<String> {
        super::PushDecode::error(self, room)
    }

    fn abort(&mut self, room: u64) {
        super::PushDecode::abort(self, room)
    }

    fn remove_room(&mut self, room: u64) {
        super::PushDecode::remove_room(self, room)
    }

    fn poll(&mut self) {
        super::PushDecode::poll(self)
    }
}
