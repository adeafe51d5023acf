//! Push mode against peers that lie, on the loopback: notifications from agents that are not
//! the room's prefill ranks neither complete nor fail a room; numbers a registry or a decode
//! sends are checked before anything uses them (no panic, no wrap, a clear refusal).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::Transport;
use kvxfer_core::push::messages::{
    self, BufferWire, FromPrefill, FromRegistry, RankInfo, RegisterArgs, RoomRequest, ToPrefill,
    ToRegistry, encode,
};
use kvxfer_core::push::{RoomStatus, StateKind};
use kvxfer_core::sidechannel::auth::Destination;
use kvxfer_core::sidechannel::request_bytes;
use kvxfer_core::wire::handshake::LayoutWire;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::pull_env::Model;
use kvxfer_tests::push_env::{DecodeSide, PrefillSide, Setup, decode, poll_until, prefill};
use kvxfer_tests::scenarios::pull::clock;
use kvxfer_transport_loopback::LoopbackTransport;

/// An agent that loaded decode rank 0's metadata and sends it whatever it likes, under the
/// name it was given (names are the sender's own claim).
fn forger(name: &str, dec: &DecodeSide) -> (LoopbackTransport, kvxfer_core::PeerId) {
    let mut t = LoopbackTransport::new(name).expect("agent");
    let meta = dec.ranks[0].transport().metadata().expect("metadata");
    let peer = t.load_peer(&meta).expect("load decode");
    (t, peer)
}

/// Room 1 (one page, aux) bootstrapped on both sides and waiting for the prefill's data.
fn waiting_room(name: &str) -> (PrefillSide, DecodeSide) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill(&s, name, Arc::clone(&c), None, None);
    let mut dec = decode(&s, name, c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], Some(2), vec![]);
    pre.ranks[0].add_room(1, 1, Some(0), vec![]);
    poll_until(&mut pre, &mut dec, |pre, dec| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
            && dec.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    (pre, dec)
}

/// Polls both sides a while, for notes to arrive and be handled.
fn settle_all(pre: &mut PrefillSide, dec: &mut DecodeSide) {
    for _ in 0..50 {
        for p in &mut pre.ranks {
            p.poll();
        }
        dec.ranks[0].poll();
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn notes_from_agents_that_are_not_the_rooms_prefill_are_dropped() {
    let (mut pre, mut dec) = waiting_room("pn1");
    let before = dec.ranks[0].unknown_notifications();
    let (mut x, peer) = forger("pn1-outsider", &dec);
    for note in [
        "1_abort",
        "1_kv_0_1_0",
        "1_kv_4294967295_1_0",
        "1_aux",
        "1_state_0",
    ] {
        x.send_notification(peer, note.as_bytes()).expect("send");
    }
    settle_all(&mut pre, &mut dec);
    assert_eq!(
        dec.ranks[0].status(1),
        Some(RoomStatus::WaitingForInput),
        "{:?}",
        dec.ranks[0].error(1)
    );
    assert_eq!(dec.ranks[0].unknown_notifications() - before, 5);
    // The real prefill still completes the room, every byte right.
    pre.ranks[0].send(1, &[3]).expect("send");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    dec.mem[0].kv.verify(&[(3, 5)]).expect("bytes");
    assert!(dec.mem[0].aux.holds(2, 0), "aux item");
}

/// A note under the prefill rank's own name claiming chunk `u32::MAX` is the last: no
/// overflow, and the room cannot complete on it (it waits for chunks that never come).
#[test]
fn a_last_chunk_at_u32_max_neither_wraps_nor_completes() {
    let (mut pre, mut dec) = waiting_room("pn2");
    let (mut x, peer) = forger("pn2-p0-0", &dec);
    x.send_notification(peer, b"1_kv_4294967295_1_0")
        .expect("send");
    x.send_notification(peer, b"1_aux").expect("send");
    settle_all(&mut pre, &mut dec);
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Transferring));
}

/// A registry whose layout lists a rank with `pp_size: 0`: the room fails naming the
/// layout; nothing underflows.
#[test]
fn a_registry_layout_with_zero_stages_fails_the_room() {
    let rank = RankInfo {
        agent: "liar-p0-0".into(),
        tp_size: 1,
        tp_rank: 0,
        pp_size: 0,
        pp_rank: 0,
        dp_size: 1,
        dp_rank: 0,
        host: "127.0.0.1".into(),
        port: 0,
        page_size: 4,
        dtype: "f16".into(),
        first_layer: 0,
        num_layers: 2,
    };
    // The liar is registry and mailbox at once: it accepts every registration and room.
    let server = kvxfer_tests::push_env::fake_registry(rank);
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let mut dec = decode(&s, "pn3", clock());
    dec.ranks[0].add_room(1, ("127.0.0.1", server.port()), vec![5], Some(2), vec![]);
    let start = Instant::now();
    while !dec.ranks[0].status(1).is_some_and(RoomStatus::is_final) {
        dec.ranks[0].poll();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "room never ended"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Failed));
    let error = dec.ranks[0].error(1).unwrap_or_default();
    assert!(error.contains("registry's layout"), "{error}");
}

/// Prefill rank 0 as its registry lists it (its mailbox is where registrations go).
fn mailbox(pre: &PrefillSide) -> RankInfo {
    let ranks = match messages::decode::<FromRegistry>(
        &request_bytes(
            "127.0.0.1",
            pre.registry.port(),
            &Destination::registry(pre.registry.port()),
            &encode(&ToRegistry::Query),
            Duration::from_secs(5),
            1 << 20,
        )
        .expect("query"),
        "reply",
    ) {
        Ok(FromRegistry::Layout { ranks, .. }) => ranks,
        other => panic!("{other:?}"),
    };
    ranks.into_iter().next().expect("rank 0")
}

/// A decode registering an aux buffer that ends past `u64::MAX` is refused at registration,
/// in the mailbox's reply (counted), so no room of it can reach a WRITE.
#[test]
fn a_registered_buffer_that_wraps_is_refused() {
    let (mut pre, dec) = waiting_room("pn4");
    let mailbox = mailbox(&pre);
    let item_len = kvxfer_tests::push_env::ITEM_LEN;
    let spec = dec.mem[0].kv.spec;
    let args = RegisterArgs {
        agent: "pn4-wrapper".into(),
        agent_metadata: dec.ranks[0].transport().metadata().expect("metadata"),
        layout: LayoutWire::from_spec(&spec, 4, 2, 0),
        kv_bases: dec.mem[0].kv.bases(),
        aux: vec![BufferWire {
            base: u64::MAX - 10,
            item_len,
            items: 4,
        }],
        state: vec![],
        tp_size: 1,
        tp_rank: 0,
        reregisters: false,
    };
    let before = pre.ranks[0].refused();
    let reply = request_bytes(
        &mailbox.host,
        mailbox.port,
        &Destination::mailbox(&mailbox.agent),
        &encode(&ToPrefill::Register(args)),
        Duration::from_secs(5),
        1 << 20,
    )
    .expect("reply");
    match messages::decode::<FromPrefill>(&reply, "reply") {
        Ok(FromPrefill::Error { reason }) => {
            assert!(reason.contains("overflows the address space"), "{reason}");
        }
        other => panic!("refused in the reply, naming why: {other:?}"),
    }
    assert_eq!(pre.ranks[0].refused(), before + 1);
    // The refused decode cannot open a room: the prefill does not know it, and says so at
    // once (the decode registers again, is refused again, and fails the room).
    let room = RoomRequest {
        room: 9,
        agent: "pn4-wrapper".into(),
        pages: vec![1],
        aux_index: Some(0),
        state_indices: vec![],
        digest: false,
        prefix_tokens: 0,
        group_pages: Vec::new(),
    };
    let reply = request_bytes(
        &mailbox.host,
        mailbox.port,
        &Destination::mailbox(&mailbox.agent),
        &encode(&ToPrefill::Room(room)),
        Duration::from_secs(5),
        1 << 20,
    )
    .expect("reply");
    assert_eq!(
        messages::decode::<FromPrefill>(&reply, "reply").ok(),
        Some(FromPrefill::Unregistered)
    );
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].status(9), None, "nothing queued");
}

/// A decode registers its buffers with a prefill rank once, not once per room.
#[test]
fn a_decode_registers_once_for_many_rooms() {
    let (mut pre, mut dec) = waiting_room("pn5");
    let port = pre.registry.port();
    for room in 2..5u64 {
        dec.ranks[0].add_room(room, ("127.0.0.1", port), vec![room as u32], None, vec![]);
        pre.ranks[0].add_room(room, 1, None, vec![]);
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        (1..5).all(|r| pre.ranks[0].status(r) == Some(RoomStatus::WaitingForInput))
    });
    assert_eq!(pre.ranks[0].take_metrics().registrations, 1);
}

/// With two pipeline stages, a room is complete only when both wrote: stage 0 alone
/// leaves it transferring. Aux comes from the last stage only.
#[test]
fn a_room_waits_for_every_pipeline_stage() {
    let mut model = Model::small(BlockOrder::Hnd, 4);
    model.layers = 2;
    let mut s = Setup::new(model, 1, 1);
    s.stages = vec![1, 1];
    let c = clock();
    let mut pre = prefill(&s, "pn6", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn6", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], Some(2), vec![]);
    for p in &mut pre.ranks {
        p.add_room(1, 1, Some(0), vec![]);
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks
            .iter()
            .all(|p| p.status(1) == Some(RoomStatus::WaitingForInput))
    });
    pre.ranks[0].send(1, &[3]).expect("stage 0 sends");
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::Success)
    });
    settle_all(&mut pre, &mut dec);
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Transferring));
    assert_eq!(
        pre.ranks[0].take_metrics().transfers,
        1,
        "stage 0: KV, no aux"
    );
    pre.ranks[1].send(1, &[3]).expect("stage 1 sends");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    assert_eq!(
        pre.ranks[1].take_metrics().transfers,
        2,
        "the last stage: KV and aux"
    );
    dec.mem[0]
        .kv
        .verify(&[(3, 5)])
        .expect("both stages' layers");
}

/// Layer chunks name layers the rank holds, of a cache that keeps layers apart: an empty
/// range, one past its layers and a cross-layer cache (every layer in each block) are
/// refused, and the room is untouched by them; a valid layer chunk then goes out.
#[test]
fn layer_chunks_outside_the_ranks_layers_or_of_a_cross_layer_cache_are_refused() {
    let (mut pre, mut dec) = waiting_room("pn8");
    let layers = pre.ranks[0].rank_info().num_layers;
    for bad in [0..0, layers..layers + 1, 0..layers + 1] {
        assert!(
            pre.ranks[0]
                .send_layers(1, &[3], bad.clone(), true)
                .is_err(),
            "{bad:?} of {layers} layers"
        );
    }
    assert_eq!(pre.ranks[0].status(1), Some(RoomStatus::WaitingForInput));
    pre.ranks[0]
        .send_layers(1, &[3], 0..1, false)
        .expect("the first layer");
    pre.ranks[0]
        .send_layers(1, &[3], 1..layers, true)
        .expect("the others");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    dec.mem[0]
        .kv
        .verify(&[(3, 5)])
        .expect("both chunks' layers");

    let mut cross = Model::small(BlockOrder::Hnd, 4);
    cross.kind = kvxfer_layout::CacheKind::CrossLayer;
    let s = Setup::new(cross, 1, 1);
    let c = clock();
    let mut pre = prefill(&s, "pn8x", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn8x", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![]);
    pre.ranks[0].add_room(1, 1, None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    let refused = pre.ranks[0].send_layers(1, &[3], 0..1, true);
    assert!(
        refused.is_err_and(|e| e.to_string().contains("cross-layer")),
        "a cross-layer cache sends whole pages"
    );
    pre.ranks[0].send(1, &[3]).expect("whole pages");
}

/// Registers `args` with the waiting room's prefill rank 0 through its mailbox and waits
/// until its engine poll has handled it; returns whether it was refused. A registration
/// that does not pair is refused in the mailbox's reply, naming why, and counted.
fn register(pre: &mut PrefillSide, args: RegisterArgs) -> bool {
    let mailbox = mailbox(pre);
    let refused = pre.ranks[0].refused();
    let _ = pre.ranks[0].take_metrics();
    let reply = request_bytes(
        &mailbox.host,
        mailbox.port,
        &Destination::mailbox(&mailbox.agent),
        &encode(&ToPrefill::Register(args)),
        Duration::from_secs(5),
        1 << 20,
    )
    .expect("reply");
    match messages::decode::<FromPrefill>(&reply, "reply").expect("a reply") {
        FromPrefill::Ok => {}
        FromPrefill::Error { reason } => {
            assert!(!reason.is_empty());
            assert_eq!(pre.ranks[0].refused(), refused + 1, "counted");
            return true;
        }
        other => panic!("{other:?}"),
    }
    let start = Instant::now();
    let mut seen = 0;
    while seen == 0 {
        pre.ranks[0].poll();
        seen = pre.ranks[0].take_metrics().registrations;
        assert!(start.elapsed() < Duration::from_secs(60), "never handled");
        std::thread::sleep(Duration::from_millis(1));
    }
    pre.ranks[0].refused() > refused
}

/// Each difference a decode's registration may not have from the prefill's layout is
/// refused on its own: page size, dtype, aux or state buffer count, item length, the
/// model's KV heads or layers. Its regions
/// lie far apart, so a larger page does not make them overlap (a refusal of its own).
#[test]
fn registrations_that_do_not_fit_are_refused_one_difference_at_a_time() {
    let (mut pre, dec) = waiting_room("pn7");
    let spec = dec.mem[0].kv.spec;
    let item = claimed(&dec, "", spec.num_blocks()).aux[0];
    let base = |name: &str| claimed(&dec, name, spec.num_blocks());
    assert!(
        !register(&mut pre, base("pn7-fits")),
        "a fitting registration"
    );
    let mut page = base("pn7-page");
    page.layout.tokens_per_block += 1;
    // A multiple pairs in pull mode (token ranges); a push room's pages must match.
    let mut page_multiple = base("pn7-page-multiple");
    page_multiple.layout.tokens_per_block *= 2;
    let mut dtype = base("pn7-dtype");
    dtype.layout.dtype = if dtype.layout.dtype == "f32" {
        "f16"
    } else {
        "f32"
    }
    .into();
    let mut aux_count = base("pn7-aux-count");
    aux_count.aux.push(item);
    let mut aux_len = base("pn7-aux-len");
    aux_len.aux[0].item_len += 1;
    let mut state_count = base("pn7-state-count");
    state_count.state.push(item);
    // Twice the model's heads, split over two decode ranks: each rank's own count fits.
    let mut heads = base("pn7-heads");
    heads.layout.total_kv_heads *= 2;
    heads.tp_size = 2;
    let mut layers = base("pn7-layers");
    layers.layout.total_layers += 1;
    for (what, args) in [
        ("page size", page),
        ("page size, a multiple", page_multiple),
        ("dtype", dtype),
        ("aux count", aux_count),
        ("aux item length", aux_len),
        ("state count", state_count),
        ("model's KV heads", heads),
        ("model's layers", layers),
    ] {
        assert!(register(&mut pre, args), "{what} differs and was accepted");
    }
}

/// A registry that stays "not ready" (no prefill rank ever registers) fails the decode's
/// room after `bootstrap_timeout`, naming how many ranks registered: the decode does not
/// keep asking until its much longer waiting timeout.
#[test]
fn a_registry_that_stays_not_ready_fails_the_room_after_the_bootstrap_timeout() {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.decode_config = |cfg| cfg.bootstrap_timeout = Duration::from_millis(300);
    let empty = kvxfer_core::push::BootstrapRegistry::bind("127.0.0.1", 0).expect("registry");
    let mut dec = decode(&s, "notready", clock());
    dec.ranks[0].add_room(1, ("127.0.0.1", empty.port()), vec![5], None, vec![]);
    let start = Instant::now();
    while dec.ranks[0].status(1) != Some(RoomStatus::Failed) {
        dec.ranks[0].poll();
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "still waiting for the registry"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "failed before the bootstrap timeout"
    );
    let error = dec.ranks[0].error(1).unwrap_or_default();
    assert!(error.contains("not ready: 0 of 0 ranks"), "{error}");
}

/// A registration of decode `name` claiming `num_blocks` pages per region, its regions
/// 1 TiB apart (a registration touches no memory), one aux buffer of 4 items, no state.
fn claimed(dec: &DecodeSide, name: &str, num_blocks: u32) -> RegisterArgs {
    let spec = dec.mem[0].kv.spec;
    let mut layout = LayoutWire::from_spec(&spec, 4, 2, 0);
    layout.num_blocks = num_blocks;
    RegisterArgs {
        agent: name.into(),
        agent_metadata: dec.ranks[0].transport().metadata().expect("metadata"),
        layout,
        kv_bases: (1..=u64::from(spec.num_regions()))
            .map(|r| r << 40)
            .collect(),
        aux: vec![BufferWire {
            base: 0x1000,
            item_len: kvxfer_tests::push_env::ITEM_LEN,
            items: 4,
        }],
        state: vec![],
        tp_size: 1,
        tp_rank: 0,
        reregisters: false,
    }
}

/// Sends `req` to prefill rank 0's mailbox as its decode would, and polls until the rank
/// knows the room; returns the room's error, if it failed.
fn open_room(pre: &mut PrefillSide, req: RoomRequest) -> Option<String> {
    let mailbox = mailbox(pre);
    let room = req.room;
    let reply = request_bytes(
        &mailbox.host,
        mailbox.port,
        &Destination::mailbox(&mailbox.agent),
        &encode(&ToPrefill::Room(req)),
        Duration::from_secs(120),
        messages::MAX_MESSAGE_BYTES,
    )
    .expect("reply");
    assert_eq!(
        messages::decode::<FromPrefill>(&reply, "reply").ok(),
        Some(FromPrefill::Ok)
    );
    let start = Instant::now();
    while pre.ranks[0].status(room).is_none() {
        pre.ranks[0].poll();
        assert!(start.elapsed() < Duration::from_secs(60), "room never seen");
        std::thread::sleep(Duration::from_millis(1));
    }
    pre.ranks[0].error(room)
}

fn room_of(agent: &str, room: u64, pages: Vec<u32>, state_indices: Vec<u32>) -> RoomRequest {
    RoomRequest {
        room,
        agent: agent.into(),
        pages,
        aux_index: None,
        state_indices,
        digest: false,
        prefix_tokens: 0,
        group_pages: Vec::new(),
    }
}

/// A room may name up to `MAX_ROOM_PAGES` destination pages, not one more, even when the
/// decode claims enough pages for more.
#[test]
fn a_room_of_more_than_max_room_pages_fails_and_one_of_exactly_that_many_does_not() {
    let (mut pre, dec) = waiting_room("pn8");
    let max = messages::MAX_ROOM_PAGES as u32;
    assert!(!register(&mut pre, claimed(&dec, "pn8-big", max + 1)));
    let exactly = open_room(&mut pre, room_of("pn8-big", 2, (0..max).collect(), vec![]));
    assert_eq!(exactly, None);
    let more = open_room(&mut pre, room_of("pn8-big", 3, (0..=max).collect(), vec![]))
        .expect("more pages than the limit");
    assert!(more.contains("exceed the limit"), "{more}");
}

/// Mamba state takes one index per room with pages: a room naming two fails, one naming
/// one does not.
#[test]
fn a_mamba_room_with_two_state_indices_fails() {
    let s = with_state(1, StateKind::Mamba);
    let c = clock();
    let mut pre = prefill(&s, "pn9", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn9", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![0]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1).is_some()
    });
    assert_eq!(pre.ranks[0].error(1), None, "one index");
    let agent = dec.ranks[0].transport().name().to_string();
    let two = open_room(&mut pre, room_of(&agent, 2, vec![6], vec![0, 1])).expect("two");
    assert!(two.contains("exactly one index"), "{two}");
}

/// The page, aux and state numbers of the room must be in the decode's range.
#[test]
fn rooms_naming_pages_or_items_the_decode_lacks_fail() {
    let (mut pre, dec) = waiting_room("pn10");
    assert!(!register(&mut pre, claimed(&dec, "pn10-small", 8)));
    let page = open_room(&mut pre, room_of("pn10-small", 2, vec![8], vec![])).expect("page");
    assert!(page.contains("page 8 is out of range"), "{page}");
    let repeat = open_room(&mut pre, room_of("pn10-small", 3, vec![7, 7], vec![]));
    assert!(repeat.expect("repeat").contains("repeat"));
    let mut aux = room_of("pn10-small", 4, vec![7], vec![]);
    aux.aux_index = Some(4);
    let aux = open_room(&mut pre, aux).expect("aux");
    assert!(aux.contains("aux index 4"), "{aux}");
    let mut fits = room_of("pn10-small", 5, vec![0, 7], vec![]);
    fits.aux_index = Some(3);
    assert_eq!(open_room(&mut pre, fits), None);
}

/// A decode that registers again with other buffers (same name) is written at the new
/// ones: the latest registration wins.
#[test]
fn a_decode_registering_again_with_new_buffers_is_written_at_the_new_ones() {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill(&s, "pn11", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn11", c);
    // Before the decode bootstraps, its name registers buffers nowhere near its memory.
    let agent = dec.ranks[0].transport().name().to_string();
    let spec = dec.mem[0].kv.spec;
    assert!(!register(
        &mut pre,
        claimed(&dec, &agent, spec.num_blocks())
    ));
    let statuses = kvxfer_tests::push_env::run_room(
        &mut pre,
        &mut dec,
        1,
        &[3],
        &[5],
        1,
        Some((0, 2)),
        (vec![], vec![]),
    );
    assert_eq!(
        statuses,
        vec![RoomStatus::Success],
        "{:?}",
        dec.ranks[0].error(1)
    );
    dec.mem[0]
        .kv
        .verify(&[(3, 5)])
        .expect("bytes at the new buffers");
    assert!(dec.mem[0].aux.holds(2, 0));
}

/// Aux and state items travel with the chunk that completes the room, not before; state
/// only when both sides name state indices.
#[test]
fn only_the_last_chunk_writes_aux_and_state() {
    let s = with_state(1, StateKind::Window);
    let c = clock();
    let mut pre = prefill(&s, "pn12", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn12", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5, 6], Some(2), vec![4]);
    pre.ranks[0].add_room(1, 2, Some(0), vec![1]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    pre.ranks[0].send(1, &[3]).expect("first chunk");
    settle_all(&mut pre, &mut dec);
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Transferring));
    assert!(dec.mem[0].aux.untouched(2), "aux before the last chunk");
    assert!(dec.mem[0].state.untouched(4), "state before the last chunk");
    assert_eq!(pre.ranks[0].take_metrics().transfers, 1, "KV only");
    pre.ranks[0].send(1, &[7]).expect("last chunk");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    dec.mem[0].kv.verify(&[(3, 5), (7, 6)]).expect("bytes");
    assert!(dec.mem[0].aux.holds(2, 0) && dec.mem[0].state.holds(4, 1));
    // The prefill names state, the decode does not: KV and aux move, no state.
    dec.ranks[0].add_room(2, ("127.0.0.1", port), vec![1], Some(3), vec![]);
    pre.ranks[0].add_room(2, 1, Some(0), vec![2]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(2) == Some(RoomStatus::WaitingForInput)
    });
    pre.ranks[0].send(2, &[4]).expect("send");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(2).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(2), Some(RoomStatus::Success));
    assert!(dec.mem[0].aux.holds(3, 0));
    assert!(
        (0..8)
            .filter(|&i| i != 4)
            .all(|i| dec.mem[0].state.untouched(i))
    );
}

/// Both sides list the rooms they know, count the failed ones, and forget removed ones.
#[test]
fn rooms_are_listed_counted_when_failed_and_forgotten_when_removed() {
    let (mut pre, mut dec) = waiting_room("pn13");
    pre.ranks[0].add_room(3, 1, None, vec![]);
    pre.ranks[0].add_room(2, 1, None, vec![]);
    let mut rooms = pre.ranks[0].known_rooms();
    rooms.sort_unstable();
    assert_eq!(rooms, vec![1, 2, 3]);
    pre.ranks[0].abort(3);
    assert_eq!(pre.ranks[0].take_metrics().failed_rooms, 1);
    pre.ranks[0].remove_room(3);
    assert_eq!(pre.ranks[0].status(3), None);
    rooms = pre.ranks[0].known_rooms();
    rooms.sort_unstable();
    assert_eq!(rooms, vec![1, 2]);
    assert_eq!(pre.ranks[0].take_metrics().failed_rooms, 0);
    dec.ranks[0].remove_room(1);
    assert_eq!(dec.ranks[0].status(1), None);
    dec.ranks[0].poll();
    assert_eq!(dec.ranks[0].status(1), None);
}

/// A room one of two writing prefill ranks fails (TP 2 → 1; here state between different TP
/// sizes, which cannot be paired item for item): that rank releases every WRITE it posted
/// and tells the decode, which fails the room at once and tells the other rank to stop; the
/// room drains (its pages may be handed out) only once both acknowledged.
#[test]
fn a_room_failed_by_one_of_two_writers_fails_at_once_and_drains_when_both_stopped() {
    let mut s = with_state(2, StateKind::Window);
    s.decode_config = |cfg| cfg.waiting_timeout = Duration::from_secs(3600);
    let c = clock();
    let mut pre = prefill(&s, "pn14", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn14", c);
    let statuses = kvxfer_tests::push_env::run_room(
        &mut pre,
        &mut dec,
        1,
        &[3],
        &[5],
        1,
        Some((0, 2)),
        (vec![1], vec![4]),
    );
    assert_eq!(statuses, vec![RoomStatus::Failed]);
    let why = pre
        .ranks
        .iter()
        .find_map(|p| p.error(1))
        .expect("a prefill rank failed");
    assert!(why.contains("equal TP"), "{why}");
    let decode = dec.ranks[0].error(1).unwrap_or_default();
    assert!(decode.contains("aborted by the prefill"), "{decode}");
    dec.ranks[0].remove_room(1);
    poll_until(&mut pre, &mut dec, |_, dec| dec.ranks[0].drained(1));
    for p in &pre.ranks {
        assert_eq!(p.status(1), Some(RoomStatus::Failed), "a writer kept going");
        assert_eq!(p.transport().open_transfers(), 0, "a WRITE left unreleased");
    }
    assert!(dec.mem[0].state.untouched(4), "no state written");
}

/// A room aborted while its destinations are still on their way (the bootstrap has not come
/// back) drains once the ranks they reached acknowledged, not before; one whose bootstrap
/// never reached a rank drains as soon as that is known.
#[test]
fn a_room_aborted_during_its_bootstrap_drains_after_the_ranks_it_reached() {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill(&s, "pn19", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn19", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![]);
    dec.ranks[0].abort(1);
    dec.ranks[0].remove_room(1);
    assert!(
        !dec.ranks[0].drained(1),
        "drained before the bootstrap came back"
    );
    poll_until(&mut pre, &mut dec, |_, dec| dec.ranks[0].drained(1));
    assert_eq!(
        pre.ranks[0].status(1),
        Some(RoomStatus::Failed),
        "the prefill was told"
    );
    // One aborted (kept, not removed) before its bootstrap came back learns the prefill's
    // ranks from it: another agent's note is not the room's.
    dec.ranks[0].add_room(3, ("127.0.0.1", port), vec![6], None, vec![]);
    dec.ranks[0].abort(3);
    poll_until(&mut pre, &mut dec, |_, dec| dec.ranks[0].drained(3));
    let (mut forged, peer) = forger("pn19-stranger", &dec);
    let before = dec.ranks[0].unknown_notifications();
    forged
        .send_notification(peer, &messages::abort_note(3))
        .expect("send");
    let start = Instant::now();
    while dec.ranks[0].unknown_notifications() == before {
        dec.ranks[0].poll();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the stranger's note counted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // A registry nobody answers: the bootstrap fails without reaching a rank.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = silent.local_addr().expect("addr").port();
    drop(silent);
    dec.ranks[0].add_room(2, ("127.0.0.1", dead), vec![5], None, vec![]);
    dec.ranks[0].abort(2);
    dec.ranks[0].remove_room(2);
    assert!(!dec.ranks[0].drained(2));
    poll_until(&mut pre, &mut dec, |_, dec| dec.ranks[0].drained(2));
}

/// A bootstrap that fails after it sent the room's pages to one prefill rank (the second of
/// two writers is gone: its registration goes unanswered) tells the rank it reached to stop;
/// the room drains once that rank acknowledged.
#[test]
fn a_bootstrap_that_fails_part_way_stops_the_ranks_it_reached() {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 2, 1);
    s.decode_config = |cfg| cfg.request_timeout = Duration::from_millis(300);
    let c = clock();
    let mut pre = prefill(&s, "pn20", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn20", c);
    drop(pre.ranks.remove(1));
    // The engine has the room: only the decode's abort can end it there (no bootstrap
    // timeout that would fail it and tell the decode anyway).
    pre.ranks[0].add_room(1, 1, None, vec![]);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![]);
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    poll_until(&mut pre, &mut dec, |pre, dec| {
        pre.ranks[0].status(1) == Some(RoomStatus::Failed) && dec.ranks[0].drained(1)
    });
}

/// A live room the prefill engine removes fails, and its one-writer decode is told.
#[test]
fn a_room_removed_by_the_prefill_engine_fails_on_the_decode() {
    let (mut pre, mut dec) = waiting_room("pn17");
    pre.ranks[0].remove_room(1);
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    let told = dec.ranks[0].error(1).unwrap_or_default();
    assert!(told.contains("aborted by the prefill"), "{told}");
}

/// A prefill engine's abort releases (cancels) the room's WRITEs before it tells the decode,
/// which may hand the pages to other requests as soon as it knows.
#[test]
fn a_prefill_abort_releases_its_writes_and_tells_the_decode() {
    let (mut pre, mut dec) = waiting_room("pn15");
    let faults = pre.ranks[0].transport().faults();
    faults.hold_completions(true);
    pre.ranks[0].send(1, &[3]).expect("send");
    assert_eq!(
        pre.ranks[0].transport().open_transfers(),
        2,
        "KV and aux WRITEs in flight"
    );
    pre.ranks[0].abort(1);
    assert_eq!(
        pre.ranks[0].transport().open_transfers(),
        0,
        "WRITE not released"
    );
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    let told = dec.ranks[0].error(1).unwrap_or_default();
    assert!(told.contains("aborted by the prefill"), "{told}");
    faults.release_held();
}

/// A WRITE that fails fails the room on the prefill and, told at once, on the decode.
#[test]
fn a_failed_write_fails_the_room_on_both_sides_at_once() {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.decode_config = |cfg| cfg.waiting_timeout = Duration::from_secs(3600);
    let c = clock();
    let mut pre = prefill(&s, "pn16", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn16", c);
    pre.ranks[0].transport().faults().fail_next_transfers(1);
    let statuses = kvxfer_tests::push_env::run_room(
        &mut pre,
        &mut dec,
        1,
        &[3],
        &[5],
        1,
        None,
        (vec![], vec![]),
    );
    assert_eq!(statuses, vec![RoomStatus::Failed]);
    let why = pre.ranks[0].error(1).unwrap_or_default();
    assert!(why.contains("transfer failed"), "{why}");
    let told = dec.ranks[0].error(1).unwrap_or_default();
    assert!(told.contains("aborted by the prefill"), "{told}");
}

/// Prefill TP `p` → decode TP 1, one state buffer of `kind` per rank.
fn with_state(p: u32, kind: StateKind) -> Setup {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), p, 1);
    s.state = 1;
    s.state_kind = kind;
    s
}

/// SGLang's order: the decode's destinations arrive before the engine knows the room's size,
/// and the prefill reports them ready only once all have asked (two decode ranks take from
/// this one); the engine adds the room then. A failed room is not ready.
#[test]
fn destinations_are_ready_once_every_decode_rank_asked_before_the_engine_adds_the_room() {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 2);
    let c = clock();
    let mut pre = prefill(&s, "pn20", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn20", c);
    let port = pre.registry.port();
    assert!(!pre.ranks[0].destinations_ready(1), "unknown room");
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], Some(2), vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1).is_some()
    });
    settle_all(&mut pre, &mut dec);
    assert!(
        !pre.ranks[0].destinations_ready(1),
        "one of two decode ranks asked"
    );
    dec.ranks[1].add_room(1, ("127.0.0.1", port), vec![6], Some(2), vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].destinations_ready(1)
    });
    assert_eq!(pre.ranks[0].status(1), Some(RoomStatus::Bootstrapping));
    pre.ranks[0].add_room(1, 1, Some(0), vec![]);
    assert_eq!(pre.ranks[0].status(1), Some(RoomStatus::WaitingForInput));
    pre.ranks[0].send(1, &[2]).expect("the one chunk");
    poll_until(&mut pre, &mut dec, |_, dec| {
        (0..2).all(|r| dec.ranks[r].status(1) == Some(RoomStatus::Success))
    });
    pre.ranks[0].abort(1);
    assert!(!pre.ranks[0].destinations_ready(1), "a failed room");
}

/// State indices handed over with the last chunk replace those the room was added with; a
/// final or unknown room takes none.
#[test]
fn state_indices_set_before_the_last_chunk_are_the_ones_written() {
    let s = with_state(1, StateKind::Window);
    let c = clock();
    let mut pre = prefill(&s, "pn21", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn21", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], Some(2), vec![4]);
    pre.ranks[0].add_room(1, 1, Some(0), vec![7]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    pre.ranks[0]
        .set_state_indices(1, vec![1])
        .expect("a live room");
    pre.ranks[0].send(1, &[2]).expect("the one chunk");
    // The decode may learn of success before the prefill polls its own completion; the room
    // is final on the prefill only then.
    poll_until(&mut pre, &mut dec, |pre, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Success)
            && pre.ranks[0].status(1) == Some(RoomStatus::Success)
    });
    assert!(dec.mem[0].state.holds(4, 1), "the replacing index's item");
    assert!(
        pre.ranks[0].set_state_indices(1, vec![0]).is_err(),
        "a final room takes no new indices"
    );
    assert!(
        pre.ranks[0].set_state_indices(9, vec![0]).is_err(),
        "unknown room"
    );
}

/// A room that only decodes knew — the engine never added it — fails at the bootstrap timeout
/// (its decode told) and is forgotten once twice that has passed; a room the engine added
/// stays until the engine removes it.
#[test]
fn rooms_the_engine_never_added_are_forgotten_after_twice_the_bootstrap_timeout() {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.prefill_config = |cfg| cfg.bootstrap_timeout = Duration::from_secs(10);
    let manual = kvxfer_core::clock::ManualClock::default();
    let mut pre = prefill(&s, "pn22", Arc::new(manual.clone()), None, None);
    let mut dec = decode(&s, "pn22", clock());
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].requested_rooms() == [1]
    });
    pre.ranks[0].add_room(2, 1, None, vec![]);
    pre.ranks[0].abort(2);
    manual.advance(Duration::from_secs(11));
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    assert_eq!(pre.ranks[0].status(1), Some(RoomStatus::Failed));
    manual.advance(Duration::from_secs(9));
    pre.ranks[0].poll();
    assert_eq!(
        pre.ranks[0].status(1),
        Some(RoomStatus::Failed),
        "at twice the timeout"
    );
    manual.advance(Duration::from_secs(1));
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].status(1), None, "forgotten");
    assert_eq!(
        pre.ranks[0].status(2),
        Some(RoomStatus::Failed),
        "the engine's own room"
    );
}

/// A decode that holds the prompt's first tokens (its radix cache) names them with its
/// room; the prefill learns the prefix before it sizes the room, and sends only the pages
/// after it.
#[test]
fn the_decodes_prefix_reaches_the_prefill_before_it_sizes_the_room() {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill(&s, "pn20", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "pn20", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room_after_prefix(1, ("127.0.0.1", port), vec![5, 6], None, vec![], 8);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].requested_rooms() == [1]
    });
    assert_eq!(pre.ranks[0].decode_prefix(1), Some(8));
    assert_eq!(
        pre.ranks[0].decode_prefix(2),
        None,
        "a room nobody asked for"
    );
    pre.ranks[0].add_room(1, 2, None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    pre.ranks[0].send(1, &[1, 2]).expect("send");
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    dec.mem[0].kv.verify(&[(1, 5), (2, 6)]).expect("bytes");
}
