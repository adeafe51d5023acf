//! Fetching a peer's handshake metadata over the side channel.

use std::time::Duration;

use thiserror::Error;

use super::{context, endpoint};
use crate::wire::WireError;
use crate::wire::handshake::{GET_META_MSG, HandshakeMeta};

/// Why a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FetchError {
    /// The socket could not be set up or used.
    #[error("side channel to {endpoint}: {reason}")]
    Socket {
        /// The endpoint.
        endpoint: String,
        /// ZMQ's reason.
        reason: String,
    },
    /// No reply within the timeout.
    #[error("no handshake reply from {endpoint} within {timeout:?}")]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The timeout.
        timeout: Duration,
    },
    /// The reply did not decode.
    #[error("bad handshake reply from {endpoint}: {error}")]
    BadReply {
        /// The endpoint.
        endpoint: String,
        /// The decoding error.
        error: WireError,
    },
}

/// Asks `host:port` for its metadata (`rank: None` sends exactly `get_meta_msg`, as the
/// reference does; `Some(r)` names a TP rank). Every wait is bounded by `timeout`.
pub fn fetch_metadata(
    host: &str,
    port: u16,
    rank: Option<u32>,
    timeout: Duration,
    max_reply: usize,
) -> Result<HandshakeMeta, FetchError> {
    let request = match rank {
        None => GET_META_MSG.to_vec(),
        Some(r) => {
            rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), r)).unwrap_or_default()
        }
    };
    let reply = request_bytes(host, port, &request, timeout, max_reply)?;
    HandshakeMeta::decode(&reply, max_reply).map_err(|error| FetchError::BadReply {
        endpoint: endpoint(host, port),
        error,
    })
}

/// Sends one request and waits (at most `timeout`) for the reply, refusing replies larger
/// than `max_reply`.
pub fn request_bytes(
    host: &str,
    port: u16,
    request: &[u8],
    timeout: Duration,
    max_reply: usize,
) -> Result<Vec<u8>, FetchError> {
    let ep = endpoint(host, port);
    let sock_err = |e: zmq::Error| FetchError::Socket {
        endpoint: ep.clone(),
        reason: e.to_string(),
    };
    let ms = i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    let socket = context().socket(zmq::REQ).map_err(sock_err)?;
    socket.set_linger(0).map_err(sock_err)?;
    socket.set_rcvtimeo(ms).map_err(sock_err)?;
    socket.set_sndtimeo(ms).map_err(sock_err)?;
    socket.set_connect_timeout(ms).map_err(sock_err)?;
    socket
        .set_maxmsgsize(i64::try_from(max_reply).unwrap_or(i64::MAX))
        .map_err(sock_err)?;
    socket.connect(&ep).map_err(sock_err)?;
    let timed_out = || FetchError::Timeout {
        endpoint: ep.clone(),
        timeout,
    };
    match socket.send(request, 0) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Err(timed_out()),
        Err(e) => return Err(sock_err(e)),
    }
    match socket.recv_bytes(0) {
        Ok(r) => Ok(r),
        Err(zmq::Error::EAGAIN) => Err(timed_out()),
        Err(e) => Err(sock_err(e)),
    }
}
