//! Property tests of the layout crate: plans stay inside registered memory, coalescing
//! preserves every byte, TP slices tile each destination block exactly once with the right
//! heads, PP stages partition layers, ids are unique, and no input panics.

mod common;
use std::collections::HashMap;

use common::*;
use kvxfer_layout::*;
use proptest::prelude::*;
use proptest::sample::subsequence;

/// A random but valid heterogeneous-TP configuration.
#[derive(Debug, Clone)]
struct Config {
    kind: CacheKind,
    order: BlockOrder,
    layers: u32,
    total_heads: u32,
    head_dim: u32,
    tokens: u32,
    blocks: u32,
    p: u32,
    d: u32,
    /// Gap after each region (0 = adjacent, so merges across regions are possible).
    gaps: Vec<u64>,
    /// Block pairs (src may repeat; dst unique).
    src_blocks: Vec<u32>,
    dst_blocks: Vec<u32>,
}

impl Config {
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

    fn rank_spec(&self, side: Side, rank: u32) -> CacheSpec {
        let heads = self.mapping().heads_of(side, rank).unwrap().count;
        CacheSpec::new(CacheParams {
            kind: self.kind,
            order: self.order,
            dtype: Dtype::F16,
            num_layers: self.layers,
            kv_heads: heads,
            head_dim: self.head_dim,
            tokens_per_block: self.tokens,
            num_blocks: self.blocks,
        })
        .unwrap()
    }

    /// Region bases of one rank: side-specific start, ranks 1 GiB apart, given gaps.
    fn rank_bases(&self, spec: &CacheSpec, side: Side, rank: u32) -> Vec<u64> {
        let mut at = match side {
            Side::Prefill => 0x10_0000_0000,
            Side::Decode => 0x80_0000_0000,
        } + u64::from(rank) * (1 << 30);
        (0..spec.num_regions() as usize)
            .map(|r| {
                let base = at;
                at += spec.region_len() + self.gaps[r % self.gaps.len()];
                base
            })
            .collect()
    }
}

fn config() -> impl Strategy<Value = Config> {
    let kinds = prop_oneof![
        Just(CacheKind::SplitKv),
        Just(CacheKind::JointKv),
        Just(CacheKind::Mla),
        Just(CacheKind::PackedKv),
        Just(CacheKind::CrossLayer)
    ];
    let orders = prop_oneof![Just(BlockOrder::Hnd), Just(BlockOrder::Nhd)];
    let pow2 = |max: u32| (0..=max).prop_map(|e| 1u32 << e);
    (
        kinds,
        orders,
        1u32..=3,
        pow2(3),
        1u32..=3,
        1u32..=4,
        1u32..=6,
        pow2(3),
        pow2(3),
    )
        .prop_flat_map(
            |(kind, order, layers, total_heads, head_dim, tokens, blocks, p, d)| {
                let ids: Vec<u32> = (0..blocks).collect();
                (
                    Just((
                        kind,
                        order,
                        layers,
                        total_heads,
                        head_dim,
                        tokens,
                        blocks,
                        p,
                        d,
                    )),
                    prop::collection::vec(prop_oneof![Just(0u64), 1u64..64], 1..4),
                    subsequence(ids, 0..=blocks as usize).prop_shuffle(),
                    prop::collection::vec(0..blocks, blocks as usize),
                )
            },
        )
        .prop_map(
            |(
                (kind, order, layers, total_heads, head_dim, tokens, blocks, p, d),
                gaps,
                dst,
                src,
            )| {
                let n = dst.len();
                Config {
                    kind,
                    order,
                    layers,
                    total_heads,
                    head_dim,
                    tokens,
                    blocks,
                    p,
                    d,
                    gaps,
                    src_blocks: src[..n].to_vec(),
                    dst_blocks: dst,
                }
            },
        )
}

/// Plans every data link into decode rank `r`: (prefill rank, raw plan, coalesced plan).
fn plans_into(c: &Config, r: u32) -> Vec<(u32, TransferPlan, TransferPlan)> {
    let m = c.mapping();
    let dspec = c.rank_spec(Side::Decode, r);
    let dbases = c.rank_bases(&dspec, Side::Decode, r);
    let dside = CacheSide::new(&dspec, &dbases, 0).unwrap();
    let pairs = BlockPairs {
        src: &c.src_blocks,
        dst: &c.dst_blocks,
        windows: None,
    };
    let mut out = Vec::new();
    for link in m.links_for_decode(r).unwrap() {
        let LinkKind::Data(slice) = link.kind else {
            continue;
        };
        let q = link.prefill_rank;
        let pspec = c.rank_spec(Side::Prefill, q);
        let pbases = c.rank_bases(&pspec, Side::Prefill, q);
        let pside = CacheSide::new(&pspec, &pbases, 0).unwrap();
        let raw = plan_transfer(
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
        let merged = plan_transfer(&pside, &dside, slice, &pairs, PlanOptions::default()).unwrap();
        // Every descriptor inside both sides' registered regions.
        for desc in raw.descriptors().iter().chain(&merged.descriptors()) {
            assert!(pside.contains(desc.src, desc.len), "src outside: {desc:?}");
            assert!(dside.contains(desc.dst, desc.len), "dst outside: {desc:?}");
        }
        out.push((q, raw, merged));
    }
    out
}

/// Identity of a cache element: (layer, part, block, token, global head, byte in head).
type Element = (u32, Part, u32, u32, u32, u64);

/// Address -> element identity for every byte of a rank's cache.
fn element_map(c: &Config, side: Side, rank: u32, blocks: &[u32]) -> HashMap<u64, Element> {
    let spec = c.rank_spec(side, rank);
    let bases = c.rank_bases(&spec, side, rank);
    let first_head = c.mapping().heads_of(side, rank).unwrap().first;
    let mut map = HashMap::new();
    for layer in 0..c.layers {
        for &part in spec.parts() {
            for &b in blocks {
                for t in 0..c.tokens {
                    for h in 0..spec.kv_heads() {
                        let (region, r) = spec.head_token_range(layer, part, b, t, h).unwrap();
                        for e in 0..r.len {
                            let addr = bases[region as usize] + r.offset + e;
                            map.insert(addr, (layer, part, b, t, first_head + h, e));
                        }
                    }
                }
            }
        }
    }
    map
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn coalescing_preserves_bytes_and_is_minimal(c in config()) {
        for r in 0..c.d {
            for (_, raw, merged) in plans_into(&c, r) {
                prop_assert_eq!(raw.raw_count, raw.descriptors().len() as u64);
                prop_assert_eq!(merged.raw_count, raw.raw_count);
                prop_assert_eq!(byte_pairs(&raw.descriptors()), byte_pairs(&merged.descriptors()));
                let bytes: u64 = merged.descriptors().iter().map(|d| d.len).sum();
                prop_assert_eq!(bytes, merged.total_bytes);
                for w in merged.descriptors().windows(2) {
                    prop_assert!(w[0].dst + w[0].len <= w[1].dst, "dst overlap or unordered: {:?}", w);
                    prop_assert!(!w[0].continues_into(&w[1]), "mergeable neighbours: {:?}", w);
                }
                let mut again = merged.descriptors().clone();
                coalesce(&mut again);
                prop_assert_eq!(&again, &merged.descriptors());
            }
        }
    }

    #[test]
    fn tp_slices_tile_every_destination_block_with_the_right_heads(c in config()) {
        let m = c.mapping();
        // Every prefill rank hears from at least one decode rank.
        for q in 0..c.p {
            prop_assert!(m.notifications_per_request(q).unwrap() >= 1);
        }
        for r in 0..c.d {
            let dst_elems = element_map(&c, Side::Decode, r, &c.dst_blocks);
            let mut written: HashMap<u64, u64> = HashMap::new(); // dst addr -> src addr
            let mut sources: HashMap<u32, HashMap<u64, Element>> = HashMap::new();
            for (q, _, merged) in plans_into(&c, r) {
                sources.entry(q).or_insert_with(|| element_map(&c, Side::Prefill, q, &c.src_blocks));
                for d in &merged.descriptors() {
                    for i in 0..d.len {
                        let prev = written.insert(d.dst + i, d.src + i);
                        prop_assert!(prev.is_none(), "destination byte written twice");
                        prop_assert!(sources[&q].contains_key(&(d.src + i)), "source byte outside requested blocks");
                    }
                }
                // Remember which prefill rank wrote each byte through the source map lookup below.
                for d in &merged.descriptors() {
                    for i in 0..d.len {
                        let src = sources[&q][&(d.src + i)];
                        let dst = dst_elems[&(d.dst + i)];
                        let pair = c.dst_blocks.iter().position(|&b| b == dst.2).unwrap();
                        // Same layer, part, token, global head and byte; block mapped by the pair.
                        prop_assert_eq!((src.0, src.1, src.3, src.4, src.5), (dst.0, dst.1, dst.3, dst.4, dst.5));
                        prop_assert_eq!(src.2, c.src_blocks[pair]);
                    }
                }
            }
            // Every byte of every requested destination block was written exactly once.
            prop_assert_eq!(written.len(), dst_elems.len());
        }
    }

    #[test]
    fn pp_stages_partition_layers(total in 1u32..200, stages in 1u32..20) {
        prop_assume!(stages <= total);
        let split = PpSplit::even(total, stages).unwrap();
        let mut next = 0;
        let sizes: Vec<u32> = split.stages().iter().map(|s| s.count).collect();
        for s in split.stages() {
            prop_assert_eq!(s.first, next);
            next = s.end();
        }
        prop_assert_eq!(next, total);
        prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        for layer in 0..total {
            let st = split.stage_of_layer(layer).unwrap();
            prop_assert!(split.stage(st).unwrap().contains(layer));
        }
    }

    #[test]
    fn descriptor_ids_unique_and_in_range(
        kind in prop_oneof![Just(CacheKind::SplitKv), Just(CacheKind::JointKv), Just(CacheKind::Mla), Just(CacheKind::PackedKv)],
        layers in 1u32..40,
        blocks in 1u32..300,
        picks in prop::collection::btree_set(0u32..300, 0..64),
        window in prop::option::of(0u32..8),
    ) {
        let s = spec(kind, BlockOrder::Hnd, layers, 1, 8, 4, blocks);
        let ids_in: Vec<u32> = picks.into_iter().filter(|&b| b < blocks).collect();
        let ids = descriptor_ids(&s, &ids_in, None).unwrap();
        prop_assert_eq!(ids.len(), ids_in.len() * s.num_regions() as usize);
        let limit = u64::from(s.num_regions()) * u64::from(blocks);
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), ids.len());
        prop_assert!(ids.iter().all(|&i| i < limit));
        let windows = vec![window; layers as usize];
        let w = descriptor_ids_windowed(&s, &ids_in, &windows).unwrap();
        let per_layer = windowed_blocks(&ids_in, window).len() * s.num_regions() as usize / layers as usize;
        prop_assert_eq!(w.len(), per_layer * layers as usize);
        prop_assert!(w.iter().all(|i| ids.contains(i)));
    }

    #[test]
    fn any_input_is_ok_or_a_typed_error(
        vals in prop::collection::vec(prop_oneof![Just(0u32), Just(1), Just(u32::MAX), Just(MAX_DIM), Just(MAX_DIM + 1), any::<u32>(), 0u32..64], 12),
        bases_in in prop::collection::vec(prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()], 0..6),
        blocks in prop::collection::vec(prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>(), 0u32..8], 0..6),
        kind in prop_oneof![Just(CacheKind::SplitKv), Just(CacheKind::JointKv), Just(CacheKind::Mla), Just(CacheKind::PackedKv), Just(CacheKind::CrossLayer)],
        order in prop_oneof![Just(BlockOrder::Hnd), Just(BlockOrder::Nhd)],
    ) {
        let params = CacheParams {
            kind,
            order,
            dtype: Dtype::Bf16,
            num_layers: vals[0],
            kv_heads: vals[1],
            head_dim: vals[2],
            tokens_per_block: vals[3],
            num_blocks: vals[4],
        };
        // TP mapping with arbitrary sizes; cheap enough only when sizes are small.
        if vals[5].min(vals[6]).min(vals[7]) < 4096 || vals[5].max(vals[6]).max(vals[7]) < 4096 {
            let small = |v: u32| if v > 4096 { v } else { v % 65 };
            let _ = TpMapping::new(small(vals[5]), small(vals[6]), HeadSharding::Split { total_kv_heads: small(vals[7]) })
                .map(|m| m.links_for_decode(vals[8]).ok());
        }
        let _ = PpSplit::even(vals[9], vals[10]);
        let _ = PpSplit::from_sizes(&vals[9..12]);
        let Ok(spec) = CacheSpec::new(params) else { return Ok(()) };
        let _ = spec.token_bytes(vals[5], Part::Key, vals[6], vals[7]);
        let _ = spec.head_token_range(vals[5] % 4, Part::Value, vals[6] % 4, vals[7] % 4, vals[8]);
        let _ = spec.block_range(vals[9], vals[10]);
        let _ = spec.locate(vals[11], Part::Latent);
        if spec.num_regions() < 64 {
            let _ = descriptor_ids(&spec, &blocks, Some(vals[8] % 4));
        }
        if let Ok(side) = CacheSide::new(&spec, &bases_in, vals[11]) {
            let slice = HeadSlice { src_first: vals[8] % 3, dst_first: vals[9] % 3, count: vals[10] % 3 };
            let dst: Vec<u32> = blocks.iter().rev().copied().collect();
            let pairs = BlockPairs { src: &blocks, dst: &dst, windows: None };
            let opts = PlanOptions { max_descriptors: 1 << 16, ..Default::default() };
            let _ = plan_transfer(&side, &side, slice, &pairs, opts);
        }
    }
}
