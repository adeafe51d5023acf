//! Fetching a peer's handshake metadata over the side channel.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::time::{Duration, Instant};

use thiserror::Error;

use super::auth::Destination;
use super::{context, endpoint};
use crate::wire::WireError;
use crate::wire::handshake::{GET_META_MSG, HandshakeMeta};
use crate::wire::vllm;

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
    /// Authentication failed: no or wrong key on one side, or an altered reply.
    #[error("side channel to {endpoint}: {reason}")]
    Auth {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        reason: String,
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

/// How long a metadata request first waits for its reply before it is asked again on a
/// fresh socket; each later wait doubles, up to [`MAX_ATTEMPT_WAIT`], all within the
/// caller's timeout.
pub const FIRST_ATTEMPT_WAIT: Duration = Duration::from_secs(1);
/// The longest single wait of a metadata request.
pub const MAX_ATTEMPT_WAIT: Duration = Duration::from_secs(8);

/// Asks `host:port`, a listener of prefill engine `engine_id` (bound into an authenticated
/// request), for its metadata (`rank: None` sends exactly `get_meta_msg`, as the reference
/// does; `Some(r)` names a TP rank). Every wait is bounded by `timeout`; a request
/// unanswered is asked again ([`FIRST_ATTEMPT_WAIT`]).
pub fn fetch_metadata(
    host: &str,
    port: u16,
    engine_id: &str,
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
    let to = Destination::pull(engine_id);
    fetch(host, port, &to, &request, timeout, max_reply)
}

/// Asks `host:port`, a listener of prefill engine `engine_id`, for TP rank `rank`'s
/// metadata on behalf of agent `reader`, which the
/// listener then counts among the peers whose read notifications it accepts (kvxfer
/// listeners only). Every wait is bounded by `timeout`; a request unanswered is asked
/// again ([`FIRST_ATTEMPT_WAIT`]).
pub fn fetch_metadata_for(
    host: &str,
    port: u16,
    engine_id: &str,
    rank: u32,
    reader: &str,
    timeout: Duration,
    max_reply: usize,
) -> Result<HandshakeMeta, FetchError> {
    let request = rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), rank, reader))
        .unwrap_or_default();
    let to = Destination::pull(engine_id);
    fetch(host, port, &to, &request, timeout, max_reply)
}

/// What a vLLM 0.32 listener answered: its payload and its clock when it answered.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmReply {
    /// The handshake payload.
    pub payload: vllm::HandshakePayload,
    /// The peer's monotonic clock (seconds) when it replied.
    pub remote_clock: f64,
    /// Our monotonic clock halfway through the round trip, to estimate the offset.
    pub local_midpoint: f64,
    /// The round trip, in seconds: the offset's error is at most half of it.
    pub round_trip: f64,
}

/// Asks a stock vLLM 0.32 listener at `host:port` for (`pp_rank`, `tp_rank`)'s payload
/// (two reply frames). Every wait is bounded by `timeout`, and a request unanswered is asked
/// again ([`FIRST_ATTEMPT_WAIT`]); vLLM's protocol has no authentication, so with a
/// side-channel key set this refuses to ask.
pub fn fetch_vllm(
    host: &str,
    port: u16,
    request: vllm::MetaRequest,
    timeout: Duration,
    max_reply: usize,
) -> Result<VllmReply, FetchError> {
    let ep = endpoint(host, port);
    if super::auth::key()
        .map_err(|reason| FetchError::Auth {
            endpoint: ep.clone(),
            reason,
        })?
        .is_some()
    {
        return Err(FetchError::Auth {
            endpoint: ep,
            reason: "a side-channel key is set, and stock vLLM peers cannot authenticate".into(),
        });
    }
    let encoded = request.encode();
    let (frames, started) = with_retries(&ep, timeout, |wait| {
        let socket = req_socket(&ep, wait, max_reply)?;
        let started = super::listener::monotonic_seconds();
        // Frame by frame, at most three kept: a reply of many frames is refused, not
        // collected.
        let frames = exchange(&socket, &ep, &encoded, wait, |s| {
            let mut frames = vec![s.recv_bytes(0)?];
            while frames.len() < 3 && s.get_rcvmore()? {
                frames.push(s.recv_bytes(0)?);
            }
            Ok(frames)
        })?;
        Ok((frames, started))
    })?;
    let ended = super::listener::monotonic_seconds();
    let bad = |error: WireError| FetchError::BadReply {
        endpoint: ep.clone(),
        error,
    };
    let [payload, clock] = frames.as_slice() else {
        return Err(bad(WireError::Malformed {
            what: "vLLM handshake reply",
            reason: format!("{} frames, expected 2", frames.len()),
        }));
    };
    Ok(VllmReply {
        payload: vllm::HandshakePayload::decode(payload, max_reply).map_err(bad)?,
        remote_clock: vllm::decode_clock(clock).map_err(bad)?,
        local_midpoint: started + (ended - started) / 2.0,
        round_trip: ended - started,
    })
}

/// A REQ socket connected to `ep` with every wait bounded by `timeout`.
fn req_socket(ep: &str, timeout: Duration, max_reply: usize) -> Result<zmq::Socket, FetchError> {
    let sock_err = |e: zmq::Error| FetchError::Socket {
        endpoint: ep.to_string(),
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
    socket.connect(ep).map_err(sock_err)?;
    Ok(socket)
}

/// Sends `request` and receives the reply with `recv`, mapping a timeout to
/// [`FetchError::Timeout`].
fn exchange<R>(
    socket: &zmq::Socket,
    ep: &str,
    request: &[u8],
    timeout: Duration,
    recv: impl FnOnce(&zmq::Socket) -> zmq::Result<R>,
) -> Result<R, FetchError> {
    let timed_out = || FetchError::Timeout {
        endpoint: ep.to_string(),
        timeout,
    };
    let sock_err = |e: zmq::Error| FetchError::Socket {
        endpoint: ep.to_string(),
        reason: e.to_string(),
    };
    match socket.send(request, 0) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Err(timed_out()),
        Err(e) => return Err(sock_err(e)),
    }
    match recv(socket) {
        Ok(r) => Ok(r),
        Err(zmq::Error::EAGAIN) => Err(timed_out()),
        Err(e) => Err(sock_err(e)),
    }
}

/// Runs `attempt` (one request on a fresh socket, waiting at most the time it is given)
/// until it is answered or `timeout` has passed. A REQ socket never sends twice, so a
/// request or reply lost with its connection (a listener that restarted between the
/// connect and its reply, or that ZMQ's buffers dropped) would otherwise be waited for to
/// the end. Only for idempotent requests: the listener may serve several attempts.
fn with_retries<R>(
    ep: &str,
    timeout: Duration,
    mut attempt: impl FnMut(Duration) -> Result<R, FetchError>,
) -> Result<R, FetchError> {
    let Some(deadline) = Instant::now().checked_add(timeout) else {
        return attempt(timeout);
    };
    let mut wait = FIRST_ATTEMPT_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match attempt(wait.min(left)) {
            Err(FetchError::Timeout { .. }) if Instant::now() < deadline => {
                // Unusual (a reply takes milliseconds): worth a line when diagnosing a peer.
                tracing::warn!(endpoint = ep, ?wait, "no handshake reply yet: asking again");
                wait = wait.saturating_mul(2).min(MAX_ATTEMPT_WAIT);
            }
            Err(FetchError::Timeout { .. }) => {
                return Err(FetchError::Timeout {
                    endpoint: ep.to_string(),
                    timeout,
                });
            }
            other => return other,
        }
    }
}

fn fetch(
    host: &str,
    port: u16,
    to: &Destination,
    request: &[u8],
    timeout: Duration,
    max_reply: usize,
) -> Result<HandshakeMeta, FetchError> {
    let ep = endpoint(host, port);
    let reply = with_retries(&ep, timeout, |wait| {
        request_bytes(host, port, to, request, wait, max_reply)
    })?;
    HandshakeMeta::decode(&reply, max_reply).map_err(|error| FetchError::BadReply {
        endpoint: ep,
        error,
    })
}

/// Sends one request to `host:port`, the server `to` names, and waits (at most `timeout`)
/// for the reply, refusing replies larger than `max_reply`. With a side-channel key
/// ([`super::auth`]) the request is sealed for `to` and the reply must be sealed for it.
pub fn request_bytes(
    host: &str,
    port: u16,
    to: &Destination,
    request: &[u8],
    timeout: Duration,
    max_reply: usize,
) -> Result<Vec<u8>, FetchError> {
    let ep = endpoint(host, port);
    let auth_err = |reason: String| FetchError::Auth {
        endpoint: ep.clone(),
        reason,
    };
    let key = super::auth::key().map_err(&auth_err)?;
    let (sealed, nonce) = match &key {
        Some(k) => {
            let (s, n) = k.seal_request(to, request);
            (Some(s), n)
        }
        None => (None, [0; 16]),
    };
    let request = sealed.as_deref().unwrap_or(request);
    let socket = req_socket(&ep, timeout, max_reply)?;
    let reply = exchange(&socket, &ep, request, timeout, |s| s.recv_bytes(0))?;
    match &key {
        None if reply == super::auth::REFUSED_REPLY => Err(auth_err(
            "the peer requires side-channel authentication and no key is configured".into(),
        )),
        None => Ok(reply),
        Some(_) if reply == super::auth::REFUSED_REPLY => Err(auth_err(
            "the peer refused our side-channel authentication (is the key the same on both sides?)"
                .into(),
        )),
        Some(k) => k
            .open_reply(&nonce, &reply)
            .map(<[u8]>::to_vec)
            .map_err(|e| auth_err(format!("reply refused: {e}"))),
    }
}
