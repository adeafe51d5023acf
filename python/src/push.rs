//! The push connector for Python: `PushRegistry` (the prefill instance's bootstrap
//! registry), `PushPrefill` (one prefill rank: takes decode destinations, WRITEs each room's
//! chunks) and `PushDecode` (one decode rank: registers with the prefill ranks it needs, sends
//! each room's destinations, tracks completion). Statuses are SGLang's `KVPoll` numbers:
//! 0 failed, 1 bootstrapping, 2 waiting for input, 3 transferring, 4 success.

use std::sync::Arc;

use kvxfer::AnyTransport;
use kvxfer_core::clock::SystemClock;
use kvxfer_core::push::messages::BufferWire;
use kvxfer_core::push::{self, PushBuffers, PushError, PushMetrics, Rooms, StateKind};
use kvxfer_core::{MemoryKind, Transport};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::agent::transport_kind;
use crate::args::seconds;
use crate::cache;
use crate::errors::{self, InvalidArgumentError, SideChannelError, TransferFailedError};
use crate::memory::{Kept, base_of, check_host_mapped};
use crate::slot::Slot;

/// `(base, item_len, items)` triples as the push side registers them.
/// Aux or state buffers: `(base, item_len, items)`, the base an address or an object holding
/// the buffer (kept alive).
type Buffers<'py> = Vec<(Bound<'py, PyAny>, u64, u32)>;

/// The rank's buffers: the KV cache `layout` (the keys `PullWorker` takes), aux buffers
/// (host memory) and state buffers (beside the KV cache), each checked to be mapped.
fn buffers(
    layout: &Bound<'_, PyDict>,
    aux: Buffers<'_>,
    state: Buffers<'_>,
    state_kind: &str,
    keep: &mut Kept,
) -> PyResult<PushBuffers> {
    let kv = cache::from_dict(layout, keep)?;
    let state_kind = match state_kind {
        "none" => StateKind::None,
        "mamba" => StateKind::Mamba,
        "window" => StateKind::Window,
        other => {
            return Err(InvalidArgumentError::new_err(format!(
                "state_kind {other:?}: expected none, mamba or window"
            )));
        }
    };
    if state_kind == StateKind::None && !state.is_empty() {
        return Err(InvalidArgumentError::new_err(
            "state buffers given with state_kind none",
        ));
    }
    let mut wire = |list: Buffers<'_>, host: bool| -> PyResult<Vec<BufferWire>> {
        list.into_iter()
            .map(|(obj, item_len, items)| {
                let len = item_len.checked_mul(u64::from(items)).ok_or_else(|| {
                    InvalidArgumentError::new_err("a buffer's size overflows the address space")
                })?;
                let base = base_of(&obj, len, keep)?;
                let b = BufferWire {
                    base,
                    item_len,
                    items,
                };
                let len = b.end().map(|e| e - base).ok_or_else(|| {
                    InvalidArgumentError::new_err("a buffer's size overflows the address space")
                })?;
                if host && len > 0 {
                    check_host_mapped(kvxfer_core::AddrRange::new(base, len))?;
                }
                Ok(b)
            })
            .collect()
    };
    let state_host = kv.memory == MemoryKind::Host;
    Ok(PushBuffers {
        aux: wire(aux, true)?,
        state: wire(state, state_host)?,
        state_kind,
        kv,
    })
}

fn push_error(e: PushError) -> PyErr {
    match e {
        PushError::Setup(s) => TransferFailedError::new_err(s),
        other => InvalidArgumentError::new_err(other.to_string()),
    }
}

/// A prefill instance's bootstrap registry: its ranks register, decodes ask for the layout.
/// A restarted instance's registry has a new `instance` id, which tells decodes to register
/// again.
/// Binds the room API both push sides share ([`push::Rooms`]) on `$class`, whose `inner`
/// slot holds a `$core`: once for both classes (`multiple-pymethods`).
macro_rules! room_methods {
    ($class:ident, $core:ty) => {
        #[pymethods]
        impl $class {
            /// The room's status (0 failed, 1 bootstrapping, 2 waiting for input,
            /// 3 transferring, 4 success), or `None` for a room this rank has not heard of.
            fn status(&self, py: Python<'_>, room: u64) -> PyResult<Option<u8>> {
                self.inner.with(py, <$core as Rooms>::SIDE, |r| {
                    Ok(Rooms::status(r, room).map(|s| s as u8))
                })
            }

            /// Why the room failed.
            fn error(&self, py: Python<'_>, room: u64) -> PyResult<Option<String>> {
                self.inner
                    .with(py, <$core as Rooms>::SIDE, |r| Ok(Rooms::error(r, room)))
            }

            /// Gives up on the room. A prefill rank fails it, releases its WRITEs and tells
            /// the decodes it alone writes into; a decode rank tells its prefill ranks, which
            /// acknowledge once they stopped writing into it (see `PushDecode.drained`).
            fn abort(&self, py: Python<'_>, room: u64) -> PyResult<()> {
                self.inner.with(py, <$core as Rooms>::SIDE, |r| {
                    Rooms::abort(r, room);
                    Ok(())
                })
            }

            /// Forgets the room (a live one is aborted first). A decode rank keeps one that a
            /// prefill rank may still write into aside until it drains, or for the waiting
            /// timeout at most.
            fn remove_room(&self, py: Python<'_>, room: u64) -> PyResult<()> {
                self.inner.with(py, <$core as Rooms>::SIDE, |r| {
                    Rooms::remove_room(r, room);
                    Ok(())
                })
            }

            /// Processes control messages and results, transfer completions, notifications,
            /// timeouts and liveness. Never blocks.
            fn poll(&self, py: Python<'_>) -> PyResult<()> {
                self.inner.with(py, <$core as Rooms>::SIDE, |r| {
                    Rooms::poll(r);
                    Ok(())
                })
            }
        }
    };
}

room_methods!(PushPrefill, push::PushPrefill<AnyTransport>);
room_methods!(PushDecode, push::PushDecode<AnyTransport>);

#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct PushRegistry {
    inner: Slot<push::BootstrapRegistry>,
    port: u16,
    instance: u64,
}

#[pymethods]
impl PushRegistry {
    /// Serves on `host:port` (0 picks a free port).
    #[new]
    #[pyo3(signature = (host = "127.0.0.1", port = 0))]
    fn new(py: Python<'_>, host: &str, port: u16) -> PyResult<Self> {
        let r = py
            .detach(|| push::BootstrapRegistry::bind(host, port))
            .map_err(SideChannelError::new_err)?;
        Ok(PushRegistry {
            port: r.port(),
            instance: r.instance(),
            inner: Slot::new(r),
        })
    }

    /// The bound port.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// This prefill instance's random id.
    #[getter]
    fn instance(&self) -> u64 {
        self.instance
    }

    /// Stops serving. Calling it twice is fine.
    fn shutdown(&self, py: Python<'_>) {
        self.inner.shutdown(py);
    }
}

/// One prefill rank over a transport of its own.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct PushPrefill {
    inner: Arc<Slot<push::PushPrefill<AnyTransport>>>,
    port: u16,
    /// The objects holding its buffers (after `inner`: dropped once it deregistered them).
    _keep: Kept,
}

/// How often a prefill rank is polled while its engine does not poll it.
const IDLE_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// Polls `slot` every [`IDLE_POLL`] (skipping turns the engine holds it) until it is shut
/// down or dropped: a decode's abort is processed, its WRITEs released and acknowledged, even
/// when the prefill engine has no request left to poll for (the decode holds the room's pages
/// until then).
fn poll_while_idle(slot: &Arc<Slot<push::PushPrefill<AnyTransport>>>) -> std::io::Result<()> {
    let weak = Arc::downgrade(slot);
    std::thread::Builder::new()
        .name("kvx-push-idle".into())
        .spawn(move || {
            loop {
                std::thread::sleep(IDLE_POLL);
                let Some(slot) = weak.upgrade() else { return };
                if !slot.try_with(|p| p.poll()) {
                    return;
                }
            }
        })
        .map(drop)
}

#[pymethods]
impl PushPrefill {
    /// Registers the buffers, opens this rank's mailbox on `host:port` and registers the rank
    /// with the registry at `registry`. A decode idle for `idle_decode_timeout` seconds (or
    /// whose connection failed) is forgotten; it registers again with its next room.
    #[new]
    #[pyo3(signature = (
        agent_name, transport, layout, *, registry, tp_rank, tp_size, pp_rank = 0,
        pp_size = 1, aux = Vec::new(), state = Vec::new(), state_kind = "none",
        host = "127.0.0.1", port = 0, bootstrap_timeout = 300.0, request_timeout = 2.0,
        idle_decode_timeout = 600.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent_name: &str,
        transport: &str,
        layout: &Bound<'_, PyDict>,
        registry: (String, u16),
        tp_rank: u32,
        tp_size: u32,
        pp_rank: u32,
        pp_size: u32,
        aux: Buffers<'_>,
        state: Buffers<'_>,
        state_kind: &str,
        host: &str,
        port: u16,
        bootstrap_timeout: f64,
        request_timeout: f64,
        idle_decode_timeout: f64,
    ) -> PyResult<Self> {
        let mut keep = Kept::new();
        let bufs = buffers(layout, aux, state, state_kind, &mut keep)?;
        if tp_size == 0 || tp_rank >= tp_size || pp_size == 0 || pp_rank >= pp_size {
            return Err(InvalidArgumentError::new_err(format!(
                "tp_rank {tp_rank} of tp_size {tp_size}, pp_rank {pp_rank} of pp_size {pp_size}"
            )));
        }
        let config = push::PushPrefillConfig {
            tp: (tp_rank, tp_size),
            pp: (pp_rank, pp_size),
            host: host.into(),
            port,
            registry,
            bootstrap_timeout: seconds("bootstrap_timeout", bootstrap_timeout)?,
            request_timeout: seconds("request_timeout", request_timeout)?,
            idle_decode_timeout: seconds("idle_decode_timeout", idle_decode_timeout)?,
        };
        let tkind = transport_kind(transport)?;
        let name = agent_name.to_string();
        let p = py.detach(move || {
            let t = kvxfer::open(tkind, &name).map_err(errors::transport)?;
            push::PushPrefill::new(t, config, bufs, Arc::new(SystemClock::default()))
                .map_err(|e| SideChannelError::new_err(e.to_string()))
        })?;
        let port = p.port();
        let inner = Arc::new(Slot::new(p));
        poll_while_idle(&inner).map_err(|e| errors::KvxferError::new_err(e.to_string()))?;
        Ok(PushPrefill {
            port,
            inner,
            _keep: keep,
        })
    }

    /// The mailbox port.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Registers this rank in etcd at `url` (`etcd://HOST:PORT[,...]`) as a rank of push
    /// prefill `engine_id` in `cluster`, named by `bootstrap` (the address decodes' rooms
    /// give), under this process's `instance`, on a lease of `ttl` seconds; a decode whose
    /// directory is that etcd then learns the rank from it. Raises `DiscoveryError` when etcd
    /// is unreachable or refuses.
    #[pyo3(signature = (url, cluster, engine_id, bootstrap, instance, ttl = 10.0))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        url: &str,
        cluster: &str,
        engine_id: &str,
        bootstrap: (String, u16),
        instance: u64,
        ttl: f64,
    ) -> PyResult<crate::discovery::Registration> {
        if !(ttl.is_finite() && (2.0..=3600.0).contains(&ttl)) {
            return Err(InvalidArgumentError::new_err("ttl: 2 to 3600 seconds"));
        }
        let info = self
            .inner
            .with(py, "prefill", |p| Ok(p.rank_info().clone()))?;
        let records = push::push_records(cluster, engine_id, &bootstrap, instance, &[info])
            .map_err(InvalidArgumentError::new_err)?;
        let client = crate::discovery::client(url)?;
        let ttl = std::time::Duration::from_secs_f64(ttl);
        let r = py
            .detach(|| kvxfer_discovery::etcd::Registrar::start(client, ttl, records))
            .map_err(crate::discovery::discovery)?;
        Ok(crate::discovery::Registration::from_registrar(r))
    }

    /// Adds a room this rank sends `total_pages` pages of, with the engine's `aux_index` and
    /// `state_indices` (sent with the last chunk).
    #[pyo3(signature = (room, total_pages, aux_index = None, state_indices = Vec::new()))]
    fn add_room(
        &self,
        py: Python<'_>,
        room: u64,
        total_pages: usize,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
    ) -> PyResult<()> {
        self.inner.with(py, "prefill", |p| {
            p.add_room(room, total_pages, aux_index, state_indices);
            Ok(())
        })
    }

    /// Whether every decode destination of `room` this rank serves has asked for it.
    fn destinations_ready(&self, py: Python<'_>, room: u64) -> PyResult<bool> {
        self.inner
            .with(py, "prefill", |p| Ok(p.destinations_ready(room)))
    }

    /// The prompt tokens `room`'s decode holds already (its radix cache), once a destination
    /// asked: send only the pages after them. `None` for an unknown room or one not asked for.
    fn decode_prefix(&self, py: Python<'_>, room: u64) -> PyResult<Option<u64>> {
        self.inner
            .with(py, "prefill", |p| Ok(p.decode_prefix(room)))
    }

    /// How many of `room`'s pages each KV cache group of a hybrid model takes, in group
    /// order (empty for one group), once a destination with pages asked: send each group's
    /// pages in that order, each group's the blocks ending where the decode's do. `None`
    /// for an unknown room or one not asked for.
    fn decode_group_pages(&self, py: Python<'_>, room: u64) -> PyResult<Option<Vec<u32>>> {
        self.inner
            .with(py, "prefill", |p| Ok(p.decode_group_pages(room)))
    }

    /// Sends the room's next chunk from this rank's `pages`; the chunk that completes the room
    /// also carries aux and state (`state_indices` replaces those given to `add_room`).
    /// Raises `InvalidArgumentError` when the room is unknown, not ready or has fewer pages
    /// left, `TransferFailedError` when posting failed (the room has failed then).
    #[pyo3(signature = (room, pages, state_indices = None))]
    fn send(
        &self,
        py: Python<'_>,
        room: u64,
        pages: Vec<u32>,
        state_indices: Option<Vec<u32>>,
    ) -> PyResult<()> {
        self.inner.with(py, "prefill", |p| {
            if let Some(s) = state_indices {
                p.set_state_indices(room, s).map_err(push_error)?;
            }
            p.send(room, &pages).map_err(push_error)
        })
    }

    /// Sends layers `first_layer .. first_layer + num_layers` (this rank's own indices) of
    /// `pages` as one chunk, for streaming each layer as the engine computes it; the chunk
    /// that `completes` these pages moves on to the room's next ones (and completes the room
    /// when none are left). Raises as `send` does, and `InvalidArgumentError` for layers
    /// this rank does not hold or a cross-layer cache.
    fn send_layers(
        &self,
        py: Python<'_>,
        room: u64,
        pages: Vec<u32>,
        first_layer: u32,
        num_layers: u32,
        completes: bool,
    ) -> PyResult<()> {
        let end = first_layer
            .checked_add(num_layers)
            .ok_or_else(|| InvalidArgumentError::new_err("layer range overflows"))?;
        self.inner.with(py, "prefill", |p| {
            p.send_layers(room, &pages, first_layer..end, completes)
                .map_err(push_error)
        })
    }

    /// Control messages refused (unknown agent, malformed content).
    fn refused(&self, py: Python<'_>) -> PyResult<u64> {
        self.inner.with(py, "prefill", |p| Ok(p.refused()))
    }

    /// Takes one multipart message of a stock SGLang decode (SGLang's own nixl backend: a
    /// registration, a room, an abort), read from the rank's ZMQ PULL socket. Raises
    /// `InvalidArgumentError` with the reason for a message refused (a room refused is
    /// also told to its decode: see `take_stock_outbox`).
    fn stock_message(&self, py: Python<'_>, frames: Vec<Vec<u8>>) -> PyResult<()> {
        self.inner.with(py, "prefill", |p| {
            let parts: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            p.stock_message(&parts)
                .map_err(InvalidArgumentError::new_err)
        })
    }

    /// Messages for stock SGLang decodes since the last call, oldest first, as
    /// `(host, port, frames)`: push each to `tcp://host:port` (the decode rank's PULL
    /// socket) as one multipart message.
    #[allow(clippy::type_complexity)]
    fn take_stock_outbox<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(String, u16, Vec<Bound<'py, PyBytes>>)>> {
        let out = self
            .inner
            .with(py, "prefill", |p| Ok(p.take_stock_outbox()))?;
        Ok(out
            .into_iter()
            .map(|m| {
                let frames = m.frames.iter().map(|f| PyBytes::new(py, f)).collect();
                (m.host, m.port, frames)
            })
            .collect())
    }

    /// Counters since the last call (reset on read), durations in seconds.
    fn take_metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.with(py, "prefill", |p| Ok(p.take_metrics()))?;
        metrics_dict(py, &m)
    }

    /// Closes the mailbox, releases transfers and deregisters memory. Calling it twice is
    /// fine; other calls afterwards raise `ShutDownError`.
    fn shutdown(&self, py: Python<'_>) {
        self.inner.shutdown(py);
    }
}

fn metrics_dict<'py>(py: Python<'py>, m: &PushMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("transfers", m.transfers)?;
    d.set_item("kv_bytes", m.kv_bytes)?;
    d.set_item("descriptors_raw", m.descriptors_raw)?;
    d.set_item("descriptors_posted", m.descriptors_posted)?;
    d.set_item("post_time", m.post_time.as_secs_f64())?;
    d.set_item("plan_time", m.plan_time.as_secs_f64())?;
    d.set_item("digest_time", m.digest_time.as_secs_f64())?;
    d.set_item("digested_pages", m.digested_pages)?;
    d.set_item("failed_rooms", m.failed_rooms)?;
    d.set_item("registrations", m.registrations)?;
    Ok(d)
}

/// One decode rank over a transport of its own.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct PushDecode {
    inner: Slot<push::PushDecode<AnyTransport>>,
    /// The objects holding its buffers (after `inner`: dropped once it deregistered them).
    _keep: Kept,
}

#[pymethods]
impl PushDecode {
    /// Registers the buffers and starts the control thread. With `discovery` =
    /// `(url, cluster)`, prefills' ranks and liveness come from that etcd (prefill ranks
    /// registered with `PushPrefill.register`) instead of their bootstrap registries; raises
    /// `DiscoveryError` when etcd is unreachable. With `digest`, every room is checked
    /// against the content digests its writers send before it succeeds (host memory only:
    /// raises `KvxferError` on GPU memory).
    #[new]
    #[pyo3(signature = (
        agent_name, transport, layout, *, tp_rank, tp_size, aux = Vec::new(),
        state = Vec::new(), state_kind = "none", waiting_timeout = 300.0,
        bootstrap_timeout = 30.0, heartbeat_interval = 5.0, max_heartbeat_failures = 2,
        request_timeout = 2.0, discovery = None, digest = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent_name: &str,
        transport: &str,
        layout: &Bound<'_, PyDict>,
        tp_rank: u32,
        tp_size: u32,
        aux: Buffers<'_>,
        state: Buffers<'_>,
        state_kind: &str,
        waiting_timeout: f64,
        bootstrap_timeout: f64,
        heartbeat_interval: f64,
        max_heartbeat_failures: u32,
        request_timeout: f64,
        discovery: Option<(String, String)>,
        digest: bool,
    ) -> PyResult<Self> {
        let mut keep = Kept::new();
        let bufs = buffers(layout, aux, state, state_kind, &mut keep)?;
        if tp_size == 0 || tp_rank >= tp_size {
            return Err(InvalidArgumentError::new_err(format!(
                "tp_rank {tp_rank} of tp_size {tp_size}"
            )));
        }
        if max_heartbeat_failures == 0 {
            return Err(InvalidArgumentError::new_err(
                "max_heartbeat_failures must be at least 1",
            ));
        }
        let mut config = push::PushDecodeConfig::new(tp_rank, tp_size);
        config.waiting_timeout = seconds("waiting_timeout", waiting_timeout)?;
        config.bootstrap_timeout = seconds("bootstrap_timeout", bootstrap_timeout)?;
        config.heartbeat_interval = seconds("heartbeat_interval", heartbeat_interval)?;
        config.max_heartbeat_failures = max_heartbeat_failures;
        config.request_timeout = seconds("request_timeout", request_timeout)?;
        config.digest = digest;
        if let Some((url, cluster)) = discovery {
            kvxfer_discovery::key::check_name("cluster name", &cluster)
                .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
            let client = crate::discovery::client(&url)?;
            let dir = py
                .detach(|| push::EtcdDirectory::start(client, &cluster))
                .map_err(crate::discovery::discovery)?;
            config.directory = Arc::new(dir);
        }
        let tkind = transport_kind(transport)?;
        let name = agent_name.to_string();
        let d = py.detach(move || {
            let t = kvxfer::open(tkind, &name).map_err(errors::transport)?;
            push::PushDecode::new(t, config, bufs, Arc::new(SystemClock::default()))
                .map_err(errors::KvxferError::new_err)
        })?;
        Ok(PushDecode {
            inner: Slot::new(d),
            _keep: keep,
        })
    }

    /// Starts receiving `room` from the prefill whose registry is at `registry`: this rank's
    /// destination `pages` (empty for a rank that only completes its status), `aux_index` and
    /// `state_indices`. A decode that holds the prompt's first `prefix_tokens` tokens
    /// already (its radix cache) gives the pages of the tokens after them; the prefill sends
    /// only those. A cache in KV cache groups (a hybrid model) lists each group's pages in
    /// group order and `group_pages`, how many are each group's (no aux or state then).
    /// Never blocks: the control thread talks to the prefill.
    #[pyo3(signature = (
        room, registry, pages, aux_index = None, state_indices = Vec::new(), prefix_tokens = 0,
        group_pages = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_room(
        &self,
        py: Python<'_>,
        room: u64,
        registry: (String, u16),
        pages: Vec<u32>,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
        prefix_tokens: u64,
        group_pages: Option<Vec<u32>>,
    ) -> PyResult<()> {
        if group_pages.is_some() && (aux_index.is_some() || !state_indices.is_empty()) {
            return Err(InvalidArgumentError::new_err(
                "a room in KV cache groups carries no aux or state items",
            ));
        }
        self.inner.with(py, "decode", |d| {
            let addr = (registry.0.as_str(), registry.1);
            match group_pages {
                Some(counts) => d.add_room_in_groups(room, addr, pages, counts, prefix_tokens),
                None => d.add_room_after_prefix(
                    room,
                    addr,
                    pages,
                    aux_index,
                    state_indices,
                    prefix_tokens,
                ),
            }
            Ok(())
        })
    }

    /// Whether no prefill rank can still write into the room's pages, so that they may be
    /// handed to another request: it succeeded, every rank sent its pages acknowledged an
    /// abort, or the prefill was declared dead. True for a room this rank does not know.
    fn drained(&self, py: Python<'_>, room: u64) -> PyResult<bool> {
        self.inner.with(py, "decode", |d| Ok(d.drained(room)))
    }

    /// Stops waiting for the room to drain (its pages were released anyway).
    fn forget(&self, py: Python<'_>, room: u64) -> PyResult<()> {
        self.inner.with(py, "decode", |d| {
            d.forget(room);
            Ok(())
        })
    }

    /// Rooms removed before they drained and given up on after the waiting timeout.
    fn undrained(&self, py: Python<'_>) -> PyResult<u64> {
        self.inner.with(py, "decode", |d| Ok(d.undrained()))
    }

    /// Counters since the last call (reset on read), durations in seconds: rooms whose
    /// content digests matched (`verified_rooms`) or did not (`digest_mismatches`), and the
    /// time their checks took (`digest_time`).
    fn take_metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.with(py, "decode", |d| Ok(d.take_metrics()))?;
        let out = PyDict::new(py);
        out.set_item("verified_rooms", m.verified_rooms)?;
        out.set_item("digest_mismatches", m.digest_mismatches)?;
        out.set_item("digest_time", m.digest_time.as_secs_f64())?;
        Ok(out)
    }

    /// This rank's NIXL agent's own metadata (`getLocalMD`), for stock peers of the same
    /// NIXL release (a stock SGLang prefill loads it). Raises `NotSupportedError` on
    /// another transport.
    fn native_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = self.inner.with(py, "decode", |d| {
            d.transport().native_metadata().map_err(errors::transport)
        })?;
        Ok(PyBytes::new(py, &md))
    }

    /// Notifications that matched no room or writer.
    fn unknown_notifications(&self, py: Python<'_>) -> PyResult<u64> {
        self.inner
            .with(py, "decode", |d| Ok(d.unknown_notifications()))
    }

    /// Stops the control thread and deregisters memory. Calling it twice is fine; other
    /// calls afterwards raise `ShutDownError`.
    fn shutdown(&self, py: Python<'_>) {
        self.inner.shutdown(py);
    }
}
