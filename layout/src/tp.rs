//! Tensor-parallel mapping between a prefill side of TP `p` and a decode side of TP `d`.
//!
//! Heads are numbered globally. A rank of a side with TP `t` and `H` KV heads holds
//! `H / t` consecutive heads when `t <= H`, and one head, `r * H / t`, when `t > H`
//! (replication: ranks `[0,0,1,1]` for 2 heads on 4 ranks). Every decode rank takes each
//! head it holds from one prefill rank holding that head; prefill ranks that no decode rank
//! reads from are linked as notify-only, so every prefill rank learns when it may free.

use crate::error::nonzero;
use crate::{LayoutError, MAX_DIM, Result};

/// How heads are spread over the ranks of a side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadSharding {
    /// Multi-head (or grouped-query) attention: KV heads are divided among ranks.
    Split {
        /// KV heads of the whole model (before TP).
        total_kv_heads: u32,
    },
    /// MLA: every rank holds the whole latent cache, identical everywhere.
    Replicated,
}

/// A contiguous range of heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadRange {
    /// First head.
    pub first: u32,
    /// Number of heads.
    pub count: u32,
}

/// The heads one link moves, as local head indices on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSlice {
    /// First head inside the prefill rank's cache.
    pub src_first: u32,
    /// First head inside the decode rank's cache.
    pub dst_first: u32,
    /// Number of heads moved.
    pub count: u32,
}

/// What a link between a prefill rank and a decode rank carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// Data for the given head slice.
    Data(HeadSlice),
    /// No data; the decode rank only notifies the prefill rank (MLA, replicated heads).
    NotifyOnly,
}

/// One (prefill rank, decode rank) pair that exchanges data or a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpLink {
    /// Prefill (source) rank.
    pub prefill_rank: u32,
    /// Decode (destination) rank.
    pub decode_rank: u32,
    /// Data slice or notification only.
    pub kind: LinkKind,
}

/// Which side of the transfer a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The side that computed the KV cache (the data source).
    Prefill,
    /// The side that receives it.
    Decode,
}

/// The complete TP mapping; links are computed once at construction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpMapping {
    prefill_tp: u32,
    decode_tp: u32,
    sharding: HeadSharding,
    links: Vec<TpLink>,
}

impl TpMapping {
    /// Builds the mapping; errors when a TP size does not divide (or is not a multiple of)
    /// the head count.
    pub fn new(prefill_tp: u32, decode_tp: u32, sharding: HeadSharding) -> Result<Self> {
        for (tp, field) in [(prefill_tp, "prefill TP"), (decode_tp, "decode TP")] {
            nonzero(tp.into(), field)?;
            if tp > MAX_DIM {
                return Err(LayoutError::TooLarge {
                    what: field,
                    value: tp.into(),
                    limit: MAX_DIM.into(),
                });
            }
        }
        if let HeadSharding::Split { total_kv_heads } = sharding {
            nonzero(total_kv_heads.into(), "total KV heads")?;
            if total_kv_heads > MAX_DIM {
                return Err(LayoutError::TooLarge {
                    what: "total KV heads",
                    value: total_kv_heads.into(),
                    limit: MAX_DIM.into(),
                });
            }
            check_divisible(prefill_tp, total_kv_heads, "prefill TP vs KV heads")?;
            check_divisible(decode_tp, total_kv_heads, "decode TP vs KV heads")?;
        }
        let mut mapping = TpMapping {
            prefill_tp,
            decode_tp,
            sharding,
            links: Vec::new(),
        };
        mapping.links = mapping.compute_links()?;
        Ok(mapping)
    }

    /// Prefill TP size.
    pub fn prefill_tp(&self) -> u32 {
        self.prefill_tp
    }

    /// Decode TP size.
    pub fn decode_tp(&self) -> u32 {
        self.decode_tp
    }

    /// Head sharding.
    pub fn sharding(&self) -> HeadSharding {
        self.sharding
    }

    /// Every link, grouped by decode rank in rank order, then notify-only links.
    pub fn links(&self) -> &[TpLink] {
        &self.links
    }

    fn tp(&self, side: Side) -> u32 {
        match side {
            Side::Prefill => self.prefill_tp,
            Side::Decode => self.decode_tp,
        }
    }

    /// The global heads held by `rank` of `side` (for MLA: the single latent, head 0).
    pub fn heads_of(&self, side: Side, rank: u32) -> Result<HeadRange> {
        let tp = self.tp(side);
        if rank >= tp {
            return Err(LayoutError::OutOfRange {
                what: "TP rank",
                index: rank.into(),
                limit: tp.into(),
            });
        }
        heads_of(self.total_heads(), tp, rank)
    }

    fn total_heads(&self) -> u32 {
        match self.sharding {
            HeadSharding::Split { total_kv_heads } => total_kv_heads,
            HeadSharding::Replicated => 1,
        }
    }

    /// Links into one decode rank (data and notify-only).
    pub fn links_for_decode(&self, rank: u32) -> Result<Vec<TpLink>> {
        self.heads_of(Side::Decode, rank)?;
        Ok(self
            .links
            .iter()
            .filter(|l| l.decode_rank == rank)
            .copied()
            .collect())
    }

    /// Links out of one prefill rank (data and notify-only).
    pub fn links_for_prefill(&self, rank: u32) -> Result<Vec<TpLink>> {
        self.heads_of(Side::Prefill, rank)?;
        Ok(self
            .links
            .iter()
            .filter(|l| l.prefill_rank == rank)
            .copied()
            .collect())
    }

    /// How many decode ranks notify `prefill_rank` for each request: the count a pull-mode
    /// prefill rank waits for before freeing the request's blocks.
    pub fn notifications_per_request(&self, prefill_rank: u32) -> Result<u32> {
        Ok(self.links_for_prefill(prefill_rank)?.len() as u32)
    }

    /// How many prefill ranks write data into each block of `decode_rank`.
    pub fn writers_per_block(&self, decode_rank: u32) -> Result<u32> {
        let links = self.links_for_decode(decode_rank)?;
        Ok(links
            .iter()
            .filter(|l| matches!(l.kind, LinkKind::Data(_)))
            .count() as u32)
    }

    fn compute_links(&self) -> Result<Vec<TpLink>> {
        let total = self.total_heads();
        let (p, d) = (self.prefill_tp, self.decode_tp);
        let mut links = Vec::new();
        let mut served = vec![false; p as usize];
        for r in 0..d {
            let dst = heads_of(total, d, r)?;
            let mut current: Option<TpLink> = None;
            for h in dst.first..dst.first.checked_add(dst.count).ok_or_else(overflow)? {
                let src_rank = holder(total, p, d, h, r)?;
                let src = heads_of(total, p, src_rank)?;
                let src_local = h.checked_sub(src.first).ok_or_else(overflow)?;
                let dst_local = h.checked_sub(dst.first).ok_or_else(overflow)?;
                if let Some(TpLink {
                    prefill_rank,
                    kind: LinkKind::Data(slice),
                    ..
                }) = current.as_mut()
                {
                    let next = slice.src_first.checked_add(slice.count);
                    if *prefill_rank == src_rank && next == Some(src_local) {
                        slice.count = slice.count.checked_add(1).ok_or_else(overflow)?;
                        continue;
                    }
                }
                links.extend(current.take());
                current = Some(TpLink {
                    prefill_rank: src_rank,
                    decode_rank: r,
                    kind: LinkKind::Data(HeadSlice {
                        src_first: src_local,
                        dst_first: dst_local,
                        count: 1,
                    }),
                });
                *served.get_mut(src_rank as usize).ok_or_else(overflow)? = true;
            }
            links.extend(current);
        }
        for q in (0..p).filter(|&q| !served[q as usize]) {
            // The decode ranks spread evenly over the unserved prefill ranks: q * d / p.
            let decode_rank = u64::from(q)
                .checked_mul(d.into())
                .and_then(|x| x.checked_div(p.into()))
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(overflow)?;
            links.push(TpLink {
                prefill_rank: q,
                decode_rank,
                kind: LinkKind::NotifyOnly,
            });
        }
        Ok(links)
    }
}

fn check_divisible(tp: u32, heads: u32, what: &'static str) -> Result<()> {
    let (big, small) = if tp <= heads {
        (heads, tp)
    } else {
        (tp, heads)
    };
    if big.checked_rem(small) == Some(0) {
        Ok(())
    } else {
        Err(LayoutError::NotDivisible {
            what,
            dividend: big.into(),
            divisor: small.into(),
        })
    }
}

/// The error of head-mapping arithmetic that a validated mapping never reaches.
fn overflow() -> LayoutError {
    LayoutError::Overflow {
        what: "head mapping",
    }
}

/// Heads of rank `r` of a side with TP `tp` and `total` heads (divisibility checked).
fn heads_of(total: u32, tp: u32, r: u32) -> Result<HeadRange> {
    Ok(if tp <= total {
        let per = total.checked_div(tp).ok_or_else(overflow)?;
        HeadRange {
            first: r.checked_mul(per).ok_or_else(overflow)?,
            count: per,
        }
    } else {
        let ranks_per_head = tp.checked_div(total).ok_or_else(overflow)?;
        HeadRange {
            first: r.checked_div(ranks_per_head).ok_or_else(overflow)?,
            count: 1,
        }
    })
}

/// The prefill rank decode rank `r` takes head `h` from. When several prefill ranks hold
/// `h` (replication), the decode ranks needing `h` are spread over them in blocks, as the
/// reference spreads decode ranks over prefill ranks (`r / k`).
fn holder(total: u32, p: u32, d: u32, h: u32, r: u32) -> Result<u32> {
    let (holders, first_holder) = if p <= total {
        let heads_per_rank = total.checked_div(p).ok_or_else(overflow)?;
        (1, h.checked_div(heads_per_rank).ok_or_else(overflow)?)
    } else {
        let holders = p.checked_div(total).ok_or_else(overflow)?;
        (holders, h.checked_mul(holders).ok_or_else(overflow)?)
    };
    let (needing, position) = if d <= total {
        (1, 0)
    } else {
        let needing = d.checked_div(total).ok_or_else(overflow)?;
        (needing, r.checked_rem(needing).ok_or_else(overflow)?)
    };
    // position * holders / needing, in u64 so the product cannot overflow.
    let offset = u64::from(position)
        .checked_mul(holders.into())
        .and_then(|x| x.checked_div(needing.into()))
        .and_then(|x| u32::try_from(x).ok());
    offset
        .and_then(|o| first_holder.checked_add(o))
        .ok_or_else(overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(p: u32, d: u32, h: u32) -> TpMapping {
        TpMapping::new(p, d, HeadSharding::Split { total_kv_heads: h }).unwrap()
    }

    fn data(l: &TpLink) -> HeadSlice {
        match l.kind {
            LinkKind::Data(s) => s,
            LinkKind::NotifyOnly => panic!("expected data link"),
        }
    }

    #[test]
    fn a_mapping_reports_what_it_was_built_from() {
        let m = split(2, 4, 8);
        assert_eq!((m.prefill_tp(), m.decode_tp()), (2, 4));
        assert_eq!(m.sharding(), HeadSharding::Split { total_kv_heads: 8 });
        let mla = TpMapping::new(3, 1, HeadSharding::Replicated).unwrap();
        assert_eq!((mla.prefill_tp(), mla.decode_tp()), (3, 1));
        assert_eq!(mla.sharding(), HeadSharding::Replicated);
    }

    #[test]
    fn decode_larger_reads_head_slices() {
        // d = 2p: decode rank r reads slice r % 2 of prefill rank r / 2.
        let m = split(2, 4, 8);
        for r in 0..4 {
            let links = m.links_for_decode(r).unwrap();
            assert_eq!(links.len(), 1);
            assert_eq!(links[0].prefill_rank, r / 2);
            assert_eq!(
                data(&links[0]),
                HeadSlice {
                    src_first: (r % 2) * 2,
                    dst_first: 0,
                    count: 2
                }
            );
        }
        assert_eq!(m.notifications_per_request(0).unwrap(), 2);
        assert_eq!(m.writers_per_block(3).unwrap(), 1);
    }

    #[test]
    fn prefill_larger_writes_into_offsets() {
        // p = 4, d = 2, 8 heads: decode 0 takes 2 heads each from prefill 0 and 1.
        let m = split(4, 2, 8);
        let links = m.links_for_decode(0).unwrap();
        assert_eq!(links.len(), 2);
        assert_eq!(
            (links[0].prefill_rank, data(&links[0])),
            (
                0,
                HeadSlice {
                    src_first: 0,
                    dst_first: 0,
                    count: 2
                }
            )
        );
        assert_eq!(
            (links[1].prefill_rank, data(&links[1])),
            (
                1,
                HeadSlice {
                    src_first: 0,
                    dst_first: 2,
                    count: 2
                }
            )
        );
        assert_eq!(m.writers_per_block(1).unwrap(), 2);
        assert_eq!(m.notifications_per_request(3).unwrap(), 1);
    }

    #[test]
    fn replication_maps_heads_0_0_1_1() {
        // One prefill rank with 2 heads, 4 decode ranks: source heads [0, 0, 1, 1].
        let m = split(1, 4, 2);
        let src: Vec<u32> = (0..4)
            .map(|r| data(&m.links_for_decode(r).unwrap()[0]).src_first)
            .collect();
        assert_eq!(src, vec![0, 0, 1, 1]);
        assert_eq!(m.notifications_per_request(0).unwrap(), 4);
    }

    #[test]
    fn replicated_prefill_notifies_unread_ranks() {
        // 2 heads on 4 prefill ranks, 2 decode ranks: decode reads from two prefill ranks,
        // the other two are notify-only so they can free their blocks.
        let m = split(4, 2, 2);
        for q in 0..4 {
            assert_eq!(
                m.notifications_per_request(q).unwrap(),
                1,
                "prefill rank {q}"
            );
        }
        assert_eq!(
            m.links()
                .iter()
                .filter(|l| l.kind == LinkKind::NotifyOnly)
                .count(),
            2
        );
    }

    #[test]
    fn mla_reads_one_notifies_rest() {
        let m = TpMapping::new(4, 2, HeadSharding::Replicated).unwrap();
        assert_eq!(m.writers_per_block(0).unwrap(), 1);
        let notify: Vec<_> = m
            .links()
            .iter()
            .filter(|l| l.kind == LinkKind::NotifyOnly)
            .collect();
        assert_eq!(notify.len(), 2);
        let m = TpMapping::new(2, 4, HeadSharding::Replicated).unwrap();
        let src: Vec<u32> = (0..4)
            .map(|r| m.links_for_decode(r).unwrap()[0].prefill_rank)
            .collect();
        assert_eq!(src, vec![0, 0, 1, 1]);
    }

    #[test]
    fn incompatible_sizes_are_errors() {
        assert!(matches!(
            TpMapping::new(3, 1, HeadSharding::Split { total_kv_heads: 8 }),
            Err(LayoutError::NotDivisible {
                dividend: 8,
                divisor: 3,
                ..
            })
        ));
        assert!(matches!(
            TpMapping::new(1, 12, HeadSharding::Split { total_kv_heads: 8 }),
            Err(LayoutError::NotDivisible {
                dividend: 12,
                divisor: 8,
                ..
            })
        ));
        assert!(TpMapping::new(0, 1, HeadSharding::Replicated).is_err());
        assert!(split(1, 1, 8).links_for_decode(1).is_err());
    }
}
