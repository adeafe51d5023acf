//! The pull scenarios again, on loopback agents that prefer prepared per-block lists as
//! NIXL does: the connector's indexed posts (per-block lists prepared at the handshake,
//! fragmented requests posted by index) run and are checked without NIXL.

use kvxfer_tests::loopback::LoopbackPreparedLists;

fn run(_case: &str, body: impl FnOnce(&LoopbackPreparedLists)) {
    body(&LoopbackPreparedLists);
}

kvxfer_tests::pull_scenarios!(run);

#[test]
fn fragmented_requests_post_by_index() {
    kvxfer_tests::scenarios::pull::fragmented_requests_post_by_index(&LoopbackPreparedLists);
}
