//! A request/reply message server: a ROUTER thread that hands each request to a handler
//! and sends back what it returns. Requests above a size limit never reach the handler
//! (ZMQ drops them); the handler sees raw bytes and must treat them as untrusted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use super::{context, endpoint};

/// Handles one request, returning the reply.
pub type Handler = Box<dyn FnMut(&[u8]) -> Vec<u8> + Send>;

/// A running server; dropping it stops and joins the thread.
pub struct MessageServer {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MessageServer {
    /// Binds `host:port` (0 picks a free port) and serves requests of at most `max_request`
    /// bytes with `handler`.
    pub fn bind(
        host: &str,
        port: u16,
        max_request: usize,
        mut handler: Handler,
    ) -> Result<Self, String> {
        let socket = context().socket(zmq::ROUTER).map_err(|e| e.to_string())?;
        socket.set_linger(0).map_err(|e| e.to_string())?;
        socket.set_rcvtimeo(50).map_err(|e| e.to_string())?;
        socket.set_sndtimeo(1000).map_err(|e| e.to_string())?;
        socket
            .set_maxmsgsize(i64::try_from(max_request).unwrap_or(i64::MAX))
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
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
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
                    let reply = handler(&frames[2]);
                    let _ = socket.send_multipart([frames[0].as_slice(), b"", reply.as_slice()], 0);
                }
            })
            .map_err(|e| format!("cannot start server thread: {e}"))?;
        Ok(MessageServer {
            port,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
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
