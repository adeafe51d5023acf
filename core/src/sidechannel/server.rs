//! A request/reply message server: a ROUTER thread that hands each request to a handler
//! and sends back what it returns. Requests above a size limit never reach the handler
//! (ZMQ drops them); the handler sees raw bytes and must treat them as untrusted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use super::bind_router;

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
        let (socket, port) = bind_router(host, port, max_request, 50)?;
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
