//! The conformance suite and the pull and push scenario lists on NIXL (host memory, UCX
//! backend). Without the runtime every case prints why it is skipped. Cases run one at a time (a process-wide lock), as NIXL's own
//! tests do, so the suite needs no `--test-threads=1`.
#![cfg(feature = "nixl")]

use kvxfer_tests::conformance::{TransportFactory, skip};
use kvxfer_transport_nixl::{NixlTransport, runtime_available};

struct Nixl;

impl TransportFactory for Nixl {
    type T = NixlTransport;

    fn label(&self) -> String {
        "nixl/ucx".into()
    }

    fn create(&self, name: &str) -> NixlTransport {
        NixlTransport::new(name).expect("NIXL agent")
    }
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

kvxfer_tests::pull_scenarios!(run);
kvxfer_tests::push_scenarios!(run);

/// Runs `case` when the runtime and its UCX plugin are there, else prints the skip.
fn run(case: &str, f: impl FnOnce(&Nixl)) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let usable = runtime_available().and_then(|()| {
        NixlTransport::new("kvxfer-probe")
            .map(drop)
            .map_err(|e| e.to_string())
    });
    match usable {
        Ok(()) => f(&Nixl),
        Err(reason) => skip("nixl", case, &reason),
    }
}

#[test]
fn conformance_read_random_descriptor_sets() {
    run("read", |f| {
        kvxfer_tests::conformance::random_descriptor_sets(f, kvxfer_core::Op::Read)
    });
}
#[test]
fn conformance_write_random_descriptor_sets() {
    run("write", |f| {
        kvxfer_tests::conformance::random_descriptor_sets(f, kvxfer_core::Op::Write)
    });
}
#[test]
fn conformance_metadata_round_trip() {
    run("metadata", kvxfer_tests::conformance::metadata_round_trip);
}
#[test]
fn conformance_notification_after_data() {
    run(
        "notification",
        kvxfer_tests::conformance::notification_after_data,
    );
}
#[test]
fn conformance_many_in_flight() {
    run("many", kvxfer_tests::conformance::many_in_flight);
}
#[test]
fn conformance_unknown_and_released_transfers() {
    run(
        "unknown",
        kvxfer_tests::conformance::unknown_and_released_transfers,
    );
}
#[test]
fn conformance_out_of_bounds_rejected() {
    run("oob", kvxfer_tests::conformance::out_of_bounds_rejected);
}
#[test]
fn conformance_unknown_or_removed_peer() {
    run("peer", kvxfer_tests::conformance::unknown_or_removed_peer);
}
#[test]
fn conformance_peer_restart_same_name() {
    run("restart", kvxfer_tests::conformance::peer_restart_same_name);
}
#[test]
fn conformance_zero_length_lists() {
    run("zero", kvxfer_tests::conformance::zero_length_lists);
}
#[test]
fn conformance_failures_surface_as_failed() {
    // NIXL injects no faults itself: the decorator over the contract does.
    run("failures", |_| {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            Nixl,
        ))
    });
}
#[test]
fn conformance_registration_lifecycle() {
    run(
        "registration",
        kvxfer_tests::conformance::registration_lifecycle,
    );
}
#[test]
fn conformance_capabilities_declared() {
    run("caps", kvxfer_tests::conformance::capabilities_declared);
}

/// NIXL's own per-transfer measurements reach the pull connector's metrics: one report per
/// completed READ, with the bytes the connector asked for; the push side likewise.
#[test]
fn telemetry_reaches_the_connector_metrics() {
    run("telemetry", |f| {
        use kvxfer_tests::pull_env::{Model, engine};
        use kvxfer_tests::scenarios::pull::{clock, mk, no_tune, poll_until_pair};
        let model = Model::small(kvxfer_layout::BlockOrder::Hnd, 4);
        let c = clock();
        let mut pre = engine("telem-P", &model, 1, true, c.clone(), &mk(f), &no_tune);
        let mut dec = engine("telem-D", &model, 1, false, c, &mk(f), &no_tune);
        let params = pre.finish_prefill("r", &[1, 2, 3]);
        dec.start_load("r", &params, &[4, 5, 6], 12);
        let mut failures = Vec::new();
        poll_until_pair(
            &mut dec,
            &mut pre,
            &mut [false],
            &mut [false],
            &mut failures,
        );
        assert!(failures.is_empty(), "{failures:?}");
        let m = dec.workers[0].take_metrics();
        assert_eq!(m.transfers, 1);
        assert_eq!(m.backend.transfers, 1, "one telemetry report: {m:?}");
        assert_eq!(m.backend.bytes, m.bytes, "{m:?}");
        assert_eq!(m.backend.descriptors, m.descriptors_posted, "{m:?}");
        drop((dec, pre));

        use kvxfer_tests::push_env::{Setup, decode_on, prefill_on, run_room};
        let s = Setup::new(model, 1, 1);
        let mut pre = prefill_on(f, &s, "telem-push", clock(), None, None);
        let mut dec = decode_on(f, &s, "telem-push", clock());
        let st = run_room(
            &mut pre,
            &mut dec,
            1,
            &[1, 2],
            &[3, 4],
            1,
            Some((0, 0)),
            (vec![], vec![]),
        );
        assert_eq!(st, vec![kvxfer_core::push::RoomStatus::Success]);
        let m = pre.ranks[0].take_metrics();
        assert!(m.transfers >= 2, "two chunks: {m:?}");
        assert_eq!(
            m.backend.transfers, m.transfers,
            "a report per WRITE: {m:?}"
        );
        assert!(m.backend.bytes >= m.kv_bytes, "KV plus aux: {m:?}");
    });
}

/// On NIXL, fragmented requests go by index into per-block lists prepared at the handshake
/// (every TP slice pattern included), mostly contiguous ones as coalesced raw plans; the
/// bytes are right either way.
#[test]
fn fragmented_requests_post_by_index() {
    run(
        "indexed",
        kvxfer_tests::scenarios::pull::fragmented_requests_post_by_index,
    );
}
