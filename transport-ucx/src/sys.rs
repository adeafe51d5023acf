//! Generated UCP bindings (bindgen against UCX 1.13's headers, only the calls we make) and
//! the C macros UCX uses for status pointers.
//!
//! The library is opened at run time (`dlopen`, local scope) rather than linked: a process
//! that also loads NIXL's own bundled UCX would otherwise have two UCX copies resolving each
//! other's global symbols, which aborts in UCX's initialisation. A missing library is then a
//! typed error, not a failure to start.
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    unused_imports,
    clippy::all
)]

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

// Committed (`scripts/ucx-bindings.sh` regenerates and checks them), so that building needs
// neither UCX's headers nor libclang; the regenerating build uses its fresh output.
#[cfg(not(feature = "regen-bindings"))]
include!("ucp_bindings.rs");
#[cfg(feature = "regen-bindings")]
include!(concat!(env!("OUT_DIR"), "/ucp_bindings.rs"));

/// The UCP library opened at run time unless [`LIBRARY_ENV`] names another.
pub const LIBRARY: &str = "libucp.so.0";

/// The variable naming the UCP library to open (a path, or a name the loader searches for).
pub const LIBRARY_ENV: &str = "KVXFER_UCX_LIBRARY";

static API: OnceLock<Result<UcpLibrary, String>> = OnceLock::new();

/// The library [`load`] opens: `$KVXFER_UCX_LIBRARY`, else [`LIBRARY`].
pub fn library_name() -> String {
    std::env::var(LIBRARY_ENV)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| LIBRARY.to_string())
}

/// Opens the UCP library once per process; later calls return the same result (the first
/// agent's choice holds for the process).
pub fn load() -> Result<&'static UcpLibrary, String> {
    API.get_or_init(|| {
        let name = library_name();
        // SAFETY: loading UCX runs its initialisers, as linking it would; every symbol we
        // bind is resolved now (`dynamic_link_require_all`), so a wrong library fails here.
        let lib = unsafe { UcpLibrary::new(&name) }.map_err(|e| {
            format!(
                "{name} cannot be loaded ({e}); install UCX >= 1.13 \
                 (`apt-get install libucx0`) or point {LIBRARY_ENV} at a libucp"
            )
        })?;
        // SAFETY: a static C string from the library just opened.
        let version = unsafe { CStr::from_ptr(lib.ucp_get_version_string()) };
        tracing::info!("UCX {} from {name}", version.to_string_lossy());
        Ok(lib)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The loaded library's version text (`"1.13.1"`), or why it cannot be loaded.
pub fn version() -> Result<String, String> {
    let lib = load()?;
    // SAFETY: `ucp_get_version_string` returns a static C string.
    Ok(unsafe { CStr::from_ptr(lib.ucp_get_version_string()) }
        .to_string_lossy()
        .into_owned())
}

/// The library; only called after [`load`] succeeded (every agent loads it first).
pub fn api() -> &'static UcpLibrary {
    match API.get() {
        Some(Ok(lib)) => lib,
        _ => unreachable!("UCX used before sys::load() succeeded"),
    }
}

/// `UCS_ERR_LAST`: status pointers at or above this address are errors.
const UCS_ERR_LAST: isize = -100;

/// What a `ucs_status_ptr_t` returned by an `_nbx` call means.
pub enum StatusPtr {
    /// Completed immediately.
    Done,
    /// Failed immediately.
    Failed(ucs_status_t),
    /// In flight: the request handle.
    Pending(*mut c_void),
}

/// `UCS_PTR_IS_ERR` / `UCS_PTR_STATUS` / `UCS_PTR_IS_PTR`.
pub fn classify(ptr: ucs_status_ptr_t) -> StatusPtr {
    if ptr.is_null() {
        StatusPtr::Done
    } else if ptr as usize >= UCS_ERR_LAST as usize {
        StatusPtr::Failed(ucs_status_t(ptr as isize as i8))
    } else {
        StatusPtr::Pending(ptr)
    }
}

/// UCX's text for a status.
pub fn status_text(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any value.
    unsafe {
        let p = api().ucs_status_string(status);
        if p.is_null() {
            format!("UCX status {}", status.0)
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Built with `regen-bindings` (as `cargo test --workspace --all-features` does), the
/// bindings the headers give now are compared with the committed ones.
#[cfg(all(test, feature = "regen-bindings"))]
mod committed {
    #[test]
    fn the_committed_bindings_are_what_the_ucx_headers_give() {
        let fresh = include_str!(concat!(env!("OUT_DIR"), "/ucp_bindings.rs"));
        let committed = include_str!("ucp_bindings.rs");
        assert!(
            fresh == committed,
            "transport-ucx/src/ucp_bindings.rs is not what the UCX headers give: run \
             scripts/ucx-bindings.sh"
        );
    }
}
