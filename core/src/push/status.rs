//! Per-room transfer status, ordered as the push reference orders it.

/// Status of a room. Updates keep the maximum, except `Failed`, which always wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RoomStatus {
    /// The room failed; final.
    Failed = 0,
    /// Waiting for the other side's setup (prefill layout, destination info).
    Bootstrapping = 1,
    /// Ready; waiting for the engine's data (prefill) or for the first chunk (decode).
    WaitingForInput = 2,
    /// Chunks are moving.
    Transferring = 3,
    /// Everything arrived.
    Success = 4,
}

impl RoomStatus {
    /// Merges an update into the current status.
    pub fn update(self, new: RoomStatus) -> RoomStatus {
        if self == RoomStatus::Failed || new == RoomStatus::Failed {
            RoomStatus::Failed
        } else {
            self.max(new)
        }
    }

    /// True for `Success` and `Failed`.
    pub fn is_final(self) -> bool {
        matches!(self, RoomStatus::Success | RoomStatus::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::RoomStatus::*;

    #[test]
    fn keeps_maximum_and_failed_wins() {
        assert_eq!(Bootstrapping.update(Transferring), Transferring);
        assert_eq!(Transferring.update(WaitingForInput), Transferring);
        assert_eq!(Success.update(Failed), Failed);
        assert_eq!(Failed.update(Success), Failed);
        assert_eq!((Failed as u8, Success as u8), (0, 4));
    }
}
