//! `kvxfer bench` in pull mode (the default): the decode ranks READ each request's blocks
//! from the prefill ranks, in waves of `concurrency`, and every byte is verified; and the
//! prefill that `kvxfer serve` runs for decodes in other processes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::SystemClock;
use kvxfer_core::pull::{PullConfig, PullMetrics, PullScheduler, PullWorker};
use kvxfer_core::wire::params::KvTransferParams;
use kvxfer_layout::{CacheSpec, Side, TpMapping};

use super::blocks::{choose, source_blocks, xorshift};
use super::config::{BenchConfig, BenchError};
use super::discovery::{Resolver, register};
use super::fill;
use super::rank::Rank;
use super::report::BenchReport;
use super::timing::{
    POLL_PAUSE, ceiling_baseline, digest_baseline, finish, mean_piece, memcpy_baseline, ms,
};
use crate::transports::{AnyTransport, open};

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
            let mut rank = Rank::new(spec, heads.first, c.memory)?;
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
            // A served prefill (`kvxfer serve`, a fixed port) holds no request: the bench's
            // decode makes its references up, so they carry no stamp it could confirm.
            cfg.stamp_references = fixed_port.is_none();
            cfg.digest = c.digest;
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

/// Pull mode: the decode READs each request from the prefill, in waves of `concurrency`.
pub(super) fn run(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    if c.prefill_pp != 1 {
        return Err(BenchError::Config(
            "pipeline stages (--pp) are supported in push mode; use --mode push".into(),
        ));
    }
    let per_request = c.tokens_per_request.div_ceil(c.block_size);
    let num_blocks = c.num_blocks.max(per_request.saturating_mul(c.concurrency));
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    // The prefill runs here, or in another process (`kvxfer serve`) reached through `connect`
    // or found through discovery.
    let mut pre = match (&c.connect, &c.discovery) {
        (None, None) => Some(side(
            c,
            &mapping,
            Side::Prefill,
            c.prefill_tp,
            num_blocks,
            "bench-prefill",
            (None, "127.0.0.1"),
        )?),
        _ => None,
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
    // With discovery the prefill's side channel comes from etcd, and again after a restart.
    let resolver = c.discovery.as_ref().map(Resolver::start).transpose()?;
    let (mut host, mut port) = match (&c.connect, &pre, &resolver) {
        (Some((h, p)), _, _) => (h.clone(), *p),
        (None, Some(p), _) => (
            "127.0.0.1".to_string(),
            p.workers[0].listener_port().unwrap_or(0),
        ),
        (None, None, Some(r)) => r.endpoint(ENGINE_WAIT)?,
        (None, None, None) => unreachable!("a local prefill exists without --connect"),
    };
    // A served prefill holds nothing for us: name it and read its blocks directly.
    let served_id = match &c.discovery {
        Some(d) => Some(d.engine_id.clone()),
        None => c.connect.as_ref().map(|_| "served-prefill".to_string()),
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
    let mut prefill_digest = Duration::ZERO;
    let mut next = 0u32;
    while next < total {
        if let Some(r) = &resolver {
            lose_engine(r, &mut dec.workers);
            // Lost, or back under a new instance: the next wave reads from whatever is
            // registered now (waiting for it while it is away).
            let now = r.endpoint(ENGINE_WAIT)?;
            if now != (host.clone(), port) {
                (host, port) = now;
                psched = PullScheduler::new("bench-prefill", &host, port);
            }
        }
        let instance = resolver.as_ref().and_then(Resolver::instance);
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
            let decision = psched.request_finished(
                &id,
                Some(&asks),
                true,
                std::slice::from_ref(&remote),
                None,
            );
            let mut params = decision
                .params
                .ok_or_else(|| BenchError::Config("prefill did not hold the request".into()))?;
            if let Some(id) = &served_id {
                params.remote_engine_id = Some(id.clone());
            }
            dsched
                .after_alloc(
                    &id,
                    &mut params,
                    std::slice::from_ref(&local),
                    c.tokens_per_request as usize,
                    None,
                    None,
                )
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
            if let Some(r) = &resolver {
                lose_engine(r, &mut dec.workers);
            }
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
            std::thread::sleep(POLL_PAUSE);
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
        for w in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
            prefill_digest += w.take_metrics().digest_time;
        }
        report.lost_connections += wave_metrics.lost_connections;
        report.peer_restarts += wave_metrics.peer_restarts;
        report.failed_requests += failed_jobs.iter().filter(|&&f| f).count() as u32;
        if let (Some(r), Some(d), true) = (&resolver, &c.discovery, failed_jobs.contains(&true)) {
            // Its keys outlive a dead prefill by at most the lease's TTL (and etcd's expiry
            // check, 0.5 s): wait that long for discovery to say what happened.
            r.settle(instance, d.ttl + Duration::from_secs(1));
        }
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
    let ceiling = ceiling_baseline(
        source,
        moved,
        mean_piece(moved, metrics.descriptors_posted).unwrap_or(piece),
        report.requests,
    );
    report.descriptors_raw = metrics.descriptors_raw;
    report.descriptors_posted = metrics.descriptors_posted;
    report.post_ms_per_request = ms(metrics.post_time) / f64::from(report.requests.max(1));
    report.plan_ms_per_request = ms(metrics.plan_time) / f64::from(report.requests.max(1));
    report.library(&metrics.backend);
    if c.digest {
        report.digest = true;
        report.digest_gb_per_s = digest_baseline(source, moved, piece);
        report.prefill_digest_ms_per_request = ms(prefill_digest) / f64::from(total.max(1));
    }
    finish(&mut report, c, latencies, moved, measured, memcpy, ceiling);
    Ok(report)
}

/// How long a bench waits for its prefill engine to be registered (at start, or back after
/// a restart).
const ENGINE_WAIT: Duration = Duration::from_secs(60);

/// Fails the loads in flight from the prefill engine when discovery reports it lost.
fn lose_engine(r: &Resolver, workers: &mut [PullWorker<AnyTransport>]) {
    for reason in r.lost() {
        let id = r.engine_id();
        eprintln!("discovery: prefill engine {id} lost: {reason}");
        for w in workers.iter_mut() {
            w.engine_lost(id, &reason);
        }
    }
}

/// Pull mode of `kvxfer serve`: the prefill ranks answer reads until `stop` is set.
pub(super) fn serve(
    c: &BenchConfig,
    host: &str,
    port: u16,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), BenchError> {
    let per_request = c.tokens_per_request.div_ceil(c.block_size.max(1));
    let num_blocks = source_blocks(c, per_request);
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    let mut pre = side(
        c,
        &mapping,
        Side::Prefill,
        c.prefill_tp,
        num_blocks,
        c.discovery
            .as_ref()
            .map_or("served-prefill", |d| d.engine_id.as_str()),
        (Some(port), host),
    )?;
    // Registered for as long as this serves; dropped (the lease revoked) on the way out.
    let _registration = c
        .discovery
        .as_ref()
        .map(|d| register(d, &pre.workers, host))
        .transpose()?;
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
