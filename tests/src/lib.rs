//! # kvxfer-tests
//!
//! The conformance suite every kvxfer transport must pass ([`conformance`]), with host test
//! buffers that check guard bytes ([`memory`]). Each transport runs it through
//! [`conformance_suite!`]; end-to-end connector scenarios ([`scenarios`]) run on every transport the same way.
#![warn(missing_docs)]

pub mod conformance;
#[cfg(feature = "etcd")]
pub mod etcd_server;
pub mod faulty;
pub mod loopback;
pub mod memory;
pub mod pull_env;
pub mod push_env;
pub mod remote;
pub mod scenarios;
pub mod shared_mem;
pub mod soak;
pub mod threads;
