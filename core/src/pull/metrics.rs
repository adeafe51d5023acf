//! Counters of the pull connector, read as a snapshot and reset on read.

use std::time::Duration;

/// What the connector did since the last snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullMetrics {
    /// Transfers posted.
    pub transfers: u64,
    /// Bytes requested by those transfers.
    pub bytes: u64,
    /// Descriptors before coalescing.
    pub descriptors_raw: u64,
    /// Descriptors posted after coalescing.
    pub descriptors_posted: u64,
    /// Time spent planning and posting.
    pub post_time: Duration,
    /// Time from post to completion, summed over completed transfers.
    pub transfer_time: Duration,
    /// Handshakes that failed (timeout, bad reply, incompatible layout).
    pub failed_handshakes: u64,
    /// Loads that failed while being set up (planning or posting).
    pub failed_setups: u64,
    /// Transfers that ended `Failed`.
    pub failed_transfers: u64,
    /// Notifications that could not be sent.
    pub failed_notifications: u64,
    /// Held requests freed because their lease expired.
    pub expired_leases: u64,
    /// Handshake durations observed, summed, and their count.
    pub handshake_time: Duration,
    /// Handshakes completed.
    pub handshakes: u64,
}
