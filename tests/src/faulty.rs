//! Fault injection as a decorator over the transport contract, so that the failure cases of
//! the suites run on every transport, not only on the loopback (which injects faults inside
//! itself, [`kvxfer_transport_loopback::Faults`]).
//!
//! [`Faulty`] forwards every call to the transport it wraps and hands out its own transfer
//! ids, so that a transfer it fails never reaches the wrapped transport: an armed failure
//! posts nothing (no byte moves, no notification is sent) and reports `Failed` until
//! released, exactly as a transfer that failed inside the transport looks to its caller. It
//! is consumed before the wrapped transport sees the post, so it also stands in for a post
//! the transport would have refused; the failure cases of the suites only post valid
//! transfers. A failure can also be armed a few posts ahead, and as a refused post (an
//! error from the post itself). Completions can be held back: the wrapped transport's
//! transfers report `InProgress` until released, whatever happened to them, so a suite
//! shows that nothing is reported (or handed back to an engine) before its transfers end.
//! Notifications can be failed too: the next few sends return an error, sending nothing.
//! And a READ can be corrupted in flight: one byte of what landed flipped when it completes,
//! as a faulty link or NIC would (what content digests must catch); a WRITE too: one byte of
//! its source flipped while it is posted, then flipped back once it completed (what landed
//! differs, the source does not), or left flipped (a source changed after its digest).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::conformance::TransportFactory;
use kvxfer_core::{
    AddrRange, Capabilities, DescListId, MemoryKind, Notification, Op, PeerId, Registration,
    Transport, TransportError, TransportResult, XferId, XferStatus, XferTelemetry,
};

/// What the injected failures report.
pub const INJECTED: &str = "injected failure (kvxfer-tests Faulty)";

/// What an injected post refusal returns.
pub const REFUSED: &str = "injected post refusal (kvxfer-tests Faulty)";

/// What an injected notification failure returns.
pub const UNSENT: &str = "injected notification failure (kvxfer-tests Faulty)";

/// What is armed.
#[derive(Debug, Default)]
struct Armed {
    /// Posts that go through before the armed failures apply.
    skip: usize,
    /// Posts that fail, after `skip`.
    fail: usize,
    /// Failing posts return an error instead of a transfer that reports `Failed`.
    refuse: bool,
    /// Every forwarded transfer reports `InProgress`, whatever the wrapped transport says.
    hold: bool,
    /// Notifications that fail to send, from the next one on.
    unsent: usize,
    /// READs posted with ranges (not by index) whose first landed range gets one byte
    /// flipped when they complete, from the next one on.
    corrupt: usize,
    /// WRITEs posted with ranges whose first source range has one byte flipped while they
    /// are posted, from the next one on.
    corrupt_writes: usize,
    /// Whether those bytes are flipped back once their WRITEs completed.
    restore_writes: bool,
    /// Posts that go through before one of them also writes a stray byte (the caller's
    /// choice of what that post writes outside its ranges: see `stray_write_after`).
    stray: Option<usize>,
}

/// How one post goes.
enum Injection {
    Forward,
    Fail,
    Refuse,
}

/// The switch of one [`Faulty`] transport; clone it to arm failures from anywhere.
#[derive(Debug, Clone, Default)]
pub struct FaultSwitch(Arc<Mutex<Armed>>);

impl FaultSwitch {
    fn armed(&self) -> MutexGuard<'_, Armed> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next `n` transfers posted through the transport fail without being posted.
    pub fn fail_next_transfers(&self, n: usize) {
        self.fail_after(0, n, false);
    }

    /// After `skip` more posts go through, the next `n` fail without being posted: the post
    /// returns an error (`refuse`, as a transport refusing it) or a transfer that reports
    /// `Failed`.
    pub fn fail_after(&self, skip: usize, n: usize, refuse: bool) {
        let mut a = self.armed();
        (a.skip, a.fail, a.refuse) = (skip, n, refuse);
    }

    /// While on, every transfer the wrapped transport carries reports `InProgress`, however
    /// it ended: completions held back, as a slow network holds them; off, each reports its
    /// true status again.
    pub fn hold_completions(&self, on: bool) {
        self.armed().hold = on;
    }

    fn held(&self) -> bool {
        self.armed().hold
    }

    /// The next `n` READs posted with ranges land with one byte flipped (the middle byte of
    /// their first local range), as a link that corrupts data would leave them.
    pub fn corrupt_next_reads(&self, n: usize) {
        self.armed().corrupt = n;
    }

    /// The next `n` WRITEs posted with ranges carry one byte flipped (the middle byte of their
    /// first source range, flipped just before the post): flipped back once the WRITE
    /// completes with `restore` (the destination alone differs, as after a link that
    /// corrupts data), left flipped without (a source changed after it was digested).
    pub fn corrupt_next_writes(&self, n: usize, restore: bool) {
        let mut a = self.armed();
        (a.corrupt_writes, a.restore_writes) = (n, restore);
    }

    /// Consumes one WRITE's share of the armed corruption: whether it is corrupted, and
    /// whether its byte is flipped back.
    fn take_write_corruption(&self) -> Option<bool> {
        let restore = self.armed().restore_writes;
        self.take_one(|a| &mut a.corrupt_writes).then_some(restore)
    }

    /// Consumes one READ's share of the armed corruption: whether it is corrupted.
    fn take_corruption(&self) -> bool {
        self.take_one(|a| &mut a.corrupt)
    }

    /// Counts one use off the counter `pick` chooses: whether it was armed.
    fn take_one(&self, pick: fn(&mut Armed) -> &mut usize) -> bool {
        let mut a = self.armed();
        let n = pick(&mut a);
        let armed = *n > 0;
        *n = n.saturating_sub(1);
        armed
    }

    /// After `skip` more posts, the next post with ranges also flips the byte two past the
    /// end of its last destination range (remote for a WRITE, local for a READ): a stray
    /// write outside what the transfer names, for a check that must catch one. The caller
    /// guarantees that byte is memory of a destination buffer in this process (the loopback,
    /// host memory).
    pub fn stray_write_after(&self, skip: usize) {
        self.armed().stray = Some(skip);
    }

    /// Consumes one post's share of an armed stray write: whether this post makes it.
    fn take_stray(&self) -> bool {
        let mut a = self.armed();
        match a.stray {
            Some(0) => {
                a.stray = None;
                true
            }
            Some(n) => {
                a.stray = Some(n - 1);
                false
            }
            None => false,
        }
    }

    /// The next `n` notifications sent through the transport fail without being sent.
    pub fn fail_next_notifications(&self, n: usize) {
        self.armed().unsent = n;
    }

    /// Consumes one notification's share of what is armed: whether it fails.
    fn take_notification(&self) -> bool {
        self.take_one(|a| &mut a.unsent)
    }

    /// Consumes one post's share of what is armed.
    fn take(&self) -> Injection {
        let mut a = self.armed();
        if a.skip > 0 {
            a.skip -= 1;
            return Injection::Forward;
        }
        if a.fail == 0 {
            return Injection::Forward;
        }
        a.fail -= 1;
        if a.refuse {
            Injection::Refuse
        } else {
            Injection::Fail
        }
    }
}

/// A transfer as the decorator knows it.
#[derive(Debug, Clone, Copy)]
enum Posted {
    /// Forwarded: the wrapped transport's id.
    Inner(XferId),
    /// Failed by injection: never posted.
    Injected,
}

/// `T` with fault injection in front of its posts.
pub struct Faulty<T: Transport> {
    inner: T,
    switch: FaultSwitch,
    xfers: HashMap<XferId, Posted>,
    /// Forwarded READs to corrupt when they complete: the address of the byte to flip.
    corrupt: HashMap<XferId, u64>,
    /// Forwarded WRITEs whose source byte is flipped back when they complete (or are
    /// released): its address.
    restore: HashMap<XferId, u64>,
    next: u64,
}

impl<T: Transport> Faulty<T> {
    /// Wraps `inner`; nothing fails until armed.
    pub fn new(inner: T) -> Self {
        Faulty {
            inner,
            switch: FaultSwitch::default(),
            xfers: HashMap::new(),
            corrupt: HashMap::new(),
            restore: HashMap::new(),
            next: 0,
        }
    }

    /// The switch that arms failures.
    pub fn faults(&self) -> FaultSwitch {
        self.switch.clone()
    }

    /// Transfers posted through the decorator and not released yet.
    pub fn in_flight(&self) -> usize {
        self.xfers.len()
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    fn track(&mut self, posted: Posted) -> XferId {
        self.next += 1;
        let id = XferId(self.next);
        self.xfers.insert(id, posted);
        id
    }

    fn lookup(&self, xfer: XferId) -> TransportResult<Posted> {
        self.xfers
            .get(&xfer)
            .copied()
            .ok_or(TransportError::UnknownTransfer(xfer))
    }

    /// Flips back the source byte a corrupted WRITE flipped, once it ended.
    fn restore_source(&mut self, xfer: XferId) {
        if let Some(addr) = self.restore.remove(&xfer) {
            // SAFETY: as when it was flipped; the caller keeps the registered source while
            // the transfer is known.
            unsafe { *(addr as *mut u8) ^= 0x01 };
        }
    }

    /// Posts through `post` unless a failure is armed.
    fn post_with(
        &mut self,
        post: impl FnOnce(&mut T) -> TransportResult<XferId>,
    ) -> TransportResult<XferId> {
        let posted = match self.switch.take() {
            Injection::Forward => Posted::Inner(post(&mut self.inner)?),
            Injection::Fail => Posted::Injected,
            Injection::Refuse => return Err(TransportError::Backend(REFUSED.into())),
        };
        Ok(self.track(posted))
    }
}

impl<T: Transport> Transport for Faulty<T> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn register(&mut self, kind: MemoryKind, range: AddrRange) -> TransportResult<Registration> {
        self.inner.register(kind, range)
    }

    fn metadata(&self) -> TransportResult<Vec<u8>> {
        self.inner.metadata()
    }

    fn load_peer(&mut self, metadata: &[u8]) -> TransportResult<PeerId> {
        self.inner.load_peer(metadata)
    }

    fn remove_peer(&mut self, peer: PeerId) -> TransportResult<()> {
        self.inner.remove_peer(peer)
    }

    fn prepare_local(
        &mut self,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.inner.prepare_local(kind, ranges)
    }

    fn prepare_remote(
        &mut self,
        peer: PeerId,
        kind: MemoryKind,
        ranges: &[AddrRange],
    ) -> TransportResult<DescListId> {
        self.inner.prepare_remote(peer, kind, ranges)
    }

    fn release_list(&mut self, list: DescListId) -> TransportResult<()> {
        self.inner.release_list(list)
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
        self.post_with(|t| t.post_indexed(op, local, local_idx, remote, remote_idx, notification))
    }

    fn post(
        &mut self,
        op: Op,
        peer: PeerId,
        kind: (MemoryKind, MemoryKind),
        local: &[AddrRange],
        remote: &[AddrRange],
        notification: Option<&[u8]>,
    ) -> TransportResult<XferId> {
        let flip = match (op, local.first()) {
            (Op::Write, Some(first)) if kind.0 == MemoryKind::Host && first.len > 0 => self
                .switch
                .take_write_corruption()
                .map(|restore| (first.addr + first.len / 2, restore)),
            _ => None,
        };
        let x = self.post_with(|t| {
            if let Some((addr, _)) = flip {
                // SAFETY: `addr` lies inside the local range the caller registered and
                // posts from.
                unsafe { *(addr as *mut u8) ^= 0x01 };
            }
            t.post(op, peer, kind, local, remote, notification)
        })?;
        let dst = match op {
            Op::Write => remote.last(),
            Op::Read => local.last(),
        };
        if let Some(d) = dst.filter(|_| self.switch.take_stray()) {
            // SAFETY: the caller of `stray_write_after` guarantees this byte is memory of a
            // destination buffer in this process.
            unsafe { *((d.addr + d.len + 1) as *mut u8) ^= 0xFF };
        }
        let forwarded = matches!(self.xfers.get(&x), Some(Posted::Inner(_)));
        if let (Some((addr, true)), true) = (flip, forwarded) {
            self.restore.insert(x, addr);
        }
        if let (Op::Read, true, Some(first)) = (op, forwarded, local.first()) {
            if kind.0 == MemoryKind::Host && first.len > 0 && self.switch.take_corruption() {
                self.corrupt.insert(x, first.addr + first.len / 2);
            }
        }
        Ok(x)
    }

    fn status(&mut self, xfer: XferId) -> TransportResult<XferStatus> {
        match self.lookup(xfer)? {
            Posted::Inner(x) => {
                let status = self.inner.status(x).map_err(|e| outer(e, xfer))?;
                if self.switch.held() {
                    return Ok(XferStatus::InProgress);
                }
                let done = matches!(status, XferStatus::Done);
                if let Some(addr) = done.then(|| self.corrupt.remove(&xfer)).flatten() {
                    // SAFETY: `addr` lies inside the local range the READ landed in, host
                    // memory the caller registered and keeps while the transfer is known.
                    unsafe { *(addr as *mut u8) ^= 0x01 };
                }
                if status != XferStatus::InProgress {
                    self.restore_source(xfer);
                }
                Ok(status)
            }
            Posted::Injected => Ok(XferStatus::Failed(INJECTED.into())),
        }
    }

    fn release(&mut self, xfer: XferId) -> TransportResult<()> {
        let posted = self.lookup(xfer)?;
        self.xfers.remove(&xfer);
        self.corrupt.remove(&xfer);
        self.restore_source(xfer);
        match posted {
            Posted::Inner(x) => self.inner.release(x).map_err(|e| outer(e, xfer)),
            Posted::Injected => Ok(()),
        }
    }

    fn telemetry(&mut self, xfer: XferId) -> Option<XferTelemetry> {
        match self.lookup(xfer).ok()? {
            Posted::Inner(x) => self.inner.telemetry(x),
            Posted::Injected => None,
        }
    }

    fn send_notification(&mut self, peer: PeerId, message: &[u8]) -> TransportResult<()> {
        if self.switch.take_notification() {
            return Err(TransportError::Backend(UNSENT.into()));
        }
        self.inner.send_notification(peer, message)
    }

    fn peer_failed(&self, peer: PeerId) -> bool {
        self.inner.peer_failed(peer)
    }

    fn native_metadata(&self) -> TransportResult<Vec<u8>> {
        self.inner.native_metadata()
    }

    fn load_native_peer(
        &mut self,
        metadata: &[u8],
        regions: &[(MemoryKind, AddrRange)],
    ) -> TransportResult<PeerId> {
        self.inner.load_native_peer(metadata, regions)
    }

    fn prefers_prepared_lists(&self) -> bool {
        self.inner.prefers_prepared_lists()
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) -> TransportResult<usize> {
        self.inner.drain_notifications(out)
    }
}

/// A factory whose transports are `F`'s wrapped in [`Faulty`], with the suite's failure
/// case wired to the decorator.
pub struct WithFaults<F>(pub F);

impl<F: TransportFactory> TransportFactory for WithFaults<F> {
    type T = Faulty<F::T>;

    fn label(&self) -> String {
        self.0.label()
    }

    fn create(&self, name: &str) -> Self::T {
        Faulty::new(self.0.create(name))
    }

    fn inject_failures(&self, t: &Self::T, n: usize) -> bool {
        t.faults().fail_next_transfers(n);
        true
    }
}

/// The wrapped transport's error with the caller's transfer id where it names one.
fn outer(e: TransportError, xfer: XferId) -> TransportError {
    match e {
        TransportError::UnknownTransfer(_) => TransportError::UnknownTransfer(xfer),
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{connect, wait};
    use crate::loopback::Loopback;
    use crate::memory::Buffer;

    #[test]
    fn armed_failures_are_consumed_in_order_and_ids_stay_distinct() {
        let mut src = Buffer::new(4096, Some(3));
        let mut dst = Buffer::new(4096, None);
        let mut p = connect(&WithFaults(Loopback), &mut [&mut dst], &mut [&mut src]);
        let h = MemoryKind::Host;
        p.a.faults().fail_next_transfers(1);
        let failed =
            p.a.post(
                Op::Read,
                p.b_in_a,
                (h, h),
                &[dst.range()],
                &[src.range()],
                None,
            )
            .expect("post");
        let ok =
            p.a.post(
                Op::Read,
                p.b_in_a,
                (h, h),
                &[dst.range()],
                &[src.range()],
                None,
            )
            .expect("post");
        assert_ne!(failed, ok);
        assert_eq!(wait(&mut p.a, failed), XferStatus::Failed(INJECTED.into()));
        assert_eq!(wait(&mut p.a, ok), XferStatus::Done);
        p.a.release(failed).expect("release the injected one");
        assert!(matches!(
            p.a.status(failed),
            Err(TransportError::UnknownTransfer(_))
        ));
        assert!(p.a.release(failed).is_err(), "released twice");
        p.a.release(ok).expect("release the real one");
        assert!(p.a.status(ok).is_err());
    }
}
