//! Plain data types of the transport contract.

use std::fmt;

/// Where memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host (CPU) memory.
    Host,
    /// GPU memory on the given device index.
    Gpu {
        /// CUDA device ordinal.
        device: u32,
    },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Gpu { device } => write!(f, "gpu:{device}"),
        }
    }
}

/// A byte range at an absolute address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddrRange {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl AddrRange {
    /// A range.
    pub const fn new(addr: u64, len: u64) -> Self {
        AddrRange { addr, len }
    }

    /// One past the last byte, or `None` when the range wraps around.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// True when `inner` lies entirely inside `self`.
    pub fn contains(&self, inner: &AddrRange) -> bool {
        match (self.end(), inner.end()) {
            (Some(end), Some(inner_end)) => inner.addr >= self.addr && inner_end <= end,
            _ => false,
        }
    }
}

/// Direction of a transfer, seen from the agent that posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Copy remote → local (pull).
    Read,
    /// Copy local → remote (push).
    Write,
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}#{}", stringify!($name), self.0)
            }
        }
    };
}

id_type!(
    /// A loaded peer.
    PeerId
);
id_type!(
    /// A prepared descriptor list.
    DescListId
);
id_type!(
    /// A posted transfer.
    XferId
);

/// Status of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    /// Still moving.
    InProgress,
    /// Every byte arrived (and the notification, if any, was sent after it).
    Done,
    /// The transfer failed; the reason is the transport's own error text.
    Failed(String),
}

/// What the backend itself measured of a finished transfer (NIXL's per-request telemetry),
/// for transports whose library measures it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XferTelemetry {
    /// Time the library spent inside its post call.
    pub post: std::time::Duration,
    /// Time from post to completion as the library saw it.
    pub transfer: std::time::Duration,
    /// Bytes the library moved.
    pub bytes: u64,
    /// Descriptors the library posted.
    pub descriptors: u64,
}

/// A notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Name of the sending agent.
    pub from: String,
    /// The message bytes.
    pub message: Vec<u8>,
}

/// What a transport supports, so callers and the conformance suite can tell "not
/// supported" from "broken".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Host memory can be registered.
    pub host_memory: bool,
    /// GPU memory can be registered (a device and driver exist and the transport handles it).
    pub gpu_memory: bool,
    /// READ is supported.
    pub read: bool,
    /// WRITE is supported.
    pub write: bool,
    /// Notifications (attached and standalone) are supported.
    pub notifications: bool,
    /// Most descriptors one transfer or list may hold.
    pub max_descriptors: usize,
    /// Largest notification message in bytes.
    pub max_notification_len: usize,
    /// A transfer into memory the peer deregistered after we loaded its metadata fails
    /// (the loopback sees it; network transports holding remote keys may not).
    pub detects_peer_deregistration: bool,
}
