//! The conformance suite and the pull and push scenario lists on NIXL (host memory, UCX
//! backend). Without the runtime every case prints why it is skipped. Cases run one at a time (a process-wide lock), as NIXL's own
//! tests do, so the suite needs no `--test-threads=1`.
#![cfg(feature = "nixl")]

use kvxfer_tests::conformance::{TransportFactory, skip};
use kvxfer_transport_nixl::{NixlTransport, runtime_available};

struct Nixl;

impl TransportFactory for Nixl {
    type T = NixlTransport;

    fn label(&self) -> String {
        "nixl/ucx".into()
    }

    fn create(&self, name: &str) -> NixlTransport {
        NixlTransport::new(name).expect("NIXL agent")
    }
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

kvxfer_tests::pull_scenarios!(run);
kvxfer_tests::push_scenarios!(run);

/// Runs `case` when the runtime and its UCX plugin are there, else prints the skip.
fn run(case: &str, f: impl FnOnce(&Nixl)) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let usable = runtime_available().and_then(|()| {
        NixlTransport::new("kvxfer-probe")
            .map(drop)
            .map_err(|e| e.to_string())
    });
    match usable {
        Ok(()) => f(&Nixl),
        Err(reason) => skip("nixl", case, &reason),
    }
}

#[test]
fn conformance_read_random_descriptor_sets() {
    run("read", |f| {
        kvxfer_tests::conformance::random_descriptor_sets(f, kvxfer_core::Op::Read)
    });
}
#[test]
fn conformance_write_random_descriptor_sets() {
    run("write", |f| {
        kvxfer_tests::conformance::random_descriptor_sets(f, kvxfer_core::Op::Write)
    });
}
#[test]
fn conformance_metadata_round_trip() {
    run("metadata", kvxfer_tests::conformance::metadata_round_trip);
}
#[test]
fn conformance_notification_after_data() {
    run(
        "notification",
        kvxfer_tests::conformance::notification_after_data,
    );
}
#[test]
fn conformance_many_in_flight() {
    run("many", kvxfer_tests::conformance::many_in_flight);
}
#[test]
fn conformance_unknown_and_released_transfers() {
    run(
        "unknown",
        kvxfer_tests::conformance::unknown_and_released_transfers,
    );
}
#[test]
fn conformance_out_of_bounds_rejected() {
    run("oob", kvxfer_tests::conformance::out_of_bounds_rejected);
}
#[test]
fn conformance_unknown_or_removed_peer() {
    run("peer", kvxfer_tests::conformance::unknown_or_removed_peer);
}
#[test]
fn conformance_peer_restart_same_name() {
    run("restart", kvxfer_tests::conformance::peer_restart_same_name);
}
#[test]
fn conformance_zero_length_lists() {
    run("zero", kvxfer_tests::conformance::zero_length_lists);
}
#[test]
fn conformance_failures_surface_as_failed() {
    // NIXL injects no faults itself: the decorator over the contract does.
    run("failures", |_| {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            Nixl,
        ))
    });
}
#[test]
fn conformance_registration_lifecycle() {
    run(
        "registration",
        kvxfer_tests::conformance::registration_lifecycle,
    );
}
#[test]
fn conformance_capabilities_declared() {
    run("caps", kvxfer_tests::conformance::capabilities_declared);
}

/// NIXL's own per-transfer measurements reach the pull connector's metrics: one report per
/// completed READ, with the bytes the connector asked for; the push side likewise.
#[test]
fn telemetry_reaches_the_connector_metrics() {
    run("telemetry", |f| {
        use kvxfer_tests::pull_env::{Model, engine};
        use kvxfer_tests::scenarios::pull::{clock, mk, no_tune, poll_until_pair};
        let model = Model::small(kvxfer_layout::BlockOrder::Hnd, 4);
        let c = clock();
        let mut pre = engine("telem-P", &model, 1, true, c.clone(), &mk(f), &no_tune);
        let mut dec = engine("telem-D", &model, 1, false, c, &mk(f), &no_tune);
        let params = pre.finish_prefill("r", &[1, 2, 3]);
        dec.start_load("r", &params, &[4, 5, 6], 12);
        let mut failures = Vec::new();
        poll_until_pair(
            &mut dec,
            &mut pre,
            &mut [false],
            &mut [false],
            &mut failures,
        );
        assert!(failures.is_empty(), "{failures:?}");
        let m = dec.workers[0].take_metrics();
        assert_eq!(m.transfers, 1);
        assert_eq!(m.backend.transfers, 1, "one telemetry report: {m:?}");
        assert_eq!(m.backend.bytes, m.bytes, "{m:?}");
        assert_eq!(m.backend.descriptors, m.descriptors_posted, "{m:?}");
        drop((dec, pre));

        use kvxfer_tests::push_env::{Setup, decode_on, prefill_on, run_room};
        let s = Setup::new(model, 1, 1);
        let mut pre = prefill_on(f, &s, "telem-push", clock(), None, None);
        let mut dec = decode_on(f, &s, "telem-push", clock());
        let st = run_room(
            &mut pre,
            &mut dec,
            1,
            &[1, 2],
            &[3, 4],
            1,
            Some((0, 0)),
            (vec![], vec![]),
        );
        assert_eq!(st, vec![kvxfer_core::push::RoomStatus::Success]);
        let m = pre.ranks[0].take_metrics();
        assert!(m.transfers >= 2, "two chunks: {m:?}");
        assert_eq!(
            m.backend.transfers, m.transfers,
            "a report per WRITE: {m:?}"
        );
        assert!(m.backend.bytes >= m.kv_bytes, "KV plus aux: {m:?}");
    });
}

/// On NIXL, fragmented requests go by index into per-block lists prepared at the handshake
/// (every TP slice pattern included), mostly contiguous ones as coalesced raw plans; the
/// bytes are right either way.
#[test]
fn fragmented_requests_post_by_index() {
    run(
        "indexed",
        kvxfer_tests::scenarios::pull::fragmented_requests_post_by_index,
    );
}

/// A decode speaking vLLM 0.32's handshake to a prefill that serves it (as with a stock
/// vLLM NixlConnector on either side): plain NIXL metadata, the region geometry from vLLM's
/// fields, read notes from an agent that never named itself counted, every note understood
/// (`HB:` heartbeats too, where one went out before the read finished); reads too close to
/// the prefill's expiry declined; a decode with other compatibility factors refused, naming
/// the hash. (Both sides are kvxfer: interop with vLLM itself is `tests_vllm`'s.)
/// The settings of an engine speaking vLLM 0.32.0's handshake for `model` (the test model's
/// factors, the hash enforced).
fn vllm_peer(model: &str) -> kvxfer_core::pull::VllmCompat {
    kvxfer_core::pull::VllmCompat {
        factors: kvxfer_core::wire::vllm::CompatFactors {
            vllm_version: "0.32.0".into(),
            nixl_connector_version: 14,
            model: model.into(),
            dtype: "torch.float16".into(),
            num_kv_heads: 4,
            head_size: 8,
            num_hidden_layers: 2,
            attn_backend_name: "kvxfer".into(),
            cache_dtype: "auto".into(),
            is_hma_enabled: true,
            speculative_config: serde_json::Value::Null,
            transfer_mode: "pull".into(),
        },
        enforce_hash: true,
        region_names: Vec::new(),
        serve_decodes: true,
    }
}

/// A hybrid model's cache (layer 0 in KV cache group 0, layer 1 in group 1, the two layers
/// over the same memory on each side, as vLLM lays them out) between engines speaking vLLM's
/// handshake: the prefill serves its regions deduplicated, as vLLM registers them (one per
/// memory, marked -1: shared by both groups); the decode maps them back onto its layers and
/// moves each group by its own blocks (each group's local blocks the tail of its prefill
/// blocks), nothing else.
#[test]
fn a_hybrid_cache_pairs_over_the_vllm_handshake() {
    run("vllm-hybrid", |f| {
        use kvxfer_core::connector::KvCache;
        use kvxfer_core::pull::PullConfig;
        use kvxfer_tests::pull_env::{Model, RankCache, engine_tuned_with};
        use kvxfer_tests::scenarios::pull::{loaded_handoff_with, mk};

        let tune = |c: &mut PullConfig| c.vllm = Some(vllm_peer("hybrid"));
        let model = Model::small(kvxfer_layout::BlockOrder::Hnd, 4);
        let overlaid = |c: &RankCache| {
            let mut kv = KvCache {
                groups: Some(
                    kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).expect("groups"),
                ),
                ..model.kv_cache(c)
            };
            // Split K/V regions [K0, V0, K1, V1]: layer 1 over layer 0's memory.
            kv.bases = vec![kv.bases[0], kv.bases[1], kv.bases[0], kv.bases[1]];
            kv
        };
        let mut pre = engine_tuned_with("vh-P", &model, true, &mk(f), &tune, &overlaid);
        let mut dec = engine_tuned_with("vh-D", &model, false, &mk(f), &tune, &overlaid);
        // As a stock prefill hands them: no kvxfer version.
        loaded_handoff_with(
            &mut pre,
            &mut dec,
            &[vec![1, 2, 3], vec![5, 6]],
            &[vec![8, 9, 10], vec![12]],
            12,
            &|p| p.kvxfer_protocol = None,
        );
        // The shared memory (layer 0's regions): group 0's blocks 1-3 into 8-10, group 1's
        // block 6 (the tail of 5, 6) into 12; layer 1's own regions, unused, untouched.
        dec.caches[0]
            .verify_with(&|layer, b| {
                Some(match (layer, b) {
                    (0, 8..=10) => Some((0, b - 7)),
                    (0, 12) => Some((0, 6)),
                    _ => None,
                })
            })
            .expect("bytes");
    });
}

#[test]
fn the_vllm_handshake_pairs_over_plain_nixl_metadata() {
    run("vllm-protocol", |f| {
        use kvxfer_core::pull::PullConfig;
        use kvxfer_tests::pull_env::{Model, engine};
        use kvxfer_tests::scenarios::pull::{clock, first_failure, mk, poll_until_pair};

        let tune = |model: &'static str| {
            move |c: &mut PullConfig| {
                c.vllm = Some(vllm_peer(model));
                c.heartbeat_interval = std::time::Duration::from_millis(1);
            }
        };
        let model = Model::small(kvxfer_layout::BlockOrder::Hnd, 4);
        let c = clock();
        let mut pre = engine("vllm-P", &model, 1, true, c.clone(), &mk(f), &tune("m"));
        let mut dec = engine("vllm-D", &model, 1, false, c.clone(), &mk(f), &tune("m"));
        let mut params = pre.finish_prefill("r", &[3, 4, 9]);
        // As a stock prefill hands them: vLLM's transfer mode, no kvxfer version.
        params.kvxfer_protocol = None;
        assert_eq!(params.transfer_mode.as_deref(), Some("pull"));
        dec.start_load("r", &params, &[0, 7, 8], 12);
        let mut failures = Vec::new();
        poll_until_pair(
            &mut dec,
            &mut pre,
            &mut [false],
            &mut [false],
            &mut failures,
        );
        assert!(failures.is_empty(), "{failures:?}");
        dec.caches[0].verify(&[(3, 0), (4, 7), (9, 8)]).unwrap();
        let m = pre.workers[0].take_metrics();
        assert_eq!((m.refused_notes, m.expired_leases), (0, 0), "{m:?}");
        assert_eq!(pre.workers[0].unknown_notifications(), 0);

        // Blocks the prefill frees within the safety margin (its clock is ours here: the
        // handshake measured an offset near 0) are not read; ones freed later are.
        let now = kvxfer_core::sidechannel::monotonic_seconds();
        let mut soon = pre.finish_prefill("r-soon", &[6]);
        soon.kvxfer_protocol = None;
        soon.remote_blocks_expiry_time = serde_json::Number::from_f64(now + 2.0);
        dec.start_load("r-soon", &soon, &[2], 4);
        let failed = first_failure(&mut dec);
        assert!(
            failed[0].reason.contains("too late"),
            "{}",
            failed[0].reason
        );
        assert_eq!(dec.workers[0].take_metrics().expired_reads, 1);
        let mut later = pre.finish_prefill("r-later", &[6]);
        later.kvxfer_protocol = None;
        later.remote_blocks_expiry_time = serde_json::Number::from_f64(now + 60.0);
        dec.start_load("r-later", &later, &[2], 4);
        let mut failures = Vec::new();
        poll_until_pair(
            &mut dec,
            &mut pre,
            &mut [false],
            &mut [false],
            &mut failures,
        );
        assert!(failures.is_empty(), "{failures:?}");
        dec.caches[0]
            .verify(&[(3, 0), (4, 7), (9, 8), (6, 2)])
            .unwrap();

        // A cross-layer cache is refused toward a vLLM-protocol peer, naming why.
        let mut cross = model;
        cross.kind = kvxfer_layout::CacheKind::CrossLayer;
        let mut xpre = engine("vllm-XP", &cross, 1, true, c.clone(), &mk(f), &tune("m"));
        let mut xdec = engine("vllm-XD", &cross, 1, false, c.clone(), &mk(f), &tune("m"));
        let mut xparams = xpre.finish_prefill("rx", &[1]);
        xparams.kvxfer_protocol = None;
        xdec.start_load("rx", &xparams, &[2], 4);
        let failed = first_failure(&mut xdec);
        assert!(
            failed[0]
                .reason
                .contains("cross-layer cache (BLHNC) does not pair with stock vLLM peers"),
            "{}",
            failed[0].reason
        );

        // Other factors: refused before the agent metadata is read.
        let mut other = engine("vllm-D2", &model, 1, false, c, &mk(f), &tune("other"));
        let params = pre.finish_prefill("r2", &[5]);
        let mut params = params;
        params.kvxfer_protocol = None;
        other.start_load("r2", &params, &[1], 4);
        let failed = first_failure(&mut other);
        assert_eq!(failed[0].invalid_blocks, vec![1]);
        assert!(
            failed[0].reason.contains("compatibility hash differs")
                && failed[0].reason.contains("\"model\":\"other\""),
            "{}",
            failed[0].reason
        );
    });
}

/// A stock SGLang decode (its own nixl backend: ZMQ frames, plain NIXL metadata, no
/// notifications) served by a kvxfer prefill rank: at TP 1→1 and 1→2 every page lands
/// where the room names it and the aux row with it, and each decode rank is told
/// `KV_STATUS` Success only then; a registration whose pages hold no whole heads, a room
/// from an agent never registered and a room naming a page past the decode's buffers are
/// refused, the decode told why, nothing written.
#[test]
fn a_stock_sglang_decode_is_written_and_told_by_message() {
    run("stock sglang decode", |f| {
        use kvxfer_core::push::{PushPrefill, StockOutgoing};
        use kvxfer_core::transport::{AddrRange, MemoryKind, Registration, Transport};
        use kvxfer_core::wire::sglang_nixl as sgl;
        use kvxfer_layout::{BlockOrder, Side, TpMapping};
        use kvxfer_tests::pull_env::{GUARD, Model, RankCache};
        use kvxfer_tests::push_env::{ITEM_LEN, ITEMS, Setup, item_byte, prefill_on};
        use kvxfer_tests::scenarios::pull::clock;

        struct StockDecode {
            agent: NixlTransport,
            _regs: Vec<Registration>,
            cache: RankCache,
            aux: Vec<u8>,
            reg: sgl::Registration,
        }
        fn frames(v: &[Vec<u8>]) -> Vec<&[u8]> {
            v.iter().map(Vec::as_slice).collect()
        }
        fn room(d: &StockDecode, room: u64, pages: &[u32], required: u32) -> sgl::Room {
            sgl::Room {
                room,
                endpoint: d.reg.endpoint.clone(),
                agent: d.reg.agent.clone(),
                pages: pages.to_vec(),
                aux_index: Some(2),
                required,
                state: Vec::new(),
                prefix_tokens: 0,
                dummy: false,
            }
        }
        fn settle<T: Transport>(p: &mut PushPrefill<T>, want: usize) -> Vec<StockOutgoing> {
            let start = std::time::Instant::now();
            let mut out = Vec::new();
            while out.len() < want {
                p.poll();
                out.extend(p.take_stock_outbox());
                assert!(start.elapsed().as_secs() < 60, "no status within 60 s");
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
            out
        }

        let model = Model::small(BlockOrder::Nhd, 2);
        let (src, dst) = ([1u32, 2, 3, 4, 5], [9u32, 3, 4, 12, 0]);
        for d in [1u32, 2] {
            let s = Setup::new(model, 1, d);
            let mut pre = prefill_on(f, &s, &format!("stock-p{d}"), clock(), None, None);
            let p = &mut pre.ranks[0];
            let mapping = TpMapping::new(d, d, model.sharding()).expect("tp");
            let mut decodes: Vec<StockDecode> = (0..d)
                .map(|tp| {
                    let heads = mapping.heads_of(Side::Decode, tp).expect("rank");
                    let cache =
                        RankCache::in_memory(model.spec(heads.count), heads.first, 0, false, false);
                    let mut aux = vec![GUARD; (ITEMS as u64 * ITEM_LEN) as usize];
                    let mut agent = f.create(&format!("stock-d{d}-{tp}"));
                    let region = cache.spec.region_len();
                    let mut regs: Vec<Registration> = cache
                        .bases()
                        .iter()
                        .map(|&b| agent.register(MemoryKind::Host, AddrRange::new(b, region)))
                        .collect::<Result<_, _>>()
                        .expect("register KV");
                    let aux_ptr = aux.as_mut_ptr() as u64;
                    regs.push(
                        agent
                            .register(MemoryKind::Host, AddrRange::new(aux_ptr, aux.len() as u64))
                            .expect("register aux"),
                    );
                    let b = cache.bases();
                    let layers = b.len() / 2;
                    // SGLang's order: K of every layer, then V of every layer.
                    let kv_ptrs: Vec<u64> = (0..layers)
                        .map(|l| b[2 * l])
                        .chain((0..layers).map(|l| b[2 * l + 1]))
                        .collect();
                    let reg = sgl::Registration {
                        endpoint: ("127.0.0.1".into(), 41000 + tp as u16),
                        agent: agent.name().to_string(),
                        metadata: agent.native_metadata().expect("metadata"),
                        kv_item_lens: vec![cache.spec.block_len(); kv_ptrs.len()],
                        kv_mem_kinds: vec!["DRAM".into(); kv_ptrs.len()],
                        kv_ptrs,
                        aux_ptrs: vec![aux_ptr],
                        state_ptrs: Vec::new(),
                        gpu_id: 0,
                        tp: (d, tp),
                        state_item_lens: Vec::new(),
                        state_dims: Vec::new(),
                        staging: None,
                        num_slots: cache.spec.num_blocks().into(),
                        state_layer_ids: Vec::new(),
                        kv_layer_ids: Vec::new(),
                        dcp: (1, 0),
                        state_data_lens: Vec::new(),
                    };
                    StockDecode {
                        agent,
                        _regs: regs,
                        cache,
                        aux,
                        reg,
                    }
                })
                .collect();

            // Refused: pages that hold no whole number of this prefill's heads.
            let bad = sgl::Registration {
                agent: "not-whole-heads".into(),
                kv_item_lens: vec![decodes[0].cache.spec.block_len() + 1; 2 * 2],
                ..decodes[0].reg.clone()
            };
            let e = p
                .stock_message(&frames(&sgl::encode_registration(&bad)))
                .unwrap_err();
            assert!(e.contains("do not make whole heads"), "{e}");
            // Refused: a room from that agent, told to the address it gave.
            let m = sgl::Room {
                agent: bad.agent.clone(),
                ..room(&decodes[0], 5, &dst, d)
            };
            let e = p.stock_message(&frames(&sgl::encode_room(&m))).unwrap_err();
            assert!(
                e.starts_with("its registration was refused: stock SGLang decode not-whole-heads:")
                    && e.contains("bytes per KV page"),
                "{e}"
            );
            let told = p.take_stock_outbox();
            assert_eq!(told.len(), 1);
            assert_eq!(
                told[0].frames,
                sgl::kv_status(5, sgl::status::FAILED, 0, &e)
            );

            for dec in &decodes {
                p.stock_message(&frames(&sgl::encode_registration(&dec.reg)))
                    .expect("registration");
                p.stock_message(&frames(&sgl::encode_room(&room(dec, 7, &dst, d))))
                    .expect("room");
            }
            p.add_room(7, src.len(), Some(1), Vec::new());
            assert!(p.destinations_ready(7));
            p.send(7, &src[..2]).expect("chunk");
            assert!(
                p.take_stock_outbox().is_empty(),
                "told before the last chunk"
            );
            p.send(7, &src[2..]).expect("last chunk");
            let mut told = settle(p, d as usize);
            told.sort_by_key(|m| m.port);
            for (tp, dec) in decodes.iter().enumerate() {
                assert_eq!(told[tp].host, "127.0.0.1");
                assert_eq!(told[tp].port, dec.reg.endpoint.1);
                assert_eq!(
                    told[tp].frames,
                    sgl::kv_status(7, sgl::status::SUCCESS, 0, "")
                );
                let pairs: Vec<(u32, u32)> = src.iter().copied().zip(dst).collect();
                dec.cache
                    .verify(&pairs)
                    .unwrap_or_else(|e| panic!("decode {tp}: {e}"));
                let row = &dec.aux[(2 * ITEM_LEN) as usize..(3 * ITEM_LEN) as usize];
                assert!(
                    row.iter()
                        .enumerate()
                        .all(|(i, &b)| b == item_byte(0, 1, i as u64)),
                    "aux row 2 holds the prefill's row 1"
                );
            }

            // A page past the decode's buffers: the room fails, the decode is told why.
            let past = model.blocks;
            for dec in &decodes {
                p.stock_message(&frames(&sgl::encode_room(&room(dec, 8, &[past], d))))
                    .expect("room");
            }
            p.add_room(8, 1, Some(3), Vec::new());
            let told = settle(p, d as usize);
            for m in &told {
                assert_eq!(
                    m.frames[..3],
                    sgl::kv_status(8, sgl::status::FAILED, 0, "")[..3]
                );
                let reason = String::from_utf8_lossy(&m.frames[4]);
                assert!(reason.contains(&past.to_string()), "{reason}");
            }
            let pairs: Vec<(u32, u32)> = src.iter().copied().zip(dst).collect();
            for dec in &mut decodes {
                dec.cache.verify(&pairs).expect("nothing else written");
                // SGLang 0.5.23 never reads NIXL notifications: none may pile up there.
                let mut notes = Vec::new();
                dec.agent.drain_notifications(&mut notes).expect("drain");
                assert!(notes.is_empty(), "{} notifications sent", notes.len());
            }
        }
    });
}
