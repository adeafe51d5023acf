//! Fleet discovery through etcd for the engines' connectors: a process's rank registration
//! (`Registration`) and a watch of one role's engines (`FleetWatch`).

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use kvxfer_discovery::etcd::{EtcdClient, EtcdError, Registrar, Watcher};
use kvxfer_discovery::key::role_prefix;
use kvxfer_discovery::{Change, RankIndex, RankKey, RankRecord, Role, World};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{DiscoveryError, InvalidArgumentError};
use crate::slot::Slot;

/// How long one etcd call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub(crate) fn discovery(e: EtcdError) -> PyErr {
    match e {
        EtcdError::Address(_) => InvalidArgumentError::new_err(e.to_string()),
        e => DiscoveryError::new_err(e.to_string()),
    }
}

fn role(s: &str) -> PyResult<Role> {
    Role::parse(s).ok_or_else(|| {
        InvalidArgumentError::new_err(format!("role {s:?}: expected prefill or decode"))
    })
}

pub(crate) fn client(url: &str) -> PyResult<Arc<EtcdClient>> {
    Ok(Arc::new(
        EtcdClient::new(url, CALL_TIMEOUT).map_err(discovery)?,
    ))
}

/// One process's rank, registered under its own lease until `close()` (or the process's end,
/// after the lease's TTL).
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct Registration {
    inner: Slot<Registrar>,
}

impl Registration {
    /// Wraps a running registrar.
    pub(crate) fn from_registrar(r: Registrar) -> Registration {
        Registration {
            inner: Slot::new(r),
        }
    }
}

#[pymethods]
impl Registration {
    /// Registers the rank `(dp, pp, tp)` of `engine_id` in an engine of `world` ranks
    /// `(dp, pp, tp)` at `url` (`etcd://HOST:PORT[,HOST:PORT...]`); raises
    /// `DiscoveryError` when etcd is unreachable or refuses.
    #[new]
    #[pyo3(signature = (url, cluster, role, engine_id, rank, world, endpoint, instance, layout, ttl = 10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &str,
        cluster: &str,
        role: &str,
        engine_id: &str,
        rank: (u32, u32, u32),
        world: (u32, u32, u32),
        endpoint: &str,
        instance: u64,
        layout: &str,
        ttl: f64,
    ) -> PyResult<Self> {
        if !(ttl.is_finite() && (2.0..=3600.0).contains(&ttl)) {
            return Err(InvalidArgumentError::new_err("ttl: 2 to 3600 seconds"));
        }
        let rank = RankIndex {
            dp: rank.0,
            pp: rank.1,
            tp: rank.2,
        };
        let key = RankKey::new(cluster, self::role(role)?, engine_id, rank)
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        let record = RankRecord {
            instance,
            endpoint: endpoint.to_owned(),
            layout: layout.to_owned(),
            world: World {
                dp: world.0,
                pp: world.1,
                tp: world.2,
            },
            push: None,
        };
        record
            .check()
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        if !record.world.contains(rank) {
            return Err(InvalidArgumentError::new_err(format!(
                "rank {rank} lies outside the world {world:?}"
            )));
        }
        let client = client(url)?;
        let ttl = Duration::from_secs_f64(ttl);
        let registrar = py
            .detach(|| Registrar::start(client, ttl, vec![(key, record)]))
            .map_err(discovery)?;
        Ok(Registration::from_registrar(registrar))
    }

    /// `registered`, `lease`, `renewals`, `registrations`, `failures`, `last_error`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.with(py, "registration", |r| Ok(r.status()))?;
        let d = PyDict::new(py);
        d.set_item("registered", s.registered)?;
        d.set_item("lease", s.lease)?;
        d.set_item("renewals", s.renewals)?;
        d.set_item("registrations", s.registrations)?;
        d.set_item("failures", s.failures)?;
        d.set_item("last_error", s.last_error)?;
        Ok(d)
    }

    /// Deregisters (revokes the lease: the keys go at once). Calling it twice is fine.
    fn close(&self, py: Python<'_>) {
        self.inner.shutdown(py);
    }
}

/// A watch of one role's engines in a cluster.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct FleetWatch {
    role: Role,
    inner: Slot<(Watcher, Receiver<Change>)>,
}

#[pymethods]
impl FleetWatch {
    /// Watches the `role` engines of `cluster` at `url`; raises `DiscoveryError` when etcd
    /// is unreachable.
    #[new]
    #[pyo3(signature = (url, cluster, role = "prefill"))]
    fn new(py: Python<'_>, url: &str, cluster: &str, role: &str) -> PyResult<Self> {
        kvxfer_discovery::key::check_name("cluster name", cluster)
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        let role = self::role(role)?;
        let prefix = role_prefix(cluster, role);
        let client = client(url)?;
        let w = py
            .detach(|| Watcher::start(client, prefix))
            .map_err(discovery)?;
        Ok(FleetWatch {
            role,
            inner: Slot::new(w),
        })
    }

    /// The changes since the last call: `("ready", engine_id, "")` when an engine became
    /// whole, `("lost", engine_id, reason)` when the engine last ready is gone or restarted.
    fn changes(&self, py: Python<'_>) -> PyResult<Vec<(&'static str, String, String)>> {
        self.inner.with(py, "watch", |(_, rx)| {
            Ok(rx
                .try_iter()
                .map(|c| match c {
                    Change::Ready(v) => ("ready", v.engine_id, String::new()),
                    Change::Lost {
                        engine_id, reason, ..
                    } => ("lost", engine_id, reason),
                })
                .collect())
        })
    }

    /// A whole engine's ranks as `((dp, pp, tp), endpoint, instance)`, or `None`.
    #[allow(clippy::type_complexity)]
    fn engine(
        &self,
        py: Python<'_>,
        engine_id: &str,
    ) -> PyResult<Option<Vec<((u32, u32, u32), String, u64)>>> {
        let role = self.role;
        self.inner.with(py, "watch", |(w, _)| {
            Ok(w.engine(role, engine_id).map(|v| {
                v.ranks
                    .into_iter()
                    .map(|(r, rec)| ((r.dp, r.pp, r.tp), rec.endpoint, rec.instance))
                    .collect()
            }))
        })
    }

    /// `connected`, `revision`, `resyncs`, `events`, `last_error`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.with(py, "watch", |(w, _)| Ok(w.status()))?;
        let d = PyDict::new(py);
        d.set_item("connected", s.connected)?;
        d.set_item("revision", s.revision)?;
        d.set_item("resyncs", s.resyncs)?;
        d.set_item("events", s.events)?;
        d.set_item("last_error", s.last_error)?;
        Ok(d)
    }

    /// Stops the watch. Calling it twice is fine.
    fn close(&self, py: Python<'_>) {
        self.inner.shutdown(py);
    }
}
