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
    run(
        "failures",
        kvxfer_tests::conformance::failures_surface_as_failed,
    );
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
