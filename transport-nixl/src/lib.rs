//! # kvxfer-transport-nixl
//!
//! The transport contract over NVIDIA NIXL (feature `nixl`). NIXL's C API
//! (`libnixl_capi.so`, shipped by every NIXL wheel) is declared in [`capi`] and opened at
//! run time, so building needs neither NIXL nor libclang: without the runtime, every
//! constructor returns a typed "not available" error with the install hint.
//!
//! Thread model: one [`NixlTransport`] is driven by one thread at a time (`&mut self`), as
//! the contract says; every call into the NIXL agent takes the agent's lock (registrations
//! are released from whichever thread drops their guard).
#![warn(missing_docs)]

#[cfg(feature = "nixl")]
mod agent;
#[cfg(feature = "nixl")]
mod capi;
pub mod metadata;
#[cfg(feature = "nixl")]
mod transport;

#[cfg(feature = "nixl")]
pub use transport::{NixlConfig, NixlTransport};

/// How to get the runtime (see `scripts/nixl-venv.sh`).
pub const INSTALL_HINT: &str = "install it with `scripts/nixl-venv.sh` (pip package nixl-cu12==1.5.1) and export the LD_LIBRARY_PATH and NIXL_PLUGIN_DIR it prints";

/// Whether the NIXL runtime can be opened in this process: `KVXFER_NIXL_LIBRARY` when set,
/// else `libnixl_capi.so` (the one already loaded under that name, or the loader's search
/// path), with every entry point kvxfer calls.
pub fn runtime_available() -> Result<(), String> {
    #[cfg(feature = "nixl")]
    {
        capi::api()
            .map(|_| ())
            .map_err(|e| format!("{e}; {INSTALL_HINT}"))
    }
    #[cfg(not(feature = "nixl"))]
    {
        Err("built without the `nixl` feature".into())
    }
}
