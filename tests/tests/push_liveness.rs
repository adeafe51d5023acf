//! The push decode's liveness checks against a fake prefill that counts them: one probe per
//! heartbeat interval while the prefill has open rooms and none without; rooms fail only
//! after `max_heartbeat_failures` missed probes; dropping a decode ends its control thread; a
//! room that ends on the decode while the prefill may still write is aborted at the prefill.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::push::RoomStatus;
use kvxfer_core::push::messages::{
    self, FromPrefill, FromRegistry, RankInfo, ToPrefill, ToRegistry, encode,
};
use kvxfer_core::sidechannel::MessageServer;
use kvxfer_core::sidechannel::auth::Destination;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::pull_env::Model;
use kvxfer_tests::push_env::{DecodeSide, Setup, decode};

/// Registry and prefill rank 0 in one: it lays out one rank (itself), accepts every
/// registration and room, counts liveness probes and answers them as told, and counts the
/// aborts it is sent. It never writes.
struct FakePrefill {
    server: MessageServer,
    probes: Arc<AtomicU64>,
    healthy: Arc<AtomicBool>,
    aborts: Arc<AtomicU64>,
}

impl FakePrefill {
    /// Answers layout queries after `query_delay`.
    fn start(query_delay: Duration) -> Self {
        let probes = Arc::new(AtomicU64::new(0));
        let healthy = Arc::new(AtomicBool::new(true));
        let port = Arc::new(AtomicU16::new(0));
        let aborts = Arc::new(AtomicU64::new(0));
        let (p, h, me) = (Arc::clone(&probes), Arc::clone(&healthy), Arc::clone(&port));
        let a = Arc::clone(&aborts);
        // Registry and mailbox in one (no side-channel key here: the name is not checked).
        let server = MessageServer::bind(
            "127.0.0.1",
            0,
            1 << 20,
            Destination::registry,
            Box::new(
                move |bytes: &[u8]| match messages::decode::<ToRegistry>(bytes, "request") {
                    Ok(ToRegistry::Query) => {
                        std::thread::sleep(query_delay);
                        encode(&FromRegistry::Layout {
                            instance: 1,
                            ranks: vec![rank(me.load(Ordering::SeqCst))],
                        })
                    }
                    Ok(ToRegistry::Health) => {
                        p.fetch_add(1, Ordering::SeqCst);
                        if h.load(Ordering::SeqCst) {
                            encode(&FromRegistry::Ok)
                        } else {
                            encode(&FromRegistry::Error {
                                reason: "unwell".into(),
                            })
                        }
                    }
                    _ => {
                        if let Ok(ToPrefill::Abort { .. }) =
                            messages::decode::<ToPrefill>(bytes, "message")
                        {
                            a.fetch_add(1, Ordering::SeqCst);
                        }
                        encode(&FromPrefill::Ok)
                    }
                },
            ),
        )
        .expect("server");
        port.store(server.port(), Ordering::SeqCst);
        FakePrefill {
            server,
            probes,
            healthy,
            aborts,
        }
    }

    fn aborts(&self) -> u64 {
        self.aborts.load(Ordering::SeqCst)
    }

    fn probes(&self) -> u64 {
        self.probes.load(Ordering::SeqCst)
    }
}

/// The fake's only rank, shaped like `Model::small`'s prefill.
fn rank(port: u16) -> RankInfo {
    RankInfo {
        agent: "fake-p0-0".into(),
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        dp_size: 1,
        dp_rank: 0,
        host: "127.0.0.1".into(),
        port,
        page_size: 4,
        dtype: "f16".into(),
        first_layer: 0,
        num_layers: 2,
    }
}

const INTERVAL: Duration = Duration::from_secs(5);

/// A decode on `manual`'s clock with room 1 open at `fake` (bootstrapped, waiting for data).
fn open_room(name: &str, fake: &FakePrefill, manual: &ManualClock) -> DecodeSide {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.decode_config = |cfg| {
        cfg.heartbeat_interval = INTERVAL;
        cfg.max_heartbeat_failures = 2;
    };
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut dec = decode(&s, name, c);
    dec.ranks[0].add_room(1, ("127.0.0.1", fake.server.port()), vec![5], None, vec![]);
    poll(&mut dec, |d| {
        d.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    dec
}

/// Polls until `done`, or fails after 60 s.
fn poll(dec: &mut DecodeSide, mut done: impl FnMut(&DecodeSide) -> bool) {
    let start = Instant::now();
    while !done(dec) {
        dec.ranks[0].poll();
        assert!(start.elapsed() < Duration::from_secs(60), "never happened");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls for `ms` milliseconds of real time (the test clock stands still).
fn idle(dec: &mut DecodeSide, ms: u64) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(ms) {
        dec.ranks[0].poll();
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn one_probe_per_interval_while_rooms_are_open_and_none_without() {
    let fake = FakePrefill::start(Duration::ZERO);
    let manual = ManualClock::default();
    let mut dec = open_room("live1", &fake, &manual);
    idle(&mut dec, 200);
    assert_eq!(fake.probes(), 0, "a probe before the interval passed");
    manual.advance(INTERVAL);
    poll(&mut dec, |_| fake.probes() == 1);
    idle(&mut dec, 200);
    assert_eq!(fake.probes(), 1, "a second probe within the interval");
    manual.advance(INTERVAL);
    poll(&mut dec, |_| fake.probes() == 2);
    // An aborted room whose prefill has not acknowledged is probed still (a dead prefill
    // drains it); once the engine stops waiting for it, the prefill is not probed again.
    dec.ranks[0].abort(1);
    idle(&mut dec, 100);
    manual.advance(INTERVAL);
    poll(&mut dec, |_| fake.probes() == 3);
    dec.ranks[0].forget(1);
    idle(&mut dec, 100);
    manual.advance(INTERVAL * 3);
    idle(&mut dec, 200);
    assert_eq!(fake.probes(), 3, "probed without an open room");
}

#[test]
fn rooms_fail_only_after_the_configured_missed_probes() {
    let fake = FakePrefill::start(Duration::ZERO);
    fake.healthy.store(false, Ordering::SeqCst);
    let manual = ManualClock::default();
    let mut dec = open_room("live2", &fake, &manual);
    manual.advance(INTERVAL);
    poll(&mut dec, |_| fake.probes() == 1);
    idle(&mut dec, 200);
    assert_eq!(
        dec.ranks[0].status(1),
        Some(RoomStatus::WaitingForInput),
        "failed after one missed probe of two"
    );
    manual.advance(INTERVAL);
    poll(&mut dec, |d| {
        d.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    assert_eq!(fake.probes(), 2);
    let error = dec.ranks[0].error(1).unwrap_or_default();
    assert!(error.contains("missed 2 heartbeats"), "{error}");
    assert!(dec.ranks[0].drained(1), "a dead prefill writes no more");
}

/// A room the engine removed waits for its prefill's acknowledgement (this fake never
/// sends one) until the prefill is declared dead, then drains.
#[test]
fn a_removed_room_of_a_prefill_that_dies_drains_when_it_is_declared_dead() {
    let fake = FakePrefill::start(Duration::ZERO);
    let manual = ManualClock::default();
    let mut dec = open_room("live7", &fake, &manual);
    dec.ranks[0].remove_room(1);
    poll(&mut dec, |_| fake.aborts() == 1);
    fake.healthy.store(false, Ordering::SeqCst);
    manual.advance(INTERVAL);
    poll(&mut dec, |_| fake.probes() == 1);
    idle(&mut dec, 100);
    assert!(
        !dec.ranks[0].drained(1),
        "drained with the prefill alive, unacknowledged"
    );
    manual.advance(INTERVAL);
    poll(&mut dec, |d| d.ranks[0].drained(1));
    assert_eq!(dec.ranks[0].undrained(), 0, "drained, not given up on");
}

/// A probe answered in time resets the count: misses must be consecutive.
#[test]
fn a_good_probe_between_misses_keeps_the_rooms() {
    let fake = FakePrefill::start(Duration::ZERO);
    let manual = ManualClock::default();
    let mut dec = open_room("live3", &fake, &manual);
    // A probe goes out only once the last one's answer was handled, so the fourth probe
    // shows that the third, failed one was counted.
    for (i, healthy) in [false, true, false, true].into_iter().enumerate() {
        fake.healthy.store(healthy, Ordering::SeqCst);
        manual.advance(INTERVAL);
        poll(&mut dec, |_| fake.probes() == i as u64 + 1);
    }
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::WaitingForInput));
}

/// Dropping a decode waits for its control thread, even one blocked on a slow prefill.
#[test]
#[cfg(target_os = "linux")]
fn dropping_a_decode_ends_its_control_thread() {
    let fake = FakePrefill::start(Duration::from_secs(3));
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let mut dec = decode(&s, "zq", kvxfer_tests::scenarios::pull::clock());
    // The agent is "zq-d0": Linux shows the first 15 bytes of the thread's name.
    let thread = "kvx-push-zq-d0";
    // A thread names itself once it runs.
    let start = Instant::now();
    while !kvxfer_tests::threads::alive(thread) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no control thread"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    dec.ranks[0].add_room(1, ("127.0.0.1", fake.server.port()), vec![5], None, vec![]);
    drop(dec);
    // Not joined, the thread would wait on the slow prefill for about 3 s.
    let wait = Duration::from_millis(500);
    assert!(
        kvxfer_tests::threads::gone_within(thread, wait),
        "outlived its decode"
    );
}

/// A room aborted or forgotten by the engine before its bootstrap came back: the prefill
/// already has its destinations by then, so it is told to drop them once the bootstrap ends.
#[test]
fn a_room_ended_during_its_bootstrap_is_aborted_at_the_prefill_when_the_bootstrap_ends() {
    let fake = FakePrefill::start(Duration::from_millis(300));
    let manual = ManualClock::default();
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut dec = decode(&s, "live5", c);
    let addr = ("127.0.0.1", fake.server.port());
    dec.ranks[0].add_room(1, addr, vec![5], None, vec![]);
    dec.ranks[0].add_room(2, addr, vec![6], None, vec![]);
    dec.ranks[0].abort(1);
    dec.ranks[0].remove_room(2);
    poll(&mut dec, |_| fake.aborts() == 2);
    idle(&mut dec, 200);
    assert_eq!(fake.aborts(), 2, "each told once");
    dec.ranks[0].add_room(3, addr, vec![7], None, vec![]);
    poll(&mut dec, |d| {
        d.ranks[0].status(3) == Some(RoomStatus::WaitingForInput)
    });
    idle(&mut dec, 100);
    assert_eq!(fake.aborts(), 2, "a live room is not aborted");
}

/// A room the decode gives up on after its waiting timeout is aborted at its prefill, which
/// may otherwise still write into pages the engine hands to another request.
#[test]
fn a_room_past_its_waiting_timeout_is_aborted_at_the_prefill() {
    let fake = FakePrefill::start(Duration::ZERO);
    let manual = ManualClock::default();
    let mut dec = open_room("live6", &fake, &manual);
    idle(&mut dec, 100);
    assert_eq!(fake.aborts(), 0);
    manual.advance(Duration::from_secs(301));
    poll(&mut dec, |d| {
        d.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    poll(&mut dec, |_| fake.aborts() == 1);
    idle(&mut dec, 200);
    assert_eq!(fake.aborts(), 1, "told once");
}

/// A removed room whose live prefill never acknowledges is waited for no longer than the
/// waiting timeout after its removal, then given up on and counted.
#[test]
fn a_removed_room_never_acknowledged_is_given_up_on_after_the_waiting_timeout() {
    let fake = FakePrefill::start(Duration::ZERO);
    let manual = ManualClock::default();
    let mut dec = open_room("live8", &fake, &manual);
    dec.ranks[0].remove_room(1);
    poll(&mut dec, |_| fake.aborts() == 1);
    manual.advance(Duration::from_secs(300));
    idle(&mut dec, 100);
    assert!(
        !dec.ranks[0].drained(1),
        "given up on before the waiting timeout"
    );
    assert_eq!(dec.ranks[0].undrained(), 0);
    manual.advance(Duration::from_secs(1));
    poll(&mut dec, |d| d.ranks[0].undrained() == 1);
    assert!(dec.ranks[0].drained(1), "unknown once given up on");
}
