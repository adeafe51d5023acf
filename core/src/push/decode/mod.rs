//! The decode side of the push connector: per room, learns the prefill's layout from its
//! bootstrap registry, registers its buffers with each prefill rank it needs (once per
//! prefill instance), sends the room's destinations (dummy messages to ranks that only need
//! to complete their status), and tracks chunk, aux and state notifications until the room
//! is complete. All side-channel traffic runs on a control thread (`control`); `poll` never
//! blocks.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvxfer_layout::HeadSharding;

use super::buffers::PushBuffers;
use super::digests::{PageDigests, Pending};
use super::directory::{PrefillDirectory, RegistryDirectory};
use super::messages::{self, PushNote, RankInfo, RegisterArgs, RoomRequest};
use super::status::RoomStatus;
use crate::clock::Clock;
use crate::tally::Tally;
use crate::transport::{Registration, Transport};
use room::{DecodeRoom, WriterCheck};

mod control;
pub mod room;
use crate::wire::handshake::LayoutWire;
use control::{Addr, Control, Done, Job};

/// Settings of a decode rank.
#[derive(Debug, Clone)]
pub struct PushDecodeConfig {
    /// TP rank and size.
    pub tp: (u32, u32),
    /// Rooms not complete after this long fail.
    pub waiting_timeout: Duration,
    /// How long to wait for a registry that answers "not ready".
    pub bootstrap_timeout: Duration,
    /// Liveness probe interval (the reference uses max(interval, 2 s)).
    pub heartbeat_interval: Duration,
    /// Consecutive failed probes after which a prefill is declared dead.
    pub max_heartbeat_failures: u32,
    /// Bound on each side-channel request.
    pub request_timeout: Duration,
    /// Where prefills' ranks and liveness come from: their bootstrap registries by default.
    pub directory: Arc<dyn PrefillDirectory>,
    /// Check each room's content digests before it succeeds ([`crate::push::digests`]):
    /// every prefill rank that writes into it sends the fold of what it wrote, and the room
    /// fails unless this rank's pages fold the same.
    pub digest: bool,
}

impl PushDecodeConfig {
    /// Defaults of the reference (5 s heartbeats, 2 misses, 300 s waiting timeout).
    pub fn new(tp_rank: u32, tp_size: u32) -> Self {
        PushDecodeConfig {
            tp: (tp_rank, tp_size),
            waiting_timeout: Duration::from_secs(300),
            bootstrap_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(5),
            max_heartbeat_failures: 2,
            request_timeout: Duration::from_secs(2),
            directory: Arc::new(RegistryDirectory),
            digest: false,
        }
    }
}

struct Prefill {
    instance: u64,
    registered: HashSet<(u32, u32)>,
    failures: u32,
    last_probe: Duration,
    probing: bool,
}

/// One decode rank.
pub struct PushDecode<T: Transport> {
    transport: T,
    config: PushDecodeConfig,
    clock: Arc<dyn Clock>,
    _registrations: Vec<Registration>,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    prefills: HashMap<Addr, Prefill>,
    rooms: HashMap<u64, DecodeRoom>,
    /// Rooms the engine removed while a prefill rank may still write into their pages, and
    /// when: kept to count acknowledgements until [`PushDecode::drained`], bounded by the
    /// waiting timeout.
    draining: HashMap<u64, (Duration, DecodeRoom)>,
    undrained: u64,
    unknown_notifications: u64,
    sharding: HeadSharding,
    /// Content digesting, with digests on.
    digests: Option<PageDigests>,
    /// Rooms whose content check runs: when it started, and per writer, its share and the
    /// digests computing.
    checking: HashMap<u64, (Duration, Vec<(WriterCheck, Pending)>)>,
    metrics: PushDecodeMetrics,
}

/// Counters of a decode rank, read and reset with [`PushDecode::take_metrics`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushDecodeMetrics {
    /// Rooms whose content digests matched.
    pub verified_rooms: u64,
    /// Rooms that failed on a content digest mismatch.
    pub digest_mismatches: u64,
    /// Time from a room's last note to the end of its content check (digesting on the
    /// digest threads, while the engine steps).
    pub digest_time: Duration,
}

impl<T: Transport> PushDecode<T> {
    /// Registers memory and starts the control thread.
    pub fn new(
        mut transport: T,
        config: PushDecodeConfig,
        bufs: PushBuffers,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, String> {
        bufs.kv.check().map_err(|e| e.to_string())?;
        let digests = if config.digest {
            Some(PageDigests::new(&bufs.kv)?)
        } else {
            None
        };
        let registrations = bufs.register(&mut transport).map_err(|e| e.to_string())?;
        let kv = &bufs.kv;
        let args = RegisterArgs {
            agent: transport.name().to_string(),
            agent_metadata: transport.metadata().map_err(|e| e.to_string())?,
            layout: LayoutWire::from_spec(&kv.spec, kv.total_kv_heads, kv.total_layers, 0)
                .with_groups(kv.groups.as_ref()),
            kv_bases: kv.bases.clone(),
            aux: bufs.aux.clone(),
            state: bufs.state.clone(),
            tp_size: config.tp.1,
            tp_rank: config.tp.0,
            reregisters: true,
        };
        let (jobs, job_rx) = unbounded::<Job>();
        let (done_tx, done) = unbounded::<Done>();
        let ctl = Control {
            args,
            config: config.clone(),
            sharding: kv.sharding(),
        };
        // Linux keeps a thread's first 15 bytes as its name: a short prefix leaves room for
        // the agent's.
        let thread = std::thread::Builder::new()
            .name(format!("kvx-push-{}", transport.name()))
            .spawn(move || {
                for job in job_rx {
                    let _ = done_tx.send(ctl.run(job));
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(PushDecode {
            transport,
            config,
            clock,
            _registrations: registrations,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            prefills: HashMap::new(),
            rooms: HashMap::new(),
            draining: HashMap::new(),
            undrained: 0,
            unknown_notifications: 0,
            sharding: bufs.kv.sharding(),
            digests,
            checking: HashMap::new(),
            metrics: PushDecodeMetrics::default(),
        })
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Notifications that matched no room or writer (dropped and counted).
    pub fn unknown_notifications(&self) -> u64 {
        self.unknown_notifications
    }

    /// Starts receiving `room` from the prefill whose registry is at `addr`: destination
    /// `pages` (empty for a rank that only completes its status), `aux_index`, `state_indices`.
    pub fn add_room(
        &mut self,
        room: u64,
        addr: (&str, u16),
        pages: Vec<u32>,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
    ) {
        self.add_room_after_prefix(room, addr, pages, aux_index, state_indices, 0);
    }

    /// Like [`PushDecode::add_room`] for a decode that holds the prompt's first
    /// `prefix_tokens` tokens already (its radix cache): `pages` are for the tokens after
    /// them, and the prefill engine learns the prefix ([`PushPrefill::decode_prefix`]) and
    /// sends only those.
    ///
    /// [`PushPrefill::decode_prefix`]: crate::push::PushPrefill::decode_prefix
    pub fn add_room_after_prefix(
        &mut self,
        room: u64,
        addr: (&str, u16),
        pages: Vec<u32>,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
        prefix_tokens: u64,
    ) {
        self.open_room(
            room,
            addr,
            pages,
            Vec::new(),
            aux_index,
            state_indices,
            prefix_tokens,
        );
    }

    /// Starts receiving `room` into a cache in KV cache groups (a hybrid model): `pages`
    /// lists each group's destination pages in group order, `group_pages` how many are
    /// each group's (one count per group, summing to `pages.len()`; checked by the prefill,
    /// which fails the room otherwise). `prefix_tokens` as in
    /// [`PushDecode::add_room_after_prefix`].
    pub fn add_room_in_groups(
        &mut self,
        room: u64,
        addr: (&str, u16),
        pages: Vec<u32>,
        group_pages: Vec<u32>,
        prefix_tokens: u64,
    ) {
        self.open_room(
            room,
            addr,
            pages,
            group_pages,
            None,
            Vec::new(),
            prefix_tokens,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn open_room(
        &mut self,
        room: u64,
        addr: (&str, u16),
        pages: Vec<u32>,
        group_pages: Vec<u32>,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
        prefix_tokens: u64,
    ) {
        let addr = (addr.0.to_string(), addr.1);
        let req = RoomRequest {
            room,
            agent: self.transport.name().to_string(),
            pages: pages.clone(),
            aux_index,
            state_indices: state_indices.clone(),
            digest: self.config.digest && !pages.is_empty(),
            prefix_tokens,
            group_pages,
        };
        let known = self
            .prefills
            .get(&addr)
            .map(|p| (p.instance, p.registered.clone()));
        let mut r = DecodeRoom::new(
            addr.clone(),
            self.clock.now(),
            pages,
            aux_index,
            state_indices,
        );
        if self.config.digest {
            r.check_digests();
        }
        self.rooms.insert(room, r);
        self.submit(Job::Bootstrap {
            room,
            addr,
            req,
            known,
        });
    }

    fn submit(&mut self, job: Job) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send(job);
        }
    }

    /// Status of a room.
    pub fn status(&self, room: u64) -> Option<RoomStatus> {
        self.rooms.get(&room).map(DecodeRoom::status)
    }

    /// Why a room failed.
    pub fn error(&self, room: u64) -> Option<String> {
        self.rooms
            .get(&room)
            .and_then(|r| r.error().map(str::to_string))
    }

    /// Forgets a room; a live one is aborted first. One that a prefill rank may still write
    /// into is kept aside until [`PushDecode::drained`] says so, or for the waiting timeout
    /// at most.
    pub fn remove_room(&mut self, room: u64) {
        if self.status(room).is_some_and(|s| !s.is_final()) {
            self.abort(room);
        }
        if let Some(r) = self.rooms.remove(&room)
            && !r.drained()
        {
            self.draining.insert(room, (self.clock.now(), r));
        }
    }

    /// Whether no prefill rank can still write into `room`'s pages, so that the engine may
    /// hand them to another request (SGLang's deferred release): it succeeded, every rank
    /// that was sent its pages acknowledged an abort (after releasing its WRITEs), or the
    /// prefill was declared dead. True for a room this rank does not know (any more): kept
    /// aside no longer than the waiting timeout.
    pub fn drained(&self, room: u64) -> bool {
        match (self.rooms.get(&room), self.draining.get(&room)) {
            (Some(r), _) | (None, Some((_, r))) => r.drained(),
            (None, None) => true,
        }
    }

    /// Stops waiting for `room` to drain (the engine released its pages anyway).
    pub fn forget(&mut self, room: u64) {
        self.rooms.remove(&room);
        self.draining.remove(&room);
        self.checking.remove(&room);
    }

    /// The counters since the last call, reset.
    pub fn take_metrics(&mut self) -> PushDecodeMetrics {
        std::mem::take(&mut self.metrics)
    }

    /// Rooms removed before they drained and given up on after the waiting timeout.
    pub fn undrained(&self) -> u64 {
        self.undrained
    }

    /// Gives up on a room and tells its prefill ranks, which acknowledge once they stopped
    /// writing into it ([`PushDecode::drained`]).
    pub fn abort(&mut self, room: u64) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        r.fail("aborted by the decode engine".into());
        let ranks = r.unacked_ranks();
        if !ranks.is_empty() {
            self.submit(Job::Abort { room, ranks });
        }
    }

    /// Processes control results, notifications, timeouts and liveness. Never blocks.
    pub fn poll(&mut self) {
        while let Ok(done) = self.done.try_recv() {
            self.on_done(done);
        }
        let mut notes = Vec::new();
        let _ = self.transport.drain_notifications(&mut notes);
        for n in notes {
            self.on_note(&n.from, &n.message);
        }
        let now = self.clock.now();
        let mut failed = Vec::new();
        for (id, r) in &mut self.rooms {
            let live = !r.status().is_final();
            r.advance(*id, now, self.config.waiting_timeout);
            // Failed now (waiting timeout, or one writer's abort): every rank that has not
            // stopped is told to, and acknowledges once it has.
            if live && r.status() == RoomStatus::Failed {
                failed.push((*id, r.unacked_ranks()));
            }
        }
        self.abort_ranks(failed);
        self.check_contents(now);
        let wait = self.config.waiting_timeout;
        let undrained = &mut self.undrained;
        self.draining.retain(|id, (removed, r)| {
            if r.drained() {
                return false;
            }
            let keep = now.saturating_sub(*removed) <= wait;
            if !keep {
                tracing::warn!(room = id, "a removed room's prefill ranks never acknowledged its abort: no longer waited for");
                undrained.tally(1);
            }
            keep
        });
        self.heartbeat(now);
    }

    /// Starts the content checks of rooms whose notes all arrived, and ends those whose
    /// digests are in: the room succeeds if every writer's fold matches its pages', fails
    /// otherwise.
    fn check_contents(&mut self, now: Duration) {
        let Some(digests) = self.digests.as_mut() else {
            return;
        };
        for (&id, r) in &mut self.rooms {
            let Some(checks) = r.take_check() else {
                continue;
            };
            let started: Result<Vec<_>, String> = checks
                .into_iter()
                .map(|c| digests.start(r.pages(), c.cover).map(|p| (c, p)))
                .collect();
            match started {
                Ok(writers) => {
                    self.checking.insert(id, (now, writers));
                }
                Err(e) => r.checked(Err(format!("content check: {e}"))),
            }
        }
        let mut ended = Vec::new();
        for (&id, (t0, writers)) in &mut self.checking {
            if let Some(outcome) = check_outcome(writers) {
                ended.push((id, *t0, outcome));
            }
        }
        for (id, t0, outcome) in ended {
            self.checking.remove(&id);
            self.metrics.digest_time.tally(now.saturating_sub(t0));
            let outcome = match outcome {
                Checked::Match => {
                    self.metrics.verified_rooms.tally(1);
                    Ok(())
                }
                Checked::Mismatch(e) => {
                    self.metrics.digest_mismatches.tally(1);
                    Err(e)
                }
                Checked::Failed(e) => Err(e),
            };
            if let Some(r) = self.room_mut(id) {
                r.checked(outcome);
            }
        }
    }

    /// Fails the live rooms that bootstrapped against instance `old` of the prefill at
    /// `addr`, now `new`: what they wait for was to come from the old process. Its ranks
    /// are told, as for a room that timed out: where only some of them restarted (one
    /// instance per engine in etcd), the others may still write.
    fn end_rooms_of(&mut self, addr: &(String, u16), old: u64, new: u64) {
        let mut ended = Vec::new();
        for (id, r) in &mut self.rooms {
            if r.addr == *addr && r.instance == Some(old) && !r.status().is_final() {
                r.fail(format!(
                    "the prefill at {}:{} restarted (instance {old:#x}, now {new:#x})",
                    addr.0, addr.1
                ));
                ended.push((*id, r.unacked_ranks()));
            }
        }
        self.abort_ranks(ended);
    }

    /// Tells the prefill ranks of rooms the decode gave up on to drop them.
    fn abort_ranks(&mut self, rooms: Vec<(u64, Vec<RankInfo>)>) {
        for (room, ranks) in rooms {
            if !ranks.is_empty() {
                self.submit(Job::Abort { room, ranks });
            }
        }
    }

    fn on_done(&mut self, done: Done) {
        match done {
            Done::Bootstrapped {
                room,
                addr,
                instance,
                ranks,
                registered,
                reached,
            } => {
                let p = self.prefills.entry(addr.clone()).or_insert(Prefill {
                    instance,
                    registered: HashSet::new(),
                    failures: 0,
                    last_probe: self.clock.now(),
                    probing: false,
                });
                let restarted = (p.instance != instance).then(|| {
                    // A restarted prefill: forget what was registered with the old one.
                    let old = p.instance;
                    p.instance = instance;
                    p.registered.clear();
                    old
                });
                p.registered.extend(registered);
                if let Some(old) = restarted {
                    self.end_rooms_of(&addr, old, instance);
                }
                let agents = reached.iter().map(|r| r.agent.clone());
                let (tp, sharding) = (self.config.tp, self.sharding);
                match self.room_mut(room) {
                    Some(r) if !r.status().is_final() => {
                        r.instance = Some(instance);
                        r.set_reached(agents);
                        r.bootstrapped(ranks, tp, sharding);
                        return;
                    }
                    // Aborted, timed out or forgotten while its destinations were on their way:
                    // the prefill ranks have them now and are told to drop them, or they would
                    // write into pages the engine may have handed to another request.
                    Some(r) => {
                        r.set_reached(agents);
                        r.learn_ranks(ranks.clone());
                    }
                    None => {}
                }
                self.submit(Job::Abort { room, ranks });
            }
            Done::BootstrapFailed {
                room,
                reason,
                reached,
            } => {
                if let Some(r) = self.room_mut(room) {
                    r.fail(reason);
                    r.set_reached(reached.iter().map(|r| r.agent.clone()));
                    r.learn_ranks(reached.clone());
                }
                // Ranks that have the room's pages write into them unless told to stop.
                if !reached.is_empty() {
                    self.submit(Job::Abort {
                        room,
                        ranks: reached,
                    });
                }
            }
            Done::AbortSent => {}
            Done::Probed { addr, ok } => {
                let max = self.config.max_heartbeat_failures;
                let Some(p) = self.prefills.get_mut(&addr) else {
                    return;
                };
                p.probing = false;
                if ok {
                    p.failures = 0;
                    return;
                }
                p.failures.tally(1);
                if p.failures >= max {
                    tracing::warn!(host = %addr.0, port = addr.1, "prefill unreachable: failing its rooms");
                    self.prefills.remove(&addr);
                    let rooms = self.rooms.values_mut();
                    let removed = self.draining.values_mut().map(|(_, r)| r);
                    for r in rooms.chain(removed).filter(|r| r.addr == addr) {
                        r.prefill_gone(format!(
                            "prefill {}:{} missed {max} heartbeats",
                            addr.0, addr.1
                        ));
                    }
                }
            }
        }
    }

    fn on_note(&mut self, from: &str, message: &[u8]) {
        let Some(note) = messages::parse_note(message) else {
            self.unknown_notifications.tally(1);
            return;
        };
        let room_id = match note {
            PushNote::Kv { room, .. }
            | PushNote::Aux { room }
            | PushNote::State { room, .. }
            | PushNote::Abort { room } => room,
        };
        let Some(r) = self.room_mut(room_id) else {
            self.unknown_notifications.tally(1);
            return;
        };
        if !r.note(from, &note) {
            self.unknown_notifications.tally(1);
        }
    }

    /// A room the engine has, or one it removed that is still draining.
    fn room_mut(&mut self, room: u64) -> Option<&mut DecodeRoom> {
        match self.rooms.get_mut(&room) {
            Some(r) => Some(r),
            None => self.draining.get_mut(&room).map(|(_, r)| r),
        }
    }

    fn heartbeat(&mut self, now: Duration) {
        let interval = self.config.heartbeat_interval;
        // Probed while a room waits for data or for its writers to stop (a live room is
        // never drained).
        let busy: HashSet<Addr> = self
            .rooms
            .values()
            .chain(self.draining.values().map(|(_, r)| r))
            .filter(|r| !r.drained())
            .map(|r| r.addr.clone())
            .collect();
        let mut probes = Vec::new();
        for (addr, p) in &mut self.prefills {
            if busy.contains(addr) && !p.probing && now.saturating_sub(p.last_probe) >= interval {
                p.probing = true;
                p.last_probe = now;
                probes.push(addr.clone());
            }
        }
        for addr in probes {
            self.submit(Job::Probe { addr });
        }
    }
}

/// How a room's content check ended.
enum Checked {
    /// Every writer's fold matched.
    Match,
    /// One did not.
    Mismatch(String),
    /// The pages could not be digested.
    Failed(String),
}

/// The outcome of a room's content check once every writer's digests are in (`None`
/// before), stopping at the first mismatch or failure.
fn check_outcome(writers: &mut [(WriterCheck, Pending)]) -> Option<Checked> {
    for (c, pending) in writers.iter_mut() {
        match pending.try_fold()? {
            Err(e) => return Some(Checked::Failed(format!("content check: {e}"))),
            Ok(fold) if fold != c.expected => {
                return Some(Checked::Mismatch(format!(
                    "content digest mismatch: the pages prefill rank {} (stage {}) wrote into this decode rank fold to {fold:016x}, it sent {:016x}: the bytes received are not the ones it digested",
                    c.agent, c.pp_rank, c.expected
                )));
            }
            Ok(_) => {}
        }
    }
    Some(Checked::Match)
}

impl<T: Transport> Drop for PushDecode<T> {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
