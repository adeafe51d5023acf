//! A request/reply message server: a ROUTER thread that hands each request to a handler
//! and sends back what it returns. Requests above a size limit never reach the handler
//! (ZMQ drops them); the handler sees raw bytes and must treat them as untrusted.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use super::auth::Destination;
use super::bind_router;

/// Handles one request, returning the reply.
pub type Handler = Box<dyn FnMut(&[u8]) -> Vec<u8> + Send>;

/// A running server; dropping it stops and joins the thread.
pub struct MessageServer {
    port: u16,
    refused: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MessageServer {
    /// Binds `host:port` (0 picks a free port) and serves requests of at most `max_request`
    /// bytes with `handler`, as the server `me` names given the bound port. With a
    /// side-channel key ([`super::auth`]), requests that are not sealed with it for `me`
    /// (or replayed) never reach the handler: they are counted and answered with
    /// [`super::auth::REFUSED_REPLY`].
    pub fn bind(
        host: &str,
        port: u16,
        max_request: usize,
        me: impl FnOnce(u16) -> Destination,
        mut handler: Handler,
    ) -> Result<Self, String> {
        let key = super::auth::key()?;
        let (socket, port) = bind_router(host, port, max_request, 50)?;
        let me = me(port);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let refused = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&refused);
        let mut seen = super::auth::ReplayGuard::default();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-server-{port}"))
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    let frames = match socket.recv_multipart(0) {
                        Ok(f) => f,
                        Err(_) => continue,
                    };
                    // REQ clients send [identity, "", payload].
                    if frames.len() != 3 || !frames[1].is_empty() {
                        continue;
                    }
                    let reply = match &key {
                        None => handler(&frames[2]),
                        Some(k) => match k.open_request(&me, &frames[2], &mut seen) {
                            Ok((nonce, payload)) => k.seal_reply(&nonce, &handler(payload)),
                            Err(e) => {
                                counter.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(port, "side channel refused a request: {e}");
                                super::auth::REFUSED_REPLY.to_vec()
                            }
                        },
                    };
                    let _ = socket.send_multipart([frames[0].as_slice(), b"", reply.as_slice()], 0);
                }
            })
            .map_err(|e| format!("cannot start server thread: {e}"))?;
        Ok(MessageServer {
            port,
            refused,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Requests refused for failing authentication.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for MessageServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
