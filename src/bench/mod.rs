//! `kvxfer bench`: a prefill engine and a decode engine in one process, moving batches of
//! requests over a transport and verifying every byte, measured in the same run against
//! single-thread memcpy of the same bytes and the machine's copy ceiling (all cores,
//! streaming stores) for the same piece size.

mod blocks;
pub mod chart;
mod discovery;
mod fill;
mod pull;
mod push;
mod rank;
mod report;
mod timing;

use std::time::Duration;

use kvxfer_core::TransportError;
use kvxfer_layout::{BlockOrder, LayoutError};

use crate::models::ModelShape;
use crate::transports::TransportKind;
pub use discovery::DiscoveryConfig;
pub use report::BenchReport;

/// Transfer style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Decode READs (vLLM style).
    Pull,
    /// Prefill WRITEs (SGLang style).
    Push,
}

/// Where the caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory.
    Host,
    /// Host memory in kvxfer shared memory (`kvxfer_host_mem::shm::SharedHostMem`): a same-host
    /// UCX peer maps it and its transfers are host copies.
    SharedHost,
    /// GPU memory.
    Gpu,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Model shape.
    pub model: ModelShape,
    /// In-block order.
    pub order: BlockOrder,
    /// Prefill TP.
    pub prefill_tp: u32,
    /// Prefill pipeline stages (push mode).
    pub prefill_pp: u32,
    /// Decode TP.
    pub decode_tp: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per region (raised to fit `concurrency` requests).
    pub num_blocks: u32,
    /// Measured requests.
    pub requests: u32,
    /// Tokens per request.
    pub tokens_per_request: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Unmeasured requests first (the first one includes the handshake).
    pub warmup: u32,
    /// Whether block ids are scattered (true) or consecutive (false).
    pub fragmented: bool,
    /// Transport.
    pub transport: TransportKind,
    /// Memory kind.
    pub memory: Memory,
    /// Transfer style.
    pub mode: Mode,
    /// Seed of the block choice.
    pub seed: u64,
    /// Decode only: pull from a prefill served by `kvxfer serve` at this side channel.
    pub connect: Option<(String, u16)>,
    /// Pull: a READ pending longer than this is cancelled and its request failed.
    pub transfer_timeout: Duration,
    /// Pull: never post by index into prepared lists (see `PullConfig::prepared_lists`).
    pub raw_posts: bool,
    /// Pull: a failed request is counted and the run goes on (a prefill that restarts
    /// under the run); without it the first failure ends the run.
    pub keep_going: bool,
    /// Pull: find the prefill (`bench`) or register it (`serve`) through etcd.
    pub discovery: Option<DiscoveryConfig>,
    /// Content digests on, after a run with them off (see [`run`]); push: the decode asks
    /// for them.
    pub digest: bool,
}

/// Why a bench could not run or failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The configuration cannot run here.
    #[error("{0}")]
    Config(String),
    /// A layout parameter is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The transport refused.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A load failed.
    #[error("request {req} failed: {reason}")]
    Failed {
        /// Request id.
        req: String,
        /// Why.
        reason: String,
    },
    /// Bytes arrived wrong.
    #[error("verification failed: {0}")]
    Verification(String),
    /// The caches do not fit in this machine's memory.
    #[error("KV cache: {0}")]
    Memory(#[from] kvxfer_host_mem::mem::HostMemError),
}

/// Runs the bench. `progress(done, total)` is called as requests finish.
pub fn run(c: &BenchConfig, progress: &mut dyn FnMut(u32, u32)) -> Result<BenchReport, BenchError> {
    crate::transports::availability(c.transport)?;
    if c.memory == Memory::Gpu {
        return Err(BenchError::Config(
            "GPU memory in `bench` is not supported yet; use --memory host (the loopback's GPU path is compiled with `--features cuda` but has not run on a GPU yet)".into(),
        ));
    }
    if c.requests == 0 || c.concurrency == 0 || c.tokens_per_request == 0 || c.block_size == 0 {
        return Err(BenchError::Config(
            "requests, concurrency, tokens per request and block size must be positive".into(),
        ));
    }
    if let Some(d) = &c.discovery {
        discovery::check(d, c.connect.is_some())?;
    }
    if c.connect.is_some() || c.discovery.is_some() {
        in_process_only(c)?;
    }
    if c.digest {
        return with_and_without_digests(c, progress);
    }
    run_mode(c, progress)
}

/// One run of the bench in its mode.
fn run_mode(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    match c.mode {
        Mode::Push => push::run(c, progress),
        Mode::Pull => pull::run(c, progress),
    }
}

/// `--digest`: the same bench without content digests, then with them; the report is the
/// second run's, with the first's throughput and their ratio.
fn with_and_without_digests(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    if c.mode == Mode::Pull && (c.connect.is_some() || c.discovery.is_some()) {
        return Err(BenchError::Config(
            "--digest in pull mode runs both engines here (a served prefill holds no request to digest)".into(),
        ));
    }
    let off = run_mode(
        &BenchConfig {
            digest: false,
            ..c.clone()
        },
        progress,
    )?;
    let mut on = run_mode(c, progress)?;
    on.digest_off_gb_per_s = off.gb_per_s;
    on.digest_on_to_off = on.gb_per_s / off.gb_per_s.max(1e-9);
    Ok(on)
}

/// `kvxfer serve --role prefill`: fills a prefill engine's caches, listens on `port` (rank r
/// on `port + r`) and answers reads until `stop` is set. Decode processes run
/// `kvxfer bench --connect HOST:PORT` with the same model, TP, block size and blocks.
pub fn serve(
    c: &BenchConfig,
    host: &str,
    port: u16,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), BenchError> {
    crate::transports::availability(c.transport)?;
    in_process_only(c)?;
    if let Some(d) = &c.discovery {
        discovery::check(d, false)?;
        discovery::check_registered_host(host)?;
    }
    if c.mode == Mode::Push {
        return push::serve(c, host, port, stop);
    }
    pull::serve(c, host, port, stop)
}

/// The loopback's agents live in one process: refuse it for runs that span processes.
fn in_process_only(c: &BenchConfig) -> Result<(), BenchError> {
    if c.transport == TransportKind::Loopback {
        return Err(BenchError::Config(
            "the loopback transport cannot cross processes; use --transport ucx or nixl".into(),
        ));
    }
    Ok(())
}
