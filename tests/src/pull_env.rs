//! A small disaggregated deployment in one process for pull-connector scenarios: a prefill
//! engine of TP `p` and a decode engine of TP `d`, each rank a loopback agent with its own
//! KV cache in host memory, filled so every byte says which (layer, part, block, token,
//! global head, byte) it holds. Verification recomputes the expected bytes from that
//! identity, independently of the planner.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::Clock;
use kvxfer_core::connector::KvCache;
use kvxfer_core::pull::{Finished, PullConfig, PullScheduler, PullWorker, StepMeta};
use kvxfer_core::wire::params::KvTransferParams;
use kvxfer_core::{MemoryKind, Transport};

use crate::shared_mem::SharedMem;
use kvxfer_layout::{
    BlockOrder, CacheKind, CacheParams, CacheSpec, Dtype, HeadSharding, Part, Side, TpMapping,
};

/// Shape of the test model.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    /// Cache kind.
    pub kind: CacheKind,
    /// In-block order.
    pub order: BlockOrder,
    /// Layers.
    pub layers: u32,
    /// KV heads of the model (1 for MLA).
    pub heads: u32,
    /// Head dim (latent dim for MLA).
    pub head_dim: u32,
    /// Tokens per block.
    pub tokens: u32,
    /// Blocks per region.
    pub blocks: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Caches in kvxfer shared memory (a memfd), which a same-host UCX peer maps and copies
    /// through; private memory otherwise.
    pub shared: bool,
}

impl Model {
    /// A small split-K/V model.
    pub fn small(order: BlockOrder, heads: u32) -> Self {
        Model {
            kind: CacheKind::SplitKv,
            order,
            layers: 2,
            heads,
            head_dim: 4,
            tokens: 4,
            blocks: 16,
            dtype: Dtype::F16,
            shared: false,
        }
    }

    /// A small MLA model.
    pub fn mla() -> Self {
        Model {
            kind: CacheKind::Mla,
            order: BlockOrder::Nhd,
            layers: 3,
            heads: 1,
            head_dim: 12,
            tokens: 4,
            blocks: 16,
            dtype: Dtype::F16,
            shared: false,
        }
    }

    /// A small state (Mamba) model at TP `tp`: one page of 40 bytes per block, layer and
    /// rank, the rank's shard of the model (its one "head").
    pub fn state(tp: u32) -> Self {
        Model {
            kind: CacheKind::State,
            order: BlockOrder::Hnd,
            layers: 2,
            heads: tp,
            head_dim: 40,
            tokens: 1,
            blocks: 16,
            dtype: Dtype::U8,
            shared: false,
        }
    }

    /// The cache a rank registers for `cache`'s memory: one region each, one group.
    pub fn kv_cache(&self, cache: &RankCache) -> KvCache {
        KvCache {
            spec: cache.spec,
            bases: cache.bases(),
            memory: MemoryKind::Host,
            total_kv_heads: self.heads,
            total_layers: self.layers,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        }
    }

    /// How heads shard across TP.
    pub fn sharding(&self) -> HeadSharding {
        if self.kind == CacheKind::Mla {
            HeadSharding::Replicated
        } else {
            HeadSharding::Split {
                total_kv_heads: self.heads,
            }
        }
    }

    /// The spec of a rank holding `heads` heads of every layer.
    pub fn spec(&self, heads: u32) -> CacheSpec {
        self.stage_spec(heads, self.layers)
    }

    /// The spec of a rank holding `heads` heads of `layers` layers.
    pub fn stage_spec(&self, heads: u32, layers: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: self.kind,
            order: self.order,
            dtype: self.dtype,
            num_layers: layers,
            kv_heads: heads,
            head_dim: self.head_dim,
            tokens_per_block: self.tokens,
            num_blocks: self.blocks,
        })
        .expect("test spec")
    }
}

/// The byte a prefill cache holds at an element identity.
pub fn element_byte(layer: u32, part: Part, block: u32, token: u32, head: u32, e: u64) -> u8 {
    element_of(run_hash(layer, part, block, token, head), e)
}

/// The hash of a run's identity (all but the element index), mixed once per run: the
/// suite runs unoptimised, where hashing every identity for every byte costs seconds.
fn run_hash(layer: u32, part: Part, block: u32, token: u32, head: u32) -> u64 {
    let p = match part {
        Part::Key => 1u64,
        Part::Value => 2,
        Part::Latent => 3,
        Part::PackedKv => 4,
        Part::State => 5,
    };
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in [
        u64::from(layer),
        p,
        u64::from(block),
        u64::from(token),
        u64::from(head),
    ] {
        h = fnv_mix(h, v);
    }
    h
}

fn fnv_mix(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(0x100_0000_01b3)
}

/// The byte of element `e` of a run: FNV alone leaves the upper bits of neighbouring
/// identities (head 0 and head 1, element 0 and 1) equal, so a copy landing one head or one
/// element off would hold the expected bytes; a full 64-bit finaliser (MurmurHash3's
/// fmix64) makes every bit depend on every input bit.
fn element_of(run: u64, e: u64) -> u8 {
    let mut z = fnv_mix(run, e);
    z ^= z >> 33;
    z = z.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z ^= z >> 33;
    z = z.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^= z >> 33;
    z as u8
}

/// Writes the bytes of one run (`element_byte` for `e` in `0..out.len()`) into `out`.
fn fill_run(out: &mut [u8], layer: u32, part: Part, block: u32, token: u32, head: u32) {
    let run = run_hash(layer, part, block, token, head);
    for (e, b) in out.iter_mut().enumerate() {
        *b = element_of(run, e as u64);
    }
}

/// Guard value of untouched decode bytes.
pub const GUARD: u8 = 0xEE;

/// A cache's bytes: private memory, or kvxfer shared memory a same-host peer maps.
pub enum CacheMem {
    /// Private memory.
    Private(Vec<u8>),
    /// A memfd mapping.
    Shared(SharedMem),
}

impl std::ops::Deref for CacheMem {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            CacheMem::Private(v) => v,
            CacheMem::Shared(m) => m.as_slice(),
        }
    }
}

impl std::ops::DerefMut for CacheMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            CacheMem::Private(v) => v,
            CacheMem::Shared(m) => m.as_mut_slice(),
        }
    }
}

/// One rank's cache memory (regions back to back in one allocation).
pub struct RankCache {
    /// The spec.
    pub spec: CacheSpec,
    /// The memory.
    pub mem: CacheMem,
    /// First global head held.
    pub first_head: u32,
    /// Global index of the first layer held (pipeline stages).
    pub first_layer: u32,
    addr: u64,
}

impl RankCache {
    /// A cache of `spec` holding heads from `first_head`; prefill caches are filled with
    /// their identity bytes, decode caches with guard bytes.
    pub fn new(spec: CacheSpec, first_head: u32, fill_identity: bool) -> Self {
        Self::with_layers(spec, first_head, 0, fill_identity)
    }

    /// Like [`RankCache::new`] for a pipeline stage starting at global layer `first_layer`.
    pub fn with_layers(
        spec: CacheSpec,
        first_head: u32,
        first_layer: u32,
        fill_identity: bool,
    ) -> Self {
        Self::in_memory(spec, first_head, first_layer, fill_identity, false)
    }

    /// Like [`RankCache::with_layers`], in kvxfer shared memory when `shared`.
    pub fn in_memory(
        spec: CacheSpec,
        first_head: u32,
        first_layer: u32,
        fill_identity: bool,
        shared: bool,
    ) -> Self {
        let len = spec.total_bytes() as usize;
        let mut mem = if shared {
            let mut m = SharedMem::new(len);
            m.as_mut_slice().fill(GUARD);
            CacheMem::Shared(m)
        } else {
            CacheMem::Private(vec![GUARD; len])
        };
        let addr = mem.as_mut_ptr() as u64;
        let mut c = RankCache {
            mem,
            spec,
            first_head,
            first_layer,
            addr,
        };
        if fill_identity {
            c.fill();
        }
        c
    }

    /// Region bases.
    pub fn bases(&self) -> Vec<u64> {
        let start = self.addr;
        (0..u64::from(self.spec.num_regions()))
            .map(|r| start + r * self.spec.region_len())
            .collect()
    }

    fn offset(&self, layer: u32, part: Part, block: u32, token: u32, head: u32) -> (usize, usize) {
        let (region, r) = self
            .spec
            .head_token_range(layer, part, block, token, head)
            .expect("in range");
        (
            (u64::from(region) * self.spec.region_len() + r.offset) as usize,
            r.len as usize,
        )
    }

    fn fill(&mut self) {
        let s = self.spec;
        for layer in 0..s.num_layers() {
            for &part in s.parts() {
                for b in 0..s.num_blocks() {
                    for t in 0..s.tokens_per_block() {
                        for h in 0..s.kv_heads() {
                            let (at, len) = self.offset(layer, part, b, t, h);
                            fill_run(
                                &mut self.mem[at..at + len],
                                self.first_layer + layer,
                                part,
                                b,
                                t,
                                self.first_head + h,
                            );
                        }
                    }
                }
            }
        }
    }

    /// Checks this decode cache: each `(src, dst)` block pair holds the prefill's bytes for
    /// every head this rank holds; every other block is untouched.
    pub fn verify(&self, pairs: &[(u32, u32)]) -> Result<(), String> {
        self.verify_except(pairs, &[])
    }

    /// [`RankCache::verify`], leaving out the blocks of failed loads (whose content the
    /// engine was told is invalid: a copy may or may not have landed).
    pub fn verify_except(&self, pairs: &[(u32, u32)], invalid: &[u32]) -> Result<(), String> {
        self.verify_with(&|layer, b| {
            (!invalid.contains(&b)).then(|| {
                pairs
                    .iter()
                    .find(|(_, d)| *d == b)
                    .map(|(sb, _)| (layer, *sb))
            })
        })
    }

    /// Checks each block of each layer's regions (this rank's layer indices) as
    /// `want(layer, block)` says: `Some(Some((l, src)))`, it holds the prefill's bytes of
    /// layer `l`, block `src`, for every head this rank holds (`l` differs from `layer`
    /// where KV cache groups overlay layers in the same memory); `Some(None)`, it is
    /// untouched; `None`, it is not checked.
    pub fn verify_with(
        &self,
        want: &dyn Fn(u32, u32) -> Option<Option<(u32, u32)>>,
    ) -> Result<(), String> {
        let s = self.spec;
        let mut expected = Vec::new();
        for layer in 0..s.num_layers() {
            for &part in s.parts() {
                for b in 0..s.num_blocks() {
                    let Some(src) = want(layer, b) else {
                        continue;
                    };
                    for t in 0..s.tokens_per_block() {
                        for h in 0..s.kv_heads() {
                            let (at, len) = self.offset(layer, part, b, t, h);
                            let got = &self.mem[at..at + len];
                            expected.resize(len, GUARD);
                            match src {
                                Some((sl, sb)) => fill_run(
                                    &mut expected,
                                    self.first_layer + sl,
                                    part,
                                    sb,
                                    t,
                                    self.first_head + h,
                                ),
                                None => expected.fill(GUARD),
                            }
                            if got != expected.as_slice() {
                                let e = (0..len).find(|&e| got[e] != expected[e]).unwrap_or(0);
                                let (got, want) = (got[e], expected[e]);
                                return Err(format!(
                                    "layer {layer} {part:?} block {b} token {t} head {h} byte {e}: got {got:#x}, want {want:#x} (source block {src:?})"
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// One engine: its ranks' caches and workers.
pub struct Engine<T: Transport> {
    /// Caches, by rank (drop after workers: declared first, dropped last is wrong, so workers
    /// are dropped explicitly in `Drop`).
    pub caches: Vec<RankCache>,
    /// Workers, by rank.
    pub workers: Vec<PullWorker<T>>,
    /// Scheduler.
    pub scheduler: PullScheduler,
    /// Base port of the listeners.
    pub base_port: u16,
    /// The content key this engine names for its requests (prefill: in the hold's stamp;
    /// decode: what its loads expect), none by default.
    pub content: Option<u64>,
}

impl<T: Transport> Drop for Engine<T> {
    fn drop(&mut self) {
        // Workers deregister before the cache memory is freed.
        self.workers.clear();
    }
}

/// Builds an engine of `tp` ranks; `prefill` engines fill their caches with identities and
/// bind listeners at `base_port + rank` (retrying other bases when ports are taken).
pub fn engine<T: Transport>(
    name: &str,
    model: &Model,
    tp: u32,
    prefill: bool,
    clock: Arc<dyn Clock>,
    make: &dyn Fn(&str) -> T,
    tune: &dyn Fn(&mut PullConfig),
) -> Engine<T> {
    let kv = |c: &RankCache| model.kv_cache(c);
    let bases = candidate_ports(name, prefill);
    build(name, model, tp, prefill, bases, clock, make, tune, &kv)
        .unwrap_or_else(|| panic!("no free port range for {name}"))
}

/// Base ports to try for engine `name`, derived from its name: a prefill's below Linux's
/// ephemeral range (32768 and up by default), so no test's outgoing connection can take a
/// port between a prefill's exit and its restart at that port; a decode's 0 (any).
fn candidate_ports(name: &str, prefill: bool) -> impl Iterator<Item = u16> {
    let mut seed = name
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..50).map(move |_| {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
        if prefill {
            20_000 + (seed % 12_000) as u16
        } else {
            0
        }
    })
}

/// Like [`engine`] for one rank, with the [`KvCache`] each rank registers made by `kv` from
/// its memory (KV cache groups, aliased regions).
pub fn engine_with<T: Transport>(
    name: &str,
    model: &Model,
    prefill: bool,
    make: &dyn Fn(&str) -> T,
    kv: &dyn Fn(&RankCache) -> KvCache,
) -> Engine<T> {
    engine_tp_with(name, model, 1, prefill, make, kv)
}

/// Like [`engine_with`], each rank's settings changed by `tune` (a vLLM-protocol peer).
pub fn engine_tuned_with<T: Transport>(
    name: &str,
    model: &Model,
    prefill: bool,
    make: &dyn Fn(&str) -> T,
    tune: &dyn Fn(&mut PullConfig),
    kv: &dyn Fn(&RankCache) -> KvCache,
) -> Engine<T> {
    let clock: Arc<dyn Clock> = Arc::new(kvxfer_core::clock::SystemClock::default());
    let bases = candidate_ports(name, prefill);
    build(name, model, 1, prefill, bases, clock, make, tune, kv)
        .unwrap_or_else(|| panic!("no free port range for {name}"))
}

/// Like [`engine_with`] with `tp` ranks.
pub fn engine_tp_with<T: Transport>(
    name: &str,
    model: &Model,
    tp: u32,
    prefill: bool,
    make: &dyn Fn(&str) -> T,
    kv: &dyn Fn(&RankCache) -> KvCache,
) -> Engine<T> {
    let clock: Arc<dyn Clock> = Arc::new(kvxfer_core::clock::SystemClock::default());
    let bases = candidate_ports(name, prefill);
    build(name, model, tp, prefill, bases, clock, make, &|_| {}, kv)
        .unwrap_or_else(|| panic!("no free port range for {name}"))
}

/// A prefill engine like [`engine`]'s whose listeners bind exactly `base_port + rank`
/// (a restart at the address of one that ended); `None` when those ports stay taken for 5 s.
pub fn prefill_at<T: Transport>(
    name: &str,
    model: &Model,
    tp: u32,
    base_port: u16,
    clock: Arc<dyn Clock>,
    make: &dyn Fn(&str) -> T,
    tune: &dyn Fn(&mut PullConfig),
) -> Option<Engine<T>> {
    // The ended engine's sockets close in the background: its port may stay taken a moment.
    for _ in 0..250 {
        let bases = std::iter::once(base_port);
        let kv = |c: &RankCache| model.kv_cache(c);
        let built = build(
            name,
            model,
            tp,
            true,
            bases,
            Arc::clone(&clock),
            make,
            tune,
            &kv,
        );
        if let Some(e) = built {
            return Some(e);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    None
}

/// Builds an engine on the first base port of `bases` whose listeners bind.
#[allow(clippy::too_many_arguments)]
fn build<T: Transport>(
    name: &str,
    model: &Model,
    tp: u32,
    prefill: bool,
    bases: impl Iterator<Item = u16>,
    clock: Arc<dyn Clock>,
    make: &dyn Fn(&str) -> T,
    tune: &dyn Fn(&mut PullConfig),
    kv: &dyn Fn(&RankCache) -> KvCache,
) -> Option<Engine<T>> {
    let mapping = TpMapping::new(tp, tp, model.sharding()).expect("tp valid for model");
    for base in bases {
        let caches: Vec<RankCache> = (0..tp)
            .map(|r| {
                let heads = mapping.heads_of(Side::Prefill, r).expect("rank");
                let spec = model.spec(heads.count);
                RankCache::in_memory(spec, heads.first, 0, prefill, model.shared)
            })
            .collect();
        let mut workers = Vec::new();
        let mut ok = true;
        for (r, cache) in caches.iter().enumerate() {
            let mut config = PullConfig::new(name, r as u32, tp);
            config.side_channel_port = base;
            config.handshake_timeout = Duration::from_secs(5);
            tune(&mut config);
            match PullWorker::new(
                make(&format!("{name}-{r}")),
                config,
                kv(cache),
                Arc::clone(&clock),
            ) {
                Ok(w) => workers.push(w),
                Err(kvxfer_core::pull::PullError::SideChannel(e)) if prefill => {
                    let _ = e;
                    ok = false;
                    break;
                }
                Err(e) => panic!("worker {name}-{r}: {e}"),
            }
        }
        if ok {
            return Some(Engine {
                caches,
                workers,
                scheduler: PullScheduler::new(name, "127.0.0.1", base),
                base_port: base,
                content: None,
            });
        }
    }
    None
}

impl<T: Transport> Engine<T> {
    /// Prefill: finishes `req_id` holding `blocks`, tells every rank to hold, returns the
    /// params for the decode.
    pub fn finish_prefill(&mut self, req_id: &str, blocks: &[u32]) -> KvTransferParams {
        let (params, meta) = self.hand_out(req_id, blocks);
        self.start_step(&meta);
        params
    }

    /// Prefill: the scheduler finishes `req_id` and hands its reference out, one step before
    /// the workers see the step that holds the blocks ([`Engine::start_step`]), as an engine
    /// answers before its next step runs.
    pub fn hand_out(&mut self, req_id: &str, blocks: &[u32]) -> (KvTransferParams, StepMeta) {
        let p = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        let d = self.scheduler.request_finished(
            req_id,
            Some(&p),
            true,
            std::slice::from_ref(&blocks.to_vec()),
            self.content,
        );
        assert!(d.delay_free);
        let meta = self.scheduler.build_step_meta();
        (d.params.expect("params"), meta)
    }

    /// Runs a step's metadata on every rank.
    pub fn start_step(&mut self, meta: &StepMeta) {
        for w in &mut self.workers {
            w.start_load_kv(meta);
        }
    }

    /// Decode: schedules a load of `params` into `local` blocks and starts it on every rank.
    pub fn start_load(
        &mut self,
        req_id: &str,
        params: &KvTransferParams,
        local: &[u32],
        external_tokens: usize,
    ) -> StepMeta {
        let mut p = params.clone();
        self.scheduler
            .after_alloc(
                req_id,
                &mut p,
                &[local.to_vec()],
                external_tokens,
                None,
                self.content,
            )
            .expect("after alloc");
        let meta = self.scheduler.build_step_meta();
        for w in &mut self.workers {
            w.start_load_kv(&meta);
        }
        meta
    }

    /// Polls every rank once; returns per-rank results.
    pub fn poll(&mut self) -> Vec<Finished> {
        self.workers.iter_mut().map(|w| w.get_finished()).collect()
    }
}

/// The loads one poll reported failed, as (request, invalid blocks), sorted by request.
pub fn failed_loads(f: &Finished) -> Vec<(String, Vec<u32>)> {
    let mut failed: Vec<(String, Vec<u32>)> = f
        .failed
        .iter()
        .map(|l| (l.req_id.clone(), l.invalid_blocks.clone()))
        .collect();
    failed.sort();
    failed
}

/// Polls `engines` until `done` says so or 60 s pass (a hang guard, not a timing check).
pub fn poll_until<T: Transport>(
    engines: &mut [&mut Engine<T>],
    mut done: impl FnMut(usize, &[Finished]) -> bool,
) {
    let start = Instant::now();
    loop {
        let mut all = true;
        for (i, e) in engines.iter_mut().enumerate() {
            let f = e.poll();
            if !done(i, &f) {
                all = false;
            }
        }
        if all {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "scenario did not finish within 60 s"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode cache whose block 2 holds the prefill's block 5, copied byte for byte.
    fn loaded() -> (RankCache, Vec<(u32, u32)>) {
        let model = Model::small(BlockOrder::Hnd, 2);
        let pre = RankCache::new(model.spec(2), 0, true);
        let mut dec = RankCache::new(model.spec(2), 0, false);
        for layer in 0..model.layers {
            for &part in pre.spec.parts() {
                for t in 0..model.tokens {
                    for h in 0..2 {
                        let (from, len) = pre.offset(layer, part, 5, t, h);
                        let (to, _) = dec.offset(layer, part, 2, t, h);
                        dec.mem[to..to + len].copy_from_slice(&pre.mem[from..from + len]);
                    }
                }
            }
        }
        (dec, vec![(5, 2)])
    }

    #[test]
    fn a_prefill_cache_holds_each_elements_identity_byte() {
        let model = Model::small(BlockOrder::Nhd, 2);
        // A second TP rank's cache of a pipeline stage: global heads 2.. and layers 4..
        let pre = RankCache::with_layers(model.spec(2), 2, 4, true);
        let (at, len) = pre.offset(1, Part::Value, 3, 1, 1);
        for e in 0..len {
            assert_eq!(
                pre.mem[at + e],
                element_byte(5, Part::Value, 3, 1, 3, e as u64)
            );
        }
    }

    #[test]
    fn neighbouring_identities_hold_different_bytes() {
        let run = |layer, part, block, token, head| {
            (0..16)
                .map(|e| element_byte(layer, part, block, token, head, e))
                .collect::<Vec<u8>>()
        };
        let base = run(1, Part::Key, 3, 2, 1);
        let distinct: std::collections::HashSet<u8> = base.iter().copied().collect();
        assert!(distinct.len() > 8, "a run's bytes barely vary: {base:?}");
        for other in [
            run(0, Part::Key, 3, 2, 1),
            run(1, Part::Value, 3, 2, 1),
            run(1, Part::Key, 2, 2, 1),
            run(1, Part::Key, 3, 1, 1),
            run(1, Part::Key, 3, 2, 0),
        ] {
            let same = base.iter().zip(&other).filter(|(a, b)| a == b).count();
            assert!(same < 4, "{same} of 16 bytes equal: {base:?} / {other:?}");
        }
    }

    #[test]
    fn a_loaded_block_verifies_and_a_changed_byte_is_named() {
        let (mut dec, pairs) = loaded();
        dec.verify(&pairs).expect("copied block");
        let (at, _) = dec.offset(1, Part::Value, 2, 1, 0);
        dec.mem[at + 3] ^= 1;
        let err = dec.verify(&pairs).expect_err("changed byte");
        assert!(
            err.starts_with("layer 1 Value block 2 token 1 head 0 byte 3:"),
            "{err}"
        );
        dec.verify_except(&pairs, &[2])
            .expect("the changed block left out");
    }

    #[test]
    fn a_guard_byte_changed_in_a_block_nothing_loaded_is_named() {
        let (mut dec, pairs) = loaded();
        let (at, len) = dec.offset(0, Part::Key, 7, 0, 1);
        dec.mem[at + len - 1] = 0;
        let err = dec.verify(&pairs).expect_err("changed guard");
        assert!(err.contains("block 7 token 0 head 1"), "{err}");
        assert!(err.contains("want 0xee (source block None)"), "{err}");
    }
}
