//! The helper protocol: one JSON [`Request`] per line to the helper, one [`Reply`] line
//! back (marked with a prefix, so that the helper's other output passes through), and the
//! transport's errors as they cross.

use kvxfer_core::{AddrRange, DescListId, MemoryKind, PeerId, TransportError, XferId};
use serde::{Deserialize, Serialize};

/// Marks reply lines on the helper's stdout.
pub(super) const REPLY_PREFIX: &str = "KVXREPLY ";

/// `(addr, len)` on the wire.
pub(super) type Range = (u64, u64);

pub(super) fn to_wire(r: &[AddrRange]) -> Vec<Range> {
    r.iter().map(|r| (r.addr, r.len)).collect()
}

pub(super) fn from_wire(r: &[Range]) -> Vec<AddrRange> {
    r.iter().map(|&(a, l)| AddrRange::new(a, l)).collect()
}

/// Memory kind on the wire: `None` = host, `Some(d)` = GPU `d`.
pub(super) type Kind = Option<u32>;

pub(super) fn kind_to(k: MemoryKind) -> Kind {
    match k {
        MemoryKind::Host => None,
        MemoryKind::Gpu { device } => Some(device),
    }
}

pub(super) fn kind_from(k: Kind) -> MemoryKind {
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
    /// Allocates `len` bytes of the helper's own memory — anonymous with huge pages
    /// advised, or kvxfer shared memory when `shared` — filled like
    /// `Buffer::new(len, Some(seed))`; replies with the address.
    AllocFilled {
        len: u64,
        seed: u64,
        shared: bool,
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
