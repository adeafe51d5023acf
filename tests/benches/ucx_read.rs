//! A Llama-3-8B-shaped READ over the UCX transport **across two processes** — 8192
//! descriptors of 32 KiB (32 layers × K/V × 128 fragmented 16-token bf16 blocks, 268 MB) —
//! against `ucx_perftest` `ucp_get` run back to back on the same machine with the same
//! `UCX_TLS`, and against single-thread memcpy of the same blocks. Every byte is verified.
//!
//! The source lives in a helper process (`kvxfer-test-agent`); this process reads it through
//! a prepared list and indexed posts, timing post → done. `ucx_perftest` is run twice: with
//! one message of the same total size (the bandwidth reference the ratio uses) and with the
//! same 8192 × 32 KiB message shape.
//!
//! Reading the ratios: `ucx_perftest` allocates its buffers through UCX, in shared-memory
//! segments the reader maps directly, and copies one 268 MB block. An engine's cache is its
//! own memory, which UCX can only reach one-sidedly through CMA (`process_vm_readv`), and a
//! fragmented request is 8192 separate 32 KiB copies; the memcpy line shows what such copies
//! cost on the machine. A source in kvxfer shared memory (`SharedHostMem`) is mapped by the
//! reader, and its READ is host copies on the reader's copy workers (the line "source in
//! shared memory"; polled with 50 µs pauses, where the UCX lines spin because UCX requests
//! only progress when polled). The references: the same blocks copied with non-temporal
//! stores by one thread, and by one thread per core (the machine's copy ceiling), measured
//! in this process.
//!
//! `cargo bench -p kvxfer-tests --features ucx --bench ucx_read [-- ROUNDS]`

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
use kvxfer_host_mem::copy::{self as host_copy, Method};
use kvxfer_host_mem::mem::HostMem;
use kvxfer_tests::memory::{Rng, fill};
use kvxfer_tests::remote::RemoteAgent;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

const AGENT: &str = env!("CARGO_BIN_EXE_kvxfer-test-agent");
const BLOCK: u64 = 32 << 10;
const BLOCKS: u64 = 8192;
const TOTAL: u64 = BLOCK * BLOCKS;
const H: MemoryKind = MemoryKind::Host;
/// Pause between polls of a transfer done by copy workers.
const POLL_PAUSE: Duration = Duration::from_micros(50);

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn permutation(seed: u64) -> Vec<u64> {
    let mut rng = Rng::new(seed);
    let mut p: Vec<u64> = (0..BLOCKS).collect();
    for i in (1..p.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        p.swap(i, j);
    }
    p
}

/// How the READ is cut into descriptors.
#[derive(Clone, Copy)]
enum Shape {
    /// 8192 blocks of 32 KiB, sources in a random order (a real fragmented request).
    Fragmented,
    /// The same 8192 blocks in order (adjacent, but still 8192 descriptors).
    InOrder,
    /// One descriptor of the whole 268 MB (what `ucx_perftest` moves).
    Whole,
}

/// Where the source process keeps its cache.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    /// Its own anonymous memory (an engine's cache): UCX reaches it through CMA.
    Private,
    /// kvxfer shared memory (`SharedHostMem`): the reader maps it and copies.
    Shared,
}

/// Median bytes/s of `rounds` READs of the whole shape, after two warm-up rounds.
fn kvxfer_read(tls: &str, rounds: usize, shape: Shape, source: Source) -> (f64, Duration) {
    let perm = match shape {
        Shape::Fragmented => permutation(42),
        Shape::InOrder | Shape::Whole => (0..BLOCKS).collect(),
    };
    let (count, len) = match shape {
        Shape::Whole => (1, TOTAL),
        _ => (BLOCKS, BLOCK),
    };
    let mut b = RemoteAgent::spawn(AGENT, &["ucx", tls], "bench-src").expect("helper");
    let mut a = UcxTransport::with_config(
        "bench-dst",
        UcxConfig {
            tls: Some(tls.into()),
            ..UcxConfig::default()
        },
    )
    .expect("UCX agent");
    // Engine-like memory on both sides: anonymous, huge pages advised.
    let src_addr = match source {
        Source::Private => b.alloc_filled(TOTAL, 1),
        Source::Shared => b.alloc_shared_filled(TOTAL, 1),
    }
    .expect("helper memory");
    let _src_reg = b
        .register(H, AddrRange::new(src_addr, TOTAL))
        .expect("register source");
    let mut expected = vec![0u8; TOTAL as usize];
    fill(&mut expected, Some(1));
    let dst = HostMem::new(TOTAL as usize, 1);
    let dst_reg = a
        .register(H, AddrRange::new(dst.addr(), TOTAL))
        .expect("register destination");
    let peer = a.load_peer(&b.metadata().expect("metadata")).expect("load");
    assert_eq!(
        a.maps_peer(peer),
        source == Source::Shared,
        "the path taken"
    );
    let blocks = |base: u64| -> Vec<AddrRange> {
        (0..count)
            .map(|i| AddrRange::new(base + i * len, len))
            .collect()
    };
    let local = a.prepare_local(H, &blocks(dst.addr())).expect("local list");
    let remote = a
        .prepare_remote(peer, H, &blocks(src_addr))
        .expect("remote list");
    let local_idx: Vec<u32> = (0..count as u32).collect();
    let remote_idx: Vec<u32> = perm[..count as usize].iter().map(|&p| p as u32).collect();
    let mut times = Vec::new();
    let mut first = Duration::ZERO;
    for round in 0..rounds + 2 {
        let start = Instant::now();
        let x = a
            .post_indexed(Op::Read, local, &local_idx, remote, &remote_idx, None)
            .expect("post");
        loop {
            match a.status(x).expect("status") {
                // UCX requests progress only when polled: spin. Copies run on their own
                // workers: pause between polls (as `kvxfer bench` does) instead of taking
                // one of the cores they copy on.
                XferStatus::InProgress if source == Source::Shared => {
                    std::thread::sleep(POLL_PAUSE)
                }
                XferStatus::InProgress => {}
                XferStatus::Done => break,
                XferStatus::Failed(e) => panic!("READ failed: {e}"),
            }
        }
        let t = start.elapsed();
        a.release(x).expect("release");
        if round == 0 {
            first = t;
        }
        if round >= 2 {
            times.push(TOTAL as f64 / t.as_secs_f64());
        }
    }
    for (i, &p) in perm.iter().enumerate().take((count * len / BLOCK) as usize) {
        let (d, s) = ((i as u64 * BLOCK) as usize, (p * BLOCK) as usize);
        assert!(
            dst.as_slice()[d..d + BLOCK as usize] == expected[s..s + BLOCK as usize],
            "block {i} differs"
        );
    }
    let copied = a.shared_memory_transfers();
    assert_eq!(
        copied > 0,
        source == Source::Shared,
        "{copied} mapped copies"
    );
    drop(dst_reg);
    (median(&mut times), first)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `ucx_perftest -t ucp_get` bandwidth in bytes/s (overall), or why it could not run.
fn perftest(tls: &str, size: u64, iters: u64, warmup: u64) -> Result<f64, String> {
    let port = free_port().to_string();
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .env("UCX_TLS", tls)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("ucx_perftest not runnable ({e}); install ucx-utils"))?;
    let mut last = String::new();
    let mut result = Err(String::new());
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(150));
        let out = Command::new("ucx_perftest")
            .args(["127.0.0.1", "-p", &port, "-t", "ucp_get"])
            .args(["-s", &size.to_string(), "-n", &iters.to_string()])
            .args(["-w", &warmup.to_string()])
            .env("UCX_TLS", tls)
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // "Final: iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall",
        // bandwidth in MB/s of 2^20 bytes.
        if let Some(line) = text.lines().find(|l| l.trim_start().starts_with("Final:")) {
            let nums: Vec<f64> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            result = nums
                .get(5)
                .map(|mbs| mbs * 1048576.0)
                .ok_or_else(|| format!("unreadable line {line:?}"));
            break;
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
    }
    let _ = server.kill();
    let _ = server.wait();
    result.map_err(|e| format!("ucx_perftest gave no result {e} {last}"))
}

/// How the reference copies move a block.
#[derive(Clone, Copy, PartialEq)]
enum Copier {
    /// `copy_from_slice` (glibc memcpy): regular stores for 32 KiB pieces.
    Memcpy,
    /// Non-temporal (streaming) stores, what memcpy itself uses for very large copies: the
    /// fastest single-thread way to scatter these blocks on x86.
    Streaming,
}

/// Copies `src` to `dst` (equal lengths) with the streaming stores the loopback uses where
/// the CPU has them (`kvxfer_host_mem::copy`).
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    let method = if host_copy::streaming_supported() {
        Method::Streaming
    } else {
        Method::Plain
    };
    // SAFETY: two distinct slices of equal length, one borrowed mutably.
    unsafe { host_copy::copy(dst.as_mut_ptr(), src.as_ptr(), dst.len(), method) };
}

/// Median bytes/s of single-thread copies of the same blocks in the same order (`perm`
/// None: the whole buffer as one copy).
fn memcpy(rounds: usize, perm: Option<&[u64]>, how: Copier) -> f64 {
    let mut src = HostMem::new(TOTAL as usize, 1);
    fill(src.as_mut_slice(), Some(3));
    let (src, mut dst) = (src, HostMem::new(TOTAL as usize, 1));
    let (src, dst) = (src.as_slice(), dst.as_mut_slice());
    let mut times = Vec::new();
    for _ in 0..rounds + 1 {
        let start = Instant::now();
        let copy = |d: &mut [u8], s: &[u8]| match how {
            Copier::Memcpy => d.copy_from_slice(s),
            Copier::Streaming => stream_copy(d, s),
        };
        match perm {
            Some(perm) => {
                for (i, &p) in perm.iter().enumerate() {
                    let (d, s) = ((i as u64 * BLOCK) as usize, (p * BLOCK) as usize);
                    copy(&mut dst[d..d + BLOCK as usize], &src[s..s + BLOCK as usize]);
                }
            }
            None => copy(dst, src),
        }
        host_copy::fence(Method::Streaming);
        std::hint::black_box(&dst);
        times.push(TOTAL as f64 / start.elapsed().as_secs_f64());
    }
    median(&mut times[1..])
}

/// Median bytes/s of streaming copies of the same blocks by one thread per core, each
/// taking an equal share of the blocks: the machine's copy ceiling for this shape.
fn ceiling(rounds: usize, perm: &[u64]) -> (f64, usize) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut src = HostMem::new(TOTAL as usize, 1);
    fill(src.as_mut_slice(), Some(3));
    let mut dst = HostMem::new(TOTAL as usize, 1);
    let src = src.as_slice();
    let share = perm.len().div_ceil(threads);
    let mut times = Vec::new();
    for _ in 0..rounds + 1 {
        let start = Instant::now();
        std::thread::scope(|scope| {
            let chunks = dst.as_mut_slice().chunks_mut(share * BLOCK as usize);
            for (dst, perm) in chunks.zip(perm.chunks(share)) {
                scope.spawn(move || {
                    for (i, &p) in perm.iter().enumerate() {
                        let (d, s) = ((i as u64 * BLOCK) as usize, (p * BLOCK) as usize);
                        stream_copy(&mut dst[d..d + BLOCK as usize], &src[s..s + BLOCK as usize]);
                    }
                    host_copy::fence(Method::Streaming);
                });
            }
        });
        std::hint::black_box(&dst);
        times.push(TOTAL as f64 / start.elapsed().as_secs_f64());
    }
    (median(&mut times[1..]), threads)
}

fn main() {
    let rounds: usize = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(8);
    let gb = |b: f64| b / 1e9;
    println!(
        "READ of {BLOCKS} x {} KiB = {:.0} MB across two processes, median of {rounds} rounds",
        BLOCK >> 10,
        TOTAL as f64 / 1e6
    );
    let perm = permutation(42);
    let copy = memcpy(rounds, Some(&perm), Copier::Memcpy);
    let streamed = memcpy(rounds, Some(&perm), Copier::Streaming);
    let one_copy = memcpy(rounds, None, Copier::Memcpy);
    let (ceiling, threads) = ceiling(rounds, &perm);
    println!(
        "in-process references: memcpy of the blocks {:.2} GB/s, streaming copy of the blocks {:.2} GB/s, one {:.0} MB memcpy {:.2} GB/s",
        gb(copy),
        gb(streamed),
        TOTAL as f64 / 1e6,
        gb(one_copy)
    );
    println!(
        "  ceiling for this shape: the streaming copy of the blocks is {:.2}x of one big memcpy; {threads} threads streaming the blocks {:.2} GB/s (the machine's copy ceiling)",
        streamed / one_copy,
        gb(ceiling)
    );
    for tls in ["sm,self", "tcp,self"] {
        let (ours, first) = kvxfer_read(tls, rounds, Shape::Fragmented, Source::Private);
        let (in_order, _) = kvxfer_read(tls, rounds, Shape::InOrder, Source::Private);
        let (one, _) = kvxfer_read(tls, rounds, Shape::Whole, Source::Private);
        let (mapped, mapped_first) = kvxfer_read(tls, rounds, Shape::Fragmented, Source::Shared);
        let whole = perftest(tls, TOTAL, rounds as u64, 2);
        let shaped = perftest(tls, BLOCK, BLOCKS * rounds as u64, BLOCKS);
        println!("UCX_TLS={tls}");
        println!(
            "  kvxfer READ, 8192 random blocks     {:>7.2} GB/s   first transfer {:.1} ms",
            gb(ours),
            first.as_secs_f64() * 1e3
        );
        println!(
            "  kvxfer READ, 8192 blocks in order   {:>7.2} GB/s",
            gb(in_order)
        );
        println!(
            "  kvxfer READ, 1 descriptor           {:>7.2} GB/s",
            gb(one)
        );
        println!(
            "  kvxfer READ, 8192 random blocks, source in shared memory {:>7.2} GB/s   first transfer {:.1} ms",
            gb(mapped),
            mapped_first.as_secs_f64() * 1e3
        );
        match &whole {
            Ok(p) => println!(
                "  ucx_perftest ucp_get, 1 x {:.0} MB  {:>7.2} GB/s   ratio: random {:.2}x, in order {:.2}x, 1 descriptor {:.2}x",
                TOTAL as f64 / 1e6,
                gb(*p),
                ours / p,
                in_order / p,
                one / p
            ),
            Err(e) => println!("  ucx_perftest (same total bytes): {e}"),
        }
        if let Ok(p) = &whole {
            println!(
                "  shared memory: random blocks {:.2}x ucx_perftest 1 x {:.0} MB, {:.2}x the copy ceiling",
                mapped / p,
                TOTAL as f64 / 1e6,
                mapped / ceiling
            );
        }
        match &shaped {
            Ok(p) => println!(
                "  ucx_perftest ucp_get, 8192 x 32 KiB {:>7.2} GB/s   kvxfer ratio {:.2}x",
                gb(*p),
                ours / p
            ),
            Err(e) => println!("  ucx_perftest (same shape): {e}"),
        }
        println!(
            "  memcpy, 1 thread, same blocks      {:>7.2} GB/s   kvxfer ratio {:.2}x",
            gb(copy),
            ours / copy
        );
        println!(
            "  streaming copy, same blocks        {:>7.2} GB/s   kvxfer ratio {:.2}x",
            gb(streamed),
            ours / streamed
        );
        if let (Ok(p), true) = (&whole, tls.starts_with("sm")) {
            println!(
                "  streaming copy vs ucx_perftest 1 x {:.0} MB: {:.2}x (the most any copy of these blocks reaches)",
                TOTAL as f64 / 1e6,
                streamed / p
            );
        }
    }
}
