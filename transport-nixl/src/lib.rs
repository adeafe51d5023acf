//! # kvxfer-transport-nixl
//!
//! The transport contract over NVIDIA NIXL (feature `nixl`). `nixl-sys` is built with its
//! stub API and loads `libnixl_capi.so` at run time — and aborts the process if it is
//! missing — so [`runtime_available`] probes for the library first and every constructor
//! returns a typed "not available" error, with the install hint, instead.
//!
//! Thread model: one [`NixlTransport`] is driven by one thread at a time (`&mut self`), as
//! the contract says; NIXL's own agent lock serializes post, status and notification calls.
#![warn(missing_docs)]

pub mod metadata;
#[cfg(feature = "nixl")]
mod transport;

#[cfg(feature = "nixl")]
pub use transport::{NixlConfig, NixlTransport};

/// How to get the runtime (see `scripts/nixl-venv.sh`).
pub const INSTALL_HINT: &str = "install it with `scripts/nixl-venv.sh` (pip package nixl-cu12==1.5.1) and export the LD_LIBRARY_PATH and NIXL_PLUGIN_DIR it prints";

/// Whether the NIXL runtime library can be loaded in this process.
pub fn runtime_available() -> Result<(), String> {
    #[cfg(feature = "nixl")]
    {
        // SAFETY: loading the NIXL C API library runs its initialisers, as any NIXL user does;
        // the handle is dropped right after (the stub loader opens it again).
        match unsafe { libloading::Library::new("libnixl_capi.so") } {
            Ok(_) => Ok(()),
            Err(e) => Err(format!(
                "libnixl_capi.so cannot be loaded ({e}); {INSTALL_HINT}"
            )),
        }
    }
    #[cfg(not(feature = "nixl"))]
    {
        Err("built without the `nixl` feature".into())
    }
}
