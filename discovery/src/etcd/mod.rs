//! The etcd v3 backend, over etcd's HTTP/JSON gateway (`/v3/...`, etcd 3.4 and later).
//!
//! Why the gateway rather than gRPC (the `etcd-client` crate): kvxfer's connectors are
//! threads, not async tasks, and the gateway needs no async runtime, no protobuf compiler at
//! build time and no dependency beyond base64; the calls discovery makes (a range, a put per
//! rank, one lease renewal every TTL/3 per process, one watch stream per peer) are few enough
//! that JSON costs nothing that matters. Not supported: TLS and authentication.

mod client;
mod http;
mod registrar;
mod watcher;
mod wire;

pub use client::{EtcdClient, EtcdError, LeaseId, WatchItem, WatchStream};
pub use registrar::{Registrar, RegistrarStatus};
pub use watcher::{WatchStatus, Watcher};
