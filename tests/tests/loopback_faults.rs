//! The loopback's fault injection does what tests rely on: held completions, lost and
//! duplicated notifications, vanished peers.

use kvxfer_core::{MemoryKind, Op, Transport, TransportError, XferStatus};
use kvxfer_tests::conformance::{TransportFactory, connect, wait, wait_notifications};
use kvxfer_tests::memory::{Buffer, Copy, verify};
use kvxfer_transport_loopback::LoopbackTransport;

struct Loopback;

impl TransportFactory for Loopback {
    type T = LoopbackTransport;
    fn label(&self) -> String {
        "loopback".into()
    }
    fn create(&self, name: &str) -> LoopbackTransport {
        LoopbackTransport::new(name).expect("agent")
    }
}

const H: (MemoryKind, MemoryKind) = (MemoryKind::Host, MemoryKind::Host);

fn drain(t: &mut LoopbackTransport) -> Vec<kvxfer_core::Notification> {
    let mut v = Vec::new();
    t.drain_notifications(&mut v).expect("drain");
    v
}

#[test]
fn held_completion_stays_in_progress_until_released() {
    let mut src = Buffer::new(1 << 20, Some(1));
    let mut dst = Buffer::new(1 << 20, None);
    let mut p = connect(&Loopback, &mut [&mut src], &mut [&mut dst]);
    let faults = p.a.faults();
    faults.hold_completions(true);
    let x =
        p.a.post(
            Op::Write,
            p.b_in_a,
            H,
            &[src.range()],
            &[dst.range()],
            Some(b"n"),
        )
        .expect("post");
    for _ in 0..1000 {
        assert_eq!(p.a.status(x).expect("status"), XferStatus::InProgress);
        std::thread::yield_now();
    }
    assert!(
        drain(&mut p.b).is_empty(),
        "notification of a held transfer delivered"
    );
    faults.release_held();
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    assert_eq!(wait_notifications(&mut p.b, 1)[0].message, b"n");
    verify(
        &src,
        &dst,
        &[Copy {
            src: 0,
            dst: 0,
            len: 1 << 20,
        }],
    )
    .expect("bytes");
}

#[test]
fn dropped_and_duplicated_notifications() {
    let mut src = Buffer::new(4096, Some(2));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(&Loopback, &mut [&mut src], &mut [&mut dst]);
    let faults = p.a.faults();
    faults.drop_next_notifications(1);
    let x =
        p.a.post(
            Op::Write,
            p.b_in_a,
            H,
            &[src.range()],
            &[dst.range()],
            Some(b"lost"),
        )
        .expect("post");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    assert!(drain(&mut p.b).is_empty(), "dropped notification arrived");
    faults.duplicate_next_notifications(1);
    p.a.send_notification(p.b_in_a, b"twice").expect("send");
    let got = drain(&mut p.b);
    assert_eq!(got.len(), 2);
    assert!(got.iter().all(|n| n.message == b"twice"));
    p.a.send_notification(p.b_in_a, b"once").expect("send");
    assert_eq!(drain(&mut p.b).len(), 1);
}

#[test]
fn vanished_peer_fails_transfers_and_cannot_be_loaded() {
    let mut src = Buffer::new(4096, Some(3));
    let mut dst = Buffer::new(4096, None);
    let mut p = connect(&Loopback, &mut [&mut src], &mut [&mut dst]);
    let meta = p.b.metadata().expect("meta");
    // A transfer whose completion is held when the peer vanishes fails.
    p.a.faults().hold_completions(true);
    let x =
        p.a.post(Op::Write, p.b_in_a, H, &[src.range()], &[dst.range()], None)
            .expect("post");
    p.b.faults().vanish();
    p.a.faults().release_held();
    assert!(matches!(wait(&mut p.a, x), XferStatus::Failed(_)));
    // New transfers fail, loading it again is refused, notifications cannot be sent.
    let y =
        p.a.post(Op::Read, p.b_in_a, H, &[src.range()], &[dst.range()], None);
    if let Ok(y) = y {
        assert!(matches!(wait(&mut p.a, y), XferStatus::Failed(_)));
    }
    assert!(matches!(
        p.a.load_peer(&meta),
        Err(TransportError::PeerGone(_))
    ));
    assert!(p.a.send_notification(p.b_in_a, b"x").is_err());
}

/// Releasing a transfer that is still copying cancels it and returns only when no copy runs
/// any more: a connector reports the destination invalid right after the release, and the
/// engine may reuse it at once, so nothing may land there afterwards.
#[test]
fn nothing_lands_after_a_release() {
    const PIECE: u64 = 16 << 10;
    let mut src = Buffer::new(64 << 20, Some(3));
    let mut dst = Buffer::new(64 << 20, None);
    let mut p = connect(&Loopback, &mut [&mut src], &mut [&mut dst]);
    // Many small jobs, so that most are still queued when the release comes.
    let pieces = (64 << 20) / PIECE;
    let local: Vec<_> = (0..pieces)
        .map(|i| kvxfer_core::AddrRange::new(src.addr(i * PIECE), PIECE))
        .collect();
    let remote: Vec<_> = (0..pieces)
        .map(|i| kvxfer_core::AddrRange::new(dst.addr(i * PIECE), PIECE))
        .collect();
    for round in 0..5 {
        let x =
            p.a.post(Op::Write, p.b_in_a, H, &local, &remote, None)
                .expect("post");
        p.a.release(x).expect("release");
        dst.bytes_mut().fill(0x5a);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let landed = dst.bytes().iter().filter(|&&b| b != 0x5a).count();
        assert_eq!(
            landed, 0,
            "round {round}: {landed} bytes landed after the release"
        );
    }
}
