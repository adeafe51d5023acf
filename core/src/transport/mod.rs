//! The transport contract: what NIXL, raw UCX and the loopback all implement.
//!
//! A transport registers memory, exchanges opaque metadata with peers, prepares descriptor
//! lists, posts READ or WRITE transfers with an optional notification, reports their status
//! without blocking, and delivers notifications. It knows nothing of requests, rooms or
//! layers. Every method is called from one thread at a time (`&mut self`); all types are
//! `Send` so a transport can move between threads.

pub mod checks;
mod error;
mod registration;
mod types;

pub use error::{TransportError, TransportResult};
pub use registration::{Deregister, Registration, RegistrationId};
pub use types::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, XferId, XferStatus,
    XferTelemetry,
};

/// One agent of a transport. See the module docs for the threading model.
pub trait Transport: Send {
    /// This agent's name, unique among the agents that talk to each other.
    fn name(&self) -> &str;

    /// What this transport can do on this machine.
    fn capabilities(&self) -> Capabilities;

    /// Registers `[range.addr, range.addr + range.len)` of `kind` memory. The memory must stay
    /// valid until the returned guard is dropped; dropping it deregisters the region and waits
    /// for transfers that touch it.
    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration>;

    /// This agent's metadata (identity and registered regions) as opaque bytes for peers.
    fn metadata(&self) -> TransportResult<Vec<u8>>;

    /// Loads a peer's metadata. Loading a peer with a name already known replaces the old
    /// peer (a restart): its prepared lists stop working and new ones must be prepared.
    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId>;

    /// Forgets a peer and every descriptor list prepared for it.
    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()>;

    /// Prepares a list of local ranges for indexed transfers; each range must lie inside
    /// memory this agent registered.
    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId>;

    /// Prepares a list of a peer's ranges; each must lie inside memory the peer advertised.
    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId>;

    /// Releases a prepared list.
    fn release_list(&mut self, list: DescListId) -> TransportResult<()>;

    /// Posts a transfer between `local[local_idx[i]]` and `remote[remote_idx[i]]` (the fast
    /// path). READ copies remote → local, WRITE local → remote. `notification`, if any, is
    /// delivered to the peer after the data is visible there.
    fn post_indexed(
        &mut self,
        op: Op,
        local: DescListId,
        local_idx: &[u32],
        remote: DescListId,
        remote_idx: &[u32],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId>;

    /// Posts a transfer from raw ranges: `local[i]` pairs with `remote[i]` (equal lengths).
    fn post(
        &mut self,
        op: Op,
        peer: PeerId,
        kind: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId>;

    /// Non-blocking status. Unknown or released transfers are an error.
    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus>;

    /// Releases a transfer. A transfer still in progress is first waited for (bounded) or
    /// cancelled; its id is invalid afterwards.
    fn release(&mut self, xfer: XferId) -> TransportResult<()>;

    /// The library's own measurements of a transfer that is `Done`, where the library
    /// measures them (NIXL telemetry); `None` otherwise. Call before `release`.
    fn telemetry(&mut self, _xfer: XferId) -> Option<XferTelemetry> {
        None
    }

    /// The library's own metadata, exactly what a stock agent of the same library loads
    /// (NIXL's `getLocalMD`), for peers that are not kvxfer: kvxfer's extras travel in the
    /// peer protocol's own fields, never inside it. `NotSupported` where the library has no
    /// stock agents to talk to (UCX, loopback).
    fn native_metadata(&self) -> TransportResult<Vec<u8>> {
        Err(TransportError::NotSupported(format!(
            "{}: no native metadata for stock peers",
            self.name()
        )))
    }

    /// Loads a stock agent's native metadata. `regions` are what the peer advertised through
    /// its own protocol (vLLM's base addresses and block geometry); remote ranges are
    /// checked against them as against a kvxfer peer's registrations.
    fn load_native_peer(
        &mut self,
        _metadata: &[u8],
        _regions: &[(MemoryKind, AddrRange)],
    ) -> TransportResult<PeerId> {
        Err(TransportError::NotSupported(format!(
            "{}: stock peers cannot be loaded",
            self.name()
        )))
    }

    /// Sends a notification without data.
    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()>;

    /// Whether the transport knows `peer` to be unreachable: its process ended or its
    /// connection failed (a restarted peer's old instance looks like this). `false` where
    /// the transport cannot tell, and for unknown peers. Connectors ask before posting to a
    /// peer they cached, so that a restart costs a new handshake instead of a failed request.
    fn peer_failed(&self, _peer: PeerId) -> bool {
        false
    }

    /// Whether `post_indexed` builds requests markedly faster than `post` of the same
    /// descriptors (the library prepared the lists: NIXL), so connectors should prepare
    /// per-block lists up front. False by default.
    fn prefers_prepared_lists(&self) -> bool {
        false
    }

    /// Appends every notification received since the last call to `out`; returns how many.
    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize>;
}
