//! Plans between caches whose blocks hold different numbers of tokens (a prefill with
//! 16-token blocks, a decode with 32, or the reverse): the plan maps token ranges, not
//! block ids. The smaller block size divides the larger, as vLLM requires; the request's
//! tokens move in units of the smaller block, each unit a run of tokens inside one block on
//! each side.

use std::ops::Range;

use crate::error::{add, mul};
use crate::plan::{
    Emitter, Sweep, check_blocks, check_slice, check_unique, finish, shared_layers, sized,
};
use crate::{
    CacheKind, CacheSide, CacheSpec, HeadSlice, LayoutError, PlanOptions, Result, TransferPlan,
};

/// Which tokens a plan moves, and the blocks holding them on each side, in token order:
/// `src[i]` holds the request's tokens from `src_first + i * source tokens per block`, and
/// likewise `dst`. Each side's first token is a multiple of its block size.
#[derive(Debug, Clone)]
pub struct TokenPairs<'a> {
    /// Source blocks, in token order.
    pub src: &'a [u32],
    /// The request's token at the start of `src[0]`.
    pub src_first: u64,
    /// Destination blocks, in token order, each at most once.
    pub dst: &'a [u32],
    /// The request's token at the start of `dst[0]`.
    pub dst_first: u64,
    /// The tokens moved, `[start, end)`. Moved in whole units of the smaller block size: a
    /// range that starts or ends inside a unit moves that unit's other tokens too (they lie
    /// in the same blocks on both sides).
    pub tokens: Range<u64>,
}

/// The unit of tokens two block sizes share: the smaller, when it divides the larger.
pub fn shared_unit(src_tokens: u32, dst_tokens: u32) -> Result<u32> {
    let (small, large) = (src_tokens.min(dst_tokens), src_tokens.max(dst_tokens));
    if large.checked_rem(small) != Some(0) {
        return Err(LayoutError::Unsupported(format!(
            "tokens per block {src_tokens} and {dst_tokens}: the smaller must divide the larger"
        )));
    }
    Ok(small)
}

/// Why a cache of `kind` moves whole blocks only, where it does: the token ranges of its
/// blocks are not what this crate's model of them says.
pub fn whole_blocks_only(kind: CacheKind) -> Option<&'static str> {
    match kind {
        // vLLM's CPU cache: its attention kernel lays out each head's block itself (K and V
        // apart, K in the kernel's own order), so a run of tokens is not a run of bytes.
        CacheKind::PackedKv => {
            Some("a packed K/V cache (vLLM's CPU cache) is not addressable by token")
        }
        CacheKind::CrossLayer => Some("a cross-layer cache interleaves layers inside each block"),
        CacheKind::State => Some("a state cache holds a request's state, not its tokens"),
        CacheKind::SplitKv | CacheKind::JointKv | CacheKind::Mla => None,
    }
}

/// The pieces of one unit of `unit` tokens in one block part, and the bytes between two
/// tokens' starts on each side (where a unit begins inside its block).
fn unit_sweep(
    src: &CacheSpec,
    dst: &CacheSpec,
    slice: HeadSlice,
    unit: u32,
) -> Result<(Sweep, u64, u64)> {
    check_slice(src, dst, slice)?;
    if let Some(why) = whole_blocks_only(src.kind()) {
        return Err(LayoutError::Unsupported(format!(
            "{why}: both sides need the same block size"
        )));
    }
    let hb = src.head_token_bytes();
    let count = u64::from(slice.count);
    let what = "unit bytes";
    if src.is_head_major() {
        // [heads, tokens, bytes]: one piece per head, each `unit` tokens long; a head's
        // tokens span a whole block on each side, so the strides differ.
        let (sh, dh) = (
            mul(src.tokens_per_block().into(), hb, what)?,
            mul(dst.tokens_per_block().into(), hb, what)?,
        );
        let sweep = Sweep::Tokens {
            src_off: mul(slice.src_first.into(), sh, what)?,
            dst_off: mul(slice.dst_first.into(), dh, what)?,
            src_stride: sh,
            dst_stride: dh,
            len: mul(unit.into(), hb, what)?,
            count: slice.count,
        };
        return Ok((sweep, hb, hb));
    }
    // [tokens, heads, bytes] (NHD; MLA's one latent vector per token alike).
    let len = mul(count, hb, what)?;
    let src_stride = mul(src.kv_heads().into(), hb, what)?;
    let dst_stride = mul(dst.kv_heads().into(), hb, what)?;
    let sweep = if len == src_stride && len == dst_stride {
        Sweep::Whole {
            src_off: 0,
            dst_off: 0,
            len: mul(len, unit.into(), what)?,
        }
    } else {
        Sweep::Tokens {
            src_off: mul(slice.src_first.into(), hb, what)?,
            dst_off: mul(slice.dst_first.into(), hb, what)?,
            src_stride,
            dst_stride,
            len,
            count: unit,
        }
    };
    Ok((sweep, src_stride, dst_stride))
}

/// The index in `blocks` of the block holding `token`, refused when the list does not reach
/// it.
fn block_of(
    token: u64,
    first: u64,
    per_block: u32,
    blocks: &[u32],
    what: &'static str,
) -> Result<u64> {
    let index = token
        .checked_sub(first)
        .ok_or(LayoutError::OutOfRange {
            what,
            index: token,
            limit: first,
        })?
        .checked_div(u64::from(per_block))
        .ok_or(LayoutError::Zero {
            field: "tokens per block",
        })?;
    if index >= blocks.len() as u64 {
        return Err(LayoutError::OutOfRange {
            what,
            index,
            limit: blocks.len() as u64,
        });
    }
    Ok(index)
}

/// One side's listed blocks, as a unit's address is computed from them.
struct Listed<'a> {
    blocks: &'a [u32],
    first: u64,
    per_block: u32,
    block_len: u64,
    token_bytes: u64,
}

impl Listed<'_> {
    /// Where the unit starting at `token` begins in the part at `base` (block 0's address).
    fn address(&self, base: u64, token: u64) -> Result<u64> {
        let what = "unit address";
        let rel = token
            .checked_sub(self.first)
            .ok_or(LayoutError::Overflow { what })?;
        let per = u64::from(self.per_block);
        let (Some(index), Some(within)) = (rel.checked_div(per), rel.checked_rem(per)) else {
            return Err(LayoutError::Zero {
                field: "tokens per block",
            });
        };
        let block = usize::try_from(index)
            .ok()
            .and_then(|i| self.blocks.get(i))
            .ok_or(LayoutError::OutOfRange {
                what: "block of token",
                index,
                limit: self.blocks.len() as u64,
            })?;
        let at = add(
            mul(u64::from(*block), self.block_len, what)?,
            mul(within, self.token_bytes, what)?,
            what,
        )?;
        add(base, at, what)
    }
}

/// Plans moving the head slice `slice` of `pairs.tokens` from `src` to `dst`, for every layer
/// both sides hold, where the two sides' blocks may hold different numbers of tokens (equal
/// sizes work too, in units of a whole block). Every descriptor lies inside both sides'
/// regions and inside the listed blocks. On error `plan` is left empty.
pub fn plan_token_transfer_into(
    src: &CacheSide<'_>,
    dst: &CacheSide<'_>,
    slice: HeadSlice,
    pairs: &TokenPairs<'_>,
    options: PlanOptions,
    plan: &mut TransferPlan,
) -> Result<()> {
    plan.clear();
    let (sspec, dspec) = (src.spec(), dst.spec());
    let (sb, db) = (sspec.tokens_per_block(), dspec.tokens_per_block());
    let unit = shared_unit(sb, db)?;
    let (sweep, s_tok, d_tok) = unit_sweep(sspec, dspec, slice, unit)?;
    check_blocks(pairs.src, sspec.num_blocks(), "source block")?;
    check_blocks(pairs.dst, dspec.num_blocks(), "destination block")?;
    check_unique(pairs.dst, "destination blocks")?;
    for (first, per_block, what) in [
        (pairs.src_first, sb, "source first token"),
        (pairs.dst_first, db, "destination first token"),
    ] {
        if first.checked_rem(u64::from(per_block)) != Some(0) {
            return Err(LayoutError::Unsupported(format!(
                "{what} {first} does not start a {per_block}-token block"
            )));
        }
    }
    let Range { start, end } = pairs.tokens;
    if start >= end {
        return Ok(());
    }
    let u = u64::from(unit);
    // `unit` is not zero (`shared_unit`).
    let (first_unit, end_unit) = (start.checked_div(u).unwrap_or(0), end.div_ceil(u));
    // The first and last units' blocks on both sides bound every unit's.
    let last = mul(end_unit.saturating_sub(1), u, "token")?;
    let first_token = mul(first_unit, u, "token")?;
    for token in [first_token, last] {
        block_of(
            token,
            pairs.src_first,
            sb,
            pairs.src,
            "source block of token",
        )?;
        block_of(
            token,
            pairs.dst_first,
            db,
            pairs.dst,
            "destination block of token",
        )?;
    }
    let (layers_first, layers_end) = shared_layers(src, dst)?;
    let parts = sspec.parts();
    let units = mul(
        end_unit.saturating_sub(first_unit),
        u64::from(layers_end.saturating_sub(layers_first)),
        "plan size",
    )?;
    let (raw_count, total_bytes) = sized(units, parts.len(), sweep, options)?;
    plan.reserve(raw_count as usize);
    let mut emitter = Emitter::new(plan, options.coalesce);
    let source = Listed {
        blocks: pairs.src,
        first: pairs.src_first,
        per_block: sb,
        block_len: sspec.block_len(),
        token_bytes: s_tok,
    };
    let dest = Listed {
        blocks: pairs.dst,
        first: pairs.dst_first,
        per_block: db,
        block_len: dspec.block_len(),
        token_bytes: d_tok,
    };
    for layer in layers_first..layers_end {
        for &part in parts {
            let (sbase, dbase) = (src.part_base(layer, part)?, dst.part_base(layer, part)?);
            for k in first_unit..end_unit {
                let token = k.saturating_mul(u);
                match (source.address(sbase, token), dest.address(dbase, token)) {
                    (Ok(s), Ok(d)) => emitter.emit_at(sweep, s, d),
                    (Err(e), _) | (_, Err(e)) => {
                        plan.clear();
                        return Err(e);
                    }
                }
            }
        }
    }
    let sorted = emitter.sorted();
    finish(plan, sorted, options, raw_count, total_bytes);
    Ok(())
}

/// Like [`plan_token_transfer_into`], into a new plan.
pub fn plan_token_transfer(
    src: &CacheSide<'_>,
    dst: &CacheSide<'_>,
    slice: HeadSlice,
    pairs: &TokenPairs<'_>,
    options: PlanOptions,
) -> Result<TransferPlan> {
    let mut plan = TransferPlan::default();
    plan_token_transfer_into(src, dst, slice, pairs, options, &mut plan)?;
    Ok(plan)
}
