//! Errors of the transport contract.

use thiserror::Error;

use super::{DescListId, MemoryKind, PeerId, XferId};

/// Everything a transport call can report. Transfer failures after posting are not errors
/// of the call: they appear as [`super::XferStatus::Failed`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransportError {
    /// The transport does not support this operation or memory kind at all.
    #[error("not supported by this transport: {0}")]
    NotSupported(String),
    /// Supported, but not available on this machine (no GPU driver, runtime missing, …).
    #[error("{what} is not available: {reason}")]
    NotAvailable {
        /// What was asked for.
        what: String,
        /// Why it is missing and, where known, how to fix it.
        reason: String,
    },
    /// A range lies (partly) outside registered memory.
    #[error("range {addr:#x}+{len} ({kind}) is outside the memory registered {whose}")]
    OutOfBounds {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// Memory kind it was given as.
        kind: MemoryKind,
        /// "locally" or "by the peer".
        whose: &'static str,
    },
    /// A registration overlaps one that exists, or is empty.
    #[error("invalid registration: {0}")]
    InvalidRegistration(String),
    /// Peer metadata could not be decoded or is inconsistent.
    #[error("invalid peer metadata: {0}")]
    InvalidMetadata(String),
    /// The peer id is unknown or was removed.
    #[error("unknown peer {0}")]
    UnknownPeer(PeerId),
    /// The peer is no longer reachable.
    #[error("peer {0:?} is gone")]
    PeerGone(String),
    /// The list id is unknown, released, or belongs to a removed peer.
    #[error("unknown descriptor list {0}")]
    UnknownList(DescListId),
    /// A list was used on the wrong side (local list as remote or the reverse).
    #[error("descriptor list {0} is not a {1} list")]
    WrongList(DescListId, &'static str),
    /// The transfer id is unknown or was released.
    #[error("unknown transfer {0}")]
    UnknownTransfer(XferId),
    /// An index into a prepared list is out of range.
    #[error("index {index} is out of range for a list of {len} descriptors")]
    IndexOutOfRange {
        /// The index.
        index: u32,
        /// The list length.
        len: usize,
    },
    /// Local and remote sides disagree in count or per-descriptor length.
    #[error("local and remote descriptors differ: {0}")]
    Mismatch(String),
    /// More descriptors or bytes than the transport accepts.
    #[error("{what}: {count} exceeds the limit of {limit}")]
    TooLarge {
        /// What is too large.
        what: &'static str,
        /// The size asked for.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// The backend library reported an error.
    #[error("backend error: {0}")]
    Backend(String),
}

/// Result alias of the transport contract.
pub type TransportResult<T> = Result<T, TransportError>;
