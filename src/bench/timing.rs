//! The bench's clocks: the baselines measured in the same run (1-thread memcpy, and the
//! machine's copy ceiling), and the report's timing fields.

use std::time::{Duration, Instant};

use kvxfer_host_mem::copy::{self as host_copy, Method};

use super::blocks::xorshift;
use super::config::BenchConfig;
use super::report::BenchReport;

/// The pause between two polls of a wave's progress. A poller that only yields keeps a core
/// busy and takes it from the transport's copy workers: on a 2-core machine that cost the
/// loopback about a third of its copy rate. 50 µs (about 0.1 ms with timer slack) is well
/// under a request's latency.
pub(crate) const POLL_PAUSE: Duration = Duration::from_micros(50);

/// Single-thread memcpy of `bytes` bytes from `src` in pieces of `piece` bytes (wrapping
/// around the source and a 256 MiB destination): the baseline every ratio is taken against.
pub(crate) fn memcpy_baseline(src: &[u8], bytes: u64, piece: usize) -> Duration {
    let mut scratch = kvxfer_host_mem::mem::HostMem::new(src.len().min(256 << 20), 1);
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

/// One thread's xxh3-64 digest rate, in GB/s, over `bytes` bytes of `src` in pieces of
/// `piece` bytes (wrapping around the source): what digesting costs next to the copy.
pub(crate) fn digest_baseline(src: &[u8], bytes: u64, piece: usize) -> f64 {
    let piece = piece.min(src.len()).max(1);
    let t = Instant::now();
    let (mut done, mut at, mut acc) = (0u64, 0usize, 0u64);
    while done < bytes && !src.is_empty() {
        if at + piece > src.len() {
            at = 0;
        }
        acc ^= kvxfer_core::digest::of(&src[at..at + piece]);
        at += piece;
        done += piece as u64;
    }
    std::hint::black_box(acc);
    done as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
}

/// The machine's copy ceiling for pieces of `piece` bytes, in GB/s: `bytes` bytes (at most
/// 1 GiB a pass, best of five passes) as pieces at random piece-aligned places in `src`
/// copied to random places in a pre-touched 256 MiB destination, on all cores (each its own
/// part of the destination), copied the way the loopback copies a request of that size
/// (`bytes / requests`): with streaming stores where the CPU has them and the transfer is too
/// large for the caches.
pub(crate) fn ceiling_baseline(src: &[u8], bytes: u64, piece: usize, requests: u32) -> Ceiling {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The loopback chooses per transfer; a request is about one transfer per decode rank.
    let method = host_copy::method_for(bytes / u64::from(requests.max(1)));
    let mut ceiling = Ceiling {
        gb_per_s: 0.0,
        threads,
        streaming: method == Method::Streaming,
    };
    if src.is_empty() {
        return ceiling;
    }
    // 256 MiB, or room for 4 pieces per thread if that is more (never more than the source),
    // and at least a byte per thread, so every part holds a piece.
    let room = piece
        .saturating_mul(threads)
        .saturating_mul(4)
        .max(256 << 20);
    let scratch_len = src.len().min(room).max(threads);
    let Ok(mut scratch) = kvxfer_host_mem::mem::HostMem::try_new(scratch_len, 1) else {
        // Not enough memory left for the measurement: no figure, and the ratio shows 0.
        return ceiling;
    };
    let part_len = scratch.len() / threads;
    let piece = piece.min(src.len()).min(part_len).max(1);
    let per_thread = (bytes.min(1 << 30) / threads as u64).div_ceil(piece as u64) as usize;
    let (src_slots, dst_slots) = ((src.len() / piece) as u64, (part_len / piece) as u64);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let places: Vec<Vec<(usize, usize)>> = (0..threads)
        .map(|_| {
            (0..per_thread)
                .map(|_| {
                    let s = (xorshift(&mut state) % src_slots) as usize * piece;
                    let d = (xorshift(&mut state) % dst_slots) as usize * piece;
                    (s, d)
                })
                .collect()
        })
        .collect();
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|scope| {
            let parts = scratch.as_mut_slice().chunks_mut(part_len.max(1));
            for (part, places) in parts.zip(&places) {
                scope.spawn(move || {
                    for &(s, d) in places {
                        let (from, to) = (&src[s..s + piece], &mut part[d..d + piece]);
                        // SAFETY: two slices of `piece` bytes, one borrowed mutably.
                        unsafe { host_copy::copy(to.as_mut_ptr(), from.as_ptr(), piece, method) };
                    }
                    host_copy::fence(method);
                });
            }
        });
        best = best.min(t.elapsed());
    }
    std::hint::black_box(&scratch);
    let moved = (threads * per_thread * piece) as f64;
    ceiling.gb_per_s = moved / best.as_secs_f64().max(1e-9) / 1e9;
    ceiling
}

/// The copy ceiling measured in the run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ceiling {
    pub gb_per_s: f64,
    /// Threads it ran on (all cores).
    pub threads: usize,
    /// Whether it copied with streaming stores.
    pub streaming: bool,
}

/// The mean size of the descriptors the measured requests posted: the pieces the ceiling
/// copies. None when nothing was posted here (a prefill in another process posts).
pub(crate) fn mean_piece(moved: u64, posted: u64) -> Option<usize> {
    (posted > 0).then(|| (moved / posted).max(1) as usize)
}

/// Fills the timing fields of `report` from latencies and totals.
pub(crate) fn finish(
    report: &mut BenchReport,
    c: &BenchConfig,
    mut latencies: Vec<Duration>,
    moved: u64,
    measured: Duration,
    memcpy: Duration,
    ceiling: Ceiling,
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
    report.ceiling_gb_per_s = ceiling.gb_per_s;
    report.ceiling_threads = ceiling.threads;
    report.ceiling_streaming = ceiling.streaming;
    report.ratio_to_ceiling = report.gb_per_s / ceiling.gb_per_s.max(1e-9);
    report.describe(c);
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
