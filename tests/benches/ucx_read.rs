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
//! `cargo bench -p kvxfer-tests --features ucx --bench ucx_read [-- ROUNDS]`

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
use kvxfer_tests::memory::{Buffer, Rng};
use kvxfer_tests::remote::RemoteAgent;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

const AGENT: &str = env!("CARGO_BIN_EXE_kvxfer-test-agent");
const BLOCK: u64 = 32 << 10;
const BLOCKS: u64 = 8192;
const TOTAL: u64 = BLOCK * BLOCKS;
const H: MemoryKind = MemoryKind::Host;

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

/// Median bytes/s of `rounds` READs of the whole shape, after two warm-up rounds.
fn kvxfer_read(tls: &str, rounds: usize, perm: &[u64]) -> (f64, Duration) {
    let mut b = RemoteAgent::spawn(AGENT, &["ucx", tls], "bench-src").expect("helper");
    let mut a = UcxTransport::with_config(
        "bench-dst",
        UcxConfig {
            tls: Some(tls.into()),
            ..UcxConfig::default()
        },
    )
    .expect("UCX agent");
    let mut src = Buffer::new(TOTAL as usize, Some(1));
    let mut dst = Buffer::new(TOTAL as usize, None);
    src.registration = Some(b.register(H, src.range()).expect("register source"));
    dst.registration = Some(a.register(H, dst.range()).expect("register destination"));
    let peer = a.load_peer(&b.metadata().expect("metadata")).expect("load");
    let blocks = |buf: &Buffer| -> Vec<AddrRange> {
        (0..BLOCKS)
            .map(|i| AddrRange::new(buf.addr(i * BLOCK), BLOCK))
            .collect()
    };
    let local = a.prepare_local(H, &blocks(&dst)).expect("local list");
    let remote = a
        .prepare_remote(peer, H, &blocks(&src))
        .expect("remote list");
    let local_idx: Vec<u32> = (0..BLOCKS as u32).collect();
    let remote_idx: Vec<u32> = perm.iter().map(|&p| p as u32).collect();
    let mut times = Vec::new();
    let mut first = Duration::ZERO;
    for round in 0..rounds + 2 {
        let start = Instant::now();
        let x = a
            .post_indexed(Op::Read, local, &local_idx, remote, &remote_idx, None)
            .expect("post");
        loop {
            match a.status(x).expect("status") {
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
    for (i, &p) in perm.iter().enumerate() {
        let (d, s) = ((i as u64 * BLOCK) as usize, (p * BLOCK) as usize);
        assert!(
            dst.bytes()[d..d + BLOCK as usize] == src.bytes()[s..s + BLOCK as usize],
            "block {i} differs"
        );
    }
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

/// Median bytes/s of single-thread memcpy of the same blocks in the same order.
fn memcpy(rounds: usize, perm: &[u64]) -> f64 {
    let mut rng = Rng::new(3);
    let src: Vec<u8> = (0..TOTAL).map(|_| rng.next_u64() as u8).collect();
    let mut dst = vec![1u8; TOTAL as usize];
    let mut times = Vec::new();
    for _ in 0..rounds + 1 {
        let start = Instant::now();
        for (i, &p) in perm.iter().enumerate() {
            let (d, s) = ((i as u64 * BLOCK) as usize, (p * BLOCK) as usize);
            dst[d..d + BLOCK as usize].copy_from_slice(&src[s..s + BLOCK as usize]);
        }
        std::hint::black_box(&dst);
        times.push(TOTAL as f64 / start.elapsed().as_secs_f64());
    }
    median(&mut times[1..])
}

fn main() {
    let rounds: usize = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(8);
    let perm = permutation(42);
    let gb = |b: f64| b / 1e9;
    println!(
        "READ of {BLOCKS} x {} KiB = {:.0} MB across two processes, median of {rounds} rounds",
        BLOCK >> 10,
        TOTAL as f64 / 1e6
    );
    let copy = memcpy(rounds, &perm);
    for tls in ["sm,self", "tcp,self"] {
        let (ours, first) = kvxfer_read(tls, rounds, &perm);
        let whole = perftest(tls, TOTAL, rounds as u64, 2);
        let shaped = perftest(tls, BLOCK, BLOCKS * rounds as u64, BLOCKS);
        println!("UCX_TLS={tls}");
        println!(
            "  kvxfer READ (8192 descriptors)      {:>7.2} GB/s   first transfer {:.1} ms",
            gb(ours),
            first.as_secs_f64() * 1e3
        );
        match &whole {
            Ok(p) => println!(
                "  ucx_perftest ucp_get, 1 x {:.0} MB  {:>7.2} GB/s   kvxfer ratio {:.2}x",
                TOTAL as f64 / 1e6,
                gb(*p),
                ours / p
            ),
            Err(e) => println!("  ucx_perftest (same total bytes): {e}"),
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
    }
}
