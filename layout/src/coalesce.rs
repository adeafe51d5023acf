//! Descriptors and coalescing: fewer, larger descriptors move the same bytes faster.

use crate::{LayoutError, Result};

/// One contiguous copy of `len` bytes from `src` to `dst` (absolute addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Descriptor {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Descriptor {
    /// True when `next` continues `self` on both sides, so the two can be one descriptor.
    #[inline]
    pub fn continues_into(&self, next: &Descriptor) -> bool {
        self.src.checked_add(self.len) == Some(next.src)
            && self.dst.checked_add(self.len) == Some(next.dst)
    }

    /// `self` and `next` as one descriptor, when `next` continues `self` and the merged
    /// length fits in 64 bits.
    #[inline]
    pub fn merged(&self, next: &Descriptor) -> Option<Descriptor> {
        if !self.continues_into(next) {
            return None;
        }
        let len = self.len.checked_add(next.len)?;
        Some(Descriptor { len, ..*self })
    }
}

/// A run of index pairs that are `+1` consecutive on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IndexRun {
    /// First source index.
    pub src_first: u64,
    /// First destination index.
    pub dst_first: u64,
    /// Number of indices in the run.
    pub len: u64,
}

/// The reference "group contiguous indices" behaviour: split the (src, dst) index pairs
/// wherever either side is not `+1` consecutive. Empty input gives no runs; lists of
/// different lengths are an error. Each run becomes one descriptor
/// `base + first * item_len`, length `item_len * run.len`.
pub fn group_contiguous(src: &[u64], dst: &[u64]) -> Result<Vec<IndexRun>> {
    if src.len() != dst.len() {
        return Err(LayoutError::LengthMismatch {
            what: "source vs destination indices",
            left: src.len(),
            right: dst.len(),
        });
    }
    let mut runs: Vec<IndexRun> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        if let Some(run) = runs.last_mut() {
            let next_src = run.src_first.checked_add(run.len);
            let next_dst = run.dst_first.checked_add(run.len);
            if next_src == Some(s) && next_dst == Some(d) {
                if let Some(len) = run.len.checked_add(1) {
                    run.len = len;
                    continue;
                }
            }
        }
        runs.push(IndexRun {
            src_first: s,
            dst_first: d,
            len: 1,
        });
    }
    Ok(runs)
}

/// Appends `d`, merging it into the previous descriptor when both sides continue it.
#[inline]
pub fn push_merging(out: &mut Vec<Descriptor>, d: Descriptor) {
    if let Some(last) = out.last_mut() {
        if let Some(merged) = last.merged(&d) {
            *last = merged;
            return;
        }
    }
    out.push(d);
}

/// Coalesces descriptors to the fewest possible, assuming destinations do not overlap
/// (true of every plan): drops empty ones, orders by destination when not already ordered,
/// and merges every run that is contiguous on both sides. Idempotent.
pub fn coalesce(descs: &mut Vec<Descriptor>) {
    descs.retain(|d| d.len > 0);
    if !descs.windows(2).all(|w| w[0].dst < w[1].dst) {
        descs.sort_unstable_by_key(|d| d.dst);
    }
    // `dedup_by` hands each descriptor with the last one kept; merging into the kept one
    // and answering true drops the later one, in place.
    descs.dedup_by(|next, kept| match kept.merged(next) {
        Some(merged) => {
            *kept = merged;
            true
        }
        None => false,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(src: &[u64], dst: &[u64]) -> Vec<(u64, u64, u64)> {
        group_contiguous(src, dst)
            .unwrap()
            .into_iter()
            .map(|r| (r.src_first, r.dst_first, r.len))
            .collect()
    }

    type Case = (&'static [u64], &'static [u64], &'static [(u64, u64, u64)]);

    #[test]
    fn grouping_table() {
        // (src, dst, expected runs) — the cases the push reference documents and tests.
        let cases: &[Case] = &[
            (&[], &[], &[]),
            (&[5], &[9], &[(5, 9, 1)]),
            (&[0, 1, 2, 3], &[4, 5, 6, 7], &[(0, 4, 4)]),
            (&[0, 1, 2, 3], &[4, 5, 7, 8], &[(0, 4, 2), (2, 7, 2)]),
            (&[0, 1, 3, 4], &[4, 5, 6, 7], &[(0, 4, 2), (3, 6, 2)]),
            (&[3, 2, 1], &[1, 2, 3], &[(3, 1, 1), (2, 2, 1), (1, 3, 1)]),
            (&[1, 2, 2, 3], &[1, 2, 3, 4], &[(1, 1, 2), (2, 3, 2)]),
            (&[u64::MAX, 0], &[0, 1], &[(u64::MAX, 0, 1), (0, 1, 1)]),
        ];
        for (src, dst, want) in cases {
            assert_eq!(&runs(src, dst), want, "src {src:?} dst {dst:?}");
        }
        assert!(matches!(
            group_contiguous(&[1, 2], &[1]),
            Err(LayoutError::LengthMismatch {
                left: 2,
                right: 1,
                ..
            })
        ));
    }

    #[test]
    fn coalesce_orders_and_merges() {
        let d = |src, dst, len| Descriptor { src, dst, len };
        let mut v = vec![
            d(20, 120, 10),
            d(0, 100, 10),
            d(10, 110, 10),
            d(50, 200, 0),
            d(40, 140, 5),
        ];
        coalesce(&mut v);
        assert_eq!(v, vec![d(0, 100, 30), d(40, 140, 5)]);
        let again = v.clone();
        coalesce(&mut v);
        assert_eq!(v, again);
        let mut w = vec![d(u64::MAX, 0, 1), d(0, 1, 1)];
        coalesce(&mut w);
        assert_eq!(w.len(), 2, "no merge across address wrap-around");
    }

    #[test]
    fn a_merge_whose_length_overflows_keeps_both_descriptors() {
        let d = |src, dst, len| Descriptor { src, dst, len };
        let (huge, next) = (d(0, 0, u64::MAX - 1), d(u64::MAX - 1, u64::MAX - 1, 2));
        assert!(huge.continues_into(&next));
        assert_eq!(huge.merged(&next), None);
        assert_eq!(
            huge.merged(&d(u64::MAX - 1, u64::MAX - 1, 1)),
            Some(d(0, 0, u64::MAX))
        );
        let mut out = vec![huge];
        push_merging(&mut out, next);
        assert_eq!(out, vec![huge, next]);
        let mut v = vec![huge, next];
        coalesce(&mut v);
        assert_eq!(v, vec![huge, next]);
    }
}
