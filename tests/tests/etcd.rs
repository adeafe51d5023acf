//! Discovery against a real single-node etcd (3.4, as Debian ships it): registration under a
//! lease, lookup, watch changes on expiry and restart, and the store going away and coming
//! back. Without an etcd binary every case prints why it is skipped.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use kvxfer_discovery::etcd::{EtcdClient, EtcdError, Registrar, Watcher};
use kvxfer_discovery::key::role_prefix;
use kvxfer_discovery::{Change, RankIndex, RankKey, RankRecord, Role, World};
use kvxfer_tests::conformance::skip;
use kvxfer_tests::etcd_server::EtcdServer;

/// A bound on every wait: a safety net against hangs, never a timing assertion.
const LIMIT: Duration = Duration::from_secs(30);
const CALL: Duration = Duration::from_secs(2);

fn with_etcd(case: &str, f: impl FnOnce(&mut EtcdServer)) {
    match EtcdServer::start() {
        Ok(mut s) => f(&mut s),
        Err(reason) => skip("etcd", case, &reason),
    }
}

fn client(s: &EtcdServer) -> Arc<EtcdClient> {
    Arc::new(EtcdClient::new(&s.url(), CALL).unwrap())
}

fn rank(tp: u32) -> RankIndex {
    RankIndex { dp: 0, pp: 0, tp }
}

fn ranks(cluster: &str, engine: &str, tp_size: u32, instance: u64) -> Vec<(RankKey, RankRecord)> {
    (0..tp_size)
        .map(|tp| {
            let k = RankKey::new(cluster, Role::Prefill, engine, rank(tp)).unwrap();
            let r = RankRecord {
                instance,
                endpoint: format!("127.0.0.1:{}", 5600 + tp),
                layout: "test-layout".into(),
                world: World {
                    dp: 1,
                    pp: 1,
                    tp: tp_size,
                },
                push: None,
            };
            (k, r)
        })
        .collect()
}

fn next(rx: &Receiver<Change>) -> Change {
    rx.recv_timeout(LIMIT).expect("a change within the limit")
}

fn expect_ready(rx: &Receiver<Change>, engine: &str) -> kvxfer_discovery::EngineView {
    match next(rx) {
        Change::Ready(v) if v.engine_id == engine => v,
        other => panic!("expected {engine} ready, got {other:?}"),
    }
}

fn expect_lost(rx: &Receiver<Change>, engine: &str) -> String {
    match next(rx) {
        Change::Lost {
            engine_id, reason, ..
        } if engine_id == engine => reason,
        other => panic!("expected {engine} lost, got {other:?}"),
    }
}

fn watch(c: &Arc<EtcdClient>, cluster: &str) -> (Watcher, Receiver<Change>) {
    Watcher::start(c.clone(), role_prefix(cluster, Role::Prefill)).unwrap()
}

#[test]
fn registered_ranks_are_found_and_a_clean_stop_removes_them_at_once() {
    with_etcd("register and look up", |s| {
        let c = client(s);
        let (w, rx) = watch(&c, "c1");
        assert!(w.engines().is_empty());
        let reg =
            Registrar::start(c.clone(), Duration::from_secs(10), ranks("c1", "p0", 2, 7)).unwrap();
        let v = expect_ready(&rx, "p0");
        assert_eq!(
            v.world,
            World {
                dp: 1,
                pp: 1,
                tp: 2
            }
        );
        assert_eq!(v.rank(rank(1)).unwrap().endpoint, "127.0.0.1:5601");
        assert_eq!(w.engine(Role::Prefill, "p0"), Some(v));
        // Another cluster's engines are not seen.
        let _other =
            Registrar::start(c.clone(), Duration::from_secs(10), ranks("c2", "p0", 1, 8)).unwrap();
        // The keys are on one lease with the TTL asked for.
        let (_, kvs) = c
            .range_prefix(role_prefix("c1", Role::Prefill).as_bytes())
            .unwrap();
        assert_eq!(kvs.len(), 2);
        assert!(
            kvs.iter()
                .all(|kv| kv.lease == reg.status().lease && kv.lease != 0)
        );
        assert_eq!(reg.status().registrations, 1);

        let t0 = Instant::now();
        drop(reg);
        let why = expect_lost(&rx, "p0");
        assert!(why.contains("deregistered"), "{why}");
        // Revoked, not left to expire: well before the 10 s TTL.
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(w.engine(Role::Prefill, "p0").is_none());
        assert!(rx.try_recv().is_err(), "nothing about cluster c2");
    });
}

#[test]
fn a_crashed_process_keys_expire_with_its_lease_and_a_restart_is_picked_up() {
    with_etcd("crash and restart", |s| {
        let c = client(s);
        let (w, rx) = watch(&c, "c1");
        // What a crashed process leaves: keys on a lease nobody renews.
        let lease = c.grant(2).unwrap();
        for (k, r) in ranks("c1", "p0", 1, 1) {
            c.put(k.to_key().as_bytes(), &r.encode(), lease).unwrap();
        }
        expect_ready(&rx, "p0");
        let t0 = Instant::now();
        let why = expect_lost(&rx, "p0");
        assert!(why.contains("deregistered"), "{why}");
        // etcd checks expiry every 500 ms: TTL + 1 s at most.
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());

        // The restarted process registers under the same engine id: a new instance.
        let _reg =
            Registrar::start(c.clone(), Duration::from_secs(10), ranks("c1", "p0", 1, 2)).unwrap();
        assert_eq!(expect_ready(&rx, "p0").ranks[0].1.instance, 2);

        // A restart faster than the TTL overwrites the keys: lost, then the new one.
        let lease = c.grant(10).unwrap();
        for (k, r) in ranks("c1", "p0", 1, 3) {
            c.put(k.to_key().as_bytes(), &r.encode(), lease).unwrap();
        }
        let why = expect_lost(&rx, "p0");
        assert!(why.contains("restarted"), "{why}");
        assert_eq!(expect_ready(&rx, "p0").ranks[0].1.instance, 3);
        assert_eq!(
            w.engine(Role::Prefill, "p0").unwrap().ranks[0].1.instance,
            3
        );
    });
}

#[test]
fn an_unreachable_etcd_is_a_clear_error_at_start() {
    // No server needed: a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = Arc::new(EtcdClient::new(&format!("etcd://127.0.0.1:{port}"), CALL).unwrap());
    let t0 = Instant::now();
    let e = Registrar::start(c.clone(), Duration::from_secs(10), ranks("c", "p", 1, 1))
        .err()
        .expect("no registration without etcd");
    assert!(matches!(e, EtcdError::Unreachable { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("etcd unreachable at 127.0.0.1:{port}")),
        "{e}"
    );
    let e = Watcher::start(c, "/kvxfer/v1/c/".into())
        .err()
        .expect("no watch without etcd");
    assert!(matches!(e, EtcdError::Unreachable { .. }), "{e}");
    assert!(t0.elapsed() < LIMIT);
}

#[test]
fn etcd_stopped_mid_run_keeps_the_view_and_both_sides_recover_when_it_returns() {
    with_etcd("etcd outage", |s| {
        let c = client(s);
        let (w, rx) = watch(&c, "c1");
        let reg =
            Registrar::start(c.clone(), Duration::from_secs(3), ranks("c1", "p0", 1, 1)).unwrap();
        expect_ready(&rx, "p0");
        let resyncs = w.status().resyncs;

        s.kill();
        // Renewals (every second) fail and are retried; the watch notices within its probe.
        wait_until("the registrar notices", || reg.status().failures > 0);
        wait_until("the watcher notices", || !w.status().connected);
        assert!(!reg.status().registered);
        // The last view stays: an outage of the store fails nothing.
        assert!(w.engine(Role::Prefill, "p0").is_some());
        assert!(rx.try_recv().is_err());

        // etcd comes back with its data: the lease is still there (etcd extends leases on
        // restart), the registrar renews it, the watcher resyncs and sees no change.
        s.restart(true);
        wait_until("the registrar renews", || reg.status().registered);
        wait_until("the watcher resyncs", || {
            w.status().connected && w.status().resyncs > resyncs
        });
        assert_eq!(reg.status().registrations, 1);
        assert!(w.engine(Role::Prefill, "p0").is_some());
        assert!(
            rx.try_recv().is_err(),
            "no change for an engine that stayed"
        );

        // etcd comes back empty (a lost member): the registrar registers again under a new
        // lease. The watcher either resyncs before that (the engine goes, then comes back) or
        // after (the same records: nothing happened to the engine).
        s.restart(false);
        wait_until("the registrar registers again", || {
            reg.status().registrations == 2
        });
        assert!(reg.status().registered);
        wait_until("the watcher sees it", || {
            w.status().connected && w.engine(Role::Prefill, "p0").is_some()
        });
        let changes: Vec<Change> = rx.try_iter().collect();
        match &changes[..] {
            [] => {}
            [Change::Lost { .. }, Change::Ready(v)] => assert_eq!(v.engine_id, "p0"),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn lookups_answer_from_the_last_view_while_etcd_hangs() {
    with_etcd("etcd hanging", |s| {
        let c = client(s);
        let (w, rx) = watch(&c, "c1");
        let reg =
            Registrar::start(c.clone(), Duration::from_secs(30), ranks("c1", "p0", 1, 1)).unwrap();
        expect_ready(&rx, "p0");
        s.freeze(true);
        // The watch's probe goes unanswered; from then on the watcher ranges again and again,
        // each range waiting out the client's call timeout.
        wait_until("the watcher notices", || !w.status().connected);
        let mut slowest = Duration::ZERO;
        let until = Instant::now() + 3 * CALL;
        while Instant::now() < until {
            let t = Instant::now();
            assert!(
                w.engine(Role::Prefill, "p0").is_some(),
                "the last view stays"
            );
            slowest = slowest.max(t.elapsed());
        }
        s.freeze(false);
        // Ranging under the lock made a lookup wait for a whole range: the call timeout.
        assert!(slowest < CALL / 4, "a lookup waited {slowest:?} for etcd");
        drop(reg);
    });
}

#[test]
fn a_watch_from_a_compacted_revision_is_told_so() {
    with_etcd("compaction", |s| {
        let c = client(s);
        let first = c.put(b"/kvxfer/v1/c/x", b"1", 0).unwrap();
        let last = c.put(b"/kvxfer/v1/c/x", b"2", 0).unwrap();
        c.compact(last).unwrap();
        let mut stream = c.watch(b"/kvxfer/v1/c/", first).unwrap();
        let t0 = Instant::now();
        loop {
            match stream.next(Duration::from_millis(100)) {
                kvxfer_discovery::etcd::WatchItem::Changes(r) if r.compact_revision > 0 => {
                    assert!(r.canceled);
                    assert_eq!(r.compact_revision, last);
                    break;
                }
                kvxfer_discovery::etcd::WatchItem::Lost(why) => panic!("{why}"),
                _ => assert!(t0.elapsed() < LIMIT, "no compaction notice"),
            }
        }
    });
}

#[test]
fn foreign_and_malformed_keys_under_the_prefix_are_ignored() {
    with_etcd("malformed keys", |s| {
        let c = client(s);
        let prefix = role_prefix("c1", Role::Prefill);
        c.put(
            format!("{prefix}p0/ranks/0.0.0").as_bytes(),
            b"not a record",
            0,
        )
        .unwrap();
        c.put(format!("{prefix}p0/other").as_bytes(), b"{}", 0)
            .unwrap();
        let (w, rx) = watch(&c, "c1");
        assert_eq!(w.ignored(), 2);
        c.put(
            format!("{prefix}p1/ranks/0.0.0").as_bytes(),
            &[0xff; 5000],
            0,
        )
        .unwrap();
        let _reg =
            Registrar::start(c.clone(), Duration::from_secs(10), ranks("c1", "p2", 1, 1)).unwrap();
        expect_ready(&rx, "p2");
        assert_eq!(w.ignored(), 3);
        assert_eq!(w.engines().len(), 1);
    });
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < LIMIT, "{what}: not within {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
