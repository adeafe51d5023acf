//! Notifications: pull read-done and heartbeats, push KV/aux/state/abort notes, UCX frames.
#![no_main]
use kvxfer_core::pull::notify;
use kvxfer_core::push::messages::parse_note;
use kvxfer_transport_ucx::notification::{decode_notification, encode_notification};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = notify::parse(data);
    let _ = parse_note(data);
    if let Some(n) = decode_notification(data, 64 << 10) {
        let again = decode_notification(&encode_notification(&n.from, &n.message), 64 << 10);
        assert_eq!(again, Some(n));
    }
});
