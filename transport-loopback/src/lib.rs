//! # kvxfer-transport-loopback
//!
//! An in-process transport: two or more agents in one process find each other through the
//! metadata bytes and move host memory with memcpy on a small copy-worker pool, so completion
//! is asynchronous and status polling matters as it does on a real network. GPU memory is
//! behind the `cuda` feature. [`Faults`] injects failures deterministically for tests.
#![warn(missing_docs)]

mod agent;
#[cfg(feature = "cuda")]
mod cuda;
mod faults;
mod metadata;
mod pool;
mod xfer;

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use kvxfer_core::transport::checks::{self, check_pairs};
use kvxfer_core::transport::{Registration, RegistrationId};
use kvxfer_core::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Transport,
    TransportError, TransportResult, XferId, XferStatus,
};

use agent::{AgentShared, Pin};
pub use faults::Faults;
pub use metadata::{AgentMetadata, MAX_NAME_LEN, MAX_REGIONS};
use pool::{CopyPool, Job, Split};
use xfer::{CopyPair, PendingNotification, XferState};

/// How long `release` waits for the copies of a transfer it cancels.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Settings of a loopback agent.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    /// Copy worker threads (at least 1).
    pub workers: usize,
    /// Most descriptors per list or transfer.
    pub max_descriptors: usize,
    /// Largest notification message.
    pub max_notification_len: usize,
    /// A transfer is split into jobs of at least this many bytes.
    pub min_job_bytes: u64,
    /// Answer `prefers_prepared_lists` with true, as NIXL does, so that connectors take
    /// their prepared-list path (and tests can run it without NIXL).
    pub prefer_prepared_lists: bool,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
            max_descriptors: 1 << 22,
            max_notification_len: 64 << 10,
            min_job_bytes: 1 << 20,
            prefer_prepared_lists: false,
        }
    }
}

/// A prepared list plus the distinct regions its ranges lie in (pinned when posted).
#[derive(Debug)]
struct PreparedList {
    list: checks::PreparedList,
    regions: Vec<AddrRange>,
}

#[derive(Debug)]
struct Peer {
    uid: u64,
    name: String,
    advertised: Vec<(MemoryKind, AddrRange)>,
    agent: Weak<AgentShared>,
}

/// One loopback agent.
pub struct LoopbackTransport {
    shared: Arc<AgentShared>,
    pool: CopyPool,
    config: LoopbackConfig,
    faults: Faults,
    peers: HashMap<PeerId, Peer>,
    lists: HashMap<DescListId, PreparedList>,
    xfers: HashMap<XferId, Arc<XferState>>,
    next_id: u64,
}

impl LoopbackTransport {
    /// A new agent named `name` with default settings.
    pub fn new(name: &str) -> TransportResult<Self> {
        Self::with_config(name, LoopbackConfig::default())
    }

    /// A new agent with explicit settings.
    pub fn with_config(name: &str, config: LoopbackConfig) -> TransportResult<Self> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(TransportError::InvalidRegistration(format!(
                "agent name must be 1..={MAX_NAME_LEN} bytes"
            )));
        }
        let shared = AgentShared::new(name);
        let pool = CopyPool::new(config.workers, name)
            .map_err(|e| TransportError::Backend(format!("cannot start copy workers: {e}")))?;
        Ok(LoopbackTransport {
            faults: Faults::new(Arc::clone(&shared)),
            shared,
            pool,
            config,
            peers: HashMap::new(),
            lists: HashMap::new(),
            xfers: HashMap::new(),
            next_id: 1,
        })
    }

    /// The fault injector of this agent.
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    /// Number of transfers not yet released (for leak checks in tests).
    pub fn open_transfers(&self) -> usize {
        self.xfers.len()
    }

    /// Live resources `(peers, prepared lists, transfers, registered regions)`, so tests can
    /// check that a user released exactly what it created.
    pub fn resource_counts(&self) -> (usize, usize, usize, usize) {
        (
            self.peers.len(),
            self.lists.len(),
            self.xfers.len(),
            self.shared.regions().len(),
        )
    }

    fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn check_kind(&self, kind: MemoryKind) -> TransportResult<()> {
        match kind {
            MemoryKind::Host => Ok(()),
            MemoryKind::Gpu { device } => check_gpu(device),
        }
    }

    fn check_count(&self, what: &'static str, count: usize) -> TransportResult<()> {
        checks::within(what, count, self.config.max_descriptors)
    }

    /// Distinct local regions containing `ranges`, or the first range outside them.
    fn local_regions(
        &self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<Vec<AddrRange>> {
        let mut regions: Vec<AddrRange> = Vec::new();
        for r in ranges {
            if regions.last().is_some_and(|last| last.contains(r)) {
                continue;
            }
            let region = self
                .shared
                .find(kind, r)
                .ok_or(TransportError::OutOfBounds {
                    addr: r.addr,
                    len: r.len,
                    kind,
                    whose: "locally",
                })?;
            if !regions.contains(&region.range) {
                regions.push(region.range);
            }
        }
        Ok(regions)
    }

    fn remote_regions(
        &self,
        peer: &Peer,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<Vec<AddrRange>> {
        let mut regions: Vec<AddrRange> = Vec::new();
        for r in ranges {
            if regions.last().is_some_and(|last| last.contains(r)) {
                continue;
            }
            let at = peer.advertised.partition_point(|(_, a)| a.addr <= r.addr);
            let found = at
                .checked_sub(1)
                .map(|i| peer.advertised[i])
                .filter(|(k, a)| *k == kind && a.contains(r));
            let (_, region) = found.ok_or(TransportError::OutOfBounds {
                addr: r.addr,
                len: r.len,
                kind,
                whose: "by the peer",
            })?;
            if !regions.contains(&region) {
                regions.push(region);
            }
        }
        Ok(regions)
    }

    fn peer(&self, id: PeerId) -> TransportResult<&Peer> {
        self.peers.get(&id).ok_or(TransportError::UnknownPeer(id))
    }

    /// Builds, pins and queues a transfer whose ranges were already validated.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        op: Op,
        peer_id: PeerId,
        kinds: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        regions: (&[AddrRange], &[AddrRange]),
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        if let Some(n) = notification {
            self.check_notification(n)?;
        }
        let peer = self.peer(peer_id)?;
        let (agent, name) = (peer.agent.upgrade(), peer.name.clone());
        if self.faults.take_refusal() {
            return Err(TransportError::Backend("injected post refusal".into()));
        }
        let id = XferId(self.next());
        if self.faults.take_failure() {
            self.xfers
                .insert(id, XferState::failed("injected transfer failure".into()));
            return Ok(id);
        }
        let Some(agent) = agent.filter(|a| a.is_alive()) else {
            self.xfers
                .insert(id, XferState::failed(format!("peer {name:?} is gone")));
            return Ok(id);
        };
        // Pin every region the copies touch; a region deregistered since preparation fails
        // the transfer before any byte moves.
        let mut pins: Vec<Pin> = Vec::with_capacity(regions.0.len() + regions.1.len());
        for (owner, kind, list, whose) in [
            (&self.shared, kinds.0, regions.0, "local"),
            (&agent, kinds.1, regions.1, "remote"),
        ] {
            for region in list {
                match owner.find(kind, region).and_then(|r| r.pin()) {
                    Some(pin) => pins.push(pin),
                    None => {
                        let reason = format!(
                            "{whose} region {:#x}+{} was deregistered",
                            region.addr, region.len
                        );
                        self.xfers.insert(id, XferState::failed(reason));
                        return Ok(id);
                    }
                }
            }
        }
        let pairs: Vec<CopyPair> = local
            .iter()
            .zip(remote)
            .map(|(l, r)| match op {
                Op::Read => CopyPair {
                    src: r.addr,
                    dst: l.addr,
                    len: l.len,
                },
                Op::Write => CopyPair {
                    src: l.addr,
                    dst: r.addr,
                    len: l.len,
                },
            })
            .collect();
        let note = notification.map(|m| PendingNotification {
            target: Arc::downgrade(&agent),
            note: Notification {
                from: self.shared.name.clone(),
                message: m.to_vec(),
            },
        });
        let Split { bounds, method } =
            pool::split(&pairs, self.pool.workers(), self.config.min_job_bytes);
        let jobs = bounds.len().max(1);
        let device = match kinds {
            (MemoryKind::Gpu { device }, _) | (_, MemoryKind::Gpu { device }) => Some(device),
            _ => None,
        };
        let x = XferState::new(
            pairs,
            device,
            jobs,
            pins,
            note,
            Arc::downgrade(&agent),
            self.faults.clone(),
        );
        if bounds.is_empty() {
            x.job_done();
        }
        for (start, end) in bounds {
            self.pool.submit(Job {
                xfer: Arc::clone(&x),
                start,
                end,
                method,
            });
        }
        self.xfers.insert(id, x);
        Ok(id)
    }

    fn check_notification(&self, message: &[u8]) -> TransportResult<()> {
        checks::within(
            "notification bytes",
            message.len(),
            self.config.max_notification_len,
        )
    }
}

/// GPU memory is usable when built with `cuda` and a driver and the device exist.
fn check_gpu(device: u32) -> TransportResult<()> {
    let unavailable = |reason: String| TransportError::NotAvailable {
        what: format!("GPU memory (device {device}) on the loopback transport"),
        reason,
    };
    #[cfg(feature = "cuda")]
    {
        match cuda::available() {
            Ok(count) if device < count => Ok(()),
            Ok(count) => Err(unavailable(format!(
                "this machine has {count} CUDA device(s)"
            ))),
            Err(reason) => Err(unavailable(reason)),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(unavailable("built without the `cuda` feature".into()))
    }
}

fn gpu_supported() -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::available().is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        // Peers' transfers to us fail from now on; queued copies finish before the pool joins.
        self.shared.vanish();
    }
}

impl Transport for LoopbackTransport {
    fn prefers_prepared_lists(&self) -> bool {
        self.config.prefer_prepared_lists
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            host_memory: true,
            gpu_memory: gpu_supported(),
            read: true,
            write: true,
            notifications: true,
            max_descriptors: self.config.max_descriptors,
            max_notification_len: self.config.max_notification_len,
            detects_peer_deregistration: true,
        }
    }

    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration> {
        self.check_kind(kind)?;
        let id = self.next();
        self.shared.add_region(id, kind, range)?;
        let owner: Arc<AgentShared> = Arc::clone(&self.shared);
        Ok(Registration::new(RegistrationId(id), kind, range, owner))
    }

    fn metadata(&self) -> TransportResult<Vec<u8>> {
        Ok(AgentMetadata {
            name: self.shared.name.clone(),
            uid: self.shared.uid,
            regions: self.shared.regions(),
        }
        .encode())
    }

    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId> {
        let meta = AgentMetadata::decode(metadata)?;
        let agent = AgentShared::lookup(meta.uid)
            .ok_or_else(|| TransportError::PeerGone(meta.name.clone()))?;
        if agent.name != meta.name {
            return Err(TransportError::InvalidMetadata(format!(
                "agent {} is named {:?}, metadata says {:?}",
                meta.uid, agent.name, meta.name
            )));
        }
        let existing = self
            .peers
            .iter()
            .find(|(_, p)| p.name == meta.name)
            .map(|(id, p)| (*id, p.uid));
        if let Some((id, uid)) = existing {
            if uid == meta.uid {
                // Same instance: refresh what it advertises, keep the id and lists.
                if let Some(p) = self.peers.get_mut(&id) {
                    p.advertised = sorted(meta.regions);
                }
                return Ok(id);
            }
            // A restarted peer replaces the old one and everything prepared for it.
            self.remove_peer(id)?;
        }
        let id = PeerId(self.next());
        self.peers.insert(
            id,
            Peer {
                uid: meta.uid,
                name: meta.name,
                advertised: sorted(meta.regions),
                agent: Arc::downgrade(&agent),
            },
        );
        Ok(id)
    }

    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()> {
        self.peers
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        self.lists.retain(|_, l| l.list.peer != Some(peer));
        Ok(())
    }

    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.check_kind(kind)?;
        self.check_count("descriptors in list", ranges.len())?;
        let regions = self.local_regions(kind, ranges)?;
        let id = DescListId(self.next());
        self.lists.insert(
            id,
            PreparedList {
                list: checks::PreparedList {
                    kind,
                    ranges: ranges.to_vec(),
                    peer: None,
                },
                regions,
            },
        );
        Ok(id)
    }

    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.check_kind(kind)?;
        self.check_count("descriptors in list", ranges.len())?;
        let regions = self.remote_regions(self.peer(peer)?, kind, ranges)?;
        let id = DescListId(self.next());
        self.lists.insert(
            id,
            PreparedList {
                list: checks::PreparedList {
                    kind,
                    ranges: ranges.to_vec(),
                    peer: Some(peer),
                },
                regions,
            },
        );
        Ok(id)
    }

    fn release_list(&mut self, list: DescListId) -> TransportResult<()> {
        self.lists
            .remove(&list)
            .map(|_| ())
            .ok_or(TransportError::UnknownList(list))
    }

    fn post_indexed(
        &mut self,
        op: Op,
        local: DescListId,
        local_idx: &[u32],
        remote: DescListId,
        remote_idx: &[u32],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        self.check_count("descriptors in transfer", local_idx.len())?;
        let lists = &self.lists;
        let x = checks::resolve_indexed(
            |id| lists.get(&id).map(|l| &l.list),
            (local, local_idx),
            (remote, remote_idx),
        )?;
        // Both lists exist: resolve_indexed found them.
        let region_of = |id| {
            lists
                .get(&id)
                .map(|l| l.regions.clone())
                .unwrap_or_default()
        };
        let (lreg, rreg) = (region_of(local), region_of(remote));
        self.submit(
            op,
            x.peer,
            x.kinds,
            &x.local,
            &x.remote,
            (&lreg, &rreg),
            notification,
        )
    }

    fn post(
        &mut self,
        op: Op,
        peer: PeerId,
        kinds: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        self.check_kind(kinds.0)?;
        self.check_kind(kinds.1)?;
        if local.len() != remote.len() {
            return Err(TransportError::Mismatch(format!(
                "{} local ranges, {} remote ranges",
                local.len(),
                remote.len()
            )));
        }
        self.check_count("descriptors in transfer", local.len())?;
        check_pairs(local, remote)?;
        let lreg = self.local_regions(kinds.0, local)?;
        let rreg = self.remote_regions(self.peer(peer)?, kinds.1, remote)?;
        self.submit(op, peer, kinds, local, remote, (&lreg, &rreg), notification)
    }

    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus> {
        self.xfers
            .get(&xfer)
            .map(|x| x.status())
            .ok_or(TransportError::UnknownTransfer(xfer))
    }

    fn release(&mut self, xfer: XferId) -> TransportResult<()> {
        let x = self
            .xfers
            .remove(&xfer)
            .ok_or(TransportError::UnknownTransfer(xfer))?;
        // A transfer still copying is cancelled and waited for: the caller may report its
        // destination invalid and reuse it, so no copy may land afterwards. Copies past the
        // bound keep their regions pinned, so forgetting the id stays memory-safe.
        if !x.cancel(RELEASE_WAIT) {
            tracing::error!(%xfer, "copies still running {RELEASE_WAIT:?} after release");
        }
        Ok(())
    }

    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()> {
        self.check_notification(message)?;
        let p = self.peer(peer)?;
        let agent = p
            .agent
            .upgrade()
            .filter(|a| a.is_alive())
            .ok_or_else(|| TransportError::PeerGone(p.name.clone()))?;
        for _ in 0..self.faults.notification_copies() {
            agent.deliver(Notification {
                from: self.shared.name.clone(),
                message: message.to_vec(),
            });
        }
        Ok(())
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize> {
        Ok(self.shared.drain(out))
    }

    fn peer_failed(&self, peer: PeerId) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|p| !p.agent.upgrade().is_some_and(|a| a.is_alive()))
    }
}

fn sorted(mut regions: Vec<(MemoryKind, AddrRange)>) -> Vec<(MemoryKind, AddrRange)> {
    regions.sort_unstable_by_key(|(_, r)| r.addr);
    regions
}
