//! Decode-side READs: posting each load's READs (coalesced plans or prepared-list
//! indices), polling them to completion or failure, and heartbeats for the prefill's leases.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{
    BlockPairs, CacheSide, HeadSlice, LinkKind, PlanOptions, TokenPairs, TransferPlan,
    plan_token_transfer_into,
};

use super::{Load, PullWorker, RemoteRank, Verify};
use crate::connector::KvCache;
use crate::connector::plan::{Grouped, Planned, Planner, Ranges};
use crate::pull::block_lists;
use crate::pull::notify;
use crate::pull::phases::{Counted, Next, Posted};
use crate::pull::scheduler::{GroupPairs, RecvRequest};
use crate::pull::stamps::{self, Held};
use crate::tally::Tally;
use crate::transport::{MemoryKind, Op, Transport, XferId, XferStatus};

/// What planning a load's READs reuses, so that a step does not allocate: the plan, the
/// range lists (local, remote) and the prepared lists' indices (local, remote).
#[derive(Default)]
pub(super) struct Buffers {
    plan: TransferPlan,
    ranges: Ranges,
    indices: (Vec<u32>, Vec<u32>),
}

impl<T: Transport> PullWorker<T> {
    pub(super) fn issue(&mut self, req: RecvRequest) {
        if let Some(why) = self.expired_at_prefill(&req) {
            self.metrics.expired_reads.tally(1);
            self.book.fail(req, why);
            return;
        }
        let start = self.clock.now();
        let mut verify = Vec::new();
        match self.post_reads(&req, &mut verify) {
            Ok(xfers) => {
                self.metrics
                    .post_time
                    .tally(self.clock.now().saturating_sub(start));
                if xfers.is_empty() {
                    self.book.done(&req);
                } else {
                    self.start(req, xfers, verify, None);
                }
            }
            Err((reason, posted)) => {
                self.metrics.failed_setups.tally(1);
                let engine_id = req.engine_id.clone();
                if posted.is_empty() {
                    self.book.fail(req, reason);
                } else {
                    // READs posted before the failure may still land in the blocks: the load
                    // is reported failed once they ended (poll_loads), never before.
                    self.start(req, posted, Vec::new(), Some(reason));
                }
                self.drop_if_peer_failed(&engine_id);
            }
        }
    }
    /// Puts a load whose READs were posted now in flight: `stamped` the ranks whose stamps
    /// are read after them, `failed` why it already failed.
    fn start(
        &mut self,
        req: RecvRequest,
        xfers: Vec<XferId>,
        stamped: Vec<Verify>,
        failed: Option<String>,
    ) {
        let now = self.clock.now();
        let xfers = xfers.into_iter().map(|x| (x, now)).collect();
        let digests = self.digests.is_some();
        self.book
            .start(Load::new(req, xfers, stamped, digests, failed));
    }
    /// Posts one READ per data link (and notifications for the rest); on error returns
    /// the reason and the transfers already posted (to be released once they end). A data
    /// link to a rank that stamps its references posts without its note, which `verify`
    /// keeps until the stamp READ that follows the data confirmed the hold.
    pub(super) fn post_reads(
        &mut self,
        req: &RecvRequest,
        verify: &mut Vec<Verify>,
    ) -> Result<Vec<XferId>, (String, Vec<XferId>)> {
        let Some(super::Connection { mapping, ranks, .. }) = self.book.connection(&req.engine_id)
        else {
            return Err((
                format!("engine {} is not connected", req.engine_id),
                Vec::new(),
            ));
        };
        // A prefill whose blocks hold another number of tokens: plans map token ranges.
        let own_tokens = self.cache.spec.tokens_per_block();
        let resized = ranks
            .values()
            .any(|r| r.spec.tokens_per_block() != own_tokens);
        let pairs = if resized {
            Vec::new()
        } else {
            req.pairs(self.cache.group_count())
                .map_err(|e| (e, Vec::new()))?
        };
        let moves = !req.local_block_ids.iter().all(Vec::is_empty);
        let links = mapping
            .links_for_decode(self.config.tp_rank)
            .map_err(|e| (e.to_string(), Vec::new()))?;
        let mut posted = Vec::new();
        for link in links {
            let readers = mapping
                .notifications_per_request(link.prefill_rank)
                .unwrap_or(1);
            let note = notify::read_done(&req.remote_req_id, readers);
            let Some(rank) = ranks.get(&link.prefill_rank) else {
                return Err((
                    format!("prefill rank {} was not connected", link.prefill_rank),
                    posted,
                ));
            };
            // A stamping rank's data READ goes without its note: the note goes once the stamp
            // READ confirmed the hold.
            let stamped = rank.stamps.is_some() && matches!(link.kind, LinkKind::Data(_));
            if stamped && req.stamp.is_none() {
                return Err((
                    format!(
                        "prefill rank {} stamps its references and this one has no stamp (not handed out by that prefill)",
                        link.prefill_rank
                    ),
                    posted,
                ));
            }
            if self.digests.is_some() && matches!(link.kind, LinkKind::Data(_)) {
                let missing = if rank.digests.is_none() {
                    Some("publishes no content digests (switch them on there too)")
                } else if !stamped {
                    Some("does not stamp its references, which content digests need")
                } else if resized {
                    Some("holds blocks of another size: content digests need equal block sizes")
                } else {
                    None
                };
                if let Some(why) = missing {
                    return Err((format!("prefill rank {} {why}", link.prefill_rank), posted));
                }
            }
            let data_note = (!stamped).then_some(note.as_slice());
            // Prepared lists describe one block table: single-group caches only.
            let single = match pairs.as_slice() {
                [one] => Some(*one),
                _ => None,
            };
            let indexed = rank
                .lists
                .zip(single)
                .filter(|(_, (remote, local))| block_lists::fragmented(remote, local));
            let data = match (link.kind, indexed) {
                (LinkKind::Data(_), Some((lists, (remote, local)))) => {
                    let planning = self.clock.now();
                    lists
                        .indices(
                            remote,
                            local,
                            &mut self.bufs.indices.0,
                            &mut self.bufs.indices.1,
                        )
                        .map_err(|e| (e, posted.clone()))?;
                    self.metrics
                        .plan_time
                        .tally(self.clock.now().saturating_sub(planning));
                    let x = self
                        .transport
                        .post_indexed(
                            Op::Read,
                            lists.local,
                            &self.bufs.indices.0,
                            lists.remote,
                            &self.bufs.indices.1,
                            data_note,
                        )
                        .map_err(|e| (e.to_string(), posted.clone()))?;
                    let pairs = local.len() as u64;
                    self.metrics.indexed_transfers.tally(1);
                    self.metrics
                        .bytes
                        .tally(pairs.saturating_mul(lists.bytes_per_block));
                    self.metrics
                        .descriptors_raw
                        .tally(pairs.saturating_mul(lists.raw_per_block));
                    self.metrics
                        .descriptors_posted
                        .tally(self.bufs.indices.0.len() as u64);
                    Some(x)
                }
                (LinkKind::Data(slice), None) if !pairs.is_empty() || (resized && moves) => {
                    let planning = self.clock.now();
                    let planned = if resized {
                        plan_resized_read(
                            rank,
                            &self.cache,
                            slice,
                            req,
                            &mut self.bufs.plan,
                            &mut self.bufs.ranges,
                        )
                    } else {
                        plan_read(
                            rank,
                            &self.cache,
                            slice,
                            &pairs,
                            &mut self.bufs.plan,
                            &mut self.bufs.ranges,
                        )
                    }
                    .map_err(|e| (e, posted.clone()))?;
                    self.metrics
                        .plan_time
                        .tally(self.clock.now().saturating_sub(planning));
                    let kinds = (self.cache.memory, self.cache.memory);
                    let x = self
                        .transport
                        .post(
                            Op::Read,
                            rank.peer,
                            kinds,
                            &self.bufs.ranges.0,
                            &self.bufs.ranges.1,
                            data_note,
                        )
                        .map_err(|e| (e.to_string(), posted.clone()))?;
                    self.metrics.bytes.tally(planned.bytes);
                    self.metrics.descriptors_raw.tally(planned.raw);
                    self.metrics.descriptors_posted.tally(planned.descriptors);
                    Some(x)
                }
                _ => {
                    if let Err(e) = self.transport.send_notification(rank.peer, &note) {
                        self.metrics.failed_notifications.tally(1);
                        return Err((
                            format!("notifying prefill rank {}: {e}", link.prefill_rank),
                            posted,
                        ));
                    }
                    None
                }
            };
            // A data READ posted: kept, and with a stamping rank its stamp READ to follow.
            if let Some(x) = data {
                posted.push(x);
                self.metrics.transfers.tally(1);
                if let (true, LinkKind::Data(slice)) = (stamped, link.kind) {
                    verify.push(Verify {
                        rank: link.prefill_rank,
                        note: note.clone(),
                        slice,
                    });
                }
            }
        }
        Ok(posted)
    }
    pub(super) fn poll_loads(&mut self) {
        let now = self.clock.now();
        let mut ended = Vec::new();
        let mut lost: Vec<(String, String)> = Vec::new();
        for (id, load) in self.book.loads_mut() {
            let had_failed = load.phases.failed();
            let mut first = None;
            // Stamp and digest READs are not counted with the data (`transfers`, `bytes`
            // neither).
            let data = load.phases.reading_data();
            let mut still = Vec::with_capacity(load.xfers.len());
            for &(x, posted) in &load.xfers {
                let failure = match self.transport.status(x) {
                    Ok(XferStatus::InProgress)
                        if now.saturating_sub(posted) > self.config.transfer_timeout =>
                    {
                        // Cancel before reporting: nothing may land in the blocks after the
                        // engine hears they are invalid. Release is bounded by the transport.
                        let _ = self.transport.release(x);
                        format!(
                            "transfer failed: no completion within {:?}",
                            self.config.transfer_timeout
                        )
                    }
                    Ok(XferStatus::InProgress) => {
                        still.push((x, posted));
                        continue;
                    }
                    Ok(XferStatus::Done) => {
                        if data {
                            self.metrics.transfer_time.tally(now.saturating_sub(posted));
                            if let Some(t) = self.transport.telemetry(x) {
                                self.metrics.backend.add(&t);
                            }
                        }
                        let _ = self.transport.release(x);
                        continue;
                    }
                    Ok(XferStatus::Failed(reason)) => {
                        let _ = self.transport.release(x);
                        format!("transfer failed: {reason}")
                    }
                    Err(e) => format!("transfer failed: {e}"),
                };
                self.metrics.failed_transfers.tally(1);
                first.get_or_insert_with(|| failure.clone());
                load.phases.fail(failure);
            }
            load.xfers = still;
            if let (false, Some(reason)) = (had_failed, first) {
                lost.push((load.req.engine_id.clone(), reason));
            }
            // Report only when nothing writes into the blocks any more.
            if load.xfers.is_empty() {
                ended.push(id.clone());
            }
        }
        for id in ended {
            if let Some(load) = self.book.take(&id) {
                self.end_phase(load);
            }
        }
        // A failed transfer means the prefill died, restarted or became unreachable: its
        // cached connection is not trusted again.
        for (engine_id, reason) in lost {
            self.lose_engine(&engine_id, &reason);
        }
    }
    /// A load none of whose transfers is in flight: does what its phases say (stamp READs,
    /// digest READs and their check, read-done notes) until it waits for a READ, a check or
    /// the next poll, or is reported.
    pub(super) fn end_phase(&mut self, mut load: Load) {
        loop {
            let now = self.clock.now();
            let busy = !load.xfers.is_empty();
            match load.phases.next(now, self.config.transfer_timeout, busy) {
                Next::Wait => return self.book.start(load),
                Next::ReadStamps => {
                    let posted = self.post_stamp_reads(&mut load);
                    load.phases.stamps_posted(posted);
                }
                Next::CheckStamps(posted) => {
                    let found = self.read_stamps(&load.req, posted);
                    load.phases.stamps_checked(found);
                }
                Next::DropStamps(slots) => self.scratch.give_back(slots),
                Next::ReadDigests => {
                    let posted = self.post_digest_reads(&mut load);
                    load.phases.digests_posted(posted);
                }
                Next::CheckDigests(landed) => {
                    let parts = self.start_check(&load.req, landed);
                    load.phases.checking(parts);
                }
                Next::DropDigests(landed) => self.drop_digests(landed),
                Next::Notify(ranks) => {
                    for v in &ranks {
                        self.send_read_done(&load.req, v);
                    }
                }
                Next::Count(c) => self.count(c),
                Next::Report { failed, notes } => {
                    // Read-done notes still kept (content digests) go now: the blocks were
                    // read.
                    for v in &notes {
                        self.send_read_done(&load.req, v);
                    }
                    return match failed {
                        None => self.book.done(&load.req),
                        Some(reason) => self.book.fail(load.req, reason),
                    };
                }
            }
        }
    }

    /// Counts what a load's phases saw.
    fn count(&mut self, c: Counted) {
        let m = &mut self.metrics;
        match c {
            Counted::VerifiedReference => m.verified_references.tally(1),
            Counted::StaleReference => m.stale_references.tally(1),
            Counted::VerifiedDigests => m.verified_digests.tally(1),
            Counted::DigestMismatch => m.digest_mismatches.tally(1),
            Counted::FailedSetup => m.failed_setups.tally(1),
        }
    }

    /// Posts the stamp READs of the load's pending ranks (each rank's read-done note waits
    /// for its check); short while the scratch has too few free slots. On failure the READs
    /// posted so far stay in `load.xfers`, their slots lent until they ended.
    fn post_stamp_reads(&mut self, load: &mut Load) -> Posted<Vec<u32>> {
        let Some(stamp) = load.req.stamp else {
            return Posted::Failed(Vec::new(), "stamped ranks but no stamp".into());
        };
        let Some(slots) = self.scratch.take(load.phases.pending().len()) else {
            return Posted::Short;
        };
        let Some(super::Connection { ranks, .. }) = self.book.connection(&load.req.engine_id)
        else {
            self.scratch.give_back(slots);
            let why = format!("engine {} is not connected", load.req.engine_id);
            return Posted::Failed(Vec::new(), why);
        };
        let now = self.clock.now();
        let mut posted = Vec::new();
        let mut unused = slots.into_iter();
        for v in load.phases.pending() {
            let slot = unused.next().unwrap_or_default();
            let remote = ranks
                .get(&v.rank)
                .and_then(|r| Some((r.peer, r.stamps?)))
                .and_then(|(peer, base)| {
                    Some((
                        peer,
                        crate::pull::stamps::StampTable::slot_range(base, stamp.generation)?,
                    ))
                });
            let Some((peer, remote)) = remote else {
                self.scratch
                    .give_back(std::iter::once(slot).chain(unused).collect());
                let why = format!("prefill rank {} has no stamp table", v.rank);
                return Posted::Failed(posted, why);
            };
            let local = self.scratch.slot_range(slot);
            let host = (MemoryKind::Host, MemoryKind::Host);
            match self
                .transport
                .post(Op::Read, peer, host, &[local], &[remote], None)
            {
                Ok(x) => {
                    load.xfers.push((x, now));
                    posted.push(slot);
                }
                Err(e) => {
                    self.scratch
                        .give_back(std::iter::once(slot).chain(unused).collect());
                    let why = format!("reading prefill rank {}'s stamp: {e}", v.rank);
                    return Posted::Failed(posted, why);
                }
            }
        }
        Posted::All(posted)
    }

    /// What each stamp READ found against the reference's stamp, giving the scratch slots
    /// back.
    fn read_stamps(
        &mut self,
        req: &RecvRequest,
        posted: Vec<(u32, Verify)>,
    ) -> Vec<(Verify, Result<Held, String>)> {
        let (slots, ranks): (Vec<u32>, Vec<Verify>) = posted.into_iter().unzip();
        let reads: Vec<[u64; 2]> = slots.iter().map(|&s| self.scratch.read(s)).collect();
        self.scratch.give_back(slots);
        let mut found = Vec::with_capacity(ranks.len());
        for (v, read) in ranks.into_iter().zip(reads) {
            let held = match req.stamp {
                Some(stamp) => stamps::check(read, stamp).map_err(|e| e.to_string()),
                None => Err("the reference has no stamp".into()),
            };
            if let Err(e) = &held {
                tracing::warn!(req = %req.req_id, engine = %req.engine_id, rank = v.rank, "{e}: the blocks read are discarded");
            }
            found.push((v, held));
        }
        found
    }

    /// The read-done note of a rank whose stamp confirmed the hold: the prefill may free the
    /// blocks now. A note that cannot be sent leaves them to the prefill's lease.
    fn send_read_done(&mut self, req: &RecvRequest, v: &Verify) {
        let peer = match self.book.connection(&req.engine_id) {
            Some(c) => c.ranks.get(&v.rank).map(|r| r.peer),
            _ => None,
        };
        let sent = peer.map(|p| self.transport.send_notification(p, &v.note));
        if !matches!(sent, Some(Ok(()))) {
            self.metrics.failed_notifications.tally(1);
            tracing::warn!(req = %req.req_id, rank = v.rank, "read-done note not sent: the prefill's lease frees the blocks");
        }
    }

    /// A stock prefill's expiry for the request's blocks, converted with the handshake's clock
    /// offset, falls within [`crate::wire::vllm_peer::EXPIRY_MARGIN`] of now: reading could race the free.
    fn expired_at_prefill(&self, req: &RecvRequest) -> Option<String> {
        let expiry = req.remote_expiry.as_ref()?.as_f64()?;
        let offset = self.book.connection(&req.engine_id)?.clock_offset?;
        crate::wire::vllm_peer::expired(expiry, offset, crate::sidechannel::monotonic_seconds())
    }

    /// Notes a request waiting for blocks, so that its prefill's lease is heartbeated, and
    /// handshakes with the prefill ahead of the load, as vLLM's decode does: a heartbeat
    /// needs the connection, and the load will too.
    pub(super) fn await_load(&mut self, wait: &RecvRequest) {
        self.drop_if_peer_failed(&wait.engine_id);
        if self.book.wait(wait) {
            self.spawn_handshake(wait);
        }
    }
    /// Heartbeats the requests that began waiting this step on a connected prefill and still
    /// wait (neither ended nor loading), once per engine: the time since the prefill
    /// finished is already spent from their leases.
    pub(super) fn heartbeat_new_waits(&mut self, waits: &[RecvRequest]) {
        let mut by_engine: Vec<(String, Vec<String>)> = Vec::new();
        for w in waits.iter().filter(|w| self.book.is_waiting(&w.req_id)) {
            let id = w.remote_req_id.clone();
            match by_engine.iter_mut().find(|(e, _)| *e == w.engine_id) {
                Some((_, ids)) => ids.push(id),
                None => by_engine.push((w.engine_id.clone(), vec![id])),
            }
        }
        for (engine_id, ids) in by_engine {
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            self.send_heartbeat(&engine_id, &ids);
        }
    }
    /// Every heartbeat interval, extends the prefill's lease on the blocks of each request
    /// loading or waiting to, on each connected rank that keeps leases.
    pub(super) fn send_heartbeats(&mut self) {
        let now = self.clock.now();
        if now.saturating_sub(self.last_heartbeat) < self.config.heartbeat_interval {
            return;
        }
        self.last_heartbeat = now;
        let busy = self.book.engines_of(true);
        for engine_id in &busy {
            self.heartbeat(engine_id);
        }
        self.close_unneeded(&busy, now);
    }
    /// Heartbeats every request loading or waiting to load from `engine_id`, now. Also called
    /// as the connection is made: the time its requests waited for it is already spent from
    /// their leases.
    pub(super) fn heartbeat(&mut self, engine_id: &str) {
        let ids: Vec<String> = self
            .book
            .requests(true)
            .filter(|r| r.engine_id == engine_id)
            .map(|r| r.remote_req_id.clone())
            .collect();
        // No ids, no note: a stock rank gets none (vllm_heartbeat), a kvxfer rank one per id.
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        self.send_heartbeat(engine_id, &ids);
    }
    /// Extends the leases of `ids` (the prefill's request ids) on each connected rank of
    /// `engine_id` that keeps leases: a stock vLLM rank gets one `HB:` note naming all of
    /// them, a kvxfer rank one note each.
    fn send_heartbeat(&mut self, engine_id: &str, ids: &[&str]) {
        let Some(conn) = self.book.connection(engine_id) else {
            return;
        };
        for rank in conn.ranks.values().filter(|r| r.lease_aware) {
            let notes: Vec<Vec<u8>> = if rank.stock {
                let (note, left_out) = notify::vllm_heartbeat(ids);
                if !left_out.is_empty() {
                    tracing::warn!(engine = engine_id, ids = ?left_out, "request ids a stock vLLM prefill would split at their commas get no heartbeat: their leases may run out");
                }
                note.into_iter().collect()
            } else {
                ids.iter().map(|id| notify::heartbeat(id)).collect()
            };
            for note in notes {
                match self.transport.send_notification(rank.peer, &note) {
                    Ok(()) => self.metrics.heartbeats.tally(1),
                    Err(_) => self.metrics.failed_notifications.tally(1),
                }
            }
        }
    }
}

/// Plans the READ of a load from a prefill whose blocks hold another number of tokens than
/// this cache's: token ranges, not block ids, pair them. One block table (no groups, no
/// per-layer windows: the handshake refused those); the load names its tokens, and the
/// prefill's list ends at the block of the load's last token, as this version's and stock
/// vLLM's prefills hand them off.
fn plan_resized_read(
    remote: &RemoteRank,
    own: &KvCache,
    slice: HeadSlice,
    req: &RecvRequest,
    plan: &mut TransferPlan,
    ranges: &mut Ranges,
) -> Result<Planned, String> {
    let mut out = Planner::new(Op::Read, plan, ranges);
    let (theirs, ours) = (remote.spec.tokens_per_block(), own.spec.tokens_per_block());
    if remote.groups.is_some() || own.groups.is_some() || own.layer_windows.is_some() {
        return Err(format!(
            "blocks of {theirs} tokens into blocks of {ours}: only without KV cache groups or per-layer windows"
        ));
    }
    let ([src], [dst]) = (
        req.remote_block_ids.as_slice(),
        req.local_block_ids.as_slice(),
    ) else {
        return Err("blocks of one KV cache group expected".into());
    };
    let Some([first, end]) = req.tokens else {
        return Err(format!(
            "the prefill's blocks hold {theirs} tokens, this cache's {ours}: the load needs the tokens it covers, which the engine did not name"
        ));
    };
    // The prefill's list ends at the block holding token `end - 1`.
    let held = end.div_ceil(u64::from(theirs));
    let src_first = held
        .checked_sub(src.len() as u64)
        .and_then(|b| b.checked_mul(u64::from(theirs)))
        .ok_or_else(|| {
            format!(
                "the prefill lists {} blocks of {theirs} tokens, more than the {end} tokens loaded fill",
                src.len()
            )
        })?;
    let src_side = CacheSide::new(&remote.spec, &remote.bases, remote.first_layer)
        .map_err(|e| e.to_string())?;
    let dst_side =
        CacheSide::new(&own.spec, &own.bases, own.first_layer).map_err(|e| e.to_string())?;
    let pairs = TokenPairs {
        src,
        src_first,
        dst,
        dst_first: first,
        tokens: first..end,
    };
    plan_token_transfer_into(
        &src_side,
        &dst_side,
        slice,
        &pairs,
        PlanOptions::default(),
        out.plan,
    )
    .map_err(|e| e.to_string())?;
    out.appended();
    Ok(out.planned)
}

/// Plans the READ of `pairs` (per KV cache group: prefill blocks, local blocks) from
/// `remote` into `own` into `ranges` (local, remote): one coalesced plan per group, on that
/// group's layers alone.
fn plan_read(
    remote: &RemoteRank,
    own: &KvCache,
    slice: HeadSlice,
    pairs: &[GroupPairs<'_>],
    plan: &mut TransferPlan,
    ranges: &mut Ranges,
) -> Result<Planned, String> {
    let mut out = Planner::new(Op::Read, plan, ranges);
    match (&remote.groups, &own.groups) {
        (None, None) => {
            let [(src_blocks, dst_blocks)] = pairs else {
                return Err(format!("{} KV cache groups of blocks for one", pairs.len()));
            };
            let src = CacheSide::new(&remote.spec, &remote.bases, remote.first_layer)
                .map_err(|e| e.to_string())?;
            let dst = CacheSide::new(&own.spec, &own.bases, own.first_layer)
                .map_err(|e| e.to_string())?;
            let blocks = BlockPairs {
                src: src_blocks,
                dst: dst_blocks,
                windows: own.layer_windows.as_deref(),
            };
            out.add(&src, &dst, slice, &blocks)?;
        }
        (Some(theirs), Some(ours)) if theirs == ours => {
            let caches = Grouped {
                groups: ours,
                src: (&remote.spec, &remote.bases),
                dst: (&own.spec, &own.bases),
                rank_heads: own.spec.kv_heads(),
            };
            for (g, (src_blocks, dst_blocks)) in pairs.iter().enumerate() {
                if !dst_blocks.is_empty() {
                    out.add_group(&caches, g, slice, (src_blocks, dst_blocks))?;
                }
            }
        }
        _ => return Err("the prefill's KV cache groups differ from this cache's".into()),
    }
    Ok(out.planned)
}
