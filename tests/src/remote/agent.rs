//! The test's side: [`RemoteAgent`] forwards every [`Transport`] call to its helper process
//! and waits (bounded) for the reply.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::transport::{Deregister, Registration, RegistrationId};
use kvxfer_core::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Transport,
    TransportError, TransportResult, XferId, XferStatus,
};

use super::CALL_LIMIT;
use super::wire::{REPLY_PREFIX, Reply, Request, kind_to, to_wire};
use crate::shared_mem::mapping_of;

/// The pipe to one helper process.
struct Conn {
    stdin: Mutex<Option<ChildStdin>>,
    replies: Mutex<Receiver<String>>,
}

impl Conn {
    fn call(&self, req: &Request) -> TransportResult<Reply> {
        let gone = |why: String| TransportError::PeerGone(format!("helper process: {why}"));
        let mut stdin = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
        let replies = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        let pipe = stdin.as_mut().ok_or_else(|| gone("closed".into()))?;
        let mut line = serde_json::to_string(req).map_err(|e| gone(e.to_string()))?;
        line.push('\n');
        pipe.write_all(line.as_bytes())
            .and_then(|()| pipe.flush())
            .map_err(|e| gone(e.to_string()))?;
        let reply = match replies.recv_timeout(CALL_LIMIT) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                return Err(gone(format!("no reply in {CALL_LIMIT:?}")));
            }
            Err(RecvTimeoutError::Disconnected) => return Err(gone("exited".into())),
        };
        match serde_json::from_str(&reply).map_err(|e| gone(format!("bad reply: {e}")))? {
            Reply::Err(e) => Err(e.into()),
            r => Ok(r),
        }
    }
}

impl Deregister for Conn {
    fn deregister(&self, id: RegistrationId) {
        // A helper that is gone has nothing left to deregister.
        let _ = self.call(&Request::Deregister(id.0));
    }
}

/// An agent living in a helper process.
pub struct RemoteAgent {
    name: String,
    conn: Arc<Conn>,
    child: Child,
}

fn unexpected(r: Reply) -> TransportError {
    TransportError::Backend(format!("helper process: unexpected reply {r:?}"))
}

impl RemoteAgent {
    /// Starts `program args…` (a helper that runs [`serve`]) as agent `name`.
    pub fn spawn(program: &str, args: &[&str], name: &str) -> std::io::Result<RemoteAgent> {
        let mut child = Command::new(program)
            .args(args)
            .arg(name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // Libraries in the helper (UCX logs) may print to stdout too.
                let Some(reply) = line.strip_prefix(REPLY_PREFIX) else {
                    eprintln!("[helper] {line}");
                    continue;
                };
                if tx.send(reply.to_string()).is_err() {
                    break;
                }
            }
        });
        Ok(RemoteAgent {
            name: name.to_string(),
            conn: Arc::new(Conn {
                stdin: Mutex::new(child.stdin.take()),
                replies: Mutex::new(rx),
            }),
            child,
        })
    }

    /// The helper's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the helper with SIGKILL (a crash) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn id(&self, req: &Request) -> TransportResult<u64> {
        match self.conn.call(req)? {
            Reply::Id(id) => Ok(id),
            r => Err(unexpected(r)),
        }
    }

    /// Allocates memory in the helper's own address space (anonymous, huge pages advised,
    /// like an engine's cache), filled like `Buffer::new(len, Some(seed))`; it can then be
    /// registered with this agent. Freed when the helper exits.
    pub fn alloc_filled(&self, len: u64, seed: u64) -> TransportResult<u64> {
        self.id(&Request::AllocFilled {
            len,
            seed,
            shared: false,
        })
    }

    /// Like [`RemoteAgent::alloc_filled`], in kvxfer shared memory
    /// ([`kvxfer_host_mem::shm::SharedHostMem`]), which a same-host peer's transport may map.
    pub fn alloc_shared_filled(&self, len: u64, seed: u64) -> TransportResult<u64> {
        self.id(&Request::AllocFilled {
            len,
            seed,
            shared: true,
        })
    }

    fn done(&self, req: &Request) -> TransportResult<()> {
        match self.conn.call(req)? {
            Reply::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }
}

impl Drop for RemoteAgent {
    fn drop(&mut self) {
        let _ = self.conn.call(&Request::Shutdown);
        self.conn
            .stdin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill();
    }
}

impl Transport for RemoteAgent {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        match self.conn.call(&Request::Capabilities) {
            Ok(Reply::Caps {
                host,
                gpu,
                read,
                write,
                notifications,
                max_descriptors,
                max_notification_len,
                detects_peer_deregistration,
            }) => Capabilities {
                host_memory: host,
                gpu_memory: gpu,
                read,
                write,
                notifications,
                max_descriptors,
                max_notification_len,
                detects_peer_deregistration,
            },
            other => panic!("capabilities from the helper: {other:?}"),
        }
    }

    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration> {
        // Shared test memory is attached by the helper; anything else must be memory the
        // helper allocated itself (it checks).
        let mapping = mapping_of(range.addr, range.len);
        let id = self.id(&Request::Register {
            kind: kind_to(kind),
            range: (range.addr, range.len),
            mapping: mapping.map(|m| (m.pid, m.fd, m.base, m.len)),
        })?;
        let owner: Arc<Conn> = Arc::clone(&self.conn);
        Ok(Registration::new(RegistrationId(id), kind, range, owner))
    }

    fn metadata(&self) -> TransportResult<Vec<u8>> {
        match self.conn.call(&Request::Metadata)? {
            Reply::Bytes(b) => Ok(b),
            r => Err(unexpected(r)),
        }
    }

    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId> {
        self.id(&Request::LoadPeer(metadata.to_vec())).map(PeerId)
    }

    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()> {
        self.done(&Request::RemovePeer(peer.0))
    }

    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.id(&Request::PrepareLocal(kind_to(kind), to_wire(ranges)))
            .map(DescListId)
    }

    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.id(&Request::PrepareRemote(
            peer.0,
            kind_to(kind),
            to_wire(ranges),
        ))
        .map(DescListId)
    }

    fn release_list(&mut self, list: DescListId) -> TransportResult<()> {
        self.done(&Request::ReleaseList(list.0))
    }

    fn post_indexed(
        &mut self,
        op: Op,
        local: DescListId,
        local_idx: &[u32],
        remote: DescListId,
        remote_idx: &[u32],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        self.id(&Request::PostIndexed {
            write: op == Op::Write,
            local: local.0,
            local_idx: local_idx.to_vec(),
            remote: remote.0,
            remote_idx: remote_idx.to_vec(),
            notification: notification.map(<[u8]>::to_vec),
        })
        .map(XferId)
    }

    fn post(
        &mut self,
        op: Op,
        peer: PeerId,
        kinds: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        self.id(&Request::Post {
            write: op == Op::Write,
            peer: peer.0,
            kinds: (kind_to(kinds.0), kind_to(kinds.1)),
            local: to_wire(local),
            remote: to_wire(remote),
            notification: notification.map(<[u8]>::to_vec),
        })
        .map(XferId)
    }

    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus> {
        match self.conn.call(&Request::Status(xfer.0))? {
            Reply::InProgress => Ok(XferStatus::InProgress),
            Reply::Finished => Ok(XferStatus::Done),
            Reply::Failed(e) => Ok(XferStatus::Failed(e)),
            r => Err(unexpected(r)),
        }
    }

    fn release(&mut self, xfer: XferId) -> TransportResult<()> {
        self.done(&Request::Release(xfer.0))
    }

    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()> {
        self.done(&Request::SendNotification(peer.0, message.to_vec()))
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize> {
        match self.conn.call(&Request::Drain)? {
            Reply::Notes(n) => {
                let count = n.len();
                out.extend(
                    n.into_iter()
                        .map(|(from, message)| Notification { from, message }),
                );
                Ok(count)
            }
            r => Err(unexpected(r)),
        }
    }
}
