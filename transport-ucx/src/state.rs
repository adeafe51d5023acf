//! Everything a UCX agent owns, behind one lock: the worker, registered regions, peers with
//! their endpoints and unpacked keys, prepared lists, transfers in flight and received
//! notifications. Completion callbacks run inside `ucp_worker_progress`, which is only called
//! with this lock held, so they may touch the transfer they point at.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::transport::checks::PreparedLists;
use kvxfer_core::{AddrRange, MemoryKind, Notification, PeerId, XferId};

use crate::UcxConfig;
pub use crate::notification::{decode_notification, encode_notification};
use crate::same_host::{Copier, Copies, Mapped, PeerMaps};
use crate::sys::{self, StatusPtr, classify, ucs_status_t};
use crate::worker::Ucp;

/// Active-message id of kvxfer notifications.
pub const AM_ID: u32 = 0x4b56;
/// Most notifications kept undrained; later ones are dropped and counted.
const MAX_INBOX: usize = 1 << 20;

/// A region we registered.
pub struct LocalRegion {
    pub kind: MemoryKind,
    pub range: AddrRange,
    pub memh: sys::ucp_mem_h,
    pub rkey: Vec<u8>,
    /// Where a same-host peer can map it, when it lies in kvxfer shared memory.
    pub shared: Option<kvxfer_host_mem::shm::Export>,
}

/// Error state of an endpoint, written by UCX's error callback.
#[derive(Default)]
pub struct Health {
    pub error: Option<String>,
}

/// A loaded peer.
pub struct Peer {
    pub name: String,
    pub ep: sys::ucp_ep_h,
    pub regions: Vec<(MemoryKind, AddrRange, sys::ucp_rkey_h)>,
    pub health: Box<Health>,
    /// Its regions mapped here (a same-host peer with shared memory).
    pub maps: PeerMaps,
}

/// An endpoint being closed in the background, with what must outlive it.
pub struct Closing {
    req: *mut c_void,
    peer: Peer,
    since: Instant,
}

fn destroy_keys(peer: &mut Peer) {
    for (_, _, rkey) in peer.regions.drain(..) {
        // SAFETY: unpacked on this peer's endpoint, which is closed; no request uses it.
        unsafe { sys::api().ucp_rkey_destroy(rkey) };
    }
}

/// Where a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Data requests (and, for WRITE, the flush) outstanding.
    Data,
    /// The notification is being sent.
    Notify,
    /// Finished.
    Finished,
}

/// One transfer: its outstanding request count is decremented by [`on_complete`].
pub struct Xfer {
    pub peer: PeerId,
    pub pending: usize,
    pub error: Option<String>,
    pub phase: Phase,
    /// `[name len u16][name][message]`, kept alive until the send completes.
    pub notification: Option<Vec<u8>>,
    /// Local registrations the transfer touches (deregistration waits for them).
    pub regions: Vec<u64>,
    /// Host copies doing the data phase instead of UCX requests (a same-host peer).
    pub copies: Option<Arc<Copies>>,
}

impl Xfer {
    /// A transfer with nothing outstanding yet, boxed: callbacks hold its address.
    pub fn new(
        peer: PeerId,
        phase: Phase,
        notification: Option<Vec<u8>>,
        regions: Vec<u64>,
    ) -> Box<Xfer> {
        Box::new(Xfer {
            peer,
            pending: 0,
            error: None,
            phase,
            notification,
            regions,
            copies: None,
        })
    }

    /// Whether UCX requests or host copies are outstanding.
    pub fn busy(&self) -> bool {
        self.pending > 0 || self.copies.as_ref().is_some_and(|c| c.running())
    }

    /// Waits for host copies (which always end) so memory they touch may go.
    pub fn wait_copies(&self) {
        if let Some(c) = &self.copies {
            c.wait();
        }
    }

    /// Counts the result of one `_nbx` call.
    pub fn account(&mut self, ptr: sys::ucs_status_ptr_t) {
        match classify(ptr) {
            StatusPtr::Done => {}
            StatusPtr::Pending(_) => self.pending += 1,
            StatusPtr::Failed(s) => self.fail(s),
        }
    }

    fn fail(&mut self, s: ucs_status_t) {
        if self.error.is_none() {
            self.error = Some(format!("UCX: {}", sys::status_text(s)));
        }
    }

    /// Request parameters whose completion callback updates this transfer.
    pub fn params(&mut self) -> sys::ucp_request_param_t {
        let mut p = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK
                | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: self as *mut Xfer as *mut c_void,
            ..Default::default()
        };
        p.cb.send = Some(on_complete);
        p
    }
}

/// Completion callback of every request a transfer posts.
///
/// # Safety
/// `user` is the `Xfer` that posted the request; it stays alive until its count reaches zero.
unsafe extern "C" fn on_complete(request: *mut c_void, status: ucs_status_t, user: *mut c_void) {
    // SAFETY: see above; runs under the state lock (inside worker progress).
    unsafe {
        let x = &mut *(user as *mut Xfer);
        x.pending = x.pending.saturating_sub(1);
        if status != ucs_status_t::UCS_OK {
            x.fail(status);
        }
        sys::api().ucp_request_free(request);
    }
}

/// Endpoint error callback: the peer died or the connection broke.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the peer's `Health`, alive until its endpoint is closed.
    let h = unsafe { &mut *(arg as *mut Health) };
    if h.error.is_none() {
        h.error = Some(sys::status_text(status));
    }
}

/// Received notifications, filled by [`on_am`].
pub struct Inbox {
    pub worker: sys::ucp_worker_h,
    pub notes: Vec<Notification>,
    pub max_len: usize,
    /// Messages refused: malformed, too large, rendezvous, or inbox full.
    pub dropped: u64,
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the state's inbox (alive while the worker is); `data` holds `length`
    // bytes for this call.
    unsafe {
        let inbox = &mut *(arg as *mut Inbox);
        if (*param).recv_attr & sys::ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            // We only send eager notifications: anything else is not ours.
            sys::api().ucp_am_data_release(inbox.worker, data);
            inbox.dropped += 1;
            return ucs_status_t::UCS_OK;
        }
        let bytes = if length == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(data as *const u8, length)
        };
        match decode_notification(bytes, inbox.max_len) {
            Some(n) if inbox.notes.len() < MAX_INBOX => inbox.notes.push(n),
            _ => inbox.dropped += 1,
        }
        ucs_status_t::UCS_OK
    }
}

/// The agent's state. Field order is drop order after [`Drop`]: the worker goes before the
/// boxes its callbacks point into.
pub struct State {
    pub ucp: Ucp,
    pub name: String,
    pub config: UcxConfig,
    pub regions: BTreeMap<u64, LocalRegion>,
    pub peers: HashMap<PeerId, Peer>,
    pub lists: PreparedLists,
    pub xfers: HashMap<XferId, Box<Xfer>>,
    /// Standalone notifications still being sent (boxed: callbacks hold their address).
    #[allow(clippy::vec_box)]
    pub sends: Vec<Box<Xfer>>,
    pub inbox: Box<Inbox>,
    pub next_id: u64,
    /// True once the owning transport was dropped (registration guards may outlive it).
    pub closed: bool,
    /// Endpoints closing in the background.
    pub closing: Vec<Closing>,
    /// Whether endpoints are created with peer-failure handling (learned on first connect).
    pub failure_detection: Option<bool>,
    /// Health records of peers whose endpoints die with the worker.
    #[allow(clippy::vec_box)]
    pub dead_health: Vec<Box<Health>>,
    /// Copy workers for same-host transfers through shared memory.
    pub copier: Copier,
    /// Transfers done as host copies through a peer's shared memory.
    pub shared_transfers: u64,
    /// Same-host peers whose shared memory was refused (over a mapping limit, or memfds
    /// another peer has mapped).
    pub map_refusals: u64,
}

// SAFETY: the UCX handles are only used under the `Mutex` that owns this state, and the
// worker is created `UCS_THREAD_MODE_SERIALIZED`.
unsafe impl Send for State {}

impl State {
    /// What the peers not named `name` have mapped here (peers being closed hold nothing).
    pub fn mapped_except(&self, name: &str) -> Mapped {
        let mut m = Mapped::default();
        for p in self.peers.values().filter(|p| p.name != name) {
            p.maps.count_into(&mut m);
        }
        m
    }

    /// A state around a fresh worker, with the notification handler installed.
    pub fn new(ucp: Ucp, name: &str, config: UcxConfig) -> kvxfer_core::TransportResult<State> {
        let inbox = Box::new(Inbox {
            worker: ucp.worker,
            notes: Vec::new(),
            max_len: config.max_notification_len,
            dropped: 0,
        });
        let mut st = State {
            ucp,
            name: name.to_string(),
            config,
            regions: BTreeMap::new(),
            peers: HashMap::new(),
            lists: PreparedLists::default(),
            xfers: HashMap::new(),
            sends: Vec::new(),
            inbox,
            next_id: 1,
            closed: false,
            dead_health: Vec::new(),
            failure_detection: None,
            closing: Vec::new(),
            copier: Copier::default(),
            shared_transfers: 0,
            map_refusals: 0,
        };
        let param = sys::ucp_am_handler_param_t {
            field_mask: (sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ARG)
                as u64,
            id: AM_ID,
            cb: Some(on_am),
            arg: &mut *st.inbox as *mut Inbox as *mut c_void,
            ..Default::default()
        };
        // SAFETY: the inbox outlives the worker (field order).
        let status = unsafe { sys::api().ucp_worker_set_am_recv_handler(st.ucp.worker, &param) };
        crate::worker::check("set_am_recv_handler", status)?;
        Ok(st)
    }

    /// A fresh id for lists, peers, transfers and registrations.
    pub fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Progresses the worker and reaps finished standalone sends.
    pub fn progress(&mut self) {
        self.ucp.progress();
        self.sends.retain(|x| x.pending > 0);
        if !self.closing.is_empty() {
            self.reap_closing();
        }
    }

    /// Creates an endpoint to a worker address, with peer-failure detection where the
    /// transports allow it. UCX 1.13's shared-memory transports have no peer-failure
    /// handling: there the endpoint is created without it (once seen, for every later peer)
    /// and the agent reports it through [`State::peer_failure_detection`].
    pub fn connect(
        &mut self,
        address: &[u8],
        health: &mut Health,
    ) -> Result<sys::ucp_ep_h, String> {
        if self.failure_detection != Some(false) {
            match self.create_ep(address, health, true) {
                Ok(ep) => {
                    self.failure_detection = Some(true);
                    return Ok(ep);
                }
                Err(s) if s == ucs_status_t::UCS_ERR_UNREACHABLE => {
                    tracing::info!(
                        "no UCX transport to this peer supports peer-failure handling; \
                         connecting without it (dead peers are then not detected by UCX)"
                    );
                    self.failure_detection = Some(false);
                }
                Err(s) => return Err(sys::status_text(s)),
            }
        }
        self.create_ep(address, health, false)
            .map_err(sys::status_text)
    }

    fn create_ep(
        &mut self,
        address: &[u8],
        health: &mut Health,
        peer_errors: bool,
    ) -> Result<sys::ucp_ep_h, ucs_status_t> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER)
                as u64,
            address: address.as_ptr() as *const sys::ucp_address_t,
            err_mode: if peer_errors {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        params.err_handler.cb = Some(on_ep_error);
        params.err_handler.arg = health as *mut Health as *mut c_void;
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: the address bytes outlive the call; `health` outlives the endpoint.
        let status = unsafe { sys::api().ucp_ep_create(self.ucp.worker, &params, &mut ep) };
        if status != ucs_status_t::UCS_OK {
            return Err(status);
        }
        Ok(ep)
    }

    /// Whether endpoints detect dead peers (`None` before the first connection).
    pub fn peer_failure_detection(&self) -> Option<bool> {
        self.failure_detection
    }

    /// Closes a peer's endpoint (outstanding requests complete or fail), then destroys its
    /// keys. If UCX does not finish closing within the bound, the keys and health are
    /// leaked rather than freed under a live endpoint.
    pub fn close_peer(&mut self, peer: Peer, wait: bool) {
        self.close_peer_with(peer, wait, false)
    }

    /// Like [`State::close_peer`]; `force` cancels outstanding requests at once (for
    /// transfers that will not finish: a dead link UCX has not noticed).
    pub fn close_peer_with(&mut self, mut peer: Peer, wait: bool, force: bool) {
        // Its mappings go now, not when the endpoint is closed: copies in flight hold their
        // own references, and a closing peer must not count against the mapping bounds.
        peer.maps = PeerMaps::default();
        // A healthy endpoint closes gracefully (flush, then a disconnect the peer sees);
        // forcing a healthy one over TCP trips UCX 1.13's wire-up state. A failed or stuck
        // one is forced.
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force || peer.health.error.is_some() {
                sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: the endpoint is live and closed once.
        let pending = match classify(unsafe { sys::api().ucp_ep_close_nbx(peer.ep, &param) }) {
            StatusPtr::Done | StatusPtr::Failed(_) => None,
            StatusPtr::Pending(req) if wait => {
                let limit = self.config.release_wait.min(Duration::from_secs(2));
                (!self.ucp.wait_request(req, limit)).then_some(req)
            }
            StatusPtr::Pending(req) => Some(req),
        };
        // Let callbacks of the cancelled requests run.
        self.ucp.progress();
        match pending {
            None => destroy_keys(&mut peer),
            // A peer that died without UCX noticing yet can take long to close (a restarted
            // peer replacing it must not wait for that): finish in the background.
            Some(req) => self.closing.push(Closing {
                req,
                peer,
                since: Instant::now(),
            }),
        }
    }

    /// Finishes background endpoint closes; keys are destroyed once their endpoint closed.
    fn reap_closing(&mut self) {
        let mut i = 0;
        while i < self.closing.len() {
            let c = &self.closing[i];
            // SAFETY: a live close request, freed exactly once below.
            let status = unsafe { sys::api().ucp_request_check_status(c.req) };
            if status == ucs_status_t::UCS_INPROGRESS {
                if c.since.elapsed() > self.config.release_wait {
                    tracing::warn!(peer = %c.peer.name, "UCX endpoint still closing");
                }
                i += 1;
                continue;
            }
            let mut c = self.closing.swap_remove(i);
            // SAFETY: finished, not yet freed.
            unsafe { sys::api().ucp_request_free(c.req) };
            destroy_keys(&mut c.peer);
        }
    }

    /// Progresses until no transfer touching registration `id` is outstanding, or the bound
    /// passes; returns whether it is free.
    pub fn quiesce_region(&mut self, id: u64) -> bool {
        let limit = self.config.release_wait;
        let busy = |st: &State| {
            st.xfers
                .values()
                .any(|x| x.busy() && x.regions.contains(&id))
        };
        let start = Instant::now();
        while busy(self) {
            if start.elapsed() > limit {
                return false;
            }
            self.progress();
            std::thread::yield_now();
        }
        true
    }

    /// Waits (bounded) for a transfer's requests to finish; if they do not, closes its
    /// peer's endpoint so they are cancelled. Returns false if even that did not finish them.
    pub fn settle(&mut self, id: XferId, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            let Some(x) = self.xfers.get(&id) else {
                return true;
            };
            if !x.busy() {
                return true;
            }
            if start.elapsed() > limit {
                // Copies cannot be cancelled, but always end; the endpoint is only closed for
                // UCX requests that did not.
                x.wait_copies();
                if x.pending == 0 {
                    return true;
                }
                let peer = x.peer;
                if let Some(p) = self.peers.remove(&peer) {
                    tracing::warn!(peer = %p.name, "transfer did not finish in time; closing the endpoint");
                    self.lists.forget_peer(peer);
                    self.close_peer_with(p, true, true);
                }
                return self.xfers.get(&id).is_none_or(|x| !x.busy());
            }
            self.progress();
            std::thread::yield_now();
        }
    }

    /// Unmaps a region (after [`State::quiesce_region`]).
    pub fn unmap(&mut self, id: u64) {
        if let Some(r) = self.regions.remove(&id) {
            // SAFETY: the handle came from ucp_mem_map on this context.
            let status = unsafe { sys::api().ucp_mem_unmap(self.ucp.context, r.memh) };
            if status != ucs_status_t::UCS_OK {
                tracing::warn!("ucp_mem_unmap: {}", sys::status_text(status));
            }
        }
    }

    /// The transport was dropped: settles every transfer, destroys the peers' keys and the
    /// worker (endpoints go with it). Registrations may outlive this; they only need the
    /// context.
    pub fn shut_down(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let ids: Vec<XferId> = self.xfers.keys().copied().collect();
        for id in ids {
            self.settle(id, self.config.release_wait);
        }
        let start = Instant::now();
        while !self.sends.is_empty() && start.elapsed() < self.config.release_wait {
            self.progress();
        }
        self.lists.clear();
        if self.xfers.values().any(|x| x.busy()) || !self.sends.is_empty() {
            // Unfinished requests point into these; after the worker is gone nothing will.
            std::mem::forget(std::mem::take(&mut self.xfers));
            std::mem::forget(std::mem::take(&mut self.sends));
        }
        self.xfers.clear();
        let start = Instant::now();
        while !self.closing.is_empty() && start.elapsed() < Duration::from_millis(200) {
            self.progress();
        }
        for c in std::mem::take(&mut self.closing) {
            // Still closing (the peer never progressed the disconnect): the worker's
            // destruction ends the endpoint, and UCX aborts the process there if the close
            // request was not handed back. Its keys are leaked rather than destroyed under
            // it; its health record is freed after the worker, like the live peers'.
            // SAFETY: a live close request, freed exactly once; UCX finishes it internally.
            unsafe { sys::api().ucp_request_free(c.req) };
            std::mem::forget(c.peer.regions);
            self.dead_health.push(c.peer.health);
        }
        for (_, mut p) in self.peers.drain() {
            for (_, _, rkey) in p.regions.drain(..) {
                // SAFETY: no request uses the key any more.
                unsafe { sys::api().ucp_rkey_destroy(rkey) };
            }
            // `p.health` is freed below, after the worker (and its error callbacks) are gone.
            self.dead_health.push(p.health);
        }
        self.ucp.destroy_worker();
        self.dead_health.clear();
    }
}

impl Drop for State {
    fn drop(&mut self) {
        self.shut_down();
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            self.unmap(id);
        }
    }
}
