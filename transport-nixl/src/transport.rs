//! The NIXL transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer_core::transport::checks::{PreparedLists, check_pairs, new_region, within};
use kvxfer_core::transport::{Deregister, Registration, RegistrationId};
use kvxfer_core::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Transport,
    TransportError, TransportResult, XferId, XferStatus, XferTelemetry,
};
use std::ffi::c_int;

use crate::agent::{
    Agent, AgentSettings, Backend, DescList, OptArgs, Prepared, Registered, Request,
};
use crate::capi::{self, Api};
use crate::{INSTALL_HINT, metadata};

/// Settings of a NIXL agent.
#[derive(Debug, Clone)]
pub struct NixlConfig {
    /// Backend plugin (UCX by default).
    pub backend: String,
    /// Most descriptors per list or transfer.
    pub max_descriptors: usize,
    /// Largest notification.
    pub max_notification_len: usize,
    /// Start NIXL's progress thread, as NIXL's Python agent does by default: transfers and
    /// notifications progress without polling (over TCP the target side needs it), at the
    /// cost of a thread waking every `progress_delay_us`. `KVXFER_NIXL_PROGRESS_THREAD=0`
    /// turns it off.
    pub progress_thread: bool,
    /// Sleep of the progress thread between rounds, in microseconds.
    pub progress_delay_us: u64,
    /// Ask NIXL to measure every transfer (post time, transfer time, bytes, descriptors);
    /// the connectors add the figures to their metrics. `KVXFER_NIXL_TELEMETRY=0` turns it off.
    pub telemetry: bool,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            backend: "UCX".into(),
            max_descriptors: 1 << 22,
            max_notification_len: 64 << 10,
            progress_thread: std::env::var("KVXFER_NIXL_PROGRESS_THREAD")
                .map_or(true, |v| v != "0"),
            progress_delay_us: 50,
            telemetry: std::env::var("KVXFER_NIXL_TELEMETRY").map_or(true, |v| v != "0"),
        }
    }
}

fn mem_type(kind: MemoryKind) -> c_int {
    match kind {
        MemoryKind::Host => capi::MEM_DRAM,
        MemoryKind::Gpu { .. } => capi::MEM_VRAM,
    }
}

fn dev(kind: MemoryKind) -> u64 {
    match kind {
        MemoryKind::Host => 0,
        MemoryKind::Gpu { device } => device.into(),
    }
}

fn backend_err(what: &str, e: crate::agent::Error) -> TransportError {
    TransportError::Backend(format!("NIXL {what}: {e}"))
}

/// Registered regions, shared with the registration guards.
#[derive(Default)]
struct Regions {
    handles: Mutex<HashMap<u64, (MemoryKind, AddrRange, Registered)>>,
}

impl Deregister for Regions {
    fn deregister(&self, id: RegistrationId) {
        // Dropping the registration deregisters the memory.
        let removed = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id.0);
        drop(removed);
    }
}

impl Regions {
    /// The first of `ranges` no region of `kind` contains (one lock for the whole list).
    fn first_outside(&self, kind: MemoryKind, ranges: &[AddrRange]) -> Option<AddrRange> {
        let h = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        ranges
            .iter()
            .find(|r| {
                !h.values()
                    .any(|(k, range, _)| *k == kind && range.contains(r))
            })
            .copied()
    }

    fn list(&self) -> Vec<(MemoryKind, AddrRange)> {
        let h = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        h.values().map(|(k, r, _)| (*k, *r)).collect()
    }
}

struct Peer {
    name: String,
    advertised: Vec<(MemoryKind, AddrRange)>,
}

struct Xfer {
    req: Option<Request>,
    failed: Option<String>,
}

/// A list NIXL prepared (`prepXferDlist`): indexed posts build their request from it with
/// no per-descriptor lookup, NIXL's fast path.
struct NativeList {
    peer: Option<PeerId>,
    handle: Prepared,
}

/// One NIXL agent.
pub struct NixlTransport {
    api: &'static Api,
    agent: Agent,
    backend: Backend,
    name: String,
    config: NixlConfig,
    regions: Arc<Regions>,
    peers: HashMap<PeerId, Peer>,
    lists: PreparedLists,
    native: HashMap<DescListId, NativeList>,
    xfers: HashMap<XferId, Xfer>,
    next_id: u64,
}

impl NixlTransport {
    /// A new agent with the default backend (UCX).
    pub fn new(name: &str) -> TransportResult<Self> {
        Self::with_config(name, NixlConfig::default())
    }

    /// A new agent with explicit settings. Fails with `NotAvailable` (never aborts) when the
    /// runtime is missing, and lists the available backends when the asked one is not.
    pub fn with_config(name: &str, config: NixlConfig) -> TransportResult<Self> {
        let api = capi::api().map_err(|reason| TransportError::NotAvailable {
            what: "the NIXL runtime".into(),
            reason: format!("{reason}; {INSTALL_HINT}"),
        })?;
        // Always the configured constructor: the plain one starts the progress thread
        // whatever was asked.
        let settings = AgentSettings {
            progress_thread: config.progress_thread,
            progress_delay_us: config.progress_delay_us,
            telemetry: config.telemetry,
        };
        let agent =
            Agent::new(api, name, settings).map_err(|e| backend_err("agent creation", e))?;
        let plugins = agent.plugins().unwrap_or_default();
        if !plugins.contains(&config.backend) {
            return Err(TransportError::NotAvailable {
                what: format!("NIXL backend {:?}", config.backend),
                reason: format!(
                    "available backends: {plugins:?} (set NIXL_PLUGIN_DIR; {INSTALL_HINT})"
                ),
            });
        }
        let backend = agent
            .create_backend(&config.backend)
            .map_err(|e| backend_err("backend creation", e))?;
        Ok(NixlTransport {
            api,
            agent,
            backend,
            name: name.to_string(),
            config,
            regions: Arc::default(),
            peers: HashMap::new(),
            lists: PreparedLists::default(),
            native: HashMap::new(),
            xfers: HashMap::new(),
            next_id: 1,
        })
    }

    fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn check_count(&self, what: &'static str, count: usize) -> TransportResult<()> {
        within(what, count, self.config.max_descriptors)
    }

    fn check_local(&self, kind: MemoryKind, ranges: &[AddrRange]) -> TransportResult<()> {
        match self.regions.first_outside(kind, ranges) {
            Some(r) => Err(TransportError::OutOfBounds {
                addr: r.addr,
                len: r.len,
                kind,
                whose: "locally",
            }),
            None => Ok(()),
        }
    }

    fn check_remote(
        &self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<&Peer> {
        let p = self
            .peers
            .get(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        for r in ranges {
            if !p
                .advertised
                .iter()
                .any(|(k, a)| *k == kind && a.contains(r))
            {
                return Err(TransportError::OutOfBounds {
                    addr: r.addr,
                    len: r.len,
                    kind,
                    whose: "by the peer",
                });
            }
        }
        Ok(p)
    }

    fn opt_args(&self, notification: Option<&[u8]>) -> TransportResult<OptArgs> {
        match notification {
            None => OptArgs::new(self.api, self.backend).map_err(|e| backend_err("options", e)),
            Some(n) => {
                within(
                    "notification bytes",
                    n.len(),
                    self.config.max_notification_len,
                )?;
                OptArgs::with_notification(self.api, self.backend, n)
                    .map_err(|e| backend_err("notification", e))
            }
        }
    }

    fn submit(
        &mut self,
        op: Op,
        peer_name: &str,
        kinds: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        let args = self.opt_args(notification)?;
        let id = XferId(self.next());
        if local.is_empty() {
            // NIXL refuses empty transfers: deliver the notification alone, as "done".
            if let Some(n) = notification {
                self.agent
                    .notify(peer_name, n, self.backend)
                    .map_err(|e| backend_err("notification", e))?;
            }
            self.xfers.insert(
                id,
                Xfer {
                    req: None,
                    failed: None,
                },
            );
            return Ok(id);
        }
        let l = desc_list(self.api, kinds.0, local)?;
        let r = desc_list(self.api, kinds.1, remote)?;
        let req = self
            .agent
            .create_request(xfer_op(op), &l, &r, peer_name, &args)
            .map_err(|e| backend_err("transfer creation", e))?;
        Ok(self.launch(id, req, &args))
    }

    /// Posts a created request and records it under `id`; a post error makes it `Failed`.
    fn launch(&mut self, id: XferId, req: Request, args: &OptArgs) -> XferId {
        let failed = match self.agent.post(&req, args) {
            Ok(_) => None,
            Err(e) => Some(format!("NIXL post failed: {e}")),
        };
        self.xfers.insert(
            id,
            Xfer {
                req: Some(req),
                failed,
            },
        );
        id
    }

    /// Hands a checked list to NIXL's `prepXferDlist` ("" = this agent's own memory).
    fn prepare_native(
        &mut self,
        id: DescListId,
        kind: MemoryKind,
        ranges: &[AddrRange],
        peer: Option<PeerId>,
    ) -> TransportResult<()> {
        if ranges.is_empty() {
            // NIXL refuses empty lists; posts from one are empty and never reach NIXL.
            return Ok(());
        }
        // NIXL names a local list's owner "" (NIXL_INIT_AGENT), a remote one by its agent.
        let owner = match peer {
            Some(p) => self
                .peers
                .get(&p)
                .ok_or(TransportError::UnknownPeer(p))?
                .name
                .clone(),
            None => String::new(),
        };
        let list = desc_list(self.api, kind, ranges)?;
        let handle = self
            .agent
            .prepare(&owner, &list, self.backend)
            .map_err(|e| backend_err("list preparation", e))?;
        self.native.insert(id, NativeList { peer, handle });
        Ok(())
    }
}

fn xfer_op(op: Op) -> c_int {
    match op {
        Op::Read => capi::OP_READ,
        Op::Write => capi::OP_WRITE,
    }
}

/// A NIXL descriptor list of `ranges`.
fn desc_list(
    api: &'static Api,
    kind: MemoryKind,
    ranges: &[AddrRange],
) -> TransportResult<DescList> {
    let err = |e| backend_err("descriptor list", e);
    let mut l = DescList::new(api, mem_type(kind)).map_err(err)?;
    for a in ranges {
        l.push(api, a.addr, a.len, dev(kind)).map_err(err)?;
    }
    Ok(l)
}

impl Transport for NixlTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            host_memory: true,
            // VRAM needs a CUDA-enabled backend and device; not probed here yet.
            gpu_memory: false,
            read: true,
            write: true,
            notifications: true,
            max_descriptors: self.config.max_descriptors,
            max_notification_len: self.config.max_notification_len,
            detects_peer_deregistration: false,
        }
    }

    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration> {
        if let MemoryKind::Gpu { .. } = kind {
            return Err(TransportError::NotAvailable {
                what: "GPU memory on the NIXL transport".into(),
                reason: "not supported by this build yet".into(),
            });
        }
        new_region(range, self.regions.list().into_iter().map(|(_, r)| r))?;
        let handle = self
            .agent
            .register(
                mem_type(kind),
                range.addr,
                range.len,
                dev(kind),
                self.backend,
            )
            .map_err(|e| backend_err("registration", e))?;
        let id = self.next();
        self.regions
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (kind, range, handle));
        let owner: Arc<Regions> = Arc::clone(&self.regions);
        Ok(Registration::new(RegistrationId(id), kind, range, owner))
    }

    fn metadata(&self) -> TransportResult<Vec<u8>> {
        let nixl = self
            .agent
            .local_metadata()
            .map_err(|e| backend_err("metadata", e))?;
        Ok(metadata::encode(&self.name, &self.regions.list(), &nixl))
    }

    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId> {
        let metadata::Decoded {
            name,
            regions: advertised,
            nixl,
        } = metadata::decode(metadata).map_err(TransportError::InvalidMetadata)?;
        if let Some((&id, _)) = self.peers.iter().find(|(_, p)| p.name == name) {
            // Same name: a restart or a refresh. Drop the old one and its lists.
            self.remove_peer(id)?;
        }
        let loaded = self.agent.load_remote(nixl).map_err(|e| {
            TransportError::InvalidMetadata(format!("NIXL refused the metadata: {e}"))
        })?;
        if loaded != name {
            return Err(TransportError::InvalidMetadata(format!(
                "metadata names {name:?} but NIXL loaded {loaded:?}"
            )));
        }
        let id = PeerId(self.next());
        self.peers.insert(id, Peer { name, advertised });
        Ok(id)
    }

    fn native_metadata(&self) -> TransportResult<Vec<u8>> {
        self.agent
            .local_metadata()
            .map_err(|e| backend_err("metadata", e))
    }

    fn load_native_peer(
        &mut self,
        metadata: &[u8],
        regions: &[(MemoryKind, AddrRange)],
    ) -> TransportResult<PeerId> {
        if regions.len() > metadata::MAX_REGIONS {
            return Err(TransportError::InvalidMetadata(format!(
                "{} regions advertised",
                regions.len()
            )));
        }
        for (kind, r) in regions {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(TransportError::InvalidMetadata(format!(
                    "advertised region {:#x}+{} ({kind}) is empty or wraps",
                    r.addr, r.len
                )));
            }
        }
        let name = self.agent.load_remote(metadata).map_err(|e| {
            TransportError::InvalidMetadata(format!("NIXL refused the peer's metadata: {e}"))
        })?;
        if let Some((&old, _)) = self.peers.iter().find(|(_, p)| p.name == name) {
            // The same agent again (its name is unique per process): NIXL replaced its
            // metadata; lists prepared against the old load go.
            self.peers.remove(&old);
            self.lists.forget_peer(old);
            self.native.retain(|_, l| l.peer != Some(old));
        }
        let id = PeerId(self.next());
        self.peers.insert(
            id,
            Peer {
                name,
                advertised: regions.to_vec(),
            },
        );
        Ok(id)
    }

    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()> {
        let p = self
            .peers
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        self.lists.forget_peer(peer);
        // Prepared handles go before NIXL forgets the metadata they point into.
        self.native.retain(|_, l| l.peer != Some(peer));
        let _ = self.agent.invalidate_remote(&p.name);
        Ok(())
    }

    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.check_count("descriptors in list", ranges.len())?;
        self.check_local(kind, ranges)?;
        let id = DescListId(self.next());
        self.prepare_native(id, kind, ranges, None)?;
        Ok(self.lists.insert(id, kind, ranges, None))
    }

    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.check_count("descriptors in list", ranges.len())?;
        self.check_remote(peer, kind, ranges)?;
        let id = DescListId(self.next());
        self.prepare_native(id, kind, ranges, Some(peer))?;
        Ok(self.lists.insert(id, kind, ranges, Some(peer)))
    }

    fn release_list(&mut self, list: DescListId) -> TransportResult<()> {
        self.lists.release(list)?;
        self.native.remove(&list);
        Ok(())
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
        // Our own checks first (lists, sides, index range, lengths), then NIXL builds the
        // request from its prepared handles by index.
        let x = self
            .lists
            .resolve((local, local_idx), (remote, remote_idx))?;
        self.check_count("descriptors in transfer", x.local.len())?;
        let peer_name = self
            .peers
            .get(&x.peer)
            .ok_or(TransportError::UnknownPeer(x.peer))?
            .name
            .clone();
        let (Some(l), Some(r)) = (self.native.get(&local), self.native.get(&remote)) else {
            // Empty lists have no NIXL handle: the transfer is empty too.
            return self.submit(op, &peer_name, x.kinds, &[], &[], notification);
        };
        // NIXL takes C ints: an index past i32::MAX (a list that long) is refused.
        let as_c = |idx: &[u32]| -> TransportResult<Vec<c_int>> {
            idx.iter()
                .map(|&i| {
                    c_int::try_from(i).map_err(|_| TransportError::TooLarge {
                        what: "descriptor index",
                        count: i as usize,
                        limit: c_int::MAX as usize,
                    })
                })
                .collect()
        };
        let (local_c, remote_c) = (as_c(local_idx)?, as_c(remote_idx)?);
        let args = self.opt_args(notification)?;
        let req = self
            .agent
            .make_request(
                xfer_op(op),
                &l.handle,
                &local_c,
                &r.handle,
                &remote_c,
                &args,
            )
            .map_err(|e| backend_err("indexed transfer creation", e))?;
        let id = XferId(self.next());
        Ok(self.launch(id, req, &args))
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
        check_pairs(local, remote)?;
        self.check_count("descriptors in transfer", local.len())?;
        self.check_local(kinds.0, local)?;
        let name = self.check_remote(peer, kinds.1, remote)?.name.clone();
        self.submit(op, &name, kinds, local, remote, notification)
    }

    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus> {
        let x = self
            .xfers
            .get_mut(&xfer)
            .ok_or(TransportError::UnknownTransfer(xfer))?;
        if let Some(e) = &x.failed {
            return Ok(XferStatus::Failed(e.clone()));
        }
        let Some(req) = &x.req else {
            return Ok(XferStatus::Done);
        };
        match self.agent.done(req) {
            Ok(true) => Ok(XferStatus::Done),
            Ok(false) => Ok(XferStatus::InProgress),
            Err(e) => {
                let reason = format!("NIXL transfer error: {e}");
                x.failed = Some(reason.clone());
                Ok(XferStatus::Failed(reason))
            }
        }
    }

    fn release(&mut self, xfer: XferId) -> TransportResult<()> {
        // Dropping the request releases it in NIXL (aborting it if still in flight).
        self.xfers
            .remove(&xfer)
            .map(|_| ())
            .ok_or(TransportError::UnknownTransfer(xfer))
    }

    fn prefers_prepared_lists(&self) -> bool {
        // makeXferReq by index skips the per-descriptor registration lookup createXferReq
        // does: about half the build time for 8192 descriptors (benches/nixl_post).
        true
    }

    fn telemetry(&mut self, xfer: XferId) -> Option<XferTelemetry> {
        if !self.config.telemetry {
            return None;
        }
        let req = self.xfers.get(&xfer)?.req.as_ref()?;
        let t = self.agent.telemetry(req).ok()?;
        Some(XferTelemetry {
            post: Duration::from_micros(t.post_duration_us),
            transfer: Duration::from_micros(t.xfer_duration_us),
            bytes: t.total_bytes,
            descriptors: t.desc_count,
        })
    }

    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()> {
        within(
            "notification bytes",
            message.len(),
            self.config.max_notification_len,
        )?;
        let p = self
            .peers
            .get(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        self.agent
            .notify(&p.name, message, self.backend)
            .map_err(|e| backend_err("notification", e))
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize> {
        let got = self
            .agent
            .notifications()
            .map_err(|e| backend_err("notifications", e))?;
        let n = got.len();
        out.extend(
            got.into_iter()
                .map(|(from, message)| Notification { from, message }),
        );
        Ok(n)
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // Requests before registrations before the agent.
        self.xfers.clear();
        self.native.clear();
        self.lists.clear();
    }
}
