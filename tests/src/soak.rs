//! The soak: many transfers of random shapes between two agents, each checked — every copied
//! range against its source checksum, the guard bytes on both sides of every range, and the
//! whole destination now and then — with resident memory sampled after warm-up and at the
//! end. Run long by `cargo bench -p kvxfer-tests --bench soak`, short in the test suite.

use std::time::{Duration, Instant};

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};

use crate::memory::{Buffer, Rng, fill_guard, guard_byte};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// Transfers in total.
    pub transfers: usize,
    /// Transfers before the resident-memory baseline is taken.
    pub warmup: usize,
    /// Most descriptors per transfer.
    pub max_descriptors: usize,
    /// Longest descriptor in bytes.
    pub max_len: u64,
    /// Size of each buffer.
    pub buffer: usize,
    /// Seed of every random choice.
    pub seed: u64,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            transfers: 100_000,
            warmup: 5_000,
            max_descriptors: 32,
            max_len: 16 << 10,
            buffer: 4 << 20,
            seed: 1,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    /// Transfers completed and checked.
    pub transfers: usize,
    /// Descriptors moved.
    pub descriptors: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Transfers with a wrong byte anywhere (copied range or guard).
    pub corrupt: usize,
    /// Transfers that did not end `Done`.
    pub failed: usize,
    /// Resident memory after warm-up and at the end, KiB.
    pub rss_kib: (u64, u64),
    /// Wall time.
    pub elapsed: Duration,
}

/// Resident set size of this process in KiB (0 where `/proc` is unavailable).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

struct Side {
    src: Buffer,
    dst: Buffer,
}

fn side<T: Transport>(t: &mut T, len: usize, seed: u64) -> Side {
    let mut src = Buffer::new(len, Some(seed));
    let mut dst = Buffer::new(len, None);
    src.registration = Some(t.register(MemoryKind::Host, src.range()).expect("register"));
    dst.registration = Some(t.register(MemoryKind::Host, dst.range()).expect("register"));
    Side { src, dst }
}

/// Runs the soak between `a` (initiator) and `b`.
pub fn run<T: Transport>(mut a: T, mut b: T, c: &SoakConfig) -> SoakReport {
    let mut sa = side(&mut a, c.buffer, c.seed);
    let mut sb = side(&mut b, c.buffer, c.seed + 1);
    let peer = a.load_peer(&b.metadata().expect("metadata")).expect("load");
    let _ = b.load_peer(&a.metadata().expect("metadata"));
    let mut rng = Rng::new(c.seed);
    // What an untouched destination holds, for the periodic whole-buffer check.
    let mut untouched = vec![0u8; c.buffer];
    fill_guard(&mut untouched, 0);
    let mut report = SoakReport::default();
    let start = Instant::now();
    let h = MemoryKind::Host;
    for i in 0..c.transfers {
        if i == c.warmup {
            report.rss_kib.0 = rss_kib();
        }
        let op = if rng.next_u64() % 2 == 0 {
            Op::Read
        } else {
            Op::Write
        };
        let n = rng.range(1, c.max_descriptors as u64) as usize;
        let slot = (c.buffer / n) as u64;
        // (source offset, destination offset, length), destinations in disjoint slots with
        // at least one guard byte on each side.
        let copies: Vec<(u64, u64, u64)> = (0..n as u64)
            .map(|k| {
                let len = rng.range(1, c.max_len.min(slot - 2));
                let dst = k * slot + rng.range(1, slot - len - 1);
                let src = rng.range(0, c.buffer as u64 - len);
                (src, dst, len)
            })
            .collect();
        let (from, to) = match op {
            Op::Read => (&sb.src, &mut sa.dst),
            Op::Write => (&sa.src, &mut sb.dst),
        };
        let sums: Vec<u64> = copies
            .iter()
            .map(|&(s, _, l)| from.checksum(s, l))
            .collect();
        let (local, remote): (Vec<AddrRange>, Vec<AddrRange>) = copies
            .iter()
            .map(|&(s, d, l)| match op {
                Op::Read => (
                    AddrRange::new(to.addr(d), l),
                    AddrRange::new(from.addr(s), l),
                ),
                Op::Write => (
                    AddrRange::new(from.addr(s), l),
                    AddrRange::new(to.addr(d), l),
                ),
            })
            .unzip();
        let x = a
            .post(op, peer, (h, h), &local, &remote, None)
            .expect("post");
        let status = loop {
            match a.status(x).expect("status") {
                XferStatus::InProgress => std::thread::yield_now(),
                s => break s,
            }
        };
        a.release(x).expect("release");
        if status != XferStatus::Done {
            report.failed += 1;
            continue;
        }
        let mut bad = false;
        for (&(_, d, l), &sum) in copies.iter().zip(&sums) {
            let (du, lu) = (d as usize, l as usize);
            bad |= to.checksum(d, l) != sum;
            bad |= to.bytes()[du - 1] != guard_byte(du - 1);
            bad |= to.bytes()[du + lu] != guard_byte(du + lu);
        }
        // Put the guard pattern back where the copies landed.
        let bytes = to.bytes_mut();
        for &(_, d, l) in &copies {
            let (du, lu) = (d as usize, l as usize);
            fill_guard(&mut bytes[du..du + lu], du);
        }
        if i % 1000 == 999 {
            bad |= *bytes != untouched[..];
        }
        report.corrupt += usize::from(bad);
        report.transfers += 1;
        report.descriptors += n as u64;
        report.bytes += copies.iter().map(|c| c.2).sum::<u64>();
    }
    report.rss_kib.1 = rss_kib();
    report.elapsed = start.elapsed();
    drop((sa, sb));
    report
}
