//! Counters of the pull connector, read as a snapshot and reset on read.

use std::time::Duration;

use crate::connector::BackendTelemetry;

/// What the connector did since the last snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullMetrics {
    /// Transfers posted.
    pub transfers: u64,
    /// Of which: posted by index into per-block prepared lists.
    pub indexed_transfers: u64,
    /// Bytes requested by those transfers.
    pub bytes: u64,
    /// Descriptors before coalescing.
    pub descriptors_raw: u64,
    /// Descriptors posted after coalescing.
    pub descriptors_posted: u64,
    /// Time spent planning and posting (the transport's post call included).
    pub post_time: Duration,
    /// Of which: computing the coalesced plans and range lists.
    pub plan_time: Duration,
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
    /// Heartbeat notes sent to prefill ranks holding this decode's requests (at most one per
    /// rank and request each heartbeat interval).
    pub heartbeats: u64,
    /// Held requests freed because their lease expired.
    pub expired_leases: u64,
    /// Decode side: loads declined because a stock prefill frees their blocks too soon.
    pub expired_reads: u64,
    /// Decode side: loads whose stamped reference the prefill's stamp table confirmed after
    /// the blocks were read.
    pub verified_references: u64,
    /// Decode side: loads failed because the prefill's stamp table refuted their reference
    /// (consumed, expired, superseded, or computed for another prompt).
    pub stale_references: u64,
    /// Decode side: loads whose received bytes digested as the prefill published
    /// (`PullConfig::digest`).
    pub verified_digests: u64,
    /// Decode side: loads failed because a received block's digest differed from the one
    /// the prefill published: bytes other than the source's landed (or the source changed
    /// after it was digested).
    pub digest_mismatches: u64,
    /// Prefill side: time spent digesting held blocks.
    pub digest_time: Duration,
    /// Loads refused because one of the same request id was already in flight.
    pub refused_loads: u64,
    /// Cached connections to a prefill engine dropped after a failed transfer or a peer
    /// the transport saw fail (the next load for that engine handshakes again).
    pub lost_connections: u64,
    /// Handshakes that found a new instance under a known engine id and rank: a restart
    /// (seen across a lost connection; a connection closed as unneeded is forgotten whole).
    pub peer_restarts: u64,
    /// Connections to prefill engines no request needed closed: a rank the transport saw
    /// fail (a dead prefill, or one restarted under a new engine id), or unused for
    /// `PullConfig::idle_engine_timeout`. The next load for that engine handshakes again.
    pub closed_connections: u64,
    /// Prefill side: pull notes dropped because their sender never fetched this rank's
    /// metadata, already counted for the request, or named another reader count.
    pub refused_notes: u64,
    /// Handshake durations observed, summed, and their count.
    pub handshake_time: Duration,
    /// Handshakes completed.
    pub handshakes: u64,
    /// What the transport library measured itself (NIXL telemetry), summed over the
    /// completed transfers it reported on.
    pub backend: BackendTelemetry,
}

impl PullMetrics {
    /// Adds another rank's counters (for engine-wide stats across TP ranks).
    pub fn merge(&mut self, o: &PullMetrics) {
        self.transfers += o.transfers;
        self.indexed_transfers += o.indexed_transfers;
        self.bytes += o.bytes;
        self.descriptors_raw += o.descriptors_raw;
        self.descriptors_posted += o.descriptors_posted;
        self.post_time += o.post_time;
        self.plan_time += o.plan_time;
        self.transfer_time += o.transfer_time;
        self.failed_handshakes += o.failed_handshakes;
        self.failed_setups += o.failed_setups;
        self.failed_transfers += o.failed_transfers;
        self.failed_notifications += o.failed_notifications;
        self.heartbeats += o.heartbeats;
        self.expired_leases += o.expired_leases;
        self.expired_reads += o.expired_reads;
        self.verified_references += o.verified_references;
        self.stale_references += o.stale_references;
        self.verified_digests += o.verified_digests;
        self.digest_mismatches += o.digest_mismatches;
        self.digest_time += o.digest_time;
        self.refused_loads += o.refused_loads;
        self.lost_connections += o.lost_connections;
        self.peer_restarts += o.peer_restarts;
        self.closed_connections += o.closed_connections;
        self.refused_notes += o.refused_notes;
        self.handshake_time += o.handshake_time;
        self.handshakes += o.handshakes;
        self.backend.merge(&o.backend);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Every counter set to `n` (durations to `n` ms), so a merge of 2 and 3 shows a field
    /// that was skipped (2), subtracted (underflow) or multiplied (6) instead of added (5).
    fn all(n: u64) -> PullMetrics {
        PullMetrics {
            transfers: n,
            indexed_transfers: n,
            bytes: n,
            descriptors_raw: n,
            descriptors_posted: n,
            post_time: ms(n),
            plan_time: ms(n),
            transfer_time: ms(n),
            failed_handshakes: n,
            failed_setups: n,
            failed_transfers: n,
            failed_notifications: n,
            heartbeats: n,
            expired_leases: n,
            expired_reads: n,
            verified_references: n,
            stale_references: n,
            verified_digests: n,
            digest_mismatches: n,
            digest_time: ms(n),
            refused_loads: n,
            lost_connections: n,
            peer_restarts: n,
            closed_connections: n,
            refused_notes: n,
            handshake_time: ms(n),
            handshakes: n,
            backend: BackendTelemetry {
                transfers: n,
                post_time: ms(n),
                transfer_time: ms(n),
                bytes: n,
                descriptors: n,
            },
        }
    }

    #[test]
    fn merge_adds_every_counter() {
        let mut m = all(2);
        m.merge(&all(3));
        assert_eq!(m, all(5));
    }

    #[test]
    fn telemetry_add_counts_one_transfer_and_sums_the_rest() {
        let mut b = all(2).backend;
        b.add(&crate::XferTelemetry {
            post: ms(3),
            transfer: ms(3),
            bytes: 3,
            descriptors: 3,
        });
        let want = BackendTelemetry {
            transfers: 3,
            ..all(5).backend
        };
        assert_eq!(b, want);
    }
}
