use super::*;

/// The first reply frame a real vLLM 0.32.0 prefill sent (tiny fp32 model, work dir
/// `/tmp/vllmcpu`; `../shared/realvllm/captured`).
const CAPTURED: &[u8] = include_bytes!("../../../testdata/vllm-0.32.0-pull-fp32.payload.bin");
const LIMIT: usize = 1 << 20;

/// The factors of the captured prefill's engine (other tests' engine too).
pub(crate) fn factors() -> CompatFactors {
    CompatFactors {
        vllm_version: "0.32.0".into(),
        nixl_connector_version: 14,
        model: "/tmp/vllmcpu/tiny-llama-rw".into(),
        dtype: "torch.float32".into(),
        num_kv_heads: 2,
        head_size: 64,
        num_hidden_layers: 2,
        attn_backend_name: "CPU_ATTN".into(),
        cache_dtype: "auto".into(),
        is_hma_enabled: true,
        speculative_config: serde_json::Value::Null,
        transfer_mode: "pull".into(),
    }
}

#[test]
fn the_captured_payload_decodes_and_its_hash_is_ours_for_the_same_factors() {
    let p = HandshakePayload::decode(CAPTURED, LIMIT).unwrap();
    assert_eq!(p.compatibility_hash, factors().hash());
    assert_eq!(
        p.compatibility_hash,
        "856d9614f6344178ac89b3234a29146c0aa2876f1050ec8007dcc3ab1e7c9158"
    );
    let m = AgentMetadata::decode(&p.agent_metadata_bytes, LIMIT).unwrap();
    assert_eq!(m.engine_id, "vllm-prefill-engine");
    assert_eq!(
        m.kv_caches_base_addr,
        vec![140605686542400, 140606223413312]
    );
    assert_eq!((m.num_blocks, m.block_size), (16384, 32));
    assert_eq!(m.block_lens, vec![32768, 32768]);
    assert_eq!(m.kv_cache_layout, "LBHNC");
    assert_eq!(m.attn_backend_name, "CPU_ATTN");
    assert_eq!(m.region_mem_types, Some(vec!["DRAM".to_string(); 2]));
    assert!(m.agent_metadata.starts_with(b"nixlSerDes|Agent$"));
    assert_eq!(m.region_len(1), Some(16384 * 32768));
    // Our encoding is vLLM's, byte for byte: same keys, order and types.
    assert_eq!(m.encode(), p.agent_metadata_bytes);
    assert_eq!(p.encode(), CAPTURED);
}

#[test]
fn a_changed_factor_changes_the_hash_and_common_ones_are_named() {
    let ours = factors();
    let mut push = ours.clone();
    push.transfer_mode = "push".into();
    assert_ne!(push.hash(), ours.hash());
    assert!(
        ours.explain_mismatch(&push.hash())
            .contains("transfer_mode is \"push\"")
    );
    let mut newer = ours.clone();
    newer.nixl_connector_version = 15;
    assert!(
        ours.explain_mismatch(&newer.hash())
            .contains("connector version 15")
    );
    let mut other = ours.clone();
    other.model = "another".into();
    let why = ours.explain_mismatch(&other.hash());
    assert!(
        why.contains("tiny-llama-rw") && why.contains(&other.hash()),
        "{why}"
    );
    // Strings are escaped as Python escapes them: non-ASCII as \u escapes.
    let mut odd = ours;
    odd.model = "mödel\"\u{1F600}\n".into();
    let mut s = String::new();
    python_str(&odd.model, &mut s);
    assert_eq!(s, r#""m\u00f6del\"\ud83d\ude00\n""#);
    let mut f = String::new();
    python_json(
        &serde_json::json!({"b": [1.0, 2.5, -3], "a": {"y": null, "x": true}}),
        &mut f,
    );
    assert_eq!(f, r#"{"a": {"x": true, "y": null}, "b": [1.0, 2.5, -3]}"#);
}

#[test]
fn requests_are_vllms_bytes_and_nothing_else_parses() {
    let r = MetaRequest {
        pp_rank: 0,
        tp_rank: 0,
    };
    let hex: String = r.encode().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, "93c40c6765745f6d6574615f6d73670000");
    let r = MetaRequest {
        pp_rank: 1,
        tp_rank: 3,
    };
    assert_eq!(MetaRequest::parse(&r.encode()), Some(r));
    let kvxfer =
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), 0u32, "agent")).unwrap();
    let str_tag = rmp_serde::to_vec(&("get_meta_msg", 0u32, 0u32)).unwrap();
    let wrong_tag = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"get_meta"), 0u32, 0u32)).unwrap();
    let negative =
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), -1i32, 0u32)).unwrap();
    for bad in [
        &kvxfer[..],
        &str_tag,
        &wrong_tag,
        &negative,
        b"get_meta_msg",
        b"",
        &[0x93; 80],
    ] {
        assert_eq!(MetaRequest::parse(bad), None, "{bad:?}");
    }
}

#[test]
fn clock_frames_round_trip_and_junk_is_refused() {
    assert_eq!(
        decode_clock(&encode_clock(2436.588181285)).unwrap(),
        2436.588181285
    );
    let captured = [0xcb, 0x40, 0xa3, 0x09, 0x2d, 0x26, 0x18, 0xee, 0x63];
    assert!((decode_clock(&captured).unwrap() - 2436.588181285).abs() < 1e-9);
    assert_eq!(decode_clock(&[0x05]).unwrap(), 5.0);
    let nan = encode_clock(f64::NAN);
    for bad in [&b""[..], b"\xc0", b"\xa1x", &nan, &[0xcb; 20], b"\x05\x05"] {
        assert!(decode_clock(bad).is_err(), "{bad:?}");
    }
}

fn sample() -> AgentMetadata {
    let p = HandshakePayload::decode(CAPTURED, LIMIT).unwrap();
    AgentMetadata::decode(&p.agent_metadata_bytes, LIMIT).unwrap()
}

#[test]
fn inconsistent_metadata_is_refused() {
    type Change = Box<dyn Fn(&mut AgentMetadata)>;
    let cases: Vec<(&str, Change)> = vec![
        ("empty engine", Box::new(|m| m.engine_id.clear())),
        ("empty nixl blob", Box::new(|m| m.agent_metadata.clear())),
        ("no regions", Box::new(|m| m.kv_caches_base_addr.clear())),
        (
            "lens short",
            Box::new(|m| {
                m.block_lens.pop();
            }),
        ),
        ("names short", Box::new(|m| m.region_names = Some(vec![]))),
        ("zero blocks", Box::new(|m| m.num_blocks = 0)),
        ("zero block size", Box::new(|m| m.block_size = 0)),
        ("stride below len", Box::new(|m| m.block_strides[0] = 1)),
        ("zero len", Box::new(|m| m.block_lens[1] = 0)),
        (
            "wraps",
            Box::new(|m| m.kv_caches_base_addr[0] = u64::MAX - 10),
        ),
        (
            "huge count",
            Box::new(|m| m.region_num_blocks = Some(vec![u64::MAX, 1])),
        ),
        (
            "zero region blocks",
            Box::new(|m| m.region_num_blocks = Some(vec![0, 1])),
        ),
    ];
    for (what, change) in cases {
        let mut m = sample();
        change(&mut m);
        assert!(
            matches!(
                AgentMetadata::decode(&m.encode(), LIMIT),
                Err(WireError::Invalid { .. })
            ),
            "{what}"
        );
    }
    assert!(matches!(
        AgentMetadata::decode(&sample().encode(), 10),
        Err(WireError::TooLarge { .. })
    ));
    let mut p = HandshakePayload::decode(CAPTURED, LIMIT).unwrap();
    p.compatibility_hash = "zz".repeat(32);
    assert!(HandshakePayload::decode(&p.encode(), LIMIT).is_err());
}

#[test]
fn truncated_and_flipped_bytes_never_panic() {
    let p = HandshakePayload::decode(CAPTURED, LIMIT).unwrap();
    let inner = p.agent_metadata_bytes;
    for n in 0..inner.len() {
        assert!(
            AgentMetadata::decode(&inner[..n], LIMIT).is_err(),
            "truncated at {n}"
        );
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..3000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut b = CAPTURED.to_vec();
        let at = (state as usize) % b.len();
        b[at] ^= (state >> 32) as u8 | 1;
        if let Ok(p) = HandshakePayload::decode(&b, LIMIT) {
            let _ = AgentMetadata::decode(&p.agent_metadata_bytes, LIMIT);
        }
    }
}
