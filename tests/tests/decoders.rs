//! Every decoder of bytes that crosses a process boundary, fed arbitrary bytes and mutated
//! valid messages: no panic, a typed refusal or a value, and re-encoding what was accepted
//! decodes to the same value. (Size limits and allocation bounds: `decoder_allocation.rs`.)
//!
//! Decoders: pull handshake metadata (msgpack map), `KvTransferParams` (JSON), pull
//! notifications, push control messages (to prefill, to/from registry, from prefill), push
//! notifications, UCX agent metadata and UCX notifications, vLLM 0.32's handshake (request,
//! payload, agent metadata, clock frame).

use kvxfer_core::pull::notify;
use kvxfer_core::push::messages::{
    self, FromPrefill, FromRegistry, RoomRequest, ToPrefill, ToRegistry, parse_note,
};
use kvxfer_core::wire::handshake::HandshakeMeta;
use kvxfer_core::wire::params::KvTransferParams;
use kvxfer_core::wire::vllm;
use kvxfer_transport_ucx::metadata::{AgentMeta, RegionMeta};
use kvxfer_transport_ucx::notification::{decode_notification, encode_notification};
use proptest::prelude::*;

fn handshake() -> HandshakeMeta {
    HandshakeMeta {
        engine_id: "prefill-0".into(),
        agent_metadata: vec![7; 40],
        kv_caches_base_addr: vec![0x1000, 0x2000, 0x3000],
        num_blocks: 16,
        tp_size: 2,
        block_len: 4096,
        attn_backend_name: "FLASH_ATTN".into(),
        kvxfer_protocol: Some(1),
        kvxfer_tp_rank: Some(1),
        kvxfer_layout: None,
        kvxfer_lease_ms: Some(30_000),
        kvxfer_instance: Some(1),
        kvxfer_stamps: None,
        kvxfer_digests: None,
    }
}

fn ucx_meta() -> AgentMeta {
    AgentMeta {
        name: "decode-3".into(),
        worker_address: vec![1; 90],
        regions: vec![RegionMeta {
            kind: kvxfer_core::MemoryKind::Host,
            range: kvxfer_core::AddrRange::new(0x7f00_0000_0000, 1 << 20),
            rkey: vec![2; 30],
            shared: Some(kvxfer_host_mem::shm::Export {
                pid: 4242,
                fd: 9,
                token: [6; 16],
                file_len: 2 << 20,
                offset: 4096,
            }),
        }],
        host: Some([1; 16]),
    }
}

fn room() -> ToPrefill {
    ToPrefill::Room(RoomRequest {
        room: 42,
        agent: "decode-1".into(),
        pages: vec![3, 9, 27],
        aux_index: Some(1),
        state_indices: vec![4],
        digest: true,
        prefix_tokens: 0,
        group_pages: Vec::new(),
    })
}

/// Runs every decoder on `bytes`; checks accepted values re-encode to themselves.
fn decode_all(bytes: &[u8]) {
    if let Ok(m) = HandshakeMeta::decode(bytes, 1 << 20) {
        assert_eq!(HandshakeMeta::decode(&m.encode(), 1 << 20).unwrap(), m);
    }
    if let Ok(p) = KvTransferParams::from_json(bytes) {
        let again = KvTransferParams::from_json(p.to_json().as_bytes()).unwrap();
        assert_eq!(again, p);
        let _ = p.remote_source();
    }
    let _ = notify::parse(bytes);
    if let Ok(m) = messages::decode::<ToPrefill>(bytes, "t") {
        assert_eq!(
            messages::decode::<ToPrefill>(&messages::encode(&m), "t").unwrap(),
            m
        );
    }
    let _ = messages::decode::<ToRegistry>(bytes, "t");
    let _ = messages::decode::<FromRegistry>(bytes, "t");
    let _ = messages::decode::<FromPrefill>(bytes, "t");
    let _ = parse_note(bytes);
    if let Ok(m) = AgentMeta::decode(bytes) {
        assert_eq!(AgentMeta::decode(&m.encode()).unwrap(), m);
    }
    if let Ok(p) = vllm::HandshakePayload::decode(bytes, 1 << 20) {
        assert_eq!(
            vllm::HandshakePayload::decode(&p.encode(), 1 << 20).unwrap(),
            p
        );
        vllm_agent(&p.agent_metadata_bytes);
    }
    vllm_agent(bytes);
    if let Some(r) = vllm::MetaRequest::parse(bytes) {
        assert_eq!(vllm::MetaRequest::parse(&r.encode()), Some(r));
    }
    if let Ok(t) = vllm::decode_clock(bytes) {
        assert!(t.is_finite());
    }
    if let Some(n) = decode_notification(bytes, 64 << 10) {
        let again = decode_notification(&encode_notification(&n.from, &n.message), 64 << 10);
        assert_eq!(again, Some(n));
    }
}

/// vLLM 0.32 agent metadata: what decodes re-encodes to itself and has a bounded extent.
fn vllm_agent(bytes: &[u8]) {
    if let Ok(m) = vllm::AgentMetadata::decode(bytes, 1 << 20) {
        assert_eq!(
            vllm::AgentMetadata::decode(&m.encode(), 1 << 20).unwrap(),
            m
        );
        for r in 0..m.kv_caches_base_addr.len() {
            let len = m.region_len(r).expect("a validated region has an extent");
            assert!(m.kv_caches_base_addr[r].checked_add(len).is_some());
        }
    }
}

/// The first reply frame of a real vLLM 0.32.0 prefill.
const VLLM_PAYLOAD: &[u8] = include_bytes!("../../core/testdata/vllm-0.32.0-pull-fp32.payload.bin");

fn mutate(mut bytes: Vec<u8>, edits: &[(usize, u8, u8)]) -> Vec<u8> {
    for &(at, op, v) in edits {
        if bytes.is_empty() {
            bytes.push(v);
            continue;
        }
        let i = at % bytes.len();
        match op % 4 {
            0 => bytes[i] = v,
            1 => bytes[i] ^= 1 << (v % 8),
            2 => bytes.truncate(i),
            _ => bytes.insert(i, v),
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn mutated_valid_messages(
        which in 0usize..9,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..8),
    ) {
        let valid = match which {
            0 => handshake().encode(),
            1 => KvTransferParams {
                do_remote_decode: true,
                remote_engine_id: Some("e".into()),
                remote_block_ids: Some(vec![vec![1, 2, 3]]),
                remote_host: Some("10.0.0.1".into()),
                remote_port: Some(5600),
                ..Default::default()
            }.to_json().into_bytes(),
            2 => messages::encode(&room()),
            3 => ucx_meta().encode(),
            4 => encode_notification("prefill-1", b"42_kv_0_1_0"),
            5 => VLLM_PAYLOAD.to_vec(),
            6 => vllm::HandshakePayload::decode(VLLM_PAYLOAD, 1 << 20).unwrap().agent_metadata_bytes,
            7 => vllm::MetaRequest { pp_rank: 0, tp_rank: 3 }.encode(),
            _ => notify::read_done("cmpl-7", 2),
        };
        decode_all(&mutate(valid, &edits));
    }
}

#[test]
fn valid_messages_decode() {
    decode_all(&handshake().encode());
    assert_eq!(
        HandshakeMeta::decode(&handshake().encode(), 1 << 20).unwrap(),
        handshake()
    );
    assert_eq!(
        messages::decode::<ToPrefill>(&messages::encode(&room()), "t").unwrap(),
        room()
    );
    assert_eq!(AgentMeta::decode(&ucx_meta().encode()).unwrap(), ucx_meta());
}
