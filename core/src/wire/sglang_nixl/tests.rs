use super::*;

fn registration() -> Registration {
    Registration {
        endpoint: ("127.0.0.1".into(), 40123),
        agent: "5b0c9e1a-decode".into(),
        metadata: vec![7; 300],
        kv_ptrs: vec![0x1000, 0x2000, 0x3000, 0x4000],
        aux_ptrs: vec![0x9000, 0xa000],
        state_ptrs: vec![vec![0xb000, 0xc000]],
        gpu_id: 0,
        tp: (2, 1),
        kv_item_lens: vec![256; 4],
        state_item_lens: vec![vec![64, 64]],
        state_dims: vec![vec![16, 16]],
        staging: None,
        num_slots: 16,
        kv_mem_kinds: vec!["VRAM".into(); 4],
        state_layer_ids: vec![vec![0, 1]],
        kv_layer_ids: Vec::new(),
        dcp: (1, 0),
        state_data_lens: vec![vec![4096, 4096]],
    }
}

fn room() -> Room {
    Room {
        room: 1 << 60,
        endpoint: ("127.0.0.1".into(), 40123),
        agent: "5b0c9e1a-decode".into(),
        pages: vec![3, 4, 9],
        aux_index: Some(5),
        required: 1,
        state: vec![vec![2]],
        prefix_tokens: 32,
        dummy: false,
    }
}

fn frames(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(Vec::as_slice).collect()
}

#[test]
fn a_registration_and_a_room_decode_to_what_was_encoded() {
    let r = registration();
    let f = encode_registration(&r);
    assert_eq!(f.len(), REGISTRATION_FRAMES);
    assert_eq!(decode(&frames(&f)), Ok(FromDecode::Register(Box::new(r))));
    let staged = Registration {
        staging: Some((0xd000, 1 << 20)),
        state_ptrs: Vec::new(),
        state_item_lens: Vec::new(),
        state_dims: Vec::new(),
        state_layer_ids: Vec::new(),
        state_data_lens: Vec::new(),
        ..registration()
    };
    let f = encode_registration(&staged);
    assert_eq!(
        decode(&frames(&f)),
        Ok(FromDecode::Register(Box::new(staged)))
    );
    let m = room();
    let f = encode_room(&m);
    assert_eq!(f.len(), ROOM_FRAMES);
    assert_eq!(decode(&frames(&f)), Ok(FromDecode::Room(m)));
    let dummy = Room {
        pages: Vec::new(),
        aux_index: None,
        state: Vec::new(),
        dummy: true,
        ..room()
    };
    let f = encode_room(&dummy);
    assert_eq!(decode(&frames(&f)), Ok(FromDecode::Room(dummy)));
}

#[test]
fn frames_are_sglangs_bytes() {
    // SGLang's `pack_int_lists([[1, 2]], "I")` and a room's int32 pages, literally.
    let f = encode_registration(&Registration {
        state_item_lens: vec![vec![1, 2]],
        ..registration()
    });
    assert_eq!(f[13], [1, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(f[1], b"None");
    assert_eq!(f[3], b"40123");
    assert_eq!(f[18], b"VRAM,VRAM,VRAM,VRAM");
    let f = encode_room(&room());
    assert_eq!(f[1], b"1152921504606846976");
    assert_eq!(f[5], [3, 0, 0, 0, 4, 0, 0, 0, 9, 0, 0, 0]);
    assert_eq!(f[10], b"0");
    assert_eq!(
        kv_status(7, status::SUCCESS, 1, ""),
        [&b"KV_STATUS"[..], b"7", b"4", b"1", b""]
    );
    assert_eq!(
        kv_status(7, status::FAILED, 0, "no pages"),
        [&b"KV_STATUS"[..], b"7", b"0", b"0", b"no pages"]
    );
    assert_eq!(abort_ack(9, 3, 12), [&b"ABORT_ACK"[..], b"9", b"3", b"12"]);
}

#[test]
fn aborts_decode_with_and_without_a_return_address() {
    let with = [&b"ABORT"[..], b"8", b"10.0.0.2", b"5000", b"3"];
    assert_eq!(
        decode(&with),
        Ok(FromDecode::Abort(Abort {
            room: 8,
            ack: Some((("10.0.0.2".into(), 5000), 3)),
        }))
    );
    // Without a generation the decode waits for no acknowledgement.
    let without = [&b"ABORT"[..], b"8", b"10.0.0.2", b"5000"];
    assert_eq!(
        decode(&without),
        Ok(FromDecode::Abort(Abort { room: 8, ack: None }))
    );
    assert!(decode(&[&b"ABORT"[..]]).is_err());
    assert!(decode(&[&b"ABORT"[..], b"x"]).is_err());
}

#[test]
fn what_sglang_would_choke_on_is_refused_with_the_reason() {
    let refused = |f: Vec<Vec<u8>>, says: &str| {
        let e = decode(&frames(&f)).unwrap_err();
        assert!(e.contains(says), "{e:?} should say {says:?}");
    };
    let reg = encode_registration(&registration());
    refused(
        reg[..13].to_vec(),
        "13 frames: SGLang 0.5.23's nixl backend sends 25",
    );
    let mut f = reg.clone();
    f[19].truncate(8);
    refused(f, "1 KV item lengths for 4 KV buffers");
    let mut f = reg.clone();
    f[12] = b"512".to_vec();
    refused(f, "KV item length 512 but the first buffer's is 256");
    let mut f = reg.clone();
    f[6].push(0);
    refused(f, "KV bases: 33 bytes are not 8-byte integers");
    let mut f = reg.clone();
    f[8].truncate(10);
    refused(f, "state bases: truncated");
    let mut f = reg.clone();
    f[8].push(0);
    refused(f, "state bases: 1 bytes left over");
    let mut f = reg.clone();
    f[3] = b"70000".to_vec();
    refused(f, "port 70000 is out of range");
    let mut f = reg.clone();
    f[10] = b"-1".to_vec();
    refused(f, "TP size \"-1\" is not a decimal number");
    let mut f = reg.clone();
    f[4] = Vec::new();
    refused(f, "agent name of 0 bytes");
    let mut f = reg.clone();
    f[4] = vec![0xff; 4];
    refused(f, "agent name is not ASCII");
    let mut f = reg.clone();
    f[5] = Vec::new();
    refused(f, "empty NIXL metadata");
    let mut f = reg.clone();
    f[16] = Vec::new();
    f[15] = vec![0; 8];
    refused(f, "a staging base without a size");
    let mut f = reg;
    f[18] = b"VRAM".to_vec();
    refused(f, "1 memory kinds for 4 KV buffers");

    let m = encode_room(&room());
    refused(m[..10].to_vec(), "a room of 10 frames");
    let mut f = m.clone();
    f[5] = (-1i32).to_le_bytes().to_vec();
    refused(f, "page -1");
    let mut f = m.clone();
    f[10] = b"2".to_vec();
    refused(f, "dummy flag \"2\"");
    let mut f = m.clone();
    f[1] = b"18446744073709551616".to_vec();
    refused(f, "room 18446744073709551616 is out of range");
    let mut f = m;
    f[7] = Vec::new();
    refused(f, "destination count \"\" is not a decimal number");

    refused(vec![b"WATERMARK".to_vec()], "not an SGLang nixl message");
    refused(Vec::new(), "no frames");
    refused(vec![GUARD.to_vec()], "a guard frame alone");
    refused(vec![Vec::new(); MAX_FRAMES + 1], "33 frames");
}

#[test]
fn a_claimed_list_count_allocates_nothing_the_input_does_not_hold() {
    let mut f = encode_registration(&registration());
    f[8] = u32::MAX.to_le_bytes().to_vec();
    let e = decode(&frames(&f)).unwrap_err();
    assert!(e.contains("lists"), "{e}");
    f[8] = [1u32.to_le_bytes(), u32::MAX.to_le_bytes()].concat();
    let e = decode(&frames(&f)).unwrap_err();
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn what_a_prefill_tells_a_decode_decodes_and_anything_else_is_refused() {
    let f = kv_status(7, status::FAILED, 3, "page 9 out of range");
    assert_eq!(
        decode_from_prefill(&frames(&f)),
        Ok(FromPrefill::Status {
            room: 7,
            status: 0,
            rank: 3,
            reason: "page 9 out of range".into(),
        })
    );
    let f = abort_ack(7, 1, 12);
    assert_eq!(
        decode_from_prefill(&frames(&f)),
        Ok(FromPrefill::AbortAck {
            room: 7,
            rank: 1,
            generation: Some(12),
        })
    );
    assert_eq!(
        decode_from_prefill(&frames(&f[..3])),
        Ok(FromPrefill::AbortAck {
            room: 7,
            rank: 1,
            generation: None,
        })
    );
    let mut bad = kv_status(7, status::SUCCESS, 0, "");
    bad[2] = b"x".to_vec();
    assert!(
        decode_from_prefill(&frames(&bad))
            .unwrap_err()
            .contains("status")
    );
    assert!(decode_from_prefill(&frames(&bad[..2])).is_err());
    assert!(decode_from_prefill(&[b"ABORT".as_slice(), b"7", b"1"]).is_err());
    // SGLang appends nothing past its frames, but a message of up to MAX_FRAMES decodes.
    let mut long = kv_status(7, status::SUCCESS, 0, "");
    long.resize(MAX_FRAMES, Vec::new());
    assert!(decode_from_prefill(&frames(&long)).is_ok());
    long.push(Vec::new());
    assert_eq!(
        decode_from_prefill(&frames(&long)),
        Err(format!("{} frames", MAX_FRAMES + 1))
    );
    assert!(decode_from_prefill(&[]).is_err());
    // A decode's abort, as SGLang's decode sends it.
    assert_eq!(
        abort(7, &("10.0.0.1".into(), 4000), 2),
        [&b"ABORT"[..], b"7", b"10.0.0.1", b"4000", b"2"]
    );
    let a = abort(7, &("10.0.0.1".into(), 4000), 2);
    assert_eq!(
        decode(&frames(&a)),
        Ok(FromDecode::Abort(Abort {
            room: 7,
            ack: Some((("10.0.0.1".into(), 4000), 2)),
        }))
    );
}

#[test]
fn every_bound_holds_exactly_at_its_limit() {
    // Frames: MAX_FRAMES of up to MAX_FRAME_BYTES each.
    let mut abort = abort(8, &("h".into(), 1), 2);
    abort.resize(MAX_FRAMES - 1, Vec::new());
    abort.push(vec![b'x'; MAX_FRAME_BYTES]);
    assert!(decode(&frames(&abort)).is_ok());
    assert!(
        decode_from_prefill(&frames(&abort)).is_err(),
        "not a status"
    );
    abort[MAX_FRAMES - 1].push(b'x');
    assert_eq!(
        decode(&frames(&abort)),
        Err(format!("a frame of {} bytes", MAX_FRAME_BYTES + 1))
    );
    let mut status = kv_status(7, status::FAILED, 0, "");
    status.push(vec![b'x'; MAX_FRAME_BYTES + 1]);
    assert!(
        decode_from_prefill(&frames(&status))
            .unwrap_err()
            .contains("a frame of")
    );
    // A reason of up to MAX_TEXT * 64 bytes.
    let long = "r".repeat(MAX_TEXT * 64);
    assert!(decode_from_prefill(&frames(&kv_status(7, 0, 0, &long))).is_ok());
    let longer = format!("{long}r");
    let e = decode_from_prefill(&frames(&kv_status(7, 0, 0, &longer))).unwrap_err();
    assert_eq!(e, format!("a reason of {} bytes", MAX_TEXT * 64 + 1));
    // Names and hosts of 1 to MAX_TEXT bytes.
    let named = |agent: String, host: String| {
        let r = Room {
            agent,
            endpoint: (host, 1),
            ..room()
        };
        decode(&frames(&encode_room(&r)))
    };
    let max = "a".repeat(MAX_TEXT);
    assert!(named(max.clone(), max.clone()).is_ok());
    assert!(
        named(format!("{max}a"), "h".into())
            .unwrap_err()
            .contains("agent name of 257")
    );
    assert!(
        named("a".into(), format!("{max}a"))
            .unwrap_err()
            .contains("host of 257")
    );
    assert!(
        named("a".into(), String::new())
            .unwrap_err()
            .contains("host of 0")
    );
    // A room of up to MAX_PAGES pages.
    let most = Room {
        pages: vec![1; MAX_PAGES],
        ..room()
    };
    assert!(decode(&frames(&encode_room(&most))).is_ok());
    let mut f = encode_room(&most);
    f[5].extend_from_slice(&1u32.to_le_bytes());
    assert_eq!(
        decode(&frames(&f)),
        Err(format!("pages: {} entries", MAX_PAGES + 1))
    );
    // Up to MAX_ENTRIES state lists.
    let lists = Registration {
        state_item_lens: vec![Vec::new(); MAX_ENTRIES],
        ..registration()
    };
    assert!(decode(&frames(&encode_registration(&lists))).is_ok());
    let mut f = encode_registration(&lists);
    let mut over = ((MAX_ENTRIES + 1) as u32).to_le_bytes().to_vec();
    over.resize(4 * (MAX_ENTRIES + 2), 0);
    f[13] = over;
    assert!(decode(&frames(&f)).unwrap_err().contains("65537 lists"));
}
