//! Push control messages: decode → prefill, registry requests and replies, prefill replies.
#![no_main]
use kvxfer_core::push::messages::{self, FromPrefill, FromRegistry, ToPrefill, ToRegistry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = messages::decode::<ToPrefill>(data, "fuzz") {
        assert_eq!(
            messages::decode::<ToPrefill>(&messages::encode(&m), "fuzz").unwrap(),
            m
        );
    }
    let _ = messages::decode::<ToRegistry>(data, "fuzz");
    let _ = messages::decode::<FromRegistry>(data, "fuzz");
    let _ = messages::decode::<FromPrefill>(data, "fuzz");
});
