//! What building a NIXL request costs us per Llama-3-8B-shaped request (64 regions × 128 of
//! 256 blocks of 32 KiB, 8192 block descriptors, 268 MB READ, two agents in one process),
//! three ways: a raw descriptor list per request (NIXL checks every descriptor against the
//! registrations), the same list with adjacent blocks merged, and indices into lists
//! prepared once (NIXL's `prepXferDlist` + `makeXferReq`, the fast path vLLM uses).
//!
//! "build" = our call's time minus the time NIXL reports for its own post (telemetry), so
//! it is the CPU cost of turning block ids into a posted request, without the data movement
//! NIXL's post may already do. Bytes are checked for every request.
//!
//! `eval "$(scripts/nixl-venv.sh)"; cargo bench -p kvxfer-tests --features nixl --bench nixl_post [-- REQUESTS]`

use std::time::{Duration, Instant};

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
use kvxfer_tests::memory::Rng;
use kvxfer_transport_nixl::{NixlTransport, runtime_available};

const REGIONS: u64 = 64;
const BLOCKS: u64 = 256;
const BLOCK: u64 = 32 << 10;
const REQ_BLOCKS: usize = 128;
const H: MemoryKind = MemoryKind::Host;

fn pick(rng: &mut Rng) -> Vec<u64> {
    let mut all: Vec<u64> = (0..BLOCKS).collect();
    for i in (1..all.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        all.swap(i, j);
    }
    let mut v = all[..REQ_BLOCKS].to_vec();
    // Sorted, as the peer script's requests are.
    v.sort_unstable();
    v
}

fn block(base: u64, region: u64, b: u64) -> AddrRange {
    AddrRange::new(base + (region * BLOCKS + b) * BLOCK, BLOCK)
}

/// Merges neighbours that are adjacent on both sides.
fn merged(local: &[AddrRange], remote: &[AddrRange]) -> (Vec<AddrRange>, Vec<AddrRange>) {
    let (mut l, mut r): (Vec<AddrRange>, Vec<AddrRange>) = (Vec::new(), Vec::new());
    for (a, b) in local.iter().zip(remote) {
        match (l.last_mut(), r.last_mut()) {
            (Some(x), Some(y)) if x.addr + x.len == a.addr && y.addr + y.len == b.addr => {
                x.len += a.len;
                y.len += b.len;
            }
            _ => {
                l.push(*a);
                r.push(*b);
            }
        }
    }
    (l, r)
}

struct Sample {
    call: Duration,
    library_post: Duration,
    total: Duration,
}

fn main() {
    if let Err(e) = runtime_available() {
        println!("SKIP nixl_post: {e}");
        return;
    }
    let requests: usize = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(8);
    let total = (REGIONS * BLOCKS * BLOCK) as usize;
    let mut rng = Rng::new(7);
    let mut src = vec![0u8; total];
    for chunk in src.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes()[..chunk.len()]);
    }
    let mut dst = vec![1u8; total];
    let (sbase, dbase) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
    let mut p = NixlTransport::new("post-bench-P").expect("agent");
    let mut d = NixlTransport::new("post-bench-D").expect("agent");
    let _rs = p
        .register(H, AddrRange::new(sbase, total as u64))
        .expect("reg");
    let _rd = d
        .register(H, AddrRange::new(dbase, total as u64))
        .expect("reg");
    let peer = d.load_peer(&p.metadata().expect("md")).expect("load");
    let all = |base| -> Vec<AddrRange> {
        (0..REGIONS)
            .flat_map(|r| (0..BLOCKS).map(move |b| block(base, r, b)))
            .collect()
    };
    let t = Instant::now();
    let local_list = d.prepare_local(H, &all(dbase)).expect("prep");
    let remote_list = d.prepare_remote(peer, H, &all(sbase)).expect("prep");
    println!(
        "prepared 2 x {} block descriptors once in {:.1} ms",
        REGIONS * BLOCKS,
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut results: Vec<(&str, Vec<Sample>)> =
        vec![("raw", vec![]), ("raw merged", vec![]), ("indexed", vec![])];
    for i in 0..requests + 1 {
        for (way, samples) in results.iter_mut() {
            let (lb, rb) = (pick(&mut rng), pick(&mut rng));
            let start = Instant::now();
            let x = match *way {
                "indexed" => {
                    let li: Vec<u32> = (0..REGIONS)
                        .flat_map(|r| lb.iter().map(move |&b| (r * BLOCKS + b) as u32))
                        .collect();
                    let ri: Vec<u32> = (0..REGIONS)
                        .flat_map(|r| rb.iter().map(move |&b| (r * BLOCKS + b) as u32))
                        .collect();
                    d.post_indexed(Op::Read, local_list, &li, remote_list, &ri, None)
                }
                _ => {
                    let l: Vec<AddrRange> = (0..REGIONS)
                        .flat_map(|r| lb.iter().map(move |&b| block(dbase, r, b)))
                        .collect();
                    let rr: Vec<AddrRange> = (0..REGIONS)
                        .flat_map(|r| rb.iter().map(move |&b| block(sbase, r, b)))
                        .collect();
                    let (l, rr) = if *way == "raw merged" {
                        merged(&l, &rr)
                    } else {
                        (l, rr)
                    };
                    d.post(Op::Read, peer, (H, H), &l, &rr, None)
                }
            }
            .expect("post");
            let call = start.elapsed();
            loop {
                match d.status(x).expect("status") {
                    XferStatus::InProgress => {
                        // The prefill agent progresses on NIXL's own thread (default on).
                        assert!(
                            start.elapsed() < Duration::from_secs(60),
                            "{way}: no completion in 60 s"
                        );
                        std::hint::spin_loop()
                    }
                    XferStatus::Done => break,
                    XferStatus::Failed(e) => panic!("{way}: {e}"),
                }
            }
            let total = start.elapsed();
            let library_post = d.telemetry(x).map_or(Duration::ZERO, |t| t.post);
            d.release(x).expect("release");
            for r in 0..REGIONS {
                for (&a, &b) in lb.iter().zip(&rb) {
                    let (l, s) = (block(0, r, a), block(0, r, b));
                    assert!(
                        dst[l.addr as usize..(l.addr + l.len) as usize]
                            == src[s.addr as usize..(s.addr + s.len) as usize],
                        "{way}: region {r} block {a} differs"
                    );
                }
            }
            if i > 0 {
                samples.push(Sample {
                    call,
                    library_post,
                    total,
                });
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mean = |v: &[Sample], f: fn(&Sample) -> Duration| -> f64 {
        v.iter().map(|s| ms(f(s))).sum::<f64>() / v.len().max(1) as f64
    };
    println!(
        "{requests} requests of {} descriptors, {} MB each:",
        REGIONS as usize * REQ_BLOCKS,
        REGIONS * REQ_BLOCKS as u64 * BLOCK / 1_000_000
    );
    for (way, v) in &results {
        let build = mean(v, |s| s.call.saturating_sub(s.library_post));
        let gbs = (REGIONS * REQ_BLOCKS as u64 * BLOCK) as f64 / (mean(v, |s| s.total) / 1e3) / 1e9;
        println!(
            "  {way:<11} build {build:.3} ms  post call {:.2} ms (NIXL's post {:.2} ms)  request {:.2} ms  {gbs:.2} GB/s",
            mean(v, |s| s.call),
            mean(v, |s| s.library_post),
            mean(v, |s| s.total)
        );
    }
}
