//! The state behind a Python object that `shutdown` (or `close`) ends.

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::errors::{KvxferError, ShutDownError};

/// A shared, lockable object that `shutdown` ends (its threads stopped, its resources freed).
pub(crate) struct Slot<T>(Mutex<Option<T>>);

impl<T: Send> Slot<T> {
    pub(crate) fn new(inner: T) -> Self {
        Slot(Mutex::new(Some(inner)))
    }

    /// Runs `f` on the inner value without the GIL; `ShutDownError` once shut down.
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut T) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut guard = self.0.lock().map_err(|_| {
                KvxferError::new_err(format!("{what} state poisoned by an earlier panic"))
            })?;
            let inner = guard
                .as_mut()
                .ok_or_else(|| ShutDownError::new_err(format!("the {what} was shut down")))?;
            f(inner)
        })
    }

    /// Runs `f` on the inner value if nobody holds it now (from a thread of our own, without
    /// Python); false once shut down.
    pub(crate) fn try_with(&self, f: impl FnOnce(&mut T)) -> bool {
        match self.0.try_lock() {
            Ok(mut guard) => guard.as_mut().map(f).is_some(),
            Err(std::sync::TryLockError::WouldBlock) => true,
            Err(std::sync::TryLockError::Poisoned(_)) => false,
        }
    }

    /// Drops the inner value (its threads stop, its memory is deregistered) outside the GIL.
    pub(crate) fn shutdown(&self, py: Python<'_>) {
        py.detach(|| {
            let taken = match self.0.lock() {
                Ok(mut g) => g.take(),
                Err(p) => p.into_inner().take(),
            };
            drop(taken);
        });
    }
}
