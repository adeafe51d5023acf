//! # kvxfer-core
//!
//! The transport contract every kvxfer transport implements ([`transport`]), and, as they
//! land, the wire formats and the pull and push connectors built on it. Transport-agnostic:
//! byte offsets come from `kvxfer-layout`, bytes move through a [`transport::Transport`].
#![warn(missing_docs)]

pub mod clock;
pub mod connector;
pub mod digest;
pub mod options;
pub mod pull;
pub mod push;
pub mod sidechannel;
mod tally;
pub mod transport;
pub mod wire;

pub use transport::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Registration,
    Transport, TransportError, TransportResult, XferId, XferStatus, XferTelemetry,
};
