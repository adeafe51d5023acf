//! `kvxfer bench`: a prefill engine and a decode engine in one process, moving batches of
//! requests over a transport and verifying every byte, measured against single-thread memcpy
//! of the same bytes in the same run.

pub mod chart;
mod fill;
mod push;
mod report;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::SystemClock;
use kvxfer_core::pull::{KvCache, PullConfig, PullMetrics, PullScheduler, PullWorker};
use kvxfer_core::wire::params::KvTransferParams;
use kvxfer_core::{MemoryKind, TransportError};
use kvxfer_layout::{BlockOrder, CacheSpec, LayoutError, Side, TpMapping};

use crate::models::ModelShape;
use crate::transports::{AnyTransport, TransportKind, open};
pub use report::BenchReport;

/// Transfer style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Decode READs (vLLM style).
    Pull,
    /// Prefill WRITEs (SGLang style).
    Push,
}

/// Where the caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory.
    Host,
    /// GPU memory.
    Gpu,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Model shape.
    pub model: ModelShape,
    /// In-block order.
    pub order: BlockOrder,
    /// Prefill TP.
    pub prefill_tp: u32,
    /// Prefill pipeline stages (push mode).
    pub prefill_pp: u32,
    /// Decode TP.
    pub decode_tp: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per region (raised to fit `concurrency` requests).
    pub num_blocks: u32,
    /// Measured requests.
    pub requests: u32,
    /// Tokens per request.
    pub tokens_per_request: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Unmeasured requests first (the first one includes the handshake).
    pub warmup: u32,
    /// Whether block ids are scattered (true) or consecutive (false).
    pub fragmented: bool,
    /// Transport.
    pub transport: TransportKind,
    /// Memory kind.
    pub memory: Memory,
    /// Transfer style.
    pub mode: Mode,
    /// Seed of the block choice.
    pub seed: u64,
    /// Decode only: pull from a prefill served by `kvxfer serve` at this side channel.
    pub connect: Option<(String, u16)>,
    /// Pull: a READ pending longer than this is cancelled and its request failed.
    pub transfer_timeout: Duration,
    /// Pull: never post by index into prepared lists (see `PullConfig::prepared_lists`).
    pub raw_posts: bool,
    /// Pull: a failed request is counted and the run goes on (a prefill that restarts
    /// under the run); without it the first failure ends the run.
    pub keep_going: bool,
}

/// Why a bench could not run or failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The configuration cannot run here.
    #[error("{0}")]
    Config(String),
    /// A layout parameter is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The transport refused.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A load failed.
    #[error("request {req} failed: {reason}")]
    Failed {
        /// Request id.
        req: String,
        /// Why.
        reason: String,
    },
    /// Bytes arrived wrong.
    #[error("verification failed: {0}")]
    Verification(String),
    /// The caches do not fit in this machine's memory.
    #[error("KV cache: {0}")]
    Memory(#[from] kvxfer_core::host_mem::HostMemError),
}

pub(crate) struct Rank {
    pub(crate) mem: kvxfer_core::host_mem::HostMem,
    pub(crate) spec: CacheSpec,
    pub(crate) first_head: u32,
    pub(crate) first_layer: u32,
}

impl Rank {
    pub(crate) fn new(spec: CacheSpec, first_head: u32) -> Result<Self, BenchError> {
        let len = usize::try_from(spec.total_bytes())
            .map_err(|_| BenchError::Config("KV cache larger than the address space".into()))?;
        Ok(Rank {
            mem: kvxfer_core::host_mem::HostMem::try_new(len, 0x5a)?,
            spec,
            first_head,
            first_layer: 0,
        })
    }

    pub(crate) fn kv(&mut self, model: &ModelShape) -> KvCache {
        let base = self.mem.as_mut_ptr() as u64;
        KvCache {
            spec: self.spec,
            bases: (0..u64::from(self.spec.num_regions()))
                .map(|r| base + r * self.spec.region_len())
                .collect(),
            memory: MemoryKind::Host,
            total_kv_heads: model.kv_heads,
            total_layers: model.layers,
            first_layer: self.first_layer,
            layer_windows: None,
        }
    }
}

/// One side: ranks (memory) and their workers; workers drop first.
struct EngineSide {
    workers: Vec<PullWorker<AnyTransport>>,
    ranks: Vec<Rank>,
}

impl Drop for EngineSide {
    fn drop(&mut self) {
        self.workers.clear();
    }
}

pub(crate) fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// `n` sorted distinct blocks out of `range`, scattered or consecutive.
pub(crate) fn choose(
    range: std::ops::Range<u32>,
    n: u32,
    fragmented: bool,
    state: &mut u64,
) -> Vec<u32> {
    if !fragmented {
        return (range.start..range.start + n).collect();
    }
    let mut all: Vec<u32> = range.collect();
    for i in (1..all.len()).rev() {
        let j = (xorshift(state) % (i as u64 + 1)) as usize;
        all.swap(i, j);
    }
    let mut v = all[..n as usize].to_vec();
    v.sort_unstable();
    v
}

fn side(
    c: &BenchConfig,
    mapping: &TpMapping,
    which: Side,
    tp: u32,
    num_blocks: u32,
    name: &str,
    (fixed_port, host): (Option<u16>, &str),
) -> Result<EngineSide, BenchError> {
    let prefill = which == Side::Prefill;
    let clock = Arc::new(SystemClock::default());
    let mut seed = c.seed ^ 0x5bd1_e995;
    for _attempt in 0..50 {
        let base = match (prefill, fixed_port) {
            (true, Some(p)) => p,
            (true, None) => 20_000 + (xorshift(&mut seed) % 30_000) as u16,
            (false, _) => 0,
        };
        let mut ranks = Vec::new();
        for r in 0..tp {
            let heads = mapping.heads_of(which, r)?;
            let spec = CacheSpec::new(c.model.rank_params(
                c.order,
                heads.count,
                c.model.layers,
                c.block_size,
                num_blocks,
            ))?;
            let mut rank = Rank::new(spec, heads.first)?;
            if prefill {
                fill::fill(&mut rank.mem, &spec, (heads.first, 0));
            }
            ranks.push(rank);
        }
        let mut workers = Vec::new();
        let mut retry = false;
        for r in 0..tp {
            let mut cfg = PullConfig::new(name, r, tp);
            cfg.side_channel_port = base;
            cfg.side_channel_host = host.to_string();
            cfg.transfer_timeout = c.transfer_timeout;
            cfg.prepared_lists = !c.raw_posts;
            let kv = ranks[r as usize].kv(&c.model);
            let transport = open(c.transport, &format!("{name}-{r}"))?;
            match PullWorker::new(transport, cfg, kv, clock.clone()) {
                Ok(w) => workers.push(w),
                Err(kvxfer_core::pull::PullError::SideChannel(e)) if prefill => {
                    if fixed_port.is_some() {
                        return Err(BenchError::Config(format!(
                            "cannot listen on port {base}: {e}"
                        )));
                    }
                    retry = true;
                    break;
                }
                Err(e) => return Err(BenchError::Config(e.to_string())),
            }
        }
        if !retry {
            return Ok(EngineSide { workers, ranks });
        }
    }
    Err(BenchError::Config(
        "no free port range for the prefill listeners".into(),
    ))
}

/// Runs the bench. `progress(done, total)` is called as requests finish.
pub fn run(c: &BenchConfig, progress: &mut dyn FnMut(u32, u32)) -> Result<BenchReport, BenchError> {
    crate::transports::availability(c.transport)?;
    if c.memory == Memory::Gpu {
        return Err(BenchError::Config(
            "GPU memory in `bench` is not supported yet; use --memory host (the loopback's GPU path is compiled with `--features cuda` but has not run on a GPU yet)".into(),
        ));
    }
    if c.requests == 0 || c.concurrency == 0 || c.tokens_per_request == 0 || c.block_size == 0 {
        return Err(BenchError::Config(
            "requests, concurrency, tokens per request and block size must be positive".into(),
        ));
    }
    if c.connect.is_some() {
        in_process_only(c)?;
    }
    if c.mode == Mode::Push {
        return push::run(c, progress);
    }
    if c.prefill_pp != 1 {
        return Err(BenchError::Config(
            "pipeline stages (--pp) are supported in push mode; use --mode push".into(),
        ));
    }
    let per_request = c.tokens_per_request.div_ceil(c.block_size);
    let num_blocks = c.num_blocks.max(per_request.saturating_mul(c.concurrency));
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    // The prefill runs here, or in another process (`kvxfer serve`) reached through `connect`.
    let mut pre = match &c.connect {
        None => Some(side(
            c,
            &mapping,
            Side::Prefill,
            c.prefill_tp,
            num_blocks,
            "bench-prefill",
            (None, "127.0.0.1"),
        )?),
        Some(_) => None,
    };
    let mut dec = side(
        c,
        &mapping,
        Side::Decode,
        c.decode_tp,
        num_blocks,
        "bench-decode",
        (None, "127.0.0.1"),
    )?;
    let (host, port) = match (&c.connect, &pre) {
        (Some((h, p)), _) => (h.clone(), *p),
        (None, Some(p)) => (
            "127.0.0.1".to_string(),
            p.workers[0].listener_port().unwrap_or(0),
        ),
        (None, None) => unreachable!("a local prefill exists without --connect"),
    };
    let mut psched = PullScheduler::new("bench-prefill", &host, port);
    let mut dsched = PullScheduler::new("bench-decode", "127.0.0.1", 0);
    let mut state = c.seed | 1;
    let total = c.warmup + c.requests;
    let mut report = BenchReport::default();
    let mut latencies = Vec::new();
    let mut measured = Duration::ZERO;
    let mut metrics = PullMetrics::default();
    let mut moved = 0u64;
    let mut next = 0u32;
    while next < total {
        let wave: Vec<u32> = (next..total.min(next + c.concurrency)).collect();
        next += wave.len() as u32;
        let mut jobs = Vec::new();
        for (slot, &i) in wave.iter().enumerate() {
            let id = format!("req-{i}");
            let part = num_blocks / c.concurrency;
            let local = choose(
                slot as u32 * part..(slot as u32 + 1) * part,
                per_request,
                c.fragmented,
                &mut state,
            );
            let remote = choose(
                0..source_blocks(c, per_request),
                per_request,
                c.fragmented,
                &mut state,
            );
            let asks = KvTransferParams {
                do_remote_decode: true,
                ..Default::default()
            };
            let decision = psched.request_finished(&id, Some(&asks), true, &remote);
            let mut params = decision
                .params
                .ok_or_else(|| BenchError::Config("prefill did not hold the request".into()))?;
            if c.connect.is_some() {
                // A served prefill holds nothing for us: name it and read its blocks directly.
                params.remote_engine_id = Some("served-prefill".into());
            }
            dsched
                .after_alloc(&id, &mut params, &local, c.tokens_per_request as usize)
                .map_err(|e| BenchError::Config(e.to_string()))?;
            jobs.push((id, remote, local));
        }
        let hold = psched.build_step_meta();
        for w in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
            w.start_load_kv(&hold);
        }
        let meta = dsched.build_step_meta();
        let start = Instant::now();
        for w in &mut dec.workers {
            w.start_load_kv(&meta);
        }
        let mut done: Vec<Vec<bool>> = vec![vec![false; c.decode_tp as usize]; jobs.len()];
        let mut finished_at = vec![None; jobs.len()];
        let mut failed_jobs = vec![false; jobs.len()];
        while finished_at.iter().any(Option::is_none) {
            for (r, w) in dec.workers.iter_mut().enumerate() {
                let f = w.get_finished();
                for failed in &f.failed {
                    if !c.keep_going {
                        return Err(BenchError::Failed {
                            req: failed.req_id.clone(),
                            reason: failed.reason.clone(),
                        });
                    }
                    eprintln!(
                        "request {} failed on decode rank {r} (going on): {}",
                        failed.req_id, failed.reason
                    );
                    if let Some(j) = jobs.iter().position(|(jid, _, _)| *jid == failed.req_id) {
                        failed_jobs[j] = true;
                    }
                }
                // Failed loads are in `recving` too: the request ended on this rank.
                for id in f.recving {
                    if let Some(j) = jobs.iter().position(|(jid, _, _)| *jid == id) {
                        done[j][r] = true;
                        if done[j].iter().all(|&x| x) && finished_at[j].is_none() {
                            finished_at[j] = Some(start.elapsed());
                        }
                    }
                }
            }
            for w in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
                w.get_finished();
            }
            if start.elapsed() > Duration::from_secs(300) {
                return Err(BenchError::Config(
                    "a wave of requests did not finish within 300 s".into(),
                ));
            }
            std::thread::yield_now();
        }
        let wave_time = finished_at
            .iter()
            .flatten()
            .max()
            .copied()
            .unwrap_or_default();
        let mut wave_metrics = PullMetrics::default();
        for w in &mut dec.workers {
            wave_metrics.merge(&w.take_metrics());
        }
        report.lost_connections += wave_metrics.lost_connections;
        report.peer_restarts += wave_metrics.peer_restarts;
        report.failed_requests += failed_jobs.iter().filter(|&&f| f).count() as u32;
        // Verify every byte of every request that succeeded, on every decode rank.
        for ((id, remote, local), _) in jobs.iter().zip(&failed_jobs).filter(|(_, f)| !**f) {
            let pairs: Vec<(u32, u32)> =
                remote.iter().copied().zip(local.iter().copied()).collect();
            for (r, rank) in dec.ranks.iter().enumerate() {
                let checked = fill::verify(&rank.mem, &rank.spec, (rank.first_head, 0), &pairs)
                    .map_err(|e| {
                        BenchError::Verification(format!("{id} on decode rank {r}: {e}"))
                    })?;
                report.verified_bytes += checked;
            }
        }
        if wave[0] < c.warmup {
            if wave[0] == 0 {
                report.first_transfer_ms = ms(finished_at[0].unwrap_or_default());
                report.handshake_ms =
                    ms(wave_metrics.handshake_time) / wave_metrics.handshakes.max(1) as f64;
            }
        } else {
            measured += wave_time;
            let ok = finished_at.iter().zip(&failed_jobs).filter(|(_, f)| !**f);
            latencies.extend(ok.filter_map(|(t, _)| *t));
            moved += wave_metrics.bytes;
            metrics.merge(&wave_metrics);
            report.requests += failed_jobs.iter().filter(|&&f| !f).count() as u32;
        }
        progress(next, total);
    }
    let piece = dec.ranks[0].spec.block_len() as usize;
    let source = pre.as_ref().map_or(&dec.ranks[0].mem, |p| &p.ranks[0].mem);
    let memcpy = memcpy_baseline(source, moved, piece);
    report.descriptors_raw = metrics.descriptors_raw;
    report.descriptors_posted = metrics.descriptors_posted;
    report.post_ms_per_request = ms(metrics.post_time) / f64::from(report.requests.max(1));
    report.plan_ms_per_request = ms(metrics.plan_time) / f64::from(report.requests.max(1));
    report.library(&metrics.backend);
    finish(&mut report, c, latencies, moved, measured, memcpy);
    Ok(report)
}

/// Single-thread memcpy of `bytes` bytes from `src` in pieces of `piece` bytes (wrapping
/// around the source and a 256 MiB destination): the baseline every ratio is taken against.
pub(crate) fn memcpy_baseline(src: &[u8], bytes: u64, piece: usize) -> Duration {
    let mut scratch = kvxfer_core::host_mem::HostMem::new(src.len().min(256 << 20), 1);
    let t = Instant::now();
    let mut copied = 0u64;
    let (mut s_at, mut d_at) = (0usize, 0usize);
    while copied < bytes {
        let n = piece
            .min((bytes - copied) as usize)
            .min(src.len())
            .min(scratch.len());
        if s_at + n > src.len() {
            s_at = 0;
        }
        if d_at + n > scratch.len() {
            d_at = 0;
        }
        scratch[d_at..d_at + n].copy_from_slice(&src[s_at..s_at + n]);
        std::hint::black_box(&scratch);
        s_at += n;
        d_at += n;
        copied += n as u64;
    }
    t.elapsed()
}

/// Fills the timing fields of `report` from latencies and totals.
pub(crate) fn finish(
    report: &mut BenchReport,
    c: &BenchConfig,
    mut latencies: Vec<Duration>,
    moved: u64,
    measured: Duration,
    memcpy: Duration,
) {
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p) as usize)
            .copied()
            .unwrap_or_default()
    };
    report.bytes = moved;
    report.seconds = measured.as_secs_f64();
    report.gb_per_s = moved as f64 / measured.as_secs_f64().max(1e-9) / 1e9;
    report.requests_per_s = f64::from(report.requests) / measured.as_secs_f64().max(1e-9);
    report.latency_p50_ms = ms(pct(0.5));
    report.latency_p99_ms = ms(pct(0.99));
    report.memcpy_gb_per_s = moved as f64 / memcpy.as_secs_f64().max(1e-9) / 1e9;
    report.ratio_to_memcpy = memcpy.as_secs_f64() / measured.as_secs_f64().max(1e-9);
    report.describe(c);
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `kvxfer serve --role prefill`: fills a prefill engine's caches, listens on `port` (rank r
/// on `port + r`) and answers reads until `stop` is set. Decode processes run
/// `kvxfer bench --connect HOST:PORT` with the same model, TP, block size and blocks.
pub fn serve(
    c: &BenchConfig,
    host: &str,
    port: u16,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), BenchError> {
    crate::transports::availability(c.transport)?;
    in_process_only(c)?;
    if c.mode == Mode::Push {
        return push::serve(c, host, port, stop);
    }
    let per_request = c.tokens_per_request.div_ceil(c.block_size.max(1));
    let num_blocks = source_blocks(c, per_request);
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    let mut pre = side(
        c,
        &mapping,
        Side::Prefill,
        c.prefill_tp,
        num_blocks,
        "served-prefill",
        (Some(port), host),
    )?;
    println!(
        "serving {} prefill (TP {}) on {host}:{port} over {}; Ctrl-C to stop",
        c.model.name, c.prefill_tp, c.transport
    );
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        for w in &mut pre.workers {
            w.get_finished();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for w in &mut pre.workers {
        w.shutdown();
    }
    Ok(())
}

/// The prefill blocks requests read from: `--num-blocks`, raised to hold one request. Not
/// the decode's concurrency: a `kvxfer serve` in another process must derive the same.
pub(crate) fn source_blocks(c: &BenchConfig, per_request: u32) -> u32 {
    c.num_blocks.max(per_request)
}

/// The loopback's agents live in one process: refuse it for runs that span processes.
fn in_process_only(c: &BenchConfig) -> Result<(), BenchError> {
    if c.transport == TransportKind::Loopback {
        return Err(BenchError::Config(
            "the loopback transport cannot cross processes; use --transport ucx or nixl".into(),
        ));
    }
    Ok(())
}
