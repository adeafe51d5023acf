//! Plans between caches whose blocks hold different numbers of tokens, for every ratio
//! (split and joint K/V, MLA; packed K/V and cross-layer caches are refused):
//! each destination byte of the moved tokens is written once, from the same layer, part,
//! token, global head and byte of the source; nothing outside the listed blocks is read or
//! written, tokens before the range are untouched, and coalescing keeps every byte.

mod common;
use std::collections::HashMap;

use common::*;
use kvxfer_layout::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    kind: CacheKind,
    order: BlockOrder,
    layers: u32,
    total_heads: u32,
    head_dim: u32,
    /// Tokens per block of the source and destination (one divides the other).
    src_tokens: u32,
    dst_tokens: u32,
    p: u32,
    d: u32,
    /// Prompt tokens, and the destination's first listed token (its local prefix hit).
    tokens: u64,
    dst_first: u64,
    /// Source blocks of tokens 0.., destination blocks of `dst_first`.. (each unique).
    src_blocks: Vec<u32>,
    dst_blocks: Vec<u32>,
    blocks: u32,
}

impl Case {
    fn sharding(&self) -> HeadSharding {
        if self.kind == CacheKind::Mla {
            HeadSharding::Replicated
        } else {
            HeadSharding::Split {
                total_kv_heads: self.total_heads,
            }
        }
    }

    fn mapping(&self) -> TpMapping {
        TpMapping::new(self.p, self.d, self.sharding()).unwrap()
    }

    fn spec(&self, side: Side, rank: u32) -> CacheSpec {
        let heads = self.mapping().heads_of(side, rank).unwrap().count;
        let tokens = match side {
            Side::Prefill => self.src_tokens,
            Side::Decode => self.dst_tokens,
        };
        spec(
            self.kind,
            self.order,
            self.layers,
            heads,
            self.head_dim,
            tokens,
            self.blocks,
        )
    }

    fn bases(&self, spec: &CacheSpec, side: Side, rank: u32) -> Vec<u64> {
        let start = match side {
            Side::Prefill => 0x10_0000_0000,
            Side::Decode => 0x80_0000_0000,
        } + u64::from(rank) * (1 << 30);
        bases(spec, start, 8)
    }
}

fn case() -> impl Strategy<Value = Case> {
    let kinds = prop_oneof![
        Just(CacheKind::SplitKv),
        Just(CacheKind::JointKv),
        Just(CacheKind::Mla),
    ];
    let orders = prop_oneof![Just(BlockOrder::Hnd), Just(BlockOrder::Nhd)];
    let pow2 = |max: u32| (0..=max).prop_map(|e| 1u32 << e);
    // The unit of tokens, then how many units a block holds on each side: one side 1, the
    // other any of 1 to 8.
    let ratios = (1u32..=8, any::<bool>()).prop_map(
        |(r, decode_larger)| {
            if decode_larger { (1, r) } else { (r, 1) }
        },
    );
    (
        kinds,
        orders,
        1u32..=2,
        pow2(2),
        1u32..=2,
        1u32..=3,
        ratios,
        pow2(1),
        pow2(1),
        1u64..=40,
    )
        .prop_flat_map(
            |(kind, order, layers, total_heads, head_dim, unit, (rs, rd), p, d, tokens)| {
                let (src_tokens, dst_tokens) = (unit * rs, unit * rd);
                let src_n = tokens.div_ceil(src_tokens.into()) as usize;
                let dst_total = tokens.div_ceil(dst_tokens.into());
                let blocks = (src_n.max(dst_total as usize) + 3) as u32;
                (
                    Just((
                        kind,
                        order,
                        layers,
                        total_heads,
                        head_dim,
                        src_tokens,
                        dst_tokens,
                    )),
                    Just((p, d, tokens, blocks)),
                    0..dst_total,
                    Just((0..blocks).collect::<Vec<u32>>())
                        .prop_shuffle()
                        .prop_map(move |v| v[..src_n].to_vec()),
                    Just((0..blocks).collect::<Vec<u32>>()).prop_shuffle(),
                )
            },
        )
        .prop_map(
            |(
                (kind, order, layers, total_heads, head_dim, src_tokens, dst_tokens),
                (p, d, tokens, blocks),
                skipped,
                src_blocks,
                shuffled,
            )| {
                let dst_first = skipped * u64::from(dst_tokens);
                let n = (tokens.div_ceil(dst_tokens.into()) - skipped) as usize;
                Case {
                    kind,
                    order,
                    layers,
                    total_heads,
                    head_dim,
                    src_tokens,
                    dst_tokens,
                    p,
                    d,
                    tokens,
                    dst_first,
                    src_blocks,
                    dst_blocks: shuffled[..n].to_vec(),
                    blocks,
                }
            },
        )
}

/// Identity of a cache byte: (layer, part, request token, global head, byte in head).
type Element = (u32, Part, u64, u32, u64);

/// Address -> identity of every byte of the listed blocks of a rank's cache.
fn elements(c: &Case, side: Side, rank: u32) -> HashMap<u64, Element> {
    let spec = c.spec(side, rank);
    let bases = c.bases(&spec, side, rank);
    let first_head = c.mapping().heads_of(side, rank).unwrap().first;
    let (blocks, first) = match side {
        Side::Prefill => (&c.src_blocks, 0),
        Side::Decode => (&c.dst_blocks, c.dst_first),
    };
    let per = spec.tokens_per_block();
    let mut map = HashMap::new();
    for layer in 0..c.layers {
        for &part in spec.parts() {
            for (i, &b) in blocks.iter().enumerate() {
                for t in 0..per {
                    let token = first + i as u64 * u64::from(per) + u64::from(t);
                    for h in 0..spec.kv_heads() {
                        let (region, r) = spec.head_token_range(layer, part, b, t, h).unwrap();
                        for e in 0..r.len {
                            let at = bases[region as usize] + r.offset + e;
                            let prev = map.insert(at, (layer, part, token, first_head + h, e));
                            assert!(prev.is_none());
                        }
                    }
                }
            }
        }
    }
    map
}

/// The plans of every data link into decode rank `r`: (prefill rank, raw, coalesced).
fn plans_into(c: &Case, r: u32) -> Vec<(u32, TransferPlan, TransferPlan)> {
    let dspec = c.spec(Side::Decode, r);
    let dbases = c.bases(&dspec, Side::Decode, r);
    let dside = CacheSide::new(&dspec, &dbases, 0).unwrap();
    let pairs = TokenPairs {
        src: &c.src_blocks,
        src_first: 0,
        dst: &c.dst_blocks,
        dst_first: c.dst_first,
        tokens: c.dst_first..c.tokens,
    };
    let mut out = Vec::new();
    for link in c.mapping().links_for_decode(r).unwrap() {
        let LinkKind::Data(slice) = link.kind else {
            continue;
        };
        let q = link.prefill_rank;
        let pspec = c.spec(Side::Prefill, q);
        let pbases = c.bases(&pspec, Side::Prefill, q);
        let pside = CacheSide::new(&pspec, &pbases, 0).unwrap();
        let raw = plan_token_transfer(
            &pside,
            &dside,
            slice,
            &pairs,
            PlanOptions {
                coalesce: false,
                ..Default::default()
            },
        )
        .unwrap();
        let merged =
            plan_token_transfer(&pside, &dside, slice, &pairs, PlanOptions::default()).unwrap();
        out.push((q, raw, merged));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_token_lands_in_its_place_at_any_ratio(c in case()) {
        for r in 0..c.d {
            let dst = elements(&c, Side::Decode, r);
            let mut written: HashMap<u64, u64> = HashMap::new();
            for (q, raw, merged) in plans_into(&c, r) {
                prop_assert_eq!(raw.raw_count, raw.descriptors().len() as u64);
                prop_assert_eq!(merged.raw_count, raw.raw_count);
                prop_assert_eq!(byte_pairs(&raw.descriptors()), byte_pairs(&merged.descriptors()));
                let bytes: u64 = merged.descriptors().iter().map(|d| d.len).sum();
                prop_assert_eq!(bytes, merged.total_bytes);
                let src = elements(&c, Side::Prefill, q);
                for d in merged.descriptors() {
                    for i in 0..d.len {
                        prop_assert!(written.insert(d.dst + i, d.src + i).is_none(), "written twice");
                        let (Some(s), Some(t)) = (src.get(&(d.src + i)), dst.get(&(d.dst + i))) else {
                            return Err(TestCaseError::fail(format!("outside the listed blocks: {d:?}")));
                        };
                        prop_assert_eq!(s, t);
                    }
                }
            }
            // Every byte of the moved tokens, and none before them.
            for (at, e) in &dst {
                let moved = e.2 >= c.dst_first && e.2 < c.tokens;
                if moved {
                    prop_assert!(written.contains_key(at), "token {} not written: {:?}", e.2, e);
                }
                if e.2 < c.dst_first {
                    prop_assert!(!written.contains_key(at), "token {} before the range written", e.2);
                }
            }
        }
    }
}

#[test]
fn block_sizes_that_do_not_divide_and_lists_too_short_are_refused() {
    let (a, b) = (
        spec(CacheKind::SplitKv, BlockOrder::Hnd, 1, 1, 2, 4, 8),
        spec(CacheKind::SplitKv, BlockOrder::Hnd, 1, 1, 2, 6, 8),
    );
    let (ab, bb) = (bases(&a, 0x1000, 0), bases(&b, 0x10_0000, 0));
    let (sa, sb) = (
        CacheSide::new(&a, &ab, 0).unwrap(),
        CacheSide::new(&b, &bb, 0).unwrap(),
    );
    let slice = HeadSlice {
        src_first: 0,
        dst_first: 0,
        count: 1,
    };
    let pairs = |src: &'static [u32], dst: &'static [u32], first: u64, tokens| TokenPairs {
        src,
        src_first: 0,
        dst,
        dst_first: first,
        tokens,
    };
    // Plans from `sa` (4-token blocks) into `to`; the error's text where it fails.
    let plan = |to: &CacheSide<'_>, src, dst, first, tokens| {
        plan_token_transfer(
            &sa,
            to,
            slice,
            &pairs(src, dst, first, tokens),
            Default::default(),
        )
    };
    let err = |to: &CacheSide<'_>, src, dst, first, tokens| {
        plan(to, src, dst, first, tokens).unwrap_err().to_string()
    };
    assert!(
        err(&sb, &[0], &[0], 0, 0..4).contains("smaller must divide"),
        "4 and 6"
    );
    let c = spec(CacheKind::SplitKv, BlockOrder::Hnd, 1, 1, 2, 8, 8);
    let cb = bases(&c, 0x10_0000, 0);
    let sc = CacheSide::new(&c, &cb, 0).unwrap();
    // 9 tokens need 3 source blocks of 4 ...
    assert!(err(&sc, &[0, 1], &[0, 1], 0, 0..9).contains("source block of token"));
    // ... and 2 destination blocks of 8.
    assert!(err(&sc, &[0, 1, 2], &[0], 0, 0..9).contains("destination block of token"));
    // A destination list must start a block.
    assert!(err(&sc, &[0, 1, 2], &[0, 1], 4, 4..9).contains("does not start a 8-token block"));
    // Tokens before the destination's first.
    assert!(plan(&sc, &[0, 1, 2], &[0, 1], 8, 4..9).is_err());
    // An empty range is an empty plan; a valid one moves 9 tokens in three 4-token units.
    assert!(plan(&sc, &[0], &[0], 0, 3..3).unwrap().is_empty());
    let ok = plan(&sc, &[0, 1, 2], &[5, 6], 0, 0..9).unwrap();
    assert_eq!(ok.raw_count, 3 * 2);
    // Cross-layer caches are refused by name.
    let x = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 2, 1, 2, 4, 8);
    let y = spec(CacheKind::CrossLayer, BlockOrder::Hnd, 2, 1, 2, 8, 8);
    let (xb, yb) = (bases(&x, 0x1000, 0), bases(&y, 0x10_0000, 0));
    let (sx, sy) = (
        CacheSide::new(&x, &xb, 0).unwrap(),
        CacheSide::new(&y, &yb, 0).unwrap(),
    );
    let p4 = spec(CacheKind::PackedKv, BlockOrder::Hnd, 1, 1, 2, 4, 8);
    let p8 = spec(CacheKind::PackedKv, BlockOrder::Hnd, 1, 1, 2, 8, 8);
    let (p4b, p8b) = (bases(&p4, 0x1000, 0), bases(&p8, 0x10_0000, 0));
    let packed = plan_token_transfer(
        &CacheSide::new(&p4, &p4b, 0).unwrap(),
        &CacheSide::new(&p8, &p8b, 0).unwrap(),
        slice,
        &pairs(&[0], &[0], 0, 0..4),
        Default::default(),
    );
    assert!(
        packed
            .unwrap_err()
            .to_string()
            .contains("not addressable by token"),
        "vLLM's CPU cache"
    );
    let cross = plan_token_transfer(
        &sx,
        &sy,
        slice,
        &pairs(&[0], &[0], 0, 0..4),
        Default::default(),
    );
    assert!(cross.unwrap_err().to_string().contains("cross-layer"));
}

#[test]
fn a_token_plan_with_equal_block_sizes_is_the_block_plan() {
    // Same sizes: the token planner gives the bytes the block planner does.
    for (kind, order) in [
        (CacheKind::SplitKv, BlockOrder::Hnd),
        (CacheKind::JointKv, BlockOrder::Nhd),
        (CacheKind::Mla, BlockOrder::Nhd),
    ] {
        let heads = if kind == CacheKind::Mla { 1 } else { 2 };
        let s = spec(kind, order, 2, heads, 2, 4, 8);
        let (sb, db) = (bases(&s, 0x1000, 16), bases(&s, 0x10_0000, 0));
        let (src, dst) = (
            CacheSide::new(&s, &sb, 0).unwrap(),
            CacheSide::new(&s, &db, 0).unwrap(),
        );
        let slice = HeadSlice {
            src_first: 0,
            dst_first: 0,
            count: s.kv_heads(),
        };
        let blocks = BlockPairs {
            src: &[3, 1, 2],
            dst: &[0, 4, 5],
            windows: None,
        };
        let tokens = TokenPairs {
            src: &[7, 3, 1, 2],
            src_first: 0,
            dst: &[0, 4, 5],
            dst_first: 4,
            tokens: 4..16,
        };
        let by_block = plan_transfer(&src, &dst, slice, &blocks, Default::default()).unwrap();
        let by_token = plan_token_transfer(&src, &dst, slice, &tokens, Default::default()).unwrap();
        assert_eq!(
            byte_pairs(&by_block.descriptors()),
            byte_pairs(&by_token.descriptors()),
            "{kind:?} {order:?}"
        );
        assert_eq!(by_block.total_bytes, by_token.total_bytes);
    }
}
