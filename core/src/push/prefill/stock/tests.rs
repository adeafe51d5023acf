use super::*;
use crate::connector::KvCache;
use crate::push::buffers::StateKind;
use crate::push::prefill::decodes::check_registration;
use kvxfer_layout::{BlockOrder, CacheParams, CacheSpec, Dtype};

/// A rank of a TP 2 prefill: 2 of the model's 4 KV heads (8 bytes per head and token), 2
/// layers, pages of 16 tokens, one aux buffer of 32-byte rows.
fn prefill_bufs(kind: CacheKind) -> PushBuffers {
    let spec = CacheSpec::new(CacheParams {
        kind,
        order: BlockOrder::Nhd,
        dtype: Dtype::U8,
        num_layers: 2,
        kv_heads: if kind == CacheKind::Mla { 1 } else { 2 },
        head_dim: 8,
        tokens_per_block: 16,
        num_blocks: 4,
    })
    .expect("spec");
    PushBuffers {
        kv: KvCache {
            spec,
            bases: (1..=u64::from(spec.num_regions()))
                .map(|r| r << 32)
                .collect(),
            memory: MemoryKind::Host,
            total_kv_heads: if kind == CacheKind::Mla { 1 } else { 4 },
            total_layers: 2,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        },
        aux: vec![BufferWire {
            base: 0x1000,
            item_len: 32,
            items: 8,
        }],
        state: Vec::new(),
        state_kind: StateKind::None,
    }
}

/// A TP 1 stock decode of the same model: all 4 heads, 100 pages per buffer.
fn registration() -> sgl::Registration {
    sgl::Registration {
        endpoint: ("10.0.0.9".into(), 5555),
        agent: "stock".into(),
        metadata: vec![1; 8],
        kv_ptrs: vec![0xa0000, 0xb0000, 0xc0000, 0xd0000],
        aux_ptrs: vec![0x7000],
        state_ptrs: Vec::new(),
        gpu_id: 0,
        tp: (1, 0),
        kv_item_lens: vec![4 * 8 * 16; 4],
        state_item_lens: Vec::new(),
        state_dims: Vec::new(),
        staging: None,
        num_slots: 100,
        kv_mem_kinds: vec!["VRAM".into(); 4],
        state_layer_ids: Vec::new(),
        kv_layer_ids: Vec::new(),
        dcp: (1, 0),
        state_data_lens: Vec::new(),
    }
}

#[test]
fn a_stock_registration_reads_as_the_kvxfer_decode_with_those_buffers() {
    let bufs = prefill_bufs(CacheKind::SplitKv);
    let t = translate(&bufs, &registration()).expect("translated");
    // K0, V0, K1, V1 from SGLang's K0, K1, V0, V1.
    assert_eq!(t.args.kv_bases, [0xa0000, 0xc0000, 0xb0000, 0xd0000]);
    assert_eq!(t.args.layout.kv_heads, 4);
    assert_eq!(t.args.layout.num_blocks, 100);
    assert_eq!((t.args.tp_size, t.args.tp_rank), (1, 0));
    assert_eq!(t.args.aux[0].item_len, 32);
    // What a kvxfer decode registering this would pass.
    let (spec, mapping) = check_registration(&bufs, 2, &t.args).expect("pairs");
    assert_eq!(spec.kv_heads(), 4);
    assert_eq!(mapping.notifications_per_request(0), Ok(1));
    let region = 4 * 8 * 16 * 100;
    assert!(
        t.regions
            .contains(&(MemoryKind::Host, AddrRange::new(0xc0000, region)))
    );
    assert_eq!(t.regions.len(), 5);
    // One state type: its buffers' items from their lengths.
    let with_state = sgl::Registration {
        state_ptrs: vec![vec![0x5000]],
        state_item_lens: vec![vec![64]],
        state_data_lens: vec![vec![640]],
        ..registration()
    };
    let t = translate(&bufs, &with_state).expect("state");
    assert_eq!(
        t.args.state,
        [BufferWire {
            base: 0x5000,
            item_len: 64,
            items: 10
        }]
    );
    assert!(
        t.regions
            .contains(&(MemoryKind::Host, AddrRange::new(0x5000, 640)))
    );
    // An MLA prefill takes one latent buffer per layer, the same page size.
    let mla = prefill_bufs(CacheKind::Mla);
    let r = sgl::Registration {
        kv_ptrs: vec![0xa0000, 0xb0000],
        kv_item_lens: vec![8 * 16; 2],
        kv_mem_kinds: vec!["VRAM".into(); 2],
        ..registration()
    };
    let t = translate(&mla, &r).expect("MLA");
    assert_eq!(t.args.kv_bases, [0xa0000, 0xb0000]);
    assert_eq!(t.args.layout.kv_heads, 1);
    // A latent is one "head": a page of another size is another latent.
    let other = sgl::Registration {
        kv_item_lens: vec![2 * 8 * 16; 2],
        ..r
    };
    let e = translate(&mla, &other).err().expect("refused");
    assert!(e.contains("256 bytes per KV page"), "{e}");
}

#[test]
fn what_kvxfer_does_not_write_is_refused_naming_it() {
    let bufs = prefill_bufs(CacheKind::SplitKv);
    let refused = |r: sgl::Registration, says: &str| match translate(&bufs, &r) {
        Err(e) => assert!(e.contains(says), "{e:?} should say {says:?}"),
        Ok(_) => panic!("accepted, should say {says:?}"),
    };
    refused(
        sgl::Registration {
            staging: Some((0x1, 64)),
            ..registration()
        },
        "stages KV through a buffer of 64 bytes",
    );
    refused(
        sgl::Registration {
            dcp: (2, 0),
            ..registration()
        },
        "decode context parallelism 2",
    );
    refused(
        sgl::Registration {
            kv_layer_ids: vec![0, 1, 0, 1],
            ..registration()
        },
        "layer id",
    );
    refused(
        sgl::Registration {
            kv_mem_kinds: vec!["VRAM".into(), "DRAM".into(), "VRAM".into(), "VRAM".into()],
            ..registration()
        },
        "mixed memory kinds",
    );
    refused(
        sgl::Registration {
            kv_ptrs: vec![1, 2],
            kv_item_lens: vec![512; 2],
            ..registration()
        },
        "2 KV buffers; this prefill has 2 layers of K and V buffers",
    );
    refused(
        sgl::Registration {
            kv_item_lens: vec![512, 512, 512, 256],
            ..registration()
        },
        "different page sizes",
    );
    refused(
        sgl::Registration {
            kv_item_lens: vec![4 * 8 * 16 + 8; 4],
            ..registration()
        },
        "520 bytes per KV page",
    );
    refused(
        sgl::Registration {
            aux_ptrs: Vec::new(),
            ..registration()
        },
        "0 aux buffers, this prefill 1",
    );
    refused(
        sgl::Registration {
            state_ptrs: vec![vec![1], vec![2]],
            ..registration()
        },
        "2 state types",
    );
    refused(
        sgl::Registration {
            state_ptrs: vec![vec![1]],
            ..registration()
        },
        "1 state buffers with 0 lengths",
    );
    refused(
        sgl::Registration {
            state_ptrs: vec![vec![1]],
            state_data_lens: vec![vec![640]],
            ..registration()
        },
        "1 state buffers with 1 lengths and 0 item lengths",
    );
    refused(
        sgl::Registration {
            state_ptrs: vec![vec![1]],
            state_item_lens: vec![vec![64]],
            ..registration()
        },
        "1 state buffers with 0 lengths and 1 item lengths",
    );
    refused(
        sgl::Registration {
            num_slots: 1 << 32,
            ..registration()
        },
        "4294967296 pages per KV buffer",
    );
}

#[test]
fn a_stock_room_reads_as_a_kvxfer_room_or_is_refused() {
    let m = sgl::Room {
        room: 3,
        endpoint: ("10.0.0.9".into(), 5555),
        agent: "stock".into(),
        pages: vec![4, 5],
        aux_index: Some(1),
        required: 1,
        state: vec![Vec::new(), vec![6]],
        prefix_tokens: 16,
        dummy: false,
    };
    let r = room_request(&m).expect("room");
    assert_eq!(
        (
            r.room,
            r.pages.as_slice(),
            r.aux_index,
            r.state_indices.as_slice()
        ),
        (3, &[4, 5][..], Some(1), &[6][..])
    );
    assert_eq!((r.prefix_tokens, r.digest), (16, false));
    let dummy = sgl::Room {
        pages: Vec::new(),
        dummy: true,
        ..m.clone()
    };
    assert!(room_request(&dummy).expect("dummy").pages.is_empty());
    let refused = |m: sgl::Room, says: &str| {
        let e = room_request(&m).unwrap_err();
        assert!(e.contains(says), "{e:?} should say {says:?}");
    };
    refused(
        sgl::Room {
            dummy: true,
            ..m.clone()
        },
        "a dummy destination naming 2 pages",
    );
    refused(
        sgl::Room {
            pages: Vec::new(),
            ..m.clone()
        },
        "no pages to write",
    );
    refused(
        sgl::Room {
            state: vec![vec![1], vec![2]],
            ..m.clone()
        },
        "more than one state type",
    );
    refused(
        sgl::Room {
            state: vec![vec![-1]],
            ..m
        },
        "state index -1",
    );
}
