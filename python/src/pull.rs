//! The pull connector halves for Python: `PullScheduler` (the engine scheduler's
//! bookkeeping) and `PullWorker` (one TP rank's worker: registration, side channel, READs,
//! leases, heartbeats). What travels from scheduler to workers (`build_step_meta`) and
//! between engines (`kv_transfer_params`) is JSON text, so an engine can pickle or forward it.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvxfer::AnyTransport;
use kvxfer_core::clock::SystemClock;
use kvxfer_core::options::{ConnectorOptions, Flow};
use kvxfer_core::pull;
use kvxfer_core::pull::{FailurePolicy, PullConfig, PullMetrics, StepMeta};
use kvxfer_core::wire::params::KvTransferParams;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::agent::transport_kind;
use crate::args::{BlockIds, seconds, seconds_or_zero};
use crate::cache;
use crate::errors::{self, InvalidArgumentError, LayoutError, ShutDownError, SideChannelError};
use crate::memory::Kept;

/// Largest step metadata accepted from the engine (block lists of many long prompts).
const MAX_STEP_META_BYTES: usize = 64 << 20;

fn params(json: Option<&str>) -> PyResult<Option<KvTransferParams>> {
    json.map(|j| KvTransferParams::from_json(j.as_bytes()))
        .transpose()
        .map_err(|e| InvalidArgumentError::new_err(e.to_string()))
}

/// `vllm_compat` as the engine adapter writes it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmCompatArgs {
    factors: kvxfer_core::wire::vllm::CompatFactors,
    enforce_hash: bool,
    region_names: Vec<String>,
    #[serde(default = "yes")]
    serve_decodes: bool,
}

fn yes() -> bool {
    true
}

fn parse_vllm_compat(json: &str) -> PyResult<pull::VllmCompat> {
    let a: VllmCompatArgs = serde_json::from_str(json)
        .map_err(|e| InvalidArgumentError::new_err(format!("vllm_compat: {e}")))?;
    Ok(pull::VllmCompat {
        factors: a.factors,
        enforce_hash: a.enforce_hash,
        region_names: a.region_names,
        serve_decodes: a.serve_decodes,
    })
}

/// Longest `get_finished` wait: the engine's step waits on it.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// The scheduler half: which requests load from a remote prefill, which the prefill holds.
#[pyclass(module = "kvxfer._kvxfer")]
pub struct PullScheduler {
    inner: pull::PullScheduler,
}

#[pymethods]
impl PullScheduler {
    /// A scheduler for `engine_id` (TP size `tp_size`), whose workers' side channels listen
    /// at `host:port`.
    #[new]
    #[pyo3(signature = (engine_id, host, port, tp_size = 1))]
    fn new(engine_id: &str, host: &str, port: u16, tp_size: u32) -> Self {
        PullScheduler {
            inner: pull::PullScheduler::new(engine_id, host, port).with_tp_size(tp_size),
        }
    }

    /// `(tokens, load_async)`: prompt tokens that request `req_id` loads from the remote
    /// prefill. From the first call that loads, the workers heartbeat the prefill's lease
    /// for it until its load starts or `request_finished` names it.
    #[pyo3(signature = (req_id, params_json, prompt_len, num_computed_tokens))]
    fn tokens_to_load(
        &mut self,
        req_id: &str,
        params_json: Option<&str>,
        prompt_len: usize,
        num_computed_tokens: usize,
    ) -> PyResult<(usize, bool)> {
        let p = params(params_json)?;
        self.inner
            .tokens_to_load(req_id, p.as_ref(), prompt_len, num_computed_tokens)
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))
    }

    /// Records a request after block allocation (`uncomputed_blocks`: its local blocks
    /// without a prefix hit, per KV cache group or flat for one); returns its updated params
    /// JSON. `load_end`: the token the load ends before, which a prefill with another block
    /// size needs (the local blocks receive `[load_end - num_external_tokens, load_end)`).
    /// `content`: what this engine expects the KV to be computed from, as the prefill's
    /// engine named it in `request_finished` (a stamped reference naming other content
    /// fails the load).
    #[pyo3(signature = (req_id, params_json, uncomputed_blocks, num_external_tokens, load_end = None, content = None))]
    fn after_alloc(
        &mut self,
        req_id: &str,
        params_json: &str,
        uncomputed_blocks: BlockIds,
        num_external_tokens: usize,
        load_end: Option<usize>,
        content: Option<u64>,
    ) -> PyResult<String> {
        let mut p = params(Some(params_json))?.unwrap_or_default();
        let blocks = uncomputed_blocks.into_groups();
        self.inner
            .after_alloc(
                req_id,
                &mut p,
                &blocks,
                num_external_tokens,
                load_end,
                content,
            )
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        Ok(p.to_json())
    }

    /// Records a load that cannot start (params kvxfer cannot read, `reason` says why): the
    /// workers report it failed with `uncomputed_blocks`, so the engine's failure policy
    /// decides instead of the prompt being computed silently.
    fn refuse_load(&mut self, req_id: &str, uncomputed_blocks: BlockIds, reason: &str) {
        let blocks = uncomputed_blocks.into_groups();
        self.inner.refuse_load(req_id, &blocks, reason);
    }

    /// The step's metadata for the workers, as JSON (the next call starts empty).
    fn build_step_meta(&mut self) -> String {
        // Plain strings and integers: serializing cannot fail.
        serde_json::to_string(&self.inner.build_step_meta()).unwrap_or_default()
    }

    /// `(delay_free, params_json or None)` for a request finishing: on the prefill side, whether
    /// its blocks wait for a decode and the params to hand it; on the decode side, it stops
    /// the heartbeats of a request that ended waiting. `block_ids`: per KV cache group, or
    /// flat for one. `content`: what the KV was computed from (e.g. a digest of the prompt's
    /// tokens), written into the hold's stamp for decodes to check.
    #[pyo3(signature = (req_id, params_json, length_capped, block_ids, content = None))]
    fn request_finished(
        &mut self,
        req_id: &str,
        params_json: Option<&str>,
        length_capped: bool,
        block_ids: BlockIds,
        content: Option<u64>,
    ) -> PyResult<(bool, Option<String>)> {
        let p = params(params_json)?;
        let blocks = block_ids.into_groups();
        let d = self
            .inner
            .request_finished(req_id, p.as_ref(), length_capped, &blocks, content);
        Ok((d.delay_free, d.params.map(|p| p.to_json())))
    }
}

/// One TP rank's worker over a transport of its own.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct PullWorker {
    inner: Mutex<Option<pull::PullWorker<AnyTransport>>>,
    /// The objects holding its cache regions (after `inner`: dropped once it deregistered
    /// them).
    _keep: Kept,
}

impl PullWorker {
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut pull::PullWorker<AnyTransport>) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut guard: MutexGuard<'_, _> = self.inner.lock().map_err(|_| {
                errors::KvxferError::new_err("worker state poisoned by an earlier panic")
            })?;
            let w = guard
                .as_mut()
                .ok_or_else(|| ShutDownError::new_err("the worker was shut down"))?;
            f(w)
        })
    }
}

#[pymethods]
impl PullWorker {
    /// Registers the cache `layout` (the dict `PushDecode` and `PushPrefill` take: `kind`,
    /// `order`, `dtype`, `num_layers`, `kv_heads`, `head_dim`, `tokens_per_block`,
    /// `num_blocks`, `bases`, `total_kv_heads`, `total_layers`, optional `first_layer`,
    /// `memory`, `groups`, `state_groups`; `bases`: one per region, each region
    /// `num_blocks * block_len` bytes and mapped in this process: an address, or an object
    /// with `data_ptr()` or `__array_interface__`, kept alive as long as the worker) and
    /// starts the listener. `options`: `kv_connector_extra_config` as JSON (KvxferConnector's
    /// keys, checked as the connector checks them; the worker reads its side channel, lease,
    /// timeouts, `enforce_compat` and `digest`); what it leaves out keeps the core's defaults.
    #[new]
    #[pyo3(signature = (
        agent_name, transport, layout, *, engine_id, tp_rank, tp_size, options = None,
        dp_rank_local = 0, backend_name = "kvxfer", heartbeat_interval = None,
        failure_policy = "fail", prepared_lists = true, vllm_compat = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent_name: &str,
        transport: &str,
        layout: &Bound<'_, PyDict>,
        engine_id: &str,
        tp_rank: u32,
        tp_size: u32,
        options: Option<&str>,
        dp_rank_local: u32,
        backend_name: &str,
        heartbeat_interval: Option<f64>,
        failure_policy: &str,
        prepared_lists: bool,
        vllm_compat: Option<&str>,
    ) -> PyResult<Self> {
        let mut keep = Kept::new();
        let cache = cache::from_dict(layout, &mut keep)?;
        if tp_size == 0 || tp_rank >= tp_size {
            return Err(InvalidArgumentError::new_err(format!(
                "tp_rank {tp_rank} of tp_size {tp_size}"
            )));
        }
        // The connector's options (`kv_connector_extra_config`) become the worker's settings
        // in the core, which holds their defaults (`ConnectorOptions`, `PullConfig::new`).
        let options = ConnectorOptions::parse(options.unwrap_or("null"), Flow::Pull)
            .map_err(InvalidArgumentError::new_err)?;
        let mut config = options.pull_config(PullConfig::new(engine_id, tp_rank, tp_size));
        config.dp_rank_local = dp_rank_local;
        config.backend_name = backend_name.into();
        if let Some(s) = heartbeat_interval {
            config.heartbeat_interval = seconds("heartbeat_interval", s)?;
        }
        config.failure_policy = match failure_policy {
            "fail" => FailurePolicy::Fail,
            "recompute" => FailurePolicy::Recompute,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "failure_policy {other:?}: expected fail or recompute"
                )));
            }
        };
        config.prepared_lists = prepared_lists;
        config.vllm = vllm_compat.map(parse_vllm_compat).transpose()?;
        let tkind = transport_kind(transport)?;
        let name = agent_name.to_string();
        let worker = py.detach(move || {
            let t = kvxfer::open(tkind, &name).map_err(errors::transport)?;
            pull::PullWorker::new(t, config, cache, Arc::new(SystemClock::default())).map_err(|e| {
                match e {
                    pull::PullError::Transport(t) => errors::transport(t),
                    pull::PullError::Layout(l) => LayoutError::new_err(l.to_string()),
                    pull::PullError::SideChannel(s) => SideChannelError::new_err(s),
                    pull::PullError::Config(c) => InvalidArgumentError::new_err(c),
                }
            })
        })?;
        Ok(PullWorker {
            inner: Mutex::new(Some(worker)),
            _keep: keep,
        })
    }

    /// The port this rank's side-channel listener is bound to.
    fn listener_port(&self, py: Python<'_>) -> PyResult<Option<u16>> {
        self.with(py, |w| Ok(w.listener_port()))
    }

    /// This worker's random instance id (a restarted rank has a new one).
    fn instance(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |w| Ok(w.instance()))
    }

    /// A digest of this rank's cache geometry (`sha256:` and 16 hex digits).
    fn layout_digest(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |w| Ok(w.layout_digest().to_owned()))
    }

    /// Discovery reports `engine_id` gone or restarted: its loads in flight fail now (they
    /// come out of `get_finished`), its connection is dropped, the next load handshakes.
    fn engine_lost(&self, py: Python<'_>, engine_id: &str, reason: &str) -> PyResult<()> {
        self.with(py, |w| {
            w.engine_lost(engine_id, reason);
            Ok(())
        })
    }

    /// Starts the step's loads and holds (`meta_json` from `PullScheduler.build_step_meta`);
    /// never blocks on a peer. Returns why any load was refused (a load of the same request
    /// already in flight): the others start regardless.
    fn start_load_kv(&self, py: Python<'_>, meta_json: &str) -> PyResult<Vec<String>> {
        if meta_json.len() > MAX_STEP_META_BYTES {
            return Err(InvalidArgumentError::new_err(
                "step metadata exceeds 64 MiB",
            ));
        }
        let meta: StepMeta = serde_json::from_str(meta_json)
            .map_err(|e| InvalidArgumentError::new_err(format!("step metadata: {e}")))?;
        self.with(py, |w| {
            Ok(w.start_load_kv(&meta)
                .iter()
                .map(ToString::to_string)
                .collect())
        })
    }

    /// `(sending, recving, failed)` since the last call; `failed` holds
    /// `(req_id, invalid_blocks, reason, policy)`. Failed loads are also in `recving`.
    /// With `wait` (seconds, at most 1), waits up to that long for something to finish
    /// while loads or holds are outstanding (for an engine step that scheduled nothing).
    #[pyo3(signature = (wait = 0.0))]
    #[allow(clippy::type_complexity)]
    fn get_finished(
        &self,
        py: Python<'_>,
        wait: f64,
    ) -> PyResult<(
        Vec<String>,
        Vec<String>,
        Vec<(String, Vec<u32>, String, &'static str)>,
    )> {
        let wait = seconds_or_zero("wait", wait)?;
        if wait > MAX_WAIT {
            return Err(InvalidArgumentError::new_err(format!(
                "wait must be at most {} s",
                MAX_WAIT.as_secs()
            )));
        }
        let f = self.with(py, |w| Ok(w.wait_finished(wait)))?;
        let failed = f
            .failed
            .into_iter()
            .map(|l| {
                let policy = match l.policy {
                    FailurePolicy::Fail => "fail",
                    FailurePolicy::Recompute => "recompute",
                };
                (l.req_id, l.invalid_blocks, l.reason, policy)
            })
            .collect();
        Ok((f.sending, f.recving, failed))
    }

    /// Counters since the last call (reset on read), durations in seconds.
    fn take_metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.with(py, |w| Ok(w.take_metrics()))?;
        metrics_dict(py, &m)
    }

    /// Stops the listener and handshake threads, releases transfers and deregisters the
    /// cache. Calling it twice is fine; other calls afterwards raise `ShutDownError`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let taken = self
                .inner
                .lock()
                .map_err(|_| {
                    errors::KvxferError::new_err("worker state poisoned by an earlier panic")
                })?
                .take();
            if let Some(mut w) = taken {
                w.shutdown();
            }
            Ok(())
        })
    }
}

fn metrics_dict<'py>(py: Python<'py>, m: &PullMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("transfers", m.transfers)?;
    d.set_item("indexed_transfers", m.indexed_transfers)?;
    d.set_item("bytes", m.bytes)?;
    d.set_item("descriptors_raw", m.descriptors_raw)?;
    d.set_item("descriptors_posted", m.descriptors_posted)?;
    d.set_item("post_time", m.post_time.as_secs_f64())?;
    d.set_item("plan_time", m.plan_time.as_secs_f64())?;
    d.set_item("transfer_time", m.transfer_time.as_secs_f64())?;
    d.set_item("failed_handshakes", m.failed_handshakes)?;
    d.set_item("failed_setups", m.failed_setups)?;
    d.set_item("failed_transfers", m.failed_transfers)?;
    d.set_item("failed_notifications", m.failed_notifications)?;
    d.set_item("heartbeats", m.heartbeats)?;
    d.set_item("expired_leases", m.expired_leases)?;
    d.set_item("expired_reads", m.expired_reads)?;
    d.set_item("verified_references", m.verified_references)?;
    d.set_item("stale_references", m.stale_references)?;
    d.set_item("verified_digests", m.verified_digests)?;
    d.set_item("digest_mismatches", m.digest_mismatches)?;
    d.set_item("digest_time", m.digest_time.as_secs_f64())?;
    d.set_item("refused_loads", m.refused_loads)?;
    d.set_item("lost_connections", m.lost_connections)?;
    d.set_item("peer_restarts", m.peer_restarts)?;
    d.set_item("closed_connections", m.closed_connections)?;
    d.set_item("refused_notes", m.refused_notes)?;
    d.set_item("handshake_time", m.handshake_time.as_secs_f64())?;
    d.set_item("handshakes", m.handshakes)?;
    Ok(d)
}
