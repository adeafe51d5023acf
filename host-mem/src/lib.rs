//! # kvxfer-host-mem
//!
//! Host memory as kvxfer's transports and connectors use it, below both: a KV cache's
//! preallocated mapping ([`mem`]), memory a same-host peer can map ([`shm`]), the copies
//! between host buffers ([`copy`]) and the copy-worker pool that runs them off the caller's
//! thread ([`copy_pool`]). It knows nothing of transfers, layouts or peers' protocols.
#![warn(missing_docs)]

pub mod copy;
pub mod copy_pool;
pub mod mem;
pub mod shm;

pub use mem::{HostMem, HostMemError};
