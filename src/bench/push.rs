//! `kvxfer bench --mode push`: prefill ranks WRITE each request ("room") into the decode
//! ranks through the bootstrap registry (or etcd, with `--discovery`), in chunks, as the
//! SGLang-style connector does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::SystemClock;
use kvxfer_core::push::{
    BootstrapRegistry, PushBuffers, PushDecode, PushDecodeConfig, PushMetrics, PushPrefill,
    PushPrefillConfig, RoomStatus, StateKind,
};
use kvxfer_layout::{CacheSpec, LayerRange, PpSplit, Side, TpMapping};

use super::blocks::{choose, source_blocks};
use super::config::{BenchConfig, BenchError};
use super::discovery::{push_directory, register_push};
use super::fill;
use super::rank::Rank;
use super::report::BenchReport;
use super::timing::{
    POLL_PAUSE, ceiling_baseline, digest_baseline, finish, mean_piece, memcpy_baseline, ms,
};
use crate::transports::{AnyTransport, open};

/// Pages per chunk (a chunked prefill sends its KV as it computes it).
const CHUNK_PAGES: usize = 32;
/// How long a decode waits for a discovered prefill engine to be registered whole.
const ENGINE_WAIT: Duration = Duration::from_secs(60);

struct Prefill {
    workers: Vec<PushPrefill<AnyTransport>>,
    ranks: Vec<Rank>,
    registry: BootstrapRegistry,
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.workers.clear();
    }
}

struct Decode {
    workers: Vec<PushDecode<AnyTransport>>,
    ranks: Vec<Rank>,
}

impl Drop for Decode {
    fn drop(&mut self) {
        self.workers.clear();
    }
}

fn buffers(c: &BenchConfig, rank: &mut Rank) -> PushBuffers {
    PushBuffers {
        kv: rank.kv(&c.model),
        aux: Vec::new(),
        state: Vec::new(),
        state_kind: StateKind::None,
    }
}

/// The ranks of one side: TP ranks holding `layers` (a pipeline stage on the prefill side).
fn ranks(
    c: &BenchConfig,
    mapping: &TpMapping,
    side: Side,
    tp: u32,
    num_blocks: u32,
    layers: LayerRange,
) -> Result<Vec<Rank>, BenchError> {
    (0..tp)
        .map(|r| {
            let heads = mapping.heads_of(side, r)?;
            let spec = CacheSpec::new(c.model.rank_params(
                c.order,
                heads.count,
                layers.count,
                c.block_size,
                num_blocks,
            ))?;
            let mut rank = Rank::new(spec, heads.first, c.memory)?;
            rank.first_layer = layers.first;
            if side == Side::Prefill {
                fill::fill(&mut rank.mem, &spec, (heads.first, layers.first));
            }
            Ok(rank)
        })
        .collect()
}

/// Prefill ranks (every stage × TP rank) with their bootstrap registry bound at `bind`.
fn prefill_side(
    c: &BenchConfig,
    mapping: &TpMapping,
    num_blocks: u32,
    bind: (&str, u16),
    clock: Arc<dyn kvxfer_core::clock::Clock>,
) -> Result<Prefill, BenchError> {
    let registry = BootstrapRegistry::bind(bind.0, bind.1).map_err(BenchError::Config)?;
    let split = PpSplit::even(c.model.layers, c.prefill_pp)?;
    let mut pre = Prefill {
        workers: Vec::new(),
        ranks: Vec::new(),
        registry,
    };
    for stage in split.stages() {
        pre.ranks.extend(ranks(
            c,
            mapping,
            Side::Prefill,
            c.prefill_tp,
            num_blocks,
            *stage,
        )?);
    }
    for i in 0..c.prefill_pp {
        for r in 0..c.prefill_tp {
            let cfg = PushPrefillConfig {
                tp: (r, c.prefill_tp),
                pp: (i, c.prefill_pp),
                host: bind.0.into(),
                port: 0,
                registry: (bind.0.into(), pre.registry.port()),
                bootstrap_timeout: Duration::from_secs(60),
                request_timeout: Duration::from_secs(5),
                idle_decode_timeout: PushPrefillConfig::IDLE_DECODE_TIMEOUT,
            };
            let bufs = buffers(c, &mut pre.ranks[(i * c.prefill_tp + r) as usize]);
            let t = open(c.transport, &format!("bench-push-p{i}-{r}"))?;
            pre.workers.push(
                PushPrefill::new(t, cfg, bufs, clock.clone())
                    .map_err(|e| BenchError::Config(e.to_string()))?,
            );
        }
    }
    Ok(pre)
}

/// The prefill blocks a room's KV comes from: derived from the seed, the room id and the
/// prefill's block count alone, so a prefill in another process (`kvxfer serve --mode push`)
/// and the decode that verifies agree without exchanging them.
pub(super) fn source_pages(c: &BenchConfig, room: u64, per_request: u32) -> Vec<u32> {
    let mut state = (c.seed ^ room.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    let blocks = source_blocks(c, per_request);
    choose(0..blocks, per_request, c.fragmented, &mut state)
}

/// Runs the push-mode bench.
pub(super) fn run(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    let per_request = c.tokens_per_request.div_ceil(c.block_size);
    let num_blocks = c.num_blocks.max(per_request.saturating_mul(c.concurrency));
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    let clock: Arc<dyn kvxfer_core::clock::Clock> = Arc::new(SystemClock::default());
    // The prefill runs here, or in another process (`kvxfer serve --mode push`) reached
    // through `connect` or found through discovery.
    let mut pre = match (&c.connect, &c.discovery) {
        (None, None) => Some(prefill_side(
            c,
            &mapping,
            num_blocks,
            ("127.0.0.1", 0),
            clock.clone(),
        )?),
        _ => None,
    };
    let directory = c.discovery.as_ref().map(push_directory).transpose()?;
    let mut dec = Decode {
        workers: Vec::new(),
        ranks: ranks(
            c,
            &mapping,
            Side::Decode,
            c.decode_tp,
            num_blocks,
            LayerRange {
                first: 0,
                count: c.model.layers,
            },
        )?,
    };
    for r in 0..c.decode_tp {
        let mut cfg = PushDecodeConfig::new(r, c.decode_tp);
        cfg.request_timeout = Duration::from_secs(5);
        cfg.digest = c.digest;
        if let Some(d) = &directory {
            cfg.directory = d.clone();
        }
        let bufs = buffers(c, &mut dec.ranks[r as usize]);
        let t = open(c.transport, &format!("bench-push-d{r}"))?;
        dec.workers
            .push(PushDecode::new(t, cfg, bufs, clock.clone()).map_err(BenchError::Config)?);
    }
    let bootstrap = match (&c.connect, &pre, &directory, &c.discovery) {
        (Some((h, p)), ..) => (h.clone(), *p),
        (None, Some(p), ..) => ("127.0.0.1".to_string(), p.registry.port()),
        (None, None, Some(dir), Some(d)) => dir
            .resolve(&d.engine_id, ENGINE_WAIT)
            .map_err(|e| BenchError::Config(format!("discovery: {e}")))?,
        _ => unreachable!("a local prefill exists without --connect or --discovery"),
    };
    // Rooms of a served prefill outlive this run: start from a fresh range each time.
    let room_base = match pre {
        None => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_micros() as u64)
                << 16
        }
        Some(_) => 0,
    };
    let mut state = c.seed | 1;
    let total = c.warmup + c.requests;
    let mut report = BenchReport::default();
    let (mut latencies, mut measured, mut moved) = (Vec::new(), Duration::ZERO, 0u64);
    let mut metrics = PushMetrics::default();
    let mut verified_rooms = 0u64;
    let mut next = 0u32;
    while next < total {
        let wave: Vec<u32> = (next..total.min(next + c.concurrency)).collect();
        next += wave.len() as u32;
        let mut jobs = Vec::new();
        let setup = Instant::now();
        for (slot, &i) in wave.iter().enumerate() {
            let room = room_base + u64::from(i);
            let part = num_blocks / c.concurrency;
            let local = choose(
                slot as u32 * part..(slot as u32 + 1) * part,
                per_request,
                c.fragmented,
                &mut state,
            );
            let remote = source_pages(c, room, per_request);
            for d in &mut dec.workers {
                d.add_room(
                    room,
                    (&bootstrap.0, bootstrap.1),
                    local.clone(),
                    None,
                    Vec::new(),
                );
            }
            for p in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
                p.add_room(room, remote.len(), None, Vec::new());
            }
            jobs.push((room, remote, local));
        }
        let rooms: Vec<u64> = jobs.iter().map(|j| j.0).collect();
        wait(pre.as_mut(), &mut dec, &rooms, |pre, dec| {
            jobs.iter().all(|(room, ..)| match pre {
                Some(pre) => pre
                    .workers
                    .iter()
                    .all(|p| p.status(*room) == Some(RoomStatus::WaitingForInput)),
                // A served prefill sends once it has everything; bootstrap ends there.
                None => dec
                    .workers
                    .iter()
                    .all(|d| d.status(*room) >= Some(RoomStatus::WaitingForInput)),
            })
        })?;
        let bootstrap_time = setup.elapsed();
        let start = Instant::now();
        for (room, remote, _) in &jobs {
            for p in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
                for chunk in remote.chunks(CHUNK_PAGES) {
                    p.send(*room, chunk).map_err(|e| BenchError::Failed {
                        req: room.to_string(),
                        reason: e.to_string(),
                    })?;
                }
            }
        }
        let mut finished_at = vec![None; jobs.len()];
        wait(pre.as_mut(), &mut dec, &rooms, |_, dec| {
            for (j, (room, ..)) in jobs.iter().enumerate() {
                if finished_at[j].is_none()
                    && dec
                        .workers
                        .iter()
                        .all(|d| d.status(*room) == Some(RoomStatus::Success))
                {
                    finished_at[j] = Some(start.elapsed());
                }
            }
            finished_at.iter().all(Option::is_some)
        })?;
        let wave_time = finished_at
            .iter()
            .flatten()
            .max()
            .copied()
            .unwrap_or_default();
        let mut wave_metrics = PushMetrics::default();
        for p in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
            let m = p.take_metrics();
            wave_metrics.kv_bytes += m.kv_bytes;
            wave_metrics.descriptors_raw += m.descriptors_raw;
            wave_metrics.descriptors_posted += m.descriptors_posted;
            wave_metrics.post_time += m.post_time;
            wave_metrics.plan_time += m.plan_time;
            wave_metrics.digest_time += m.digest_time;
            wave_metrics.backend.merge(&m.backend);
        }
        for d in &mut dec.workers {
            let m = d.take_metrics();
            if m.digest_mismatches > 0 {
                return Err(BenchError::Verification(format!(
                    "{} rooms failed their content digests",
                    m.digest_mismatches
                )));
            }
            verified_rooms += m.verified_rooms;
        }
        for (room, remote, local) in &jobs {
            let pairs: Vec<(u32, u32)> =
                remote.iter().copied().zip(local.iter().copied()).collect();
            for (r, rank) in dec.ranks.iter().enumerate() {
                let checked = fill::verify(&rank.mem, &rank.spec, (rank.first_head, 0), &pairs)
                    .map_err(|e| {
                        BenchError::Verification(format!("room {room} on decode rank {r}: {e}"))
                    })?;
                report.verified_bytes += checked;
                if pre.is_none() {
                    // The prefill's counters are in its own process: count what arrived.
                    wave_metrics.kv_bytes += checked;
                }
            }
            for p in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
                p.remove_room(*room);
            }
            for d in &mut dec.workers {
                d.remove_room(*room);
            }
        }
        if wave[0] < c.warmup {
            if wave[0] == 0 {
                report.handshake_ms = ms(bootstrap_time);
                report.first_transfer_ms = ms(bootstrap_time + finished_at[0].unwrap_or_default());
            }
        } else {
            measured += wave_time;
            latencies.extend(finished_at.iter().flatten().copied());
            moved += wave_metrics.kv_bytes;
            metrics.descriptors_raw += wave_metrics.descriptors_raw;
            metrics.descriptors_posted += wave_metrics.descriptors_posted;
            metrics.post_time += wave_metrics.post_time;
            metrics.plan_time += wave_metrics.plan_time;
            metrics.digest_time += wave_metrics.digest_time;
            metrics.backend.merge(&wave_metrics.backend);
            report.requests += jobs.len() as u32;
        }
        progress(next, total);
    }
    let source = pre.as_ref().map_or(&dec.ranks[0].mem, |p| &p.ranks[0].mem);
    let piece = dec.ranks[0].spec.block_len() as usize;
    let memcpy = memcpy_baseline(source, moved, piece);
    let ceiling = ceiling_baseline(
        source,
        moved,
        mean_piece(moved, metrics.descriptors_posted).unwrap_or(piece),
        report.requests,
    );
    report.prefill_elsewhere = pre.is_none();
    report.descriptors_raw = metrics.descriptors_raw;
    report.descriptors_posted = metrics.descriptors_posted;
    report.post_ms_per_request = ms(metrics.post_time) / f64::from(report.requests.max(1));
    report.plan_ms_per_request = ms(metrics.plan_time) / f64::from(report.requests.max(1));
    report.library(&metrics.backend);
    if c.digest {
        // Every room of every decode rank checked, or the digests were not on.
        let expected = u64::from(total) * u64::from(c.decode_tp);
        if verified_rooms != expected {
            return Err(BenchError::Verification(format!(
                "{verified_rooms} rooms verified their content digests, {expected} expected"
            )));
        }
        report.digest = true;
        report.digest_gb_per_s = digest_baseline(source, moved, piece);
        // Push digests inside the measured waves: the prefill digests a chunk before posting
        // its WRITE.
        report.prefill_digest_ms_per_request =
            ms(metrics.digest_time) / f64::from(report.requests.max(1));
    }
    finish(&mut report, c, latencies, moved, measured, memcpy, ceiling);
    Ok(report)
}

/// Polls both sides until `done`, failing when one of `rooms` fails or after 300 s.
fn wait(
    mut pre: Option<&mut Prefill>,
    dec: &mut Decode,
    rooms: &[u64],
    mut done: impl FnMut(Option<&Prefill>, &Decode) -> bool,
) -> Result<(), BenchError> {
    let start = Instant::now();
    loop {
        for p in pre.iter_mut().flat_map(|p| p.workers.iter_mut()) {
            p.poll();
        }
        for d in &mut dec.workers {
            d.poll();
        }
        if done(pre.as_deref(), dec) {
            return Ok(());
        }
        for &room in rooms {
            let errors = pre
                .iter()
                .flat_map(|p| p.workers.iter())
                .map(|p| p.error(room))
                .chain(dec.workers.iter().map(|d| d.error(room)));
            if let Some(reason) = errors.flatten().next() {
                return Err(BenchError::Failed {
                    req: format!("room {room}"),
                    reason,
                });
            }
        }
        if start.elapsed() > Duration::from_secs(300) {
            return Err(BenchError::Config(
                "push rooms did not complete within 300 s".into(),
            ));
        }
        std::thread::sleep(POLL_PAUSE);
    }
}

/// `kvxfer serve --mode push`: prefill ranks and their bootstrap registry on `host:port`,
/// answering every room a decode (`kvxfer bench --mode push --connect`) asks for: the room is
/// added when its request arrives, its KV written in chunks from [`source_pages`] once all
/// destinations are known, and forgotten once final. Runs until `stop`.
pub(super) fn serve(
    c: &BenchConfig,
    host: &str,
    port: u16,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), BenchError> {
    let per_request = c.tokens_per_request.div_ceil(c.block_size.max(1));
    let num_blocks = source_blocks(c, per_request);
    let mapping = TpMapping::new(c.prefill_tp, c.decode_tp, c.model.sharding())?;
    let clock: Arc<dyn kvxfer_core::clock::Clock> = Arc::new(SystemClock::default());
    let mut pre = prefill_side(c, &mapping, num_blocks, (host, port), clock)?;
    // Registered for as long as this serves; dropped (the lease revoked) on the way out.
    let bootstrap = (host, pre.registry.port());
    let _registration = c
        .discovery
        .as_ref()
        .map(|d| register_push(d, &pre.workers, bootstrap, pre.registry.instance()))
        .transpose()?;
    println!(
        "serving {} prefill (TP {} x PP {}, push) on {host}:{} over {}; Ctrl-C to stop",
        c.model.name,
        c.prefill_tp,
        c.prefill_pp,
        pre.registry.port(),
        c.transport
    );
    let mut sent: std::collections::HashSet<u64> = Default::default();
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let mut requested = std::collections::BTreeSet::new();
        for p in &mut pre.workers {
            p.poll();
            requested.extend(p.requested_rooms());
        }
        for &room in &requested {
            for p in &mut pre.workers {
                if p.status(room)
                    .is_some_and(|s| s == RoomStatus::Bootstrapping)
                {
                    p.add_room(room, per_request as usize, None, Vec::new());
                }
            }
        }
        let rooms: std::collections::BTreeSet<u64> =
            pre.workers.iter().flat_map(|p| p.known_rooms()).collect();
        for room in rooms {
            let statuses: Vec<Option<RoomStatus>> =
                pre.workers.iter().map(|p| p.status(room)).collect();
            tracing::trace!(room, ?statuses, "served room");
            if !sent.contains(&room)
                && statuses
                    .iter()
                    .all(|s| *s == Some(RoomStatus::WaitingForInput))
            {
                let pages = source_pages(c, room, per_request);
                for p in &mut pre.workers {
                    for chunk in pages.chunks(CHUNK_PAGES) {
                        if let Err(e) = p.send(room, chunk) {
                            tracing::warn!(room, "send failed: {e}");
                            break;
                        }
                    }
                }
                sent.insert(room);
            } else if statuses.iter().all(|s| s.is_none_or(RoomStatus::is_final)) {
                for p in &mut pre.workers {
                    if let Some(e) = p.error(room) {
                        tracing::warn!(room, "room failed: {e}");
                    }
                    p.remove_room(room);
                }
                sent.remove(&room);
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}
