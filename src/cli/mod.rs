//! The `kvxfer` binary's command line: [`args`] defines it, [`commands`] carries it out.

pub(crate) mod args;
pub(crate) mod commands;
#[cfg(feature = "nixl")]
pub(crate) mod nixl_runtime;
