//! The bench's results: a readable table and a JSON form.

use std::fmt::Write;

use serde::Serialize;

use super::config::{BenchConfig, Mode};

/// Results of one bench run (JSON keys are the field names).
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchReport {
    /// The prefill ran in another process (push with `--connect`): its descriptor and
    /// planning counters are not seen here.
    pub prefill_elsewhere: bool,
    /// Model preset.
    pub model: String,
    /// `P:D`.
    pub tp: String,
    /// Transport.
    pub transport: String,
    /// `pull` or `push`.
    pub mode: String,
    /// Tokens per request.
    pub tokens_per_request: u32,
    /// Measured requests.
    pub requests: u32,
    /// Bytes moved by them.
    pub bytes: u64,
    /// Seconds they took (waves, verification excluded).
    pub seconds: f64,
    /// Throughput.
    pub gb_per_s: f64,
    /// Requests per second.
    pub requests_per_s: f64,
    /// Median request latency.
    pub latency_p50_ms: f64,
    /// 99th percentile request latency.
    pub latency_p99_ms: f64,
    /// Descriptors before coalescing.
    pub descriptors_raw: u64,
    /// Descriptors posted.
    pub descriptors_posted: u64,
    /// Time per request to plan and post its transfers (the transport's post call included,
    /// which may already move data).
    pub post_ms_per_request: f64,
    /// Of which: computing the coalesced plans and range lists.
    pub plan_ms_per_request: f64,
    /// Mean handshake time.
    pub handshake_ms: f64,
    /// Latency of the first request (handshake included).
    pub first_transfer_ms: f64,
    /// Single-thread memcpy of the same bytes.
    pub memcpy_gb_per_s: f64,
    /// Throughput divided by memcpy's.
    pub ratio_to_memcpy: f64,
    /// The machine's copy ceiling for the same piece size: all cores, streaming stores
    /// where the transfer is too large for the caches.
    pub ceiling_gb_per_s: f64,
    /// Threads the ceiling ran on (all cores).
    pub ceiling_threads: usize,
    /// Whether the ceiling copied with streaming stores (plain copies otherwise).
    pub ceiling_streaming: bool,
    /// Throughput divided by the ceiling.
    pub ratio_to_ceiling: f64,
    /// Bytes compared against the prefill's contents.
    pub verified_bytes: u64,
    /// Transfers the transport library measured itself (NIXL telemetry; 0 elsewhere).
    pub library_reports: u64,
    /// Per request: time inside the library's post calls, as the library measured it.
    pub library_post_ms_per_request: f64,
    /// Per transfer: post to completion, as the library measured it.
    pub library_transfer_ms_mean: f64,
    /// Requests that failed (`--keep-going`; warm-up included), not in `requests`.
    pub failed_requests: u32,
    /// Connections to the prefill dropped after a failure (warm-up included).
    pub lost_connections: u64,
    /// Handshakes that found the prefill restarted (warm-up included).
    pub peer_restarts: u64,
    /// `--digest`: content digests were on.
    pub digest: bool,
    /// `--digest`: one thread's xxh3-64 rate over the same bytes, in the same pieces.
    pub digest_gb_per_s: f64,
    /// `--digest`: per request, the prefill's time digesting its blocks when the hold
    /// started (outside the measured waves, as an engine digests after its forward pass).
    pub prefill_digest_ms_per_request: f64,
    /// `--digest`: throughput of the same bench with digests off, run first.
    pub digest_off_gb_per_s: f64,
    /// `--digest`: throughput with digests on divided by that without.
    pub digest_on_to_off: f64,
}

impl BenchReport {
    /// Takes the library's own measurements of the measured requests.
    pub(super) fn library(&mut self, t: &kvxfer_core::connector::BackendTelemetry) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        self.library_reports = t.transfers;
        self.library_post_ms_per_request = ms(t.post_time) / f64::from(self.requests.max(1));
        self.library_transfer_ms_mean = ms(t.transfer_time) / t.transfers.max(1) as f64;
    }

    pub(super) fn describe(&mut self, c: &BenchConfig) {
        self.model = c.model.name.to_string();
        self.tp = if c.prefill_pp > 1 {
            format!(
                "{}:{}, prefill PP {}",
                c.prefill_tp, c.decode_tp, c.prefill_pp
            )
        } else {
            format!("{}:{}", c.prefill_tp, c.decode_tp)
        };
        self.transport = c.transport.to_string();
        self.mode = match c.mode {
            Mode::Pull => "pull".into(),
            Mode::Push => "push".into(),
        };
        self.tokens_per_request = c.tokens_per_request;
    }

    /// The table printed by `kvxfer bench`.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mut rows: Vec<(&str, String)> = vec![
            (
                "model",
                format!(
                    "{} (TP {}), {} mode over {}",
                    self.model, self.tp, self.mode, self.transport
                ),
            ),
            (
                "requests",
                format!("{} x {} tokens", self.requests, self.tokens_per_request),
            ),
            ("throughput", format!("{:.2} GB/s", self.gb_per_s)),
            ("requests/s", format!("{:.1}", self.requests_per_s)),
            (
                "latency p50 / p99",
                format!(
                    "{:.2} ms / {:.2} ms",
                    self.latency_p50_ms, self.latency_p99_ms
                ),
            ),
            (
                "descriptors raw -> posted",
                if self.prefill_elsewhere {
                    "counted by the prefill process".into()
                } else {
                    format!("{} -> {}", self.descriptors_raw, self.descriptors_posted)
                },
            ),
            (
                "plan / plan + post per request",
                if self.prefill_elsewhere {
                    "counted by the prefill process".into()
                } else {
                    format!(
                        "{:.3} ms / {:.3} ms",
                        self.plan_ms_per_request, self.post_ms_per_request
                    )
                },
            ),
            ("handshake", format!("{:.2} ms", self.handshake_ms)),
            (
                "first transfer",
                format!("{:.2} ms (handshake included)", self.first_transfer_ms),
            ),
            (
                "memcpy, same bytes",
                format!("{:.2} GB/s (1 thread)", self.memcpy_gb_per_s),
            ),
            (
                "copy ceiling, same pieces",
                format!(
                    "{:.2} GB/s ({} threads, {})",
                    self.ceiling_gb_per_s,
                    self.ceiling_threads,
                    if self.ceiling_streaming {
                        "streaming stores"
                    } else {
                        "plain copies"
                    }
                ),
            ),
            (
                "ratio to memcpy / ceiling",
                format!(
                    "{:.2}x / {:.2}x",
                    self.ratio_to_memcpy, self.ratio_to_ceiling
                ),
            ),
            (
                "verified",
                format!("{} bytes, all correct", self.verified_bytes),
            ),
        ];
        if self.library_reports > 0 {
            rows.insert(
                rows.len() - 4,
                (
                    "library post / transfer",
                    format!(
                        "{:.3} ms per request / {:.2} ms per transfer ({} telemetry reports)",
                        self.library_post_ms_per_request,
                        self.library_transfer_ms_mean,
                        self.library_reports
                    ),
                ),
            );
        }
        if self.failed_requests > 0 || self.lost_connections > 0 || self.peer_restarts > 0 {
            rows.push((
                "failed / reconnected",
                format!(
                    "{} requests failed; {} connections lost, {} prefill restarts found",
                    self.failed_requests, self.lost_connections, self.peer_restarts
                ),
            ));
        }
        if self.digest {
            rows.push((
                "digests on / off",
                format!(
                    "{:.2} GB/s / {:.2} GB/s ({:.2}x); xxh3-64 {:.2} GB/s (1 thread, {:.2}x memcpy); prefill {:.3} ms per request",
                    self.gb_per_s,
                    self.digest_off_gb_per_s,
                    self.digest_on_to_off,
                    self.digest_gb_per_s,
                    self.digest_gb_per_s / self.memcpy_gb_per_s.max(1e-9),
                    self.prefill_digest_ms_per_request
                ),
            ));
        }
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in rows {
            let _ = writeln!(s, "  {k:<width$}  {v}");
        }
        s
    }
}
