//! The NIXL transport's metadata envelope (bytes from any peer): decoding never panics, and
//! what it accepts encodes back to the same bytes.
#![no_main]
use kvxfer_transport_nixl::metadata::{MAX_NAME, MAX_REGIONS, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = decode(data) {
        assert!(!d.name.is_empty() && d.name.len() <= MAX_NAME);
        assert!(d.regions.len() <= MAX_REGIONS && !d.nixl.is_empty());
        assert!(d.regions.iter().all(|(_, r)| r.end().is_some()));
        assert_eq!(encode(&d.name, &d.regions, d.nixl), data);
    }
});
