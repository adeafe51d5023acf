//! UCX agent metadata (worker address and packed remote keys from a peer).
#![no_main]
use kvxfer_transport_ucx::metadata::AgentMeta;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = AgentMeta::decode(data) {
        assert_eq!(AgentMeta::decode(&m.encode()).unwrap(), m);
    }
});
