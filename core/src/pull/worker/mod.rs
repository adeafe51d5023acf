//! The worker half of the pull connector: registers the engine's KV cache, serves its
//! metadata, starts loads without ever blocking the caller, and reports each step which
//! sends and receives finished and which loads failed.
//!
//! Decode side: a load for a prefill engine not yet known starts a handshake on its own
//! thread and waits in a queue; when the handshake resolves the queue is issued (or failed).
//! Each data link of the TP mapping becomes one coalesced READ whose notification tells the
//! prefill rank how many readers to wait for; notify-only links just send the notification.
//! Prefill side: held requests are freed when all readers notified or their lease expired.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_layout::{CacheSpec, LayerGroups, LayoutError, TpMapping};

use super::block_lists::BlockLists;
use super::config::PullConfig;
use super::holds::Holds;
use super::loads::{Admission, InFlight, Loads};
pub use super::loads::{FailedLoad, LoadRefused};
use super::metrics::PullMetrics;
use super::phases::{Phases, Ranked};
use super::scheduler::{RecvRequest, StepMeta};
use super::stamps::{Scratch, StampTable};
use crate::clock::Clock;
use crate::connector::KvCache;
use crate::sidechannel::{Listener, side_channel_port};
use crate::transport::{
    AddrRange, MemoryKind, PeerId, Registration, Transport, TransportError, XferId,
};
use crate::wire::handshake::{HandshakeMeta, LayoutWire, PROTOCOL_VERSION};

/// Errors setting a worker up.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The transport refused.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The cache layout is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The side channel could not start.
    #[error("side channel: {0}")]
    SideChannel(String),
    /// The settings cannot work together, or not with this cache.
    #[error("configuration: {0}")]
    Config(String),
}

/// What finished since the last step. Failed loads also appear in `recving`: the request
/// is finished, and `failed` says which of its blocks are invalid.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finished {
    /// Prefill side: requests whose blocks may be freed.
    pub sending: Vec<String>,
    /// Decode side: requests whose load ended.
    pub recving: Vec<String>,
    /// Decode side: loads that failed.
    pub failed: Vec<FailedLoad>,
}

impl Finished {
    /// Nothing finished.
    pub fn is_empty(&self) -> bool {
        self.sending.is_empty() && self.recving.is_empty() && self.failed.is_empty()
    }
}

/// How often [`PullWorker::wait_finished`] polls while it waits.
pub const IDLE_POLL: Duration = Duration::from_micros(500);

struct RemoteRank {
    peer: PeerId,
    spec: CacheSpec,
    bases: Vec<u64>,
    first_layer: u32,
    /// A kvxfer peer that understands heartbeats.
    lease_aware: bool,
    /// Per-block prepared lists, where the transport prefers indexed posts.
    lists: Option<BlockLists>,
    /// The worker instance the handshake named (kvxfer peers).
    instance: Option<u64>,
    /// Its KV cache groups (a hybrid model), as the handshake named them.
    groups: Option<LayerGroups>,
    /// A stock vLLM 0.32 prefill: heartbeats in its format.
    stock: bool,
    /// Where its stamp table lies, when it stamps its references.
    stamps: Option<u64>,
    /// Where its digest table lies, when it publishes content digests.
    digests: Option<u64>,
}

/// One prefill rank's metadata as a handshake fetched it.
struct Fetched {
    /// The cache geometry (for a stock peer, as a reference peer's map).
    meta: HandshakeMeta,
    /// For a stock vLLM peer: what its own protocol says beyond the map.
    native: Option<crate::wire::vllm_peer::StockMeta>,
    /// For a stock vLLM peer: its clock minus ours (seconds) when it answered.
    clock_offset: Option<f64>,
}

/// A connected prefill engine, as the driver keeps it (the loads machine holds it).
struct Connection {
    mapping: TpMapping,
    ranks: HashMap<u32, RemoteRank>,
    /// A stock prefill's clock minus ours (seconds), from its handshake reply.
    clock_offset: Option<f64>,
    /// When it was last needed: connected, or a request loading from or waiting for it at a
    /// heartbeat tick.
    used: Duration,
}

struct Outcome {
    engine_id: String,
    started: Duration,
    result: Result<(u32, Vec<(u32, Fetched)>), String>,
}

struct Load {
    req: RecvRequest,
    xfers: Vec<(XferId, Duration)>,
    /// What follows the data READs (stamps, digests, notes) and when it is reported.
    phases: Phases<Verify, u32, Vec<digests::Landing>>,
}

impl InFlight for Load {
    fn req(&self) -> &RecvRequest {
        &self.req
    }
}

impl Load {
    /// A load whose READs were posted: `stamped` the ranks whose stamps are read after
    /// them, `failed` why it failed already.
    fn new(
        req: RecvRequest,
        xfers: Vec<(XferId, Duration)>,
        stamped: Vec<Verify>,
        digests: bool,
        failed: Option<String>,
    ) -> Self {
        Load {
            req,
            xfers,
            phases: Phases::new(stamped, digests, failed),
        }
    }
}

/// A stamp READ a load posts after its data READs: the prefill rank whose slot it reads,
/// and the read-done note sent once the slot confirmed the hold (not before, so that the
/// prefill holds the blocks until their slot was read).
struct Verify {
    rank: u32,
    note: Vec<u8>,
    /// The heads the rank's data READ moved (what a content digest check compares).
    slice: kvxfer_layout::HeadSlice,
}

impl Ranked for Verify {
    fn rank(&self) -> u32 {
        self.rank
    }
}

/// One TP rank's worker.
pub struct PullWorker<T: Transport> {
    transport: T,
    config: PullConfig,
    cache: KvCache,
    clock: Arc<dyn Clock>,
    registrations: Vec<Registration>,
    /// Prefill side: the listener, who may send notes, the holds and their stamps.
    serving: holds::Serving,
    /// Decode side: the prefill engines, the loads queued, waiting and in flight, and what
    /// the engine is told of them (the I/O-free machine this worker drives).
    book: Loads<Connection, Load>,
    /// Decode side: the handshake threads, their outcomes, the instances they named.
    handshakes: connect::Handshakes,
    /// Decode side: where stamp READs land.
    scratch: Scratch,
    /// Decode side: what planning a load's READs reuses.
    bufs: reads::Buffers,
    /// With content digests (`PullConfig::digest`): the table this rank publishes and the
    /// scratch its READs of other ranks' land in.
    digests: Option<digests::Digests>,
    last_heartbeat: Duration,
    metrics: PullMetrics,
    shut_down: bool,
    /// This worker's random instance id, named in its handshakes.
    instance: u64,
    /// A digest of this rank's cache layout (see [`PullWorker::layout_digest`]).
    layout_digest: String,
}

mod connect;
mod digests;
mod holds;
mod reads;
mod vllm;

use crate::tally::Tally;

impl<T: Transport> PullWorker<T> {
    /// Registers `cache` with `transport` and starts this rank's side-channel listener.
    pub fn new(
        mut transport: T,
        config: PullConfig,
        cache: KvCache,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, PullError> {
        cache.check()?;
        let mut registrations = register_spans(&mut transport, &cache)?;
        let (stamps, scratch) = (StampTable::new(), Scratch::new());
        let digests = config
            .digest
            .then(|| digests::Digests::new(&cache, config.stamp_references))
            .transpose()?;
        let digest_ranges = digests
            .iter()
            .flat_map(|d| [d.table.range(), d.scratch.range()]);
        for range in [stamps.range(), scratch.range()]
            .into_iter()
            .chain(digest_ranges)
        {
            registrations.push(transport.register(MemoryKind::Host, range)?);
        }
        let layout = LayoutWire::from_spec(
            &cache.spec,
            cache.total_kv_heads,
            cache.total_layers,
            cache.first_layer,
        )
        .with_groups(cache.groups.as_ref());
        let meta = HandshakeMeta {
            engine_id: config.engine_id.clone(),
            agent_metadata: transport.metadata()?,
            kv_caches_base_addr: cache.bases.clone(),
            num_blocks: cache.spec.num_blocks().into(),
            tp_size: config.tp_size.into(),
            block_len: cache.spec.block_len(),
            attn_backend_name: config.backend_name.clone(),
            kvxfer_protocol: Some(PROTOCOL_VERSION),
            kvxfer_tp_rank: Some(config.tp_rank),
            kvxfer_layout: Some(layout),
            kvxfer_lease_ms: Some(config.lease.as_millis() as u64),
            kvxfer_instance: Some(rand::random()),
            kvxfer_stamps: config.stamp_references.then(|| stamps.range().addr),
            kvxfer_digests: digests.as_ref().map(|d| d.table.range().addr),
        };
        let instance = meta.kvxfer_instance.unwrap_or_default();
        let layout_digest = digest(&meta);
        let port = if config.side_channel_port == 0 {
            0
        } else {
            side_channel_port(
                config.side_channel_port,
                config.dp_rank_local,
                config.tp_size,
                config.tp_rank,
            )
            .ok_or_else(|| PullError::SideChannel("listener port exceeds 65535".into()))?
        };
        let listener = Listener::bind(
            &config.side_channel_host,
            port,
            config.tp_rank,
            meta.encode(),
        )
        .map_err(PullError::SideChannel)?;
        let now = clock.now();
        let worker = PullWorker {
            transport,
            serving: holds::Serving::new(listener, Holds::new(config.lease), stamps),
            book: Loads::new(config.failure_policy),
            config,
            cache,
            clock,
            registrations,
            handshakes: connect::Handshakes::default(),
            scratch,
            bufs: reads::Buffers::default(),
            digests,
            last_heartbeat: now,
            metrics: PullMetrics::default(),
            shut_down: false,
            instance,
            layout_digest,
        };
        worker.serve_stock_decodes();
        Ok(worker)
    }
    /// This worker's random instance id: a restarted rank has a new one (discovery records
    /// it, and handshakes name it).
    pub fn instance(&self) -> u64 {
        self.instance
    }
    /// A digest of this rank's cache geometry (`sha256:` and 16 hex digits), equal for ranks
    /// whose caches a peer would read alike: published by discovery so a peer can tell a
    /// changed layout without a handshake.
    pub fn layout_digest(&self) -> &str {
        &self.layout_digest
    }
    /// Discovery says `engine_id` is gone or restarted: its loads in flight fail now, with
    /// their blocks, instead of at the transfer timeout, and so do its loads queued behind a
    /// handshake still in flight (instead of at the handshake timeout); its connection is
    /// dropped and the next load handshakes again. An engine it never heard of is no-op.
    pub fn engine_lost(&mut self, engine_id: &str, reason: &str) {
        self.lose_engine(engine_id, reason);
        // The handshake itself runs on: its outcome serves the loads queued after this.
        for req in self.book.take_queued(engine_id) {
            self.book
                .fail(req, format!("prefill engine {engine_id} lost: {reason}"));
        }
    }
    /// The port this rank's listener is bound to.
    pub fn listener_port(&self) -> Option<u16> {
        self.serving.listener.as_ref().map(Listener::port)
    }
    /// The transport (for inspection).
    pub fn transport(&self) -> &T {
        &self.transport
    }
    /// The transport, mutably (tests use it to inject faults).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }
    /// Scratch slots lent to stamp READs in flight (tests: none once loads ended).
    pub fn stamp_reads_in_flight(&self) -> usize {
        (crate::pull::stamps::SCRATCH_SLOTS as usize).saturating_sub(self.scratch.free())
    }
    /// Loads whose blocks arrived and whose prefill had not yet started holding their
    /// reference when its stamp was read: they read the stamp again (tests).
    pub fn loads_awaiting_holds(&self) -> usize {
        self.book
            .loads()
            .filter(|l| l.phases.hold_pending())
            .count()
    }
    /// Handshake threads not yet joined: those still running, and any that ended since the
    /// last handshake started or answered (tests: flat however many handshakes ran).
    pub fn handshake_threads(&self) -> usize {
        self.handshakes.threads.len()
    }
    /// Notifications that were not kvxfer pull messages (dropped and counted).
    pub fn unknown_notifications(&self) -> u64 {
        self.serving.unknown_notifications
    }
    /// Metrics since the last call (reset on read).
    pub fn take_metrics(&mut self) -> PullMetrics {
        std::mem::take(&mut self.metrics)
    }
    /// Starts this step's loads and holds (never blocks: handshakes run on their own
    /// threads); returns the loads it refused (each counted in
    /// [`PullMetrics::refused_loads`]), which the engine should log: the step's other loads
    /// are started regardless.
    pub fn start_load_kv(&mut self, meta: &StepMeta) -> Vec<LoadRefused> {
        let mut refused = Vec::new();
        if self.shut_down {
            return refused;
        }
        self.start_holds(&meta.hold);
        // Waits before unwaits: a request may begin and end waiting within one step.
        for wait in &meta.wait {
            self.await_load(wait);
        }
        for id in &meta.unwait {
            self.book.unwait(id);
        }
        for req in &meta.recv {
            // A connection the transport saw fail is dropped first: the load handshakes anew.
            self.drop_if_peer_failed(&req.engine_id);
            match self.book.admit(req) {
                Admission::Refused(why) => {
                    self.metrics.refused_loads.tally(1);
                    refused.push(why);
                }
                Admission::Failed => self.metrics.failed_setups.tally(1),
                Admission::Issue => self.issue(req.clone()),
                Admission::Queued => {}
                Admission::Handshake => self.spawn_handshake(req),
            }
        }
        self.heartbeat_new_waits(&meta.wait);
        refused
    }
    /// Progresses everything and reports what finished since the last call.
    pub fn get_finished(&mut self) -> Finished {
        // One clock read per phase boundary: this runs every engine step.
        let mut t = std::time::Instant::now();
        if !self.shut_down {
            while let Ok(outcome) = self.handshakes.outcomes.1.try_recv() {
                self.on_handshake(outcome);
            }
            t = lap(t, "handshake outcomes");
            self.digests_finished();
            self.poll_loads();
            t = lap(t, "loads");
            self.check_loading_peers();
            t = lap(t, "loading peers");
            self.poll_notifications();
            t = lap(t, "notifications");
            self.expire_leases();
            t = lap(t, "leases");
            self.send_heartbeats();
            t = lap(t, "heartbeats");
        }
        self.unstamp_freed();
        lap(t, "stamps");
        let (recving, failed) = self.book.take_finished();
        Finished {
            sending: std::mem::take(&mut self.serving.sending),
            recving,
            failed,
        }
    }
    /// [`PullWorker::get_finished`], polling again every [`IDLE_POLL`] for up to `wait`
    /// while nothing finished and loads or holds are outstanding. For an engine step that
    /// scheduled nothing: the engine has no work but polling this worker, and stepping
    /// back-to-back would take the CPU the transfers need (on a CPU engine, most of it).
    pub fn wait_finished(&mut self, wait: Duration) -> Finished {
        let rounds = wait.as_nanos().div_ceil(IDLE_POLL.as_nanos());
        let mut f = self.get_finished();
        for _ in 0..rounds {
            if !f.is_empty() || !self.outstanding() {
                break;
            }
            std::thread::sleep(IDLE_POLL);
            f = self.get_finished();
        }
        f
    }
    /// Loads or holds this worker still waits for.
    fn outstanding(&self) -> bool {
        !self.shut_down
            && (self.book.loading() > 0 || self.book.any_queued() || self.serving.holds.held() > 0)
    }
    /// Releases every transfer, peer, listener and registration. Idempotent.
    pub fn shutdown(&mut self) {
        if self.shut_down {
            return;
        }
        self.shut_down = true;
        if let Some(d) = self.digests.as_mut() {
            // Their jobs read the cache: they end before the worker does.
            d.shutdown();
        }
        for load in self.book.drain() {
            for (x, _) in load.xfers {
                let _ = self.transport.release(x);
            }
        }
        // No hold outlives the worker: decodes still reading find their slots released.
        for (_, stamp) in self.serving.stamped.drain() {
            self.serving.stamps.release(stamp);
        }
        for conn in self.book.drain_connections() {
            for r in conn.ranks.into_values() {
                self.forget_rank(&r);
            }
        }
        self.serving.listener.take();
        // Handshake threads end within their timeouts.
        for t in self.handshakes.threads.drain(..) {
            let _ = t.join();
        }
        self.registrations.clear();
        self.book.clear();
        self.serving.holds.clear();
    }
}

impl<T: Transport> Drop for PullWorker<T> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Registers the cache's regions, merging regions adjacent in memory into one registration
/// so that coalesced descriptors spanning them stay inside one registered range.
fn register_spans<T: Transport>(
    t: &mut T,
    cache: &KvCache,
) -> Result<Vec<Registration>, PullError> {
    let mut bases = cache.bases.clone();
    bases.sort_unstable();
    // Regions that KV cache groups share are registered once.
    bases.dedup();
    let len = cache.spec.region_len();
    let mut spans: Vec<AddrRange> = Vec::new();
    for b in bases {
        match spans.last_mut() {
            Some(s) if s.addr.checked_add(s.len) == Some(b) => s.len = s.len.saturating_add(len),
            _ => spans.push(AddrRange::new(b, len)),
        }
    }
    spans
        .into_iter()
        .map(|s| t.register(cache.memory, s).map_err(PullError::from))
        .collect()
}

/// The prefill ranks decode rank `my_rank` links with (data or notification only), in order.
fn prefill_ranks(mapping: &TpMapping, my_rank: u32) -> Result<Vec<u32>, String> {
    let mut ranks: Vec<u32> = mapping
        .links_for_decode(my_rank)
        .map_err(|e| e.to_string())?
        .iter()
        .map(|l| l.prefill_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    Ok(ranks)
}

/// `sha256:` and the first 16 hex digits of the hash of what a peer reads the cache by.
fn digest(meta: &HandshakeMeta) -> String {
    use sha2::{Digest, Sha256};
    let facts = (
        &meta.kvxfer_layout,
        meta.block_len,
        meta.num_blocks,
        meta.tp_size,
        &meta.attn_backend_name,
    );
    let bytes = rmp_serde::to_vec(&facts).unwrap_or_default();
    let hash = Sha256::digest(&bytes);
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A poll phase slower than this is logged by name: a poll takes microseconds and the
/// engine's step waits for it, so a slow one points at what held the engine up.
const SLOW_PHASE: Duration = Duration::from_secs(1);

/// Ends one phase of [`PullWorker::get_finished`] begun at `since`, warning when it took
/// over [`SLOW_PHASE`] (wall time: a diagnostic, it changes nothing the worker does); returns
/// when the next phase begins.
fn lap(since: std::time::Instant, phase: &'static str) -> std::time::Instant {
    let now = std::time::Instant::now();
    let took = now.saturating_duration_since(since);
    if took > SLOW_PHASE {
        tracing::warn!(
            phase,
            ?took,
            "a worker poll phase was slow: the engine step waited for it"
        );
    }
    now
}
