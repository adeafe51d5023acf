//! `kvxfer._kvxfer`: the Python extension module. Thin bindings over the Rust core — the
//! transport agent (`agent`), the pull connector halves (`pull`), the push connector's
//! registry and ranks (`push`) — with typed exceptions (`errors`), the cache description
//! (`cache`), host memory same-host peers map (`shared_memory`) and checks at the boundary
//! (`args`, `memory`).

mod agent;
mod args;
mod cache;
mod discovery;
mod errors;
mod memory;
mod pull;
mod push;
mod sglang_nixl;
mod shared_memory;
mod slot;

use pyo3::prelude::*;

/// The version of the UCX library the `ucx` transport uses in this process (`"1.23.0"`),
/// loading it on first use: the file `$KVXFER_UCX_LIBRARY` names, else the system's
/// `libucp.so.0`. One library per process: the first load decides.
#[pyfunction]
fn ucx_version(py: Python<'_>) -> PyResult<String> {
    py.detach(kvxfer::transports::ucx_version)
        .map_err(errors::transport)
}

/// `kv_connector_extra_config` (JSON text) as the vLLM connector of `flow` (`"pull"` or
/// `"push"`) reads it: every option, defaults filled in, as JSON text. Raises
/// InvalidArgumentError naming an unknown key or a value of the wrong type or out of bounds.
#[pyfunction]
fn connector_options(extra_json: &str, flow: &str) -> PyResult<String> {
    use kvxfer_core::options::{ConnectorOptions, Flow};
    let flow = match flow {
        "pull" => Flow::Pull,
        "push" => Flow::Push,
        other => {
            return Err(errors::InvalidArgumentError::new_err(format!(
                "flow {other:?}: expected \"pull\" or \"push\""
            )));
        }
    };
    ConnectorOptions::parse(extra_json, flow)
        .map(|o| o.to_json())
        .map_err(errors::InvalidArgumentError::new_err)
}

/// Sends the core's logs to stderr, where engines collect their workers' output: warnings
/// by default, or what `KVXFER_LOG` asks (a `RUST_LOG`-style filter, e.g. `kvxfer_core=debug`).
/// A process that already installed a subscriber keeps it.
fn init_logging() {
    let filter = std::env::var("KVXFER_LOG")
        .ok()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// The extension module.
#[pymodule]
fn _kvxfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
    m.add_function(wrap_pyfunction!(connector_options, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_nixl::sglang_nixl_registration, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_nixl::sglang_nixl_room, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_nixl::sglang_nixl_abort, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_nixl::sglang_nixl_from_prefill, m)?)?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<shared_memory::SharedHostMemory>()?;
    m.add_class::<pull::PullScheduler>()?;
    m.add_class::<pull::PullWorker>()?;
    m.add_class::<push::PushRegistry>()?;
    m.add_class::<push::PushPrefill>()?;
    m.add_class::<push::PushDecode>()?;
    m.add_class::<discovery::Registration>()?;
    m.add_class::<discovery::FleetWatch>()?;
    errors::add_all(m)?;
    Ok(())
}
