//! Connections to prefill engines: the handshake (on its own thread), compatibility checks
//! and peer loading, and dropping a connection whose prefill died or restarted.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, unbounded};

use kvxfer_layout::{
    CacheKind, CacheSide, CacheSpec, LayerGroups, LinkKind, Side, SideLayout, TpMapping,
    check_compatible,
};

use super::prefill_ranks;
use super::vllm::{StockPrefill, stock_handshake};
use super::{Connection, Fetched, Outcome, PullWorker, RemoteRank};
use crate::pull::block_lists::{self, BlockLists};
use crate::pull::scheduler::RecvRequest;
use crate::sidechannel::fetch_metadata_for;
use crate::tally::Tally;
use crate::transport::Transport;
use crate::wire::handshake::PROTOCOL_VERSION;
use crate::wire::params::PeerProtocol;
use crate::wire::vllm_peer::{StockRegions, layout_name};

/// The decode side's handshakes: the threads not yet joined, the channel their outcomes
/// come back on, and the last instance each (engine, rank) named.
pub(super) struct Handshakes {
    pub(super) outcomes: (Sender<Outcome>, Receiver<Outcome>),
    pub(super) threads: Vec<JoinHandle<()>>,
    pub(super) instances: HashMap<(String, u32), u64>,
}

impl Default for Handshakes {
    fn default() -> Self {
        Handshakes {
            outcomes: unbounded(),
            threads: Vec::new(),
            instances: HashMap::new(),
        }
    }
}

impl<T: Transport> PullWorker<T> {
    pub(super) fn spawn_handshake(&mut self, req: &RecvRequest) {
        let tx = self.handshakes.outcomes.0.clone();
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
        let (protocol, remote_tp) = (req.protocol, req.remote_tp_size);
        let compat = self.config.vllm.clone();
        tracing::debug!(engine = %engine_id, %host, port, "handshake started");
        // Linux keeps a thread's first 15 bytes as its name (`top -H`, /proc): a short
        // prefix leaves room for the engine id.
        // The engine id comes from the request's parameters: a NUL in a thread's name
        // would panic the spawn.
        let spawned = std::thread::Builder::new()
            .name(format!("kvx-hs-{}", engine_id.replace('\0', "?")))
            .spawn(move || {
                let at = Remote {
                    host: &host,
                    port,
                    reader: &reader,
                    engine_id: &engine_id,
                };
                let result = match protocol {
                    PeerProtocol::Kvxfer => {
                        handshake(&at, my_rank, my_tp, sharding, timeout, limit)
                    }
                    PeerProtocol::Vllm032 => {
                        let stock = StockPrefill {
                            host: &host,
                            port,
                            engine_id: &engine_id,
                            tp_size: remote_tp.unwrap_or(1),
                            compat: compat.as_ref(),
                        };
                        TpMapping::new(stock.tp_size, my_tp, sharding)
                            .map_err(|e| e.to_string())
                            .and_then(|m| stock_handshake(&stock, &m, my_rank, timeout, limit))
                            .map(|ranks| (stock.tp_size, ranks))
                    }
                };
                let _ = tx.send(Outcome {
                    engine_id,
                    started,
                    result,
                });
            });
        self.join_finished_handshakes();
        match spawned {
            Ok(t) => self.handshakes.threads.push(t),
            Err(e) => {
                let _ = self.handshakes.outcomes.0.send(Outcome {
                    engine_id: req.engine_id.clone(),
                    started,
                    result: Err(format!("cannot start handshake thread: {e}")),
                });
            }
        }
    }
    /// Joins the handshake threads that ended: each holds its stack and guard page until
    /// joined, and a decode that reconnects for days would otherwise keep them all.
    fn join_finished_handshakes(&mut self) {
        let (ended, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.handshakes.threads)
            .into_iter()
            .partition(|t| t.is_finished());
        self.handshakes.threads = running;
        for t in ended {
            let _ = t.join();
        }
    }

    pub(super) fn on_handshake(&mut self, outcome: Outcome) {
        self.join_finished_handshakes();
        let clock_offset = outcome
            .result
            .as_ref()
            .ok()
            .and_then(|(_, ranks)| ranks.iter().find_map(|(_, f)| f.clock_offset));
        // Loading peers runs on the engine's thread: how long it took is worth a log line.
        let connecting = std::time::Instant::now();
        let ready = outcome
            .result
            .and_then(|(remote_tp, metas)| self.connect(remote_tp, metas));
        let connect_ms = connecting.elapsed().as_millis();
        match ready {
            Ok((mapping, ranks)) => {
                self.metrics.handshakes.tally(1);
                self.metrics
                    .handshake_time
                    .tally(self.clock.now().saturating_sub(outcome.started));
                tracing::info!(engine = %outcome.engine_id, ranks = ranks.len(), connect_ms, "connected to prefill engine");
                self.note_instances(&outcome.engine_id, &ranks);
                let conn = Connection {
                    mapping,
                    ranks,
                    clock_offset,
                    used: self.clock.now(),
                };
                for req in self.book.connected(&outcome.engine_id, conn) {
                    self.issue(req);
                }
                self.heartbeat(&outcome.engine_id);
            }
            Err(reason) => {
                self.metrics.failed_handshakes.tally(1);
                tracing::warn!(engine = %outcome.engine_id, %reason, "handshake failed");
                // Forgotten, so that a later request tries again; its queued loads fail.
                self.book.handshake_failed(&outcome.engine_id, &reason);
            }
        }
    }
    /// Checks compatibility and loads every remote rank into the transport.
    pub(super) fn connect(
        &mut self,
        remote_tp: u32,
        metas: Vec<(u32, Fetched)>,
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
    pub(super) fn remote_rank(
        &mut self,
        mapping: &TpMapping,
        rank: u32,
        fetched: &Fetched,
    ) -> Result<RemoteRank, String> {
        let (meta, native) = (&fetched.meta, fetched.native.as_ref());
        let own = &self.cache;
        let mut problems = Vec::new();
        // A stock vLLM peer names vLLM's backend, which its compatibility hash covered.
        let backend = match (native, &self.config.vllm) {
            (Some(_), Some(v)) => &v.factors.attn_backend_name,
            _ => &self.config.backend_name,
        };
        if &meta.attn_backend_name != backend {
            problems.push(format!(
                "attention backend: local {backend}, remote {}",
                meta.attn_backend_name
            ));
        }
        if let Some(n) = native {
            let ours = layout_name(&own.spec);
            if own.spec.kind() == CacheKind::CrossLayer {
                // vLLM registers a cross-layer cache as one view per layer; kvxfer as one
                // region. Refused until that mapping is built and tested against vLLM.
                problems.push(format!(
                    "a cross-layer cache ({ours}) does not pair with stock vLLM peers yet"
                ));
            }
            // An MLA cache has one "head": vLLM names its layout by the engine's setting
            // (NHD on CPU) and, as here, does not compare it.
            if own.spec.kind() != CacheKind::Mla && n.kv_cache_layout != ours {
                problems.push(format!(
                    "kv_cache_layout: local {ours}, remote {}",
                    n.kv_cache_layout
                ));
            }
            if own.groups.as_ref().is_some_and(LayerGroups::has_state) {
                problems.push(
                    "Mamba state beside attention does not pair with stock vLLM peers (vLLM \
                     registers each state's parts as regions of their own)"
                        .into(),
                );
            }
            if n.block_size != own.spec.tokens_per_block() {
                problems.push(format!(
                    "block_size: local {}, remote {}",
                    own.spec.tokens_per_block(),
                    n.block_size
                ));
            }
        }
        let (spec, first_layer, groups) = match &meta.kvxfer_layout {
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
                let (ours_tpb, theirs_tpb) = (own.spec.tokens_per_block(), spec.tokens_per_block());
                if ours_tpb != theirs_tpb {
                    // Token-range plans cover one block table of full-attention layers.
                    let what = if own.groups.is_some() || layout.groups.is_some() {
                        Some("KV cache groups")
                    } else if own.layer_windows.is_some() {
                        Some("per-layer attention windows")
                    } else {
                        None
                    };
                    if let Some(what) = what {
                        problems.push(format!(
                            "tokens per block: local {ours_tpb}, remote {theirs_tpb}; with {what} both sides need the same block size"
                        ));
                    }
                }
                let groups = match &layout.groups {
                    Some(_)
                        if layout.first_layer != 0 || layout.total_layers != spec.num_layers() =>
                    {
                        return Err("KV cache groups from a pipeline stage: unsupported".into());
                    }
                    _ => layout
                        .to_groups(spec.num_layers())
                        .map_err(|e| e.to_string())?,
                };
                if own.groups != groups {
                    problems.push(format!(
                        "KV cache groups (layers of each): local {}, remote {}",
                        groups_name(own.groups.as_ref()),
                        groups_name(groups.as_ref())
                    ));
                }
                // Groups that differ were refused above: this cache's marks are the peer's.
                let state = own.groups.as_ref().is_some_and(LayerGroups::has_state);
                if state && mapping.prefill_tp() != self.config.tp_size {
                    // A rank's state page holds its own shard of each layer's heads, laid
                    // out inside the page by the model: it moves rank to rank, whole.
                    problems.push(format!(
                        "TP size: local {}, remote {}; state KV cache groups (Mamba) move between equal TP sizes only",
                        self.config.tp_size,
                        mapping.prefill_tp()
                    ));
                }
                (spec, layout.first_layer, groups)
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
                // A stock vLLM peer's KV cache groups are ours: its compatibility hash
                // covered the model, and its regions are checked against ours below.
                let groups = native.and(own.groups.clone());
                if own.groups.is_some() && native.is_none() {
                    problems.push(format!(
                        "a hybrid cache ({} KV cache groups) does not pair with a peer of the reference protocol",
                        own.group_count()
                    ));
                }
                (spec, 0, groups)
            }
        };
        // A stock peer registers memory that layers of several groups share once; kvxfer
        // plans with one region per layer.
        let bases = match native {
            Some(n) if own.groups.is_some() => {
                let names = self
                    .config
                    .vllm
                    .as_ref()
                    .map_or(&[][..], |v| &v.region_names[..]);
                StockRegions::of(own).expand(n, names)?
            }
            _ => meta.kv_caches_base_addr.clone(),
        };
        if spec.num_regions() as usize != bases.len() {
            return Err(format!(
                "{} regions expected, {} base addresses sent",
                spec.num_regions(),
                bases.len()
            ));
        }
        if !problems.is_empty() {
            if self.config.enforce_compat {
                return Err(format!("incompatible KV layout: {}", problems.join("; ")));
            }
            tracing::warn!(rank, problems = %problems.join("; "), "incompatible KV layout (enforcement disabled)");
        }
        match &groups {
            None => CacheSide::new(&spec, &bases, first_layer).map(|_| ()),
            Some(g) => g.check_regions(&spec, &bases),
        }
        .map_err(|e| e.to_string())?;
        let peer = match native {
            Some(n) => self
                .transport
                .load_native_peer(&meta.agent_metadata, &n.regions),
            None => self.transport.load_peer(&meta.agent_metadata),
        }
        .map_err(|e| e.to_string())?;
        let mut remote = RemoteRank {
            peer,
            spec,
            bases,
            first_layer,
            lease_aware: meta.kvxfer_lease_ms.is_some() || native.is_some(),
            lists: None,
            instance: meta.kvxfer_instance,
            stamps: meta.kvxfer_stamps.filter(|_| native.is_none()),
            digests: meta.kvxfer_digests.filter(|_| native.is_none()),
            stock: native.is_some(),
            groups,
        };
        remote.lists = self.block_lists(mapping, rank, &remote);
        Ok(remote)
    }
    /// Prepares per-block lists for the link with prefill rank `rank`, when the transport
    /// builds requests faster from them and the link carries data; `None` keeps raw posts.
    pub(super) fn block_lists(
        &mut self,
        mapping: &TpMapping,
        rank: u32,
        remote: &RemoteRank,
    ) -> Option<BlockLists> {
        // Hybrid caches post raw plans: prepared lists describe one block table; so do
        // blocks of different sizes (their plans map token ranges).
        if !self.config.prepared_lists
            || !self.transport.prefers_prepared_lists()
            || self.cache.layer_windows.is_some()
            || self.cache.groups.is_some()
            || remote.groups.is_some()
            || remote.spec.tokens_per_block() != self.cache.spec.tokens_per_block()
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
    pub(super) fn forget_rank(&mut self, r: &RemoteRank) {
        if let Some(l) = r.lists {
            let _ = self.transport.release_list(l.local);
            let _ = self.transport.release_list(l.remote);
        }
        let _ = self.transport.remove_peer(r.peer);
    }
    /// Drops the cached connections whose peers the transport knows failed, for engines
    /// this worker is loading from (their loads then fail now instead of at a timeout).
    pub(super) fn check_loading_peers(&mut self) {
        for e in self.book.engines_of(false) {
            self.drop_if_peer_failed(&e);
        }
    }
    /// Drops the cached connection to `engine_id` when the transport knows one of its ranks
    /// failed (a dead or restarted prefill): the next load handshakes again instead of
    /// posting to the old instance.
    pub(super) fn drop_if_peer_failed(&mut self, engine_id: &str) {
        let Some(conn) = self.book.connection(engine_id) else {
            return;
        };
        let failed = conn
            .ranks
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
    pub(super) fn lose_engine(&mut self, engine_id: &str, reason: &str) {
        let Some((conn, doomed)) = self.book.lose(engine_id) else {
            return;
        };
        self.metrics.lost_connections.tally(1);
        tracing::warn!(engine = %engine_id, %reason, "connection to prefill engine lost: its loads in flight fail, the next load handshakes again");
        for mut load in doomed {
            // Cancel before reporting: nothing may land in the blocks after the engine
            // hears they are invalid. Release is bounded by the transport.
            for (x, _) in std::mem::take(&mut load.xfers) {
                let _ = self.transport.release(x);
            }
            let why = format!("transfer failed: connection to {engine_id} lost: {reason}");
            load.phases.fail(why);
            // Its phases hand back the scratch lent and report it (after a digest check
            // still running, which reads only this cache).
            self.end_phase(load);
        }
        for r in conn.ranks.into_values() {
            self.forget_rank(&r);
        }
    }
    /// Closes connections no request needs (each heartbeat tick; `busy`: the engines
    /// requests load from or wait for): a connected engine outside `busy` whose rank the
    /// transport saw fail (it died, or restarted under a new engine id, which no request
    /// names again), or that was last needed `idle_engine_timeout` ago. No load runs on it,
    /// so only its peers and lists go; a later request handshakes again.
    pub(super) fn close_unneeded(&mut self, busy: &[String], now: Duration) {
        for e in busy {
            if let Some(conn) = self.book.connection_mut(e) {
                conn.used = now;
            }
        }
        let idle = self.config.idle_engine_timeout;
        let closing: Vec<(String, &'static str)> = self
            .book
            .connections()
            .filter(|(id, _)| !busy.contains(id) && !self.book.has_queued(id))
            .filter_map(|(id, c)| {
                if c.ranks.values().any(|r| self.transport.peer_failed(r.peer)) {
                    return Some((id.clone(), "a rank failed"));
                }
                (now.saturating_sub(c.used) >= idle).then(|| (id.clone(), "idle"))
            })
            .collect();
        for (id, why) in closing {
            if let Some(conn) = self.book.close(&id) {
                for r in conn.ranks.into_values() {
                    self.forget_rank(&r);
                }
            }
            self.handshakes.instances.retain(|(e, _), _| *e != id);
            self.metrics.closed_connections.tally(1);
            tracing::info!(engine = %id, reason = why, "closed the connection to a prefill engine no request needs: the next load handshakes again");
        }
    }
    /// Records the instance each rank named; a new one under a known (engine, rank) is a
    /// restart, counted and logged.
    pub(super) fn note_instances(&mut self, engine_id: &str, ranks: &HashMap<u32, RemoteRank>) {
        for (&rank, r) in ranks {
            let Some(instance) = r.instance else {
                continue;
            };
            let key = (engine_id.to_string(), rank);
            if let Some(old) = self.handshakes.instances.insert(key, instance) {
                if old != instance {
                    self.metrics.peer_restarts.tally(1);
                    tracing::info!(engine = %engine_id, rank, "prefill engine restarted (new instance): connected to the new one");
                }
            }
        }
    }
}

/// A prefill's side channel, and the agent that asks it (named in each request, so the
/// prefill accepts its notes).
struct Remote<'a> {
    host: &'a str,
    port: u16,
    reader: &'a str,
    /// The engine the request names: every rank that answers must be it.
    engine_id: &'a str,
}

impl Remote<'_> {
    /// `meta` if it comes from the engine asked for: another engine at that address (a
    /// stale or misrouted reference, or one engine's ranks answering for another's) must
    /// not be read as this one.
    fn expect(
        &self,
        port: u16,
        meta: crate::wire::handshake::HandshakeMeta,
    ) -> Result<crate::wire::handshake::HandshakeMeta, String> {
        if meta.engine_id != self.engine_id {
            return Err(format!(
                "the prefill at {}:{port} is engine {:?}, the request names {:?}",
                self.host, meta.engine_id, self.engine_id
            ));
        }
        Ok(meta)
    }
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
) -> Result<(u32, Vec<(u32, Fetched)>), String> {
    let (host, port) = (at.host, at.port);
    let first = fetch_metadata_for(host, port, at.engine_id, 0, at.reader, timeout, limit)
        .map_err(|e| e.to_string())?;
    let first = at.expect(port, first)?;
    let remote_tp =
        u32::try_from(first.tp_size).map_err(|_| "remote tp_size exceeds u32".to_string())?;
    let mapping = TpMapping::new(remote_tp, my_tp, sharding).map_err(|e| e.to_string())?;
    let ranks = prefill_ranks(&mapping, my_rank)?;
    let mut metas = Vec::with_capacity(ranks.len());
    for r in ranks {
        if r == 0 {
            metas.push((0, kvxfer_peer(first.clone())));
            continue;
        }
        let p = u32::from(port)
            .checked_add(r)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| format!("port of prefill rank {r} exceeds 65535"))?;
        let meta = fetch_metadata_for(host, p, at.engine_id, r, at.reader, timeout, limit)
            .map_err(|e| e.to_string())?;
        metas.push((r, kvxfer_peer(at.expect(p, meta)?)));
    }
    Ok((remote_tp, metas))
}

fn kvxfer_peer(meta: crate::wire::handshake::HandshakeMeta) -> Fetched {
    Fetched {
        meta,
        native: None,
        clock_offset: None,
    }
}

/// KV cache groups as a mismatch names them (`one` for a single group; a state group's
/// layers followed by `state`).
fn groups_name(groups: Option<&LayerGroups>) -> String {
    let Some(g) = groups else {
        return "one".to_string();
    };
    let each: Vec<String> = g
        .as_slice()
        .iter()
        .enumerate()
        .map(|(i, layers)| {
            let mark = if g.is_state(i) { " state" } else { "" };
            format!("{layers:?}{mark}")
        })
        .collect();
    format!("[{}]", each.join(", "))
}
