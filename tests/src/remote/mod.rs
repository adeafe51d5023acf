//! A transport agent in another OS process, driven through the [`Transport`] trait.
//!
//! [`RemoteAgent`] forwards every call as one JSON line to a helper process (the
//! `kvxfer-test-agent` binary) that owns the real agent, and reads one line back. Test
//! buffers live in shared memory ([`crate::shared_mem`]) which the helper maps at the same
//! address before registering it, so the suite's byte checks read exactly what the other
//! process's transport wrote. With both agents of a pair remote, data crosses between two
//! helper processes; the test process only exchanges metadata and checks bytes.
//!
//! [`wire`] is the line protocol, [`agent`] the test's side, [`helper`] the helper's.

use std::time::Duration;

mod agent;
mod helper;
mod wire;

pub use agent::RemoteAgent;
pub use helper::serve;
pub use wire::{Reply, Request, WireError};

/// How long one call may take before the helper is declared hung.
pub const CALL_LIMIT: Duration = Duration::from_secs(60);
