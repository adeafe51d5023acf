//! `kvxfer._kvxfer`: the Python extension module. Thin bindings over the Rust core — the
//! transport agent (`agent`), the pull connector halves (`pull`) — with typed exceptions
//! (`errors`) and memory checks at the boundary (`memory`).

mod agent;
mod errors;
mod memory;
mod pull;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _kvxfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<pull::PullScheduler>()?;
    m.add_class::<pull::PullWorker>()?;
    errors::add_all(m)?;
    Ok(())
}
