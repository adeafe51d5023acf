//! Planning benchmarks on realistic shapes (NOTES.md §5), compared with the Python peers
//! by `scripts/bench-layout.sh`:
//! - `desc_ids/llama8b`: pull-mode descriptor ids, 32 layers × K/V × 128 random blocks (8192 ids);
//! - `nhd_hetero_tp/*`: the push-mode 8 → 4 heads NHD plan, 2048 tokens, 32 layers
//!   (131,072 raw descriptors), coalesced and raw;
//! - `plan_scaling/*`: the same plan at 128 and 1280 blocks, to show linear cost.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvxfer_layout::*;

/// Deterministic sorted random choice of `n` distinct blocks out of `limit` (xorshift).
fn pick_blocks(n: usize, limit: u32, seed: u64) -> Vec<u32> {
    let mut state = seed | 1;
    let mut chosen = std::collections::BTreeSet::new();
    while chosen.len() < n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chosen.insert((state % u64::from(limit)) as u32);
    }
    chosen.into_iter().collect()
}

fn spec(order: BlockOrder, heads: u32, num_blocks: u32) -> CacheSpec {
    CacheSpec::new(CacheParams {
        kind: CacheKind::SplitKv,
        order,
        dtype: Dtype::Bf16,
        num_layers: 32,
        kv_heads: heads,
        head_dim: 128,
        tokens_per_block: 16,
        num_blocks,
    })
    .expect("valid spec")
}

/// Region bases 1 GiB apart, like the peer script's fake pointers.
fn bases(spec: &CacheSpec, start: u64) -> Vec<u64> {
    let step = spec.region_len().max(1 << 30);
    (0..u64::from(spec.num_regions()))
        .map(|r| start + r * step)
        .collect()
}

fn desc_ids(c: &mut Criterion) {
    let s = spec(BlockOrder::Hnd, 8, 256);
    let blocks = pick_blocks(128, 256, 7);
    c.bench_function("desc_ids/llama8b", |b| {
        b.iter(|| descriptor_ids(&s, black_box(&blocks), None).expect("ids"))
    });
}

fn nhd_hetero(c: &mut Criterion) {
    let (src, dst) = (
        spec(BlockOrder::Nhd, 8, 4096),
        spec(BlockOrder::Nhd, 4, 4096),
    );
    let (sb, db) = (bases(&src, 0x1000_0000), bases(&dst, 0x2000_0000));
    let ss = CacheSide::new(&src, &sb, 0).expect("src side");
    let ds = CacheSide::new(&dst, &db, 0).expect("dst side");
    let (pre, dstb) = (pick_blocks(128, 4096, 11), pick_blocks(128, 4096, 13));
    let pairs = BlockPairs {
        src: &pre,
        dst: &dstb,
        windows: None,
    };
    let slice = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 4,
    };
    let mut group = c.benchmark_group("nhd_hetero_tp");
    for coalesce in [true, false] {
        let name = if coalesce { "coalesced" } else { "raw" };
        let options = PlanOptions {
            coalesce,
            ..PlanOptions::default()
        };
        let plan = plan_transfer(&ss, &ds, slice, &pairs, options).expect("plan");
        eprintln!(
            "nhd_hetero_tp/{name}: raw descriptors {}, after coalescing {}, bytes {}",
            plan.raw_count,
            plan.descriptors().len(),
            plan.total_bytes
        );
        group.bench_function(name, |b| {
            b.iter(|| plan_transfer(&ss, &ds, slice, black_box(&pairs), options).expect("plan"))
        });
        let mut reused = TransferPlan::default();
        group.bench_function(format!("{name}_reused_buffer"), |b| {
            b.iter(|| {
                plan_transfer_into(&ss, &ds, slice, black_box(&pairs), options, &mut reused)
                    .expect("plan")
            })
        });
    }
    group.finish();
}

fn scaling(c: &mut Criterion) {
    let s = spec(BlockOrder::Hnd, 8, 65536);
    let (sb, db) = (bases(&s, 0x1000_0000), bases(&s, 0x80_0000_0000));
    let ss = CacheSide::new(&s, &sb, 0).expect("src side");
    let ds = CacheSide::new(&s, &db, 0).expect("dst side");
    let slice = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 8,
    };
    let mut group = c.benchmark_group("plan_scaling");
    for n in [128usize, 1280] {
        let (pre, dstb) = (pick_blocks(n, 65536, 3), pick_blocks(n, 65536, 5));
        let pairs = BlockPairs {
            src: &pre,
            dst: &dstb,
            windows: None,
        };
        group.bench_with_input(BenchmarkId::from_parameter(n), &pairs, |b, pairs| {
            b.iter(|| {
                plan_transfer(&ss, &ds, slice, black_box(pairs), PlanOptions::default())
                    .expect("plan")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, desc_ids, nhd_hetero, scaling);
criterion_main!(benches);
