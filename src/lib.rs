//! # kvxfer
//!
//! Facade of the kvxfer workspace: re-exports the layout math and the transport contract,
//! and opens any transport by kind ([`open`]). With the `cli` feature (on by default) it also
//! holds what the `kvxfer` command is built from (the benchmark, model presets, the
//! `inspect` report); the Python extension links it without.
#![warn(missing_docs)]

#[cfg(feature = "cli")]
pub mod bench;
#[cfg(feature = "cli")]
pub mod inspect;
#[cfg(feature = "cli")]
pub mod models;
pub mod transports;

pub use kvxfer_core as core;
pub use kvxfer_layout as layout;
pub use transports::{AnyTransport, TransportKind, open};
