//! A transport agent in another OS process, driven through the [`Transport`] trait.
//!
//! [`RemoteAgent`] forwards every call as one JSON line to a helper process (the
//! `kvxfer-test-agent` binary) that owns the real agent, and reads one line back. Test
//! buffers live in shared memory ([`crate::shared_mem`]) which the helper maps at the same
//! address before registering it, so the suite's byte checks read exactly what the other
//! process's transport wrote. With both agents of a pair remote, data crosses between two
//! helper processes; the test process only exchanges metadata and checks bytes.

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
use serde::{Deserialize, Serialize};

use crate::shared_mem::{SharedMapping, mapping_of};

/// How long one call may take before the helper is declared hung.
pub const CALL_LIMIT: Duration = Duration::from_secs(60);

/// Marks reply lines on the helper's stdout.
const REPLY_PREFIX: &str = "KVXREPLY ";

/// `(addr, len)` on the wire.
type Range = (u64, u64);

fn to_wire(r: &[AddrRange]) -> Vec<Range> {
    r.iter().map(|r| (r.addr, r.len)).collect()
}

fn from_wire(r: &[Range]) -> Vec<AddrRange> {
    r.iter().map(|&(a, l)| AddrRange::new(a, l)).collect()
}

/// Memory kind on the wire: `None` = host, `Some(d)` = GPU `d`.
type Kind = Option<u32>;

fn kind_to(k: MemoryKind) -> Kind {
    match k {
        MemoryKind::Host => None,
        MemoryKind::Gpu { device } => Some(device),
    }
}

fn kind_from(k: Kind) -> MemoryKind {
    k.map_or(MemoryKind::Host, |device| MemoryKind::Gpu { device })
}

/// A call.
#[derive(Debug, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum Request {
    Capabilities,
    Register {
        kind: Kind,
        range: Range,
        mapping: Option<(u32, i32, u64, u64)>,
    },
    Deregister(u64),
    Metadata,
    LoadPeer(Vec<u8>),
    RemovePeer(u64),
    PrepareLocal(Kind, Vec<Range>),
    PrepareRemote(u64, Kind, Vec<Range>),
    ReleaseList(u64),
    PostIndexed {
        write: bool,
        local: u64,
        local_idx: Vec<u32>,
        remote: u64,
        remote_idx: Vec<u32>,
        notification: Option<Vec<u8>>,
    },
    Post {
        write: bool,
        peer: u64,
        kinds: (Kind, Kind),
        local: Vec<Range>,
        remote: Vec<Range>,
        notification: Option<Vec<u8>>,
    },
    Status(u64),
    Release(u64),
    /// Allocates `len` bytes of the helper's own anonymous memory (huge pages advised),
    /// filled like `Buffer::new(len, Some(seed))`; replies with the address.
    AllocFilled {
        len: u64,
        seed: u64,
    },
    SendNotification(u64, Vec<u8>),
    Drain,
    Shutdown,
}

/// A reply.
#[derive(Debug, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum Reply {
    Done,
    Id(u64),
    Bytes(Vec<u8>),
    Caps {
        host: bool,
        gpu: bool,
        read: bool,
        write: bool,
        notifications: bool,
        max_descriptors: usize,
        max_notification_len: usize,
        detects_peer_deregistration: bool,
    },
    InProgress,
    Finished,
    Failed(String),
    Notes(Vec<(String, Vec<u8>)>),
    Err(WireError),
}

/// [`TransportError`] on the wire.
#[derive(Debug, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum WireError {
    NotSupported(String),
    NotAvailable(String, String),
    OutOfBounds(u64, u64, Kind, bool),
    InvalidRegistration(String),
    InvalidMetadata(String),
    UnknownPeer(u64),
    PeerGone(String),
    UnknownList(u64),
    WrongList(u64, bool),
    UnknownTransfer(u64),
    IndexOutOfRange(u32, usize),
    Mismatch(String),
    TooLarge(String, usize, usize),
    Backend(String),
}

impl From<&TransportError> for WireError {
    fn from(e: &TransportError) -> Self {
        use TransportError as T;
        match e {
            T::NotSupported(s) => WireError::NotSupported(s.clone()),
            T::NotAvailable { what, reason } => {
                WireError::NotAvailable(what.clone(), reason.clone())
            }
            T::OutOfBounds {
                addr,
                len,
                kind,
                whose,
            } => WireError::OutOfBounds(*addr, *len, kind_to(*kind), *whose == "locally"),
            T::InvalidRegistration(s) => WireError::InvalidRegistration(s.clone()),
            T::InvalidMetadata(s) => WireError::InvalidMetadata(s.clone()),
            T::UnknownPeer(p) => WireError::UnknownPeer(p.0),
            T::PeerGone(s) => WireError::PeerGone(s.clone()),
            T::UnknownList(l) => WireError::UnknownList(l.0),
            T::WrongList(l, side) => WireError::WrongList(l.0, *side == "local"),
            T::UnknownTransfer(x) => WireError::UnknownTransfer(x.0),
            T::IndexOutOfRange { index, len } => WireError::IndexOutOfRange(*index, *len),
            T::Mismatch(s) => WireError::Mismatch(s.clone()),
            T::TooLarge { what, count, limit } => {
                WireError::TooLarge(what.to_string(), *count, *limit)
            }
            T::Backend(s) => WireError::Backend(s.clone()),
        }
    }
}

impl From<WireError> for TransportError {
    fn from(e: WireError) -> Self {
        use TransportError as T;
        match e {
            WireError::NotSupported(s) => T::NotSupported(s),
            WireError::NotAvailable(what, reason) => T::NotAvailable { what, reason },
            WireError::OutOfBounds(addr, len, kind, local) => T::OutOfBounds {
                addr,
                len,
                kind: kind_from(kind),
                whose: if local { "locally" } else { "by the peer" },
            },
            WireError::InvalidRegistration(s) => T::InvalidRegistration(s),
            WireError::InvalidMetadata(s) => T::InvalidMetadata(s),
            WireError::UnknownPeer(p) => T::UnknownPeer(PeerId(p)),
            WireError::PeerGone(s) => T::PeerGone(s),
            WireError::UnknownList(l) => T::UnknownList(DescListId(l)),
            WireError::WrongList(l, local) => {
                T::WrongList(DescListId(l), if local { "local" } else { "remote" })
            }
            WireError::UnknownTransfer(x) => T::UnknownTransfer(XferId(x)),
            WireError::IndexOutOfRange(index, len) => T::IndexOutOfRange { index, len },
            WireError::Mismatch(s) => T::Mismatch(s),
            WireError::TooLarge(what, count, limit) => T::TooLarge {
                what: match what.as_str() {
                    "notification bytes" => "notification bytes",
                    "descriptors in list" => "descriptors in list",
                    "descriptors in transfer" => "descriptors in transfer",
                    _ => "a limit of the helper",
                },
                count,
                limit,
            },
            WireError::Backend(s) => T::Backend(s),
        }
    }
}

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
        self.id(&Request::AllocFilled { len, seed })
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

/// The helper side: answers requests from stdin on stdout with `t` until `Shutdown` or EOF.
pub fn serve<T: Transport>(mut t: T) {
    let mut regs: std::collections::HashMap<u64, (Registration, Option<SharedMapping>)> =
        Default::default();
    let mut attached: std::collections::HashMap<u64, (SharedMapping, usize)> = Default::default();
    let mut owned: Vec<kvxfer_core::host_mem::HostMem> = Vec::new();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let req: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("kvxfer-test-agent: bad request: {e}");
                break;
            }
        };
        let shutdown = matches!(req, Request::Shutdown);
        let reply = match req {
            Request::AllocFilled { len, seed } => {
                let mut m = kvxfer_core::host_mem::HostMem::new(len as usize, 1);
                crate::memory::fill(m.as_mut_slice(), Some(seed));
                let addr = m.addr();
                owned.push(m);
                Reply::Id(addr)
            }
            Request::Register {
                kind: None,
                range,
                mapping: None,
            } if !owned.iter().any(|m| m.contains(range.0, range.1)) => {
                Reply::Err(WireError::InvalidRegistration(
                    "host memory for a helper process must be shared test memory or its own".into(),
                ))
            }
            req => handle(&mut t, req, &mut regs, &mut attached),
        };
        let mut out = REPLY_PREFIX.to_string();
        out.push_str(&serde_json::to_string(&reply).expect("reply encodes"));
        out.push('\n');
        if stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
            || shutdown
        {
            break;
        }
    }
    // Registrations before the transport, memory after both.
    regs.clear();
    drop(t);
    drop(owned);
    for (m, _) in attached.values() {
        crate::shared_mem::detach(m);
    }
}

type Regs = std::collections::HashMap<u64, (Registration, Option<SharedMapping>)>;
type Attached = std::collections::HashMap<u64, (SharedMapping, usize)>;

fn handle<T: Transport>(
    t: &mut T,
    req: Request,
    regs: &mut Regs,
    attached: &mut Attached,
) -> Reply {
    let r = |res: TransportResult<Reply>| res.unwrap_or_else(|e| Reply::Err((&e).into()));
    let op = |write: bool| if write { Op::Write } else { Op::Read };
    match req {
        Request::Capabilities => {
            let c = t.capabilities();
            Reply::Caps {
                host: c.host_memory,
                gpu: c.gpu_memory,
                read: c.read,
                write: c.write,
                notifications: c.notifications,
                max_descriptors: c.max_descriptors,
                max_notification_len: c.max_notification_len,
                detects_peer_deregistration: c.detects_peer_deregistration,
            }
        }
        Request::Register {
            kind,
            range,
            mapping,
        } => {
            let mapping = mapping.map(|(pid, fd, base, len)| SharedMapping { pid, fd, base, len });
            if let Some(m) = &mapping {
                match attached.get_mut(&m.base) {
                    Some((_, n)) => *n += 1,
                    None => {
                        if let Err(e) = crate::shared_mem::attach(m) {
                            return Reply::Err(WireError::InvalidRegistration(format!(
                                "cannot map the test's memory at {:#x}: {e}",
                                m.base
                            )));
                        }
                        attached.insert(m.base, (*m, 1));
                    }
                }
            }
            match t.register(kind_from(kind), AddrRange::new(range.0, range.1)) {
                Ok(reg) => {
                    let id = reg.id().0;
                    regs.insert(id, (reg, mapping));
                    Reply::Id(id)
                }
                Err(e) => {
                    if let Some(m) = mapping {
                        release_mapping(attached, &m);
                    }
                    Reply::Err((&e).into())
                }
            }
        }
        Request::Deregister(id) => {
            if let Some((reg, mapping)) = regs.remove(&id) {
                drop(reg);
                if let Some(m) = mapping {
                    release_mapping(attached, &m);
                }
            }
            Reply::Done
        }
        Request::Metadata => r(t.metadata().map(Reply::Bytes)),
        Request::LoadPeer(m) => r(t.load_peer(&m).map(|p| Reply::Id(p.0))),
        Request::RemovePeer(p) => r(t.remove_peer(PeerId(p)).map(|()| Reply::Done)),
        Request::PrepareLocal(k, ranges) => r(t
            .prepare_local(kind_from(k), &from_wire(&ranges))
            .map(|l| Reply::Id(l.0))),
        Request::PrepareRemote(p, k, ranges) => r(t
            .prepare_remote(PeerId(p), kind_from(k), &from_wire(&ranges))
            .map(|l| Reply::Id(l.0))),
        Request::ReleaseList(l) => r(t.release_list(DescListId(l)).map(|()| Reply::Done)),
        Request::PostIndexed {
            write,
            local,
            local_idx,
            remote,
            remote_idx,
            notification,
        } => r(t
            .post_indexed(
                op(write),
                DescListId(local),
                &local_idx,
                DescListId(remote),
                &remote_idx,
                notification.as_deref(),
            )
            .map(|x| Reply::Id(x.0))),
        Request::Post {
            write,
            peer,
            kinds,
            local,
            remote,
            notification,
        } => r(t
            .post(
                op(write),
                PeerId(peer),
                (kind_from(kinds.0), kind_from(kinds.1)),
                &from_wire(&local),
                &from_wire(&remote),
                notification.as_deref(),
            )
            .map(|x| Reply::Id(x.0))),
        Request::Status(x) => r(t.status(XferId(x)).map(|s| match s {
            XferStatus::InProgress => Reply::InProgress,
            XferStatus::Done => Reply::Finished,
            XferStatus::Failed(e) => Reply::Failed(e),
        })),
        Request::Release(x) => r(t.release(XferId(x)).map(|()| Reply::Done)),
        Request::SendNotification(p, m) => {
            r(t.send_notification(PeerId(p), &m).map(|()| Reply::Done))
        }
        Request::Drain => {
            let mut out = Vec::new();
            r(t.drain_notifications(&mut out)
                .map(|_| Reply::Notes(out.into_iter().map(|n| (n.from, n.message)).collect())))
        }
        Request::Shutdown | Request::AllocFilled { .. } => Reply::Done,
    }
}

fn release_mapping(attached: &mut Attached, m: &SharedMapping) {
    if let Some((_, n)) = attached.get_mut(&m.base) {
        *n -= 1;
        if *n == 0 {
            attached.remove(&m.base);
            crate::shared_mem::detach(m);
        }
    }
}
