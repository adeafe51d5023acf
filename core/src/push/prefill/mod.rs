//! The prefill side of the push connector: registers with the bootstrap registry, receives
//! decode registrations and room destinations on its mailbox, and WRITEs each room's KV
//! chunks (then aux and state with the last chunk) into every decode rank it serves.
//! Registrations and their checks live in `decodes`, planning and posting in `send`.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, unbounded};
use kvxfer_layout::{CacheSpec, TpMapping, TransferPlan};

use super::buffers::PushBuffers;
use super::digests::PageDigests;
use super::messages::{
    self, FromPrefill, FromRegistry, MAX_MESSAGE_BYTES, RankInfo, RegisterArgs, RoomRequest,
    ToPrefill, ToRegistry,
};
use super::registry::ask_registry;
use super::status::RoomStatus;
use crate::clock::Clock;
use crate::sidechannel::MessageServer;
use crate::sidechannel::auth::Destination;
use crate::tally::Tally;
use crate::transport::{AddrRange, PeerId, Registration, Transport, XferStatus};
use crate::wire::sglang_nixl as wire;
use room::PrefillRoom;

mod decodes;
pub mod room;
mod send;
mod stock;

pub use stock::StockOutgoing;

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
    /// A decode that re-registers on demand (kvxfer's since the `reregisters` flag) and that
    /// no room named for this long is forgotten: its connection closed, its next room
    /// answered [`FromPrefill::Unregistered`]. A decode whose connection failed is
    /// forgotten at once.
    pub idle_decode_timeout: Duration,
}

impl PushPrefillConfig {
    /// The default idle time after which a decode is forgotten (10 minutes, as the pull
    /// decode's `idle_engine_timeout`).
    pub const IDLE_DECODE_TIMEOUT: Duration = Duration::from_secs(600);
}

struct Decode {
    peer: PeerId,
    args: RegisterArgs,
    spec: CacheSpec,
    mapping: TpMapping,
    /// When it last registered or named a room.
    used: Duration,
    /// Set for a stock SGLang decode (its own nixl backend).
    stock: Option<StockPeer>,
}

/// What a stock SGLang decode is told through, besides the transport.
struct StockPeer {
    /// Its PULL socket.
    endpoint: (String, u16),
}

/// The decode agents the mailbox accepts rooms from, shared with its handler. The handler
/// queues a message while holding the lock, and a decode is forgotten only under it with
/// the inbox empty, so no room of a forgotten decode can be queued unanswered.
type Known = Arc<Mutex<HashSet<String>>>;

fn lock(known: &Known) -> std::sync::MutexGuard<'_, HashSet<String>> {
    known
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    /// The room's last chunk was already sent.
    #[error("room {0}: its last chunk was already sent")]
    AllSent(u64),
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
    info: RankInfo,
    inbox: Receiver<ToPrefill>,
    known: Known,
    decodes: HashMap<String, Decode>,
    rooms: HashMap<u64, PrefillRoom>,
    plan: TransferPlan,
    ranges: (Vec<AddrRange>, Vec<AddrRange>),
    refused: u64,
    /// Registrations the mailbox refused in its reply (they never reach `poll`).
    refused_in_reply: Arc<AtomicU64>,
    metrics: PushMetrics,
    /// Content digesting, set up when a decode first asks for it (or why it cannot be).
    digests: Option<Result<PageDigests, String>>,
    /// Messages for stock SGLang decodes, until the engine takes them.
    stock_outbox: Vec<StockOutgoing>,
    /// Why stock decodes' registrations were refused, by agent (bounded), so that their
    /// rooms fail naming it.
    stock_refusals: HashMap<String, String>,
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
    /// Of which: digesting the pages sent to decodes that check content digests.
    pub digest_time: std::time::Duration,
    /// Pages digested for decodes that check content digests (once per destination rank).
    pub digested_pages: u64,
    /// Rooms that failed.
    pub failed_rooms: u64,
    /// Registrations received from decodes (each registers once per prefill instance, and
    /// again after it was forgotten).
    pub registrations: u64,
    /// Decodes forgotten: their connection failed, or they were idle past
    /// `idle_decode_timeout`.
    pub forgotten_decodes: u64,
    /// What the transport library measured itself (NIXL telemetry) of completed WRITEs.
    pub backend: crate::connector::BackendTelemetry,
}

impl<T: Transport> PushPrefill<T> {
    /// Registers memory, opens the mailbox and registers this rank with the registry.
    pub fn new(
        mut transport: T,
        config: PushPrefillConfig,
        bufs: PushBuffers,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, PushError> {
        bufs.kv
            .check()
            .map_err(|e| PushError::Setup(e.to_string()))?;
        let registrations = bufs
            .register(&mut transport)
            .map_err(|e| PushError::Setup(e.to_string()))?;
        let (tx, inbox) = unbounded();
        let me = Destination::mailbox(transport.name());
        let known: Known = Arc::default();
        let shared = Arc::clone(&known);
        let (fit, tp_size) = (bufs.clone(), config.tp.1);
        let refused_in_reply = Arc::new(AtomicU64::new(0));
        let refusals = Arc::clone(&refused_in_reply);
        let mailbox = MessageServer::bind(
            &config.host,
            config.port,
            MAX_MESSAGE_BYTES,
            |_| me,
            Box::new(move |bytes| {
                let reply = match messages::decode::<ToPrefill>(bytes, "push control message") {
                    Ok(ToPrefill::Health) => FromPrefill::Ok,
                    Ok(msg) => {
                        let mut known = lock(&shared);
                        match &msg {
                            // A registration that cannot pair is refused in the reply, so
                            // the decode fails its room at once. Known from now on
                            // otherwise; `poll` takes it back if loading the peer fails.
                            ToPrefill::Register(a) => {
                                if let Err(reason) = decodes::check_registration(&fit, tp_size, a)
                                {
                                    tracing::warn!(decode = %a.agent, %reason, "registration refused");
                                    refusals.fetch_add(1, Ordering::Relaxed);
                                    return messages::encode(&FromPrefill::Error { reason });
                                }
                                known.insert(a.agent.clone());
                            }
                            ToPrefill::Room(r) if !known.contains(&r.agent) => {
                                return messages::encode(&FromPrefill::Unregistered);
                            }
                            _ => {}
                        }
                        match tx.send(msg) {
                            Ok(()) => FromPrefill::Ok,
                            Err(_) => FromPrefill::Error {
                                reason: "prefill rank is shutting down".into(),
                            },
                        }
                    }
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
            &ToRegistry::Register(info.clone()),
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
            info,
            inbox,
            known,
            decodes: HashMap::new(),
            rooms: HashMap::new(),
            plan: TransferPlan::default(),
            ranges: (Vec::new(), Vec::new()),
            refused: 0,
            refused_in_reply,
            metrics: PushMetrics::default(),
            digests: None,
            stock_outbox: Vec::new(),
            stock_refusals: HashMap::new(),
        })
    }

    /// The mailbox port.
    pub fn port(&self) -> u16 {
        self.mailbox.port()
    }

    /// What this rank registered with the bootstrap registry (for another directory too).
    pub fn rank_info(&self) -> &RankInfo {
        &self.info
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

    /// Control messages refused (unknown agent, malformed content, a registration that
    /// does not pair).
    pub fn refused(&self) -> u64 {
        self.refused
            .saturating_add(self.refused_in_reply.load(Ordering::Relaxed))
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

    /// Replaces a room's state indices before its last chunk: SGLang hands them over with
    /// that chunk, not when it adds the room.
    pub fn set_state_indices(
        &mut self,
        room: u64,
        state_indices: Vec<u32>,
    ) -> Result<(), PushError> {
        let r = self
            .rooms
            .get_mut(&room)
            .ok_or(PushError::UnknownRoom(room))?;
        if r.status().is_final() {
            return Err(PushError::NotReady {
                room,
                status: r.status(),
            });
        }
        r.set_state(state_indices);
        Ok(())
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

    /// Whether every decode destination this rank serves has asked for `room` and it has
    /// not failed: for an engine that sizes a room only once its destinations are known.
    pub fn destinations_ready(&self, room: u64) -> bool {
        self.rooms.get(&room).is_some_and(PrefillRoom::all_asked)
    }

    /// The prompt tokens the room's decode holds already (its radix cache), once its
    /// destinations asked: the engine sends only the pages after them (SGLang's
    /// `pop_decode_prefix_len`). `None` for an unknown room or one no destination asked for.
    pub fn decode_prefix(&self, room: u64) -> Option<u64> {
        self.rooms.get(&room).and_then(PrefillRoom::decode_prefix)
    }

    /// How many of the room's pages each KV cache group of a hybrid model takes, in group
    /// order (empty for a cache of one group), once a destination with pages asked: the
    /// engine sends each group's pages in that order ([`PushPrefill::send`]), each group's
    /// the blocks ending where the decode's do.
    pub fn decode_group_pages(&self, room: u64) -> Option<Vec<u32>> {
        self.rooms
            .get(&room)
            .and_then(PrefillRoom::decode_group_pages)
            .map(<[u32]>::to_vec)
    }

    /// Why a room failed.
    pub fn error(&self, room: u64) -> Option<String> {
        self.rooms
            .get(&room)
            .and_then(|r| r.error().map(str::to_string))
    }

    /// Forgets a final room.
    pub fn remove_room(&mut self, room: u64) {
        let Some(mut r) = self.rooms.remove(&room) else {
            return;
        };
        if !r.status().is_final() {
            r.fail("removed by the prefill engine".into());
        }
        // A failed room's decodes are told before it is forgotten.
        let agents = failure_notice(&mut self.transport, &mut r);
        self.tell_failure(room, &agents, r.error().unwrap_or("failed"));
        for x in r.into_xfers() {
            let _ = self.transport.release(x);
        }
    }

    /// Aborts a room: its decode destinations are told, its transfers released.
    pub fn abort(&mut self, room: u64) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        r.fail("aborted by the prefill engine".into());
        let agents = failure_notice(&mut self.transport, r);
        let reason = r.error().unwrap_or("failed").to_string();
        self.tell_failure(room, &agents, &reason);
    }

    /// Tells `agents` that `room` failed here (called once its WRITEs were released): each
    /// fails the room at once, and counts this rank as one that no longer writes into it.
    /// Where other prefill ranks or stages also write into a decode rank, the decode tells
    /// them to stop and keeps the pages until each acknowledged ([`PushDecode::drained`]).
    ///
    /// A stock SGLang decode is told `KV_STATUS` Failed with the `reason` instead.
    ///
    /// [`PushDecode::drained`]: crate::push::PushDecode::drained
    fn tell_failure(&mut self, room: u64, agents: &[String], reason: &str) {
        for a in agents {
            let Some(d) = self.decodes.get(a) else {
                continue;
            };
            match &d.stock {
                Some(s) => {
                    let to = s.endpoint.clone();
                    self.stock_tell(&to, room, wire::status::FAILED, reason);
                }
                None => {
                    let _ = self
                        .transport
                        .send_notification(d.peer, &messages::abort_note(room));
                }
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
        let mut failed = Vec::new();
        let mut succeeded = Vec::new();
        let decodes = &self.decodes;
        let stock = |agent: &str| decodes.get(agent).is_some_and(|d| d.stock.is_some());
        for (id, r) in &mut self.rooms {
            if r.status().is_final() || r.bootstrap_timed_out(*id, now, timeout) {
                let untold = failure_notice(&mut self.transport, r);
                if !untold.is_empty() {
                    failed.push((*id, untold, r.error().unwrap_or("failed").to_string()));
                }
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
            // Every WRITE of the room completed: stock decodes learn it from a message
            // (kvxfer's from the notes on the WRITEs).
            let done = r.untold_success(stock);
            if !done.is_empty() {
                succeeded.push((*id, done));
            }
            let untold = failure_notice(&mut self.transport, r);
            if !untold.is_empty() {
                failed.push((*id, untold, r.error().unwrap_or("failed").to_string()));
            }
        }
        for (room, agents, reason) in failed {
            self.tell_failure(room, &agents, &reason);
        }
        for (room, agents) in succeeded {
            for a in agents {
                if let Some(to) = self
                    .decodes
                    .get(&a)
                    .and_then(|d| d.stock.as_ref())
                    .map(|s| s.endpoint.clone())
                {
                    self.stock_tell(&to, room, wire::status::SUCCESS, "");
                }
            }
        }
        // Rooms only decodes knew, ended long ago (and their decodes told, above).
        self.rooms.retain(|_, r| !r.abandoned(now, timeout));
        self.forget_unneeded(now);
    }

    fn on_message(&mut self, msg: ToPrefill) {
        match msg {
            ToPrefill::Register(args) => {
                self.metrics.registrations.tally(1);
                let agent = args.agent.clone();
                if let Err(e) = self.register_decode(args, None) {
                    self.refused.tally(1);
                    tracing::warn!(error = %e, "refused a decode registration");
                    if !self.decodes.contains_key(&agent) {
                        // Its rooms are answered `Unregistered` (not queued to wait out
                        // their timeout); one that registers again is refused again.
                        lock(&self.known).remove(&agent);
                    }
                }
            }
            ToPrefill::Room(req) => self.on_room(req),
            ToPrefill::Abort { room, agent } => {
                let xfers = self.rooms.get_mut(&room).and_then(|r| r.abort_by(&agent));
                for x in xfers.into_iter().flatten() {
                    let _ = self.transport.release(x);
                }
                // The acknowledgement: nothing of this rank can land in the room's pages any
                // more (its WRITEs were released just now, `release` waits for or cancels
                // them; a room it does not know, or does not write to `agent`, has none).
                self.tell_failure(room, &[agent], "aborted by the decode");
            }
            ToPrefill::Health => {}
        }
    }

    fn on_room(&mut self, req: RoomRequest) {
        self.on_room_with(req, None);
    }

    /// A destination asked for a room; `problem`, found before, fails it.
    fn on_room_with(&mut self, req: RoomRequest, problem: Option<String>) {
        let now = self.clock.now();
        let Some(d) = self.decodes.get_mut(&req.agent) else {
            self.refused.tally(1);
            return;
        };
        d.used = now;
        let Some(d) = self.decodes.get(&req.agent) else {
            return;
        };
        let problem = problem.or_else(|| self.validate(d, &req));
        let required = d
            .mapping
            .notifications_per_request(self.config.tp.0)
            .unwrap_or(1) as usize;
        self.rooms
            .entry(req.room)
            .or_insert_with(|| PrefillRoom::new(now))
            .add_dest(req, problem, required);
    }
}

/// The decode agents to tell that room `r` failed (each once). Its WRITEs still in flight
/// are released first: once told, a decode may hand the pages to other requests, and the
/// transport's `release` cancels a transfer and waits for its copies.
fn failure_notice<T: Transport>(t: &mut T, r: &mut PrefillRoom) -> Vec<String> {
    let agents = r.untold_failure();
    if !agents.is_empty() {
        for x in r.take_xfers() {
            let _ = t.release(x);
        }
    }
    agents
}
