//! NIXL's C API (`libnixl_capi.so`, the library every NIXL wheel ships), declared here by
//! hand and opened at run time: the subset this transport calls, with the signatures of
//! NIXL 1.5's `nixl_capi.h`. Nothing to generate and nothing to compile against, so building
//! kvxfer needs neither NIXL's headers nor libclang; a runtime without one of these symbols
//! is refused when it is opened, naming the symbol.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// `nixl_capi_status_t`: 0 success, 1 in progress, negative an error.
pub(crate) type Status = c_int;
/// Success.
pub(crate) const SUCCESS: Status = 0;
/// A transfer still in progress.
pub(crate) const IN_PROGRESS: Status = 1;

/// `nixl_capi_mem_type_t`: host memory.
pub(crate) const MEM_DRAM: c_int = 0;
/// `nixl_capi_mem_type_t`: GPU memory.
pub(crate) const MEM_VRAM: c_int = 1;

/// `nixl_capi_xfer_op_t`: READ.
pub(crate) const OP_READ: c_int = 0;
/// `nixl_capi_xfer_op_t`: WRITE.
pub(crate) const OP_WRITE: c_int = 1;

/// An opaque NIXL object (agent, backend, list, request, map...).
pub(crate) type Handle = *mut c_void;

/// `nixl_capi_agent_config_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    /// `nixl_capi_thread_sync_t`: 0 = NIXL's default (none).
    pub thread_sync: c_int,
    pub num_workers: u32,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// `struct nixl_capi_xfer_telemetry_s`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Telemetry {
    pub start_time_us: u64,
    pub post_duration_us: u64,
    pub xfer_duration_us: u64,
    pub total_bytes: u64,
    pub desc_count: u64,
}

/// Declares the function table, its loader and the names checked at load.
macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The C API's entry points this transport calls.
        #[allow(non_snake_case)]
        pub(crate) struct Api {
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            _lib: libloading::Library,
        }

        impl Api {
            /// Opens `path` (a soname or a file) and resolves every entry point.
            fn open(path: &str) -> Result<Api, String> {
                // SAFETY: loading NIXL's C API library runs its initialisers, as any NIXL
                // user does.
                let lib = unsafe { libloading::Library::new(path) }
                    .map_err(|e| format!("{path} cannot be loaded ({e})"))?;
                // SAFETY: each symbol is declared with the C API's own signature.
                unsafe {
                    Ok(Api {
                        $($name: *lib
                            .get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| format!(
                                "{path} has no {} (NIXL too old?): {e}",
                                stringify!($name)
                            ))?,)*
                        _lib: lib,
                    })
                }
            }
        }
    };
}

api! {
    nixl_capi_create_configured_agent: fn(*const c_char, *const AgentConfig, *mut Handle) -> Status;
    nixl_capi_destroy_agent: fn(Handle) -> Status;
    nixl_capi_get_local_md: fn(Handle, *mut *mut c_void, *mut usize) -> Status;
    nixl_capi_load_remote_md: fn(Handle, *const c_void, usize, *mut *mut c_char) -> Status;
    nixl_capi_invalidate_remote_md: fn(Handle, *const c_char) -> Status;
    nixl_capi_get_available_plugins: fn(Handle, *mut Handle) -> Status;
    nixl_capi_destroy_string_list: fn(Handle) -> Status;
    nixl_capi_string_list_size: fn(Handle, *mut usize) -> Status;
    nixl_capi_string_list_get: fn(Handle, usize, *mut *const c_char) -> Status;
    nixl_capi_get_plugin_params: fn(Handle, *const c_char, *mut Handle, *mut Handle) -> Status;
    nixl_capi_destroy_mem_list: fn(Handle) -> Status;
    nixl_capi_destroy_params: fn(Handle) -> Status;
    nixl_capi_create_backend: fn(Handle, *const c_char, Handle, *mut Handle) -> Status;
    nixl_capi_destroy_backend: fn(Handle) -> Status;
    nixl_capi_create_opt_args: fn(*mut Handle) -> Status;
    nixl_capi_destroy_opt_args: fn(Handle) -> Status;
    nixl_capi_opt_args_add_backend: fn(Handle, Handle) -> Status;
    nixl_capi_opt_args_set_notif_msg: fn(Handle, *const c_void, usize) -> Status;
    nixl_capi_opt_args_set_has_notif: fn(Handle, bool) -> Status;
    nixl_capi_register_mem: fn(Handle, Handle, Handle) -> Status;
    nixl_capi_deregister_mem: fn(Handle, Handle, Handle) -> Status;
    nixl_capi_prep_xfer_dlist: fn(Handle, *const c_char, Handle, *mut Handle, Handle) -> Status;
    nixl_capi_release_xfer_dlist_handle: fn(Handle, Handle) -> Status;
    nixl_capi_make_xfer_req: fn(
        Handle, c_int, Handle, *const c_int, usize, Handle, *const c_int, usize, *mut Handle, Handle
    ) -> Status;
    nixl_capi_create_xfer_req: fn(
        Handle, c_int, Handle, Handle, *const c_char, *mut Handle, Handle
    ) -> Status;
    nixl_capi_post_xfer_req: fn(Handle, Handle, Handle) -> Status;
    nixl_capi_get_xfer_status: fn(Handle, Handle) -> Status;
    nixl_capi_release_xfer_req: fn(Handle, Handle) -> Status;
    nixl_capi_destroy_xfer_req: fn(Handle) -> Status;
    nixl_capi_get_xfer_telemetry: fn(Handle, Handle, *mut Telemetry) -> Status;
    nixl_capi_get_notifs: fn(Handle, Handle, Handle) -> Status;
    nixl_capi_create_notif_map: fn(*mut Handle) -> Status;
    nixl_capi_destroy_notif_map: fn(Handle) -> Status;
    nixl_capi_notif_map_size: fn(Handle, *mut usize) -> Status;
    nixl_capi_notif_map_get_agent_at: fn(Handle, usize, *mut *const c_char) -> Status;
    nixl_capi_notif_map_get_notifs_size: fn(Handle, *const c_char, *mut usize) -> Status;
    nixl_capi_notif_map_get_notif: fn(Handle, *const c_char, usize, *mut *const c_void, *mut usize) -> Status;
    nixl_capi_gen_notif: fn(Handle, *const c_char, *const c_void, usize, Handle) -> Status;
    nixl_capi_create_xfer_dlist: fn(c_int, *mut Handle) -> Status;
    nixl_capi_destroy_xfer_dlist: fn(Handle) -> Status;
    nixl_capi_xfer_dlist_add_desc: fn(Handle, usize, usize, u64) -> Status;
    nixl_capi_create_reg_dlist: fn(c_int, *mut Handle) -> Status;
    nixl_capi_destroy_reg_dlist: fn(Handle) -> Status;
    nixl_capi_reg_dlist_add_desc: fn(Handle, usize, usize, u64, *const c_void, usize) -> Status;
}

/// The library [`api`] opens: `KVXFER_NIXL_LIBRARY` when set, else `libnixl_capi.so` from
/// the loader's search path — or the one already loaded in this process under that soname
/// (`kvxfer.nixl.select()` loads the engine environment's NIXL wheel that way).
pub(crate) fn library() -> String {
    std::env::var("KVXFER_NIXL_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "libnixl_capi.so".into())
}

/// NIXL's C API, opened once per process; the error says why it cannot be. A failure is
/// not kept: the next call tries again (the Python package may load a runtime in between).
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Api> = OnceLock::new();
    if let Some(api) = API.get() {
        return Ok(api);
    }
    let opened = Api::open(&library())?;
    // Two threads may both open it: one is kept, the other's handle closes (the library
    // stays loaded while the kept one holds it).
    Ok(API.get_or_init(|| opened))
}

/// The C API's status as text.
pub(crate) fn status_text(s: Status) -> &'static str {
    match s {
        SUCCESS => "success",
        IN_PROGRESS => "in progress",
        -1 => "invalid parameter",
        -2 => "backend error",
        -3 => "invalid state",
        -4 => "exception in NIXL",
        -5 => "no telemetry",
        -6 => "not found",
        _ => "unknown status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_refused_naming_it() {
        let err = Api::open("/nonexistent/libnixl_capi.so")
            .err()
            .expect("refused");
        assert!(
            err.contains("/nonexistent/libnixl_capi.so cannot be loaded"),
            "{err}"
        );
    }

    #[test]
    fn a_library_without_the_c_api_is_refused_naming_the_first_missing_symbol() {
        // The C library every Linux process has: loadable, and no NIXL in it.
        let err = Api::open("libc.so.6").err().expect("refused");
        assert!(
            err.contains("has no nixl_capi_create_configured_agent"),
            "{err}"
        );
    }

    #[test]
    fn statuses_read_as_nixls_names() {
        assert_eq!(status_text(SUCCESS), "success");
        assert_eq!(status_text(IN_PROGRESS), "in progress");
        assert_eq!(status_text(-6), "not found");
        assert_eq!(status_text(-99), "unknown status");
    }
}
