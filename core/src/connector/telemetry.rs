//! What the transport library measured itself, summed the same way by both connectors.

use std::time::Duration;

/// Sums of the transport library's own per-transfer measurements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendTelemetry {
    /// Transfers the library reported on.
    pub transfers: u64,
    /// Time inside the library's post calls.
    pub post_time: Duration,
    /// Post-to-completion time as the library saw it.
    pub transfer_time: Duration,
    /// Bytes the library moved.
    pub bytes: u64,
    /// Descriptors the library posted.
    pub descriptors: u64,
}

impl BackendTelemetry {
    /// Adds one transfer's measurements.
    pub fn add(&mut self, t: &crate::XferTelemetry) {
        self.transfers += 1;
        self.post_time += t.post;
        self.transfer_time += t.transfer;
        self.bytes += t.bytes;
        self.descriptors += t.descriptors;
    }

    /// Adds another sum.
    pub fn merge(&mut self, o: &BackendTelemetry) {
        self.transfers += o.transfers;
        self.post_time += o.post_time;
        self.transfer_time += o.transfer_time;
        self.bytes += o.bytes;
        self.descriptors += o.descriptors;
    }
}
