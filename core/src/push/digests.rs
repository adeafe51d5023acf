//! Content digests in push mode (#38's end-to-end check; opt-in, asked by the decode): a
//! prefill rank folds the head digests ([`crate::digest`]) of every page it writes into one
//! decode rank, page by page in the room's order, each page's heads in order, across all its
//! chunks, and sends the fold in its last chunk's note. Once every note arrived, the decode
//! rank folds the same pages of its own cache the same way, per writer (its heads and its
//! stage's layers), and reports the room done only if every fold matches.
//!
//! The folds are independent of page ids, chunking and coalescing; a decode rank of another
//! TP size folds exactly the heads each writer sent it. The digesting runs on threads of
//! its own: the prefill waits for its chunk's (the fold goes into the note it posts next),
//! the decode polls for its rooms' while the engine steps.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::Arc;

use crossbeam_channel::{Receiver, TryRecvError, bounded};
use kvxfer_layout::{CacheSpec, LayerGroups};
use xxhash_rust::xxh3::Xxh3Default;

use crate::connector::KvCache;
use crate::digest;
use crate::transport::MemoryKind;
use kvxfer_host_mem::copy_pool::CopyPool;

/// Most threads digesting for one rank.
const MAX_THREADS: usize = 4;

/// Fewest pages one digesting part takes: below it, a thread's hand-off costs more than
/// the digests.
const MIN_PART_PAGES: usize = 16;

/// A cache side: its spec and region bases.
type Side = Arc<(CacheSpec, Vec<u64>)>;

/// What one writer covers in a cache: heads `first_head..first_head + heads` of the layers
/// `first_layer..first_layer + layers` (indices into the cache's own layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coverage {
    /// First head.
    pub first_head: u32,
    /// Heads.
    pub heads: u32,
    /// First layer, among the cache's.
    pub first_layer: u32,
    /// Layers.
    pub layers: u32,
}

/// The fold of a sequence of head digests (xxh3-64 over their little-endian bytes), fed
/// in any number of steps.
#[derive(Clone)]
pub struct Fold(Xxh3Default);

impl Fold {
    /// An empty fold.
    pub fn new() -> Self {
        Fold(Xxh3Default::new())
    }

    /// Appends `digests`.
    pub fn add(&mut self, digests: &[u64]) {
        for d in digests {
            self.0.update(&d.to_le_bytes());
        }
    }

    /// The fold of everything appended so far.
    pub fn value(&self) -> u64 {
        self.0.digest()
    }
}

impl Default for Fold {
    fn default() -> Self {
        Fold::new()
    }
}

impl std::fmt::Debug for Fold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fold({:016x})", self.value())
    }
}

/// Head digests being computed: one receiver per part, in page order. Each part sends its
/// pages' digests (page-major, heads in order) once, or an error; a part whose thread died
/// drops its sender.
pub struct Pending {
    parts: Vec<Receiver<Result<Vec<u64>, String>>>,
    got: Vec<Option<Vec<u64>>>,
    /// The fold, once every part arrived (a room polls its writers until the last is in).
    folded: Option<u64>,
}

impl Pending {
    /// The fold of every part's digests once all arrived (`None` while some run), or the
    /// first error.
    pub fn try_fold(&mut self) -> Option<Result<u64, String>> {
        if let Some(f) = self.folded {
            return Some(Ok(f));
        }
        for (rx, got) in self.parts.iter().zip(self.got.iter_mut()) {
            if got.is_some() {
                continue;
            }
            match rx.try_recv() {
                Ok(Ok(d)) => *got = Some(d),
                Ok(Err(e)) => return Some(Err(e)),
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => {
                    return Some(Err("a digest thread stopped".into()));
                }
            }
        }
        let f = self.fold_into(&mut Fold::new());
        self.folded = Some(f);
        Some(Ok(f))
    }

    /// Waits for every part, then appends their digests to `fold` in order (the prefill's
    /// chunk, whose fold goes on).
    pub fn wait_into(mut self, fold: &mut Fold) -> Result<(), String> {
        for (rx, got) in self.parts.iter().zip(self.got.iter_mut()) {
            if got.is_none() {
                *got = Some(
                    rx.recv()
                        .map_err(|_| "a digest thread stopped".to_string())??,
                );
            }
        }
        self.fold_into(fold);
        Ok(())
    }

    fn fold_into(&self, fold: &mut Fold) -> u64 {
        for d in self.got.iter().flatten() {
            fold.add(d);
        }
        fold.value()
    }
}

/// A push rank's digesting: its cache, the sides of the layer ranges writers cover (made
/// once each), and the threads.
pub struct PageDigests {
    cache: (CacheSpec, Vec<u64>),
    sides: HashMap<(u32, u32), Side>,
    pool: CopyPool,
}

impl PageDigests {
    /// Digesting of `cache`, or why it cannot be digested.
    pub fn new(cache: &KvCache) -> Result<Self, String> {
        let refuse = |why: &str| Err(format!("content digests: {why}"));
        if cache.memory != MemoryKind::Host {
            return refuse(
                "GPU memory is not digested yet (no device kernel): switch digests off, or use host memory",
            );
        }
        if cache.groups.is_some() || cache.layer_windows.is_some() {
            return refuse("KV cache groups and per-layer windows are not digested in push mode");
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS);
        let pool =
            CopyPool::new(threads, "digest").map_err(|e| format!("no digest threads: {e}"))?;
        Ok(PageDigests {
            cache: (cache.spec, cache.bases.clone()),
            sides: HashMap::new(),
            pool,
        })
    }

    /// The cache's layers `first..first + count` as a side of their own.
    fn side(&mut self, first: u32, count: u32) -> Result<Side, String> {
        if let Some(s) = self.sides.get(&(first, count)) {
            return Ok(Arc::clone(s));
        }
        let (spec, bases) = &self.cache;
        let total = spec.num_layers();
        let end = first
            .checked_add(count)
            .filter(|&e| e <= total && count > 0)
            .ok_or_else(|| format!("layers {first}+{count} outside the cache's {total}"))?;
        let side = if (first, end) == (0, total) {
            (*spec, bases.clone())
        } else {
            // The covered layers as one group, the others as another (or two).
            let groups: Vec<Vec<u32>> = [0..first, first..end, end..total]
                .into_iter()
                .map(|r| r.collect::<Vec<u32>>())
                .filter(|g| !g.is_empty())
                .collect();
            let at = usize::from(first > 0);
            LayerGroups::new(groups, total)
                .and_then(|g| g.group_side(at, spec, bases))
                .map_err(|e| e.to_string())?
        };
        let side = Arc::new(side);
        self.sides.insert((first, count), Arc::clone(&side));
        Ok(side)
    }

    /// Starts digesting `pages` (in order) over `cover`, in parts on the digest threads.
    pub fn start(&mut self, pages: &[u32], cover: Coverage) -> Result<Pending, String> {
        let side = self.side(cover.first_layer, cover.layers)?;
        let heads = cover.heads as usize;
        let parts = self.pool.workers().max(1);
        let per_part = pages.len().div_ceil(parts).max(MIN_PART_PAGES);
        let mut rxs = Vec::new();
        for part in pages.chunks(per_part) {
            let (tx, rx) = bounded(1);
            let (side, part) = (Arc::clone(&side), part.to_vec());
            let job = Box::new(move || {
                let _ = tx.send(digest_pages(&side, &part, cover.first_head, heads));
            });
            if let Err(job) = self.pool.submit(job) {
                job();
            }
            rxs.push(rx);
        }
        let n = rxs.len();
        Ok(Pending {
            parts: rxs,
            got: vec![None; n],
            folded: None,
        })
    }
}

/// The head digests of `pages`, page-major: heads `first..first + heads` of each.
fn digest_pages(side: &Side, pages: &[u32], first: u32, heads: usize) -> Result<Vec<u64>, String> {
    let (spec, bases) = &**side;
    let mut out = vec![0u64; pages.len().saturating_mul(heads)];
    for (&page, slot) in pages.iter().zip(out.chunks_mut(heads.max(1))) {
        // SAFETY: `bases` are the regions of the cache the rank registered (host memory, per
        // `PageDigests::new`), alive while the connector is; `block_heads` checks the page
        // and heads against the spec.
        unsafe { digest::block_heads(spec, bases, page, first, slot) }
            .map_err(|e| format!("digesting page {page}: {e}"))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, Dtype};

    fn cache(layers: u32, blocks: u32) -> (KvCache, Vec<Vec<u8>>) {
        let spec = CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Nhd,
            dtype: Dtype::F16,
            num_layers: layers,
            kv_heads: 2,
            head_dim: 4,
            tokens_per_block: 2,
            num_blocks: blocks,
        })
        .expect("spec");
        let mem: Vec<Vec<u8>> = (0..spec.num_regions())
            .map(|r| {
                (0..spec.region_len())
                    .map(|i| (i as u32 * 7 + r * 13) as u8)
                    .collect()
            })
            .collect();
        let kv = KvCache {
            spec,
            bases: mem.iter().map(|m| m.as_ptr() as u64).collect(),
            memory: MemoryKind::Host,
            total_kv_heads: 2,
            total_layers: layers,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        };
        (kv, mem)
    }

    fn fold(d: &mut PageDigests, pages: &[u32], cover: Coverage) -> u64 {
        let mut f = Fold::new();
        d.start(pages, cover)
            .expect("start")
            .wait_into(&mut f)
            .expect("digests");
        f.value()
    }

    const ALL: Coverage = Coverage {
        first_head: 0,
        heads: 2,
        first_layer: 0,
        layers: 3,
    };

    #[test]
    fn folds_do_not_depend_on_how_the_pages_are_split() {
        let (kv, _mem) = cache(3, 64);
        let mut d = PageDigests::new(&kv).expect("digests");
        let pages: Vec<u32> = (0..40).rev().collect();
        let whole = fold(&mut d, &pages, ALL);
        // In steps of any size, the same fold.
        let mut f = Fold::new();
        for step in pages.chunks(7) {
            d.start(step, ALL)
                .expect("start")
                .wait_into(&mut f)
                .expect("digests");
        }
        assert_eq!(f.value(), whole);
        // Polled to the end, the same fold.
        let mut p = d.start(&pages, ALL).expect("start");
        let polled = loop {
            if let Some(r) = p.try_fold() {
                break r.expect("digests");
            }
        };
        assert_eq!(polled, whole);
        // Another order, another fold.
        let mut other = pages.clone();
        other.swap(0, 1);
        assert_ne!(fold(&mut d, &other, ALL), whole);
    }

    #[test]
    fn a_coverage_folds_its_heads_and_layers_only() {
        let (kv, mut mem) = cache(3, 8);
        let mut d = PageDigests::new(&kv).expect("digests");
        let head1 = Coverage {
            first_head: 1,
            heads: 1,
            ..ALL
        };
        let layer2 = Coverage {
            first_layer: 2,
            layers: 1,
            ..ALL
        };
        let layer0 = Coverage {
            first_layer: 0,
            layers: 1,
            ..ALL
        };
        let covers = [ALL, head1, layer2, layer0];
        let before = covers.map(|c| fold(&mut d, &[3, 4], c));
        let distinct: std::collections::HashSet<_> = before.iter().collect();
        assert_eq!(distinct.len(), 4);
        // Layer 0's K, page 3, token 0, head 0 (NHD: the page's first bytes).
        let spec = kv.spec;
        let (r, at) = spec
            .head_token_range(0, kvxfer_layout::Part::Key, 3, 0, 0)
            .expect("range");
        mem[r as usize][at.offset as usize] ^= 1;
        let after = covers.map(|c| fold(&mut d, &[3, 4], c));
        assert_ne!(after[0], before[0], "the whole cache covers the byte");
        assert_eq!(after[1], before[1], "head 1 does not");
        assert_eq!(after[2], before[2], "layer 2 does not");
        assert_ne!(after[3], before[3], "layer 0 does");
    }

    #[test]
    fn bad_coverage_and_pages_are_errors_and_gpu_memory_is_refused() {
        let (mut kv, _mem) = cache(2, 4);
        let mut d = PageDigests::new(&kv).expect("digests");
        let past = Coverage {
            layers: 3,
            first_layer: 0,
            ..ALL
        };
        assert!(
            d.start(&[0], past)
                .err()
                .expect("refused")
                .contains("outside")
        );
        let none = Coverage { layers: 0, ..ALL };
        let refused = d.start(&[0], none).err().expect("refused");
        assert!(refused.contains("outside"), "{refused}");
        let two = Coverage { layers: 2, ..ALL };
        let mut f = Fold::new();
        let e = d.start(&[4], two).expect("start").wait_into(&mut f);
        assert!(e.expect_err("page 4 of 4").contains("page 4"));
        kv.memory = MemoryKind::Gpu { device: 0 };
        assert!(
            PageDigests::new(&kv)
                .err()
                .expect("refused")
                .contains("GPU")
        );
    }
}
