//! RAII memory registration.

use std::fmt;
use std::sync::Arc;

use super::{AddrRange, MemoryKind};

/// Identifies a registration inside its transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId(pub u64);

/// The transport side of a registration: told when the guard is dropped.
pub trait Deregister: Send + Sync {
    /// Deregisters `id`. Must not return while a transfer still touches the region, so the
    /// caller may free the memory right after.
    fn deregister(&self, id: RegistrationId);
}

/// A registered memory region. Dropping it deregisters the region; drop it **before**
/// freeing the memory.
#[must_use = "dropping a registration deregisters the memory"]
pub struct Registration {
    id: RegistrationId,
    kind: MemoryKind,
    range: AddrRange,
    owner: Option<Arc<dyn Deregister>>,
}

impl Registration {
    /// Made by transports.
    pub fn new(
        id: RegistrationId,
        kind: MemoryKind,
        range: AddrRange,
        owner: Arc<dyn Deregister>,
    ) -> Self {
        Registration {
            id,
            kind,
            range,
            owner: Some(owner),
        }
    }

    /// The id.
    pub fn id(&self) -> RegistrationId {
        self.id
    }

    /// The memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The registered range.
    pub fn range(&self) -> AddrRange {
        self.range
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("range", &self.range)
            .finish()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            owner.deregister(self.id);
        }
    }
}
