//! Safe owners of NIXL's C API objects (see [`crate::capi`]): an agent and its backend, and
//! the lists, options, requests, registrations and notification maps made through it. Every
//! call into the agent holds its lock (NIXL's agent is created without its own thread
//! synchronisation, and registrations are dropped on whatever thread drops their guard),
//! and everything that needs the agent at drop keeps it alive.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::capi::{self, Api, Handle, Status};

/// A failed C API call: what was asked and NIXL's status.
#[derive(Debug, Clone)]
pub(crate) struct Error {
    what: &'static str,
    status: Status,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed: {} ({})",
            self.what,
            capi::status_text(self.status),
            self.status
        )
    }
}

type Result<T> = std::result::Result<T, Error>;

fn check(what: &'static str, status: Status) -> Result<()> {
    if status == capi::SUCCESS {
        Ok(())
    } else {
        Err(Error { what, status })
    }
}

/// A handle or buffer a successful call left null: NIXL broke its own contract.
fn non_null<T>(what: &'static str, p: *mut T) -> Result<()> {
    if p.is_null() {
        Err(Error { what, status: -2 })
    } else {
        Ok(())
    }
}

/// A string NIXL is handed: one with an interior NUL cannot name anything NIXL knows.
fn c_string(what: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error { what, status: -1 })
}

/// A NIXL object made with a "create" call, destroyed by its "destroy" call at drop.
struct Owned {
    handle: Handle,
    destroy: unsafe extern "C" fn(Handle) -> Status,
}

impl Owned {
    fn new(
        what: &'static str,
        create: impl FnOnce(*mut Handle) -> Status,
        destroy: unsafe extern "C" fn(Handle) -> Status,
    ) -> Result<Owned> {
        let mut handle = ptr::null_mut();
        check(what, create(&mut handle))?;
        non_null(what, handle)?;
        Ok(Owned { handle, destroy })
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: made by the matching create call, destroyed once.
        unsafe { (self.destroy)(self.handle) };
    }
}

/// The agent itself: its handle, its backends, and the lock every call takes.
struct Inner {
    api: &'static Api,
    lock: Mutex<Handle>,
    backends: Mutex<Vec<Handle>>,
}

// SAFETY: the agent handle is only used under `lock`.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Inner {
    fn agent(&self) -> MutexGuard<'_, Handle> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let agent = *self.agent();
        let backends =
            std::mem::take(&mut *self.backends.lock().unwrap_or_else(|e| e.into_inner()));
        // SAFETY: nothing made through the agent is left (each holds an `Arc` of it); its
        // backends go first, as NIXL's own Rust binding does.
        unsafe {
            for b in backends {
                (self.api.nixl_capi_destroy_backend)(b);
            }
            (self.api.nixl_capi_destroy_agent)(agent);
        }
    }
}

/// Settings of a new agent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AgentSettings {
    pub progress_thread: bool,
    pub progress_delay_us: u64,
    pub telemetry: bool,
}

/// A NIXL agent (cheap to clone: the clones share it).
#[derive(Clone)]
pub(crate) struct Agent {
    inner: Arc<Inner>,
}

/// A backend of an agent (destroyed with it).
#[derive(Clone, Copy)]
pub(crate) struct Backend(Handle);

// SAFETY: an opaque pointer the agent owns, passed back to it only.
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

impl Agent {
    /// A new agent named `name`.
    pub(crate) fn new(api: &'static Api, name: &str, s: AgentSettings) -> Result<Agent> {
        let c_name = c_string("agent creation", name)?;
        let cfg = capi::AgentConfig {
            enable_prog_thread: s.progress_thread,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: s.progress_delay_us,
            lthr_delay_us: 100_000,
            capture_telemetry: s.telemetry,
        };
        let mut handle = ptr::null_mut();
        // SAFETY: a NUL-terminated name and a config of the C layout, both outliving the call.
        check("agent creation", unsafe {
            (api.nixl_capi_create_configured_agent)(c_name.as_ptr(), &cfg, &mut handle)
        })?;
        non_null("agent creation", handle)?;
        Ok(Agent {
            inner: Arc::new(Inner {
                api,
                lock: Mutex::new(handle),
                backends: Mutex::new(Vec::new()),
            }),
        })
    }

    fn api(&self) -> &'static Api {
        self.inner.api
    }

    /// The backend plugins NIXL found.
    pub(crate) fn plugins(&self) -> Result<Vec<String>> {
        let api = self.api();
        let list = {
            let agent = self.inner.agent();
            // SAFETY: live agent under its lock; the list is destroyed by `Owned`.
            Owned::new(
                "listing plugins",
                |out| unsafe { (api.nixl_capi_get_available_plugins)(*agent, out) },
                api.nixl_capi_destroy_string_list,
            )?
        };
        let mut n = 0usize;
        // SAFETY: a live string list.
        check("listing plugins", unsafe {
            (api.nixl_capi_string_list_size)(list.handle, &mut n)
        })?;
        let mut out = Vec::with_capacity(n.min(1024));
        for i in 0..n {
            let mut s: *const c_char = ptr::null();
            // SAFETY: index below the size; the string lives as long as the list.
            let status = unsafe { (api.nixl_capi_string_list_get)(list.handle, i, &mut s) };
            if status == capi::SUCCESS && !s.is_null() {
                // SAFETY: NUL-terminated, alive while `list` is.
                out.push(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned());
            }
        }
        Ok(out)
    }

    /// Creates the backend `plugin` with its default parameters.
    pub(crate) fn create_backend(&self, plugin: &str) -> Result<Backend> {
        let api = self.api();
        let c_plugin = c_string("backend creation", plugin)?;
        let agent = self.inner.agent();
        let mut mems = ptr::null_mut();
        let mut params = ptr::null_mut();
        // SAFETY: live agent under its lock; both outputs are destroyed below.
        check("plugin parameters", unsafe {
            (api.nixl_capi_get_plugin_params)(*agent, c_plugin.as_ptr(), &mut mems, &mut params)
        })?;
        let _mems = (!mems.is_null()).then(|| Owned {
            handle: mems,
            destroy: api.nixl_capi_destroy_mem_list,
        });
        let params = Owned {
            handle: params,
            destroy: api.nixl_capi_destroy_params,
        };
        let mut backend = ptr::null_mut();
        // SAFETY: as above; the parameters outlive the call.
        check("backend creation", unsafe {
            (api.nixl_capi_create_backend)(*agent, c_plugin.as_ptr(), params.handle, &mut backend)
        })?;
        non_null("backend creation", backend)?;
        self.inner
            .backends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(backend);
        Ok(Backend(backend))
    }

    /// This agent's metadata, for peers to load.
    pub(crate) fn local_metadata(&self) -> Result<Vec<u8>> {
        let api = self.api();
        let agent = self.inner.agent();
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live agent under its lock; NIXL hands over a malloc'd buffer, freed here.
        check("metadata", unsafe {
            (api.nixl_capi_get_local_md)(*agent, &mut data, &mut len)
        })?;
        non_null("metadata", data)?;
        // SAFETY: `len` bytes at `data`, ours until freed.
        let bytes = unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec();
        // SAFETY: allocated by NIXL with malloc, freed once.
        unsafe { libc::free(data) };
        Ok(bytes)
    }

    /// Loads a peer's metadata; returns the name it carries.
    pub(crate) fn load_remote(&self, metadata: &[u8]) -> Result<String> {
        let api = self.api();
        let agent = self.inner.agent();
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: live agent under its lock; the bytes outlive the call; NIXL hands over a
        // malloc'd name, freed here.
        check("loading a peer's metadata", unsafe {
            (api.nixl_capi_load_remote_md)(
                *agent,
                metadata.as_ptr() as *const c_void,
                metadata.len(),
                &mut name,
            )
        })?;
        non_null("loading a peer's metadata", name)?;
        // SAFETY: NUL-terminated (a peer's bytes: not necessarily UTF-8), freed once.
        let s = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        unsafe { libc::free(name as *mut c_void) };
        Ok(s)
    }

    /// Forgets a peer's metadata.
    pub(crate) fn invalidate_remote(&self, name: &str) -> Result<()> {
        let c_name = c_string("forgetting a peer", name)?;
        let agent = self.inner.agent();
        // SAFETY: live agent under its lock.
        check("forgetting a peer", unsafe {
            (self.api().nixl_capi_invalidate_remote_md)(*agent, c_name.as_ptr())
        })
    }

    /// Registers `len` bytes at `addr` of memory type `mem` (device `dev`) with `backend`.
    pub(crate) fn register(
        &self,
        mem: c_int,
        addr: u64,
        len: u64,
        dev: u64,
        backend: Backend,
    ) -> Result<Registered> {
        let list = self.reg_list(mem, addr, len, dev)?;
        let args = OptArgs::new(self.api(), backend)?;
        let agent = self.inner.agent();
        // SAFETY: live agent under its lock; list and options outlive the call.
        check("registration", unsafe {
            (self.api().nixl_capi_register_mem)(*agent, list.handle, args.0.handle)
        })?;
        Ok(Registered {
            agent: self.clone(),
            mem,
            addr,
            len,
            dev,
            backend,
        })
    }

    fn reg_list(&self, mem: c_int, addr: u64, len: u64, dev: u64) -> Result<Owned> {
        let api = self.api();
        let list = Owned::new(
            "registration list",
            // SAFETY: writes one handle.
            |out| unsafe { (api.nixl_capi_create_reg_dlist)(mem, out) },
            api.nixl_capi_destroy_reg_dlist,
        )?;
        let (addr, len) = sizes("registration list", addr, len)?;
        // SAFETY: a live list; no per-descriptor metadata.
        check("registration list", unsafe {
            (api.nixl_capi_reg_dlist_add_desc)(list.handle, addr, len, dev, ptr::null(), 0)
        })?;
        Ok(list)
    }

    /// Prepares `list` for indexed posts: `owner` "" for this agent's memory, else a loaded
    /// peer's name.
    pub(crate) fn prepare(
        &self,
        owner: &str,
        list: &DescList,
        backend: Backend,
    ) -> Result<Prepared> {
        let c_owner = c_string("list preparation", owner)?;
        let args = OptArgs::new(self.api(), backend)?;
        let agent = self.inner.agent();
        let mut handle = ptr::null_mut();
        // SAFETY: live agent under its lock; name, list and options outlive the call.
        check("list preparation", unsafe {
            (self.api().nixl_capi_prep_xfer_dlist)(
                *agent,
                c_owner.as_ptr(),
                list.0.handle,
                &mut handle,
                args.0.handle,
            )
        })?;
        non_null("list preparation", handle)?;
        Ok(Prepared {
            agent: self.clone(),
            handle,
        })
    }

    /// A request over two prepared lists, by descriptor index.
    pub(crate) fn make_request(
        &self,
        op: c_int,
        local: &Prepared,
        local_idx: &[c_int],
        remote: &Prepared,
        remote_idx: &[c_int],
        args: &OptArgs,
    ) -> Result<Request> {
        let agent = self.inner.agent();
        let mut req = ptr::null_mut();
        // SAFETY: live agent under its lock; handles, indices and options outlive the call.
        check("indexed transfer creation", unsafe {
            (self.api().nixl_capi_make_xfer_req)(
                *agent,
                op,
                local.handle,
                local_idx.as_ptr(),
                local_idx.len(),
                remote.handle,
                remote_idx.as_ptr(),
                remote_idx.len(),
                &mut req,
                args.0.handle,
            )
        })?;
        self.request("indexed transfer creation", req)
    }

    /// A request over two descriptor lists, to or from peer `remote`.
    pub(crate) fn create_request(
        &self,
        op: c_int,
        local: &DescList,
        remote: &DescList,
        peer: &str,
        args: &OptArgs,
    ) -> Result<Request> {
        let c_peer = c_string("transfer creation", peer)?;
        let agent = self.inner.agent();
        let mut req = ptr::null_mut();
        // SAFETY: live agent under its lock; lists, name and options outlive the call.
        check("transfer creation", unsafe {
            (self.api().nixl_capi_create_xfer_req)(
                *agent,
                op,
                local.0.handle,
                remote.0.handle,
                c_peer.as_ptr(),
                &mut req,
                args.0.handle,
            )
        })?;
        self.request("transfer creation", req)
    }

    fn request(&self, what: &'static str, req: Handle) -> Result<Request> {
        non_null(what, req)?;
        Ok(Request {
            agent: self.clone(),
            handle: req,
        })
    }

    /// Posts `req`.
    pub(crate) fn post(&self, req: &Request, args: &OptArgs) -> Result<()> {
        let agent = self.inner.agent();
        // SAFETY: live agent under its lock; a request it made.
        let status =
            unsafe { (self.api().nixl_capi_post_xfer_req)(*agent, req.handle, args.0.handle) };
        // A post that completed at once answers SUCCESS, one still running IN_PROGRESS.
        if status == capi::SUCCESS || status == capi::IN_PROGRESS {
            Ok(())
        } else {
            Err(Error {
                what: "post",
                status,
            })
        }
    }

    /// Whether `req` finished (`Ok(true)`), is running (`Ok(false)`), or failed.
    pub(crate) fn done(&self, req: &Request) -> Result<bool> {
        let agent = self.inner.agent();
        // SAFETY: live agent under its lock; a request it made.
        match unsafe { (self.api().nixl_capi_get_xfer_status)(*agent, req.handle) } {
            capi::SUCCESS => Ok(true),
            capi::IN_PROGRESS => Ok(false),
            status => Err(Error {
                what: "transfer",
                status,
            }),
        }
    }

    /// NIXL's measurements of a finished `req` (the agent captures telemetry).
    pub(crate) fn telemetry(&self, req: &Request) -> Result<capi::Telemetry> {
        let agent = self.inner.agent();
        let mut t = capi::Telemetry::default();
        // SAFETY: live agent under its lock; a request it made; `t` has the C layout.
        check("telemetry", unsafe {
            (self.api().nixl_capi_get_xfer_telemetry)(*agent, req.handle, &mut t)
        })?;
        Ok(t)
    }

    /// Sends `message` to peer `peer` alone (no transfer).
    pub(crate) fn notify(&self, peer: &str, message: &[u8], backend: Backend) -> Result<()> {
        let c_peer = c_string("notification", peer)?;
        let args = OptArgs::new(self.api(), backend)?;
        let agent = self.inner.agent();
        // SAFETY: live agent under its lock; name, bytes and options outlive the call.
        check("notification", unsafe {
            (self.api().nixl_capi_gen_notif)(
                *agent,
                c_peer.as_ptr(),
                message.as_ptr() as *const c_void,
                message.len(),
                args.0.handle,
            )
        })
    }

    /// Every notification received since the last call, with its sender's name.
    pub(crate) fn notifications(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let api = self.api();
        let map = Owned::new(
            "notifications",
            // SAFETY: writes one handle.
            |out| unsafe { (api.nixl_capi_create_notif_map)(out) },
            api.nixl_capi_destroy_notif_map,
        )?;
        {
            let agent = self.inner.agent();
            // SAFETY: live agent under its lock; a live map; no options.
            check("notifications", unsafe {
                (api.nixl_capi_get_notifs)(*agent, map.handle, ptr::null_mut())
            })?;
        }
        let mut out = Vec::new();
        let mut agents = 0usize;
        // SAFETY: a live map (its strings and bytes live as long as it does).
        check("notifications", unsafe {
            (api.nixl_capi_notif_map_size)(map.handle, &mut agents)
        })?;
        for a in 0..agents {
            let mut name: *const c_char = ptr::null();
            // SAFETY: index below the size.
            let status =
                unsafe { (api.nixl_capi_notif_map_get_agent_at)(map.handle, a, &mut name) };
            if status != capi::SUCCESS || name.is_null() {
                continue;
            }
            // SAFETY: NUL-terminated, alive with the map.
            let sender = unsafe { CStr::from_ptr(name) };
            let mut n = 0usize;
            // SAFETY: a name the map gave.
            if unsafe { (api.nixl_capi_notif_map_get_notifs_size)(map.handle, name, &mut n) }
                != capi::SUCCESS
            {
                continue;
            }
            for i in 0..n {
                let mut data: *const c_void = ptr::null();
                let mut len = 0usize;
                // SAFETY: index below that sender's count.
                let status = unsafe {
                    (api.nixl_capi_notif_map_get_notif)(map.handle, name, i, &mut data, &mut len)
                };
                if status != capi::SUCCESS {
                    continue;
                }
                let bytes = if data.is_null() || len == 0 {
                    Vec::new()
                } else {
                    // SAFETY: `len` bytes alive with the map.
                    unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
                };
                out.push((sender.to_string_lossy().into_owned(), bytes));
            }
        }
        Ok(out)
    }
}

/// `addr`/`len` as the C API's `uintptr_t`/`size_t`.
fn sizes(what: &'static str, addr: u64, len: u64) -> Result<(usize, usize)> {
    match (usize::try_from(addr), usize::try_from(len)) {
        (Ok(a), Ok(l)) => Ok((a, l)),
        _ => Err(Error { what, status: -1 }),
    }
}

/// Options of one call: the backend to use and, for a transfer, its notification.
pub(crate) struct OptArgs(Owned);

impl OptArgs {
    /// Options naming `backend`.
    pub(crate) fn new(api: &'static Api, backend: Backend) -> Result<OptArgs> {
        let o = Owned::new(
            "options",
            // SAFETY: writes one handle.
            |out| unsafe { (api.nixl_capi_create_opt_args)(out) },
            api.nixl_capi_destroy_opt_args,
        )?;
        // SAFETY: live options; a backend of the agent they are used with.
        check("options", unsafe {
            (api.nixl_capi_opt_args_add_backend)(o.handle, backend.0)
        })?;
        Ok(OptArgs(o))
    }

    /// Options naming `backend` and carrying `message` as the transfer's notification.
    pub(crate) fn with_notification(
        api: &'static Api,
        backend: Backend,
        message: &[u8],
    ) -> Result<OptArgs> {
        let o = OptArgs::new(api, backend)?;
        // SAFETY: live options; NIXL copies the bytes.
        check("notification", unsafe {
            (api.nixl_capi_opt_args_set_notif_msg)(
                o.0.handle,
                message.as_ptr() as *const c_void,
                message.len(),
            )
        })?;
        // SAFETY: live options.
        check("notification", unsafe {
            (api.nixl_capi_opt_args_set_has_notif)(o.0.handle, true)
        })?;
        Ok(o)
    }
}

/// A transfer descriptor list.
pub(crate) struct DescList(Owned);

impl DescList {
    /// An empty list of memory type `mem`.
    pub(crate) fn new(api: &'static Api, mem: c_int) -> Result<DescList> {
        Ok(DescList(Owned::new(
            "descriptor list",
            // SAFETY: writes one handle.
            |out| unsafe { (api.nixl_capi_create_xfer_dlist)(mem, out) },
            api.nixl_capi_destroy_xfer_dlist,
        )?))
    }

    /// Appends `len` bytes at `addr` on device `dev`.
    pub(crate) fn push(&mut self, api: &'static Api, addr: u64, len: u64, dev: u64) -> Result<()> {
        let (addr, len) = sizes("descriptor list", addr, len)?;
        // SAFETY: a live list.
        check("descriptor list", unsafe {
            (api.nixl_capi_xfer_dlist_add_desc)(self.0.handle, addr, len, dev)
        })
    }
}

/// A list NIXL prepared for indexed posts; released through its agent at drop.
pub(crate) struct Prepared {
    agent: Agent,
    handle: Handle,
}

// SAFETY: an opaque handle used and released only under the agent's lock.
unsafe impl Send for Prepared {}

impl Drop for Prepared {
    fn drop(&mut self) {
        let agent = self.agent.inner.agent();
        // SAFETY: prepared by this agent, released once.
        unsafe { (self.agent.api().nixl_capi_release_xfer_dlist_handle)(*agent, self.handle) };
    }
}

/// A transfer request; released (aborted if still running) and destroyed at drop.
pub(crate) struct Request {
    agent: Agent,
    handle: Handle,
}

// SAFETY: an opaque handle used and released only under the agent's lock.
unsafe impl Send for Request {}

impl Drop for Request {
    fn drop(&mut self) {
        let api = self.agent.api();
        let agent = self.agent.inner.agent();
        // SAFETY: made by this agent, released and destroyed once.
        unsafe {
            (api.nixl_capi_release_xfer_req)(*agent, self.handle);
            (api.nixl_capi_destroy_xfer_req)(self.handle);
        }
    }
}

/// Registered memory; deregistered at drop.
pub(crate) struct Registered {
    agent: Agent,
    mem: c_int,
    addr: u64,
    len: u64,
    dev: u64,
    backend: Backend,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let Ok(list) = self.agent.reg_list(self.mem, self.addr, self.len, self.dev) else {
            return;
        };
        let Ok(args) = OptArgs::new(self.agent.api(), self.backend) else {
            return;
        };
        let agent = self.agent.inner.agent();
        // SAFETY: live agent under its lock; the range it registered.
        unsafe { (self.agent.api().nixl_capi_deregister_mem)(*agent, list.handle, args.0.handle) };
    }
}
