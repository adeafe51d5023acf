//! The side channel: one ZMQ ROUTER listener per TP rank serving handshake metadata, and a
//! REQ client that fetches it, with a timeout on every wait. Wire-compatible with the
//! reference pull connector (request `get_meta_msg`, reply a msgpack map).

mod client;
mod listener;
mod server;

pub use client::{FetchError, fetch_metadata, request_bytes};
pub use listener::{Listener, ListenerStats, MAX_REQUEST_BYTES};
pub use server::{Handler, MessageServer};

use std::sync::OnceLock;

/// The process's ZMQ context (one I/O thread is plenty for handshakes).
pub(crate) fn context() -> &'static zmq::Context {
    static CTX: OnceLock<zmq::Context> = OnceLock::new();
    CTX.get_or_init(zmq::Context::new)
}

/// Port of a rank's listener: `base_port + dp_rank_local * tp_size + tp_rank`, checked.
pub fn side_channel_port(
    base_port: u16,
    dp_rank_local: u32,
    tp_size: u32,
    tp_rank: u32,
) -> Option<u16> {
    let offset = u64::from(dp_rank_local) * u64::from(tp_size) + u64::from(tp_rank);
    u16::try_from(u64::from(base_port) + offset).ok()
}

/// A `tcp://host:port` endpoint, with IPv6 hosts bracketed.
pub(crate) fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_formula() {
        assert_eq!(side_channel_port(5600, 0, 4, 3), Some(5603));
        assert_eq!(side_channel_port(5600, 2, 4, 1), Some(5609));
        assert_eq!(side_channel_port(65535, 0, 1, 1), None);
        assert_eq!(endpoint("::1", 5), "tcp://[::1]:5");
    }
}
