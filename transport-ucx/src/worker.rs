//! One UCP context and worker, created with the features the transport needs and destroyed
//! in the right order.

use std::ffi::{CString, c_void};
use std::ptr;

use kvxfer_core::{TransportError, TransportResult};

use crate::sys;

/// Turns a UCX status into a `Backend` error naming the call.
pub fn check(what: &str, status: sys::ucs_status_t) -> TransportResult<()> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(TransportError::Backend(format!(
            "UCX {what}: {}",
            sys::status_text(status)
        )))
    }
}

/// A UCP context with its single worker. All use goes through the owning transport's lock
/// (the worker is created `SERIALIZED`).
pub struct Ucp {
    pub context: sys::ucp_context_h,
    pub worker: sys::ucp_worker_h,
    /// Memory types the library can register (`UCS_MEMORY_TYPE_*` bits).
    pub memory_types: u64,
}

impl Ucp {
    /// Reads the UCX configuration from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, …),
    /// applies `overrides` (`(key, value, force)`: without `force` only where the user did not
    /// set `UCX_<key>`), and creates context and worker.
    pub fn new(
        name: &str,
        overrides: &[(&str, String, bool)],
        wakeup: bool,
    ) -> TransportResult<Ucp> {
        sys::load().map_err(|reason| TransportError::NotAvailable {
            what: "the UCX library".into(),
            reason,
        })?;
        // SAFETY: plain UCP initialisation calls with valid pointers; each failure path
        // releases what was created before it.
        unsafe {
            let mut config: *mut sys::ucp_config_t = ptr::null_mut();
            check(
                "config_read",
                sys::api().ucp_config_read(ptr::null(), ptr::null(), &mut config),
            )?;
            for (key, value, force) in overrides {
                if !force && std::env::var_os(format!("UCX_{key}")).is_some() {
                    continue;
                }
                let (k, v) = (cstring(key)?, cstring(value)?);
                let status = sys::api().ucp_config_modify(config, k.as_ptr(), v.as_ptr());
                if let Err(e) = check(&format!("config {key}={value}"), status) {
                    sys::api().ucp_config_release(config);
                    return Err(e);
                }
            }
            let cname = cstring(name)?;
            let mut features = sys::ucp_feature_UCP_FEATURE_RMA | sys::ucp_feature_UCP_FEATURE_AM;
            if wakeup {
                features |= sys::ucp_feature_UCP_FEATURE_WAKEUP;
            }
            let params = sys::ucp_params_t {
                field_mask: (sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES
                    | sys::ucp_params_field_UCP_PARAM_FIELD_NAME)
                    as u64,
                features: features as u64,
                name: cname.as_ptr(),
                ..Default::default()
            };
            let mut context: sys::ucp_context_h = ptr::null_mut();
            let status = sys::api().ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut context,
            );
            sys::api().ucp_config_release(config);
            check("init", status)?;
            let mut attr = sys::ucp_context_attr_t {
                field_mask: sys::ucp_context_attr_field_UCP_ATTR_FIELD_MEMORY_TYPES as u64,
                ..Default::default()
            };
            let memory_types =
                if sys::api().ucp_context_query(context, &mut attr) == sys::ucs_status_t::UCS_OK {
                    attr.memory_types
                } else {
                    1 << sys::ucs_memory_type_UCS_MEMORY_TYPE_HOST
                };
            let wparams = sys::ucp_worker_params_t {
                field_mask: sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
                thread_mode: sys::ucs_thread_mode_t_UCS_THREAD_MODE_SERIALIZED,
                ..Default::default()
            };
            let mut worker: sys::ucp_worker_h = ptr::null_mut();
            if let Err(e) = check(
                "worker_create",
                sys::api().ucp_worker_create(context, &wparams, &mut worker),
            ) {
                sys::api().ucp_cleanup(context);
                return Err(e);
            }
            Ok(Ucp {
                context,
                worker,
                memory_types,
            })
        }
    }

    /// True when CUDA memory can be registered.
    pub fn supports_cuda(&self) -> bool {
        self.memory_types & (1 << sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// The worker's address, to put in metadata.
    pub fn address(&self) -> TransportResult<Vec<u8>> {
        // SAFETY: the address buffer is copied out and released with the same worker.
        unsafe {
            let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
            let mut len = 0usize;
            check(
                "worker_get_address",
                sys::api().ucp_worker_get_address(self.worker, &mut addr, &mut len),
            )?;
            let bytes = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            sys::api().ucp_worker_release_address(self.worker, addr);
            Ok(bytes)
        }
    }

    /// Drives the worker until it reports no more progress (bounded rounds).
    pub fn progress(&self) -> u32 {
        if self.worker.is_null() {
            return 0;
        }
        let mut total = 0;
        for _ in 0..64 {
            // SAFETY: the worker is alive and used under the owner's lock.
            let n = unsafe { sys::api().ucp_worker_progress(self.worker) };
            if n == 0 {
                break;
            }
            total += n;
        }
        total
    }

    /// Waits for a request handle to finish, progressing, up to `limit`; true when done.
    pub fn wait_request(&self, req: *mut c_void, limit: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        loop {
            self.progress();
            // SAFETY: `req` is a live request handle from an `_nbx` call.
            let s = unsafe { sys::api().ucp_request_check_status(req) };
            if s != sys::ucs_status_t::UCS_INPROGRESS {
                // SAFETY: finished, not yet freed.
                unsafe { sys::api().ucp_request_free(req) };
                return true;
            }
            if start.elapsed() > limit {
                return false;
            }
            std::thread::yield_now();
        }
    }
}

impl Ucp {
    /// Lets the worker finish what peers' disconnects left behind (UCX asserts that no
    /// internal request is pending when the worker is destroyed): flush, then progress until
    /// quiet, both bounded.
    fn settle(&self) {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live worker; the request is waited for and freed by `wait_request`.
        let ptr = unsafe { sys::api().ucp_worker_flush_nbx(self.worker, &param) };
        if let sys::StatusPtr::Pending(req) = sys::classify(ptr) {
            self.wait_request(req, std::time::Duration::from_secs(2));
        }
        let start = std::time::Instant::now();
        let mut quiet = 0;
        while quiet < 3 && start.elapsed() < std::time::Duration::from_millis(500) {
            if self.progress() == 0 {
                quiet += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            } else {
                quiet = 0;
            }
        }
    }
}

impl Ucp {
    /// Destroys the worker (and with it every endpoint, without a disconnect handshake:
    /// peers notice through their error handling). Memory handles stay valid: they belong
    /// to the context. Idempotent.
    pub fn destroy_worker(&mut self) {
        if self.worker.is_null() {
            return;
        }
        self.settle();
        // SAFETY: keys of this worker's endpoints were destroyed by the owner; no request
        // of ours is outstanding.
        unsafe { sys::api().ucp_worker_destroy(self.worker) };
        self.worker = ptr::null_mut();
    }
}

impl Drop for Ucp {
    fn drop(&mut self) {
        self.destroy_worker();
        // SAFETY: memory handles were unmapped by the owner before this.
        unsafe { sys::api().ucp_cleanup(self.context) };
    }
}

fn cstring(s: &str) -> TransportResult<CString> {
    CString::new(s).map_err(|_| TransportError::Backend(format!("{s:?} contains a NUL byte")))
}
