//! The side-channel listener's request parse (bytes from any client of the port).
#![no_main]
use kvxfer_core::sidechannel::{MAX_READER_NAME, parse_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(r) = parse_request(data, 3) {
        if let Some(name) = &r.reader {
            assert!(!name.is_empty() && name.len() <= MAX_READER_NAME);
        }
    }
});
