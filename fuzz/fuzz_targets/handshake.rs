//! Pull handshake metadata (msgpack map from a peer's side channel).
#![no_main]
use kvxfer_core::wire::handshake::HandshakeMeta;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = HandshakeMeta::decode(data, 1 << 20) {
        assert_eq!(HandshakeMeta::decode(&m.encode(), 1 << 20).unwrap(), m);
    }
});
