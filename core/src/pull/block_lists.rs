//! Per-block prepared lists, for transports that build a request faster from lists they
//! prepared than from raw descriptors (NIXL: `makeXferReq` by index skips the lookup of every
//! descriptor in the registrations that `createXferReq` does).
//!
//! Once per connected prefill rank, the descriptors that move one block are laid out for
//! every block of each side: descriptor `j` of block `b` sits at index `b * per_block + j`,
//! remote blocks in the remote list and local blocks in the local list. A request is then
//! only indices. The pattern is derived from the planner itself — one single-block plan per
//! block — so it holds for every layout the planner knows (split/joint K/V, MLA, head
//! slices of heterogeneous TP); layouts where it would differ between blocks are refused
//! and the caller keeps posting raw plans.
//!
//! Coalesced raw plans still win when a request's blocks are partly contiguous on both
//! sides: fewer descriptors move faster where the post itself copies (CMA on a host without
//! RDMA: 8192 → 6100 descriptors was 4.7 vs 4.4 GB/s for 0.5 ms more build time per
//! request, `kvxfer bench --transport nixl [--raw-posts]`). [`fragmented`] decides.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{
    BlockPairs, CacheSide, HeadSlice, PlanOptions, TransferPlan, plan_transfer_into,
};

use crate::connector::plan::split_for;
use crate::transport::{AddrRange, DescListId, MemoryKind, Op, PeerId, Transport};

/// Most descriptors the two lists of one prefill rank may hold together; bigger caches keep
/// posting raw plans rather than preparing lists of that size.
pub const MAX_PREPARED: u64 = 4 << 20;

/// The prepared lists of one (decode rank, prefill rank) link.
#[derive(Debug, Clone, Copy)]
pub struct BlockLists {
    /// This rank's blocks.
    pub local: DescListId,
    /// The prefill rank's blocks.
    pub remote: DescListId,
    /// Descriptors per block.
    pub per_block: u32,
    /// Local and remote block counts.
    pub blocks: (u32, u32),
    /// Bytes one block pair moves.
    pub bytes_per_block: u64,
    /// Descriptors one block pair has before coalescing.
    pub raw_per_block: u64,
}

/// The descriptor pattern of one block on each side.
struct Pattern {
    lens: Vec<u64>,
    raw: u64,
    bytes: u64,
}

/// Ranges of each block of one side, or why the blocks do not share one pattern.
fn side_ranges(
    remote: &CacheSide<'_>,
    own: &CacheSide<'_>,
    slice: HeadSlice,
    local_side: bool,
    pattern: &mut Option<Pattern>,
) -> Result<Vec<AddrRange>, String> {
    let blocks = if local_side {
        own.spec().num_blocks()
    } else {
        remote.spec().num_blocks()
    };
    let mut plan = TransferPlan::default();
    let (mut l, mut r) = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    for b in 0..blocks {
        // The other side's block 0 stands in: only this side's addresses are kept.
        let (src, dst) = if local_side { ([0], [b]) } else { ([b], [0]) };
        let pairs = BlockPairs {
            src: &src,
            dst: &dst,
            windows: None,
        };
        plan_transfer_into(
            remote,
            own,
            slice,
            &pairs,
            PlanOptions::default(),
            &mut plan,
        )
        .map_err(|e| e.to_string())?;
        split_for(Op::Read, plan.iter(), &mut l, &mut r);
        let lens: Vec<u64> = l.iter().map(|x| x.len).collect();
        match pattern {
            None => {
                *pattern = Some(Pattern {
                    lens,
                    raw: plan.raw_count,
                    bytes: plan.total_bytes,
                });
            }
            Some(p) if p.lens != lens => {
                return Err(format!("block {b} has another descriptor pattern"));
            }
            Some(_) => {}
        }
        out.extend_from_slice(if local_side { &l } else { &r });
    }
    Ok(out)
}

/// Lists of `per_block` descriptors for each of `blocks` blocks (both sides together) are
/// prepared only when blocks have descriptors and all of them fit in [`MAX_PREPARED`].
fn check_size(per_block: u64, blocks: u64) -> Result<(), String> {
    if per_block == 0 || blocks.saturating_mul(per_block) > MAX_PREPARED {
        return Err(format!(
            "{per_block} descriptors per block over {blocks} blocks: not prepared"
        ));
    }
    Ok(())
}

/// Prepares the lists of one link with `peer` (whose cache is `remote`), reading head
/// slice `slice` into `own`. On error nothing stays prepared.
pub fn prepare<T: Transport>(
    transport: &mut T,
    peer: PeerId,
    memory: MemoryKind,
    remote: &CacheSide<'_>,
    own: &CacheSide<'_>,
    slice: HeadSlice,
) -> Result<BlockLists, String> {
    // Both sides must share one pattern: the local pass sets it, the remote pass checks it.
    let mut pattern = None;
    let (nl, nr) = (own.spec().num_blocks(), remote.spec().num_blocks());
    let local = side_ranges(remote, own, slice, true, &mut pattern)?;
    let per_block = pattern.as_ref().map_or(0, |p| p.lens.len() as u64);
    check_size(per_block, u64::from(nl).saturating_add(u64::from(nr)))?;
    let remote_ranges = side_ranges(remote, own, slice, false, &mut pattern)?;
    let Some(p) = pattern else {
        return Err("no blocks".into());
    };
    let local_id = transport
        .prepare_local(memory, &local)
        .map_err(|e| e.to_string())?;
    let remote_id = match transport.prepare_remote(peer, memory, &remote_ranges) {
        Ok(id) => id,
        Err(e) => {
            let _ = transport.release_list(local_id);
            return Err(e.to_string());
        }
    };
    Ok(BlockLists {
        local: local_id,
        remote: remote_id,
        per_block: per_block as u32,
        blocks: (nl, nr),
        bytes_per_block: p.bytes,
        raw_per_block: p.raw,
    })
}

impl BlockLists {
    /// Fills `local_idx` and `remote_idx` for reading `src` remote blocks into `dst` local
    /// blocks, or names the first block out of range.
    pub fn indices(
        &self,
        src: &[u32],
        dst: &[u32],
        local_idx: &mut Vec<u32>,
        remote_idx: &mut Vec<u32>,
    ) -> Result<(), String> {
        local_idx.clear();
        remote_idx.clear();
        let k = self.per_block;
        for (&s, &d) in src.iter().zip(dst) {
            if s >= self.blocks.1 || d >= self.blocks.0 {
                return Err(format!(
                    "block pair {s} -> {d} out of range ({} remote, {} local blocks)",
                    self.blocks.1, self.blocks.0
                ));
            }
            // In range: blocks × k ≤ MAX_PREPARED was checked when the lists were made.
            remote_idx.extend((0..k).map(|j| s.saturating_mul(k).saturating_add(j)));
            local_idx.extend((0..k).map(|j| d.saturating_mul(k).saturating_add(j)));
        }
        Ok(())
    }
}

/// True when coalescing would save less than a tenth of a request's descriptors (block
/// pairs contiguous on both sides are what merges): indexed posts are then the cheaper way.
pub fn fragmented(src: &[u32], dst: &[u32]) -> bool {
    let changes = src
        .windows(2)
        .zip(dst.windows(2))
        .filter(|(s, d)| !(s[1] == s[0].wrapping_add(1) && d[1] == d[0].wrapping_add(1)))
        .count();
    let runs = changes.saturating_add(1);
    runs.saturating_mul(10) > src.len().saturating_mul(9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_up_to_max_prepared_descriptors_are_prepared_and_no_more() {
        assert_eq!(check_size(1, MAX_PREPARED), Ok(()));
        assert_eq!(check_size(4, MAX_PREPARED / 4), Ok(()));
        assert!(check_size(1, MAX_PREPARED + 1).is_err());
        assert!(check_size(4, MAX_PREPARED / 4 + 1).is_err());
        assert!(
            check_size(u64::MAX, u64::MAX).is_err(),
            "saturates, no wrap"
        );
        assert!(check_size(0, 8).is_err(), "blocks without descriptors");
    }

    #[test]
    fn fragmented_tells_runs_from_scatter() {
        assert!(!fragmented(&[1, 2, 3, 4], &[7, 8, 9, 10]));
        assert!(fragmented(&[3, 4, 9], &[0, 7, 8]));
        assert!(fragmented(&[5], &[1]));
        assert!(!fragmented(&[1, 2, 5, 6], &[1, 2, 9, 10]));
        assert!(fragmented(&[1, 2, 3, 4], &[1, 3, 5, 7]));
        // One merge in ten pairs saves 10%: coalescing wins.
        let src: Vec<u32> = vec![0, 1, 5, 9, 13, 17, 21, 25, 29, 33];
        let dst: Vec<u32> = vec![0, 1, 3, 5, 7, 9, 11, 13, 15, 17];
        assert!(!fragmented(&src, &dst));
        let dst: Vec<u32> = vec![0, 2, 4, 6, 8, 10, 12, 14, 16, 18];
        assert!(fragmented(&src, &dst));
    }

    #[test]
    fn indices_follow_the_block_pattern_and_check_ranges() {
        let lists = BlockLists {
            local: DescListId(1),
            remote: DescListId(2),
            per_block: 2,
            blocks: (4, 8),
            bytes_per_block: 0,
            raw_per_block: 2,
        };
        let (mut l, mut r) = (Vec::new(), Vec::new());
        lists.indices(&[7, 0], &[1, 3], &mut l, &mut r).unwrap();
        assert_eq!(r, vec![14, 15, 0, 1]);
        assert_eq!(l, vec![2, 3, 6, 7]);
        assert!(lists.indices(&[8], &[0], &mut l, &mut r).is_err());
        assert!(lists.indices(&[0], &[4], &mut l, &mut r).is_err());
    }
}
