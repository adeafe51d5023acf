//! The UCX transport: the contract over UCP RMA (`ucp_get_nbx` / `ucp_put_nbx`, one request
//! per descriptor), endpoint flush before a WRITE is reported done, and notifications as
//! eager active messages sent only after the data is complete.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvxfer_core::transport::checks::{check_pairs, new_region, within};
use kvxfer_core::transport::{Deregister, Registration, RegistrationId};
use kvxfer_core::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Transport,
    TransportError, TransportResult, XferId, XferStatus,
};

use crate::UcxConfig;
use crate::metadata::{AgentMeta, RegionMeta};
use crate::same_host::{self, Limits, PeerMaps};
use crate::state::{AM_ID, Health, LocalRegion, Peer, Phase, State, Xfer, encode_notification};
use crate::sys;
use crate::worker::{Ucp, check};

/// The state and the progress thread's stop flag, shared with registration guards.
pub(crate) struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    /// When the owner last polled (µs since `epoch`): the progress thread stays out of the
    /// way while the owner drives the worker itself (on two cores, contending for the lock
    /// cost a third of the bandwidth).
    owner_polled_us: AtomicU64,
    epoch: Instant,
}

/// How long after the owner's last poll the progress thread takes over.
const OWNER_ACTIVE: Duration = Duration::from_millis(2);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// The owner is driving the worker: called from its polling entry points.
    fn owner_polls(&self) {
        self.owner_polled_us.store(self.now_us(), Ordering::Relaxed);
    }

    fn owner_active(&self) -> bool {
        let last = self.owner_polled_us.load(Ordering::Relaxed);
        last != 0 && self.now_us().saturating_sub(last) < OWNER_ACTIVE.as_micros() as u64
    }
}

impl Deregister for Shared {
    fn deregister(&self, id: RegistrationId) {
        let mut st = self.lock();
        if !st.quiesce_region(id.0) {
            // Cancel what still touches the region before its memory may be freed.
            let stuck: Vec<XferId> = st
                .xfers
                .iter()
                .filter(|(_, x)| x.busy() && x.regions.contains(&id.0))
                .map(|(id, _)| *id)
                .collect();
            for x in stuck {
                st.settle(x, Duration::ZERO);
            }
        }
        st.unmap(id.0);
    }
}

/// One UCX agent: a UCP context and worker.
pub struct UcxTransport {
    shared: Arc<Shared>,
    name: String,
    progress: Option<JoinHandle<()>>,
}

impl UcxTransport {
    /// A new agent with settings from the environment (see [`UcxConfig::default`]).
    pub fn new(name: &str) -> TransportResult<Self> {
        Self::with_config(name, UcxConfig::default())
    }

    /// A new agent with explicit settings. UCX itself reads `UCX_*` variables (`UCX_TLS`,
    /// `UCX_NET_DEVICES`, …) as usual.
    pub fn with_config(name: &str, config: UcxConfig) -> TransportResult<Self> {
        if name.is_empty() || name.len() > crate::metadata::MAX_NAME {
            return Err(TransportError::Backend(format!(
                "agent name must be 1..={} bytes",
                crate::metadata::MAX_NAME
            )));
        }
        let mut overrides = vec![
            (
                "KEEPALIVE_INTERVAL",
                format!("{}ms", config.keepalive_interval.as_millis().max(1)),
                false,
            ),
            // Without it, UCX >= 1.19 serves a same-host `ucp_get` by emulation over TCP
            // loopback (0.8 GiB/s here) instead of CMA zero-copy (7 GiB/s); NIXL sets the
            // same. Notifications are small, so eager sends lose nothing.
            ("RNDV_THRESH", "inf".to_string(), false),
        ];
        if let Some(tls) = &config.tls {
            overrides.push(("TLS", tls.clone(), true));
        }
        let ucp = Ucp::new(name, &overrides, config.progress_thread)?;
        let thread = config.progress_thread;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(ucp, name, config)?),
            stop: AtomicBool::new(false),
            owner_polled_us: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        let progress = if thread {
            Some(spawn_progress(Arc::clone(&shared))?)
        } else {
            None
        };
        Ok(UcxTransport {
            shared,
            name: name.to_string(),
            progress,
        })
    }

    /// Notifications refused so far (malformed, too large, or while the inbox was full).
    pub fn dropped_notifications(&self) -> u64 {
        self.shared.lock().inbox.dropped
    }

    /// Transfers this agent started as host copies through a same-host peer's shared memory
    /// (failed ones included).
    pub fn shared_memory_transfers(&self) -> u64 {
        self.lock().shared_transfers
    }

    /// Same-host peers whose shared memory was refused so far: more memfds than
    /// [`UcxConfig::max_peer_mappings`] or [`UcxConfig::max_mappings`] leave room for, or a
    /// memfd another peer has mapped advertised again. Their transfers go through UCX.
    pub fn shared_memory_refusals(&self) -> u64 {
        self.lock().map_refusals
    }

    /// Peers loaded now (each holds an endpoint and its remote keys).
    pub fn peer_count(&self) -> usize {
        self.lock().peers.len()
    }

    /// Memfds of same-host peers mapped here now.
    pub fn shared_memory_mappings(&self) -> usize {
        self.lock().peers.values().map(|p| p.maps.files.len()).sum()
    }

    /// Maps a same-host peer's shared memory where the settings allow; `Err` is a refusal,
    /// logged.
    fn map_peer(&self, meta: &AgentMeta) -> Result<PeerMaps, ()> {
        let (limits, others) = {
            let st = self.lock();
            if !st.config.shared_memory {
                return Ok(PeerMaps::default());
            }
            let limits = Limits {
                per_peer: st.config.max_peer_mappings,
                total: st.config.max_mappings,
            };
            (limits, st.mapped_except(&meta.name))
        };
        PeerMaps::attach(meta, limits, &others).map_err(|why| {
            tracing::warn!(peer = %meta.name, "not mapping a same-host peer's shared memory (its transfers go through UCX): {why}");
        })
    }

    /// Whether `peer`'s memory in kvxfer shared memory is mapped here (a same-host peer),
    /// so transfers on it are host copies.
    pub fn maps_peer(&self, peer: PeerId) -> bool {
        self.lock()
            .peers
            .get(&peer)
            .is_some_and(|p| p.maps.at.iter().any(Option::is_some))
    }

    /// Whether this agent's endpoints detect dead peers: `Some(false)` once UCX chose
    /// transports without peer-failure handling (its shared-memory ones, in 1.13); `None`
    /// before the first peer is loaded.
    pub fn detects_dead_peers(&self) -> Option<bool> {
        self.lock().peer_failure_detection()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }
}

/// The optional progress thread: sleeps on the worker's event descriptor (no busy loop) and
/// progresses when UCX has work, so a target serves emulated RMA (TCP) without being polled.
fn spawn_progress(shared: Arc<Shared>) -> TransportResult<JoinHandle<()>> {
    let efd = {
        let st = shared.lock();
        let mut fd = -1;
        // SAFETY: the worker was created with the WAKEUP feature.
        check("worker_get_efd", unsafe {
            sys::api().ucp_worker_get_efd(st.ucp.worker, &mut fd)
        })?;
        fd
    };
    std::thread::Builder::new()
        .name("kvxfer-ucx-progress".into())
        .spawn(move || {
            while !shared.stop.load(Ordering::Acquire) {
                if shared.owner_active() {
                    std::thread::sleep(OWNER_ACTIVE / 2);
                    continue;
                }
                let armed = {
                    let mut st = shared.lock();
                    st.progress();
                    // SAFETY: live worker, under the lock.
                    unsafe { sys::api().ucp_worker_arm(st.ucp.worker) }
                };
                if armed == sys::ucs_status_t::UCS_OK {
                    let mut pfd = libc::pollfd {
                        fd: efd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd; the timeout bounds how long a stop waits.
                    unsafe { libc::poll(&mut pfd, 1, 20) };
                }
            }
        })
        .map_err(|e| TransportError::Backend(format!("progress thread: {e}")))
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
        // Endpoints close now; the worker lives on while registration guards exist.
        self.lock().shut_down();
    }
}

fn out_of_bounds(r: &AddrRange, kind: MemoryKind, whose: &'static str) -> TransportError {
    TransportError::OutOfBounds {
        addr: r.addr,
        len: r.len,
        kind,
        whose,
    }
}

/// Checks every local range lies in one of our registrations; returns the registrations
/// touched and, per range, the memory handle of its registration.
fn check_local(
    st: &State,
    kind: MemoryKind,
    ranges: &[AddrRange],
) -> TransportResult<(Vec<u64>, Vec<sys::ucp_mem_h>)> {
    let mut ids: Vec<u64> = Vec::new();
    let mut memhs = Vec::with_capacity(ranges.len());
    let mut last: Option<(u64, AddrRange, sys::ucp_mem_h)> = None;
    for r in ranges {
        // Descriptors mostly fall in the region of the one before: check it first.
        let hit = match last {
            Some((id, range, memh)) if range.contains(r) => Some((id, memh)),
            _ => st
                .regions
                .iter()
                .find(|(_, reg)| reg.kind == kind && reg.range.contains(r))
                .map(|(&id, reg)| {
                    last = Some((id, reg.range, reg.memh));
                    (id, reg.memh)
                }),
        };
        let (id, memh) = hit.ok_or_else(|| out_of_bounds(r, kind, "locally"))?;
        memhs.push(memh);
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok((ids, memhs))
}

/// Index into the peer's regions of the one containing `r`.
fn remote_region(p: &Peer, kind: MemoryKind, r: &AddrRange, hint: usize) -> Option<usize> {
    let fits = |i: usize| {
        let (k, range, _) = &p.regions[i];
        *k == kind && range.contains(r)
    };
    if hint < p.regions.len() && fits(hint) {
        return Some(hint);
    }
    (0..p.regions.len()).find(|&i| fits(i))
}

fn check_remote(
    st: &State,
    peer: PeerId,
    kind: MemoryKind,
    ranges: &[AddrRange],
) -> TransportResult<Vec<usize>> {
    let p = st
        .peers
        .get(&peer)
        .ok_or(TransportError::UnknownPeer(peer))?;
    let mut hint = 0;
    ranges
        .iter()
        .map(|r| {
            hint = remote_region(p, kind, r, hint)
                .ok_or_else(|| out_of_bounds(r, kind, "by the peer"))?;
            Ok(hint)
        })
        .collect()
}

fn check_count(st: &State, what: &'static str, count: usize) -> TransportResult<()> {
    within(what, count, st.config.max_descriptors)
}

fn check_notification(st: &State, n: &[u8]) -> TransportResult<()> {
    within(
        "notification bytes",
        n.len(),
        st.config.max_notification_len,
    )
}

fn mem_type(kind: MemoryKind) -> sys::ucs_memory_type_t {
    match kind {
        MemoryKind::Host => sys::ucs_memory_type_UCS_MEMORY_TYPE_HOST,
        MemoryKind::Gpu { .. } => sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA,
    }
}

/// Posts one eager active message carrying `x.notification` on `ep`.
fn send_notification_am(ep: sys::ucp_ep_h, x: &mut Xfer) {
    let Some(buf) = &x.notification else { return };
    let (ptr, len) = (buf.as_ptr(), buf.len());
    let mut param = x.params();
    param.op_attr_mask |= sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = sys::ucp_send_am_flags_UCP_AM_SEND_FLAG_EAGER;
    // SAFETY: the buffer lives in `x` until the request completes; `x` is boxed.
    let r = unsafe {
        sys::api().ucp_am_send_nbx(ep, AM_ID, std::ptr::null(), 0, ptr.cast(), len, &param)
    };
    x.account(r);
}

impl UcxTransport {
    #[allow(clippy::too_many_arguments)]
    fn submit(
        st: &mut State,
        op: Op,
        peer: PeerId,
        kinds: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        check_pairs(local, remote)?;
        check_count(st, "descriptors in transfer", local.len())?;
        if let Some(n) = notification {
            check_notification(st, n)?;
        }
        let (regions, memhs) = check_local(st, kinds.0, local)?;
        let keys = check_remote(st, peer, kinds.1, remote)?;
        let id = XferId(st.next());
        let note = notification.map(|n| encode_notification(&st.name, n));
        let p = st
            .peers
            .get(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        let mut x = Xfer::new(peer, Phase::Data, note, regions);
        let mapped_dead = p.maps.owner_exited();
        if let Some(e) = &p.health.error {
            x.error = Some(format!("peer {:?} is unreachable: {e}", p.name));
        } else if mapped_dead {
            x.error = Some(format!("peer {:?}: its process exited", p.name));
        } else if let Some(c) =
            same_host::start(&mut st.copier, op, kinds, (local, remote), &keys, &p.maps)
        {
            x.copies = Some(c);
            st.shared_transfers += 1;
        } else {
            let mut param = x.params();
            // Our registration's handle and memory type: UCX skips its per-request lookups.
            param.op_attr_mask |= sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMH
                | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type = mem_type(kinds.0);
            for (((l, r), &k), &memh) in local.iter().zip(remote).zip(&keys).zip(&memhs) {
                let rkey = p.regions[k].2;
                param.memh = memh;
                // SAFETY: both ranges were checked against registered memory; the callback
                // target `x` is boxed and kept until its count is zero.
                let ptr = unsafe {
                    match op {
                        Op::Read => sys::api().ucp_get_nbx(
                            p.ep,
                            l.addr as *mut _,
                            l.len as usize,
                            r.addr,
                            rkey,
                            &param,
                        ),
                        Op::Write => sys::api().ucp_put_nbx(
                            p.ep,
                            l.addr as *const _,
                            l.len as usize,
                            r.addr,
                            rkey,
                            &param,
                        ),
                    }
                };
                x.account(ptr);
                if x.error.is_some() {
                    break;
                }
            }
            if op == Op::Write && x.error.is_none() && !local.is_empty() {
                // A put is complete locally before it is visible remotely; the flush
                // completes once every earlier put landed.
                let flush = x.params();
                // SAFETY: as above.
                let ptr = unsafe { sys::api().ucp_ep_flush_nbx(p.ep, &flush) };
                x.account(ptr);
            }
        }
        if mapped_dead {
            forget_dead_maps(st, peer);
        }
        st.xfers.insert(id, x);
        Ok(id)
    }
}

/// A mapped peer's process exited: it is failed (UCX's shared-memory transports may never
/// notice, and a request to it would hang) and its memory unmapped (transfers in flight keep
/// their own references), so a dead engine's cache is not kept alive here.
fn forget_dead_maps(st: &mut State, peer: PeerId) {
    if let Some(p) = st.peers.get_mut(&peer) {
        p.maps = PeerMaps::default();
        p.health
            .error
            .get_or_insert_with(|| "its process exited".into());
    }
}

impl Transport for UcxTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        let st = self.lock();
        Capabilities {
            host_memory: true,
            gpu_memory: st.ucp.supports_cuda(),
            read: true,
            write: true,
            notifications: true,
            max_descriptors: st.config.max_descriptors,
            max_notification_len: st.config.max_notification_len,
            // Remote keys stay usable on some transports after the owner unmaps.
            detects_peer_deregistration: false,
        }
    }

    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration> {
        let mut st = self.lock();
        if let MemoryKind::Gpu { .. } = kind
            && !st.ucp.supports_cuda()
        {
            return Err(TransportError::NotAvailable {
                what: "GPU memory on the UCX transport".into(),
                reason: "this UCX library was built without CUDA support".into(),
            });
        }
        new_region(range, st.regions.values().map(|r| r.range))?;
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
                as u64,
            address: range.addr as *mut _,
            length: range.len as usize,
            memory_type: mem_type(kind),
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: registers caller-owned memory that must stay valid until the guard drops
        // (the contract's rule).
        check("mem_map", unsafe {
            sys::api().ucp_mem_map(st.ucp.context, &params, &mut memh)
        })?;
        let mut buf: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: packs the key of the handle just created; the buffer is copied and released.
        let rkey = unsafe {
            let status = sys::api().ucp_rkey_pack(st.ucp.context, memh, &mut buf, &mut size);
            if let Err(e) = check("rkey_pack", status) {
                sys::api().ucp_mem_unmap(st.ucp.context, memh);
                return Err(e);
            }
            let v = std::slice::from_raw_parts(buf as *const u8, size).to_vec();
            sys::api().ucp_rkey_buffer_release(buf);
            v
        };
        let shared = match kind {
            MemoryKind::Host if st.config.shared_memory => {
                kvxfer_host_mem::shm::export_of(range.addr, range.len)
            }
            _ => None,
        };
        let id = st.next();
        st.regions.insert(
            id,
            LocalRegion {
                kind,
                range,
                memh,
                rkey,
                shared,
            },
        );
        let owner: Arc<Shared> = Arc::clone(&self.shared);
        Ok(Registration::new(RegistrationId(id), kind, range, owner))
    }

    fn metadata(&self) -> TransportResult<Vec<u8>> {
        let st = self.lock();
        let meta = AgentMeta {
            name: st.name.clone(),
            worker_address: st.ucp.address()?,
            regions: st
                .regions
                .values()
                .map(|r| RegionMeta {
                    kind: r.kind,
                    range: r.range,
                    rkey: r.rkey.clone(),
                    shared: r.shared,
                })
                .collect(),
            host: kvxfer_host_mem::shm::host_id(),
        };
        Ok(meta.encode())
    }

    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId> {
        let meta = AgentMeta::decode(metadata).map_err(TransportError::InvalidMetadata)?;
        // Mapped without the lock (opening files, reading the peer's maps): transfers go on
        // meanwhile. Only `load_peer`, which takes `&mut self`, adds mappings, so what other
        // peers hold cannot grow before the result is inserted.
        let maps = self.map_peer(&meta);
        let mut st = self.lock();
        if maps.is_err() {
            st.map_refusals += 1;
        }
        let maps = maps.unwrap_or_default();
        if let Some(old) = st
            .peers
            .iter()
            .find(|(_, p)| p.name == meta.name)
            .map(|(id, _)| *id)
        {
            // Same name: a restart or a refresh. The old endpoint, keys and lists go.
            st.lists.forget_peer(old);
            if let Some(p) = st.peers.remove(&old) {
                st.close_peer(p, false);
            }
        }
        let mut health = Box::<Health>::default();
        let ep = st.connect(&meta.worker_address, &mut health).map_err(|e| {
            TransportError::InvalidMetadata(format!("UCX refused the worker address: {e}"))
        })?;
        let mut peer = Peer {
            name: meta.name,
            ep,
            regions: Vec::with_capacity(meta.regions.len()),
            health,
            maps,
        };
        for r in &meta.regions {
            let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
            // SAFETY: the packed key bytes outlive the call; the key is tied to `ep`.
            let status =
                unsafe { sys::api().ucp_ep_rkey_unpack(ep, r.rkey.as_ptr().cast(), &mut rkey) };
            if status != sys::ucs_status_t::UCS_OK {
                let text = sys::status_text(status);
                st.close_peer(peer, true);
                return Err(TransportError::InvalidMetadata(format!(
                    "remote key of region {:#x}+{}: {text}",
                    r.range.addr, r.range.len
                )));
            }
            peer.regions.push((r.kind, r.range, rkey));
        }
        let id = PeerId(st.next());
        st.peers.insert(id, peer);
        Ok(id)
    }

    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()> {
        let mut st = self.lock();
        let p = st
            .peers
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        st.lists.forget_peer(peer);
        st.close_peer(p, false);
        Ok(())
    }

    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        let mut st = self.lock();
        check_count(&st, "descriptors in list", ranges.len())?;
        check_local(&st, kind, ranges)?;
        let id = DescListId(st.next());
        Ok(st.lists.insert(id, kind, ranges, None))
    }

    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        let mut st = self.lock();
        check_count(&st, "descriptors in list", ranges.len())?;
        check_remote(&st, peer, kind, ranges)?;
        let id = DescListId(st.next());
        Ok(st.lists.insert(id, kind, ranges, Some(peer)))
    }

    fn release_list(&mut self, list: DescListId) -> TransportResult<()> {
        self.lock().lists.release(list)
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
        self.shared.owner_polls();
        let mut st = self.lock();
        let x = st.lists.resolve((local, local_idx), (remote, remote_idx))?;
        Self::submit(
            &mut st,
            op,
            x.peer,
            x.kinds,
            &x.local,
            &x.remote,
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
        self.shared.owner_polls();
        let mut st = self.lock();
        Self::submit(&mut st, op, peer, kinds, local, remote, notification)
    }

    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus> {
        self.shared.owner_polls();
        let mut st = self.lock();
        if !st.xfers.contains_key(&xfer) {
            return Err(TransportError::UnknownTransfer(xfer));
        }
        st.progress();
        let st = &mut *st;
        let x = st.xfers.get_mut(&xfer).expect("checked above");
        loop {
            if x.busy() {
                return Ok(XferStatus::InProgress);
            }
            if let Some(c) = x.copies.take() {
                if x.error.is_none() {
                    x.error = c.error();
                }
            }
            match x.phase {
                Phase::Data if x.error.is_none() && x.notification.is_some() => {
                    x.phase = Phase::Notify;
                    match st.peers.get(&x.peer) {
                        Some(p) => send_notification_am(p.ep, x),
                        None => x.error = Some("peer removed before the notification".into()),
                    }
                }
                Phase::Data | Phase::Notify => x.phase = Phase::Finished,
                Phase::Finished => {
                    return Ok(match &x.error {
                        Some(e) => XferStatus::Failed(e.clone()),
                        None => XferStatus::Done,
                    });
                }
            }
        }
    }

    fn release(&mut self, xfer: XferId) -> TransportResult<()> {
        let mut st = self.lock();
        if !st.xfers.contains_key(&xfer) {
            return Err(TransportError::UnknownTransfer(xfer));
        }
        let limit = st.config.release_wait;
        if st.settle(xfer, limit) {
            st.xfers.remove(&xfer);
        } else if let Some(x) = st.xfers.remove(&xfer) {
            // Requests UCX never finished still point at it: keep it alive.
            tracing::error!(%xfer, "UCX requests did not finish; leaking the transfer record");
            Box::leak(x);
        }
        Ok(())
    }

    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()> {
        let mut st = self.lock();
        check_notification(&st, message)?;
        let note = encode_notification(&st.name, message);
        let p = st
            .peers
            .get(&peer)
            .ok_or(TransportError::UnknownPeer(peer))?;
        if let Some(e) = &p.health.error {
            return Err(TransportError::PeerGone(format!("{}: {e}", p.name)));
        }
        let mut x = Xfer::new(peer, Phase::Notify, Some(note), Vec::new());
        send_notification_am(p.ep, &mut x);
        if let Some(e) = x.error.take() {
            return Err(TransportError::Backend(e));
        }
        if x.pending > 0 {
            st.sends.push(x);
        }
        Ok(())
    }

    fn peer_failed(&self, peer: PeerId) -> bool {
        // The endpoint's error callback records the failure (keep-alive, a broken
        // connection); on transports without peer-failure handling it never fires. A peer
        // whose memory is mapped here is also watched through its process.
        let mut st = self.lock();
        let Some(p) = st.peers.get(&peer) else {
            return false;
        };
        let exited = p.maps.owner_exited();
        let failed = p.health.error.is_some() || exited;
        if exited {
            forget_dead_maps(&mut st, peer);
        }
        failed
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize> {
        self.shared.owner_polls();
        let mut st = self.lock();
        st.progress();
        let n = st.inbox.notes.len();
        out.append(&mut st.inbox.notes);
        Ok(n)
    }
}
