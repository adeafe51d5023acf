//! Fleet discovery for kvxfer: which engines exist, where their ranks listen, and when one
//! dies or restarts.
//!
//! Each engine process registers its ranks under one lease (see [`key`] for the layout and
//! [`record`] for the value); a peer resolves an engine id to its rank endpoints and watches
//! it, acting on the [`Change`]s a [`Membership`] derives from the store. Transfer metadata
//! stays on the side channel: nothing here is touched per request.
//!
//! The backend is etcd v3 (feature `etcd`), spoken over etcd's HTTP/JSON gateway.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod key;
pub mod membership;
pub mod record;

#[cfg(feature = "etcd")]
pub mod etcd;

pub use key::{RankIndex, RankKey, Role};
pub use membership::{Change, EngineView, Membership};
pub use record::{PushRank, RankRecord, World};

/// The most ranks one engine may declare.
pub const MAX_RANKS: u32 = 65536;
