//! Pull-connector scenarios on the loopback: the shared list in
//! `kvxfer_tests::scenarios::pull`, plus the scenarios that need the loopback's fault
//! injection (held completions, failing transfers, a vanishing peer, resource counts).

use std::sync::Arc;

use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::pull::{LoadRefused, PullConfig};
use kvxfer_core::sidechannel::{Listener, fetch_metadata};
use kvxfer_core::wire::handshake::{HandshakeMeta, MAX_HANDSHAKE_BYTES, PROTOCOL_VERSION};
use kvxfer_core::wire::params::KvTransferParams;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::loopback::Loopback;
use kvxfer_tests::pull_env::{Model, engine, failed_loads, poll_until};
use kvxfer_tests::scenarios::pull::{clock, first_failure, no_tune};
use kvxfer_transport_loopback::LoopbackTransport;

fn run(_case: &str, body: impl FnOnce(&Loopback)) {
    body(&Loopback);
}

kvxfer_tests::pull_scenarios!(run);

fn lb(name: &str) -> LoopbackTransport {
    LoopbackTransport::new(name).expect("loopback")
}

#[test]
fn transfer_failure_is_reported_not_done() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("xfail-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("xfail-D", &model, 1, false, c, &lb, &no_tune);
    dec.workers[0].transport().faults().fail_next_transfers(1);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![2]);
    assert_eq!(dec.workers[0].take_metrics().failed_transfers, 1);
}

#[test]
fn request_finishes_only_when_all_its_transfers_do() {
    // Prefill TP 2 into decode TP 1: two READs for one request.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("multi-P", &model, 2, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("multi-D", &model, 1, false, c, &lb, &no_tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    // Wait until both READs are posted (handshake done), still held.
    poll_until(&mut [&mut dec], |_, f| {
        assert!(f[0].recving.is_empty(), "finished while transfers are held");
        true
    });
    let start = std::time::Instant::now();
    loop {
        let f = dec.poll();
        assert!(f[0].recving.is_empty(), "finished while transfers are held");
        if dec.workers[0].transport().open_transfers() == 2 {
            break;
        }
        assert!(start.elapsed().as_secs() < 60);
        std::thread::yield_now();
    }
    for _ in 0..100 {
        assert!(dec.poll()[0].recving.is_empty());
    }
    faults.release_held();
    poll_until(&mut [&mut dec], |_, f| {
        f[0].recving == vec!["r".to_string()]
    });
    dec.caches[0].verify(&[(1, 2)]).expect("bytes");
}

#[test]
fn a_second_load_of_a_request_in_flight_is_refused_and_the_first_completes() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("dup-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("dup-D", &model, 1, false, c, &lb, &no_tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    let meta = dec.start_load("r", &params, &[2], 4);
    let dup = || vec![LoadRefused::AlreadyInFlight("r".into())];
    // Queued behind its handshake.
    assert_eq!(dec.workers[0].start_load_kv(&meta), dup());
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(start.elapsed().as_secs() < 60, "the READ was never posted");
        std::thread::yield_now();
    }
    // Posted, its completion held.
    assert_eq!(dec.workers[0].start_load_kv(&meta), dup());
    for _ in 0..10 {
        assert!(dec.poll()[0].recving.is_empty());
    }
    assert_eq!(
        dec.workers[0].transport().open_transfers(),
        1,
        "a second READ"
    );
    faults.release_held();
    let mut reported = Vec::new();
    poll_until(&mut [&mut dec], |_, f| {
        reported.extend(f[0].recving.clone());
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        !reported.is_empty()
    });
    assert_eq!(reported, vec!["r".to_string()]);
    dec.caches[0].verify(&[(1, 2)]).expect("bytes");
    // Ended but not yet reported: a load whose blocks do not pair fails when it starts.
    let mut both = meta.clone();
    both.recv[0].req_id = "s".into();
    both.recv[0].remote_block_ids = vec![Vec::new()];
    both.recv.push(both.recv[0].clone());
    assert_eq!(
        dec.workers[0].start_load_kv(&both),
        vec![LoadRefused::AlreadyInFlight("s".into())]
    );
    let f = dec.poll();
    assert_eq!(f[0].recving, vec!["s".to_string()]);
    assert_eq!(f[0].failed.len(), 1, "{:?}", f[0].failed);
    assert_eq!(dec.workers[0].take_metrics().refused_loads, 3);
    // Reported, the id may be loaded again.
    let mut again = meta.clone();
    again.recv[0].local_block_ids = vec![vec![3]];
    assert!(dec.workers[0].start_load_kv(&again).is_empty());
}

/// The handshake metadata of the prefill that `params` name.
fn prefill_metadata(params: &KvTransferParams) -> HandshakeMeta {
    let host = params.remote_host.clone().unwrap();
    let port = params.remote_port.unwrap();
    let engine_id = params.remote_engine_id.clone().unwrap();
    let wait = std::time::Duration::from_secs(5);
    fetch_metadata(&host, port, &engine_id, None, wait, MAX_HANDSHAKE_BYTES).unwrap()
}

/// Serves `meta` from a listener of its own, and `params` pointed at it: the same prefill,
/// announced as a test wants it announced. Keep the listener while it is used.
fn announce(params: &KvTransferParams, meta: &HandshakeMeta) -> (Listener, KvTransferParams) {
    let listener = Listener::bind("127.0.0.1", 0, 0, meta.encode()).unwrap();
    let mut at = params.clone();
    at.remote_port = Some(listener.port());
    (listener, at)
}

#[test]
fn a_kvxfer_peer_of_another_protocol_version_is_refused_naming_both() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("proto-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let params = pre.finish_prefill("r", &[1]);
    let mut meta = prefill_metadata(&params);
    meta.kvxfer_protocol = Some(PROTOCOL_VERSION + 1);
    // The same prefill, announced by a listener that claims the next protocol version.
    let (_forged, at_forged) = announce(&params, &meta);
    let mut strict = engine("proto-D1", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
    strict.start_load("r", &at_forged, &[2], 4);
    let reason = first_failure(&mut strict)[0].reason.clone();
    let want = format!(
        "kvxfer protocol: local {PROTOCOL_VERSION}, remote {}",
        PROTOCOL_VERSION + 1
    );
    assert!(reason.contains(&want), "{reason}");
    strict.caches[0].verify(&[]).expect("nothing written");
    // A layout with no protocol version at all is refused too.
    meta.kvxfer_protocol = None;
    let (_unversioned, at_unversioned) = announce(&params, &meta);
    strict.start_load("r2", &at_unversioned, &[3], 4);
    let reason = first_failure(&mut strict)[0].reason.clone();
    assert!(reason.contains("remote none"), "{reason}");
    // The escape hatch lets it through, and the bytes move.
    let lax_cfg = |cfg: &mut PullConfig| cfg.enforce_compat = false;
    let mut lax = engine("proto-D2", &model, 1, false, c, &lb, &lax_cfg);
    lax.start_load("r", &at_forged, &[2], 4);
    poll_until(&mut [&mut lax], |_, f| {
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        !f[0].recving.is_empty()
    });
    lax.caches[0].verify(&[(1, 2)]).expect("bytes");
}

/// A request that names one engine at an address where another answers (a stale reference
/// after the address was reused, or a misrouted one) fails its load naming both, and
/// nothing is read; asked as the engine it is, the prefill serves the same blocks.
#[test]
fn a_prefill_that_answers_as_another_engine_is_not_read() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("who-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let params = pre.finish_prefill("r", &[1]);
    let mut dec = engine("who-D", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
    let mut elsewhere = params.clone();
    elsewhere.remote_engine_id = Some("who-Q".into());
    dec.start_load("r", &elsewhere, &[2], 4);
    let reason = first_failure(&mut dec)[0].reason.clone();
    assert!(
        reason.contains("is engine \"who-P\", the request names \"who-Q\""),
        "{reason}"
    );
    dec.caches[0].verify(&[]).expect("nothing read");
    let mut named = engine("who-D2", &model, 1, false, c, &lb, &no_tune);
    named.start_load("r", &params, &[2], 4);
    poll_until(&mut [&mut named], |_, f| {
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        !f[0].recving.is_empty()
    });
    named.caches[0].verify(&[(1, 2)]).expect("bytes");
}

/// A reference peer (vLLM's handshake, no kvxfer layout) is described by its block length:
/// the spec derived from ours must have that length, or the load is refused naming it.
#[test]
fn a_reference_peer_is_checked_by_its_block_length() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("ref-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let params = pre.finish_prefill("r", &[1]);
    let mut meta = prefill_metadata(&params);
    // The same prefill, announced as a reference peer would announce it.
    meta.kvxfer_layout = None;
    meta.kvxfer_protocol = None;
    let (_as_reference, at_reference) = announce(&params, &meta);
    let mut dec = engine("ref-D1", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
    dec.start_load("r", &at_reference, &[2], 4);
    poll_until(&mut [&mut dec], |_, f| {
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        !f[0].recving.is_empty()
    });
    dec.caches[0].verify(&[(1, 2)]).expect("bytes");
    // One byte off: refused before anything moves.
    meta.block_len += 1;
    let (_wrong, at_wrong) = announce(&params, &meta);
    let mut strict = engine("ref-D2", &model, 1, false, c, &lb, &no_tune);
    strict.start_load("r", &at_wrong, &[3], 4);
    let reason = first_failure(&mut strict)[0].reason.clone();
    assert!(reason.contains("block_len"), "{reason}");
    strict.caches[0].verify(&[]).expect("nothing written");
}

#[test]
fn shutdown_releases_exactly_what_was_created() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("shut-P", &model, 2, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("shut-D", &model, 1, false, c, &lb, &no_tune);
    // Each prefill rank reports the port its listener bound: base + rank.
    let ports: Vec<_> = pre.workers.iter().map(|w| w.listener_port()).collect();
    assert_eq!(ports, [Some(pre.base_port), Some(pre.base_port + 1)]);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
    let (peers, lists, xfers, regions) = dec.workers[0].transport().resource_counts();
    assert_eq!(
        (peers, lists, xfers),
        (2, 0, 0),
        "two prefill ranks loaded, transfers released"
    );
    assert!(regions >= 1);
    dec.workers[0].shutdown();
    assert_eq!(dec.workers[0].transport().resource_counts(), (0, 0, 0, 0));
    dec.workers[0].shutdown();
    assert_eq!(
        dec.workers[0].transport().resource_counts(),
        (0, 0, 0, 0),
        "idempotent"
    );
    assert!(dec.workers[0].listener_port().is_none());
}

#[test]
fn prefill_vanishing_mid_transfer_fails_the_load() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("vanish-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("vanish-D", &model, 1, false, c, &lb, &no_tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(start.elapsed().as_secs() < 60);
    }
    pre.workers[0].transport().faults().vanish();
    faults.release_held();
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![2]);
}

#[test]
fn heartbeats_keep_the_lease_while_decode_loads() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let tune = |cfg: &mut PullConfig| {
        cfg.lease = std::time::Duration::from_secs(30);
        cfg.heartbeat_interval = std::time::Duration::from_secs(5);
        // The held READ stays pending for two minutes here: longer than the default
        // transfer timeout, which is not what this test is about.
        cfg.transfer_timeout = std::time::Duration::from_secs(600);
    };
    let mut pre = engine("hb-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("hb-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        dec.poll();
        assert!(start.elapsed().as_secs() < 60);
    }
    // Two minutes of held transfer: heartbeats every 5 s renew the 30 s lease.
    for _ in 0..24 {
        manual.advance(std::time::Duration::from_secs(5));
        assert!(dec.poll()[0].recving.is_empty());
        // Heartbeats are delivered synchronously on the loopback.
        assert!(
            pre.poll()[0].sending.is_empty(),
            "lease expired despite heartbeats"
        );
    }
    faults.release_held();
    poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
    poll_until(&mut [&mut pre], |_, f| !f[0].sending.is_empty());
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 0);
    // Without heartbeats (decode gone), the same wait expires the lease.
    let _ = pre.finish_prefill("orphan", &[3]);
    manual.advance(std::time::Duration::from_secs(31));
    assert_eq!(pre.poll()[0].sending, vec!["orphan".to_string()]);
}

/// A prefill and a decode on a manual clock, with 30 s leases and 5 s heartbeats.
fn lease_pair(
    name: &str,
) -> (
    ManualClock,
    kvxfer_tests::pull_env::Engine<LoopbackTransport>,
    kvxfer_tests::pull_env::Engine<LoopbackTransport>,
) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let tune = |cfg: &mut PullConfig| {
        cfg.lease = std::time::Duration::from_secs(30);
        cfg.heartbeat_interval = std::time::Duration::from_secs(5);
    };
    let pre = engine(
        &format!("{name}-P"),
        &model,
        1,
        true,
        Arc::clone(&c),
        &lb,
        &tune,
    );
    let dec = engine(&format!("{name}-D"), &model, 1, false, c, &lb, &tune);
    (manual, pre, dec)
}

/// Polls `dec` until its rank 0 handshook (real time: a thread handshakes), before any load.
/// Returns the heartbeats sent meanwhile.
fn connected_ahead(dec: &mut kvxfer_tests::pull_env::Engine<LoopbackTransport>) -> u64 {
    let start = std::time::Instant::now();
    let (mut handshakes, mut heartbeats) = (0, 0);
    while handshakes == 0 {
        dec.poll();
        let m = dec.workers[0].take_metrics();
        (handshakes, heartbeats) = (handshakes + m.handshakes, heartbeats + m.heartbeats);
        assert!(
            start.elapsed().as_secs() < 60,
            "no handshake ahead of the load"
        );
    }
    heartbeats
}

/// A request waiting in the decode engine for blocks keeps the prefill's lease from the
/// engine's first ask (vLLM's decode heartbeats from arrival too), over a connection made
/// ahead of the load; one that ends waiting stops, and its lease then runs out.
#[test]
fn a_request_waiting_for_blocks_keeps_the_lease_until_it_loads_or_ends() {
    use std::time::Duration;
    let (manual, mut pre, mut dec) = lease_pair("wait");
    let params = pre.finish_prefill("r", &[1]);
    let orphan = pre.finish_prefill("q", &[3]);
    for (id, p) in [("r", &params), ("q", &orphan)] {
        assert_eq!(
            dec.scheduler.tokens_to_load(id, Some(p), 4, 0),
            Ok((4, true))
        );
    }
    let meta = dec.scheduler.build_step_meta();
    assert!(meta.recv.is_empty());
    for w in &mut dec.workers {
        w.start_load_kv(&meta);
    }
    // The connection is made while the requests wait (real time: a thread handshakes).
    connected_ahead(&mut dec);
    // Two minutes of waiting: heartbeats every 5 s renew both 30 s leases.
    for _ in 0..24 {
        manual.advance(Duration::from_secs(5));
        dec.poll();
        assert!(
            pre.poll()[0].sending.is_empty(),
            "a lease expired while waiting"
        );
    }
    // "r" loads; the prefill frees its blocks on the read note, not by lease.
    dec.scheduler
        .request_finished("q", Some(&orphan), false, &[], None);
    let meta = dec.start_load("r", &params, &[2], 4);
    assert_eq!(meta.unwait, vec!["q".to_string()]);
    poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
    let mut sent = Vec::new();
    poll_until(&mut [&mut pre], |_, f| {
        sent.extend(f[0].sending.iter().cloned());
        !sent.is_empty()
    });
    assert_eq!(sent, vec!["r".to_string()]);
    // "q" ended without loading and "r" loaded: no more heartbeats, and q's lease runs out
    // 30 s after the last one, at 120 s.
    dec.workers[0].take_metrics();
    manual.advance(Duration::from_secs(25));
    dec.poll();
    assert!(pre.poll()[0].sending.is_empty(), "q's lease expired early");
    manual.advance(Duration::from_secs(5));
    dec.poll();
    assert_eq!(pre.poll()[0].sending, vec!["q".to_string()]);
    assert_eq!(
        dec.workers[0].take_metrics().heartbeats,
        0,
        "for ended waits or loads"
    );
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 1, "q's only");
}

/// A request that begins and ends waiting within one engine step (its step metadata names
/// it in both `wait` and `unwait`) is not heartbeated: its lease runs out.
#[test]
fn a_wait_ended_within_its_step_is_not_heartbeated() {
    use std::time::Duration;
    let (manual, mut pre, mut dec) = lease_pair("unwait");
    let params = pre.finish_prefill("q", &[1]);
    dec.scheduler
        .tokens_to_load("q", Some(&params), 4, 0)
        .unwrap();
    dec.scheduler
        .request_finished("q", Some(&params), false, &[], None);
    let meta = dec.scheduler.build_step_meta();
    assert_eq!((meta.wait.len(), meta.unwait.len()), (1, 1));
    dec.workers[0].start_load_kv(&meta);
    connected_ahead(&mut dec);
    for _ in 0..5 {
        manual.advance(Duration::from_secs(5));
        dec.poll();
        assert!(pre.poll()[0].sending.is_empty());
    }
    manual.advance(Duration::from_secs(5));
    dec.poll();
    assert_eq!(pre.poll()[0].sending, vec!["q".to_string()]);
    assert_eq!(dec.workers[0].take_metrics().heartbeats, 0);
}

/// The first heartbeat goes as the connection to the prefill is made, not up to an interval
/// later: the time a request waited for the connection is already spent from its lease. The
/// decode connects at 4 s, before its first 5 s interval; only that heartbeat can keep the
/// prefill's lease (30 s from the prefill's end) past 30 s.
#[test]
fn the_first_heartbeat_goes_as_the_connection_is_made() {
    use std::time::Duration;
    let (manual, mut pre, mut dec) = lease_pair("first-hb");
    let params = pre.finish_prefill("r", &[1]);
    manual.advance(Duration::from_secs(4));
    dec.scheduler
        .tokens_to_load("r", Some(&params), 4, 0)
        .unwrap();
    let meta = dec.scheduler.build_step_meta();
    dec.workers[0].start_load_kv(&meta);
    assert_eq!(
        connected_ahead(&mut dec),
        1,
        "one heartbeat, as the connection was made"
    );
    assert!(pre.poll()[0].sending.is_empty()); // takes the note at 4 s
    manual.advance(Duration::from_secs(26));
    assert!(
        pre.poll()[0].sending.is_empty(),
        "the lease ran out 30 s after the prefill: no heartbeat at the connection"
    );
    manual.advance(Duration::from_secs(4));
    assert_eq!(
        pre.poll()[0].sending,
        vec!["r".to_string()],
        "34 s: 30 s after it"
    );
}

/// A request that starts waiting on a prefill already connected is heartbeated in that step,
/// not at the decode's next interval: "r" asks at 4 s and the decode is not polled again, so
/// only that heartbeat keeps r's lease past 30 s, while "a" (heartbeated as the connection
/// was made, at 0 s, then no longer waiting) runs out at 30 s, and "q" (which began and ended
/// waiting in r's step) is not heartbeated at all.
#[test]
fn a_request_waiting_on_a_connected_prefill_is_heartbeated_on_arrival() {
    use std::time::Duration;
    let (manual, mut pre, mut dec) = lease_pair("arrival-hb");
    let a = pre.finish_prefill("a", &[1]);
    let r = pre.finish_prefill("r", &[3]);
    let q = pre.finish_prefill("q", &[4]);
    dec.scheduler.tokens_to_load("a", Some(&a), 4, 0).unwrap();
    let meta = dec.scheduler.build_step_meta();
    dec.workers[0].start_load_kv(&meta);
    connected_ahead(&mut dec);
    assert!(pre.poll()[0].sending.is_empty()); // takes a's heartbeat at 0 s
    dec.scheduler
        .request_finished("a", Some(&a), false, &[], None);
    manual.advance(Duration::from_secs(4));
    dec.scheduler.tokens_to_load("r", Some(&r), 4, 0).unwrap();
    dec.scheduler.tokens_to_load("q", Some(&q), 4, 0).unwrap();
    dec.scheduler
        .request_finished("q", Some(&q), false, &[], None);
    let meta = dec.scheduler.build_step_meta();
    assert_eq!((meta.wait.len(), meta.unwait.len()), (2, 2));
    dec.workers[0].start_load_kv(&meta);
    assert_eq!(
        dec.workers[0].take_metrics().heartbeats,
        1,
        "r's, on arrival"
    );
    assert!(pre.poll()[0].sending.is_empty()); // takes it at 4 s
    manual.advance(Duration::from_secs(26));
    let mut sent = pre.poll()[0].sending.clone();
    sent.sort();
    assert_eq!(
        sent,
        vec!["a".to_string(), "q".to_string()],
        "30 s: a's and q's"
    );
    manual.advance(Duration::from_secs(4));
    assert_eq!(pre.poll()[0].sending, vec!["r".to_string()], "34 s: r's");
}

/// Heartbeats go out once per interval, at the interval and after it. The prefill polls
/// before the decode at each tick, so a heartbeat sent late arrives after the lease ran out:
/// ticks of 1 s against a 5.5 s lease catch a decode that waits past the interval, ticks of
/// 7 s against an 8 s lease one that stays silent once more than the interval passed.
#[test]
fn heartbeats_go_out_at_every_interval_however_the_clock_steps() {
    use std::time::Duration;
    for (tick, lease) in [(1000, 5500), (7000, 8000)] {
        let model = Model::small(BlockOrder::Hnd, 4);
        let manual = ManualClock::default();
        let c: Arc<dyn Clock> = Arc::new(manual.clone());
        let tune = |cfg: &mut PullConfig| {
            cfg.lease = Duration::from_millis(lease);
            cfg.heartbeat_interval = Duration::from_secs(5);
            cfg.transfer_timeout = Duration::from_secs(600);
        };
        let name = format!("hb{tick}");
        let mut pre = engine(
            &format!("{name}-P"),
            &model,
            1,
            true,
            Arc::clone(&c),
            &lb,
            &tune,
        );
        let mut dec = engine(&format!("{name}-D"), &model, 1, false, c, &lb, &tune);
        let faults = dec.workers[0].transport().faults();
        faults.hold_completions(true);
        let params = pre.finish_prefill("r", &[1]);
        dec.start_load("r", &params, &[2], 4);
        let start = std::time::Instant::now();
        while dec.workers[0].transport().open_transfers() == 0 {
            dec.poll();
            assert!(start.elapsed().as_secs() < 60);
        }
        for i in 0..30 {
            manual.advance(Duration::from_millis(tick));
            assert!(
                pre.poll()[0].sending.is_empty(),
                "ticks of {tick} ms: the lease expired at tick {i}"
            );
            assert!(dec.poll()[0].recving.is_empty());
        }
        // And no more than once per interval: one as the connection was made, then at 5,
        // 10, ... 30 s with 1 s ticks, at every 7 s tick.
        let want = if tick == 1000 { 7 } else { 31 };
        assert_eq!(
            dec.workers[0].take_metrics().heartbeats,
            want,
            "ticks of {tick} ms"
        );
        faults.release_held();
        poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
        assert_eq!(pre.workers[0].take_metrics().expired_leases, 0);
    }
}

/// A READ that never completes (a cut link: TCP keeps retrying) is cancelled after
/// `transfer_timeout` and its load reported failed with its blocks; not a moment before.
#[test]
fn stuck_transfer_times_out_and_fails_the_load() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let tune = |cfg: &mut PullConfig| cfg.transfer_timeout = std::time::Duration::from_secs(10);
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut pre = engine("stuck-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("stuck-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[5, 6], 8);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        let f = dec.poll();
        assert!(f[0].recving.is_empty() && f[0].failed.is_empty());
        assert!(start.elapsed().as_secs() < 60, "the READ was never posted");
        std::thread::yield_now();
    }
    // The READ was posted at 0 s: at exactly the timeout it still counts as in time.
    manual.advance(std::time::Duration::from_secs(10));
    for _ in 0..20 {
        let f = dec.poll();
        assert!(f[0].failed.is_empty(), "failed at exactly the timeout");
    }
    manual.advance(std::time::Duration::from_millis(1));
    let f = dec.poll();
    assert_eq!(f[0].failed.len(), 1, "{:?}", f[0]);
    assert_eq!(f[0].failed[0].invalid_blocks, vec![5, 6]);
    assert!(
        f[0].failed[0].reason.contains("no completion"),
        "{}",
        f[0].failed[0].reason
    );
    assert_eq!(
        dec.workers[0].transport().open_transfers(),
        0,
        "the stuck READ was released"
    );
    faults.release_held();
}

/// `wait_finished` returns with the first load that ends, well before its bound; at once
/// with nothing outstanding; and empty-handed after its bound when nothing ends.
#[test]
fn an_idle_wait_ends_with_the_first_finished_load() {
    use std::time::{Duration, Instant};
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("idle-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("idle-D", &model, 1, false, c, &lb, &no_tune);
    let t = Instant::now();
    assert!(
        dec.workers[0]
            .wait_finished(Duration::from_secs(60))
            .is_empty()
    );
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "waited with nothing outstanding"
    );

    // Queued behind its handshake, the load is outstanding too.
    let params = pre.finish_prefill("q", &[3]);
    dec.start_load("q", &params, &[4], 4);
    let f = dec.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.recving, vec!["q".to_string()], "{f:?}");
    let f = pre.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.sending, vec!["q".to_string()], "{f:?}");

    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    // Outstanding and held: the wait runs out empty-handed.
    assert!(
        dec.workers[0]
            .wait_finished(Duration::from_millis(20))
            .is_empty()
    );
    let start = Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        assert!(dec.poll()[0].is_empty());
        assert!(start.elapsed().as_secs() < 60, "the READ was never posted");
        std::thread::yield_now();
    }
    // A load that ends while another is in flight is returned at once.
    faults.hold_completions(false);
    let params = pre.finish_prefill("a", &[5]);
    dec.start_load("a", &params, &[6], 4);
    let f = dec.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.recving, vec!["a".to_string()], "{f:?}");
    let f = pre.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.sending, vec!["a".to_string()], "{f:?}");
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        faults.release_held();
    });
    let t = Instant::now();
    let f = dec.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.recving, vec!["r".to_string()], "{f:?}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the wait ignored the completion"
    );
    release.join().expect("release");
    dec.caches[0]
        .verify(&[(3, 4), (1, 2), (5, 6)])
        .expect("bytes");

    // The prefill's hold is outstanding until the decode's note arrives: the wait ends
    // with it.
    let f = pre.workers[0].wait_finished(Duration::from_secs(60));
    assert_eq!(f.sending, vec!["r".to_string()], "{f:?}");

    // A hold no reader has noted yet is outstanding too: the wait runs to its bound.
    let _ = pre.finish_prefill("unread", &[7]);
    let t = Instant::now();
    assert!(
        pre.workers[0]
            .wait_finished(Duration::from_millis(200))
            .is_empty()
    );
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "a prefill holding a request did not wait for its notes"
    );
}

/// A worker registers its regions as spans: regions adjacent in memory (in any order) as
/// one registration, so coalesced descriptors across them stay inside it; a gap splits them.
#[test]
fn adjacent_regions_register_as_one_span_and_a_gap_splits_them() {
    use kvxfer_core::connector::KvCache;
    use kvxfer_core::pull::PullWorker;
    let model = Model::small(BlockOrder::Hnd, 4);
    let spec = model.spec(4);
    let len = spec.region_len();
    let memory = vec![0u8; 5 * len as usize];
    let b = memory.as_ptr() as u64;
    for (bases, spans) in [
        (vec![b, b + len, b + 2 * len, b + 3 * len], 1),
        (vec![b + len, b, b + 3 * len, b + 2 * len], 1),
        (vec![b, b + len, b + 3 * len, b + 4 * len], 2),
        (vec![b, b + 2 * len, b + 4 * len, b + len], 2),
    ] {
        let mut config = PullConfig::new("spans", 0, 1);
        config.side_channel_port = 0;
        let kv = KvCache {
            spec,
            bases: bases.clone(),
            memory: kvxfer_core::MemoryKind::Host,
            total_kv_heads: model.heads,
            total_layers: model.layers,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        };
        let w = PullWorker::new(lb("spans-D"), config, kv, clock()).expect("worker");
        let (.., regions) = w.transport().resource_counts();
        // Besides the cache: the stamp table and the stamp READs' scratch.
        assert_eq!(
            regions,
            spans + 2,
            "bases at {:?}",
            bases.iter().map(|x| x - b).collect::<Vec<_>>()
        );
    }
    drop(memory);
}

/// Dropping a worker ends its handshake threads before the drop returns: none outlives the
/// worker, not even one waiting on a prefill that accepted the connection and never answers.
#[test]
#[cfg(target_os = "linux")]
fn dropping_a_worker_ends_its_handshake_threads() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let model = Model::small(BlockOrder::Hnd, 4);
    let tune = |c: &mut PullConfig| c.handshake_timeout = std::time::Duration::from_secs(3);
    let mut dec = engine("joins-D", &model, 1, false, clock(), &lb, &tune);
    let params = pull_block_1("silentpf", silent.local_addr().expect("addr").port());
    dec.start_load("r", &params, &[5], 4);
    let thread = "kvx-hs-silentpf";
    let start = std::time::Instant::now();
    while !kvxfer_tests::threads::alive(thread) {
        assert!(dec.poll()[0].failed.is_empty());
        assert!(start.elapsed().as_secs() < 60, "no handshake thread");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(dec);
    // Not joined, the thread would wait out the 3 s handshake timeout.
    let wait = std::time::Duration::from_millis(500);
    assert!(
        kvxfer_tests::threads::gone_within(thread, wait),
        "outlived its worker"
    );
}

/// Discovery reports an engine lost while a load waits for its handshake (the prefill
/// accepted the connection and never answers): the load fails at once with its blocks, not at
/// the handshake timeout; a load of another engine is untouched.
#[test]
fn a_load_waiting_for_a_lost_engines_handshake_fails_at_once() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = silent.local_addr().expect("addr").port();
    let model = Model::small(BlockOrder::Hnd, 4);
    // The first poll after the loss reports it, long before this timeout (which bounds the
    // handshake threads the worker's drop joins).
    let tune = |c: &mut PullConfig| c.handshake_timeout = std::time::Duration::from_secs(3);
    let mut dec = engine("lostq-D", &model, 1, false, clock(), &lb, &tune);
    dec.start_load("r", &pull_block_1("silentq", port), &[5], 4);
    dec.start_load("s", &pull_block_1("silentq", port), &[6], 4);
    dec.start_load("other", &pull_block_1("silentother", port), &[7], 4);
    assert!(dec.poll()[0].failed.is_empty());
    dec.workers[0].engine_lost("silentq", "rank 0.0.0 deregistered");
    let f = dec.poll();
    assert_eq!(
        failed_loads(&f[0]),
        [("r".to_string(), vec![5]), ("s".to_string(), vec![6])]
    );
    assert!(
        f[0].failed[0]
            .reason
            .contains("prefill engine silentq lost: rank 0.0.0 deregistered")
    );
    assert!(
        dec.poll()[0].failed.is_empty(),
        "the other engine's load still waits"
    );
}

/// An engine id with a NUL in it (it comes from the request's parameters) fails its load
/// like any unreachable prefill; it does not panic the handshake thread's spawn.
#[test]
fn an_engine_id_with_a_nul_fails_the_load_without_a_panic() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let model = Model::small(BlockOrder::Hnd, 4);
    let tune = |c: &mut PullConfig| c.handshake_timeout = std::time::Duration::from_millis(200);
    let mut dec = engine("nulid-D", &model, 1, false, clock(), &lb, &tune);
    let params = pull_block_1("bad\0id", port);
    dec.start_load("r", &params, &[5], 4);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![5]);
}

/// Parameters that pull block 1 from engine `engine_id` at 127.0.0.1:`port`.
fn pull_block_1(engine_id: &str, port: u16) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![vec![1]]),
        remote_engine_id: Some(engine_id.into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        ..Default::default()
    }
}

/// A load the engine asked for whose params kvxfer cannot read fails in the next step with
/// its blocks (the engine's failure policy decides), touching nothing and connecting to no
/// one; the scheduler records it once.
#[test]
fn a_refused_load_fails_at_once_with_its_blocks() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut dec = engine("refused-D", &model, 1, false, clock(), &lb, &no_tune);
    dec.scheduler
        .refuse_load("r", &[vec![5, 6]], "remote_block_ids: not a list");
    dec.scheduler.refuse_load("r", &[vec![7]], "again");
    let meta = dec.scheduler.build_step_meta();
    assert_eq!(meta.recv.len(), 1, "{meta:?}");
    assert!(dec.workers[0].start_load_kv(&meta).is_empty());
    let f = dec.poll();
    assert_eq!(f[0].recving, vec!["r".to_string()]);
    let failed = &f[0].failed[0];
    assert_eq!(failed.invalid_blocks, vec![5, 6]);
    assert!(
        failed
            .reason
            .contains("unusable kv_transfer_params: remote_block_ids: not a list"),
        "{}",
        failed.reason
    );
    assert_eq!(dec.workers[0].take_metrics().failed_setups, 1);
    dec.caches[0].verify(&[]).expect("nothing written");
}

/// Handshakes that fail one after another (a prefill that is unreachable, again and again):
/// each thread is joined once it ended, so a decode that reconnects for days keeps a bounded
/// number of them, not one per handshake (each held its stack and guard page until shutdown).
#[test]
fn handshake_threads_are_joined_as_they_end() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut dec = engine(
        "hsthreads-D",
        &model,
        1,
        false,
        clock(),
        &lb,
        &|c: &mut PullConfig| c.handshake_timeout = std::time::Duration::from_millis(20),
    );
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![vec![1]]),
        remote_engine_id: Some("unreachable".into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        ..Default::default()
    };
    // Two handshakes in flight (two engines): both threads are counted while they run.
    let mut two = engine(
        "hsthreads-D2",
        &model,
        1,
        false,
        clock(),
        &lb,
        &|c: &mut PullConfig| c.handshake_timeout = std::time::Duration::from_secs(5),
    );
    for (i, id) in ["u1", "u2"].into_iter().enumerate() {
        let p = KvTransferParams {
            remote_engine_id: Some(id.into()),
            ..params.clone()
        };
        two.start_load(&format!("t{i}"), &p, &[5], 4);
    }
    assert_eq!(two.workers[0].handshake_threads(), 2);
    const HANDSHAKES: usize = 300;
    let mut most = 0;
    for i in 0..HANDSHAKES {
        dec.start_load(&format!("r{i}"), &params, &[5], 4);
        poll_until(&mut [&mut dec], |_, f| !f[0].failed.is_empty());
        most = most.max(dec.workers[0].handshake_threads());
    }
    assert!(
        most <= 2,
        "{most} handshake threads kept after {HANDSHAKES}"
    );
    assert_eq!(
        dec.workers[0].take_metrics().failed_handshakes,
        HANDSHAKES as u64
    );
}

/// A decode that read from 100 prefills in turn, each gone once read (as when a prefill
/// restarts: vLLM names each start a fresh engine id, which no request names again), keeps
/// no connection to the dead ones: each is closed at the next heartbeat tick after its rank
/// failed, so peers and prepared lists stay flat. A prefill that lives but that no request
/// names is closed once idle past `idle_engine_timeout`, and the next load from it
/// handshakes again.
#[test]
fn connections_no_request_needs_are_closed() {
    use std::time::Duration;
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let tune = |cfg: &mut PullConfig| {
        cfg.heartbeat_interval = Duration::from_secs(5);
        cfg.idle_engine_timeout = Duration::from_secs(60);
    };
    let mut dec = engine("close-D", &model, 1, false, Arc::clone(&c), &lb, &tune);
    let read = |dec: &mut kvxfer_tests::pull_env::Engine<LoopbackTransport>,
                pre: &mut kvxfer_tests::pull_env::Engine<LoopbackTransport>,
                id: &str| {
        let params = pre.finish_prefill(id, &[1]);
        dec.start_load(id, &params, &[2], 4);
        poll_until(&mut [&mut *dec], |_, f| {
            assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
            !f[0].recving.is_empty()
        });
        dec.caches[0].verify(&[(1, 2)]).expect("bytes");
    };
    for i in 0..100 {
        let mut pre = engine(
            &format!("close-P{i}"),
            &model,
            1,
            true,
            Arc::clone(&c),
            &lb,
            &tune,
        );
        read(&mut dec, &mut pre, &format!("r{i}"));
        assert_eq!(
            dec.workers[0].transport().resource_counts().0,
            1,
            "one peer while it lives"
        );
        drop(pre);
        manual.advance(Duration::from_secs(5));
        dec.poll();
        let (peers, lists, _, _) = dec.workers[0].transport().resource_counts();
        assert_eq!(
            (peers, lists),
            (0, 0),
            "a dead prefill's connection is closed ({i})"
        );
    }
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.closed_connections, m.handshakes), (100, 100));

    // Alive and idle: kept for a while, closed past the timeout, then connected again.
    let mut pre = engine("close-live", &model, 1, true, Arc::clone(&c), &lb, &tune);
    read(&mut dec, &mut pre, "a");
    for _ in 0..11 {
        manual.advance(Duration::from_secs(5));
        dec.poll();
    }
    assert_eq!(
        dec.workers[0].transport().resource_counts().0,
        1,
        "55 s idle: kept"
    );
    manual.advance(Duration::from_secs(5));
    dec.poll();
    assert_eq!(
        dec.workers[0].transport().resource_counts().0,
        0,
        "60 s idle: closed"
    );
    read(&mut dec, &mut pre, "b");
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.closed_connections, m.handshakes), (1, 2));
    // A closed connection is forgotten whole: the engine restarted after it was closed
    // is a first connection, not a restart (nothing of it is kept to compare).
    for _ in 0..12 {
        manual.advance(Duration::from_secs(5));
        dec.poll();
    }
    drop(pre);
    let mut pre = engine("close-live", &model, 1, true, Arc::clone(&c), &lb, &tune);
    read(&mut dec, &mut pre, "c");
    let m = dec.workers[0].take_metrics();
    assert_eq!(
        (m.closed_connections, m.handshakes, m.peer_restarts),
        (1, 1, 0)
    );
}
