//! What a bench run is asked to do ([`BenchConfig`]) and how it can fail ([`BenchError`]):
//! the types the bench's parts share, so that none of them imports the bench's entry points.

use std::time::Duration;

use kvxfer_core::TransportError;
use kvxfer_layout::{BlockOrder, LayoutError};

use super::discovery::DiscoveryConfig;
use crate::models::ModelShape;
use crate::transports::TransportKind;

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
