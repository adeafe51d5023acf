//! Configuration of a pull worker.

use std::time::Duration;

use crate::wire::handshake::MAX_HANDSHAKE_BYTES;
pub use crate::wire::vllm_peer::VllmCompat;

/// What the engine should do with a request whose KV cache could not be loaded. kvxfer only
/// reports the failure: the request appears in `Finished::recving` and `Finished::failed`
/// with the local blocks whose content is invalid and this policy, after no transfer writes
/// into them any more. The engine acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// End the request with an error (vLLM: finish reason `error`) and free its blocks.
    Fail,
    /// Treat the invalid blocks as not computed and compute their tokens locally (vLLM
    /// reschedules the request from its first invalid block), so the request completes as if
    /// no KV had been sent, only later.
    Recompute,
}

/// Settings of a pull worker.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// This engine's id.
    pub engine_id: String,
    /// TP rank of this worker.
    pub tp_rank: u32,
    /// TP size of this engine.
    pub tp_size: u32,
    /// Local data-parallel rank (for the listener port).
    pub dp_rank_local: u32,
    /// Host the listener binds (loopback by default; binding elsewhere is explicit).
    pub side_channel_host: String,
    /// Base port of the listeners; 0 lets this worker's listener pick a free port (tests).
    pub side_channel_port: u16,
    /// Attention backend name, compared between sides.
    pub backend_name: String,
    /// Bound on every side-channel wait.
    pub handshake_timeout: Duration,
    /// Largest handshake reply accepted.
    pub max_handshake_bytes: usize,
    /// How long the prefill holds unread blocks without hearing from the decode.
    pub lease: Duration,
    /// How often the decode renews leases of requests it waits for.
    pub heartbeat_interval: Duration,
    /// Decode side: a connection to a prefill engine that no request loaded from or waited
    /// for this long is closed (its endpoints, keys and mappings go; the next load
    /// handshakes again). One whose rank the transport saw fail is closed at the next
    /// heartbeat tick. Bounds what a long run keeps of engines that restarted under new
    /// ids. 10 minutes by default.
    pub idle_engine_timeout: Duration,
    /// A READ still in progress after this long is cancelled and its load reported failed
    /// (a cut link can leave a transfer pending for as long as TCP retries).
    pub transfer_timeout: Duration,
    /// What engines should do with failed loads.
    pub failure_policy: FailurePolicy,
    /// Refuse peers whose layout is incompatible (on by default).
    pub enforce_compat: bool,
    /// With transports that build requests faster from prepared lists (NIXL), prepare
    /// per-block lists at the handshake and post requests that coalescing would shrink by
    /// less than a tenth by index, as vLLM does; the others post coalesced plans. On by
    /// default.
    pub prepared_lists: bool,
    /// Speak vLLM 0.32's handshake with stock vLLM peers: serve them this rank's cache and
    /// pull from them. `None`: kvxfer peers only.
    pub vllm: Option<VllmCompat>,
    /// Prefill side: name this rank's stamp table in its handshake, so that decodes check
    /// each reference after reading (`pull::stamps`). On by default; off only for a prefill
    /// that serves its memory without holding requests (`kvxfer serve` for the benchmark,
    /// whose decode makes its references up).
    pub stamp_references: bool,
    /// Content digests (`kvxfer_core::digest`): a prefill publishes a digest of each held
    /// block's heads, and a decode reports a load done only once the bytes it received
    /// digest the same, failing it otherwise. Both sides must have it on (a decode refuses
    /// a prefill that publishes none). Host memory only, and references must be stamped.
    /// Off by default.
    pub digest: bool,
}

impl PullConfig {
    /// Defaults for `engine_id`, rank `tp_rank` of `tp_size`.
    pub fn new(engine_id: &str, tp_rank: u32, tp_size: u32) -> Self {
        let lease = Duration::from_secs(30);
        PullConfig {
            engine_id: engine_id.into(),
            tp_rank,
            tp_size,
            dp_rank_local: 0,
            side_channel_host: "127.0.0.1".into(),
            side_channel_port: 5600,
            backend_name: "kvxfer".into(),
            handshake_timeout: Duration::from_secs(5),
            max_handshake_bytes: MAX_HANDSHAKE_BYTES,
            lease,
            heartbeat_interval: lease / 6,
            idle_engine_timeout: Duration::from_secs(600),
            transfer_timeout: Duration::from_secs(30),
            failure_policy: FailurePolicy::Fail,
            enforce_compat: true,
            prepared_lists: true,
            vllm: None,
            stamp_references: true,
            digest: false,
        }
    }

    /// Sets the lease, and the heartbeat interval with it: a sixth of the lease, so that a
    /// decode's heartbeats reach the prefill several times within each lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.heartbeat_interval = lease / 6;
        self
    }
}
