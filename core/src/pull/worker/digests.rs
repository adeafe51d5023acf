//! Content digests in the worker (see [`crate::pull::digests`]): the prefill side writes a
//! hold's entries before its stamp; the decode side, once a load's stamps confirmed the
//! hold, reads the entries of the blocks it read and checks its blocks against them. The
//! digesting runs on threads of its own: a prefill's step waits for its holds' entries (the
//! stamp goes in right after), a decode's check goes on while the engine steps.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvxfer_layout::{CacheSpec, HeadSlice};

use std::collections::HashMap;

use super::{Load, PullError, PullWorker, RemoteRank, Verify};
use crate::connector::KvCache;
use crate::pull::digests::{DigestScratch, DigestTable};
use crate::pull::phases::Posted;
use crate::pull::scheduler::GroupPairs;
use crate::pull::scheduler::RecvRequest;
use crate::transport::AddrRange;
use crate::transport::{MemoryKind, Op, Transport};
use kvxfer_host_mem::copy_pool::{CopyPool, Job};

/// Each KV cache group's layers as a cache side of their own: its spec and region bases.
pub(super) type Sides = Vec<(CacheSpec, Vec<u64>)>;

/// Most threads digesting for one worker: a 128k-token Llama-3-70B request (TP 8) digests
/// in a few milliseconds on four.
const MAX_THREADS: usize = 4;

/// One part of a load's check: the first mismatch in it, if any.
pub(super) struct Outcome {
    req: String,
    mismatch: Option<String>,
}

/// What a worker that digests keeps: its own cache's sides (to digest its blocks), the
/// table it publishes (prefill side), the scratch its READs of other tables land in
/// (decode side), and threads that digest off the engine's thread.
pub(super) struct Digests {
    sides: Arc<Sides>,
    pub(super) table: Arc<DigestTable>,
    pub(super) scratch: DigestScratch,
    pool: Option<CopyPool>,
    outcomes: (Sender<Outcome>, Receiver<Outcome>),
}

impl Digests {
    /// Digests of `cache`, or why it cannot have them.
    pub(super) fn new(cache: &KvCache, stamped: bool) -> Result<Self, PullError> {
        let refuse = |why: &str| PullError::Config(format!("content digests: {why}"));
        if cache.memory != MemoryKind::Host {
            return Err(refuse(
                "GPU memory is not digested yet (no device kernel): switch digests off, or use host memory",
            ));
        }
        if !stamped {
            return Err(refuse(
                "they need stamped references (stamp_references), which tie the digests a decode reads to the hold that wrote them",
            ));
        }
        if cache.layer_windows.is_some() {
            return Err(refuse(
                "per-layer attention windows (a layer reads only some of a request's blocks) are not digested yet",
            ));
        }
        let sides = match &cache.groups {
            None => vec![(cache.spec, cache.bases.clone())],
            Some(g) => (0..g.len())
                .map(|i| g.group_side(i, &cache.spec, &cache.bases))
                .collect::<Result<_, _>>()?,
        };
        let heads = cache.spec.kv_heads();
        let table = DigestTable::new(cache.spec.num_blocks(), heads)
            .ok_or_else(|| refuse("the digest table does not fit in memory"))?;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS);
        let pool = CopyPool::new(threads, "digest")
            .map_err(|e| refuse(&format!("no digest threads: {e}")))?;
        Ok(Digests {
            sides: Arc::new(sides),
            table: Arc::new(table),
            scratch: DigestScratch::new(),
            pool: Some(pool),
            outcomes: unbounded(),
        })
    }

    /// Outcomes of finished digest jobs.
    pub(super) fn finished(&self) -> Vec<Outcome> {
        self.outcomes.1.try_iter().collect()
    }

    /// Digest threads.
    fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, CopyPool::workers)
    }

    /// Runs `job` on a digest thread, its outcome reported by [`Digests::finished`].
    fn spawn(&self, job: impl FnOnce() -> Outcome + Send + 'static) {
        let tx = self.outcomes.0.clone();
        self.run(Box::new(move || {
            let _ = tx.send(job());
        }));
    }

    /// Runs `job` on a digest thread, or here when the threads are gone (shut down).
    fn run(&self, job: Job) {
        let unqueued = match &self.pool {
            Some(p) => p.submit(job).err(),
            None => Some(job),
        };
        if let Some(job) = unqueued {
            job();
        }
    }

    /// Prefill side: writes the entries of a hold's blocks (per group), on the digest
    /// threads, and waits for them: the hold's stamp goes in right after, in the same engine
    /// step (an idle engine may not step again). A block that cannot be digested is logged
    /// and left out (its decode's check fails).
    pub(super) fn publish(&self, req: &str, block_ids: &[Vec<u32>]) {
        let blocks: Vec<(usize, u32)> = block_ids
            .iter()
            .enumerate()
            .flat_map(|(g, b)| b.iter().map(move |&b| (g, b)))
            .collect();
        let per_part = blocks.len().div_ceil(self.threads()).max(1);
        let (tx, rx) = unbounded();
        let mut parts = 0usize;
        for part in blocks.chunks(per_part) {
            let (sides, table, tx) = (Arc::clone(&self.sides), Arc::clone(&self.table), tx.clone());
            let (part, req) = (part.to_vec(), req.to_string());
            self.run(Box::new(move || {
                publish_part(&sides, &table, &req, &part);
                let _ = tx.send(());
            }));
            parts = parts.saturating_add(1);
        }
        drop(tx);
        // Each part sends once it ran; a part that panicked drops its sender.
        for _ in rx.iter().take(parts) {}
    }

    /// Decode side: checks a load's blocks against the entries that landed, in as many
    /// parts as there are digest threads (gives the scratch back at once); returns the
    /// parts started, each ending in an [`Outcome`].
    pub(super) fn check(
        &mut self,
        req: &str,
        landed: Vec<Landing>,
        state_group: impl Fn(usize) -> bool,
    ) -> usize {
        let mut checks = Vec::new();
        for l in &landed {
            for (i, &(g, block)) in l.blocks.iter().enumerate() {
                // A state group moves each rank's page whole: one "head".
                let (src, dst, n) = if state_group(g) {
                    (0, 0, 1)
                } else {
                    (l.slice.src_first, l.slice.dst_first, l.slice.count)
                };
                let entry = (i as u32)
                    .saturating_mul(l.heads)
                    .saturating_add(l.start)
                    .saturating_add(src);
                let expected = (0..n)
                    .map(|k| self.scratch.read(entry.saturating_add(k)))
                    .collect();
                checks.push(Check {
                    rank: l.rank,
                    group: g,
                    block,
                    first: dst,
                    expected,
                });
            }
        }
        for l in &landed {
            self.scratch.give_back(l.start, l.len);
        }
        let per_part = checks.len().div_ceil(self.threads()).max(1);
        let mut parts = 0usize;
        while !checks.is_empty() {
            let rest = checks.split_off(per_part.min(checks.len()));
            let part = std::mem::replace(&mut checks, rest);
            let (sides, req) = (Arc::clone(&self.sides), req.to_string());
            self.spawn(move || Outcome {
                mismatch: check_part(&sides, &part),
                req,
            });
            parts = parts.saturating_add(1);
        }
        parts
    }

    /// Stops the digest threads once their queued jobs ran.
    pub(super) fn shutdown(&mut self) {
        self.pool.take();
    }
}

/// Writes the entries of `blocks` ((group, block id)) into `table`.
fn publish_part(sides: &Sides, table: &DigestTable, req: &str, blocks: &[(usize, u32)]) {
    let mut out = vec![0u64; table.heads() as usize];
    for &(g, b) in blocks {
        // A state group's page is one "head"; an attention group's heads are the table's.
        let heads = sides
            .get(g)
            .map_or(out.len(), |(s, _)| s.kv_heads() as usize)
            .min(out.len());
        let written =
            digest_block(sides, g, b, 0, &mut out[..heads]).map(|()| table.set(b, &out[..heads]));
        if !matches!(written, Ok(true)) {
            tracing::warn!(req = %req, group = g, block = b, "block not digested: {written:?}");
        }
    }
}

/// One block's expected digests: the heads from `first` of the decode's `block`.
struct Check {
    rank: u32,
    group: usize,
    block: u32,
    first: u32,
    expected: Vec<u64>,
}

/// The first block of `checks` whose digests differ from those expected.
fn check_part(sides: &Sides, checks: &[Check]) -> Option<String> {
    let mut mine = Vec::new();
    for c in checks {
        mine.clear();
        mine.resize(c.expected.len(), 0);
        if let Err(e) = digest_block(sides, c.group, c.block, c.first, &mut mine) {
            return Some(format!("digesting block {}: {e}", c.block));
        }
        if let Some(k) = mine.iter().zip(&c.expected).position(|(a, b)| a != b) {
            return Some(format!(
                "content digest mismatch: block {} (KV cache group {}, head {}) from prefill rank {}: the bytes received are not the ones the prefill published",
                c.block,
                c.group,
                c.first.saturating_add(k as u32),
                c.rank
            ));
        }
    }
    None
}

/// Digests heads from `first` of `block` of group `group` of this rank's cache.
fn digest_block(
    sides: &Sides,
    group: usize,
    block: u32,
    first: u32,
    out: &mut [u64],
) -> Result<(), String> {
    let (spec, bases) = sides
        .get(group)
        .ok_or_else(|| format!("no KV cache group {group}"))?;
    // SAFETY: `bases` are the regions of this rank's cache, which its worker registered and
    // the engine keeps for the worker's life (the digest threads end with the worker);
    // `block_heads` reads inside them only.
    unsafe { crate::digest::block_heads(spec, bases, block, first, out) }.map_err(|e| e.to_string())
}

/// The entries of one prefill rank a load reads: where they landed and which blocks they
/// describe.
#[derive(Debug)]
pub(super) struct Landing {
    /// The prefill rank, and the heads its link moved.
    rank: u32,
    slice: HeadSlice,
    /// Digests per entry (the prefill rank's heads).
    heads: u32,
    /// The scratch run the entries landed in.
    start: u32,
    len: u32,
    /// (group, local block) of each entry, in order.
    blocks: Vec<(usize, u32)>,
}

impl<T: Transport> PullWorker<T> {
    /// Posts the READs of the digest entries of every block a load read, one per prefill
    /// rank its stamps confirmed; short (nothing posted) while the scratch is short.
    pub(super) fn post_digest_reads(&mut self, load: &mut Load) -> Posted<Vec<Landing>> {
        let Some(d) = self.digests.as_mut() else {
            return Posted::Failed(Vec::new(), "content digests are off".into());
        };
        let pairs = match load.req.pairs(self.cache.group_count()) {
            Ok(pairs) => pairs,
            Err(why) => return Posted::Failed(Vec::new(), why),
        };
        let Some(super::Connection { ranks, .. }) = self.book.connection(&load.req.engine_id)
        else {
            let why = format!("engine {} is not connected", load.req.engine_id);
            return Posted::Failed(Vec::new(), why);
        };
        let mut reads = Vec::new();
        let planned = plan_digest_reads(d, ranks, load.phases.confirmed(), &pairs, &mut reads);
        if !matches!(planned, Ok(true)) {
            for (l, ..) in &reads {
                d.scratch.give_back(l.start, l.len);
            }
            return match planned {
                Ok(_) => Posted::Short,
                Err(why) => Posted::Failed(Vec::new(), why),
            };
        }
        let now = self.clock.now();
        let host = (MemoryKind::Host, MemoryKind::Host);
        let mut landings = Vec::with_capacity(reads.len());
        let mut reads = reads.into_iter();
        for (landing, peer, locals, remotes) in reads.by_ref() {
            match self
                .transport
                .post(Op::Read, peer, host, &locals, &remotes, None)
            {
                Ok(x) => {
                    load.xfers.push((x, now));
                    landings.push(landing);
                }
                Err(e) => {
                    // READs posted before this one may still land: their runs stay lent
                    // until the load's transfers ended; this one's and the rest's go back.
                    let rank = landing.rank;
                    for (l, ..) in std::iter::once((landing, peer, locals, remotes)).chain(reads) {
                        d.scratch.give_back(l.start, l.len);
                    }
                    let why = format!("reading prefill rank {rank}'s digests: {e}");
                    return Posted::Failed(landings, why);
                }
            }
        }
        Posted::All(landings)
    }

    /// Starts checking the blocks `req` received against the digest entries that landed
    /// (the scratch goes back at once); returns the parts started.
    pub(super) fn start_check(&mut self, req: &RecvRequest, landed: Vec<Landing>) -> usize {
        let Some(d) = self.digests.as_mut() else {
            return 0;
        };
        let groups = self.cache.groups.as_ref();
        d.check(&req.req_id, landed, |g| {
            groups.is_some_and(|x| x.is_state(g))
        })
    }

    /// Takes the digest threads' outcomes: each ended part of a load's check goes to its
    /// phases, with the mismatch it found.
    pub(super) fn digests_finished(&mut self) {
        let Some(d) = self.digests.as_ref() else {
            return;
        };
        for Outcome { req, mismatch } in d.finished() {
            let Some(load) = self.book.load_mut(&req) else {
                continue;
            };
            if let Some(why) = &mismatch {
                tracing::warn!(req = %req, engine = %load.req.engine_id, "{why}: the load fails");
            }
            load.phases.part_checked(mismatch);
        }
    }

    /// Gives back the scratch of digest READs that never got checked (a failed load),
    /// once its transfers ended.
    pub(super) fn drop_digests(&mut self, landed: Vec<Landing>) {
        if let Some(d) = self.digests.as_mut() {
            for l in landed {
                d.scratch.give_back(l.start, l.len);
            }
        }
    }

    /// Entries of the digest scratch lent to loads (tests: none once loads ended).
    pub fn digest_reads_in_flight(&self) -> u32 {
        self.digests
            .as_ref()
            .map_or(0, |d| d.scratch.capacity().saturating_sub(d.scratch.free()))
    }
}

/// One prefill rank's digest READ: where its entries land, and the ranges to read.
type DigestRead = (
    Landing,
    crate::transport::PeerId,
    Vec<AddrRange>,
    Vec<AddrRange>,
);

/// Plans the digest READs of a load's confirmed ranks into `reads`, each with its scratch
/// run taken; false while the scratch is short. The caller gives back the runs of `reads`
/// unless this returns `Ok(true)`.
fn plan_digest_reads(
    d: &mut Digests,
    ranks: &HashMap<u32, RemoteRank>,
    confirmed: &[Verify],
    pairs: &[GroupPairs<'_>],
    reads: &mut Vec<DigestRead>,
) -> Result<bool, String> {
    for v in confirmed {
        let r = ranks
            .get(&v.rank)
            .ok_or_else(|| format!("prefill rank {} was not connected", v.rank))?;
        let base = r.digests.ok_or_else(|| {
            format!(
                "prefill rank {} publishes no content digests (switch them on there too)",
                v.rank
            )
        })?;
        let heads = r.spec.kv_heads();
        let mut blocks = Vec::new();
        let mut remotes = Vec::new();
        for (g, (remote, local)) in pairs.iter().enumerate() {
            for (&rb, &lb) in remote.iter().zip(local.iter()) {
                blocks.push((g, lb));
                let entry = DigestTable::entry_range(base, heads, rb)
                    .ok_or_else(|| format!("prefill rank {}'s digest table overflows", v.rank))?;
                remotes.push(entry);
            }
        }
        let len = u32::try_from(blocks.len())
            .ok()
            .and_then(|n| n.checked_mul(heads))
            .filter(|&n| n <= d.scratch.capacity())
            .ok_or_else(|| {
                format!(
                    "{} blocks of {heads} heads exceed the digest scratch",
                    blocks.len()
                )
            })?;
        if len == 0 {
            continue; // nothing read from this rank: nothing to check
        }
        let Some(start) = d.scratch.take(len) else {
            return Ok(false);
        };
        let locals = (0..blocks.len() as u32)
            .map(|i| {
                d.scratch
                    .entry_range(i.saturating_mul(heads).saturating_add(start), heads)
            })
            .collect();
        let landing = Landing {
            rank: v.rank,
            slice: v.slice,
            heads,
            start,
            len,
            blocks,
        };
        reads.push((landing, r.peer, locals, remotes));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, Dtype};

    fn cache(memory: MemoryKind, windows: bool) -> (KvCache, Vec<u8>) {
        let spec = CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            tokens_per_block: 2,
            num_blocks: 3,
        })
        .expect("spec");
        let mem = vec![7u8; spec.total_bytes() as usize];
        let at = mem.as_ptr() as u64;
        let bases = (0..u64::from(spec.num_regions()))
            .map(|r| at + r * spec.region_len())
            .collect();
        let kv = KvCache {
            spec,
            bases,
            memory,
            total_kv_heads: 2,
            total_layers: 2,
            first_layer: 0,
            layer_windows: windows.then(|| vec![Some(1), None]),
            groups: None,
        };
        (kv, mem)
    }

    fn refusal(kv: &KvCache, stamped: bool) -> String {
        match Digests::new(kv, stamped) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn gpu_memory_unstamped_references_and_layer_windows_are_refused() {
        let (gpu, _m) = cache(MemoryKind::Gpu { device: 0 }, false);
        assert!(refusal(&gpu, true).contains("GPU memory"));
        let (host, _m) = cache(MemoryKind::Host, false);
        assert!(refusal(&host, false).contains("stamped references"));
        let (windows, _m) = cache(MemoryKind::Host, true);
        assert!(refusal(&windows, true).contains("attention windows"));
        assert_eq!(refusal(&host, true), "");
    }

    #[test]
    fn a_published_hold_writes_every_heads_entry_in_parts_and_checks_find_changes() {
        let (kv, mut mem) = cache(MemoryKind::Host, false);
        let mut d = Digests::new(&kv, true).expect("digests");
        // Three blocks over the threads: every entry written, all alike (same bytes).
        d.publish("r", &[vec![0, 1, 2]]);
        let e0 = d.table.read(0);
        assert!(e0.iter().all(|&x| x != 0), "{e0:?}");
        assert_eq!(d.table.read(2), e0);
        // A check of blocks whose bytes still match, then of one changed since.
        let landed = |d: &mut Digests| {
            let start = d.scratch.take(4).expect("scratch");
            for (i, w) in [0u32, 1].iter().enumerate() {
                for (k, &v) in d.table.read(*w).iter().enumerate() {
                    d.scratch.words()[start as usize + i * 2 + k]
                        .store(v.to_le(), std::sync::atomic::Ordering::Release);
                }
            }
            vec![Landing {
                rank: 0,
                slice: HeadSlice {
                    src_first: 0,
                    dst_first: 0,
                    count: 2,
                },
                heads: 2,
                start,
                len: 4,
                blocks: vec![(0, 0), (0, 1)],
            }]
        };
        let outcomes = |d: &mut Digests, parts: usize| {
            let mut got = Vec::new();
            while got.len() < parts {
                got.extend(d.finished().into_iter().map(|o| o.mismatch));
            }
            got
        };
        let l = landed(&mut d);
        let parts = d.check("a", l, |_| false);
        assert!(outcomes(&mut d, parts).iter().all(Option::is_none));
        mem[1] ^= 1; // block 0, layer 0, K, head 0
        let l = landed(&mut d);
        let parts = d.check("b", l, |_| false);
        let found: Vec<String> = outcomes(&mut d, parts).into_iter().flatten().collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("block 0") && found[0].contains("head 0"),
            "{}",
            found[0]
        );
        assert_eq!(d.scratch.free(), d.scratch.capacity(), "scratch given back");
        // Shutting down waits for the checks still queued: they read the cache, which the
        // engine may free once the worker shut down.
        let mut many = landed(&mut d);
        d.scratch.give_back(many[0].start, many[0].len);
        many[0].blocks = [(0, 0), (0, 1)].repeat(100_000);
        many[0].len = 400_000;
        many[0].start = d.scratch.take(many[0].len).expect("scratch");
        let parts = d.check("many", many, |_| false);
        d.shutdown();
        assert_eq!(
            d.finished().len(),
            parts,
            "checks left running after shutdown"
        );
    }
}
