//! Push mode's registry through a real etcd (3.4): prefill ranks registered with their push
//! fields, and a decode whose rooms learn the ranks ("all registered") and the prefill's
//! liveness from etcd. The rooms name a bootstrap address where nothing listens, so only
//! etcd can answer them. Without an etcd binary every case prints why it is skipped.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::{Clock, SystemClock};
use kvxfer_core::push::messages::FromRegistry;
use kvxfer_core::push::{
    Addr, EtcdDirectory, PrefillDirectory, PushDecodeConfig, RoomStatus, push_records,
};
use kvxfer_discovery::etcd::{EtcdClient, Registrar};
use kvxfer_layout::BlockOrder;
use kvxfer_tests::conformance::skip;
use kvxfer_tests::etcd_server::EtcdServer;
use kvxfer_tests::pull_env::Model;
use kvxfer_tests::push_env::{DecodeSide, PrefillSide, Setup, decode, poll_until, prefill};

/// A bound on every wait: a safety net against hangs, never a timing assertion.
const LIMIT: Duration = Duration::from_secs(30);

/// Port 1 on the loopback: nothing listens, so a bootstrap registry there never answers.
fn nowhere() -> Addr {
    ("127.0.0.1".into(), 1)
}

fn with_etcd(case: &str, f: impl FnOnce(&mut EtcdServer)) {
    match EtcdServer::start() {
        Ok(mut s) => f(&mut s),
        Err(reason) => skip("etcd", case, &reason),
    }
}

fn client(s: &EtcdServer) -> Arc<EtcdClient> {
    Arc::new(EtcdClient::new(&s.url(), Duration::from_secs(2)).unwrap())
}

/// Registers prefill rank `i` of `pre` as its own process would (its own lease), named by
/// [`nowhere`].
fn register(s: &EtcdServer, pre: &PrefillSide, i: usize, instance: u64) -> Registrar {
    let info = pre.ranks[i].rank_info().clone();
    let records = push_records("t", "pe", &nowhere(), instance, &[info]).unwrap();
    Registrar::start(client(s), Duration::from_secs(2), records).unwrap()
}

/// A prefill of TP `p` and a one-rank decode whose directory is `t`'s etcd.
fn sides(
    etcd: &EtcdServer,
    p: u32,
    name: &str,
    decode_config: fn(&mut PushDecodeConfig),
) -> (Arc<EtcdDirectory>, PrefillSide, DecodeSide) {
    let dir = Arc::new(EtcdDirectory::start(client(etcd), "t").unwrap());
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), p, 1);
    s.directory = Some(dir.clone());
    s.decode_config = decode_config;
    let c: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let pre = prefill(&s, name, Arc::clone(&c), None, None);
    (dir, pre, decode(&s, name, c))
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < LIMIT, "{what} within {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TP 2 prefill whose ranks register one at a time: the decode's room waits while one is
/// missing (etcd answers "1 of 2"), then completes with every byte right; the instance it
/// reports changes when a rank's process restarts.
#[test]
fn rooms_wait_for_every_rank_in_etcd_then_complete() {
    with_etcd("push rooms wait for every rank", |etcd| {
        let (dir, mut pre, mut dec) = sides(etcd, 2, "pe1", |_| {});
        assert_eq!(
            dir.query(&nowhere(), LIMIT),
            Err("no prefill rank in etcd cluster \"t\" names bootstrap address 127.0.0.1:1".into()),
            "an address nobody registered fails at once"
        );
        let _r0 = register(etcd, &pre, 0, 10);
        wait_until("rank 0 in etcd", || {
            dir.query(&nowhere(), LIMIT)
                == Ok(FromRegistry::NotReady {
                    registered: 1,
                    expected: 2,
                })
        });
        assert!(!dir.alive(&nowhere(), LIMIT), "half an engine is not alive");
        assert_eq!(dir.resolve("pe", Duration::ZERO).map(|_| ()), Err(
            "prefill engine \"pe\" is not registered (all its ranks) in etcd cluster \"t\" after 0ns"
                .into()
        ));
        let (host, port) = nowhere();
        dec.ranks[0].add_room(1, (&host, port), vec![5, 6], None, vec![]);
        for p in &mut pre.ranks {
            p.add_room(1, 2, None, vec![]);
        }
        for _ in 0..100 {
            dec.ranks[0].poll();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Bootstrapping));
        let r1 = register(etcd, &pre, 1, 11);
        poll_until(&mut pre, &mut dec, |pre, _| {
            pre.ranks
                .iter()
                .all(|p| p.status(1) == Some(RoomStatus::WaitingForInput))
        });
        assert_eq!(dir.resolve("pe", LIMIT), Ok(nowhere()));
        let Ok(FromRegistry::Layout { instance, ranks }) = dir.query(&nowhere(), LIMIT) else {
            panic!("a whole engine");
        };
        let mailboxes: Vec<u16> = ranks.iter().map(|r| r.port).collect();
        assert_eq!(mailboxes, vec![pre.ranks[0].port(), pre.ranks[1].port()]);
        for p in &mut pre.ranks {
            p.send(1, &[3, 1]).unwrap();
        }
        poll_until(&mut pre, &mut dec, |_, dec| {
            dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
        });
        assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
        dec.mem[0].kv.verify(&[(3, 5), (1, 6)]).expect("bytes");
        // Rank 1's process restarts: a new instance for the engine.
        drop(r1);
        let _r1 = register(etcd, &pre, 1, 12);
        wait_until("the restarted rank", || {
            matches!(dir.query(&nowhere(), LIMIT),
                Ok(FromRegistry::Layout { instance: i, .. }) if i != instance)
        });
    });
}

/// The prefill's keys gone (its lease revoked, as when it stops; an expired one after a
/// crash reads the same) fail the decode's rooms waiting on it at the next missed liveness
/// probes, well before the waiting timeout.
#[test]
fn a_prefill_gone_from_etcd_fails_the_rooms_waiting_on_it() {
    with_etcd("push prefill gone from etcd", |etcd| {
        let (_dir, mut pre, mut dec) = sides(etcd, 1, "pe2", |c| {
            c.heartbeat_interval = Duration::from_millis(50);
            c.waiting_timeout = Duration::from_secs(600);
        });
        let registration = register(etcd, &pre, 0, 20);
        let (host, port) = nowhere();
        dec.ranks[0].add_room(1, (&host, port), vec![5], None, vec![]);
        pre.ranks[0].add_room(1, 1, None, vec![]);
        poll_until(&mut pre, &mut dec, |pre, dec| {
            pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
                && dec.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
        });
        // Alive while registered: probes pass.
        for _ in 0..40 {
            dec.ranks[0].poll();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::WaitingForInput));
        drop(registration);
        poll_until(&mut pre, &mut dec, |_, dec| {
            dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
        });
        assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Failed));
        let why = dec.ranks[0].error(1).unwrap_or_default();
        assert!(why.contains("127.0.0.1:1 missed 2 heartbeats"), "{why}");
    });
}

/// A rank registered a moment ago is never "nobody registered there", whether or not the
/// directory's watch has seen it yet (etcd itself is asked before saying so): twenty
/// registrations, each queried at once (a room added right after its prefill registered
/// failed now and then when only the watch was asked).
#[test]
fn a_registration_is_seen_at_once() {
    with_etcd("a registration is seen at once", |etcd| {
        let (dir, pre, _dec) = sides(etcd, 1, "pe3", |_| {});
        let info = pre.ranks[0].rank_info().clone();
        for i in 0..20u16 {
            let addr: Addr = ("127.0.0.1".into(), 2000 + i);
            let records = push_records(
                "t",
                &format!("pe-{i}"),
                &addr,
                u64::from(i),
                std::slice::from_ref(&info),
            )
            .unwrap();
            let _reg = Registrar::start(client(etcd), Duration::from_secs(2), records).unwrap();
            // Whole, or (the watch between the rank's keys) registered and not yet whole:
            // either way the room waits; never "nobody registered there".
            match dir.query(&addr, LIMIT) {
                Ok(FromRegistry::Layout { ranks, .. }) => assert_eq!(ranks.len(), 1),
                Ok(FromRegistry::NotReady { expected, .. }) => assert_eq!(expected, 1),
                other => panic!("registration {i}: {other:?}"),
            }
        }
    });
}

/// An engine registered under a name that sorts first (`-`) and naming another engine's
/// bootstrap address does not capture its rooms: two engines naming one address is refused
/// as ambiguous (neither answered, neither alive), counted; once the impostor's keys are
/// gone the rightful engine answers again.
#[test]
fn two_engines_naming_one_bootstrap_address_are_refused() {
    with_etcd("two engines naming one address", |etcd| {
        let (dir, pre, _dec) = sides(etcd, 1, "pe4", |_| {});
        let _rightful = register(etcd, &pre, 0, 40);
        // Another engine at another address is no rival.
        let elsewhere: Addr = ("127.0.0.1".into(), 2);
        let info = pre.ranks[0].rank_info().clone();
        let records = push_records("t", "other", &elsewhere, 42, &[info]).unwrap();
        let _other = Registrar::start(client(etcd), Duration::from_secs(2), records).unwrap();
        wait_until("the other engine", || {
            matches!(
                dir.query(&elsewhere, LIMIT),
                Ok(FromRegistry::Layout { .. })
            )
        });
        wait_until("the rightful engine", || {
            matches!(
                dir.query(&nowhere(), LIMIT),
                Ok(FromRegistry::Layout { .. })
            )
        });
        assert!(dir.alive(&nowhere(), LIMIT));
        let mut info = pre.ranks[0].rank_info().clone();
        info.port = 1;
        let records = push_records("t", "-", &nowhere(), 41, &[info]).unwrap();
        let impostor = Registrar::start(client(etcd), Duration::from_secs(2), records).unwrap();
        wait_until("the impostor refused", || {
            dir.query(&nowhere(), LIMIT).is_err()
        });
        let why = dir.query(&nowhere(), LIMIT).unwrap_err();
        assert!(
            why.contains("\"-\" and \"pe\"") && why.contains("ambiguous"),
            "{why}"
        );
        assert!(
            !dir.alive(&nowhere(), LIMIT),
            "an ambiguous address is not alive"
        );
        assert!(dir.ambiguous_matches() >= 2);
        drop(impostor);
        wait_until("the rightful engine again", || {
            matches!(dir.query(&nowhere(), LIMIT),
                Ok(FromRegistry::Layout { ranks, .. }) if ranks[0].port == pre.ranks[0].port())
        });
    });
}
