//! Table-driven plan cases: the head-slice examples of the reference connectors.

mod common;
use common::*;
use kvxfer_layout::*;

fn plan(
    src: &CacheSide<'_>,
    dst: &CacheSide<'_>,
    slice: HeadSlice,
    sb: &[u32],
    db: &[u32],
    coalesce: bool,
) -> TransferPlan {
    let pairs = BlockPairs {
        src: sb,
        dst: db,
        windows: None,
    };
    let options = PlanOptions {
        coalesce,
        ..PlanOptions::default()
    };
    plan_transfer(src, dst, slice, &pairs, options).unwrap()
}

#[test]
fn hnd_decode_tp_multiple_reads_contiguous_slice_per_block() {
    // Prefill TP 1 with 8 heads, decode TP 4 with 2 heads: rank r reads slice r of each block.
    let p = spec(CacheKind::SplitKv, BlockOrder::Hnd, 2, 8, 4, 4, 8);
    let d = spec(CacheKind::SplitKv, BlockOrder::Hnd, 2, 2, 4, 4, 8);
    let (pb, db) = (bases(&p, 0x1000_0000, 4096), bases(&d, 0x9000_0000, 4096));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let m = TpMapping::new(1, 4, HeadSharding::Split { total_kv_heads: 8 }).unwrap();
    for r in 0..4 {
        let link = m.links_for_decode(r).unwrap()[0];
        let out = plan(&ps, &ds, slice_of(&link), &[5, 1], &[2, 6], false);
        assert_eq!(out.raw_count, 2 * 2 * 2);
        let local_block_len = d.block_len();
        assert_eq!(local_block_len, p.block_len() / 4);
        let first = out.descriptors()[0];
        assert_eq!(
            first.src,
            pb[0] + 5 * p.block_len() + u64::from(r) * local_block_len
        );
        assert_eq!(first.dst, db[0] + 2 * d.block_len());
        assert_eq!(first.len, local_block_len);
    }
}

#[test]
fn nhd_prefill_tp_smaller_slices_each_token() {
    // The push reference's case: 8 heads per prefill rank, 4 per decode rank (p=1, d=2).
    let p = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 8, 2, 4, 4);
    let d = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 4, 2, 4, 4);
    let (pb, db) = (bases(&p, 0, 0), bases(&d, 1 << 20, 0));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let m = TpMapping::new(1, 2, HeadSharding::Split { total_kv_heads: 8 }).unwrap();
    let hb = p.head_token_bytes();
    let link = m.links_for_decode(1).unwrap()[0];
    assert_eq!(
        slice_of(&link),
        HeadSlice {
            src_first: 4,
            dst_first: 0,
            count: 4
        }
    );
    let out = plan(&ps, &ds, slice_of(&link), &[3], &[0], true);
    // One descriptor per (K/V, token): sources are strided, so nothing merges.
    assert_eq!(out.raw_count, 2 * 4);
    assert_eq!(out.descriptors().len(), 8);
    let k = &out.descriptors()[..4];
    for (t, desc) in k.iter().enumerate() {
        let t = t as u64;
        assert_eq!(desc.src, pb[0] + 3 * p.block_len() + t * 8 * hb + 4 * hb);
        assert_eq!(desc.dst, db[0] + t * 4 * hb);
        assert_eq!(desc.len, 4 * hb);
    }
}

#[test]
fn nhd_prefill_tp_larger_writes_at_rank_offset() {
    // p=2 (2 heads each) into d=1 (4 heads): prefill rank 1 lands at head offset 2.
    let p = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 2, 2, 2, 4);
    let d = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 4, 2, 2, 4);
    let m = TpMapping::new(2, 1, HeadSharding::Split { total_kv_heads: 4 }).unwrap();
    let links = m.links_for_decode(0).unwrap();
    assert_eq!(links.len(), 2);
    assert_eq!(
        slice_of(&links[1]),
        HeadSlice {
            src_first: 0,
            dst_first: 2,
            count: 2
        }
    );
    let (pb, db) = (bases(&p, 0, 0), bases(&d, 1 << 20, 0));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let out = plan(&ps, &ds, slice_of(&links[1]), &[0, 1], &[1, 2], true);
    let hb = p.head_token_bytes();
    // Source tokens are contiguous (all local heads) but destinations are strided.
    assert_eq!(out.descriptors().len(), 2 * 2 * 2);
    assert_eq!(out.descriptors()[0].dst, db[0] + d.block_len() + 2 * hb);
    assert_eq!(
        out.descriptors()[1].dst,
        db[0] + d.block_len() + 4 * hb + 2 * hb
    );
}

#[test]
fn fresh_request_coalesces_to_one_descriptor_per_region() {
    // Consecutive blocks on both sides, equal TP: one descriptor per region, as NOTES §3 says.
    let s = spec(CacheKind::SplitKv, BlockOrder::Hnd, 4, 8, 16, 16, 64);
    let (pb, db) = (bases(&s, 0, 4096), bases(&s, 1 << 32, 4096));
    let (ps, ds) = (
        CacheSide::new(&s, &pb, 0).unwrap(),
        CacheSide::new(&s, &db, 0).unwrap(),
    );
    let blocks: Vec<u32> = (10..42).collect();
    let full = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 8,
    };
    let out = plan(&ps, &ds, full, &blocks, &blocks, true);
    assert_eq!(out.raw_count, 8 * 32);
    assert_eq!(out.descriptors().len(), 8);
    assert_eq!(out.total_bytes, 8 * 32 * s.block_len());
    // Without gaps between regions the whole request is one descriptor per... region run:
    // blocks 10..42 of adjacent regions are not contiguous, so still 8.
    let (pb0, db0) = (bases(&s, 0, 0), bases(&s, 1 << 32, 0));
    let (ps0, ds0) = (
        CacheSide::new(&s, &pb0, 0).unwrap(),
        CacheSide::new(&s, &db0, 0).unwrap(),
    );
    let all: Vec<u32> = (0..64).collect();
    let whole = plan(&ps0, &ds0, full, &all, &all, true);
    assert_eq!(
        whole.descriptors().len(),
        1,
        "whole contiguous cache is one descriptor"
    );
}

#[test]
fn joint_and_mla_layouts() {
    let j = spec(CacheKind::JointKv, BlockOrder::Hnd, 2, 4, 8, 4, 8);
    let jd = spec(CacheKind::JointKv, BlockOrder::Hnd, 2, 2, 8, 4, 8);
    let (pb, db) = (bases(&j, 0, 64), bases(&jd, 1 << 20, 64));
    let (ps, ds) = (
        CacheSide::new(&j, &pb, 0).unwrap(),
        CacheSide::new(&jd, &db, 0).unwrap(),
    );
    let slice = HeadSlice {
        src_first: 2,
        dst_first: 0,
        count: 2,
    };
    let out = plan(&ps, &ds, slice, &[1], &[3], true);
    // K half and V half of the joint block: two pieces, K then V.
    assert_eq!(out.descriptors().len(), 4);
    let half = j.part_block_len();
    assert_eq!(out.descriptors()[1].src - out.descriptors()[0].src, half);

    let mla = CacheSpec::new(CacheParams {
        kind: CacheKind::Mla,
        order: BlockOrder::Nhd,
        dtype: Dtype::Bf16,
        num_layers: 3,
        kv_heads: 1,
        head_dim: 576,
        tokens_per_block: 64,
        num_blocks: 16,
    })
    .unwrap();
    let (pb, db) = (bases(&mla, 0, 64), bases(&mla, 1 << 30, 64));
    let (ps, ds) = (
        CacheSide::new(&mla, &pb, 0).unwrap(),
        CacheSide::new(&mla, &db, 0).unwrap(),
    );
    let one = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 1,
    };
    let out = plan(&ps, &ds, one, &[4, 5, 9], &[0, 1, 2], true);
    assert_eq!(out.raw_count, 9);
    assert_eq!(
        out.descriptors().len(),
        6,
        "blocks 4,5 -> 0,1 merge in each layer"
    );
    assert_eq!(out.total_bytes, 9 * mla.block_len());
}

#[test]
fn pipeline_stage_into_all_layers() {
    // 15 layers split 7 + 8; the second stage's layers land at 7..15 of the decode cache.
    let split = PpSplit::even(15, 2).unwrap();
    let stage = split.stage(1).unwrap();
    let p = spec(CacheKind::SplitKv, BlockOrder::Hnd, stage.count, 2, 4, 2, 4);
    let d = spec(CacheKind::SplitKv, BlockOrder::Hnd, 15, 2, 4, 2, 4);
    let (pb, db) = (bases(&p, 0, 128), bases(&d, 1 << 20, 128));
    let ps = CacheSide::new(&p, &pb, stage.first).unwrap();
    let ds = CacheSide::new(&d, &db, 0).unwrap();
    let full = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 2,
    };
    let out = plan(&ps, &ds, full, &[1], &[2], true);
    assert_eq!(out.raw_count, 16);
    // Source layer 0 of the stage (global 7), V part = source region 1 -> decode region 15.
    let v7 = out
        .iter()
        .find(|x| x.src == pb[1] + p.block_len())
        .expect("layer 7 V descriptor");
    assert_eq!(v7.dst, db[15] + 2 * d.block_len());
}

#[test]
fn windows_move_only_last_blocks() {
    let s = spec(CacheKind::SplitKv, BlockOrder::Hnd, 2, 1, 4, 2, 8);
    let (pb, db) = (bases(&s, 0, 64), bases(&s, 1 << 20, 64));
    let (ps, ds) = (
        CacheSide::new(&s, &pb, 0).unwrap(),
        CacheSide::new(&s, &db, 0).unwrap(),
    );
    let windows = [Some(1), None];
    let pairs = BlockPairs {
        src: &[1, 3, 5],
        dst: &[0, 2, 4],
        windows: Some(&windows),
    };
    let full = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 1,
    };
    let out = plan_transfer(&ps, &ds, full, &pairs, PlanOptions::default()).unwrap();
    assert_eq!(out.raw_count, 2 + 6);
    let short = BlockPairs {
        windows: Some(&windows[..1]),
        ..pairs
    };
    assert!(plan_transfer(&ps, &ds, full, &short, PlanOptions::default()).is_err());
}

#[test]
fn bad_plans_are_typed_errors() {
    let s = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 4, 4, 4, 8);
    let other = spec(CacheKind::SplitKv, BlockOrder::Hnd, 1, 4, 4, 4, 8);
    let (pb, db) = (bases(&s, 0, 0), bases(&s, 1 << 20, 0));
    let (ps, ds) = (
        CacheSide::new(&s, &pb, 0).unwrap(),
        CacheSide::new(&s, &db, 0).unwrap(),
    );
    let full = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 4,
    };
    let opts = PlanOptions::default();
    let go = |src: &[u32], dst: &[u32], slice| {
        plan_transfer(
            &ps,
            &ds,
            slice,
            &BlockPairs {
                src,
                dst,
                windows: None,
            },
            opts,
        )
    };
    assert!(matches!(
        go(&[8], &[0], full),
        Err(LayoutError::OutOfRange { .. })
    ));
    assert!(matches!(
        go(&[0], &[9], full),
        Err(LayoutError::OutOfRange { .. })
    ));
    assert!(matches!(
        go(&[0, 1], &[0], full),
        Err(LayoutError::LengthMismatch { .. })
    ));
    assert!(matches!(
        go(&[0, 1], &[3, 3], full),
        Err(LayoutError::DuplicateBlock { block: 3, .. })
    ));
    let wide = HeadSlice {
        src_first: 1,
        dst_first: 0,
        count: 4,
    };
    assert!(matches!(
        go(&[0], &[0], wide),
        Err(LayoutError::OutOfRange { .. })
    ));
    assert!(go(&[], &[], full).unwrap().descriptors().is_empty());
    let ob = bases(&other, 1 << 24, 0);
    let os = CacheSide::new(&other, &ob, 0).unwrap();
    let pairs = BlockPairs {
        src: &[0],
        dst: &[0],
        windows: None,
    };
    assert!(matches!(
        plan_transfer(&ps, &os, full, &pairs, opts),
        Err(LayoutError::Mismatch {
            field: "in-block order",
            ..
        })
    ));
    let tiny = PlanOptions {
        max_descriptors: 3,
        ..opts
    };
    let sliced = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 2,
    };
    assert!(matches!(
        plan_transfer(&ps, &ds, sliced, &pairs, tiny),
        Err(LayoutError::TooLarge { .. })
    ));
    // Overlapping or wrapping regions are refused when the side is built.
    assert!(matches!(
        CacheSide::new(&s, &[0, 10], 0),
        Err(LayoutError::Overlap { .. })
    ));
    assert!(matches!(
        CacheSide::new(&s, &[0, u64::MAX - 5], 0),
        Err(LayoutError::Overflow { .. })
    ));
    assert!(CacheSide::new(&s, &[0], 0).is_err());
}

#[test]
fn packed_kv_hnd_head_slice_is_one_piece_per_block_with_k_and_v() {
    // vLLM's CPU layout [blocks, heads, tokens, 2 * head_dim]: prefill TP 1 with 4 heads,
    // decode TP 2 with 2. Decode rank 1 reads heads 2..4 of each block: one contiguous piece
    // holding both heads' K and V for every token, formula-checked against the tensor shape.
    let (heads, head_dim, tokens) = (4u64, 8u64, 4u64);
    let p = spec(CacheKind::PackedKv, BlockOrder::Hnd, 2, 4, 8, 4, 8);
    let d = spec(CacheKind::PackedKv, BlockOrder::Hnd, 2, 2, 8, 4, 8);
    let (pb, db) = (bases(&p, 0x1000_0000, 4096), bases(&d, 0x9000_0000, 4096));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let m = TpMapping::new(1, 2, HeadSharding::Split { total_kv_heads: 4 }).unwrap();
    let link = m.links_for_decode(1).unwrap()[0];
    let out = plan(&ps, &ds, slice_of(&link), &[5, 1], &[2, 6], false);
    // One part per layer: 2 layers x 2 blocks.
    assert_eq!(out.raw_count, 2 * 2);
    let elt = 2; // f16
    let slot = 2 * head_dim * elt; // K and V of one head-token
    let first = out.descriptors()[0];
    assert_eq!(
        first.src,
        pb[0] + (5 * heads + 2) * tokens * slot,
        "block 5, head 2, token 0"
    );
    assert_eq!(first.dst, db[0] + 2 * 2 * tokens * slot);
    assert_eq!(first.len, 2 * tokens * slot);
    assert_eq!(first.len, d.block_len());
    // Layer 1 lives in the second region.
    assert_eq!(
        out.descriptors()[2].src,
        pb[1] + (5 * heads + 2) * tokens * slot
    );
}

#[test]
fn packed_kv_nhd_head_slice_is_one_piece_per_token() {
    // [blocks, tokens, heads, 2 * head_dim]: a head slice repeats once per token.
    let p = spec(CacheKind::PackedKv, BlockOrder::Nhd, 1, 4, 8, 4, 8);
    let d = spec(CacheKind::PackedKv, BlockOrder::Nhd, 1, 2, 8, 4, 8);
    let (pb, db) = (bases(&p, 0, 64), bases(&d, 1 << 20, 64));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let slice = HeadSlice {
        src_first: 2,
        dst_first: 0,
        count: 2,
    };
    let out = plan(&ps, &ds, slice, &[1], &[3], true);
    assert_eq!(out.descriptors().len(), 4, "one piece per token");
    let slot = 2 * 8 * 2;
    let descs = out.descriptors();
    assert_eq!(descs[0].src, pb[0] + p.block_len() + 2 * slot);
    assert_eq!(descs[0].len, 2 * slot);
    assert_eq!(descs[1].src - descs[0].src, 4 * slot, "next token");
    assert_eq!(descs[1].dst - descs[0].dst, 2 * slot);
    // Packed and split caches never pair.
    let split = spec(CacheKind::SplitKv, BlockOrder::Nhd, 1, 2, 8, 4, 8);
    let sb = bases(&split, 1 << 20, 64);
    let ss = CacheSide::new(&split, &sb, 0).unwrap();
    let pairs = BlockPairs {
        src: &[1],
        dst: &[3],
        windows: None,
    };
    assert!(matches!(
        plan_transfer(&ps, &ss, slice, &pairs, PlanOptions::default()),
        Err(LayoutError::Mismatch {
            field: "cache kind",
            ..
        })
    ));
}

#[test]
fn cross_layer_blocks_move_as_one_descriptor_per_run_of_blocks() {
    // vLLM's BLHNC: [blocks, layers, heads, tokens, 2 * head_dim]. Same TP on both sides:
    // every layer's page of a block is one run, so 3 blocks x 3 layers (9 raw pieces) become
    // one descriptor per run of blocks contiguous on both sides.
    let p = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 3, 2, 8, 4, 16);
    let d = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 3, 2, 8, 4, 16);
    let (pb, db) = (bases(&p, 0x1000_0000, 0), bases(&d, 0x9000_0000, 0));
    assert_eq!((pb.len(), p.block_len()), (1, 3 * p.part_block_len()));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let all = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 2,
    };
    let out = plan(&ps, &ds, all, &[4, 5, 9], &[0, 1, 7], true);
    assert_eq!(out.raw_count, 3 * 3, "one raw piece per layer and block");
    let descs = out.descriptors();
    assert_eq!(
        descs.len(),
        2,
        "blocks 4,5 -> 0,1 are one run; 9 -> 7 another"
    );
    assert_eq!(
        (descs[0].src, descs[0].dst, descs[0].len),
        (pb[0] + 4 * p.block_len(), db[0], 2 * p.block_len())
    );
    assert_eq!(
        (descs[1].src, descs[1].dst, descs[1].len),
        (
            pb[0] + 9 * p.block_len(),
            db[0] + 7 * d.block_len(),
            p.block_len()
        )
    );
    // Uncoalesced, the pieces are exactly the formula's pages, block by block.
    let raw = plan(&ps, &ds, all, &[4, 5, 9], &[0, 1, 7], false);
    let mut want = Vec::new();
    for (s, t) in [(4u64, 0u64), (5, 1), (9, 7)] {
        for l in 0..3u64 {
            let page = p.part_block_len();
            want.push((
                pb[0] + s * p.block_len() + l * page,
                db[0] + t * d.block_len() + l * page,
            ));
        }
    }
    let got: Vec<(u64, u64)> = raw.descriptors().iter().map(|d| (d.src, d.dst)).collect();
    assert_eq!(got, want);
    assert!(
        raw.descriptors()
            .iter()
            .all(|d| d.len == p.part_block_len())
    );
}

#[test]
fn cross_layer_head_slices_are_one_piece_per_layer_and_block() {
    // Prefill TP 1 with 4 heads, decode TP 2 with 2 heads, BLHNC: decode rank 1 reads heads
    // 2..4 of every layer's page; pages of different layers never merge.
    let (heads, head_dim, tokens, layers) = (4u64, 8u64, 4u64, 3u64);
    let p = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 3, 4, 8, 4, 8);
    let d = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 3, 2, 8, 4, 8);
    let (pb, db) = (bases(&p, 0x1000_0000, 0), bases(&d, 0x9000_0000, 0));
    let (ps, ds) = (
        CacheSide::new(&p, &pb, 0).unwrap(),
        CacheSide::new(&d, &db, 0).unwrap(),
    );
    let m = TpMapping::new(1, 2, HeadSharding::Split { total_kv_heads: 4 }).unwrap();
    let link = m.links_for_decode(1).unwrap()[0];
    let out = plan(&ps, &ds, slice_of(&link), &[5, 6], &[2, 3], true);
    assert_eq!(out.descriptors().len(), 3 * 2);
    let slot = 2 * head_dim * 2; // K and V of one head-token, f16
    let page = heads * tokens * slot;
    let mut got: Vec<(u64, u64, u64)> = out
        .descriptors()
        .iter()
        .map(|d| (d.src, d.dst, d.len))
        .collect();
    got.sort_unstable();
    let mut want = Vec::new();
    for b in [(5u64, 2u64), (6, 3)] {
        for l in 0..layers {
            want.push((
                pb[0] + b.0 * layers * page + l * page + 2 * tokens * slot,
                db[0] + b.1 * layers * (page / 2) + l * (page / 2),
                2 * tokens * slot,
            ));
        }
    }
    want.sort_unstable();
    assert_eq!(got, want);
    // A cross-layer cache never pairs with a per-layer one.
    let packed = spec(CacheKind::PackedKv, BlockOrder::Hnd, 3, 2, 8, 4, 8);
    let qb = bases(&packed, 1 << 30, 0);
    let qs = CacheSide::new(&packed, &qb, 0).unwrap();
    let pairs = BlockPairs {
        src: &[1],
        dst: &[3],
        windows: None,
    };
    assert!(matches!(
        plan_transfer(&ps, &qs, slice_of(&link), &pairs, PlanOptions::default()),
        Err(LayoutError::Mismatch {
            field: "cache kind",
            ..
        })
    ));
}

#[test]
fn cross_layer_stage_moves_only_its_layers_into_a_full_decode() {
    // A pipeline stage holding layers 2..4 of a 4-layer cross-layer model: its block holds
    // 2 pages; the decode's holds 4. Layer 2 of the stage is page 0 there and page 2 here.
    let stage = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 2, 2, 8, 4, 8);
    let full = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 4, 2, 8, 4, 8);
    let (sb, fb) = (bases(&stage, 0x1000_0000, 0), bases(&full, 0x9000_0000, 0));
    let (ss, fs) = (
        CacheSide::new(&stage, &sb, 2).unwrap(),
        CacheSide::new(&full, &fb, 0).unwrap(),
    );
    let all = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 2,
    };
    let page = stage.part_block_len();
    assert_eq!(page, full.part_block_len());
    let out = plan(&ss, &fs, all, &[5], &[3], true);
    assert_eq!(out.raw_count, 2);
    let d = out.descriptors();
    assert_eq!(d.len(), 1, "the stage's two pages land next to each other");
    assert_eq!(
        (d[0].src, d[0].dst, d[0].len),
        (
            sb[0] + 5 * 2 * page,
            fb[0] + 3 * 4 * page + 2 * page,
            2 * page
        )
    );
}
