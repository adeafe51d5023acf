//! vLLM 0.32's handshake from a stock peer: request frame, payload, agent metadata, clock.
#![no_main]
use kvxfer_core::wire::vllm::{AgentMetadata, HandshakePayload, MetaRequest, decode_clock};
use libfuzzer_sys::fuzz_target;

const LIMIT: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if let Some(r) = MetaRequest::parse(data) {
        assert_eq!(MetaRequest::parse(&r.encode()), Some(r));
    }
    let _ = decode_clock(data);
    let inner = match HandshakePayload::decode(data, LIMIT) {
        Ok(p) => {
            assert_eq!(HandshakePayload::decode(&p.encode(), LIMIT).unwrap(), p);
            p.agent_metadata_bytes
        }
        Err(_) => data.to_vec(),
    };
    if let Ok(m) = AgentMetadata::decode(&inner, LIMIT) {
        assert_eq!(AgentMetadata::decode(&m.encode(), LIMIT).unwrap(), m);
        for r in 0..m.kv_caches_base_addr.len() {
            let len = m.region_len(r).expect("validated regions have an extent");
            assert!(m.kv_caches_base_addr[r].checked_add(len).is_some());
        }
    }
});
