//! `Agent`: one transport agent (loopback, UCX or NIXL) for Python. Every call that can
//! block or copy runs with the GIL released; memory registered from a Python object keeps
//! that object alive until it is deregistered.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvxfer::{AnyTransport, TransportKind};
use kvxfer_core::transport::Registration;
use kvxfer_core::{
    AddrRange, DescListId, MemoryKind, Notification, Op, PeerId, Transport, XferId, XferStatus,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{
    self, InvalidArgumentError, ShutDownError, TransferFailedError, TransferTimeoutError,
};
use crate::memory::{check_host_mapped, object_range};

struct State {
    transport: AnyTransport,
    /// Registration handle -> the guard, and the object kept alive while registered.
    regs: HashMap<u64, (Registration, Option<Py<PyAny>>)>,
    next_reg: u64,
}

/// A transport agent.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct Agent {
    name: String,
    kind: TransportKind,
    state: Mutex<Option<State>>,
}

/// Parses `"host"` or `"gpu:N"`.
pub fn memory_kind(s: &str) -> PyResult<MemoryKind> {
    if s == "host" {
        return Ok(MemoryKind::Host);
    }
    s.strip_prefix("gpu:")
        .and_then(|d| d.parse().ok())
        .map(|device| MemoryKind::Gpu { device })
        .ok_or_else(|| {
            InvalidArgumentError::new_err(format!("memory {s:?}: expected host or gpu:N"))
        })
}

pub fn transport_kind(s: &str) -> PyResult<TransportKind> {
    s.parse().map_err(errors::transport)
}

fn ranges(list: Vec<(u64, u64)>) -> Vec<AddrRange> {
    list.into_iter()
        .map(|(a, l)| AddrRange::new(a, l))
        .collect()
}

impl Agent {
    fn lock(&self) -> PyResult<MutexGuard<'_, Option<State>>> {
        self.state
            .lock()
            .map_err(|_| errors::KvxferError::new_err("agent state poisoned by an earlier panic"))
    }

    /// Runs `f` on the live state with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut State) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut guard = self.lock()?;
            let state = guard.as_mut().ok_or_else(|| {
                ShutDownError::new_err(format!("agent {:?} was shut down", self.name))
            })?;
            f(state)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        py: Python<'_>,
        op: Op,
        peer: u64,
        local: Vec<(u64, u64)>,
        remote: Vec<(u64, u64)>,
        memory: &str,
        notification: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        let kind = memory_kind(memory)?;
        let (local, remote) = (ranges(local), ranges(remote));
        self.with(py, |s| {
            s.transport
                .post(
                    op,
                    PeerId(peer),
                    (kind, kind),
                    &local,
                    &remote,
                    notification.as_deref(),
                )
                .map(|x| x.0)
                .map_err(errors::transport)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn post_indexed(
        &self,
        py: Python<'_>,
        op: Op,
        local: u64,
        local_idx: Vec<u32>,
        remote: u64,
        remote_idx: Vec<u32>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        self.with(py, |s| {
            s.transport
                .post_indexed(
                    op,
                    DescListId(local),
                    &local_idx,
                    DescListId(remote),
                    &remote_idx,
                    notification.as_deref(),
                )
                .map(|x| x.0)
                .map_err(errors::transport)
        })
    }
}

#[pymethods]
impl Agent {
    /// Creates agent `name` of `transport` (`loopback`, `ucx` or `nixl`).
    #[new]
    #[pyo3(signature = (name, transport = "loopback"))]
    fn new(py: Python<'_>, name: String, transport: &str) -> PyResult<Self> {
        if name.is_empty() || name.len() > 1024 {
            return Err(InvalidArgumentError::new_err(
                "agent name must be 1 to 1024 bytes",
            ));
        }
        let kind = transport_kind(transport)?;
        let n = name.clone();
        let t = py
            .detach(move || kvxfer::open(kind, &n))
            .map_err(errors::transport)?;
        Ok(Agent {
            name,
            kind,
            state: Mutex::new(Some(State {
                transport: t,
                regs: HashMap::new(),
                next_reg: 1,
            })),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The transport's name.
    #[getter]
    fn transport(&self) -> String {
        self.kind.to_string()
    }

    /// What the transport supports here, as a dict.
    fn capabilities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with(py, |s| Ok(s.transport.capabilities()))?;
        let d = PyDict::new(py);
        d.set_item("host_memory", c.host_memory)?;
        d.set_item("gpu_memory", c.gpu_memory)?;
        d.set_item("read", c.read)?;
        d.set_item("write", c.write)?;
        d.set_item("notifications", c.notifications)?;
        d.set_item("max_descriptors", c.max_descriptors)?;
        d.set_item("max_notification_len", c.max_notification_len)?;
        d.set_item("detects_peer_deregistration", c.detects_peer_deregistration)?;
        Ok(d)
    }

    /// Registers memory: `obj` is an address (then `length` is required) or an object with
    /// `data_ptr()` (torch) or `__array_interface__` (numpy), which is kept alive until
    /// deregistered. Host ranges must be mapped read-write. Returns a registration handle.
    #[pyo3(signature = (obj, length = None, memory = "host"))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        length: Option<u64>,
        memory: &str,
    ) -> PyResult<u64> {
        let kind = memory_kind(memory)?;
        let (range, is_object) = object_range(obj, length)?;
        if kind == MemoryKind::Host {
            check_host_mapped(range)?;
        }
        let keep = is_object.then(|| obj.clone().unbind());
        self.with(py, move |s| {
            let reg = s
                .transport
                .register(kind, range)
                .map_err(errors::transport)?;
            let id = s.next_reg;
            s.next_reg += 1;
            s.regs.insert(id, (reg, keep));
            Ok(id)
        })
    }

    /// Deregisters (waits, bounded, for transfers that touch the region).
    fn deregister(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        let kept = self.with(py, |s| {
            let (reg, keep) = s.regs.remove(&handle).ok_or_else(|| {
                InvalidArgumentError::new_err(format!("unknown registration {handle}"))
            })?;
            drop(reg);
            Ok(keep)
        })?;
        drop(kept);
        Ok(())
    }

    /// This agent's metadata, for peers.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = self.with(py, |s| s.transport.metadata().map_err(errors::transport))?;
        Ok(PyBytes::new(py, &md))
    }

    /// Loads a peer's metadata; returns the peer id. A known name is replaced (a restart).
    fn load_peer(&self, py: Python<'_>, metadata: Vec<u8>) -> PyResult<u64> {
        self.with(py, |s| {
            s.transport
                .load_peer(&metadata)
                .map(|p| p.0)
                .map_err(errors::transport)
        })
    }

    /// Forgets a peer and its prepared lists.
    fn remove_peer(&self, py: Python<'_>, peer: u64) -> PyResult<()> {
        self.with(py, |s| {
            s.transport
                .remove_peer(PeerId(peer))
                .map_err(errors::transport)
        })
    }

    /// Prepares local `(addr, len)` ranges for indexed transfers; returns the list id.
    #[pyo3(signature = (ranges_, memory = "host"))]
    fn prepare_local(
        &self,
        py: Python<'_>,
        ranges_: Vec<(u64, u64)>,
        memory: &str,
    ) -> PyResult<u64> {
        let kind = memory_kind(memory)?;
        let r = ranges(ranges_);
        self.with(py, |s| {
            s.transport
                .prepare_local(kind, &r)
                .map(|l| l.0)
                .map_err(errors::transport)
        })
    }

    /// Prepares a peer's `(addr, len)` ranges; returns the list id.
    #[pyo3(signature = (peer, ranges_, memory = "host"))]
    fn prepare_remote(
        &self,
        py: Python<'_>,
        peer: u64,
        ranges_: Vec<(u64, u64)>,
        memory: &str,
    ) -> PyResult<u64> {
        let kind = memory_kind(memory)?;
        let r = ranges(ranges_);
        self.with(py, |s| {
            s.transport
                .prepare_remote(PeerId(peer), kind, &r)
                .map(|l| l.0)
                .map_err(errors::transport)
        })
    }

    /// Releases a prepared list.
    fn release_list(&self, py: Python<'_>, list: u64) -> PyResult<()> {
        self.with(py, |s| {
            s.transport
                .release_list(DescListId(list))
                .map_err(errors::transport)
        })
    }

    /// READ: `remote[i]` of `peer` into `local[i]`; returns the transfer id.
    #[pyo3(signature = (peer, local, remote, notification = None, memory = "host"))]
    fn read(
        &self,
        py: Python<'_>,
        peer: u64,
        local: Vec<(u64, u64)>,
        remote: Vec<(u64, u64)>,
        notification: Option<Vec<u8>>,
        memory: &str,
    ) -> PyResult<u64> {
        self.post(py, Op::Read, peer, local, remote, memory, notification)
    }

    /// WRITE: `local[i]` into `remote[i]` of `peer`; returns the transfer id.
    #[pyo3(signature = (peer, local, remote, notification = None, memory = "host"))]
    fn write(
        &self,
        py: Python<'_>,
        peer: u64,
        local: Vec<(u64, u64)>,
        remote: Vec<(u64, u64)>,
        notification: Option<Vec<u8>>,
        memory: &str,
    ) -> PyResult<u64> {
        self.post(py, Op::Write, peer, local, remote, memory, notification)
    }

    /// Indexed READ between prepared lists.
    #[pyo3(signature = (local, local_idx, remote, remote_idx, notification = None))]
    fn read_indexed(
        &self,
        py: Python<'_>,
        local: u64,
        local_idx: Vec<u32>,
        remote: u64,
        remote_idx: Vec<u32>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        self.post_indexed(
            py,
            Op::Read,
            local,
            local_idx,
            remote,
            remote_idx,
            notification,
        )
    }

    /// Indexed WRITE between prepared lists.
    #[pyo3(signature = (local, local_idx, remote, remote_idx, notification = None))]
    fn write_indexed(
        &self,
        py: Python<'_>,
        local: u64,
        local_idx: Vec<u32>,
        remote: u64,
        remote_idx: Vec<u32>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        self.post_indexed(
            py,
            Op::Write,
            local,
            local_idx,
            remote,
            remote_idx,
            notification,
        )
    }

    /// `"in_progress"` or `"done"`; a failed transfer raises `TransferFailedError`.
    fn status(&self, py: Python<'_>, xfer: u64) -> PyResult<&'static str> {
        let st = self.with(py, |s| {
            s.transport.status(XferId(xfer)).map_err(errors::transport)
        })?;
        match st {
            XferStatus::InProgress => Ok("in_progress"),
            XferStatus::Done => Ok("done"),
            XferStatus::Failed(reason) => Err(TransferFailedError::new_err(reason)),
        }
    }

    /// Polls until the transfer is done (GIL released); raises on failure, or
    /// `TransferTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (xfer, timeout = 30.0))]
    fn wait(&self, py: Python<'_>, xfer: u64, timeout: f64) -> PyResult<()> {
        let bound = Duration::try_from_secs_f64(timeout)
            .map_err(|_| InvalidArgumentError::new_err("timeout must be a finite number >= 0"))?;
        let start = Instant::now();
        loop {
            if self.status(py, xfer)? == "done" {
                return Ok(());
            }
            if start.elapsed() >= bound {
                return Err(TransferTimeoutError::new_err(format!(
                    "transfer {xfer} not done after {timeout} s"
                )));
            }
            py.check_signals()?;
            py.detach(|| std::thread::sleep(Duration::from_micros(200)));
        }
    }

    /// Releases a transfer (a running one is waited for, bounded, or cancelled).
    fn release(&self, py: Python<'_>, xfer: u64) -> PyResult<()> {
        self.with(py, |s| {
            s.transport.release(XferId(xfer)).map_err(errors::transport)
        })
    }

    /// Sends a notification without data.
    fn notify(&self, py: Python<'_>, peer: u64, message: Vec<u8>) -> PyResult<()> {
        self.with(py, |s| {
            s.transport
                .send_notification(PeerId(peer), &message)
                .map_err(errors::transport)
        })
    }

    /// Every notification received since the last call, as `(sender name, bytes)`.
    fn notifications<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let mut out: Vec<Notification> = Vec::new();
        self.with(py, |s| {
            s.transport
                .drain_notifications(&mut out)
                .map_err(errors::transport)
        })?;
        Ok(out
            .into_iter()
            .map(|n| (n.from, PyBytes::new(py, &n.message)))
            .collect())
    }

    /// Deregisters everything and closes the agent; later calls raise `ShutDownError`.
    /// Calling it twice is fine.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let kept = py.detach(|| -> PyResult<Vec<Py<PyAny>>> {
            let state = self.lock()?.take();
            let Some(mut s) = state else {
                return Ok(Vec::new());
            };
            let mut kept = Vec::new();
            for (_, (reg, keep)) in s.regs.drain() {
                drop(reg);
                kept.extend(keep);
            }
            drop(s.transport);
            Ok(kept)
        })?;
        drop(kept);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Agent(name={:?}, transport={:?})",
            self.name,
            self.kind.to_string()
        )
    }
}
