//! `kvxfer inspect`: the cache spec, regions, TP mapping and a sample transfer plan of a
//! configuration, to understand why a transfer is shaped as it is.

use std::fmt::Write;

use kvxfer_layout::{
    BlockOrder, BlockPairs, CacheSide, CacheSpec, LayoutError, LinkKind, PlanOptions, PpSplit,
    Side, TpMapping, plan_transfer,
};

use crate::models::ModelShape;

/// What to inspect.
#[derive(Debug, Clone)]
pub struct InspectConfig {
    /// Model preset.
    pub model: ModelShape,
    /// In-block order.
    pub order: BlockOrder,
    /// Prefill TP.
    pub prefill_tp: u32,
    /// Decode TP.
    pub decode_tp: u32,
    /// Prefill pipeline stages.
    pub prefill_pp: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Blocks per region.
    pub num_blocks: u32,
    /// Blocks in the sample request.
    pub request_blocks: u32,
}

/// Deterministic fragmented block ids: every third block, offset per side.
fn sample_blocks(n: u32, limit: u32, offset: u32) -> Vec<u32> {
    (0..n).map(|i| (offset + i * 3) % limit).collect()
}

/// Renders the report.
pub fn report(c: &InspectConfig) -> Result<String, LayoutError> {
    let m = &c.model;
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, m.sharding())?;
    let split = PpSplit::even(m.layers, c.prefill_pp)?;
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "model {}: {} layers, {} KV heads, head dim {}, {}",
        m.name, m.layers, m.kv_heads, m.head_dim, m.dtype
    );
    let _ = writeln!(
        w,
        "prefill TP {} x PP {}, decode TP {}",
        c.prefill_tp, c.prefill_pp, c.decode_tp
    );
    let specs = |side: Side, rank: u32, layers: u32| -> Result<CacheSpec, LayoutError> {
        let heads = mapping.heads_of(side, rank)?.count;
        CacheSpec::new(m.rank_params(c.order, heads, layers, c.tokens_per_block, c.num_blocks))
    };
    let d0 = specs(Side::Decode, 0, m.layers)?;
    let p0 = specs(Side::Prefill, 0, split.stage(0)?.count)?;
    for (name, s) in [("prefill rank 0 (stage 0)", &p0), ("decode rank 0", &d0)] {
        let _ = writeln!(w, "{name}: {s}");
        let _ = writeln!(
            w,
            "  regions {}, block_len {} B, token slot {} B, region {} B, total {} B",
            s.num_regions(),
            s.block_len(),
            s.token_slot_bytes(),
            s.region_len(),
            s.total_bytes()
        );
    }
    let _ = writeln!(w, "pipeline stages (prefill):");
    for (i, st) in split.stages().iter().enumerate() {
        let _ = writeln!(w, "  stage {i}: layers {}..{}", st.first, st.end());
    }
    let _ = writeln!(w, "TP links (prefill rank -> decode rank):");
    for l in mapping.links() {
        match l.kind {
            LinkKind::Data(s) => {
                let _ = writeln!(
                    w,
                    "  P{} -> D{}: heads {}..{} into {}..{}",
                    l.prefill_rank,
                    l.decode_rank,
                    s.src_first,
                    s.src_first + s.count,
                    s.dst_first,
                    s.dst_first + s.count
                );
            }
            LinkKind::NotifyOnly => {
                let _ = writeln!(
                    w,
                    "  P{} -> D{}: notify only",
                    l.prefill_rank, l.decode_rank
                );
            }
        }
    }
    for q in 0..c.prefill_tp {
        let _ = writeln!(
            w,
            "  prefill rank {q} frees a request after {} notification(s)",
            mapping.notifications_per_request(q)?
        );
    }
    // Sample plan: every data link into decode rank 0, stage 0, fragmented blocks.
    let src_blocks = sample_blocks(c.request_blocks, c.num_blocks, 1);
    let dst_blocks = sample_blocks(c.request_blocks, c.num_blocks, 0);
    let pairs = BlockPairs {
        src: &src_blocks,
        dst: &dst_blocks,
        windows: None,
    };
    let _ = writeln!(
        w,
        "sample request: {} blocks ({} tokens) into decode rank 0, prefill stage 0",
        c.request_blocks,
        u64::from(c.request_blocks) * u64::from(c.tokens_per_block)
    );
    let dbases = fake_bases(&d0, 0x7000_0000_0000);
    let dside = CacheSide::new(&d0, &dbases, 0)?;
    for link in mapping.links_for_decode(0)? {
        let LinkKind::Data(slice) = link.kind else {
            continue;
        };
        let p = specs(Side::Prefill, link.prefill_rank, split.stage(0)?.count)?;
        let pbases = fake_bases(&p, 0x1000_0000_0000);
        let pside = CacheSide::new(&p, &pbases, 0)?;
        let plan = plan_transfer(&pside, &dside, slice, &pairs, PlanOptions::default())?;
        let _ = writeln!(
            w,
            "  from prefill rank {}: {} raw descriptors -> {} coalesced, {} bytes",
            link.prefill_rank,
            plan.raw_count,
            plan.descriptors().len(),
            plan.total_bytes
        );
    }
    Ok(out)
}

/// Region bases laid out back to back (as one contiguous allocation would be).
fn fake_bases(spec: &CacheSpec, start: u64) -> Vec<u64> {
    (0..u64::from(spec.num_regions()))
        .map(|r| start + r * spec.region_len())
        .collect()
}
