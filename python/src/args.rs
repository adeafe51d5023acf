//! Conversions of the constructors' plain Python arguments, checked at the boundary.

use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::InvalidArgumentError;

/// A positive, finite number of seconds.
pub fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            InvalidArgumentError::new_err(format!("{what} must be a positive number of seconds"))
        })
}

/// Like [`seconds`], zero allowed.
pub fn seconds_or_zero(what: &str, s: f64) -> PyResult<Duration> {
    if s == 0.0 {
        return Ok(Duration::ZERO);
    }
    seconds(what, s).map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "{what} must be zero or a positive number of seconds"
        ))
    })
}

/// Block ids per KV cache group (`[[..], ..]`), or flat ids (`[..]`: one group).
#[derive(FromPyObject)]
pub enum BlockIds {
    /// One list per group.
    Groups(Vec<Vec<u32>>),
    /// One group.
    Flat(Vec<u32>),
}

impl BlockIds {
    /// The ids per group.
    pub fn into_groups(self) -> Vec<Vec<u32>> {
        match self {
            BlockIds::Groups(g) => g,
            BlockIds::Flat(v) => vec![v],
        }
    }
}
