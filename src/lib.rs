//! # kvxfer
//!
//! Facade of the kvxfer workspace: re-exports the layout math and the transport contract,
//! and holds what the `kvxfer` command shares with library users (model presets, the
//! `inspect` report).
#![warn(missing_docs)]

pub mod bench;
pub mod inspect;
pub mod models;
pub mod transports;

pub use kvxfer_core as core;
pub use kvxfer_layout as layout;
pub use transports::{AnyTransport, TransportKind, open};
