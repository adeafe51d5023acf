//! The pull-mode connector: the decode side READs the prefill's KV blocks (the reference
//! vLLM NIXL connector's behaviour, with what later versions learned: off-thread handshakes,
//! compatibility checks, leases, failure reporting, metrics).
//!
//! [`PullScheduler`] is the sans-I/O scheduler half; [`PullWorker`] is the worker half that
//! owns a transport.

mod aggregate;
mod block_lists;
mod config;
pub mod digests;
pub mod holds;
pub mod loads;
mod metrics;
pub mod phases;
/// The notes between pull workers (in `wire`, with the other formats).
pub use crate::wire::pull_notes as notify;
mod scheduler;
pub mod stamps;
mod worker;

pub use aggregate::{FinishedAggregator, LocalAggregator};
pub use config::{FailurePolicy, PullConfig, VllmCompat};
pub use metrics::PullMetrics;
pub use scheduler::{FinishDecision, Hold, PullScheduler, RecvRequest, StepMeta};
pub use worker::{FailedLoad, Finished, IDLE_POLL, LoadRefused, PullError, PullWorker};
