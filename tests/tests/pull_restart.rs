//! A prefill engine that dies and comes back under the same engine id at the same address,
//! on the loopback: the decode fails what was in flight (with its blocks), drops the old
//! connection, handshakes with the new instance, and its later loads succeed.

use std::sync::Arc;

use kvxfer_core::pull::PullConfig;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::pull_env::{Engine, GUARD, Model, engine, failed_loads, poll_until, prefill_at};
use kvxfer_tests::scenarios::pull::{clock, first_failure, no_tune};
use kvxfer_transport_loopback::LoopbackTransport;

fn lb(name: &str) -> LoopbackTransport {
    LoopbackTransport::new(name).expect("loopback")
}

/// Loads `remote` into `local` and expects success with every byte right.
fn load_ok(
    dec: &mut Engine<LoopbackTransport>,
    pre: &mut Engine<LoopbackTransport>,
    id: &str,
    remote: &[u32],
    local: &[u32],
) {
    let params = pre.finish_prefill(id, remote);
    dec.start_load(id, &params, local, remote.len() * 4);
    poll_until(&mut [&mut *dec, &mut *pre], |i, f| {
        assert!(i == 1 || f[0].failed.is_empty(), "{id} failed: {:?}", f[0]);
        i == 1 || f[0].recving.iter().any(|r| r == id)
    });
    let pairs: Vec<(u32, u32)> = remote.iter().copied().zip(local.iter().copied()).collect();
    dec.caches[0].verify(&pairs).expect("bytes of the load");
}

/// The prefill restarted (same name, same port) while the decode held a connection to the
/// old instance and nothing was in flight: the next load goes to the new instance and
/// succeeds; no request is lost to the restart.
#[test]
fn a_restart_between_loads_costs_no_request() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("rs1-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("rs1-D", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
    load_ok(&mut dec, &mut pre, "before", &[1, 2], &[3, 4]);
    let port = pre.base_port;
    drop(pre);
    let mut pre = prefill_at("rs1-P", &model, 1, port, c, &lb, &no_tune)
        .expect("the old prefill's port is free again");
    dec.caches[0].mem.fill(GUARD);
    load_ok(&mut dec, &mut pre, "after", &[5, 6], &[7, 8]);
    let m = dec.workers[0].take_metrics();
    assert_eq!(
        (
            m.handshakes,
            m.peer_restarts,
            m.lost_connections,
            m.failed_transfers
        ),
        (2, 1, 1, 0),
        "{m:?}"
    );
}

/// The prefill dies while a READ is in flight and comes back at the same address: the load
/// in flight fails with its blocks, and loads after the restart succeed.
#[test]
fn a_restart_mid_load_fails_that_load_and_later_loads_succeed() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("rs2-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("rs2-D", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
    load_ok(&mut dec, &mut pre, "before", &[1], &[2]);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("in-flight", &[3, 4]);
    dec.start_load("in-flight", &params, &[5, 6], 8);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(start.elapsed().as_secs() < 60, "the READ was never posted");
    }
    let port = pre.base_port;
    pre.workers[0].transport().faults().vanish();
    drop(pre);
    faults.release_held();
    faults.hold_completions(false);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].req_id, "in-flight");
    assert_eq!(failed[0].invalid_blocks, vec![5, 6]);
    let mut pre = prefill_at("rs2-P", &model, 1, port, c, &lb, &no_tune)
        .expect("the old prefill's port is free again");
    for i in 0..3 {
        dec.caches[0].mem.fill(GUARD);
        load_ok(
            &mut dec,
            &mut pre,
            &format!("after-{i}"),
            &[i + 1],
            &[i + 8],
        );
    }
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.handshakes, m.peer_restarts), (2, 1), "{m:?}");
}

/// Two loads from one prefill in flight; the transport reports the prefill gone: both fail
/// at once (neither waits for its transfer timeout), each with its own blocks, and the
/// READs are released before the failures are reported.
#[test]
fn a_dead_prefill_fails_every_load_in_flight_at_once() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let tune = |cfg: &mut PullConfig| cfg.transfer_timeout = std::time::Duration::from_secs(3600);
    let mut pre = engine("rs3-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("rs3-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    for (id, remote, local) in [("a", [1u32], [2u32]), ("b", [3], [4])] {
        let params = pre.finish_prefill(id, &remote);
        dec.start_load(id, &params, &local, 4);
    }
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() < 2 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(
            start.elapsed().as_secs() < 60,
            "the READs were never posted"
        );
    }
    // The completions stay held: only the dead peer can end these loads.
    pre.workers[0].transport().faults().vanish();
    let f = dec.poll();
    assert_eq!(
        failed_loads(&f[0]),
        vec![("a".to_string(), vec![2]), ("b".to_string(), vec![4])]
    );
    assert_eq!(dec.workers[0].transport().open_transfers(), 0);
    assert_eq!(dec.workers[0].take_metrics().lost_connections, 1);
    faults.release_held();
}

/// Discovery reports the prefill gone (its keys expired, or a new instance registered)
/// while two loads from it are in flight and the transport has noticed nothing: both fail
/// at once with their blocks, their READs released first; the next load handshakes again
/// and succeeds.
#[test]
fn a_prefill_discovery_reports_lost_fails_its_loads_in_flight_at_once() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let tune = |cfg: &mut PullConfig| cfg.transfer_timeout = std::time::Duration::from_secs(3600);
    let mut pre = engine("rs4-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("rs4-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let mut engine_id = String::new();
    for (id, remote, local) in [("a", [1u32], [2u32]), ("b", [3], [4])] {
        let params = pre.finish_prefill(id, &remote);
        engine_id = params
            .remote_engine_id
            .clone()
            .expect("the prefill names itself");
        dec.start_load(id, &params, &local, 4);
    }
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() < 2 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(
            start.elapsed().as_secs() < 60,
            "the READs were never posted"
        );
    }
    // An engine this decode never connected to: nothing happens.
    dec.workers[0].engine_lost("some-other-engine", "deregistered");
    assert_eq!(dec.workers[0].transport().open_transfers(), 2);
    dec.workers[0].engine_lost(&engine_id, "rank 0.0.0 deregistered");
    let f = dec.poll();
    assert_eq!(
        failed_loads(&f[0]),
        vec![("a".to_string(), vec![2]), ("b".to_string(), vec![4])]
    );
    assert!(
        f[0].failed
            .iter()
            .all(|l| l.reason.contains("rank 0.0.0 deregistered"))
    );
    assert_eq!(dec.workers[0].transport().open_transfers(), 0);
    assert_eq!(dec.workers[0].take_metrics().lost_connections, 1);
    faults.hold_completions(false);
    faults.release_held();
    let params = pre.finish_prefill("c", &[5]);
    dec.start_load("c", &params, &[6], 4);
    poll_until(&mut [&mut dec, &mut pre], |i, f| {
        assert!(i == 1 || f[0].failed.is_empty(), "c failed: {:?}", f[0]);
        i == 1 || f[0].recving.iter().any(|r| r == "c")
    });
    dec.caches[0]
        .verify_except(&[(5, 6)], &[2, 4])
        .expect("bytes of the load");
    assert_eq!(
        dec.workers[0].take_metrics().handshakes,
        1,
        "a new handshake"
    );
}

/// Each worker has its own instance id; ranks of one geometry share a layout digest and
/// another geometry has another.
#[test]
fn workers_name_their_instance_and_layout() {
    let c = clock();
    let small = Model::small(BlockOrder::Hnd, 4);
    let a = engine("id-A", &small, 1, true, Arc::clone(&c), &lb, &no_tune);
    let b = engine("id-B", &small, 1, true, Arc::clone(&c), &lb, &no_tune);
    let nhd = engine(
        "id-C",
        &Model::small(BlockOrder::Nhd, 4),
        1,
        true,
        c,
        &lb,
        &no_tune,
    );
    let (a, b, nhd) = (&a.workers[0], &b.workers[0], &nhd.workers[0]);
    assert_ne!(a.instance(), b.instance());
    assert_eq!(a.layout_digest(), b.layout_digest());
    assert_ne!(a.layout_digest(), nhd.layout_digest());
    assert!(a.layout_digest().starts_with("sha256:") && a.layout_digest().len() == 23);
}
