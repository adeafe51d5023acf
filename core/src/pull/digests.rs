//! Content digests in pull mode (see [`crate::digest`]): where a prefill rank publishes them
//! and where a decode's READs of them land.
//!
//! A prefill rank that digests keeps a [`DigestTable`], one entry per block id of its cache,
//! each entry one digest per KV head of the rank, in registered host memory. When it holds a
//! request's blocks (their data final: the forward pass that computed them ended) it writes
//! their entries, then the hold's stamp. A decode reads the blocks, then the stamp, then —
//! once the stamp confirmed the hold, which also proves the entries were written for it and
//! not rewritten since — the entries of the blocks it read, into its [`DigestScratch`]; it
//! recomputes the digests of the heads it received from its own blocks, and reports the
//! load done only when they match (its read-done note waits until then, so the hold, and
//! the entries, stand while it reads them).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::transport::AddrRange;

/// Bytes of one digest.
pub const DIGEST_BYTES: u64 = 8;

/// Entries of a decode worker's landing area: 8 MiB, a million block-heads (a 128k-token
/// prompt in 16-token blocks with 8 heads a rank takes 64k).
pub const SCRATCH_DIGESTS: u32 = 1 << 20;

fn zeroed(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

fn range_of(words: &[AtomicU64]) -> AddrRange {
    AddrRange::new(
        words.as_ptr() as u64,
        (words.len() as u64).saturating_mul(DIGEST_BYTES),
    )
}

/// A prefill rank's published digests: `blocks` entries of `heads` digests.
#[derive(Debug)]
pub struct DigestTable {
    words: Box<[AtomicU64]>,
    heads: u32,
}

impl DigestTable {
    /// A zeroed table for `blocks` blocks of `heads` heads; `None` if it would not fit in
    /// memory's address space.
    pub fn new(blocks: u32, heads: u32) -> Option<Self> {
        let n = usize::try_from(u64::from(blocks).checked_mul(heads.into())?).ok()?;
        Some(DigestTable {
            words: zeroed(n),
            heads,
        })
    }

    /// The table's memory, to register and name in the handshake.
    pub fn range(&self) -> AddrRange {
        range_of(&self.words)
    }

    /// Digests per entry.
    pub fn heads(&self) -> u32 {
        self.heads
    }

    /// Writes the first `digests.len()` digests of `block`'s entry; false (nothing written)
    /// for a block outside the table or more digests than heads.
    pub fn set(&self, block: u32, digests: &[u64]) -> bool {
        let Some(entry) = self.entry(block) else {
            return false;
        };
        if digests.len() > entry.len() {
            return false;
        }
        for (w, d) in entry.iter().zip(digests) {
            w.store(d.to_le(), Ordering::Release);
        }
        true
    }

    fn entry(&self, block: u32) -> Option<&[AtomicU64]> {
        let heads = self.heads as usize;
        let start = (block as usize).checked_mul(heads)?;
        self.words.get(start..start.checked_add(heads)?)
    }

    /// `block`'s entry as a decode would read it (tests).
    pub fn read(&self, block: u32) -> Vec<u64> {
        self.entry(block)
            .map(|e| {
                e.iter()
                    .map(|w| u64::from_le(w.load(Ordering::Acquire)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Where `block`'s entry lies in a remote table at `base` of `heads` heads; `None` when
    /// the arithmetic overflows (the remote's block ids were checked against its cache).
    pub fn entry_range(base: u64, heads: u32, block: u32) -> Option<AddrRange> {
        let len = u64::from(heads).checked_mul(DIGEST_BYTES)?;
        let at = base.checked_add(u64::from(block).checked_mul(len)?)?;
        Some(AddrRange::new(at, len))
    }
}

/// A decode worker's landing area for digest READs, registered once and lent out in
/// contiguous runs of entries (first fit).
#[derive(Debug)]
pub struct DigestScratch {
    words: Box<[AtomicU64]>,
    /// Free runs: start → length.
    free: BTreeMap<u32, u32>,
}

impl DigestScratch {
    /// [`SCRATCH_DIGESTS`] free entries.
    pub fn new() -> Self {
        Self::with_capacity(SCRATCH_DIGESTS)
    }

    /// `n` free entries (tests).
    pub fn with_capacity(n: u32) -> Self {
        let mut free = BTreeMap::new();
        if n > 0 {
            free.insert(0, n);
        }
        DigestScratch {
            words: zeroed(n as usize),
            free,
        }
    }

    /// The scratch memory, to register.
    pub fn range(&self) -> AddrRange {
        range_of(&self.words)
    }

    /// All entries, lent or not.
    pub fn capacity(&self) -> u32 {
        self.words.len() as u32
    }

    /// A run of `n` zeroed entries (its first), or none while no free run is that long.
    pub fn take(&mut self, n: u32) -> Option<u32> {
        if n == 0 {
            return None;
        }
        let (&start, &len) = self.free.iter().find(|&(_, &len)| len >= n)?;
        self.free.remove(&start);
        if len > n {
            self.free.insert(start.checked_add(n)?, len.checked_sub(n)?);
        }
        for w in self
            .words
            .get(start as usize..(start as usize).checked_add(n as usize)?)?
        {
            w.store(0, Ordering::Release);
        }
        Some(start)
    }

    /// Gives back the run `[start, start + n)` once nothing can still land in it, merging it
    /// with its free neighbours.
    pub fn give_back(&mut self, start: u32, n: u32) {
        let Some(mut end) = start.checked_add(n) else {
            return;
        };
        let mut start = start;
        if let Some(len) = self.free.remove(&end) {
            end = end.saturating_add(len);
        }
        if let Some((&before, &len)) = self.free.range(..start).next_back() {
            if before.saturating_add(len) == start {
                self.free.remove(&before);
                start = before;
            }
        }
        self.free.insert(start, end.saturating_sub(start));
    }

    /// Where entry `i` lies.
    pub fn entry_range(&self, i: u32, n: u32) -> AddrRange {
        let r = self.range();
        AddrRange::new(
            r.addr
                .saturating_add(u64::from(i).saturating_mul(DIGEST_BYTES)),
            u64::from(n).saturating_mul(DIGEST_BYTES),
        )
    }

    /// What landed in entry `i` (0 outside the scratch).
    pub fn read(&self, i: u32) -> u64 {
        self.words
            .get(i as usize)
            .map_or(0, |w| u64::from_le(w.load(Ordering::Acquire)))
    }

    /// The entries, for tests that land digests without a transport.
    #[cfg(test)]
    pub(crate) fn words(&self) -> &[AtomicU64] {
        &self.words
    }

    /// Free entries (tests: all of them once loads ended).
    pub fn free(&self) -> u32 {
        self.free.values().copied().fold(0, u32::saturating_add)
    }
}

impl Default for DigestScratch {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_entry_is_written_and_read_per_block() {
        let t = DigestTable::new(4, 2).unwrap();
        assert!(t.set(3, &[7, 8]));
        assert_eq!(t.read(3), vec![7, 8]);
        assert_eq!(t.read(2), vec![0, 0]);
        assert!(t.set(1, &[5]));
        assert_eq!(t.read(1), vec![5, 0]);
        assert!(!t.set(4, &[1]));
        assert!(!t.set(0, &[1, 2, 3]));
        assert!(t.read(4).is_empty());
        let r = t.range();
        assert_eq!(r.len, 4 * 2 * DIGEST_BYTES);
        let e = DigestTable::entry_range(r.addr, 2, 3).unwrap();
        assert_eq!((e.addr, e.len), (r.addr + 3 * 16, 16));
        assert!(DigestTable::entry_range(u64::MAX - 8, 2, 1).is_none());
    }

    #[test]
    fn scratch_runs_are_lent_zeroed_and_merge_when_given_back() {
        let mut s = DigestScratch::with_capacity(10);
        let a = s.take(4).unwrap();
        let b = s.take(3).unwrap();
        assert_eq!((a, b), (0, 4));
        assert_eq!(s.free(), 3);
        assert!(s.take(4).is_none());
        assert!(s.take(0).is_none());
        s.words[5].store(9u64.to_le(), Ordering::Release);
        assert_eq!(s.read(5), 9);
        assert_eq!(s.read(10), 0);
        s.give_back(a, 4);
        // Two free runs (0..4, 7..10): no run of 5 until b comes back and joins them.
        assert!(s.take(5).is_none());
        s.give_back(b, 3);
        assert_eq!(s.free(), 10);
        let all = s.take(10).unwrap();
        assert_eq!(all, 0);
        assert!(s.free.is_empty(), "no empty run left behind: {:?}", s.free);
        assert_eq!(s.read(5), 0, "lent zeroed");
        let r = s.entry_range(2, 3);
        assert_eq!((r.addr, r.len), (s.range().addr + 16, 24));
        s.give_back(0, 10);
        assert_eq!(s.free.len(), 1);
        // An empty scratch has no run at all.
        assert!(DigestScratch::with_capacity(0).free.is_empty());
    }
}
