//! Helpers shared by the layout integration tests.
#![allow(dead_code)]

use kvxfer_layout::*;

/// A spec with the given shape (HND/NHD, kind), small enough to expand byte by byte.
pub fn spec(
    kind: CacheKind,
    order: BlockOrder,
    layers: u32,
    heads: u32,
    head_dim: u32,
    tokens: u32,
    blocks: u32,
) -> CacheSpec {
    CacheSpec::new(CacheParams {
        kind,
        order,
        dtype: Dtype::F16,
        num_layers: layers,
        kv_heads: heads,
        head_dim,
        tokens_per_block: tokens,
        num_blocks: blocks,
    })
    .unwrap()
}

/// Region bases laid out back to back from `start`, with `gap` bytes between regions.
pub fn bases(spec: &CacheSpec, start: u64, gap: u64) -> Vec<u64> {
    (0..spec.num_regions() as u64)
        .map(|r| start + r * (spec.region_len() + gap))
        .collect()
}

/// Every (src byte, dst byte) pair a plan moves, sorted.
pub fn byte_pairs(descs: &[Descriptor]) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = descs
        .iter()
        .flat_map(|d| (0..d.len).map(move |i| (d.src + i, d.dst + i)))
        .collect();
    v.sort_unstable();
    v
}

/// The data head slice of a link (panics on notify-only; tests only).
pub fn slice_of(link: &TpLink) -> HeadSlice {
    match link.kind {
        LinkKind::Data(s) => s,
        LinkKind::NotifyOnly => panic!("notify-only link has no slice"),
    }
}
