//! The handshake listener: a thread with a ROUTER socket that answers metadata requests.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use super::auth::Destination;
use super::readers::{KnownReaders, MAX_READER_NAME};
use super::{bind_router, endpoint};
use crate::wire::handshake::{GET_META_MSG, HandshakeMeta};
use crate::wire::vllm;

/// Requests larger than this are dropped unread (a real request is a few bytes).
pub const MAX_REQUEST_BYTES: usize = 4096;
/// How often the listener thread checks whether it should stop.
const POLL_MS: i64 = 50;

/// Counters of what the listener saw.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Requests answered with metadata.
    pub served: AtomicU64,
    /// Requests refused (malformed, oversized, unknown rank).
    pub refused: AtomicU64,
}

/// A running listener; dropping it stops and joins the thread.
pub struct Listener {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    replies: Arc<RwLock<HashMap<u32, Vec<u8>>>>,
    vllm_replies: VllmReplies,
    stats: Arc<ListenerStats>,
    readers: Arc<KnownReaders>,
}

/// vLLM 0.32 payloads by (pp rank, tp rank).
type VllmReplies = Arc<RwLock<HashMap<(u32, u32), Vec<u8>>>>;

impl Listener {
    /// Binds `host:port` (port 0 picks a free one) and serves `reply` for `rank`; requests
    /// of exactly `get_meta_msg` get this rank's reply, requests naming a rank get that
    /// rank's reply if this listener holds it, and the agent a request names as its reader
    /// joins [`Listener::readers`] once it is served. `reply` names the engine: with a
    /// side-channel key, only requests sealed for it are served.
    pub fn bind(host: &str, port: u16, rank: u32, reply: Vec<u8>) -> Result<Self, String> {
        let key = super::auth::key()?;
        // Only a keyed listener needs its name (tests serve malformed replies without one).
        let me = match &key {
            None => Destination::pull(""),
            Some(_) => HandshakeMeta::decode(&reply, reply.len())
                .map(|m| Destination::pull(&m.engine_id))
                .map_err(|e| format!("the listener's reply is not handshake metadata: {e}"))?,
        };
        let (socket, port) = bind_router(host, port, MAX_REQUEST_BYTES, POLL_MS as i32)?;
        let bound = endpoint(host, port);
        let replies = Arc::new(RwLock::new(HashMap::from([(rank, reply)])));
        let vllm_replies = VllmReplies::default();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ListenerStats::default());
        let readers = Arc::new(KnownReaders::default());
        let thread = {
            let (replies, stop, stats, known) = (
                Arc::clone(&replies),
                Arc::clone(&stop),
                Arc::clone(&stats),
                Arc::clone(&readers),
            );
            let shared = Shared {
                replies,
                vllm_replies: Arc::clone(&vllm_replies),
                stats,
                readers: known,
            };
            std::thread::Builder::new()
                .name(format!("kvxfer-listen-{port}"))
                .spawn(move || serve(socket, rank, (key, &me), &shared, &stop))
                .map_err(|e| format!("cannot start listener thread: {e}"))?
        };
        tracing::debug!(%bound, rank, "side channel listening");
        Ok(Listener {
            port,
            stop,
            thread: Some(thread),
            replies,
            vllm_replies,
            stats,
            readers,
        })
    }

    /// The agents served so far that named themselves as readers (bounded, oldest out).
    pub fn readers(&self) -> Arc<KnownReaders> {
        Arc::clone(&self.readers)
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Adds or replaces the reply for another rank (one listener can serve a whole engine).
    pub fn set_reply(&self, rank: u32, reply: Vec<u8>) {
        self.replies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rank, reply);
    }

    /// Serves `payload` (a [`vllm::HandshakePayload`], encoded) to vLLM 0.32 requests for
    /// (`pp_rank`, `tp_rank`). Without one, such requests are refused. A stock vLLM decode
    /// cannot name its agent, so once one is served, [`KnownReaders::unnamed_allowed`].
    pub fn set_vllm_reply(&self, pp_rank: u32, tp_rank: u32, payload: Vec<u8>) {
        self.vllm_replies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert((pp_rank, tp_rank), payload);
    }

    /// Counters.
    pub fn stats(&self) -> &ListenerStats {
        &self.stats
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A metadata request, as [`parse_request`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    /// The TP rank asked for.
    pub rank: u32,
    /// The agent that will read (and notify) this rank, when the request names it.
    pub reader: Option<String>,
}

/// Reads a request: `get_meta_msg` alone (rank `own`), or a msgpack array
/// `["get_meta_msg", rank]` or `["get_meta_msg", rank, reader]` (an agent name of 1 to
/// [`MAX_READER_NAME`] bytes); anything else is `None`.
pub fn parse_request(payload: &[u8], own: u32) -> Option<MetaRequest> {
    if payload == GET_META_MSG {
        return Some(MetaRequest {
            rank: own,
            reader: None,
        });
    }
    type Named = (serde_bytes::ByteBuf, u32, String);
    let (tag, rank, reader) = match rmp_serde::from_slice::<Named>(payload) {
        Ok((tag, rank, name)) => {
            if name.is_empty() || name.len() > MAX_READER_NAME {
                return None;
            }
            (tag, rank, Some(name))
        }
        Err(_) => {
            let (tag, rank): (serde_bytes::ByteBuf, u32) = rmp_serde::from_slice(payload).ok()?;
            (tag, rank, None)
        }
    };
    (tag.as_ref() == GET_META_MSG).then_some(MetaRequest { rank, reader })
}

/// What the listener thread shares with its owner.
struct Shared {
    replies: Arc<RwLock<HashMap<u32, Vec<u8>>>>,
    vllm_replies: VllmReplies,
    stats: Arc<ListenerStats>,
    readers: Arc<KnownReaders>,
}

fn serve(
    socket: zmq::Socket,
    own: u32,
    (key, me): (Option<super::auth::SideKey>, &Destination),
    shared: &Shared,
    stop: &AtomicBool,
) {
    let stats = &shared.stats;
    let mut seen = super::auth::ReplayGuard::default();
    while !stop.load(Ordering::SeqCst) {
        let frames = match socket.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "side channel receive failed");
                continue;
            }
        };
        // [identity, empty delimiter, payload] from REQ; [identity, payload] from DEALER.
        let (Some(identity), Some(payload)) = (frames.first(), frames.last()) else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let with_delimiter = frames.len() == 3 && frames[1].is_empty();
        if frames.len() < 2 || (frames.len() > 2 && !with_delimiter) {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // With a key, only requests sealed with it get an answer (sealed for them).
        let mut seen_nonce = None;
        let payload: &[u8] = match &key {
            None => payload,
            Some(k) => match k.open_request(me, payload, &mut seen) {
                Ok((nonce, p)) => {
                    seen_nonce = Some(nonce);
                    p
                }
                Err(e) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("side channel refused a request: {e}");
                    let mut out: Vec<&[u8]> = vec![identity.as_slice()];
                    if with_delimiter {
                        out.push(b"");
                    }
                    out.push(super::auth::REFUSED_REPLY);
                    let _ = socket.send_multipart(out, 0);
                    continue;
                }
            },
        };
        if let Some(req) = vllm::MetaRequest::parse(payload) {
            // vLLM 0.32's client: two frames, the payload and our clock.
            let reply = shared
                .vllm_replies
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(&(req.pp_rank, req.tp_rank))
                .cloned();
            let clock = vllm::encode_clock(monotonic_seconds());
            let mut out: Vec<&[u8]> = vec![identity.as_slice()];
            if with_delimiter {
                out.push(b"");
            }
            let refusal;
            match &reply {
                Some(bytes) => {
                    stats.served.fetch_add(1, Ordering::Relaxed);
                    shared.readers.allow_unnamed();
                    out.push(bytes);
                }
                None => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        pp_rank = req.pp_rank,
                        tp_rank = req.tp_rank,
                        "side channel refused a vLLM 0.32 request: this listener serves no vLLM payload for that rank \
                         (kvxfer serves stock vLLM decodes over NIXL, from the rank's own listener)"
                    );
                    refusal = rmp_serde::to_vec_named(&ErrorReply {
                        error: "kvxfer: no vLLM 0.32 handshake payload for this rank",
                    })
                    .unwrap_or_default();
                    out.push(&refusal);
                }
            }
            out.push(&clock);
            if let Err(e) = socket.send_multipart(out, 0) {
                tracing::warn!(error = %e, "side channel reply failed");
            }
            continue;
        }
        let request = parse_request(payload, own);
        let reply = request.as_ref().and_then(|r| {
            shared
                .replies
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(&r.rank)
                .cloned()
        });
        let body = match reply {
            Some(bytes) => {
                stats.served.fetch_add(1, Ordering::Relaxed);
                if let Some(reader) = request.and_then(|r| r.reader) {
                    shared.readers.add(&reader);
                }
                bytes
            }
            None => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    len = payload.len(),
                    "side channel refused an unexpected request"
                );
                rmp_serde::to_vec_named(&ErrorReply {
                    error: "unknown request or rank",
                })
                .unwrap_or_default()
            }
        };
        let body = match (&key, seen_nonce) {
            (Some(k), Some(nonce)) => k.seal_reply(&nonce, &body),
            _ => body,
        };
        let mut out: Vec<&[u8]> = vec![identity.as_slice()];
        if with_delimiter {
            out.push(b"");
        }
        out.push(&body);
        if let Err(e) = socket.send_multipart(out, 0) {
            tracing::warn!(error = %e, "side channel reply failed");
        }
    }
}

/// `CLOCK_MONOTONIC` in seconds: what Python's `time.perf_counter()` reads on Linux, so a
/// vLLM peer's clock-offset estimate means what it expects.
pub fn monotonic_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[derive(serde::Serialize)]
struct ErrorReply {
    error: &'static str,
}
