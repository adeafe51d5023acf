//! The push-mode connector: prefill WRITEs KV, aux and state into decode (the reference
//! SGLang NIXL connector's behaviour), with a bootstrap registry, chunked sends, pipeline
//! stages and liveness.

pub mod messages;
mod registry;
mod status;

pub use registry::{BootstrapRegistry, ask_registry};
pub use status::RoomStatus;
