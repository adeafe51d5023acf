//! A push prefill's sends: planning each chunk against every decode rank it serves and
//! posting the WRITEs, with aux and state items on the chunk that completes the room.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{BlockPairs, CacheSide, CacheSpec, HeadSlice, LinkKind, TransferPlan};

use super::room::Chunk;
use super::{PushError, PushPrefill};
use crate::connector::KvCache;
use crate::connector::plan::{Grouped, Planned, Planner, Ranges};
use crate::push::digests::{Coverage, PageDigests};
use crate::push::messages::{self, BufferWire, RoomRequest};
use crate::tally::Tally;
use crate::transport::{AddrRange, MemoryKind, Op, Transport, XferId};

impl<T: Transport> PushPrefill<T> {
    /// Sends the next chunk of a room: `pages` are this rank's source pages, paired with the
    /// destinations' next pages. The chunk completing the room also carries aux and state.
    pub fn send(&mut self, room: u64, pages: &[u32]) -> Result<(), PushError> {
        self.send_chunk(room, pages, None, true)
    }

    /// Sends this rank's layers `layers` (its own indices, `0..` its stage's layer count) of
    /// `pages` as one chunk: for streaming each layer as the engine computes it. The chunk
    /// that `completes` these pages (their last layers) moves on to the room's next pages,
    /// and completes the room when none are left (aux and state go with it). A content
    /// digest covers the pages whole, taken with the completing chunk.
    pub fn send_layers(
        &mut self,
        room: u64,
        pages: &[u32],
        layers: std::ops::Range<u32>,
        completes: bool,
    ) -> Result<(), PushError> {
        let spec = &self.bufs.kv.spec;
        if layers.is_empty() || layers.end > spec.num_layers() {
            return Err(PushError::Setup(format!(
                "layers {layers:?} of a rank holding {}",
                spec.num_layers()
            )));
        }
        if self.bufs.kv.groups.is_some() {
            return Err(PushError::Setup(
                "a cache in KV cache groups (a hybrid model) sends whole pages, not layers".into(),
            ));
        }
        if spec.kind() == kvxfer_layout::CacheKind::CrossLayer {
            return Err(PushError::Setup(
                "a cross-layer cache holds every layer in each block: send whole pages".into(),
            ));
        }
        self.send_chunk(room, pages, Some(layers), completes)
    }

    fn send_chunk(
        &mut self,
        room: u64,
        pages: &[u32],
        layers: Option<std::ops::Range<u32>>,
        completes: bool,
    ) -> Result<(), PushError> {
        let chunk = self
            .rooms
            .get(&room)
            .ok_or(PushError::UnknownRoom(room))?
            .next_layer_chunk(room, pages.len(), completes)?;
        let mut posted = Vec::new();
        let mut failure = None;
        let started = self.clock.now();
        for dest in &chunk.dests {
            // WRITEs posted before a failure are recorded too, so the room can release them.
            if let Err(e) = self.send_to(dest, room, pages, layers.clone(), &chunk, &mut posted) {
                failure = Some(e);
                break;
            }
        }
        self.metrics
            .post_time
            .tally(self.clock.now().saturating_sub(started));
        self.metrics.transfers.tally(posted.len() as u64);
        let r = self
            .rooms
            .get_mut(&room)
            .ok_or(PushError::UnknownRoom(room))?;
        r.chunk_posted(&chunk, posted, failure.clone());
        match failure {
            Some(e) => Err(PushError::Setup(e)),
            None => Ok(()),
        }
    }

    /// Posts `chunk` of `room` (`pages`, of `layers` or all) to one destination.
    fn send_to(
        &mut self,
        dest: &RoomRequest,
        room: u64,
        pages: &[u32],
        layers: Option<std::ops::Range<u32>>,
        chunk: &Chunk,
        posted: &mut Vec<XferId>,
    ) -> Result<(), String> {
        let (start, is_last, aux_index) = (chunk.start, chunk.is_last, chunk.aux_index);
        let state_indices = &chunk.state_indices;
        // A layer chunk that leaves layers of its pages to later chunks is not digested:
        // the chunk completing them digests the pages whole.
        let completes = chunk.advance == chunk.pages;
        let chunk = chunk.id;
        let d = self
            .decodes
            .get(&dest.agent)
            .ok_or_else(|| format!("decode {} is not registered", dest.agent))?;
        let me = self.config.tp.0;
        let links = d
            .mapping
            .links_for_decode(d.args.tp_rank)
            .map_err(|e| e.to_string())?;
        let Some(slice) = links.iter().find_map(|l| match l.kind {
            LinkKind::Data(s) if l.prefill_rank == me => Some(s),
            _ => None,
        }) else {
            return Ok(());
        };
        // This rank writes aux (last stage) and its stage's state when it is the lowest
        // prefill rank writing into that decode rank.
        let designated = links
            .iter()
            .filter(|l| matches!(l.kind, LinkKind::Data(_)))
            .map(|l| l.prefill_rank)
            .min()
            == Some(me);
        // A stock SGLang decode reads no notifications: it is told by message once the
        // room's WRITEs completed.
        let notes = d.stock.is_none();
        let kv = &self.bufs.kv;
        let dst_pages = start
            .checked_add(pages.len())
            .and_then(|end| dest.pages.get(start..end))
            .ok_or_else(|| {
                format!(
                    "decode {} has no pages {start}.. for this chunk",
                    dest.agent
                )
            })?;
        let planning = self.clock.now();
        let target = Target {
            spec: &d.spec,
            bases: &d.args.kv_bases,
            group_pages: &dest.group_pages,
            start,
        };
        let planned = plan_chunk(
            kv,
            layers.as_ref(),
            &target,
            (pages, dst_pages),
            slice,
            &mut self.plan,
            &mut self.ranges,
        )?;
        self.metrics
            .plan_time
            .tally(self.clock.now().saturating_sub(planning));
        self.metrics.kv_bytes.tally(planned.bytes);
        self.metrics.descriptors_raw.tally(planned.raw);
        self.metrics.descriptors_posted.tally(planned.descriptors);
        let (pp_rank, pp_size) = self.config.pp;
        let mem = (kv.memory, kv.memory);
        let note = if dest.digest && completes {
            // The pages' digests join this destination's fold before their WRITE is posted;
            // the last chunk's note carries the fold.
            let digesting = self.clock.now();
            // Set up when a decode first asks.
            let digests = match self.digests.get_or_insert_with(|| PageDigests::new(kv)) {
                Ok(d) => d,
                Err(e) => return Err(e.clone()),
            };
            let cover = Coverage {
                first_head: slice.src_first,
                heads: slice.count,
                first_layer: 0,
                layers: kv.spec.num_layers(),
            };
            let pending = digests.start(pages, cover)?;
            let fold = self
                .rooms
                .get_mut(&room)
                .ok_or_else(|| format!("unknown room {room}"))?
                .fold_mut(&dest.agent);
            pending.wait_into(fold)?;
            let value = fold.value();
            self.metrics
                .digest_time
                .tally(self.clock.now().saturating_sub(digesting));
            self.metrics.digested_pages.tally(pages.len() as u64);
            if is_last {
                messages::last_kv_note_with_digest(room, chunk, pp_rank, value)
            } else {
                messages::kv_note(room, chunk, is_last, pp_rank)
            }
        } else {
            messages::kv_note(room, chunk, is_last, pp_rank)
        };
        posted.push(
            self.transport
                .post(
                    Op::Write,
                    d.peer,
                    mem,
                    &self.ranges.0,
                    &self.ranges.1,
                    notes.then_some(&note[..]),
                )
                .map_err(|e| e.to_string())?,
        );
        if !is_last || !designated {
            return Ok(());
        }
        if let (Some(src_i), Some(dst_i)) = (aux_index, dest.aux_index) {
            if pp_rank.checked_add(1) == Some(pp_size) && !self.bufs.aux.is_empty() {
                let (l, r) = items(&self.bufs.aux, &d.args.aux, &[src_i], &[dst_i])?;
                let x = self.transport.post(
                    Op::Write,
                    d.peer,
                    (MemoryKind::Host, MemoryKind::Host),
                    &l,
                    &r,
                    notes.then_some(&messages::aux_note(room)[..]),
                );
                posted.push(x.map_err(|e| e.to_string())?);
            }
        }
        if !state_indices.is_empty() && !dest.state_indices.is_empty() {
            if state_indices.len() != dest.state_indices.len() {
                return Err(format!(
                    "state index counts differ: prefill {}, decode {}",
                    state_indices.len(),
                    dest.state_indices.len()
                ));
            }
            if d.args.tp_size != self.config.tp.1 && kv.spec.kind() != kvxfer_layout::CacheKind::Mla
            {
                return Err("state transfer needs equal TP on both sides".into());
            }
            let (l, r) = items(
                &self.bufs.state,
                &d.args.state,
                state_indices,
                &dest.state_indices,
            )?;
            let x = self.transport.post(
                Op::Write,
                d.peer,
                mem,
                &l,
                &r,
                notes.then_some(&messages::state_note(room, pp_rank)[..]),
            );
            posted.push(x.map_err(|e| e.to_string())?);
        }
        Ok(())
    }
}

/// The decode rank a chunk goes to: its cache and region bases, how many of the room's
/// pages each KV cache group takes (empty: one group), and the chunk's first page's
/// position in the room.
struct Target<'a> {
    spec: &'a CacheSpec,
    bases: &'a [u64],
    group_pages: &'a [u32],
    start: usize,
}

/// Plans the WRITEs of a chunk: `pages.0` (this rank's source pages) into `pages.1` (the
/// decode's), heads `slice`, `layers` of them or all, into `ranges` (replaced). A cache in
/// KV cache groups moves each group's share of the chunk through that group's layers only:
/// the room's pages list group 0's, then group 1's, ... (`target.group_pages`), on both
/// sides, and the two caches' groups are the same (checked at registration); a state
/// group's pages (Mamba) move whole.
fn plan_chunk(
    kv: &KvCache,
    layers: Option<&std::ops::Range<u32>>,
    target: &Target<'_>,
    pages: (&[u32], &[u32]),
    slice: HeadSlice,
    plan: &mut TransferPlan,
    ranges: &mut Ranges,
) -> Result<Planned, String> {
    let mut out = Planner::new(Op::Write, plan, ranges);
    let Some(groups) = &kv.groups else {
        let part = layers.map(|l| layer_part(kv, l)).transpose()?;
        let src = match &part {
            Some((spec, bases, first)) => CacheSide::new(spec, bases, *first),
            None => CacheSide::new(&kv.spec, &kv.bases, kv.first_layer),
        }
        .map_err(|e| e.to_string())?;
        let dst = CacheSide::new(target.spec, target.bases, 0).map_err(|e| e.to_string())?;
        let pairs = BlockPairs {
            src: pages.0,
            dst: pages.1,
            windows: None,
        };
        out.add(&src, &dst, slice, &pairs)?;
        return Ok(out.planned);
    };
    if layers.is_some() {
        return Err("a cache in KV cache groups sends whole pages, not layers".into());
    }
    if target.group_pages.len() != groups.len() {
        return Err(format!(
            "the decode named pages of {} KV cache groups, this cache has {}",
            target.group_pages.len(),
            groups.len()
        ));
    }
    let caches = Grouped {
        groups,
        src: (&kv.spec, &kv.bases),
        dst: (target.spec, target.bases),
        rank_heads: kv.spec.kv_heads(),
    };
    let end = target
        .start
        .checked_add(pages.0.len())
        .ok_or("page positions overflow")?;
    // Each group's pages are positions `first .. first + count` of the room.
    let mut first = 0usize;
    for (g, &count) in target.group_pages.iter().enumerate() {
        let last = first
            .checked_add(count as usize)
            .ok_or("page positions overflow")?;
        let (from, to) = (first.max(target.start), last.min(end));
        first = last;
        if from >= to {
            continue;
        }
        // Positions `from .. to` of the room, offsets `from - start ..` of the chunk.
        let (a, b) = (
            from.saturating_sub(target.start),
            to.saturating_sub(target.start),
        );
        let (Some(src_pages), Some(dst_pages)) = (pages.0.get(a..b), pages.1.get(a..b)) else {
            return Err(format!("KV cache group {g}: pages {a}..{b} past the chunk"));
        };
        out.add_group(&caches, g, slice, (src_pages, dst_pages))?;
    }
    Ok(out.planned)
}

/// Item-wise ranges of parallel buffers: item `src[i]` of each local buffer to item
/// `dst[i]` of the matching remote buffer; an index past a buffer's end is an error.
fn items(
    local: &[BufferWire],
    remote: &[BufferWire],
    src: &[u32],
    dst: &[u32],
) -> Result<(Vec<AddrRange>, Vec<AddrRange>), String> {
    let mut l = Vec::new();
    let mut r = Vec::new();
    for (lb, rb) in local.iter().zip(remote) {
        for (&s, &d) in src.iter().zip(dst) {
            let (Some(from), Some(to)) = (lb.item(s), rb.item(d)) else {
                return Err(format!("item {s} -> {d} is outside its buffer"));
            };
            l.push(AddrRange::new(from, lb.item_len));
            r.push(AddrRange::new(to, rb.item_len));
        }
    }
    Ok((l, r))
}

/// The spec, region bases and global first layer of `layers` (local indices) of `kv`: the
/// source side of a layer chunk. Not for a cross-layer cache (checked by the caller).
fn layer_part(
    kv: &KvCache,
    layers: &std::ops::Range<u32>,
) -> Result<(kvxfer_layout::CacheSpec, Vec<u64>, u32), String> {
    let spec = &kv.spec;
    let per_layer = spec
        .num_regions()
        .checked_div(spec.num_layers())
        .ok_or("a cache without layers")?;
    let count = layers
        .end
        .checked_sub(layers.start)
        .ok_or("layers end before they start")?;
    let sub = kvxfer_layout::CacheSpec::new(kvxfer_layout::CacheParams {
        num_layers: count,
        ..*spec.params()
    })
    .map_err(|e| e.to_string())?;
    let (first, n) = (
        layers.start.checked_mul(per_layer),
        count.checked_mul(per_layer),
    );
    let (first, n) = first.zip(n).ok_or("layer index overflows")?;
    let bases = kv
        .bases
        .get(first as usize..)
        .and_then(|b| b.get(..n as usize))
        .ok_or("layers past the cache's regions")?
        .to_vec();
    let global = kv
        .first_layer
        .checked_add(layers.start)
        .ok_or("layer index overflows")?;
    Ok((sub, bases, global))
}
