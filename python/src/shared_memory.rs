//! `SharedHostMemory`: a host cache in kvxfer shared memory (a sealed memfd), which a
//! same-host peer's UCX agent maps and copies to and from directly instead of going through
//! the kernel per block. Python sees it as a byte array (`numpy.asarray(mem)`, and from
//! there `torch.from_numpy`), whose base keeps the memory alive.

use kvxfer_host_mem::shm::SharedHostMem;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::InvalidArgumentError;

/// Zero-filled host memory of `nbytes` bytes that same-host kvxfer UCX peers map.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub struct SharedHostMemory {
    inner: SharedHostMem,
}

#[pymethods]
impl SharedHostMemory {
    /// Allocates and touches `nbytes` bytes (at least one); more than the machine has
    /// available, or a refused mapping, raises `InvalidArgumentError`.
    #[new]
    fn new(py: Python<'_>, nbytes: usize) -> PyResult<Self> {
        if nbytes == 0 {
            return Err(InvalidArgumentError::new_err("nbytes must be at least 1"));
        }
        let inner = py
            .detach(|| SharedHostMem::try_new(nbytes, 0))
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        Ok(SharedHostMemory { inner })
    }

    /// Start address (what `Agent.register` takes, like a tensor's).
    fn data_ptr(&self) -> u64 {
        self.inner.addr()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// The numpy array interface: one-dimensional bytes, writable.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.inner.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.inner.addr(), false))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SharedHostMemory(nbytes={}, addr={:#x})",
            self.inner.len(),
            self.inner.addr()
        )
    }
}
