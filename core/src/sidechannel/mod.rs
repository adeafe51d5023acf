//! The side channel: one ZMQ ROUTER listener per TP rank serving handshake metadata, and a
//! REQ client that fetches it, with a timeout on every wait. kvxfer peers are framed as vLLM
//! 0.9.1's NixlConnector frames it (request `get_meta_msg`, reply one msgpack map; see
//! `wire::handshake`); stock vLLM 0.32.0 peers as vLLM 0.32.0 does (request
//! `[get_meta_msg, pp, tp]`, reply payload and clock; see `wire::vllm`), on the same
//! listener.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod auth;
mod client;
mod listener;
mod readers;
mod server;

pub use client::{
    FIRST_ATTEMPT_WAIT, FetchError, MAX_ATTEMPT_WAIT, VllmReply, fetch_metadata,
    fetch_metadata_for, fetch_vllm, request_bytes,
};
pub use listener::{
    Listener, ListenerStats, MAX_REQUEST_BYTES, MetaRequest, monotonic_seconds, parse_request,
};
pub use readers::{KnownReaders, MAX_READER_NAME, MAX_READERS};
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
    let offset = u64::from(dp_rank_local)
        .checked_mul(u64::from(tp_size))?
        .checked_add(u64::from(tp_rank))?;
    u16::try_from(u64::from(base_port).checked_add(offset)?).ok()
}

/// A ROUTER socket bound to `host:port` (0 picks a free port) that drops messages above
/// `max_message` bytes and wakes every `poll_ms` to check for shutdown; returns the port.
pub(crate) fn bind_router(
    host: &str,
    port: u16,
    max_message: usize,
    poll_ms: i32,
) -> Result<(zmq::Socket, u16), String> {
    let socket = context()
        .socket(zmq::ROUTER)
        .map_err(|e| format!("cannot create ROUTER socket: {e}"))?;
    socket.set_linger(0).map_err(|e| e.to_string())?;
    socket.set_rcvtimeo(poll_ms).map_err(|e| e.to_string())?;
    socket.set_sndtimeo(1000).map_err(|e| e.to_string())?;
    socket
        .set_maxmsgsize(i64::try_from(max_message).unwrap_or(i64::MAX))
        .map_err(|e| e.to_string())?;
    let addr = if port == 0 {
        endpoint(host, 0).replace(":0", ":*")
    } else {
        endpoint(host, port)
    };
    socket
        .bind(&addr)
        .map_err(|e| format!("cannot bind {addr}: {e}"))?;
    let bound = socket
        .get_last_endpoint()
        .map_err(|e| e.to_string())?
        .map_err(|_| "bound endpoint is not UTF-8".to_string())?;
    let port = bound
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("cannot read the port of {bound}"))?;
    Ok((socket, port))
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
