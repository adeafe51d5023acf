//! Content digests of KV blocks: what a source computes once a block's data is final and a
//! destination recomputes over what landed, so that a load is reported done only when its
//! bytes are the source's (#38's end-to-end check; opt-in).
//!
//! The hash is xxh3-64: SIMD on every x86-64 and Arm core without a runtime switch, pure
//! Rust, tens of GB/s per core (a copy's speed), 64 bits (a missed corruption is 2^-64 per
//! block and head, where CRC-32C's 2^-32 would let one through per few billion), and a
//! handful of multiply-and-xor lanes a GPU kernel can compute the same way later.
//!
//! A digest names one head of one block: the digest of the digests of its runs, a run being
//! the head's bytes of one part (K, V, latent, state) of one layer, tokens in order, runs in
//! (layer, part) order. Addresses do not enter it (the same
//! content in other block ids, or another layout order, digests the same), descriptors and
//! their coalescing do not either, and a decode rank of another TP size checks exactly the
//! heads it received, whichever prefill rank they came from.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{CacheSpec, LayoutError};

/// The digest of one run of bytes (what a block-head digest folds its runs into; the
/// bench's baseline).
pub fn of(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Digests `out.len()` heads, from `first_head`, of `block` of a cache whose region `r`
/// starts at `bases[r]`: `out[i]` is head `first_head + i`'s digest. Refuses a block or head
/// outside the spec.
///
/// A head's digest is the xxh3-64 of its runs' xxh3-64s, a run being the head's bytes of
/// one part of one layer, tokens in order: contiguous in HND (hashed in place), gathered
/// first in NHD, so both orders digest alike.
///
/// # Safety
/// Each `bases[r]` must point at `spec.region_len()` readable bytes of host memory (a cache
/// the worker registered), for the duration of the call.
pub unsafe fn block_heads(
    spec: &CacheSpec,
    bases: &[u64],
    block: u32,
    first_head: u32,
    out: &mut [u64],
) -> Result<(), LayoutError> {
    let count = u32::try_from(out.len()).map_err(|_| LayoutError::Overflow { what: "heads" })?;
    let end = first_head
        .checked_add(count)
        .ok_or(LayoutError::Overflow { what: "heads" })?;
    if end > spec.kv_heads() {
        return Err(LayoutError::OutOfRange {
            what: "head",
            index: end.into(),
            limit: spec.kv_heads().into(),
        });
    }
    let tokens = spec.tokens_per_block();
    let run = spec.head_token_bytes();
    let parts = spec.parts().len();
    let runs_per_head = (spec.num_layers() as usize).saturating_mul(parts);
    // Per head, its runs' digests in (layer, part) order.
    let mut runs = vec![0u64; runs_per_head.saturating_mul(out.len())];
    let mut gathered = Vec::new();
    for layer in 0..spec.num_layers() {
        for (p, &part) in spec.parts().iter().enumerate() {
            // Token 0 of head 0 and the steps to the next token and head: offsets inside
            // the block the spec validated, so every later offset lies between them.
            let (region, first) = spec.head_token_range(layer, part, block, 0, 0)?;
            let step = |token, head| -> Result<u64, LayoutError> {
                let (_, r) = spec.head_token_range(layer, part, block, token, head)?;
                Ok(r.offset.saturating_sub(first.offset))
            };
            let token_step = if tokens > 1 { step(1, 0)? } else { 0 };
            let head_step = if spec.kv_heads() > 1 { step(0, 1)? } else { 0 };
            let base = *bases.get(region as usize).ok_or(LayoutError::OutOfRange {
                what: "region",
                index: region.into(),
                limit: bases.len() as u64,
            })?;
            let contiguous = token_step == run || tokens == 1;
            let slot = (layer as usize).saturating_mul(parts).saturating_add(p);
            for i in 0..out.len() {
                let head = u64::from(first_head).saturating_add(i as u64);
                let head_at = base
                    .saturating_add(first.offset)
                    .saturating_add(head.saturating_mul(head_step));
                let at = |t: u32| head_at.saturating_add(u64::from(t).saturating_mul(token_step));
                // SAFETY (both reads): every token's run of this head lies inside `block` of
                // `region` (the spec checked the block's head-token ranges against its
                // geometry), and the caller vouches for the region's memory.
                let digest = if contiguous {
                    let len = run.saturating_mul(tokens.into()) as usize;
                    of(unsafe { std::slice::from_raw_parts(at(0) as *const u8, len) })
                } else {
                    gathered.clear();
                    for t in 0..tokens {
                        let bytes =
                            unsafe { std::slice::from_raw_parts(at(t) as *const u8, run as usize) };
                        gathered.extend_from_slice(bytes);
                    }
                    of(&gathered)
                };
                runs[i.saturating_mul(runs_per_head).saturating_add(slot)] = digest;
            }
        }
    }
    let mut bytes = Vec::with_capacity(runs_per_head.saturating_mul(8));
    for (o, head_runs) in out.iter_mut().zip(runs.chunks(runs_per_head.max(1))) {
        bytes.clear();
        for r in head_runs {
            bytes.extend_from_slice(&r.to_le_bytes());
        }
        *o = of(&bytes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, Dtype, Part};

    fn spec(kind: CacheKind, order: BlockOrder, heads: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind,
            order,
            dtype: Dtype::F16,
            num_layers: 2,
            kv_heads: heads,
            head_dim: 4,
            tokens_per_block: 3,
            num_blocks: 4,
        })
        .expect("spec")
    }

    /// A cache's memory with each head-token's bytes set from (layer, part, block, token,
    /// head), whatever the layout puts where.
    fn filled(s: &CacheSpec) -> (Vec<Vec<u8>>, Vec<u64>) {
        let mut regions: Vec<Vec<u8>> = (0..s.num_regions())
            .map(|_| vec![0u8; s.region_len() as usize])
            .collect();
        for layer in 0..s.num_layers() {
            for (p, &part) in s.parts().iter().enumerate() {
                for block in 0..s.num_blocks() {
                    for token in 0..s.tokens_per_block() {
                        for head in 0..s.kv_heads() {
                            let (r, range) = s
                                .head_token_range(layer, part, block, token, head)
                                .expect("range");
                            for (k, b) in regions[r as usize]
                                [range.offset as usize..(range.offset + range.len) as usize]
                                .iter_mut()
                                .enumerate()
                            {
                                *b = (layer * 31 + p as u32 * 17 + token * 7 + head * 3 + k as u32)
                                    as u8;
                            }
                        }
                    }
                }
            }
        }
        let bases = regions.iter().map(|r| r.as_ptr() as u64).collect();
        (regions, bases)
    }

    fn digests(s: &CacheSpec, bases: &[u64], block: u32) -> Vec<u64> {
        let mut out = vec![0; s.kv_heads() as usize];
        // SAFETY: `bases` point at the regions `filled` allocated.
        unsafe { block_heads(s, bases, block, 0, &mut out) }.expect("digest");
        out
    }

    #[test]
    fn digests_name_content_not_addresses_layout_order_or_kind() {
        let mut seen = Vec::new();
        for kind in [CacheKind::SplitKv, CacheKind::JointKv] {
            for order in [BlockOrder::Hnd, BlockOrder::Nhd] {
                let s = spec(kind, order, 3);
                let (_mem, bases) = filled(&s);
                // Every block holds the same content: the same digests, whatever its id.
                let d0 = digests(&s, &bases, 0);
                assert_eq!(d0, digests(&s, &bases, 3));
                // Heads differ from one another.
                assert_ne!(d0[0], d0[1]);
                // A sub-range of heads digests as the whole's slice.
                let mut two = [0u64; 2];
                unsafe { block_heads(&s, &bases, 2, 1, &mut two) }.expect("digest");
                assert_eq!(two, [d0[1], d0[2]]);
                seen.push(d0);
            }
        }
        // Split and joint K/V, HND and NHD: the same content, the same digests.
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    }

    #[test]
    fn a_byte_changed_anywhere_in_a_head_changes_its_digest_and_no_other() {
        for order in [BlockOrder::Hnd, BlockOrder::Nhd] {
            let s = spec(CacheKind::SplitKv, order, 2);
            let (mut mem, bases) = filled(&s);
            let before = digests(&s, &bases, 1);
            for (layer, part, token) in [(0, Part::Key, 0), (1, Part::Value, 2)] {
                let (r, range) = s.head_token_range(layer, part, 1, token, 1).unwrap();
                let at = (range.offset + range.len - 1) as usize;
                mem[r as usize][at] ^= 1;
                let after = digests(&s, &bases, 1);
                assert_eq!(after[0], before[0], "head 0 unchanged");
                assert_ne!(after[1], before[1], "{order} layer {layer} {part:?}");
                mem[r as usize][at] ^= 1;
            }
            // Other blocks never enter a block's digest.
            let (r, range) = s.head_token_range(0, Part::Key, 2, 0, 0).unwrap();
            mem[r as usize][range.offset as usize] ^= 1;
            assert_eq!(digests(&s, &bases, 1), before);
        }
    }

    #[test]
    fn blocks_and_heads_outside_the_spec_are_refused() {
        let s = spec(CacheKind::SplitKv, BlockOrder::Hnd, 2);
        let (_mem, bases) = filled(&s);
        let mut out = [0u64; 2];
        assert!(unsafe { block_heads(&s, &bases, 4, 0, &mut out) }.is_err());
        assert!(unsafe { block_heads(&s, &bases, 0, 1, &mut out) }.is_err());
        assert!(unsafe { block_heads(&s, &bases, 0, u32::MAX, &mut out[..1]) }.is_err());
        assert!(unsafe { block_heads(&s, &bases[..1], 0, 0, &mut out) }.is_err());
        let mut three = [0u64; 3];
        assert!(unsafe { block_heads(&s, &bases, 0, 0, &mut three) }.is_err());
    }
}
