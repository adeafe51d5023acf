//! Transfer plans: the `(src, dst, len)` descriptors that move a request's blocks from
//! one rank's cache to another's, coalesced to the fewest possible.

use crate::coalesce::coalesce;
use crate::error::{add, in_range, mul};
use crate::{
    BlockOrder, CacheKind, CacheSpec, Descriptor, HeadSlice, LayerRange, LayoutError, Part, Result,
};

/// Default bound on the descriptors one plan may hold (384 MiB of descriptors): a request
/// asking for more is refused before anything is allocated.
pub const DEFAULT_MAX_DESCRIPTORS: u64 = 1 << 24;

/// One rank's cache as the planner sees it: a spec, the base address of each region, and
/// the global layers the rank holds (a pipeline stage holds a subset).
#[derive(Debug, Clone, Copy)]
pub struct CacheSide<'a> {
    spec: &'a CacheSpec,
    bases: &'a [u64],
    layers: LayerRange,
}

impl<'a> CacheSide<'a> {
    /// Validates that there is one base per region, that no region wraps around the address
    /// space, and that no two regions overlap. `first_layer` is the global index of the
    /// spec's layer 0.
    pub fn new(spec: &'a CacheSpec, bases: &'a [u64], first_layer: u32) -> Result<Self> {
        if bases.len() != spec.num_regions() as usize {
            return Err(LayoutError::LengthMismatch {
                what: "region base addresses vs regions",
                left: bases.len(),
                right: spec.num_regions() as usize,
            });
        }
        for &base in bases {
            add(base, spec.region_len(), "region end address")?;
        }
        let mut order: Vec<usize> = (0..bases.len()).collect();
        order.sort_unstable_by_key(|&i| bases[i]);
        for w in order.windows(2) {
            if add(bases[w[0]], spec.region_len(), "region end address")? > bases[w[1]] {
                return Err(LayoutError::Overlap {
                    what: "registered regions",
                    first: w[0],
                    second: w[1],
                });
            }
        }
        let end = first_layer.checked_add(spec.num_layers());
        if end.is_none() {
            return Err(LayoutError::Overflow {
                what: "layer range",
            });
        }
        Ok(CacheSide {
            spec,
            bases,
            layers: LayerRange {
                first: first_layer,
                count: spec.num_layers(),
            },
        })
    }

    /// The spec.
    pub fn spec(&self) -> &'a CacheSpec {
        self.spec
    }

    /// Region base addresses.
    pub fn bases(&self) -> &'a [u64] {
        self.bases
    }

    /// Global layers held.
    pub fn layers(&self) -> LayerRange {
        self.layers
    }

    /// True when every byte of `[addr, addr + len)` lies in registered regions (a range
    /// may span regions that are adjacent in memory, as coalesced descriptors do). An
    /// empty range is contained when `addr` lies in a region or at its end.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        if len == 0 {
            // An empty range is inside a region when its address is, ends included.
            return self
                .bases
                .iter()
                .any(|&b| addr >= b && addr <= self.region_end(b));
        }
        let mut regions: Vec<u64> = self.bases.to_vec();
        regions.sort_unstable();
        let mut covered = addr;
        for base in regions {
            // Regions in address order: one starting at or before the covered end extends it.
            if base <= covered {
                covered = covered.max(self.region_end(base));
            }
            if covered >= end {
                return true;
            }
        }
        false
    }

    /// One past the last byte of the region at `base`. `new` checked that it fits, so
    /// saturating never changes the value.
    fn region_end(&self, base: u64) -> u64 {
        base.saturating_add(self.spec.region_len())
    }

    /// Absolute address of `part` of a global layer's block 0.
    pub(crate) fn part_base(&self, global_layer: u32, part: Part) -> Result<u64> {
        let layer = global_layer
            .checked_sub(self.layers.first)
            .ok_or(LayoutError::OutOfRange {
                what: "layer below the side's first",
                index: global_layer.into(),
                limit: self.layers.first.into(),
            })?;
        let loc = self.spec.locate(layer, part)?;
        add(
            self.bases[loc.region as usize],
            loc.offset_in_block,
            "part address",
        )
    }
}

/// Which blocks a plan moves.
#[derive(Debug, Clone, Copy)]
pub struct BlockPairs<'a> {
    /// Source block ids.
    pub src: &'a [u32],
    /// Destination block ids, one per source block, each at most once.
    pub dst: &'a [u32],
    /// Optional attention window (in blocks) per global layer: a layer with window `w`
    /// moves only the last `w` pairs. Indexed by global layer; must cover every layer moved.
    pub windows: Option<&'a [Option<u32>]>,
}

/// Options of the planner.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// Merge contiguous descriptors (on by default; off gives the raw per-block or
    /// per-token descriptors, for comparison and tests).
    pub coalesce: bool,
    /// Refuse plans with more raw descriptors than this.
    pub max_descriptors: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            coalesce: true,
            max_descriptors: DEFAULT_MAX_DESCRIPTORS,
        }
    }
}

/// Descriptor lengths of a plan: one length for all (the common case, and what lets a
/// 131,072-descriptor plan stay in cache), or one per descriptor once merges made them differ.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Lens {
    Uniform(u64),
    Each(Vec<u64>),
}

/// A transfer plan, stored as parallel arrays of source and destination addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    src: Vec<u64>,
    dst: Vec<u64>,
    lens: Lens,
    /// How many descriptors the plan has before coalescing.
    pub raw_count: u64,
    /// Bytes moved.
    pub total_bytes: u64,
}

impl Default for TransferPlan {
    fn default() -> Self {
        TransferPlan {
            src: Vec::new(),
            dst: Vec::new(),
            lens: Lens::Uniform(0),
            raw_count: 0,
            total_bytes: 0,
        }
    }
}

impl TransferPlan {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.src.len()
    }

    /// True when the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }

    /// Source addresses, one per descriptor.
    pub fn src_addrs(&self) -> &[u64] {
        &self.src
    }

    /// Destination addresses, one per descriptor.
    pub fn dst_addrs(&self) -> &[u64] {
        &self.dst
    }

    /// The length shared by every descriptor, when they all have the same one.
    pub fn uniform_len(&self) -> Option<u64> {
        match self.lens {
            Lens::Uniform(l) => Some(l),
            Lens::Each(_) => None,
        }
    }

    /// Length of descriptor `i`.
    pub fn len_of(&self, i: usize) -> u64 {
        match &self.lens {
            Lens::Uniform(l) => *l,
            Lens::Each(v) => v[i],
        }
    }

    /// Descriptor `i`.
    pub fn get(&self, i: usize) -> Option<Descriptor> {
        Some(Descriptor {
            src: *self.src.get(i)?,
            dst: self.dst[i],
            len: self.len_of(i),
        })
    }

    /// The descriptors in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Descriptor> + '_ {
        (0..self.len()).map(|i| Descriptor {
            src: self.src[i],
            dst: self.dst[i],
            len: self.len_of(i),
        })
    }

    /// The descriptors as a vector.
    pub fn descriptors(&self) -> Vec<Descriptor> {
        self.iter().collect()
    }

    pub(crate) fn clear(&mut self) {
        self.src.clear();
        self.dst.clear();
        self.lens = Lens::Uniform(0);
        self.raw_count = 0;
        self.total_bytes = 0;
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.src.reserve(n);
        self.dst.reserve(n);
    }

    /// Appends lengths for `n` new descriptors of `len` bytes.
    #[inline]
    fn push_lens(&mut self, len: u64, n: usize) {
        if let Lens::Uniform(l) = self.lens {
            if l == len {
                return;
            }
        }
        self.push_lens_slow(len, n);
    }

    #[cold]
    fn push_lens_slow(&mut self, len: u64, n: usize) {
        // The `n` new addresses are already pushed, so `total >= n`.
        let total = self.len();
        let before = total.saturating_sub(n);
        match &mut self.lens {
            Lens::Uniform(l) if *l == len || before == 0 => *l = len,
            Lens::Uniform(l) => {
                let mut each = vec![*l; before];
                each.resize(total, len);
                self.lens = Lens::Each(each);
            }
            Lens::Each(v) => v.resize(total, len),
        }
    }

    #[inline]
    fn push(&mut self, d: Descriptor) {
        self.src.push(d.src);
        self.dst.push(d.dst);
        self.push_lens(d.len, 1);
    }

    /// Sets the last descriptor's length (after a merge); no-op on an empty plan.
    fn set_last_len(&mut self, len: u64) {
        let total = self.len();
        let Some(i) = total.checked_sub(1) else {
            return;
        };
        match &mut self.lens {
            Lens::Uniform(l) if i == 0 => *l = len,
            Lens::Uniform(l) => {
                let mut each = vec![*l; total];
                each[i] = len;
                self.lens = Lens::Each(each);
            }
            Lens::Each(v) => v[i] = len,
        }
    }

    pub(crate) fn replace(&mut self, descs: &[Descriptor]) {
        let (raw, bytes) = (self.raw_count, self.total_bytes);
        self.clear();
        self.reserve(descs.len());
        for &d in descs {
            self.push(d);
        }
        self.raw_count = raw;
        self.total_bytes = bytes;
    }
}

/// How one head slice sits inside one part of one block on both sides.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sweep {
    /// One contiguous piece per block part.
    Whole {
        src_off: u64,
        dst_off: u64,
        len: u64,
    },
    /// One piece per token, `count` tokens.
    Tokens {
        src_off: u64,
        dst_off: u64,
        src_stride: u64,
        dst_stride: u64,
        len: u64,
        count: u32,
    },
}

impl Sweep {
    pub(crate) fn pieces(&self) -> u64 {
        match self {
            Sweep::Whole { .. } => 1,
            Sweep::Tokens { count, .. } => (*count).into(),
        }
    }

    pub(crate) fn bytes(&self) -> Result<u64> {
        match self {
            Sweep::Whole { len, .. } => Ok(*len),
            Sweep::Tokens { len, count, .. } => mul(*len, (*count).into(), "sweep bytes"),
        }
    }
}

fn require_equal<T: PartialEq + std::fmt::Display>(
    field: &'static str,
    src: T,
    dst: T,
) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(LayoutError::Mismatch {
            field,
            source_value: src.to_string(),
            dest_value: dst.to_string(),
        })
    }
}

fn sweep_for(src: &CacheSpec, dst: &CacheSpec, slice: HeadSlice) -> Result<Sweep> {
    check_slice(src, dst, slice)?;
    require_equal(
        "tokens per block",
        src.tokens_per_block(),
        dst.tokens_per_block(),
    )?;
    let hb = src.head_token_bytes();
    let tokens = u64::from(src.tokens_per_block());
    let count = u64::from(slice.count);
    // All products below are bounded by the part block length, which the spec checked;
    // they are checked again because a peer's spec reaches here.
    let what = "head slice bytes";
    let sweep = if src.is_head_major() || matches!(src.kind(), CacheKind::Mla | CacheKind::State) {
        let head_bytes = mul(tokens, hb, what)?;
        Sweep::Whole {
            src_off: mul(slice.src_first.into(), head_bytes, what)?,
            dst_off: mul(slice.dst_first.into(), head_bytes, what)?,
            len: mul(count, head_bytes, what)?,
        }
    } else {
        debug_assert_eq!(src.order(), BlockOrder::Nhd);
        let len = mul(count, hb, what)?;
        let src_stride = mul(src.kv_heads().into(), hb, what)?;
        let dst_stride = mul(dst.kv_heads().into(), hb, what)?;
        if len == src_stride && len == dst_stride {
            Sweep::Whole {
                src_off: 0,
                dst_off: 0,
                len: mul(len, tokens, what)?,
            }
        } else {
            Sweep::Tokens {
                src_off: mul(slice.src_first.into(), hb, what)?,
                dst_off: mul(slice.dst_first.into(), hb, what)?,
                src_stride,
                dst_stride,
                len,
                count: src.tokens_per_block(),
            }
        }
    };
    Ok(sweep)
}

/// Checks what both sides of any plan share (kind, dtype, head dim, in-block order) and
/// that the head slice lies inside both sides' heads.
pub(crate) fn check_slice(src: &CacheSpec, dst: &CacheSpec, slice: HeadSlice) -> Result<()> {
    require_equal("cache kind", src.kind(), dst.kind())?;
    require_equal("dtype", src.dtype(), dst.dtype())?;
    require_equal("head dim", src.head_dim(), dst.head_dim())?;
    if src.kind() != CacheKind::Mla {
        require_equal("in-block order", src.order(), dst.order())?;
    }
    if slice.count == 0 {
        return Err(LayoutError::Zero {
            field: "heads in slice",
        });
    }
    for (first, heads, what) in [
        (slice.src_first, src.kv_heads(), "source head slice end"),
        (
            slice.dst_first,
            dst.kv_heads(),
            "destination head slice end",
        ),
    ] {
        // Two u32 values: the sum fits in u64.
        let end = u64::from(first).saturating_add(slice.count.into());
        if end > u64::from(heads) {
            return Err(LayoutError::OutOfRange {
                what,
                index: end.saturating_sub(1),
                limit: heads.into(),
            });
        }
    }
    Ok(())
}

pub(crate) fn check_blocks(blocks: &[u32], limit: u32, what: &'static str) -> Result<()> {
    for &b in blocks {
        in_range(b.into(), limit.into(), what)?;
    }
    Ok(())
}

pub(crate) fn check_unique(blocks: &[u32], what: &'static str) -> Result<()> {
    if blocks.windows(2).all(|w| w[0] < w[1]) {
        return Ok(());
    }
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(LayoutError::DuplicateBlock { what, block: w[0] }),
        None => Ok(()),
    }
}

/// The pairs a layer moves: the last `window` pairs, or all.
fn layer_pairs(pairs: &BlockPairs<'_>, layer: u32) -> Result<std::ops::Range<usize>> {
    let n = pairs.src.len();
    let Some(windows) = pairs.windows else {
        return Ok(0..n);
    };
    let window = windows.get(layer as usize).ok_or(LayoutError::OutOfRange {
        what: "layer without a window entry",
        index: layer.into(),
        limit: windows.len() as u64,
    })?;
    Ok(match window {
        Some(w) => n.saturating_sub(*w as usize)..n,
        None => 0..n,
    })
}

/// Plans moving the head slice `slice` of the given block pairs, for every layer both
/// sides hold, from `src` to `dst`. Every descriptor lies inside both sides' regions.
pub fn plan_transfer(
    src: &CacheSide<'_>,
    dst: &CacheSide<'_>,
    slice: HeadSlice,
    pairs: &BlockPairs<'_>,
    options: PlanOptions,
) -> Result<TransferPlan> {
    let mut plan = TransferPlan::default();
    plan_transfer_into(src, dst, slice, pairs, options, &mut plan)?;
    Ok(plan)
}

/// Like [`plan_transfer`], reusing `plan`'s descriptor buffer (connectors keep one per peer,
/// so steady-state planning allocates nothing). On error `plan` is left empty.
pub fn plan_transfer_into(
    src: &CacheSide<'_>,
    dst: &CacheSide<'_>,
    slice: HeadSlice,
    pairs: &BlockPairs<'_>,
    options: PlanOptions,
    plan: &mut TransferPlan,
) -> Result<()> {
    plan.clear();
    let sweep = sweep_for(src.spec, dst.spec, slice)?;
    if pairs.src.len() != pairs.dst.len() {
        return Err(LayoutError::LengthMismatch {
            what: "source vs destination blocks",
            left: pairs.src.len(),
            right: pairs.dst.len(),
        });
    }
    check_blocks(pairs.src, src.spec.num_blocks(), "source block")?;
    check_blocks(pairs.dst, dst.spec.num_blocks(), "destination block")?;
    check_unique(pairs.dst, "destination blocks")?;
    let (first, end) = shared_layers(src, dst)?;
    let parts = src.spec.parts();
    let mut units = 0u64;
    for layer in first..end {
        units = add(units, layer_pairs(pairs, layer)?.len() as u64, "plan size")?;
    }
    let (raw_count, total_bytes) = sized(units, parts.len(), sweep, options)?;
    plan.reserve(raw_count as usize);
    let mut emitter = Emitter::new(plan, options.coalesce);
    if src.spec.kind() == CacheKind::CrossLayer && pairs.windows.is_none() {
        // Every layer's page of a block sits in one run: block by block, layer by layer, the
        // descriptors come in destination order and merge as they are emitted, with no sort.
        // Layer `first + i` is `i` pages after layer `first` on each side (`locate`); the
        // last layer's base was checked, so no sum below exceeds it.
        let (part, layers) = (Part::PackedKv, end.saturating_sub(first));
        let (sfirst, dfirst) = (src.part_base(first, part)?, dst.part_base(first, part)?);
        src.part_base(end.saturating_sub(1), part)?;
        dst.part_base(end.saturating_sub(1), part)?;
        let (spage, dpage) = (src.spec.part_block_len(), dst.spec.part_block_len());
        for (sb, db) in pairs.src.iter().zip(pairs.dst) {
            for i in 0..u64::from(layers) {
                emitter.emit(
                    sweep,
                    (
                        sfirst.saturating_add(i.saturating_mul(spage)),
                        src.spec.block_len(),
                        std::slice::from_ref(sb),
                    ),
                    (
                        dfirst.saturating_add(i.saturating_mul(dpage)),
                        dst.spec.block_len(),
                        std::slice::from_ref(db),
                    ),
                );
            }
        }
    } else {
        for layer in first..end {
            let range = layer_pairs(pairs, layer)?;
            let (sblocks, dblocks) = (&pairs.src[range.clone()], &pairs.dst[range]);
            for &part in parts {
                let sbase = src.part_base(layer, part)?;
                let dbase = dst.part_base(layer, part)?;
                emitter.emit(
                    sweep,
                    (sbase, src.spec.block_len(), sblocks),
                    (dbase, dst.spec.block_len(), dblocks),
                );
            }
        }
    }
    let sorted = emitter.sorted;
    finish(plan, sorted, options, raw_count, total_bytes);
    Ok(())
}

/// The global layers both sides hold, `[first, end)`; refused when they share none.
pub(crate) fn shared_layers(src: &CacheSide<'_>, dst: &CacheSide<'_>) -> Result<(u32, u32)> {
    let first = src.layers.first.max(dst.layers.first);
    let end = src.layers.end().min(dst.layers.end());
    if first >= end {
        return Err(LayoutError::Unsupported(format!(
            "source layers {}..{} and destination layers {}..{} do not overlap",
            src.layers.first,
            src.layers.end(),
            dst.layers.first,
            dst.layers.end()
        )));
    }
    Ok((first, end))
}

/// The raw descriptors and bytes of a plan moving `units` (block or token unit, layer)
/// pairs of `parts` parts each, refused beyond `options.max_descriptors`.
pub(crate) fn sized(
    units: u64,
    parts: usize,
    sweep: Sweep,
    options: PlanOptions,
) -> Result<(u64, u64)> {
    let units = mul(units, parts as u64, "plan size")?;
    let raw_count = mul(units, sweep.pieces(), "plan size")?;
    if raw_count > options.max_descriptors {
        return Err(LayoutError::TooLarge {
            what: "descriptors in plan",
            value: raw_count,
            limit: options.max_descriptors,
        });
    }
    Ok((raw_count, mul(units, sweep.bytes()?, "plan bytes")?))
}

/// Completes an emitted plan: emitted in destination order, every neighbour pair was
/// already offered a merge, so the list is minimal; otherwise it is ordered and merged again.
pub(crate) fn finish(
    plan: &mut TransferPlan,
    sorted: bool,
    options: PlanOptions,
    raw_count: u64,
    total_bytes: u64,
) {
    if options.coalesce && !sorted {
        let mut descs = plan.descriptors();
        coalesce(&mut descs);
        plan.replace(&descs);
    }
    plan.raw_count = raw_count;
    plan.total_bytes = total_bytes;
}

/// Appends descriptors, merging when asked, and notes whether they stay in destination order.
pub(crate) struct Emitter<'a> {
    out: &'a mut TransferPlan,
    merge: bool,
    sorted: bool,
    /// The last descriptor as it now stands (after any merge), kept here so the hot path
    /// never reads it back from the plan's arrays.
    last: Option<Descriptor>,
}

impl<'a> Emitter<'a> {
    /// An emitter appending to `out` (left as it is), merging neighbours when `merge`.
    pub(crate) fn new(out: &'a mut TransferPlan, merge: bool) -> Self {
        Emitter {
            out,
            merge,
            sorted: true,
            last: None,
        }
    }

    /// True while every descriptor came in ascending destination order.
    pub(crate) fn sorted(&self) -> bool {
        self.sorted
    }

    /// Appends the first piece of a block; later pieces of the same block follow in
    /// ascending destination order and never continue each other.
    #[inline(always)]
    fn push_first(&mut self, desc: Descriptor) {
        if let Some(last) = self.last {
            self.sorted &= last.dst < desc.dst;
            let merged = if self.merge { last.merged(&desc) } else { None };
            if let Some(merged) = merged {
                self.out.set_last_len(merged.len);
                self.last = Some(merged);
                return;
            }
        }
        self.out.src.push(desc.src);
        self.out.dst.push(desc.dst);
        self.out.push_lens(desc.len, 1);
        self.last = Some(desc);
    }

    /// Emits the pieces of one (layer, part) for every block pair. Addresses cannot
    /// overflow: `CacheSide::new` checked every region end, and blocks and slices were
    /// range-checked, so every address lies inside a registered region. This loop is the
    /// whole cost of planning, so it alone keeps plain `+` and `*`.
    #[inline]
    #[allow(clippy::arithmetic_side_effects)]
    fn emit(
        &mut self,
        sweep: Sweep,
        (sbase, sblock, sblocks): (u64, u64, &[u32]),
        (dbase, dblock, dblocks): (u64, u64, &[u32]),
    ) {
        for (&sb, &db) in sblocks.iter().zip(dblocks) {
            let s = sbase + u64::from(sb) * sblock;
            let d = dbase + u64::from(db) * dblock;
            self.emit_at(sweep, s, d);
        }
    }

    /// Emits the pieces of one block part (or unit of tokens) at `s` → `d`. The callers
    /// checked that every piece lies inside a registered region (see `emit`).
    #[inline(always)]
    #[allow(clippy::arithmetic_side_effects)]
    pub(crate) fn emit_at(&mut self, sweep: Sweep, s: u64, d: u64) {
        match sweep {
            Sweep::Whole {
                src_off,
                dst_off,
                len,
            } => {
                self.push_first(Descriptor {
                    src: s + src_off,
                    dst: d + dst_off,
                    len,
                });
            }
            Sweep::Tokens {
                src_off,
                dst_off,
                src_stride,
                dst_stride,
                len,
                count,
            } => {
                let (s, d) = (s + src_off, d + dst_off);
                self.push_first(Descriptor {
                    src: s,
                    dst: d,
                    len,
                });
                // Running sums, not `t * stride`: 64-bit vector multiplies are slow on
                // baseline x86-64, and this loop is the whole cost of big NHD plans.
                let rest = count as usize - 1;
                if rest == 0 {
                    return;
                }
                let (mut sa, mut da) = (s, d);
                self.out.src.extend((0..rest).map(|_| {
                    sa += src_stride;
                    sa
                }));
                self.out.dst.extend((0..rest).map(|_| {
                    da += dst_stride;
                    da
                }));
                self.out.push_lens(len, rest);
                self.last = Some(Descriptor {
                    src: sa,
                    dst: da,
                    len,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockOrder, CacheParams, Dtype};

    /// Split K/V, one layer: two regions of 4 blocks of 16 bytes (64 bytes each).
    fn spec() -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: 1,
            kv_heads: 1,
            head_dim: 4,
            tokens_per_block: 2,
            num_blocks: 4,
        })
        .unwrap()
    }

    #[test]
    fn contains_covers_exactly_the_registered_bytes() {
        let spec = spec();
        assert_eq!(spec.region_len(), 64);
        // Adjacent regions [1000, 1064) and [1064, 1128), listed out of address order.
        let bases = [1064, 1000];
        let side = CacheSide::new(&spec, &bases, 0).unwrap();
        assert_eq!(side.bases(), &bases);
        assert!(side.contains(1000, 64));
        assert!(
            side.contains(1010, 100),
            "a range may span adjacent regions"
        );
        assert!(side.contains(1000, 128));
        assert!(!side.contains(1000, 129), "one byte past the last region");
        assert!(!side.contains(999, 2), "one byte before the first region");
        assert!(!side.contains(2000, 1));
        assert!(!side.contains(u64::MAX, 1), "the end overflows");
        // Regions with a gap between them: [1000, 1064) and [2000, 2064).
        let gapped = [1000, 2000];
        let side = CacheSide::new(&spec, &gapped, 0).unwrap();
        assert!(side.contains(2000, 64));
        assert!(side.contains(1063, 1));
        assert!(!side.contains(1063, 2), "a range may not span a gap");
        assert!(!side.contains(1064, 1));
        assert!(!side.contains(1030, 1000));
    }

    /// Plans blocks `src` → `dst` of the one-layer spec from regions at 1000 and 2000 into
    /// regions at 5000 and 6000, coalesced.
    fn plan(src: &[u32], dst: &[u32]) -> TransferPlan {
        let spec = spec();
        let (sb, db) = ([1000, 2000], [5000, 6000]);
        let pairs = BlockPairs {
            src,
            dst,
            windows: None,
        };
        plan_transfer(
            &CacheSide::new(&spec, &sb, 0).unwrap(),
            &CacheSide::new(&spec, &db, 0).unwrap(),
            HeadSlice {
                src_first: 0,
                dst_first: 0,
                count: 1,
            },
            &pairs,
            PlanOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn a_plan_reads_back_as_the_descriptors_it_holds() {
        assert!(TransferPlan::default().is_empty());
        // Blocks 0 → 1 and 2 → 3 of K (region 0), then of V (region 1): 16 bytes each.
        let p = plan(&[0, 2], &[1, 3]);
        assert!(!p.is_empty());
        assert_eq!(p.len(), 4);
        assert_eq!(p.src_addrs(), &[1000, 1032, 2000, 2032]);
        assert_eq!(p.dst_addrs(), &[5016, 5048, 6016, 6048]);
        assert_eq!(p.uniform_len(), Some(16));
        assert_eq!(p.len_of(3), 16);
        let d = |src, dst, len| Descriptor { src, dst, len };
        assert_eq!(p.get(1), Some(d(1032, 5048, 16)));
        assert_eq!(p.get(4), None);
        let all = vec![
            d(1000, 5016, 16),
            d(1032, 5048, 16),
            d(2000, 6016, 16),
            d(2032, 6048, 16),
        ];
        assert_eq!(p.descriptors(), all);
        assert_eq!(p.iter().collect::<Vec<_>>(), all);
        assert_eq!((p.raw_count, p.total_bytes), (4, 64));
    }

    #[test]
    fn a_plan_merged_into_one_descriptor_keeps_one_length() {
        // Adjacent regions on both sides and every block in order: one descriptor.
        let spec = spec();
        let (sb, db) = ([1000, 1064], [5000, 5064]);
        let pairs = BlockPairs {
            src: &[0, 1, 2, 3],
            dst: &[0, 1, 2, 3],
            windows: None,
        };
        let slice = HeadSlice {
            src_first: 0,
            dst_first: 0,
            count: 1,
        };
        let src = CacheSide::new(&spec, &sb, 0).unwrap();
        let dst = CacheSide::new(&spec, &db, 0).unwrap();
        let p = plan_transfer(&src, &dst, slice, &pairs, PlanOptions::default()).unwrap();
        assert_eq!(
            p.descriptors(),
            vec![Descriptor {
                src: 1000,
                dst: 5000,
                len: 128
            }]
        );
        assert_eq!(p.uniform_len(), Some(128));
    }

    #[test]
    fn merged_descriptors_keep_their_own_lengths() {
        // Blocks 0, 1 → 0, 1 merge into 32 bytes; block 3 → 2 continues only the
        // destination, so it stays a 16-byte descriptor of its own.
        let p = plan(&[0, 1, 3], &[0, 1, 2]);
        assert_eq!(p.uniform_len(), None);
        assert_eq!(
            (0..p.len()).map(|i| p.len_of(i)).collect::<Vec<_>>(),
            vec![32, 16, 32, 16]
        );
        assert_eq!(p.src_addrs(), &[1000, 1048, 2000, 2048]);
        assert_eq!(p.dst_addrs(), &[5000, 5032, 6000, 6032]);
        assert_eq!((p.raw_count, p.total_bytes), (6, 96));
    }

    #[test]
    fn an_empty_range_is_contained_only_at_a_region() {
        let spec = spec();
        let bases = [1000, 2000];
        let side = CacheSide::new(&spec, &bases, 0).unwrap();
        assert!(side.contains(1000, 0));
        assert!(
            side.contains(1064, 0),
            "a region's end is its last boundary"
        );
        assert!(side.contains(2030, 0));
        assert!(!side.contains(999, 0));
        assert!(!side.contains(1065, 0));
        assert!(!side.contains(5000, 0));
    }
}
