//! The prefill side of the push connector: registers with the bootstrap registry, receives
//! decode registrations and room destinations on its mailbox, and WRITEs each room's KV
//! chunks (then aux and state with the last chunk) into every decode rank it serves.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, unbounded};
use kvxfer_layout::{
    BlockPairs, CacheSide, CacheSpec, LinkKind, PlanOptions, TpMapping, TransferPlan,
    plan_transfer_into,
};

use super::buffers::{PushBuffers, StateKind};
use super::messages::{
    self, FromPrefill, FromRegistry, MAX_MESSAGE_BYTES, RankInfo, RegisterArgs, RoomRequest,
    ToPrefill, ToRegistry,
};
use super::prefill_room::PrefillRoom;
use super::registry::ask_registry;
use super::status::RoomStatus;
use crate::clock::Clock;
use crate::plan::split_for;
use crate::sidechannel::MessageServer;
use crate::tally::Tally;
use crate::transport::{
    AddrRange, MemoryKind, Op, PeerId, Registration, Transport, XferId, XferStatus,
};

/// Settings of a prefill rank.
#[derive(Debug, Clone)]
pub struct PushPrefillConfig {
    /// TP rank and size.
    pub tp: (u32, u32),
    /// PP rank and size.
    pub pp: (u32, u32),
    /// Host the mailbox binds (loopback by default).
    pub host: String,
    /// Mailbox port (0 picks a free one).
    pub port: u16,
    /// The bootstrap registry.
    pub registry: (String, u16),
    /// Rooms still waiting for their destinations after this long fail.
    pub bootstrap_timeout: Duration,
    /// Bound on each side-channel request.
    pub request_timeout: Duration,
}

struct Decode {
    peer: PeerId,
    args: RegisterArgs,
    spec: CacheSpec,
    mapping: TpMapping,
}

/// Errors of the engine-facing calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// Unknown room.
    #[error("unknown room {0}")]
    UnknownRoom(u64),
    /// The room is not ready for data (or already final).
    #[error("room {room} is {status:?}, not ready to send")]
    NotReady {
        /// Room.
        room: u64,
        /// Its status.
        status: RoomStatus,
    },
    /// More pages than the room holds.
    #[error("room {room}: {given} more pages exceed the {left} left")]
    TooManyPages {
        /// Room.
        room: u64,
        /// Pages given.
        given: usize,
        /// Pages left.
        left: usize,
    },
    /// Setup failed.
    #[error("{0}")]
    Setup(String),
}

/// One prefill rank.
pub struct PushPrefill<T: Transport> {
    transport: T,
    config: PushPrefillConfig,
    bufs: PushBuffers,
    clock: Arc<dyn Clock>,
    _registrations: Vec<Registration>,
    mailbox: MessageServer,
    inbox: Receiver<ToPrefill>,
    decodes: HashMap<String, Decode>,
    rooms: HashMap<u64, PrefillRoom>,
    plan: TransferPlan,
    ranges: (Vec<AddrRange>, Vec<AddrRange>),
    refused: u64,
    metrics: PushMetrics,
}

/// Counters of a prefill rank, read and reset with [`PushPrefill::take_metrics`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushMetrics {
    /// WRITEs posted (KV, aux and state).
    pub transfers: u64,
    /// Bytes of KV posted.
    pub kv_bytes: u64,
    /// KV descriptors before coalescing.
    pub descriptors_raw: u64,
    /// KV descriptors posted after coalescing.
    pub descriptors_posted: u64,
    /// Time spent planning and posting.
    pub post_time: std::time::Duration,
    /// Of which: computing the coalesced plans and range lists.
    pub plan_time: std::time::Duration,
    /// Rooms that failed.
    pub failed_rooms: u64,
    /// Registrations received from decodes (each registers once per prefill instance).
    pub registrations: u64,
    /// What the transport library measured itself (NIXL telemetry) of completed WRITEs.
    pub backend: crate::pull::BackendTelemetry,
}

impl<T: Transport> PushPrefill<T> {
    /// Registers memory, opens the mailbox and registers this rank with the registry.
    pub fn new(
        mut transport: T,
        config: PushPrefillConfig,
        bufs: PushBuffers,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, PushError> {
        let registrations = bufs
            .register(&mut transport)
            .map_err(|e| PushError::Setup(e.to_string()))?;
        let (tx, inbox) = unbounded();
        let mailbox = MessageServer::bind(
            &config.host,
            config.port,
            MAX_MESSAGE_BYTES,
            Box::new(move |bytes| {
                let reply = match messages::decode::<ToPrefill>(bytes, "push control message") {
                    Ok(ToPrefill::Health) => FromPrefill::Ok,
                    Ok(msg) => match tx.send(msg) {
                        Ok(()) => FromPrefill::Ok,
                        Err(_) => FromPrefill::Error {
                            reason: "prefill rank is shutting down".into(),
                        },
                    },
                    Err(e) => FromPrefill::Error {
                        reason: e.to_string(),
                    },
                };
                messages::encode(&reply)
            }),
        )
        .map_err(PushError::Setup)?;
        let kv = &bufs.kv;
        let info = RankInfo {
            agent: transport.name().to_string(),
            tp_size: config.tp.1,
            tp_rank: config.tp.0,
            pp_size: config.pp.1,
            pp_rank: config.pp.0,
            dp_size: 1,
            dp_rank: 0,
            host: config.host.clone(),
            port: mailbox.port(),
            page_size: kv.spec.tokens_per_block(),
            dtype: kv.spec.dtype().to_string(),
            first_layer: kv.first_layer,
            num_layers: kv.spec.num_layers(),
        };
        match ask_registry(
            &config.registry.0,
            config.registry.1,
            &ToRegistry::Register(info),
            config.request_timeout,
        ) {
            Ok(FromRegistry::Ok) => {}
            Ok(other) => {
                return Err(PushError::Setup(format!(
                    "registry refused the rank: {other:?}"
                )));
            }
            Err(e) => return Err(PushError::Setup(format!("registry unreachable: {e}"))),
        }
        Ok(PushPrefill {
            transport,
            config,
            bufs,
            clock,
            _registrations: registrations,
            mailbox,
            inbox,
            decodes: HashMap::new(),
            rooms: HashMap::new(),
            plan: TransferPlan::default(),
            ranges: (Vec::new(), Vec::new()),
            refused: 0,
            metrics: PushMetrics::default(),
        })
    }

    /// The mailbox port.
    pub fn port(&self) -> u16 {
        self.mailbox.port()
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Counters since the last call (reset on read).
    pub fn take_metrics(&mut self) -> PushMetrics {
        let failed = self
            .rooms
            .values()
            .filter(|r| r.status() == RoomStatus::Failed)
            .count() as u64;
        let mut m = std::mem::take(&mut self.metrics);
        m.failed_rooms = failed;
        m
    }

    /// Control messages refused (unknown agent, malformed content).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// A room this rank will send `total_pages` pages of, plus aux and state on the last chunk.
    pub fn add_room(
        &mut self,
        room: u64,
        total_pages: usize,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
    ) {
        let now = self.clock.now();
        // Destinations that asked before the engine added the room count now.
        let required = self.rooms.get(&room).and_then(|r| {
            r.dest_agents()
                .find_map(|agent| self.decodes.get(agent))
                .and_then(|d| d.mapping.notifications_per_request(self.config.tp.0).ok())
        });
        self.rooms
            .entry(room)
            .or_insert_with(|| PrefillRoom::new(now))
            .set_engine(total_pages, aux_index, state_indices, required);
    }

    /// Status of a room.
    pub fn status(&self, room: u64) -> Option<RoomStatus> {
        self.rooms.get(&room).map(PrefillRoom::status)
    }

    /// Every room this rank knows, in any state.
    pub fn known_rooms(&self) -> Vec<u64> {
        self.rooms.keys().copied().collect()
    }

    /// Rooms a decode asked for that the engine has not added yet (the decode's request
    /// arrived first), so an engine that learns of requests from its peers can add them.
    pub fn requested_rooms(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.requested())
            .map(|(&id, _)| id)
            .collect();
        v.sort_unstable();
        v
    }

    /// Why a room failed.
    pub fn error(&self, room: u64) -> Option<String> {
        self.rooms
            .get(&room)
            .and_then(|r| r.error().map(str::to_string))
    }

    /// Forgets a final room.
    pub fn remove_room(&mut self, room: u64) {
        if let Some(r) = self.rooms.remove(&room) {
            for x in r.into_xfers() {
                let _ = self.transport.release(x);
            }
        }
    }

    /// Aborts a room: its decode destinations are told, its transfers released.
    pub fn abort(&mut self, room: u64) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        r.fail("aborted by the prefill engine".into());
        let agents: Vec<String> = r.dest_agents().map(str::to_string).collect();
        for a in agents {
            if let Some(d) = self.decodes.get(&a) {
                let _ = self
                    .transport
                    .send_notification(d.peer, &messages::abort_note(room));
            }
        }
    }

    /// Processes control messages, transfer completions and timeouts.
    pub fn poll(&mut self) {
        while let Ok(msg) = self.inbox.try_recv() {
            self.on_message(msg);
        }
        let now = self.clock.now();
        let timeout = self.config.bootstrap_timeout;
        for (id, r) in &mut self.rooms {
            if r.status().is_final() || r.bootstrap_timed_out(*id, now, timeout) {
                continue;
            }
            let mut still = Vec::new();
            for x in r.take_xfers() {
                match self.transport.status(x) {
                    Ok(XferStatus::InProgress) => still.push(x),
                    Ok(XferStatus::Done) => {
                        if let Some(t) = self.transport.telemetry(x) {
                            self.metrics.backend.add(&t);
                        }
                        let _ = self.transport.release(x);
                    }
                    Ok(XferStatus::Failed(e)) => {
                        let _ = self.transport.release(x);
                        r.fail(format!("transfer failed: {e}"));
                    }
                    Err(e) => r.fail(e.to_string()),
                }
            }
            r.keep_xfers(still);
            r.settle();
        }
    }

    fn on_message(&mut self, msg: ToPrefill) {
        match msg {
            ToPrefill::Register(args) => {
                self.metrics.registrations.tally(1);
                if let Err(e) = self.register_decode(args) {
                    self.refused.tally(1);
                    tracing::warn!(error = %e, "refused a decode registration");
                }
            }
            ToPrefill::Room(req) => self.on_room(req),
            ToPrefill::Abort { room, agent } => {
                let xfers = self.rooms.get_mut(&room).and_then(|r| r.abort_by(&agent));
                for x in xfers.into_iter().flatten() {
                    let _ = self.transport.release(x);
                }
            }
            ToPrefill::Health => {}
        }
    }

    fn register_decode(&mut self, args: RegisterArgs) -> Result<(), String> {
        let spec = args.layout.to_spec().map_err(|e| e.to_string())?;
        let mine = &self.bufs.kv.spec;
        if spec.tokens_per_block() != mine.tokens_per_block() || spec.dtype() != mine.dtype() {
            return Err(format!(
                "page size or dtype differ: decode {} tokens {}, prefill {} tokens {}",
                spec.tokens_per_block(),
                spec.dtype(),
                mine.tokens_per_block(),
                mine.dtype()
            ));
        }
        CacheSide::new(&spec, &args.kv_bases, 0).map_err(|e| e.to_string())?;
        if args.aux.len() != self.bufs.aux.len()
            || args
                .aux
                .iter()
                .zip(&self.bufs.aux)
                .any(|(a, b)| a.item_len != b.item_len)
        {
            return Err("aux buffers differ in count or item length".into());
        }
        if args.state.len() != self.bufs.state.len()
            || args
                .state
                .iter()
                .zip(&self.bufs.state)
                .any(|(a, b)| a.item_len != b.item_len)
        {
            return Err("state buffers differ in count or item length".into());
        }
        // Item addresses are computed from these numbers for every WRITE: none may wrap.
        if let Some(b) = args
            .aux
            .iter()
            .chain(&args.state)
            .find(|b| b.end().is_none())
        {
            return Err(format!(
                "buffer of {} items of {} bytes at {:#x} overflows the address space",
                b.items, b.item_len, b.base
            ));
        }
        let mapping = TpMapping::new(self.config.tp.1, args.tp_size, self.bufs.kv.sharding())
            .map_err(|e| e.to_string())?;
        if self
            .decodes
            .get(&args.agent)
            .is_some_and(|d| d.args == args)
        {
            // The same decode registering again (once per bootstrap): keep the loaded peer,
            // whose connection transfers in flight are using.
            return Ok(());
        }
        let peer = self
            .transport
            .load_peer(&args.agent_metadata)
            .map_err(|e| e.to_string())?;
        self.decodes.insert(
            args.agent.clone(),
            Decode {
                peer,
                args,
                spec,
                mapping,
            },
        );
        Ok(())
    }

    fn on_room(&mut self, req: RoomRequest) {
        let now = self.clock.now();
        let Some(d) = self.decodes.get(&req.agent) else {
            self.refused.tally(1);
            return;
        };
        let problem = self.validate(d, &req);
        let required = d
            .mapping
            .notifications_per_request(self.config.tp.0)
            .unwrap_or(1) as usize;
        self.rooms
            .entry(req.room)
            .or_insert_with(|| PrefillRoom::new(now))
            .add_dest(req, problem, required);
    }

    /// Checks every index a decode sent against what that decode registered.
    fn validate(&self, d: &Decode, req: &RoomRequest) -> Option<String> {
        if req.pages.len() > messages::MAX_ROOM_PAGES {
            return Some(format!("{} pages exceed the limit", req.pages.len()));
        }
        if let Some(&p) = req.pages.iter().find(|&&p| p >= d.spec.num_blocks()) {
            return Some(format!(
                "destination page {p} is out of range (decode has {} pages)",
                d.spec.num_blocks()
            ));
        }
        let mut sorted = req.pages.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Some("destination pages repeat".into());
        }
        if let Some(i) = req.aux_index {
            if d.args.aux.iter().any(|b| i >= b.items) {
                return Some(format!("aux index {i} is out of range"));
            }
        }
        if let Some(&i) = req
            .state_indices
            .iter()
            .find(|&&i| d.args.state.iter().any(|b| i >= b.items))
        {
            return Some(format!("state index {i} is out of range"));
        }
        if self.bufs.state_kind == StateKind::Mamba
            && !req.pages.is_empty()
            && req.state_indices.len() > 1
        {
            return Some("Mamba state takes exactly one index".into());
        }
        None
    }

    /// Sends the next chunk of a room: `pages` are this rank's source pages, paired with the
    /// destinations' next pages. The chunk completing the room also carries aux and state.
    pub fn send(&mut self, room: u64, pages: &[u32]) -> Result<(), PushError> {
        let chunk = self
            .rooms
            .get(&room)
            .ok_or(PushError::UnknownRoom(room))?
            .next_chunk(room, pages.len())?;
        let mut posted = Vec::new();
        let mut failure = None;
        let started = self.clock.now();
        for dest in &chunk.dests {
            match self.send_to(
                dest,
                room,
                pages,
                chunk.start,
                chunk.id,
                chunk.is_last,
                chunk.aux_index,
                &chunk.state_indices,
            ) {
                Ok(mut x) => posted.append(&mut x),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
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

    #[allow(clippy::too_many_arguments)]
    fn send_to(
        &mut self,
        dest: &RoomRequest,
        room: u64,
        pages: &[u32],
        start: usize,
        chunk: u32,
        is_last: bool,
        aux_index: Option<u32>,
        state_indices: &[u32],
    ) -> Result<Vec<XferId>, String> {
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
            return Ok(Vec::new());
        };
        // This rank writes aux (last stage) and its stage's state when it is the lowest
        // prefill rank writing into that decode rank.
        let designated = links
            .iter()
            .filter(|l| matches!(l.kind, LinkKind::Data(_)))
            .map(|l| l.prefill_rank)
            .min()
            == Some(me);
        let kv = &self.bufs.kv;
        let src = CacheSide::new(&kv.spec, &kv.bases, kv.first_layer).map_err(|e| e.to_string())?;
        let dst = CacheSide::new(&d.spec, &d.args.kv_bases, 0).map_err(|e| e.to_string())?;
        let dst_pages = start
            .checked_add(pages.len())
            .and_then(|end| dest.pages.get(start..end))
            .ok_or_else(|| {
                format!(
                    "decode {} has no pages {start}.. for this chunk",
                    dest.agent
                )
            })?;
        let pairs = BlockPairs {
            src: pages,
            dst: dst_pages,
            windows: None,
        };
        let planning = self.clock.now();
        plan_transfer_into(
            &src,
            &dst,
            slice,
            &pairs,
            PlanOptions::default(),
            &mut self.plan,
        )
        .map_err(|e| e.to_string())?;
        split_for(
            Op::Write,
            self.plan.iter(),
            &mut self.ranges.0,
            &mut self.ranges.1,
        );
        self.metrics
            .plan_time
            .tally(self.clock.now().saturating_sub(planning));
        self.metrics.kv_bytes.tally(self.plan.total_bytes);
        self.metrics.descriptors_raw.tally(self.plan.raw_count);
        self.metrics
            .descriptors_posted
            .tally(self.plan.len() as u64);
        let (pp_rank, pp_size) = self.config.pp;
        let mem = (kv.memory, kv.memory);
        let mut posted = Vec::new();
        let note = messages::kv_note(room, chunk, is_last, pp_rank);
        posted.push(
            self.transport
                .post(
                    Op::Write,
                    d.peer,
                    mem,
                    &self.ranges.0,
                    &self.ranges.1,
                    Some(&note),
                )
                .map_err(|e| e.to_string())?,
        );
        if !is_last || !designated {
            return Ok(posted);
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
                    Some(&messages::aux_note(room)),
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
                Some(&messages::state_note(room, pp_rank)),
            );
            posted.push(x.map_err(|e| e.to_string())?);
        }
        Ok(posted)
    }
}

/// Item-wise ranges of parallel buffers: item `src[i]` of each local buffer to item
/// `dst[i]` of the matching remote buffer; an index past a buffer's end is an error.
fn items(
    local: &[super::messages::BufferWire],
    remote: &[super::messages::BufferWire],
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
