//! The worker half of the pull connector: registers the engine's KV cache, serves its
//! metadata, starts loads without ever blocking the caller, and reports each step which
//! sends and receives finished and which loads failed.
//!
//! Decode side: a load for a prefill engine not yet known starts a handshake on its own
//! thread and waits in a queue; when the handshake resolves the queue is issued (or failed).
//! Each data link of the TP mapping becomes one coalesced READ whose notification tells the
//! prefill rank how many readers to wait for; notify-only links just send the notification.
//! Prefill side: held requests are freed when all readers notified or their lease expired.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvxfer_layout::{
    BlockPairs, CacheSide, CacheSpec, LayoutError, LinkKind, PlanOptions, Side, SideLayout,
    TpMapping, TransferPlan, check_compatible, plan_transfer_into,
};

use super::block_lists::{self, BlockLists};
use super::config::{FailurePolicy, KvCache, PullConfig};
use super::metrics::PullMetrics;
use super::notify::{self, PullNote};
use super::scheduler::{RecvRequest, StepMeta};
use crate::clock::Clock;
use crate::plan::split_for;
use crate::sidechannel::{KnownReaders, Listener, fetch_metadata_for, side_channel_port};
use crate::transport::{
    AddrRange, Op, PeerId, Registration, Transport, TransportError, XferId, XferStatus,
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
}

/// A load in the step metadata that was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadRefused {
    /// A load of this request id is already in flight (loading, waiting for its
    /// handshake, or ended and not yet reported): the first one continues untouched.
    #[error("a load of request {0} is already in flight")]
    AlreadyInFlight(String),
}

/// A load that could not complete: its local blocks hold no valid data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedLoad {
    /// Request id.
    pub req_id: String,
    /// Local blocks whose content is invalid.
    pub invalid_blocks: Vec<u32>,
    /// Why.
    pub reason: String,
    /// What the engine should do.
    pub policy: FailurePolicy,
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
}

enum Engine {
    Handshaking,
    Ready {
        mapping: TpMapping,
        ranks: HashMap<u32, RemoteRank>,
    },
}

struct Outcome {
    engine_id: String,
    started: Duration,
    result: Result<(u32, Vec<(u32, HandshakeMeta)>), String>,
}

struct Load {
    req: RecvRequest,
    xfers: Vec<(XferId, Duration)>,
    failed: Option<String>,
}

struct Held {
    readers: Option<u32>,
    /// The agents whose read-done notes were counted, each once.
    senders: Vec<String>,
    deadline: Duration,
}

impl Held {
    fn new(deadline: Duration) -> Self {
        Held {
            readers: None,
            senders: Vec::new(),
            deadline,
        }
    }

    /// Counts `from`'s note naming `readers`; false (nothing counted) for a sender already
    /// counted or a reader count that contradicts the first note's.
    fn count(&mut self, from: &str, readers: u32) -> bool {
        if self.readers.is_some_and(|r| r != readers) || self.senders.iter().any(|s| s == from) {
            return false;
        }
        self.readers = Some(readers);
        self.senders.push(from.to_string());
        true
    }

    fn all_read(&self) -> bool {
        self.readers
            .is_some_and(|r| self.senders.len() >= r as usize)
    }
}

/// One TP rank's worker.
pub struct PullWorker<T: Transport> {
    transport: T,
    config: PullConfig,
    cache: KvCache,
    clock: Arc<dyn Clock>,
    registrations: Vec<Registration>,
    listener: Option<Listener>,
    /// Decode agents that fetched this rank's metadata: the only senders of notes counted.
    readers: Arc<KnownReaders>,
    engines: HashMap<String, Engine>,
    /// The last instance each (engine, rank) named in a handshake.
    instances: HashMap<(String, u32), u64>,
    queued: HashMap<String, Vec<RecvRequest>>,
    loads: HashMap<String, Load>,
    orphans: Vec<XferId>,
    held: HashMap<String, Held>,
    early: HashMap<String, Held>,
    outcomes: (Sender<Outcome>, Receiver<Outcome>),
    threads: Vec<JoinHandle<()>>,
    finished: Finished,
    last_heartbeat: Duration,
    metrics: PullMetrics,
    unknown_notifications: u64,
    shut_down: bool,
    plan: TransferPlan,
    ranges: (Vec<AddrRange>, Vec<AddrRange>),
    indices: (Vec<u32>, Vec<u32>),
}

impl<T: Transport> PullWorker<T> {
    /// Registers `cache` with `transport` and starts this rank's side-channel listener.
    pub fn new(
        mut transport: T,
        config: PullConfig,
        cache: KvCache,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, PullError> {
        CacheSide::new(&cache.spec, &cache.bases, cache.first_layer)?;
        let registrations = register_spans(&mut transport, &cache)?;
        let layout = LayoutWire::from_spec(
            &cache.spec,
            cache.total_kv_heads,
            cache.total_layers,
            cache.first_layer,
        );
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
        };
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
        let readers = listener.readers();
        Ok(PullWorker {
            transport,
            config,
            cache,
            clock,
            registrations,
            listener: Some(listener),
            readers,
            engines: HashMap::new(),
            instances: HashMap::new(),
            queued: HashMap::new(),
            loads: HashMap::new(),
            orphans: Vec::new(),
            held: HashMap::new(),
            early: HashMap::new(),
            outcomes: unbounded(),
            threads: Vec::new(),
            finished: Finished::default(),
            last_heartbeat: now,
            metrics: PullMetrics::default(),
            unknown_notifications: 0,
            shut_down: false,
            plan: TransferPlan::default(),
            ranges: (Vec::new(), Vec::new()),
            indices: (Vec::new(), Vec::new()),
        })
    }

    /// The port this rank's listener is bound to.
    pub fn listener_port(&self) -> Option<u16> {
        self.listener.as_ref().map(Listener::port)
    }

    /// The transport (for inspection).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably (tests use it to inject faults).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Notifications that were not kvxfer pull messages (dropped and counted).
    pub fn unknown_notifications(&self) -> u64 {
        self.unknown_notifications
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
        let now = self.clock.now();
        for req_id in &meta.hold {
            let mut held = Held::new(now + self.config.lease);
            if let Some(early) = self.early.remove(req_id) {
                held.senders = early.senders;
                held.readers = early.readers;
            }
            self.hold_or_free(req_id.clone(), held);
        }
        for req in &meta.recv {
            if self.in_flight(&req.req_id) {
                self.metrics.refused_loads += 1;
                refused.push(LoadRefused::AlreadyInFlight(req.req_id.clone()));
                continue;
            }
            self.drop_if_peer_failed(&req.engine_id);
            match self.engines.get(&req.engine_id) {
                Some(Engine::Ready { .. }) => self.issue(req.clone()),
                Some(Engine::Handshaking) => self
                    .queued
                    .entry(req.engine_id.clone())
                    .or_default()
                    .push(req.clone()),
                None => {
                    self.engines
                        .insert(req.engine_id.clone(), Engine::Handshaking);
                    self.queued
                        .entry(req.engine_id.clone())
                        .or_default()
                        .push(req.clone());
                    self.spawn_handshake(req);
                }
            }
        }
        refused
    }

    /// Whether a load of `req_id` started and the engine has not yet been told it ended.
    fn in_flight(&self, req_id: &str) -> bool {
        self.loads.contains_key(req_id)
            || self.queued.values().flatten().any(|r| r.req_id == req_id)
            || self.finished.recving.iter().any(|r| r == req_id)
    }

    /// Progresses everything and reports what finished since the last call.
    pub fn get_finished(&mut self) -> Finished {
        if !self.shut_down {
            while let Ok(outcome) = self.outcomes.1.try_recv() {
                self.on_handshake(outcome);
            }
            self.poll_loads();
            self.check_loading_peers();
            self.poll_notifications();
            self.expire_leases();
            self.send_heartbeats();
            self.release_orphans();
        }
        std::mem::take(&mut self.finished)
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
            && (!self.loads.is_empty()
                || self.queued.values().any(|q| !q.is_empty())
                || !self.held.is_empty())
    }

    fn spawn_handshake(&mut self, req: &RecvRequest) {
        let tx = self.outcomes.0.clone();
        let (host, port, engine_id) = (req.host.clone(), req.port, req.engine_id.clone());
        let reader = self.transport.name().to_string();
        let (my_rank, my_tp, sharding) = (
            self.config.tp_rank,
            self.config.tp_size,
            self.cache.sharding(),
        );
        let (timeout, limit) = (
            self.config.handshake_timeout,
            self.config.max_handshake_bytes,
        );
        let started = self.clock.now();
        let spawned = std::thread::Builder::new()
            .name(format!("kvxfer-handshake-{engine_id}"))
            .spawn(move || {
                let at = Remote {
                    host: &host,
                    port,
                    reader: &reader,
                };
                let result = handshake(&at, my_rank, my_tp, sharding, timeout, limit);
                let _ = tx.send(Outcome {
                    engine_id,
                    started,
                    result,
                });
            });
        match spawned {
            Ok(t) => self.threads.push(t),
            Err(e) => {
                let _ = self.outcomes.0.send(Outcome {
                    engine_id: req.engine_id.clone(),
                    started,
                    result: Err(format!("cannot start handshake thread: {e}")),
                });
            }
        }
    }

    fn on_handshake(&mut self, outcome: Outcome) {
        let queued = self.queued.remove(&outcome.engine_id).unwrap_or_default();
        let ready = outcome
            .result
            .and_then(|(remote_tp, metas)| self.connect(remote_tp, metas));
        match ready {
            Ok((mapping, ranks)) => {
                self.metrics.handshakes += 1;
                self.metrics.handshake_time += self.clock.now().saturating_sub(outcome.started);
                tracing::info!(engine = %outcome.engine_id, ranks = ranks.len(), "connected to prefill engine");
                self.note_instances(&outcome.engine_id, &ranks);
                self.engines
                    .insert(outcome.engine_id.clone(), Engine::Ready { mapping, ranks });
                for req in queued {
                    self.issue(req);
                }
            }
            Err(reason) => {
                self.metrics.failed_handshakes += 1;
                // Forget the engine so a later request tries again.
                self.engines.remove(&outcome.engine_id);
                tracing::warn!(engine = %outcome.engine_id, %reason, "handshake failed");
                for req in queued {
                    self.fail(
                        req,
                        format!("handshake with {} failed: {reason}", outcome.engine_id),
                    );
                }
            }
        }
    }

    /// Checks compatibility and loads every remote rank into the transport.
    fn connect(
        &mut self,
        remote_tp: u32,
        metas: Vec<(u32, HandshakeMeta)>,
    ) -> Result<(TpMapping, HashMap<u32, RemoteRank>), String> {
        let mapping = TpMapping::new(remote_tp, self.config.tp_size, self.cache.sharding())
            .map_err(|e| e.to_string())?;
        let mut ranks = HashMap::new();
        for (rank, meta) in metas {
            match self.remote_rank(&mapping, rank, &meta) {
                Ok(r) => {
                    ranks.insert(rank, r);
                }
                Err(e) => {
                    for r in std::mem::take(&mut ranks).into_values() {
                        self.forget_rank(&r);
                    }
                    return Err(format!("prefill rank {rank}: {e}"));
                }
            }
        }
        Ok((mapping, ranks))
    }

    fn remote_rank(
        &mut self,
        mapping: &TpMapping,
        rank: u32,
        meta: &HandshakeMeta,
    ) -> Result<RemoteRank, String> {
        let own = &self.cache;
        let mut problems = Vec::new();
        if meta.attn_backend_name != self.config.backend_name {
            problems.push(format!(
                "attention backend: local {}, remote {}",
                self.config.backend_name, meta.attn_backend_name
            ));
        }
        let (spec, first_layer) = match &meta.kvxfer_layout {
            Some(layout) => {
                if meta.kvxfer_protocol != Some(PROTOCOL_VERSION) {
                    problems.push(format!(
                        "kvxfer protocol: local {PROTOCOL_VERSION}, remote {}",
                        meta.kvxfer_protocol
                            .map_or_else(|| "none".to_string(), |v| v.to_string())
                    ));
                }
                let spec = layout.to_spec().map_err(|e| e.to_string())?;
                let local = SideLayout {
                    spec: &own.spec,
                    tp_size: self.config.tp_size,
                    total_kv_heads: own.total_kv_heads,
                    total_layers: own.total_layers,
                };
                let remote = SideLayout {
                    spec: &spec,
                    tp_size: mapping.prefill_tp(),
                    total_kv_heads: layout.total_kv_heads,
                    total_layers: layout.total_layers,
                };
                if let Err(mismatches) = check_compatible(&local, &remote) {
                    problems.extend(mismatches.iter().map(ToString::to_string));
                }
                (spec, layout.first_layer)
            }
            None => {
                // A reference peer: derive its spec from ours and check its block length.
                let heads = mapping
                    .heads_of(Side::Prefill, rank)
                    .map_err(|e| e.to_string())?
                    .count;
                let mut params = *own.spec.params();
                params.kv_heads = heads;
                params.num_blocks = u32::try_from(meta.num_blocks)
                    .map_err(|_| "num_blocks exceeds u32".to_string())?;
                let spec = CacheSpec::new(params).map_err(|e| e.to_string())?;
                if spec.block_len() != meta.block_len {
                    problems.push(format!(
                        "block_len: local layout with {heads} heads per rank expects {}, remote {}",
                        spec.block_len(),
                        meta.block_len
                    ));
                }
                (spec, 0)
            }
        };
        if spec.num_regions() as usize != meta.kv_caches_base_addr.len() {
            return Err(format!(
                "{} regions expected, {} base addresses sent",
                spec.num_regions(),
                meta.kv_caches_base_addr.len()
            ));
        }
        if !problems.is_empty() {
            if self.config.enforce_compat {
                return Err(format!("incompatible KV layout: {}", problems.join("; ")));
            }
            tracing::warn!(rank, problems = %problems.join("; "), "incompatible KV layout (enforcement disabled)");
        }
        CacheSide::new(&spec, &meta.kv_caches_base_addr, first_layer).map_err(|e| e.to_string())?;
        let peer = self
            .transport
            .load_peer(&meta.agent_metadata)
            .map_err(|e| e.to_string())?;
        let mut remote = RemoteRank {
            peer,
            spec,
            bases: meta.kv_caches_base_addr.clone(),
            first_layer,
            lease_aware: meta.kvxfer_lease_ms.is_some(),
            lists: None,
            instance: meta.kvxfer_instance,
        };
        remote.lists = self.block_lists(mapping, rank, &remote);
        Ok(remote)
    }

    /// Prepares per-block lists for the link with prefill rank `rank`, when the transport
    /// builds requests faster from them and the link carries data; `None` keeps raw posts.
    fn block_lists(
        &mut self,
        mapping: &TpMapping,
        rank: u32,
        remote: &RemoteRank,
    ) -> Option<BlockLists> {
        if !self.config.prepared_lists
            || !self.transport.prefers_prepared_lists()
            || self.cache.layer_windows.is_some()
        {
            return None;
        }
        let slice = mapping
            .links_for_decode(self.config.tp_rank)
            .ok()?
            .into_iter()
            .find_map(|l| match l.kind {
                LinkKind::Data(slice) if l.prefill_rank == rank => Some(slice),
                _ => None,
            })?;
        let side = CacheSide::new(&remote.spec, &remote.bases, remote.first_layer).ok()?;
        let own =
            CacheSide::new(&self.cache.spec, &self.cache.bases, self.cache.first_layer).ok()?;
        match block_lists::prepare(
            &mut self.transport,
            remote.peer,
            self.cache.memory,
            &side,
            &own,
            slice,
        ) {
            Ok(lists) => Some(lists),
            Err(reason) => {
                tracing::info!(rank, %reason, "per-block lists not prepared; posting raw plans");
                None
            }
        }
    }

    /// Releases what was set up for a remote rank.
    fn forget_rank(&mut self, r: &RemoteRank) {
        if let Some(l) = r.lists {
            let _ = self.transport.release_list(l.local);
            let _ = self.transport.release_list(l.remote);
        }
        let _ = self.transport.remove_peer(r.peer);
    }

    fn issue(&mut self, req: RecvRequest) {
        let start = self.clock.now();
        match self.post_reads(&req) {
            Ok(xfers) => {
                self.metrics.post_time += self.clock.now().saturating_sub(start);
                if xfers.is_empty() {
                    self.finished.recving.push(req.req_id.clone());
                } else {
                    let posted = self.clock.now();
                    let xfers = xfers.into_iter().map(|x| (x, posted)).collect();
                    self.loads.insert(
                        req.req_id.clone(),
                        Load {
                            req,
                            xfers,
                            failed: None,
                        },
                    );
                }
            }
            Err((reason, posted)) => {
                self.metrics.failed_setups += 1;
                self.orphans.extend(posted);
                let engine_id = req.engine_id.clone();
                self.fail(req, reason);
                self.drop_if_peer_failed(&engine_id);
            }
        }
    }

    /// Posts one READ per data link (and notifications for the rest); on error returns
    /// the reason and the transfers already posted (to be released once they end).
    fn post_reads(&mut self, req: &RecvRequest) -> Result<Vec<XferId>, (String, Vec<XferId>)> {
        let Some(Engine::Ready { mapping, ranks, .. }) = self.engines.get(&req.engine_id) else {
            return Err((
                format!("engine {} is not connected", req.engine_id),
                Vec::new(),
            ));
        };
        let local = &req.local_block_ids;
        if local.len() > req.remote_block_ids.len() {
            let reason = format!(
                "{} local blocks but the prefill holds only {}",
                local.len(),
                req.remote_block_ids.len()
            );
            return Err((reason, Vec::new()));
        }
        let remote = &req.remote_block_ids[req.remote_block_ids.len() - local.len()..];
        let links = mapping
            .links_for_decode(self.config.tp_rank)
            .map_err(|e| (e.to_string(), Vec::new()))?;
        let own = CacheSide::new(&self.cache.spec, &self.cache.bases, self.cache.first_layer)
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
            let indexed = rank
                .lists
                .filter(|_| !local.is_empty() && block_lists::fragmented(remote, local));
            match (link.kind, indexed) {
                (LinkKind::Data(_), Some(lists)) => {
                    let planning = self.clock.now();
                    lists
                        .indices(remote, local, &mut self.indices.0, &mut self.indices.1)
                        .map_err(|e| (e, posted.clone()))?;
                    self.metrics.plan_time += self.clock.now().saturating_sub(planning);
                    let x = self
                        .transport
                        .post_indexed(
                            Op::Read,
                            lists.local,
                            &self.indices.0,
                            lists.remote,
                            &self.indices.1,
                            Some(&note),
                        )
                        .map_err(|e| (e.to_string(), posted.clone()))?;
                    posted.push(x);
                    let pairs = local.len() as u64;
                    self.metrics.transfers += 1;
                    self.metrics.indexed_transfers += 1;
                    self.metrics.bytes += pairs * lists.bytes_per_block;
                    self.metrics.descriptors_raw += pairs * lists.raw_per_block;
                    self.metrics.descriptors_posted += self.indices.0.len() as u64;
                }
                (LinkKind::Data(slice), None) if !local.is_empty() => {
                    let side = CacheSide::new(&rank.spec, &rank.bases, rank.first_layer)
                        .map_err(|e| (e.to_string(), posted.clone()))?;
                    let pairs = BlockPairs {
                        src: remote,
                        dst: local,
                        windows: self.cache.layer_windows.as_deref(),
                    };
                    let planning = self.clock.now();
                    plan_transfer_into(
                        &side,
                        &own,
                        slice,
                        &pairs,
                        PlanOptions::default(),
                        &mut self.plan,
                    )
                    .map_err(|e| (e.to_string(), posted.clone()))?;
                    split_for(
                        Op::Read,
                        self.plan.iter(),
                        &mut self.ranges.0,
                        &mut self.ranges.1,
                    );
                    self.metrics.plan_time += self.clock.now().saturating_sub(planning);
                    let kinds = (self.cache.memory, self.cache.memory);
                    let x = self
                        .transport
                        .post(
                            Op::Read,
                            rank.peer,
                            kinds,
                            &self.ranges.0,
                            &self.ranges.1,
                            Some(&note),
                        )
                        .map_err(|e| (e.to_string(), posted.clone()))?;
                    posted.push(x);
                    self.metrics.transfers += 1;
                    self.metrics.bytes += self.plan.total_bytes;
                    self.metrics.descriptors_raw += self.plan.raw_count;
                    self.metrics.descriptors_posted += self.plan.len() as u64;
                }
                _ => {
                    if let Err(e) = self.transport.send_notification(rank.peer, &note) {
                        self.metrics.failed_notifications += 1;
                        return Err((
                            format!("notifying prefill rank {}: {e}", link.prefill_rank),
                            posted,
                        ));
                    }
                }
            }
        }
        Ok(posted)
    }

    fn fail(&mut self, req: RecvRequest, reason: String) {
        self.finished.recving.push(req.req_id.clone());
        self.finished.failed.push(FailedLoad {
            req_id: req.req_id,
            invalid_blocks: req.local_block_ids,
            reason,
            policy: self.config.failure_policy,
        });
    }

    fn poll_loads(&mut self) {
        let now = self.clock.now();
        let mut ended = Vec::new();
        let mut lost: Vec<(String, String)> = Vec::new();
        for (id, load) in &mut self.loads {
            let had_failed = load.failed.is_some();
            let mut still = Vec::with_capacity(load.xfers.len());
            for &(x, posted) in &load.xfers {
                match self.transport.status(x) {
                    Ok(XferStatus::InProgress)
                        if now.saturating_sub(posted) > self.config.transfer_timeout =>
                    {
                        // Cancel before reporting: nothing may land in the blocks after the
                        // engine hears they are invalid. Release is bounded by the transport.
                        self.metrics.failed_transfers += 1;
                        load.failed.get_or_insert(format!(
                            "no completion within {:?}",
                            self.config.transfer_timeout
                        ));
                        let _ = self.transport.release(x);
                    }
                    Ok(XferStatus::InProgress) => still.push((x, posted)),
                    Ok(XferStatus::Done) => {
                        self.metrics.transfer_time += now.saturating_sub(posted);
                        if let Some(t) = self.transport.telemetry(x) {
                            self.metrics.backend.add(&t);
                        }
                        let _ = self.transport.release(x);
                    }
                    Ok(XferStatus::Failed(reason)) => {
                        self.metrics.failed_transfers += 1;
                        load.failed.get_or_insert(reason);
                        let _ = self.transport.release(x);
                    }
                    Err(e) => {
                        self.metrics.failed_transfers += 1;
                        load.failed.get_or_insert(e.to_string());
                    }
                }
            }
            load.xfers = still;
            if let (false, Some(reason)) = (had_failed, &load.failed) {
                lost.push((load.req.engine_id.clone(), reason.clone()));
            }
            // Report only when nothing writes into the blocks any more.
            if load.xfers.is_empty() {
                ended.push(id.clone());
            }
        }
        for id in ended {
            if let Some(load) = self.loads.remove(&id) {
                match load.failed {
                    None => self.finished.recving.push(id),
                    Some(reason) => self.fail(load.req, format!("transfer failed: {reason}")),
                }
            }
        }
        // A failed transfer means the prefill died, restarted or became unreachable: its
        // cached connection is not trusted again.
        for (engine_id, reason) in lost {
            self.lose_engine(&engine_id, &reason);
        }
    }

    /// Drops the cached connections whose peers the transport knows failed, for engines
    /// this worker is loading from (their loads then fail now instead of at a timeout).
    fn check_loading_peers(&mut self) {
        let mut engines: Vec<String> = self
            .loads
            .values()
            .map(|l| l.req.engine_id.clone())
            .collect();
        engines.sort_unstable();
        engines.dedup();
        for e in engines {
            self.drop_if_peer_failed(&e);
        }
    }

    /// Drops the cached connection to `engine_id` when the transport knows one of its ranks
    /// failed (a dead or restarted prefill): the next load handshakes again instead of
    /// posting to the old instance.
    fn drop_if_peer_failed(&mut self, engine_id: &str) {
        let Some(Engine::Ready { ranks, .. }) = self.engines.get(engine_id) else {
            return;
        };
        let failed = ranks
            .iter()
            .find(|(_, r)| self.transport.peer_failed(r.peer))
            .map(|(rank, _)| *rank);
        if let Some(rank) = failed {
            self.lose_engine(engine_id, &format!("prefill rank {rank} is unreachable"));
        }
    }

    /// Forgets the connection to `engine_id` after a failure: its loads still in flight
    /// (all posted on this connection: a new one is made only after the old one is lost)
    /// are cancelled and reported failed with their blocks, its peers and lists released,
    /// and the next load handshakes again. Nothing happens unless it is connected.
    fn lose_engine(&mut self, engine_id: &str, reason: &str) {
        if !matches!(self.engines.get(engine_id), Some(Engine::Ready { .. })) {
            return;
        }
        let Some(Engine::Ready { ranks, .. }) = self.engines.remove(engine_id) else {
            return;
        };
        self.metrics.lost_connections += 1;
        tracing::warn!(engine = %engine_id, %reason, "connection to prefill engine lost: its loads in flight fail, the next load handshakes again");
        let doomed: Vec<String> = self
            .loads
            .iter()
            .filter(|(_, l)| l.req.engine_id == engine_id)
            .map(|(id, _)| id.clone())
            .collect();
        for id in doomed {
            if let Some(load) = self.loads.remove(&id) {
                // Cancel before reporting: nothing may land in the blocks after the engine
                // hears they are invalid. Release is bounded by the transport.
                for (x, _) in load.xfers {
                    let _ = self.transport.release(x);
                }
                let why = load
                    .failed
                    .unwrap_or_else(|| format!("connection to {engine_id} lost: {reason}"));
                self.fail(load.req, format!("transfer failed: {why}"));
            }
        }
        for r in ranks.into_values() {
            self.forget_rank(&r);
        }
    }

    /// Records the instance each rank named; a new one under a known (engine, rank) is a
    /// restart, counted and logged.
    fn note_instances(&mut self, engine_id: &str, ranks: &HashMap<u32, RemoteRank>) {
        for (&rank, r) in ranks {
            let Some(instance) = r.instance else {
                continue;
            };
            let key = (engine_id.to_string(), rank);
            if let Some(old) = self.instances.insert(key, instance) {
                if old != instance {
                    self.metrics.peer_restarts += 1;
                    tracing::info!(engine = %engine_id, rank, "prefill engine restarted (new instance): connected to the new one");
                }
            }
        }
    }

    fn poll_notifications(&mut self) {
        let mut notes = Vec::new();
        if self.transport.drain_notifications(&mut notes).is_err() {
            return;
        }
        let now = self.clock.now();
        for n in notes {
            let note = notify::parse(&n.message);
            if note.is_some() && !self.readers.contains(&n.from) {
                // Only a decode that fetched our metadata reads (and frees) our blocks.
                self.metrics.refused_notes += 1;
                tracing::debug!(from = %n.from, "note from an agent that never fetched our metadata dropped");
                continue;
            }
            match note {
                Some(PullNote::Read { req_id, readers }) => {
                    if let Some(mut held) = self.held.remove(req_id) {
                        if !held.count(&n.from, readers) {
                            self.metrics.refused_notes += 1;
                        }
                        self.hold_or_free(req_id.to_string(), held);
                    } else {
                        // Arrived before the scheduler told us to hold: keep it, never drop.
                        let early = self
                            .early
                            .entry(req_id.to_string())
                            .or_insert_with(|| Held::new(now + self.config.lease));
                        if !early.count(&n.from, readers) {
                            self.metrics.refused_notes += 1;
                        }
                    }
                }
                Some(PullNote::Heartbeat { req_id }) => {
                    if let Some(h) = self.held.get_mut(req_id) {
                        h.deadline = now + self.config.lease;
                    }
                }
                None => self.unknown_notifications += 1,
            }
        }
    }

    fn hold_or_free(&mut self, req_id: String, held: Held) {
        if held.all_read() {
            self.finished.sending.push(req_id);
        } else {
            self.held.insert(req_id, held);
        }
    }

    fn expire_leases(&mut self) {
        let now = self.clock.now();
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.held.remove(&id);
            self.metrics.expired_leases += 1;
            tracing::warn!(req = %id, "lease expired: freeing blocks no decode read");
            self.finished.sending.push(id);
        }
        // Early notes for requests never held are forgotten after a lease.
        self.early.retain(|_, h| h.deadline > now);
    }

    fn send_heartbeats(&mut self) {
        let now = self.clock.now();
        if now.saturating_sub(self.last_heartbeat) < self.config.heartbeat_interval {
            return;
        }
        self.last_heartbeat = now;
        for load in self.loads.values() {
            let Some(Engine::Ready { ranks, .. }) = self.engines.get(&load.req.engine_id) else {
                continue;
            };
            for rank in ranks.values().filter(|r| r.lease_aware) {
                if self
                    .transport
                    .send_notification(rank.peer, &notify::heartbeat(&load.req.remote_req_id))
                    .is_err()
                {
                    self.metrics.failed_notifications += 1;
                }
            }
        }
    }

    fn release_orphans(&mut self) {
        let mut keep = Vec::new();
        for x in std::mem::take(&mut self.orphans) {
            match self.transport.status(x) {
                Ok(XferStatus::InProgress) => keep.push(x),
                _ => {
                    let _ = self.transport.release(x);
                }
            }
        }
        self.orphans = keep;
    }

    /// Releases every transfer, peer, listener and registration. Idempotent.
    pub fn shutdown(&mut self) {
        if self.shut_down {
            return;
        }
        self.shut_down = true;
        for load in std::mem::take(&mut self.loads).into_values() {
            for (x, _) in load.xfers {
                let _ = self.transport.release(x);
            }
        }
        for x in std::mem::take(&mut self.orphans) {
            let _ = self.transport.release(x);
        }
        for engine in std::mem::take(&mut self.engines).into_values() {
            if let Engine::Ready { ranks, .. } = engine {
                for r in ranks.into_values() {
                    self.forget_rank(&r);
                }
            }
        }
        self.listener.take();
        // Handshake threads end within their timeouts.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.registrations.clear();
        self.queued.clear();
        self.held.clear();
        self.early.clear();
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
    let len = cache.spec.region_len();
    let mut spans: Vec<AddrRange> = Vec::new();
    for b in bases {
        match spans.last_mut() {
            Some(s) if s.addr + s.len == b => s.len += len,
            _ => spans.push(AddrRange::new(b, len)),
        }
    }
    spans
        .into_iter()
        .map(|s| t.register(cache.memory, s).map_err(PullError::from))
        .collect()
}

/// A prefill's side channel, and the agent that asks it (named in each request, so the
/// prefill accepts its notes).
struct Remote<'a> {
    host: &'a str,
    port: u16,
    reader: &'a str,
}

/// Fetches rank 0 (to learn the prefill's TP), then every prefill rank this decode rank
/// links with. Runs on a handshake thread.
fn handshake(
    at: &Remote<'_>,
    my_rank: u32,
    my_tp: u32,
    sharding: kvxfer_layout::HeadSharding,
    timeout: Duration,
    limit: usize,
) -> Result<(u32, Vec<(u32, HandshakeMeta)>), String> {
    let (host, port) = (at.host, at.port);
    let first =
        fetch_metadata_for(host, port, 0, at.reader, timeout, limit).map_err(|e| e.to_string())?;
    let remote_tp =
        u32::try_from(first.tp_size).map_err(|_| "remote tp_size exceeds u32".to_string())?;
    let mapping = TpMapping::new(remote_tp, my_tp, sharding).map_err(|e| e.to_string())?;
    let mut ranks: Vec<u32> = mapping
        .links_for_decode(my_rank)
        .map_err(|e| e.to_string())?
        .iter()
        .map(|l| l.prefill_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut metas = Vec::with_capacity(ranks.len());
    for r in ranks {
        if r == 0 {
            metas.push((0, first.clone()));
            continue;
        }
        let p = u16::try_from(u32::from(port) + r)
            .map_err(|_| format!("port of prefill rank {r} exceeds 65535"))?;
        metas.push((
            r,
            fetch_metadata_for(host, p, r, at.reader, timeout, limit).map_err(|e| e.to_string())?,
        ));
    }
    Ok((remote_tp, metas))
}
