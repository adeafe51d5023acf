//! Turning `kvxfer-layout` plans into the local/remote range lists a transport posts: the
//! step both connectors take before posting (the pull decode's READs, the push prefill's
//! WRITEs), for one block table or for each KV cache group of a hybrid model.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{
    BlockPairs, CacheSide, CacheSpec, Descriptor, HeadSlice, LayerGroups, LayoutError, PlanOptions,
    TransferPlan, plan_transfer_into,
};

use crate::transport::{AddrRange, Op};

/// A transfer's local and remote address ranges, in posting order.
pub type Ranges = (Vec<AddrRange>, Vec<AddrRange>);

/// What a transfer's plans moved, summed over them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Planned {
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors before coalescing.
    pub raw: u64,
    /// Descriptors posted.
    pub descriptors: u64,
}

/// Builds one transfer's range lists from one or more plans: each is planned into the
/// reused `plan`, its ranges appended for `op`, its sizes summed in `planned`.
pub struct Planner<'a> {
    /// READ (the destination is local) or WRITE (the source is).
    pub op: Op,
    /// Reused plan storage.
    pub plan: &'a mut TransferPlan,
    /// The transfer's ranges, appended to.
    pub ranges: &'a mut Ranges,
    /// What was planned so far.
    pub planned: Planned,
}

/// Two caches in the same KV cache groups (checked before: a handshake, a registration),
/// each as its spec and region bases.
pub struct Grouped<'a> {
    /// The groups of both caches.
    pub groups: &'a LayerGroups,
    /// Where blocks move from.
    pub src: (&'a CacheSpec, &'a [u64]),
    /// Where blocks move to.
    pub dst: (&'a CacheSpec, &'a [u64]),
    /// The heads a rank's page holds: a state group's page moves only whole.
    pub rank_heads: u32,
}

impl<'a> Planner<'a> {
    /// A planner that starts `ranges` afresh.
    pub fn new(op: Op, plan: &'a mut TransferPlan, ranges: &'a mut Ranges) -> Self {
        ranges.0.clear();
        ranges.1.clear();
        Planner {
            op,
            plan,
            ranges,
            planned: Planned::default(),
        }
    }

    /// Plans heads `slice` of `pairs` from `src` to `dst` and appends the ranges.
    pub fn add(
        &mut self,
        src: &CacheSide<'_>,
        dst: &CacheSide<'_>,
        slice: HeadSlice,
        pairs: &BlockPairs<'_>,
    ) -> Result<(), String> {
        plan_transfer_into(src, dst, slice, pairs, PlanOptions::default(), self.plan)
            .map_err(|e| e.to_string())?;
        self.appended();
        Ok(())
    }

    /// Appends the ranges of the plan just made in [`Planner::plan`] and sums its sizes.
    pub fn appended(&mut self) {
        append_for(
            self.op,
            self.plan.iter(),
            &mut self.ranges.0,
            &mut self.ranges.1,
        );
        let p = &mut self.planned;
        p.bytes = p.bytes.saturating_add(self.plan.total_bytes);
        p.raw = p.raw.saturating_add(self.plan.raw_count);
        p.descriptors = p.descriptors.saturating_add(self.plan.len() as u64);
    }

    /// Plans KV cache group `g`'s `blocks` (source, destination) through that group's layers
    /// alone. Groups span the whole model on both sides. A state group's page (Mamba) moves
    /// whole, rank to rank (equal TP sizes only, checked before): `slice` must be the whole
    /// rank, and moves as one "head" of a page's bytes.
    pub fn add_group(
        &mut self,
        caches: &Grouped<'_>,
        g: usize,
        slice: HeadSlice,
        blocks: (&[u32], &[u32]),
    ) -> Result<(), String> {
        let layout = |e: LayoutError| format!("KV cache group {g}: {e}");
        let groups = caches.groups;
        let (sspec, sbases) = groups
            .group_side(g, caches.src.0, caches.src.1)
            .map_err(layout)?;
        let (dspec, dbases) = groups
            .group_side(g, caches.dst.0, caches.dst.1)
            .map_err(layout)?;
        let slice = if groups.is_state(g) {
            let whole = HeadSlice {
                src_first: 0,
                dst_first: 0,
                count: caches.rank_heads,
            };
            if slice != whole {
                return Err(format!(
                    "KV cache group {g}: state pages move rank to rank whole, not heads {slice:?}"
                ));
            }
            HeadSlice { count: 1, ..whole }
        } else {
            slice
        };
        let src = CacheSide::new(&sspec, &sbases, 0).map_err(layout)?;
        let dst = CacheSide::new(&dspec, &dbases, 0).map_err(layout)?;
        let pairs = BlockPairs {
            src: blocks.0,
            dst: blocks.1,
            windows: None,
        };
        self.add(&src, &dst, slice, &pairs)
    }
}

/// Splits plan descriptors (source → destination) into the `(local, remote)` lists of a
/// transfer posted by `op`: a READ's local side is the destination, a WRITE's the source.
pub fn split_for(
    op: Op,
    descs: impl IntoIterator<Item = Descriptor>,
    local: &mut Vec<AddrRange>,
    remote: &mut Vec<AddrRange>,
) {
    local.clear();
    remote.clear();
    append_for(op, descs, local, remote);
}

/// Like [`split_for`], appending to the lists (one transfer built from several plans).
pub fn append_for(
    op: Op,
    descs: impl IntoIterator<Item = Descriptor>,
    local: &mut Vec<AddrRange>,
    remote: &mut Vec<AddrRange>,
) {
    for d in descs {
        let (src, dst) = (AddrRange::new(d.src, d.len), AddrRange::new(d.dst, d.len));
        let (l, r) = match op {
            Op::Read => (dst, src),
            Op::Write => (src, dst),
        };
        local.push(l);
        remote.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_puts_destination_locally() {
        let d = [Descriptor {
            src: 10,
            dst: 20,
            len: 5,
        }];
        let (mut l, mut r) = (Vec::new(), Vec::new());
        split_for(Op::Read, d, &mut l, &mut r);
        assert_eq!((l[0].addr, r[0].addr), (20, 10));
        split_for(Op::Write, d, &mut l, &mut r);
        assert_eq!((l[0].addr, r[0].addr), (10, 20));
        append_for(Op::Read, d, &mut l, &mut r);
        assert_eq!(l.iter().map(|x| x.addr).collect::<Vec<_>>(), [10, 20]);
        split_for(Op::Read, d, &mut l, &mut r);
        assert_eq!(l.len(), 1);
    }

    fn spec(layers: u32, heads: u32) -> CacheSpec {
        CacheSpec::new(kvxfer_layout::CacheParams {
            kind: kvxfer_layout::CacheKind::JointKv,
            order: kvxfer_layout::BlockOrder::Hnd,
            dtype: kvxfer_layout::Dtype::F16,
            num_layers: layers,
            kv_heads: heads,
            head_dim: 8,
            tokens_per_block: 4,
            num_blocks: 8,
        })
        .expect("spec")
    }

    /// Two groups of one layer each, the second a state group (Mamba beside attention):
    /// the attention group moves the slice asked, the state group its page whole; a slice
    /// of the state group's heads is refused, naming the group.
    #[test]
    fn each_group_moves_through_its_own_layers_and_state_pages_move_whole() {
        let s = spec(2, 2);
        let region = s.region_len();
        let n = u64::from(s.num_regions());
        let src: Vec<u64> = (0..n).map(|r| 0x10_0000 + r * region).collect();
        let dst: Vec<u64> = (0..n).map(|r| 0x90_0000 + r * region).collect();
        let groups = LayerGroups::new(vec![vec![0], vec![1]], 2)
            .expect("groups")
            .with_state(&[1])
            .expect("state");
        let caches = Grouped {
            groups: &groups,
            src: (&s, &src),
            dst: (&s, &dst),
            rank_heads: 2,
        };
        let whole = HeadSlice {
            src_first: 0,
            dst_first: 0,
            count: 2,
        };
        let (mut plan, mut ranges) = (TransferPlan::default(), (Vec::new(), Vec::new()));
        ranges.0.push(AddrRange::new(1, 1));
        let mut p = Planner::new(Op::Write, &mut plan, &mut ranges);
        p.add_group(&caches, 0, whole, (&[1], &[2]))
            .expect("attention group");
        let one = p.planned;
        assert_eq!(one.bytes, s.block_len(), "one layer's block");
        assert!(one.descriptors >= 1 && one.raw >= one.descriptors);
        p.add_group(&caches, 1, whole, (&[3], &[4]))
            .expect("state group");
        assert!(p.planned.bytes > one.bytes);
        assert!(p.planned.descriptors > one.descriptors);
        let half = HeadSlice { count: 1, ..whole };
        let e = p.add_group(&caches, 1, half, (&[3], &[4])).unwrap_err();
        assert!(e.contains("KV cache group 1: state pages"), "{e}");
        let descriptors = p.planned.descriptors as usize;
        // A WRITE's local side is the source: the stale range was dropped at the start.
        assert_eq!(ranges.0.len(), descriptors);
        assert!(
            ranges
                .0
                .iter()
                .all(|r| (0x10_0000..0x90_0000).contains(&r.addr))
        );
        assert!(ranges.1.iter().all(|r| r.addr >= 0x90_0000));
    }
}
