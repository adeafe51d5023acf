//! The push-mode connector: prefill WRITEs KV, aux and state into decode (the reference
//! SGLang NIXL connector's behaviour), with a bootstrap registry, chunked sends, pipeline
//! stages and liveness.

mod buffers;
mod decode;
pub mod decode_room;
pub mod digests;
mod directory;
#[cfg(feature = "etcd")]
mod etcd_directory;
pub mod messages;
mod prefill;
pub mod prefill_room;
mod registry;
mod status;

pub use buffers::{PushBuffers, StateKind};
pub use decode::{PushDecode, PushDecodeConfig, PushDecodeMetrics};
pub use directory::{Addr, PrefillDirectory, RegistryDirectory};
#[cfg(feature = "etcd")]
pub use etcd_directory::{EtcdDirectory, push_records};
pub use prefill::{PushError, PushMetrics, PushPrefill, PushPrefillConfig};
pub use registry::{BootstrapRegistry, ask_registry};
pub use status::RoomStatus;
