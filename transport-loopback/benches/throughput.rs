//! Loopback host-memory throughput for a Llama-3-8B-shaped READ (32 layers × K/V, 128 random
//! blocks of 32 KiB per region = 8192 descriptors, 268 MB), against single-thread memcpy of
//! the same descriptors measured in the same run. Prints the ratio at the end.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
use kvxfer_transport_loopback::LoopbackTransport;

const REGIONS: usize = 64;
const BLOCKS: usize = 256;
const BLOCK_LEN: usize = 32 << 10;
const REQUEST_BLOCKS: usize = 128;

/// Sorted random choice of `n` of `limit` blocks (xorshift, fixed seed).
fn pick(n: usize, limit: usize, mut state: u64) -> Vec<usize> {
    let mut chosen = std::collections::BTreeSet::new();
    while chosen.len() < n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chosen.insert((state % limit as u64) as usize);
    }
    chosen.into_iter().collect()
}

fn main() {
    let bytes = REGIONS * BLOCKS * BLOCK_LEN;
    let mut src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    let (sb, db) = (
        pick(REQUEST_BLOCKS, BLOCKS, 11),
        pick(REQUEST_BLOCKS, BLOCKS, 13),
    );
    // (src offset, dst offset) of every descriptor, region-major like the reference.
    let pairs: Vec<(usize, usize)> = (0..REGIONS)
        .flat_map(|r| {
            sb.iter()
                .zip(&db)
                .map(move |(&s, &d)| ((r * BLOCKS + s) * BLOCK_LEN, (r * BLOCKS + d) * BLOCK_LEN))
        })
        .collect();
    let moved = (pairs.len() * BLOCK_LEN) as u64;

    let mut decode = LoopbackTransport::new("bench-decode").expect("agent");
    let mut prefill = LoopbackTransport::new("bench-prefill").expect("agent");
    let (src_addr, dst_addr) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
    let _src_reg = prefill
        .register(MemoryKind::Host, AddrRange::new(src_addr, bytes as u64))
        .expect("register src");
    let _dst_reg = decode
        .register(MemoryKind::Host, AddrRange::new(dst_addr, bytes as u64))
        .expect("register dst");
    let peer = decode
        .load_peer(&prefill.metadata().expect("meta"))
        .expect("load");
    let local: Vec<AddrRange> = pairs
        .iter()
        .map(|&(_, d)| AddrRange::new(dst_addr + d as u64, BLOCK_LEN as u64))
        .collect();
    let remote: Vec<AddrRange> = pairs
        .iter()
        .map(|&(s, _)| AddrRange::new(src_addr + s as u64, BLOCK_LEN as u64))
        .collect();
    let l = decode
        .prepare_local(MemoryKind::Host, &local)
        .expect("local list");
    let r = decode
        .prepare_remote(peer, MemoryKind::Host, &remote)
        .expect("remote list");
    let idx: Vec<u32> = (0..pairs.len() as u32).collect();

    let memcpy_time = RefCell::new((0u64, Duration::ZERO));
    let loop_time = RefCell::new((0u64, Duration::ZERO));
    let mut c = Criterion::default().configure_from_args().sample_size(10);
    let mut group = c.benchmark_group("loopback_llama8b_read");
    group.throughput(Throughput::Bytes(moved));
    group.bench_function("memcpy_single_thread", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for &(s, d) in &pairs {
                    dst[d..d + BLOCK_LEN].copy_from_slice(&src[s..s + BLOCK_LEN]);
                }
                std::hint::black_box(&dst);
            }
            let t = start.elapsed();
            let mut m = memcpy_time.borrow_mut();
            m.0 += iters;
            m.1 += t;
            t
        })
    });
    group.bench_function("loopback_transport", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let x = decode
                    .post_indexed(Op::Read, l, &idx, r, &idx, Some(b"req:1"))
                    .expect("post");
                while decode.status(x).expect("status") == XferStatus::InProgress {
                    std::hint::spin_loop();
                }
                decode.release(x).expect("release");
            }
            let t = start.elapsed();
            let mut m = loop_time.borrow_mut();
            m.0 += iters;
            m.1 += t;
            t
        })
    });
    group.finish();
    let per = |m: &RefCell<(u64, Duration)>| {
        let m = m.borrow();
        m.1.as_secs_f64() / m.0.max(1) as f64
    };
    let (tm, tl) = (per(&memcpy_time), per(&loop_time));
    println!(
        "loopback READ {} descriptors, {:.1} MB: memcpy {:.2} GB/s, loopback {:.2} GB/s, ratio {:.2}x (target >= 0.9x)",
        pairs.len(),
        moved as f64 / 1e6,
        moved as f64 / tm / 1e9,
        moved as f64 / tl / 1e9,
        tm / tl
    );
    assert_eq!(dst[db[0] * BLOCK_LEN], 7, "bytes arrived");
    c.final_summary();
}
