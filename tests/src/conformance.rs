//! The conformance suite: functions taking a transport factory, run for every transport
//! compiled in. Each case panics with a description on failure; capabilities a transport
//! lacks are skipped explicitly, each skip printed.
//!
//! Use [`crate::conformance_suite!`] to generate one `#[test]` per case for a factory.

use std::time::{Duration, Instant};

use kvxfer_core::{
    AddrRange, DescListId, MemoryKind, Op, PeerId, Transport, TransportError, XferId, XferStatus,
};

use crate::memory::{Buffer, Copy, Rng, random_copies, verify};

/// Makes transports for the suite.
pub trait TransportFactory {
    /// The transport type.
    type T: Transport;

    /// A short label for skip messages ("loopback", "ucx/shm", …).
    fn label(&self) -> String;

    /// A new agent named `name`.
    fn create(&self, name: &str) -> Self::T;

    /// Arms the transport so the next `n` transfers it posts fail. Returns false when the
    /// transport has no fault injection (the failure case is then skipped).
    fn inject_failures(&self, _t: &Self::T, _n: usize) -> bool {
        false
    }
}

impl<F: TransportFactory + ?Sized> TransportFactory for &F {
    type T = F::T;

    fn label(&self) -> String {
        (**self).label()
    }

    fn create(&self, name: &str) -> Self::T {
        (**self).create(name)
    }

    fn inject_failures(&self, t: &Self::T, n: usize) -> bool {
        (**self).inject_failures(t, n)
    }
}

/// Longest any suite wait may take: a safety bound against hangs, never a timing assertion.
pub const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Prints a skip in a form CI logs can grep.
pub fn skip(label: &str, case: &str, reason: &str) {
    println!("SKIP [{label}] {case}: {reason}");
    eprintln!("SKIP [{label}] {case}: {reason}");
}

/// Polls until the transfer leaves `InProgress` (driving notifications of `other` meanwhile
/// is not needed: transports progress on status polling).
pub fn wait<T: Transport>(t: &mut T, x: XferId) -> XferStatus {
    let start = Instant::now();
    loop {
        match t.status(x).expect("status of a live transfer") {
            XferStatus::InProgress => {
                assert!(
                    start.elapsed() < WAIT_LIMIT,
                    "transfer {x} still in progress after {WAIT_LIMIT:?}"
                );
                std::thread::yield_now();
            }
            done => return done,
        }
    }
}

/// Drains `t` until `count` notifications arrived or the wait limit passes.
pub fn wait_notifications<T: Transport>(t: &mut T, count: usize) -> Vec<kvxfer_core::Notification> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < count {
        t.drain_notifications(&mut out).expect("drain");
        assert!(
            start.elapsed() < WAIT_LIMIT,
            "got {} of {count} notifications",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

/// Drains `receiver` until `count` notifications arrived, polling `sender`'s transfer `x`
/// meanwhile: transports without a progress thread move data only while someone polls, as
/// an engine does every step.
pub fn wait_notifications_while<T: Transport>(
    receiver: &mut T,
    sender: &mut T,
    x: XferId,
    count: usize,
) -> Vec<kvxfer_core::Notification> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < count {
        let _ = sender.status(x);
        receiver.drain_notifications(&mut out).expect("drain");
        assert!(
            start.elapsed() < WAIT_LIMIT,
            "got {} of {count} notifications",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

/// Two connected agents, each with a source buffer and a destination buffer registered.
pub struct Pair<T: Transport> {
    /// Initiator.
    pub a: T,
    /// Target.
    pub b: T,
    /// `b` as loaded by `a`.
    pub b_in_a: PeerId,
    /// `a` as loaded by `b`.
    pub a_in_b: PeerId,
}

/// Creates `a` and `b`, lets `setup_a`/`setup_b` register buffers, then exchanges metadata.
pub fn connect<F: TransportFactory>(
    f: &F,
    regs_a: &mut [&mut Buffer],
    regs_b: &mut [&mut Buffer],
) -> Pair<F::T> {
    let (mut a, mut b) = (f.create("suite-a"), f.create("suite-b"));
    for buf in regs_a.iter_mut() {
        take_register(buf, &mut a);
    }
    for buf in regs_b.iter_mut() {
        take_register(buf, &mut b);
    }
    let b_in_a = a
        .load_peer(&b.metadata().expect("b metadata"))
        .expect("a loads b");
    let a_in_b = b
        .load_peer(&a.metadata().expect("a metadata"))
        .expect("b loads a");
    Pair {
        a,
        b,
        b_in_a,
        a_in_b,
    }
}

fn take_register<T: Transport>(buf: &mut Buffer, t: &mut T) {
    buf.registration = Some(
        t.register(MemoryKind::Host, buf.range())
            .expect("register host buffer"),
    );
}

const H: MemoryKind = MemoryKind::Host;

fn ranges(buf: &Buffer, offsets: impl Iterator<Item = (u64, u64)>) -> Vec<AddrRange> {
    offsets
        .map(|(o, l)| AddrRange::new(buf.addr(o), l))
        .collect()
}

/// Moves `copies` (source offsets in `src`, destination offsets in `dst`) with `op` issued by
/// `a`, through prepared lists or raw ranges, and verifies bytes and guards.
fn move_and_verify<F: TransportFactory>(
    f: &F,
    op: Op,
    copies: &[Copy],
    src_len: u64,
    dst_len: u64,
    indexed: bool,
    seed: u64,
) {
    let mut src = Buffer::new(src_len as usize, Some(seed));
    let mut dst = Buffer::new(dst_len as usize, None);
    let before = src.bytes().to_vec();
    // READ: a's destination ← b's source. WRITE: a's source → b's destination.
    let mut p = match op {
        Op::Read => connect(f, &mut [&mut dst], &mut [&mut src]),
        Op::Write => connect(f, &mut [&mut src], &mut [&mut dst]),
    };
    let (local_buf, remote_buf) = match op {
        Op::Read => (&dst, &src),
        Op::Write => (&src, &dst),
    };
    let pick = |c: &Copy, local: bool| match (op, local) {
        (Op::Read, true) | (Op::Write, false) => (c.dst, c.len),
        (Op::Read, false) | (Op::Write, true) => (c.src, c.len),
    };
    let local = ranges(local_buf, copies.iter().map(|c| pick(c, true)));
    let remote = ranges(remote_buf, copies.iter().map(|c| pick(c, false)));
    let x = if indexed {
        let l = p.a.prepare_local(H, &local).expect("prepare local");
        let r =
            p.a.prepare_remote(p.b_in_a, H, &remote)
                .expect("prepare remote");
        let idx: Vec<u32> = (0..copies.len() as u32).collect();
        let x =
            p.a.post_indexed(op, l, &idx, r, &idx, None)
                .expect("post indexed");
        let s = wait(&mut p.a, x);
        p.a.release_list(l).expect("release local list");
        p.a.release_list(r).expect("release remote list");
        (x, s)
    } else {
        let x =
            p.a.post(op, p.b_in_a, (H, H), &local, &remote, None)
                .expect("post");
        (x, wait(&mut p.a, x))
    };
    assert_eq!(
        x.1,
        XferStatus::Done,
        "{op:?} of {} descriptors",
        copies.len()
    );
    p.a.release(x.0).expect("release");
    if let Err(e) = verify(&src, &dst, copies) {
        panic!("{op:?} indexed={indexed}: {e}");
    }
    assert!(src.bytes() == before, "source changed by {op:?}");
    drop(p);
}

/// READ and WRITE of random descriptor sets, from 1 descriptor of 1 byte to 100,000
/// descriptors and to one 64 MiB descriptor, through prepared lists and raw ranges.
pub fn random_descriptor_sets<F: TransportFactory>(f: &F, op: Op) {
    let caps = f.create("caps").capabilities();
    let supported = match op {
        Op::Read => caps.read,
        Op::Write => caps.write,
    };
    if !supported {
        return skip(&f.label(), &format!("{op:?}"), "not supported");
    }
    let mut rng = Rng::new(match op {
        Op::Read => 1,
        Op::Write => 2,
    });
    let shapes: [(usize, u64, u64); 5] = [
        (1, 1, 1),
        (7, 1, 4096),
        (1000, 1, 65536),
        (100_000, 1, 48),
        (1, 64 << 20, 64 << 20),
    ];
    for (i, &(n, min, max)) in shapes.iter().enumerate() {
        if n > caps.max_descriptors {
            skip(
                &f.label(),
                "random_descriptor_sets",
                &format!("{n} descriptors exceed the declared maximum"),
            );
            continue;
        }
        let (copies, src_len, dst_len) = random_copies(&mut rng, n, min, max);
        move_and_verify(f, op, &copies, src_len, dst_len, i % 2 == 0, i as u64 + 10);
        move_and_verify(f, op, &copies, src_len, dst_len, i % 2 == 1, i as u64 + 20);
    }
}

/// Metadata round trip, idempotent loading, and malformed metadata refused.
pub fn metadata_round_trip<F: TransportFactory>(f: &F) {
    let mut buf = Buffer::new(4096, Some(3));
    let mut p = connect(f, &mut [], &mut [&mut buf]);
    let meta = p.b.metadata().expect("metadata");
    let again = p.a.load_peer(&meta).expect("loading the same peer again");
    // The peer works through the id returned last.
    let remote = [AddrRange::new(buf.addr(0), 16)];
    p.a.prepare_remote(again, H, &remote)
        .expect("prepare against reloaded peer");
    for bad in [&b""[..], &b"garbage"[..], &meta[..meta.len() / 2]] {
        assert!(
            p.a.load_peer(bad).is_err(),
            "malformed metadata ({} bytes) accepted",
            bad.len()
        );
    }
    let mut flipped = meta.clone();
    flipped[0] ^= 0xff;
    assert!(
        p.a.load_peer(&flipped).is_err(),
        "metadata with corrupted header accepted"
    );
}

/// The notification of a WRITE arrives once, after the data is visible; a READ's arrives at
/// the target after the data is in the reader's memory; standalone notifications arrive.
pub fn notification_after_data<F: TransportFactory>(f: &F) {
    if !f.create("caps").capabilities().notifications {
        return skip(
            &f.label(),
            "notification_after_data",
            "notifications not supported",
        );
    }
    let len = 8 << 20;
    let mut src = Buffer::new(len, Some(5));
    let mut dst = Buffer::new(len, None);
    let mut p = connect(f, &mut [&mut src], &mut [&mut dst]);
    let copies = [Copy {
        src: 0,
        dst: 0,
        len: len as u64,
    }];
    let x =
        p.a.post(
            Op::Write,
            p.b_in_a,
            (H, H),
            &[src.range()],
            &[dst.range()],
            Some(b"write-done"),
        )
        .expect("post write");
    let notes = wait_notifications_while(&mut p.b, &mut p.a, x, 1);
    // Data must be visible the moment the notification is seen.
    verify(&src, &dst, &copies).expect("data visible when the WRITE notification arrives");
    assert_eq!(notes[0].message, b"write-done");
    assert_eq!(notes[0].from, p.a.name());
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    let mut more = Vec::new();
    p.b.drain_notifications(&mut more).expect("drain");
    assert!(more.is_empty(), "notification delivered more than once");
    p.a.release(x).expect("release");

    // READ with notification: b learns its memory was read after a has the bytes.
    let mut back = Buffer::new(len, None);
    take_register(&mut back, &mut p.b);
    let a_meta = p.a.metadata().expect("metadata");
    let a_in_b = p.b.load_peer(&a_meta).expect("reload a");
    let x =
        p.b.post(
            Op::Read,
            a_in_b,
            (H, H),
            &[back.range()],
            &[src.range()],
            Some(b"read-done"),
        )
        .expect("post read");
    let notes = wait_notifications_while(&mut p.a, &mut p.b, x, 1);
    verify(&src, &back, &copies).expect("data visible when the READ notification arrives");
    assert_eq!(notes[0].message, b"read-done");
    assert_eq!(wait(&mut p.b, x), XferStatus::Done);
    p.b.release(x).expect("release");

    p.a.send_notification(p.b_in_a, b"hello")
        .expect("standalone notification");
    let notes = wait_notifications(&mut p.b, 1);
    assert_eq!(
        (notes[0].from.as_str(), notes[0].message.as_slice()),
        (p.a.name(), &b"hello"[..])
    );
    let _ = p.a_in_b;
}

/// Many transfers in flight at once all complete with correct bytes.
pub fn many_in_flight<F: TransportFactory>(f: &F) {
    let (n, each) = (64usize, 64 << 10);
    let mut src = Buffer::new(n * each, Some(9));
    let mut dst = Buffer::new(n * each + 128, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    let mut xs = Vec::new();
    let mut copies = Vec::new();
    for i in 0..n {
        // Reverse the order on the destination side.
        let (s, d) = ((i * each) as u64, ((n - 1 - i) * each + 64) as u64);
        copies.push(Copy {
            src: s,
            dst: d,
            len: each as u64,
        });
        let x =
            p.a.post(
                Op::Read,
                p.b_in_a,
                (H, H),
                &[AddrRange::new(dst.addr(d), each as u64)],
                &[AddrRange::new(src.addr(s), each as u64)],
                None,
            )
            .expect("post");
        xs.push(x);
    }
    for x in xs {
        assert_eq!(wait(&mut p.a, x), XferStatus::Done);
        p.a.release(x).expect("release");
    }
    verify(&src, &dst, &copies).expect("many in flight");
}

/// Status of unknown and released transfers is an error; releasing twice is an error.
pub fn unknown_and_released_transfers<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(4096, Some(1));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    let bogus = XferId(u64::MAX - 3);
    assert!(matches!(
        p.a.status(bogus),
        Err(TransportError::UnknownTransfer(_))
    ));
    assert!(matches!(
        p.a.release(bogus),
        Err(TransportError::UnknownTransfer(_))
    ));
    let x =
        p.a.post(
            Op::Read,
            p.b_in_a,
            (H, H),
            &[dst.range()],
            &[src.range()],
            None,
        )
        .expect("post");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    p.a.release(x).expect("release");
    assert!(
        matches!(p.a.status(x), Err(TransportError::UnknownTransfer(_))),
        "status after release"
    );
    assert!(
        matches!(p.a.release(x), Err(TransportError::UnknownTransfer(_))),
        "double release"
    );
    assert!(matches!(
        p.a.release_list(DescListId(u64::MAX - 5)),
        Err(TransportError::UnknownList(_))
    ));
}

/// Descriptors outside registered memory are refused at preparation or post, nothing moves.
pub fn out_of_bounds_rejected<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(4096, Some(2));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    let past_local = AddrRange::new(dst.addr(4000), 97);
    let past_remote = AddrRange::new(src.addr(1), 4096);
    let wrap = AddrRange::new(u64::MAX - 8, 64);
    let before = AddrRange::new(src.addr(0) - 1, 2);
    assert!(matches!(
        p.a.prepare_local(H, &[past_local]),
        Err(TransportError::OutOfBounds { .. })
    ));
    assert!(matches!(
        p.a.prepare_local(H, &[wrap]),
        Err(TransportError::OutOfBounds { .. })
    ));
    for bad in [past_remote, wrap, before] {
        assert!(
            matches!(
                p.a.prepare_remote(p.b_in_a, H, &[bad]),
                Err(TransportError::OutOfBounds { .. })
            ),
            "remote range {bad:?} accepted"
        );
    }
    // A local list prepared against the peer's memory (not ours) is refused too.
    assert!(
        p.a.prepare_local(H, &[AddrRange::new(src.addr(0), 16)])
            .is_err()
    );
    let ok_local = AddrRange::new(dst.addr(0), 96);
    for (l, r) in [
        (past_local, AddrRange::new(src.addr(0), 97)),
        (ok_local, AddrRange::new(src.addr(4050), 96)),
    ] {
        assert!(
            p.a.post(Op::Read, p.b_in_a, (H, H), &[l], &[r], None)
                .is_err(),
            "raw post {l:?} <- {r:?} accepted"
        );
        assert!(
            p.a.post(Op::Write, p.b_in_a, (H, H), &[l], &[r], None)
                .is_err()
        );
    }
    // Index out of range and length mismatch.
    let l = p.a.prepare_local(H, &[ok_local]).expect("prepare local");
    let r =
        p.a.prepare_remote(p.b_in_a, H, &[AddrRange::new(src.addr(0), 96)])
            .expect("prepare remote");
    assert!(matches!(
        p.a.post_indexed(Op::Read, l, &[1], r, &[0], None),
        Err(TransportError::IndexOutOfRange { .. })
    ));
    assert!(
        p.a.post_indexed(Op::Read, l, &[0, 0], r, &[0], None)
            .is_err()
    );
    assert!(
        p.a.post_indexed(Op::Read, r, &[0], l, &[0], None).is_err(),
        "lists swapped"
    );
    let short = AddrRange::new(src.addr(0), 95);
    assert!(matches!(
        p.a.post(Op::Read, p.b_in_a, (H, H), &[ok_local], &[short], None),
        Err(TransportError::Mismatch(_))
    ));
    verify(&src, &dst, &[]).expect("nothing moved");
}

/// Unknown and removed peers are errors; lists prepared for a removed peer are gone.
pub fn unknown_or_removed_peer<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(4096, Some(4));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    let bogus = PeerId(u64::MAX - 1);
    assert!(matches!(
        p.a.prepare_remote(bogus, H, &[src.range()]),
        Err(TransportError::UnknownPeer(_))
    ));
    assert!(p.a.send_notification(bogus, b"x").is_err());
    let l = p.a.prepare_local(H, &[dst.range()]).expect("local");
    let r =
        p.a.prepare_remote(p.b_in_a, H, &[src.range()])
            .expect("remote");
    p.a.remove_peer(p.b_in_a).expect("remove peer");
    assert!(matches!(
        p.a.remove_peer(p.b_in_a),
        Err(TransportError::UnknownPeer(_))
    ));
    assert!(
        p.a.post_indexed(Op::Read, l, &[0], r, &[0], None).is_err(),
        "list of removed peer used"
    );
    assert!(matches!(
        p.a.post(
            Op::Read,
            p.b_in_a,
            (H, H),
            &[dst.range()],
            &[src.range()],
            None
        ),
        Err(TransportError::UnknownPeer(_))
    ));
    verify(&src, &dst, &[]).expect("nothing moved");
}

/// A peer that restarts with the same name replaces the old one; new transfers reach the
/// new instance, and nothing reaches the old one.
pub fn peer_restart_same_name<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(4096, Some(6));
    let mut old_dst = Buffer::new(4096, None);
    let mut p = connect(f, &mut [&mut src], &mut [&mut old_dst]);
    let old_list =
        p.a.prepare_remote(p.b_in_a, H, &[old_dst.range()])
            .expect("remote list");
    drop(p.b);
    old_dst.registration.take();
    let mut b2 = f.create("suite-b");
    let mut new_dst = Buffer::new(4096, None);
    take_register(&mut new_dst, &mut b2);
    let b2_in_a =
        p.a.load_peer(&b2.metadata().expect("metadata"))
            .expect("load restarted peer");
    let l = p.a.prepare_local(H, &[src.range()]).expect("local");
    if let Ok(x) = p.a.post_indexed(Op::Write, l, &[0], old_list, &[0], None) {
        assert_ne!(
            wait(&mut p.a, x),
            XferStatus::Done,
            "write through a list of the old instance succeeded"
        );
    }
    let x =
        p.a.post(
            Op::Write,
            b2_in_a,
            (H, H),
            &[src.range()],
            &[new_dst.range()],
            Some(b"hi"),
        )
        .expect("post to new");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    verify(
        &src,
        &new_dst,
        &[Copy {
            src: 0,
            dst: 0,
            len: 4096,
        }],
    )
    .expect("new instance has the data");
    verify(&src, &old_dst, &[]).expect("old instance untouched");
    assert_eq!(wait_notifications(&mut b2, 1)[0].message, b"hi");
}

/// Empty lists: preparing them works and an empty transfer completes and still notifies.
pub fn zero_length_lists<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(64, Some(8));
    let mut dst = Buffer::new(64, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    let l = p.a.prepare_local(H, &[]).expect("empty local list");
    let r =
        p.a.prepare_remote(p.b_in_a, H, &[])
            .expect("empty remote list");
    let x =
        p.a.post_indexed(Op::Read, l, &[], r, &[], Some(b"empty"))
            .expect("empty indexed post");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    let x2 =
        p.a.post(Op::Write, p.b_in_a, (H, H), &[], &[], None)
            .expect("empty raw post");
    assert_eq!(wait(&mut p.a, x2), XferStatus::Done);
    assert_eq!(wait_notifications(&mut p.b, 1)[0].message, b"empty");
    verify(&src, &dst, &[]).expect("nothing moved");
}

/// Injected failures surface as `Failed`, never `Done`; the next transfer succeeds.
pub fn failures_surface_as_failed<F: TransportFactory>(f: &F) {
    let mut src = Buffer::new(1 << 16, Some(12));
    let mut dst = Buffer::new(1 << 16, None);
    let mut p = connect(f, &mut [&mut dst], &mut [&mut src]);
    if !f.inject_failures(&p.a, 2) {
        return skip(
            &f.label(),
            "failures_surface_as_failed",
            "no fault injection",
        );
    }
    for op in [Op::Read, Op::Write] {
        let (l, r) = (dst.range(), src.range());
        let x =
            p.a.post(op, p.b_in_a, (H, H), &[l], &[r], Some(b"must-not-arrive"))
                .expect("post");
        assert!(
            matches!(wait(&mut p.a, x), XferStatus::Failed(_)),
            "injected failure reported as done"
        );
    }
    let mut notes = Vec::new();
    p.b.drain_notifications(&mut notes).expect("drain");
    assert!(
        notes.is_empty(),
        "a failed transfer delivered its notification"
    );
    verify(&src, &dst, &[]).expect("failed transfer moved bytes");
    let x =
        p.a.post(
            Op::Read,
            p.b_in_a,
            (H, H),
            &[dst.range()],
            &[src.range()],
            None,
        )
        .expect("post");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
}

/// Registration rules: overlaps and empty ranges refused; a dropped registration no longer
/// admits descriptors; a transfer to a region the peer deregistered fails without writing.
pub fn registration_lifecycle<F: TransportFactory>(f: &F) {
    let mut t = f.create("suite-reg");
    let buf = Buffer::new(8192, Some(1));
    let reg = t.register(H, buf.range()).expect("register");
    let inner = AddrRange::new(buf.addr(100), 100);
    assert!(
        t.register(H, inner).is_err(),
        "overlapping registration accepted"
    );
    assert!(
        t.register(H, AddrRange::new(buf.addr(0), 0)).is_err(),
        "empty registration accepted"
    );
    t.prepare_local(H, &[inner]).expect("inside registration");
    drop(reg);
    assert!(
        t.prepare_local(H, &[inner]).is_err(),
        "descriptor in a dropped registration accepted"
    );

    let mut src = Buffer::new(4096, Some(2));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(f, &mut [&mut src], &mut [&mut dst]);
    let r =
        p.a.prepare_remote(p.b_in_a, H, &[dst.range()])
            .expect("remote list");
    let l = p.a.prepare_local(H, &[src.range()]).expect("local list");
    if !p.a.capabilities().detects_peer_deregistration {
        return skip(
            &f.label(),
            "registration_lifecycle/peer deregistration",
            "the transport cannot see a peer's deregistration",
        );
    }
    dst.registration.take();
    if let Ok(x) = p.a.post_indexed(Op::Write, l, &[0], r, &[0], None) {
        assert!(
            matches!(wait(&mut p.a, x), XferStatus::Failed(_)),
            "write into deregistered memory succeeded"
        );
    }
    verify(&src, &dst, &[]).expect("deregistered memory written");
}

/// Capabilities are declared; GPU cases are skipped with a reason where unsupported.
pub fn capabilities_declared<F: TransportFactory>(f: &F) {
    let mut t = f.create("suite-caps");
    let caps = t.capabilities();
    assert!(caps.host_memory, "every transport moves host memory");
    assert!(caps.max_descriptors >= 1);
    if !caps.gpu_memory {
        let e = t.register(MemoryKind::Gpu { device: 0 }, AddrRange::new(0x1000, 4096));
        assert!(
            matches!(
                e,
                Err(TransportError::NotAvailable { .. } | TransportError::NotSupported(_))
            ),
            "GPU registration without GPU support must be NotAvailable/NotSupported, got {e:?}"
        );
        skip(&f.label(), "gpu cases", "GPU memory not supported here");
    }
}

/// Generates one `#[test]` per conformance case for a factory expression.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr) => {
        #[test]
        fn conformance_read_random_descriptor_sets() {
            $crate::conformance::random_descriptor_sets(&$factory, ::kvxfer_core::Op::Read);
        }
        #[test]
        fn conformance_write_random_descriptor_sets() {
            $crate::conformance::random_descriptor_sets(&$factory, ::kvxfer_core::Op::Write);
        }
        #[test]
        fn conformance_metadata_round_trip() {
            $crate::conformance::metadata_round_trip(&$factory);
        }
        #[test]
        fn conformance_notification_after_data() {
            $crate::conformance::notification_after_data(&$factory);
        }
        #[test]
        fn conformance_many_in_flight() {
            $crate::conformance::many_in_flight(&$factory);
        }
        #[test]
        fn conformance_unknown_and_released_transfers() {
            $crate::conformance::unknown_and_released_transfers(&$factory);
        }
        #[test]
        fn conformance_out_of_bounds_rejected() {
            $crate::conformance::out_of_bounds_rejected(&$factory);
        }
        #[test]
        fn conformance_unknown_or_removed_peer() {
            $crate::conformance::unknown_or_removed_peer(&$factory);
        }
        #[test]
        fn conformance_peer_restart_same_name() {
            $crate::conformance::peer_restart_same_name(&$factory);
        }
        #[test]
        fn conformance_zero_length_lists() {
            $crate::conformance::zero_length_lists(&$factory);
        }
        #[test]
        fn conformance_failures_surface_as_failed() {
            $crate::conformance::failures_surface_as_failed(&$factory);
        }
        #[test]
        fn conformance_registration_lifecycle() {
            $crate::conformance::registration_lifecycle(&$factory);
        }
        #[test]
        fn conformance_capabilities_declared() {
            $crate::conformance::capabilities_declared(&$factory);
        }
    };
}
