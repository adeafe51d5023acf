//! End-to-end pull over the loopback with a Llama-3-8B-shaped cache (32 layers × K/V, 8 KV
//! heads × 128 dims, bf16, 16-token blocks = 32 KiB blocks, 256 blocks per region), requests
//! of 128 fragmented blocks (2048 tokens, 268 MB). Reports handshake time, first-transfer
//! time, steady throughput, descriptors raw vs posted, and the ratio to single-thread memcpy
//! of the same blocks measured in the same run. Every byte is verified.
//!
//! `cargo bench -p kvxfer-tests --bench pull_llama8b [-- REQUESTS]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::MemoryKind;
use kvxfer_core::clock::SystemClock;
use kvxfer_core::connector::KvCache;
use kvxfer_core::pull::{PullConfig, PullScheduler, PullWorker};
use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, CacheSpec, Dtype};
use kvxfer_tests::memory::Rng;
use kvxfer_transport_loopback::LoopbackTransport;

const BLOCKS: u32 = 256;
const REQ_BLOCKS: usize = 128;

fn pick(rng: &mut Rng, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..BLOCKS).collect();
    for i in (1..all.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        all.swap(i, j);
    }
    let mut v = all[..n].to_vec();
    v.sort_unstable();
    v
}

fn main() {
    let requests: usize = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(12);
    let spec = CacheSpec::new(CacheParams {
        kind: CacheKind::SplitKv,
        order: BlockOrder::Hnd,
        dtype: Dtype::Bf16,
        num_layers: 32,
        kv_heads: 8,
        head_dim: 128,
        tokens_per_block: 16,
        num_blocks: BLOCKS,
    })
    .expect("spec");
    let total = spec.total_bytes() as usize;
    let mut rng = Rng::new(42);
    let mut src = vec![0u8; total];
    for chunk in src.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes()[..chunk.len()]);
    }
    // Touch every page up front, as an engine's preallocated cache is.
    let mut dst = vec![1u8; total];
    let mut scratch = vec![1u8; total];
    let (src_addr, dst_addr) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
    let bases = |start: u64| -> Vec<u64> {
        (0..u64::from(spec.num_regions()))
            .map(|r| start + r * spec.region_len())
            .collect()
    };
    let kv = |b: Vec<u64>| KvCache {
        spec,
        bases: b,
        memory: MemoryKind::Host,
        total_kv_heads: 8,
        total_layers: 32,
        first_layer: 0,
        layer_windows: None,
        groups: None,
    };
    let clock = Arc::new(SystemClock::default());
    let mut pcfg = PullConfig::new("bench-prefill", 0, 1);
    pcfg.side_channel_port = 0;
    let mut prefill = PullWorker::new(
        LoopbackTransport::new("bench-P").expect("agent"),
        pcfg,
        kv(bases(src_addr)),
        clock.clone(),
    )
    .expect("prefill");
    let port = prefill.listener_port().expect("port");
    let mut dcfg = PullConfig::new("bench-decode", 0, 1);
    dcfg.side_channel_port = 0;
    let mut decode = PullWorker::new(
        LoopbackTransport::new("bench-D").expect("agent"),
        dcfg,
        kv(bases(dst_addr)),
        clock,
    )
    .expect("decode");
    let mut psched = PullScheduler::new("bench-prefill", "127.0.0.1", port);
    let mut dsched = PullScheduler::new("bench-decode", "127.0.0.1", 0);

    let mut latencies = Vec::new();
    let mut memcpy_time = Duration::ZERO;
    let mut first_transfer = Duration::ZERO;
    let mut bytes = 0u64;
    let mut loop_time = Duration::ZERO;
    for i in 0..=requests {
        let (remote, local) = (pick(&mut rng, REQ_BLOCKS), pick(&mut rng, REQ_BLOCKS));
        let id = format!("req-{i}");
        let fin = psched.request_finished(
            &id,
            Some(&kvxfer_core::wire::params::KvTransferParams {
                do_remote_decode: true,
                ..Default::default()
            }),
            true,
            std::slice::from_ref(&remote),
            None,
        );
        prefill.start_load_kv(&psched.build_step_meta());
        let mut params = fin.params.expect("params");
        dsched
            .after_alloc(
                &id,
                &mut params,
                std::slice::from_ref(&local),
                REQ_BLOCKS * 16,
                None,
                None,
            )
            .expect("alloc");
        let meta = dsched.build_step_meta();
        let start = Instant::now();
        decode.start_load_kv(&meta);
        loop {
            let f = decode.get_finished();
            assert!(f.failed.is_empty(), "{:?}", f.failed);
            if f.recving.contains(&id) {
                break;
            }
            prefill.get_finished();
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "request {id} stuck"
            );
        }
        let took = start.elapsed();
        // Verify every byte of every block pair.
        for r in 0..spec.num_regions() as usize {
            for (&s, &d) in remote.iter().zip(&local) {
                let so = r * spec.region_len() as usize + s as usize * spec.block_len() as usize;
                let d_o = r * spec.region_len() as usize + d as usize * spec.block_len() as usize;
                let n = spec.block_len() as usize;
                assert!(
                    src[so..so + n] == dst[d_o..d_o + n],
                    "region {r} block {s}->{d} differs"
                );
            }
        }
        // The same blocks with single-thread memcpy.
        let t = Instant::now();
        for r in 0..spec.num_regions() as usize {
            for (&s, &d) in remote.iter().zip(&local) {
                let so = r * spec.region_len() as usize + s as usize * spec.block_len() as usize;
                let d_o = r * spec.region_len() as usize + d as usize * spec.block_len() as usize;
                let n = spec.block_len() as usize;
                scratch[d_o..d_o + n].copy_from_slice(&src[so..so + n]);
            }
        }
        std::hint::black_box(&scratch);
        if i == 0 {
            first_transfer = took;
            continue; // warm-up: handshake and first touch
        }
        memcpy_time += t.elapsed();
        latencies.push(took);
        loop_time += took;
        bytes += spec.block_len() * REQ_BLOCKS as u64 * u64::from(spec.num_regions());
    }
    let m = decode.take_metrics();
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize];
    println!(
        "pull llama-3-8b over loopback: {requests} requests of {REQ_BLOCKS} blocks ({:.1} MB each), every byte verified",
        spec.block_len() as f64 * REQ_BLOCKS as f64 * 64.0 / 1e6
    );
    println!("  handshake           {:?}", m.handshake_time);
    println!("  first request       {first_transfer:?} (handshake included)");
    println!(
        "  throughput          {:.2} GB/s  ({:.1} req/s)",
        bytes as f64 / loop_time.as_secs_f64() / 1e9,
        requests as f64 / loop_time.as_secs_f64()
    );
    println!("  latency p50 / p99   {:?} / {:?}", pct(0.5), pct(0.99));
    println!(
        "  descriptors         {} raw -> {} posted",
        m.descriptors_raw, m.descriptors_posted
    );
    println!(
        "  memcpy same blocks  {:.2} GB/s -> ratio {:.2}x",
        bytes as f64 / memcpy_time.as_secs_f64() / 1e9,
        memcpy_time.as_secs_f64() / loop_time.as_secs_f64()
    );
}
