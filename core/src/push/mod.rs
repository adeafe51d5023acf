//! The push-mode connector: prefill WRITEs KV, aux and state into decode (the reference
//! SGLang NIXL connector's behaviour), with a bootstrap registry, chunked sends, pipeline
//! stages and liveness.

mod buffers;
mod decode;
pub mod digests;
mod directory;
#[cfg(feature = "etcd")]
mod etcd_directory;
/// The push connector's messages and notes (in `wire`, with the other formats).
pub use crate::wire::push_messages as messages;
mod prefill;
mod registry;
mod rooms;
mod status;

pub use buffers::{PushBuffers, StateKind};
/// The decode's room state machine (public for the fuzz targets), in its driver's folder.
pub use decode::room as decode_room;
pub use decode::{PushDecode, PushDecodeConfig, PushDecodeMetrics};
pub use directory::{Addr, PrefillDirectory, RegistryDirectory};
#[cfg(feature = "etcd")]
pub use etcd_directory::{EtcdDirectory, push_records};
/// The prefill's room state machine (public for the fuzz targets), in its driver's folder.
pub use prefill::room as prefill_room;
pub use prefill::{PushError, PushMetrics, PushPrefill, PushPrefillConfig, StockOutgoing};
pub use registry::{BootstrapRegistry, ask_registry};
pub use rooms::Rooms;
pub use status::RoomStatus;
