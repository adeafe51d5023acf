//! `kv_transfer_params` JSON handed between engines.
#![no_main]
use kvxfer_core::wire::params::KvTransferParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = KvTransferParams::from_json(data) {
        let _ = p.remote_source();
        assert_eq!(
            KvTransferParams::from_json(p.to_json().as_bytes()).unwrap(),
            p
        );
    }
});
