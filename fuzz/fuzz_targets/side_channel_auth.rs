//! Sealed side-channel requests and replies: nothing forged opens.
#![no_main]
use kvxfer_core::sidechannel::auth::{Destination, ReplayGuard, SideKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = SideKey::new(b"fuzzing key, thirty-two bytes!!").unwrap();
    // Random bytes never authenticate, for any destination.
    let me = Destination::mailbox("fuzzed-rank");
    assert!(key.open_request(&me, data, &mut ReplayGuard::default()).is_err());
    assert!(key.open_reply(&[0; 16], data).is_err());
});
