//! The bench's clocks: the memcpy baseline measured in the same run, and the report's
//! timing fields.

use std::time::{Duration, Instant};

use super::{BenchConfig, BenchReport};

/// Single-thread memcpy of `bytes` bytes from `src` in pieces of `piece` bytes (wrapping
/// around the source and a 256 MiB destination): the baseline every ratio is taken against.
pub(crate) fn memcpy_baseline(src: &[u8], bytes: u64, piece: usize) -> Duration {
    let mut scratch = kvxfer_core::host_mem::HostMem::new(src.len().min(256 << 20), 1);
    let t = Instant::now();
    let mut copied = 0u64;
    let (mut s_at, mut d_at) = (0usize, 0usize);
    while copied < bytes {
        let n = piece
            .min((bytes - copied) as usize)
            .min(src.len())
            .min(scratch.len());
        if s_at + n > src.len() {
            s_at = 0;
        }
        if d_at + n > scratch.len() {
            d_at = 0;
        }
        scratch[d_at..d_at + n].copy_from_slice(&src[s_at..s_at + n]);
        std::hint::black_box(&scratch);
        s_at += n;
        d_at += n;
        copied += n as u64;
    }
    t.elapsed()
}

/// Fills the timing fields of `report` from latencies and totals.
pub(crate) fn finish(
    report: &mut BenchReport,
    c: &BenchConfig,
    mut latencies: Vec<Duration>,
    moved: u64,
    measured: Duration,
    memcpy: Duration,
) {
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p) as usize)
            .copied()
            .unwrap_or_default()
    };
    report.bytes = moved;
    report.seconds = measured.as_secs_f64();
    report.gb_per_s = moved as f64 / measured.as_secs_f64().max(1e-9) / 1e9;
    report.requests_per_s = f64::from(report.requests) / measured.as_secs_f64().max(1e-9);
    report.latency_p50_ms = ms(pct(0.5));
    report.latency_p99_ms = ms(pct(0.99));
    report.memcpy_gb_per_s = moved as f64 / memcpy.as_secs_f64().max(1e-9) / 1e9;
    report.ratio_to_memcpy = memcpy.as_secs_f64() / measured.as_secs_f64().max(1e-9);
    report.describe(c);
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
