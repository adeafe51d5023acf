//! Descriptor ids for prepared (region, block) lists, numbered as vLLM's NixlConnector
//! numbers them: `region * num_blocks + block`, and per-layer windows.

use crate::error::in_range;
use crate::{CacheKind, CacheSpec, LayoutError, Result};

/// The regions of one layer: `[2l, 2l+1]` for split K/V, `[l]` otherwise. A cross-layer
/// cache has no region of its own per layer (its one region's blocks hold every layer), so
/// per-layer ids do not exist there: an error.
pub fn layer_regions(spec: &CacheSpec, layer: u32) -> Result<std::ops::Range<u32>> {
    in_range(layer.into(), spec.num_layers().into(), "layer")?;
    let per_layer = match spec.kind() {
        CacheKind::SplitKv => 2,
        CacheKind::JointKv | CacheKind::Mla | CacheKind::PackedKv | CacheKind::State => 1,
        CacheKind::CrossLayer => {
            return Err(LayoutError::Unsupported(
                "a cross-layer cache has no per-layer regions".into(),
            ));
        }
    };
    let overflow = LayoutError::Overflow { what: "region" };
    let first = layer.checked_mul(per_layer).ok_or(overflow.clone())?;
    Ok(first..first.checked_add(per_layer).ok_or(overflow)?)
}

/// The blocks a layer with attention window `window` (in blocks) transfers: the last
/// `window` blocks of the request, or all of them when there is no window.
pub fn windowed_blocks(block_ids: &[u32], window: Option<u32>) -> &[u32] {
    match window {
        Some(w) => &block_ids[block_ids.len().saturating_sub(w as usize)..],
        None => block_ids,
    }
}

fn check_blocks(spec: &CacheSpec, block_ids: &[u32]) -> Result<()> {
    let limit = spec.num_blocks();
    match block_ids.iter().find(|&&b| b >= limit) {
        Some(&b) => Err(LayoutError::OutOfRange {
            what: "block",
            index: b.into(),
            limit: limit.into(),
        }),
        None => Ok(()),
    }
}

/// `region * num_blocks + block`. Three `u32` values: at most `(2^32 - 1)^2 + 2^32 - 1`,
/// below `2^64`, so this cannot overflow and stays unchecked in the per-block loop.
#[inline]
#[allow(clippy::arithmetic_side_effects)]
fn descriptor_id(region: u32, num_blocks: u32, block: u32) -> u64 {
    u64::from(region) * u64::from(num_blocks) + u64::from(block)
}

fn push_ids(out: &mut Vec<u64>, regions: std::ops::Range<u32>, num_blocks: u32, blocks: &[u32]) {
    for region in regions {
        out.extend(blocks.iter().map(|&b| descriptor_id(region, num_blocks, b)));
    }
}

/// Descriptor ids of `block_ids` in every region (`layer == None`) or in the regions of
/// one layer, region-major like the reference.
pub fn descriptor_ids(spec: &CacheSpec, block_ids: &[u32], layer: Option<u32>) -> Result<Vec<u64>> {
    check_blocks(spec, block_ids)?;
    let regions = match layer {
        Some(l) => layer_regions(spec, l)?,
        None => 0..spec.num_regions(),
    };
    let capacity = regions.len().checked_mul(block_ids.len());
    let mut out = Vec::with_capacity(capacity.ok_or(LayoutError::Overflow {
        what: "descriptor ids",
    })?);
    push_ids(&mut out, regions, spec.num_blocks(), block_ids);
    Ok(out)
}

/// Descriptor ids of every layer where layer `l` transfers only its window
/// `windows[l]` (the last `w` blocks; `None` = all blocks). `windows` has one entry per layer.
pub fn descriptor_ids_windowed(
    spec: &CacheSpec,
    block_ids: &[u32],
    windows: &[Option<u32>],
) -> Result<Vec<u64>> {
    if windows.len() != spec.num_layers() as usize {
        return Err(LayoutError::LengthMismatch {
            what: "per-layer windows vs layers",
            left: windows.len(),
            right: spec.num_layers() as usize,
        });
    }
    check_blocks(spec, block_ids)?;
    let mut out = Vec::new();
    for (layer, &window) in (0u32..).zip(windows) {
        let blocks = windowed_blocks(block_ids, window);
        push_ids(
            &mut out,
            layer_regions(spec, layer)?,
            spec.num_blocks(),
            blocks,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockOrder, CacheParams, Dtype};

    fn spec(kind: CacheKind, layers: u32, blocks: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: layers,
            kv_heads: 1,
            head_dim: 4,
            tokens_per_block: 2,
            num_blocks: blocks,
        })
        .unwrap()
    }

    #[test]
    fn ids_match_reference_numbering() {
        let s = spec(CacheKind::SplitKv, 2, 10);
        // Regions K0, V0, K1, V1.
        assert_eq!(
            descriptor_ids(&s, &[3, 7], None).unwrap(),
            vec![3, 7, 13, 17, 23, 27, 33, 37]
        );
        assert_eq!(
            descriptor_ids(&s, &[3, 7], Some(1)).unwrap(),
            vec![23, 27, 33, 37]
        );
        let j = spec(CacheKind::JointKv, 2, 10);
        assert_eq!(descriptor_ids(&j, &[1], None).unwrap(), vec![1, 11]);
        assert!(descriptor_ids(&s, &[10], None).is_err());
        assert!(descriptor_ids(&s, &[1], Some(2)).is_err());
        assert!(descriptor_ids(&s, &[], None).unwrap().is_empty());
    }

    #[test]
    fn a_cross_layer_cache_numbers_whole_blocks_and_has_no_per_layer_ids() {
        let c = spec(CacheKind::CrossLayer, 3, 10);
        assert_eq!(descriptor_ids(&c, &[1, 4], None).unwrap(), vec![1, 4]);
        assert!(layer_regions(&c, 0).is_err());
        assert!(descriptor_ids(&c, &[1], Some(0)).is_err());
    }

    #[test]
    fn windows_keep_last_blocks() {
        assert_eq!(windowed_blocks(&[1, 2, 3, 4], Some(2)), &[3, 4]);
        assert_eq!(windowed_blocks(&[1, 2], Some(5)), &[1, 2]);
        assert_eq!(windowed_blocks(&[1, 2], Some(0)), &[] as &[u32]);
        let s = spec(CacheKind::SplitKv, 2, 10);
        let ids = descriptor_ids_windowed(&s, &[1, 2, 3], &[Some(1), None]).unwrap();
        assert_eq!(ids, vec![3, 13, 21, 22, 23, 31, 32, 33]);
        assert!(descriptor_ids_windowed(&s, &[1], &[None]).is_err());
    }
}
