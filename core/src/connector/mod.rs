//! What the pull and the push connector both use, so that neither imports the other: the
//! description of the engine's KV cache, the transport library's telemetry, and the step
//! from a `kvxfer-layout` plan to the range lists a transport posts.

mod cache;
pub mod plan;
mod telemetry;

pub use cache::KvCache;
pub use telemetry::BackendTelemetry;
