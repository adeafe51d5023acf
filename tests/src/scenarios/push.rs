//! Push-connector scenarios, generic over the transport: bytes verified (KV, aux, state) or
//! a failure path checked, each able to fail. Run on the loopback by `tests/push.rs` and on
//! NIXL by `tests/nixl.rs`.

use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::push::{RoomStatus, Rooms, StateKind};
use kvxfer_layout::{BlockOrder, Dtype};

use crate::conformance::TransportFactory;
use crate::faulty::WithFaults;
use crate::pull_env::Model;
use crate::push_env::{
    Setup, decode_on, poll_until, prefill_on, run_room, run_room_sending, settled,
};
use crate::scenarios::pull::clock;

/// One room `src` → `dst` through a deployment; checks every decode byte and aux item.
pub fn roundtrip<F: TransportFactory>(f: &F, s: &Setup, name: &str, chunk: usize) {
    let c = clock();
    let mut pre = prefill_on(f, s, name, Arc::clone(&c), None, None);
    let mut dec = decode_on(f, s, name, c);
    let (src, dst) = ([2u32, 3, 4, 9, 10], [0u32, 5, 6, 7, 1]);
    let statuses = run_room(
        &mut pre,
        &mut dec,
        42,
        &src,
        &dst,
        chunk,
        Some((3, 6)),
        (vec![], vec![]),
    );
    for (r, st) in statuses.iter().enumerate() {
        assert_eq!(
            *st,
            RoomStatus::Success,
            "{name}: decode rank {r}: {:?}",
            dec.ranks[r].error(42)
        );
    }
    for p in &pre.ranks {
        assert_eq!(
            p.status(42),
            Some(RoomStatus::Success),
            "{name}: prefill {:?}",
            p.error(42)
        );
    }
    let pairs: Vec<(u32, u32)> = src.iter().copied().zip(dst.iter().copied()).collect();
    for (r, m) in dec.mem.iter().enumerate() {
        if let Err(e) = m.kv.verify(&pairs) {
            panic!("{name}: decode rank {r}: {e}");
        }
        assert!(m.aux.holds(6, 3), "{name}: aux item on decode rank {r}");
        assert!(m.aux.untouched(5));
    }
}

/// One room in chunks and whole, with an aux item.
pub fn single_room_chunked_with_aux<F: TransportFactory>(f: &F) {
    roundtrip(
        f,
        &Setup::new(Model::small(BlockOrder::Nhd, 4), 1, 1),
        "one",
        2,
    );
    roundtrip(
        f,
        &Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1),
        "one-whole",
        100,
    );
}

/// Heterogeneous TP both ways, head replication both ways, MLA.
pub fn heterogeneous_tp_replication_and_mla<F: TransportFactory>(f: &F) {
    for (p, d) in [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)] {
        roundtrip(
            f,
            &Setup::new(Model::small(BlockOrder::Nhd, 4), p, d),
            &format!("tp{p}x{d}"),
            2,
        );
    }
    roundtrip(
        f,
        &Setup::new(Model::small(BlockOrder::Nhd, 2), 1, 4),
        "repl",
        3,
    );
    roundtrip(
        f,
        &Setup::new(Model::small(BlockOrder::Hnd, 2), 4, 1),
        "repl-p",
        3,
    );
    for (p, d) in [(1, 1), (2, 1), (1, 2)] {
        roundtrip(
            f,
            &Setup::new(Model::mla(), p, d),
            &format!("mla{p}x{d}"),
            2,
        );
    }
}

/// Each chunk sent layer by layer (`send_layers`, as an engine streams layers while it
/// computes): rooms complete, bytes and aux land, across TP, pipeline stages and MLA; a
/// room is not complete before its last page's last layer went out.
pub fn layer_by_layer_sends_complete_rooms<F: TransportFactory>(f: &F) {
    let mut model = Model::small(BlockOrder::Nhd, 4);
    model.layers = 3;
    let mut staged = Setup::new(model, 2, 1);
    staged.stages = vec![2, 1];
    // Content digests: taken with the chunk that completes its pages, over every layer.
    let mut digested = Setup::new(model, 2, 2);
    digested.decode_config = crate::scenarios::push_digest::digests_on;
    let setups = [
        (Setup::new(model, 1, 1), "layers"),
        (Setup::new(model, 1, 2), "layers-tp1x2"),
        (staged, "layers-pp"),
        (Setup::new(Model::mla(), 2, 1), "layers-mla"),
        (digested, "layers-digest"),
    ];
    for (s, name) in setups {
        let c = clock();
        let mut pre = prefill_on(f, &s, name, Arc::clone(&c), None, None);
        let mut dec = decode_on(f, &s, name, c);
        let (src, dst) = ([2u32, 3, 4, 9, 10], [0u32, 5, 6, 7, 1]);
        let mut by_layer = |p: &mut kvxfer_core::push::PushPrefill<_>, room: u64, src: &[u32]| {
            let layers = p.rank_info().num_layers;
            src.chunks(2).all(|part| {
                (0..layers).all(|l| {
                    let last = l + 1 == layers;
                    let sent = p.send_layers(room, part, l..l + 1, last).is_ok();
                    // Until its last layer, a chunk's pages do not count as sent.
                    sent && (last || p.status(room) != Some(RoomStatus::Success))
                })
            })
        };
        let statuses = run_room_sending(
            &mut pre,
            &mut dec,
            42,
            &src,
            &dst,
            &mut by_layer,
            Some((3, 6)),
            (vec![], vec![]),
        );
        assert!(
            statuses.iter().all(|s| *s == RoomStatus::Success),
            "{name}: {statuses:?} {:?}",
            dec.ranks[0].error(42)
        );
        let pairs: Vec<(u32, u32)> = src.iter().copied().zip(dst.iter().copied()).collect();
        for (r, m) in dec.mem.iter().enumerate() {
            if let Err(e) = m.kv.verify(&pairs) {
                panic!("{name}: decode rank {r}: {e}");
            }
            assert!(m.aux.holds(6, 3), "{name}: aux item on decode rank {r}");
        }
        if name == "layers-digest" {
            for d in &mut dec.ranks {
                let m = d.take_metrics();
                assert_eq!((m.verified_rooms, m.digest_mismatches), (1, 0));
            }
        }
        // One WRITE per layer and chunk (3 chunks) to each decode rank it writes to, and the
        // aux item where it is the last stage's lead writer.
        let p0 = &mut pre.ranks[0];
        let layers = u64::from(p0.rank_info().num_layers);
        let transfers = p0.take_metrics().transfers;
        assert!(transfers >= 3 * layers, "{name}: {transfers}");
        if name == "layers" {
            assert_eq!(transfers, 3 * layers + 1);
        }
    }
}

/// Prefill pipeline stages (uneven split, TP × PP, MLA) write into one decode cache.
pub fn pipeline_stages_including_an_uneven_split<F: TransportFactory>(f: &F) {
    let mut model = Model::small(BlockOrder::Nhd, 4);
    model.layers = 3;
    let mut s = Setup::new(model, 1, 1);
    s.stages = vec![1, 2];
    roundtrip(f, &s, "pp-uneven", 2);
    let mut s = Setup::new(model, 2, 1);
    s.stages = vec![2, 1];
    roundtrip(f, &s, "pp-tp", 5);
    let mut mla = Model::mla();
    mla.layers = 3;
    let mut s = Setup::new(mla, 1, 1);
    s.stages = vec![2, 1];
    roundtrip(f, &s, "pp-mla", 1);
}

/// Six rooms in flight at once on TP 2:2, two chunks each.
pub fn many_rooms_concurrently<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 2, 2);
    let c = clock();
    let mut pre = prefill_on(f, &s, "many", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "many", c);
    let port = pre.registry.port();
    for room in 0..6u64 {
        let dst = vec![2 * room as u32, 2 * room as u32 + 1];
        for d in &mut dec.ranks {
            d.add_room(
                room,
                ("127.0.0.1", port),
                dst.clone(),
                Some(room as u32),
                vec![],
            );
        }
        for p in &mut pre.ranks {
            p.add_room(room, 2, Some(room as u32), vec![]);
        }
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks
            .iter()
            .all(|p| (0..6).all(|r| p.status(r) == Some(RoomStatus::WaitingForInput)))
    });
    for room in 0..6u64 {
        for p in &mut pre.ranks {
            p.send(room, &[room as u32 + 1]).expect("chunk 1");
            p.send(room, &[room as u32 + 8]).expect("chunk 2");
        }
    }
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks
            .iter()
            .all(|d| (0..6).all(|r| d.status(r) == Some(RoomStatus::Success)))
    });
    let pairs: Vec<(u32, u32)> = (0..6u32)
        .flat_map(|r| [(r + 1, 2 * r), (r + 8, 2 * r + 1)])
        .collect();
    for m in &dec.mem {
        m.kv.verify(&pairs).expect("bytes");
        assert!((0..6).all(|r| m.aux.holds(r, r)));
    }
}

/// Mamba and sliding-window state items travel with the last chunk.
pub fn mamba_and_window_state<F: TransportFactory>(f: &F) {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.state = 2;
    s.state_kind = StateKind::Mamba;
    let c = clock();
    let mut pre = prefill_on(f, &s, "mamba", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "mamba", Arc::clone(&c));
    let st = run_room(
        &mut pre,
        &mut dec,
        1,
        &[1],
        &[2],
        1,
        Some((0, 0)),
        (vec![5], vec![3]),
    );
    assert_eq!(st, vec![RoomStatus::Success]);
    assert!(dec.mem[0].state.holds(3, 5));
    assert!(dec.mem[0].state.untouched(5));
    drop((pre, dec));
    s.state_kind = StateKind::Window;
    let mut pre = prefill_on(f, &s, "window", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "window", c);
    let st = run_room(
        &mut pre,
        &mut dec,
        1,
        &[1, 2],
        &[3, 4],
        1,
        Some((0, 0)),
        (vec![1, 2], vec![6, 7]),
    );
    assert_eq!(st, vec![RoomStatus::Success]);
    assert!(dec.mem[0].state.holds(6, 1) && dec.mem[0].state.holds(7, 2));
}

/// A prefill rank no decode rank needs completes without writing.
pub fn dummy_ranks_complete_without_data<F: TransportFactory>(f: &F) {
    // MLA from 2 prefill ranks into 1 decode rank: prefill rank 1 is a dummy destination.
    let s = Setup::new(Model::mla(), 2, 1);
    let c = clock();
    let mut pre = prefill_on(f, &s, "dummy", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "dummy", c);
    let st = run_room(
        &mut pre,
        &mut dec,
        9,
        &[1, 2],
        &[3, 4],
        1,
        Some((1, 1)),
        (vec![], vec![]),
    );
    assert_eq!(st, vec![RoomStatus::Success]);
    assert_eq!(
        pre.ranks[1].status(9),
        Some(RoomStatus::Success),
        "dummy rank completes"
    );
    assert_eq!(
        pre.ranks[1].take_metrics().transfers,
        0,
        "dummy rank sent nothing"
    );
    assert!(
        pre.ranks[0].take_metrics().transfers > 0,
        "the real rank wrote"
    );
}

/// A room waits while the registry lacks ranks and proceeds once all registered.
pub fn registry_not_ready_then_ready<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 2, 1);
    let c = clock();
    // Only rank 0 registers at first.
    let partial = prefill_on(f, &s, "late", Arc::clone(&c), None, Some(1));
    let mut dec = decode_on(f, &s, "late", Arc::clone(&c));
    let port = partial.registry.port();
    dec.ranks[0].add_room(5, ("127.0.0.1", port), vec![1], None, vec![]);
    for _ in 0..50 {
        dec.ranks[0].poll();
        assert_eq!(dec.ranks[0].status(5), Some(RoomStatus::Bootstrapping));
        std::thread::sleep(Duration::from_millis(2));
    }
    // The full prefill registers with the same registry; the waiting room proceeds.
    let mut pre = partial;
    let registry = std::mem::replace(
        &mut pre.registry,
        kvxfer_core::push::BootstrapRegistry::bind("127.0.0.1", 0).unwrap(),
    );
    let mut full = prefill_on(f, &s, "late-full", c, Some(registry), None);
    drop(pre);
    for p in &mut full.ranks {
        p.add_room(5, 1, None, vec![]);
    }
    poll_until(&mut full, &mut dec, |pre, _| {
        pre.ranks
            .iter()
            .all(|p| p.status(5) == Some(RoomStatus::WaitingForInput))
    });
    for p in &mut full.ranks {
        p.send(5, &[7]).unwrap();
    }
    poll_until(&mut full, &mut dec, |_, dec| {
        dec.ranks[0].status(5) == Some(RoomStatus::Success)
    });
    dec.mem[0].kv.verify(&[(7, 1)]).expect("bytes");
}

/// A decode with another dtype is refused, naming it.
pub fn page_size_or_dtype_mismatch_is_refused<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let mut other = s.clone();
    other.model.dtype = Dtype::Bf16;
    let c = clock();
    let mut pre = prefill_on(f, &s, "mm", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &other, "mm", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![1], None, vec![]);
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::Failed)
    });
    let e = dec.ranks[0].error(1).unwrap();
    assert!(e.contains("dtype"), "{e}");
}

/// Out-of-range or repeated destinations fail the room before any byte moves.
pub fn out_of_range_destinations_are_refused_with_guards_intact<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill_on(f, &s, "oor", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "oor", c);
    for (room, dst, aux) in [
        (1u64, vec![3u32, 999], Some(0u32)),
        (2, vec![3, 3], Some(0)),
        (3, vec![3], Some(99)),
    ] {
        let port = pre.registry.port();
        dec.ranks[0].add_room(room, ("127.0.0.1", port), dst.clone(), aux, vec![]);
        pre.ranks[0].add_room(room, dst.len(), Some(0), vec![]);
        poll_until(&mut pre, &mut dec, |pre, _| {
            pre.ranks[0].status(room) == Some(RoomStatus::Failed)
        });
        assert!(
            pre.ranks[0].send(room, &[1]).is_err(),
            "send into a failed room"
        );
        let e = pre.ranks[0].error(room).unwrap();
        assert!(e.contains("out of range") || e.contains("repeat"), "{e}");
    }
    dec.mem[0].kv.verify(&[]).expect("no byte moved");
    assert!((0..8).all(|i| dec.mem[0].aux.untouched(i)));
}

/// A dead prefill fails its rooms after missed heartbeats; another prefill is unaffected.
pub fn prefill_death_fails_its_rooms_within_the_heartbeat_window<F: TransportFactory>(f: &F) {
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.decode_config = |cfg| {
        cfg.heartbeat_interval = Duration::from_secs(5);
        cfg.max_heartbeat_failures = 2;
        cfg.request_timeout = Duration::from_millis(200);
    };
    let mut doomed = prefill_on(f, &s, "doomed", Arc::clone(&c), None, None);
    let mut healthy = prefill_on(f, &s, "healthy", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "dead", c);
    let (pd, ph) = (doomed.registry.port(), healthy.registry.port());
    dec.ranks[0].add_room(1, ("127.0.0.1", pd), vec![1], None, vec![]);
    dec.ranks[0].add_room(2, ("127.0.0.1", ph), vec![2], None, vec![]);
    doomed.ranks[0].add_room(1, 1, None, vec![]);
    healthy.ranks[0].add_room(2, 1, None, vec![]);
    poll_until(&mut doomed, &mut dec, |_, dec| {
        dec.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
            && dec.ranks[0].status(2) == Some(RoomStatus::WaitingForInput)
    });
    // The doomed prefill dies (registry and ranks gone) mid-room.
    drop(doomed);
    let start = std::time::Instant::now();
    let mut advanced = Duration::ZERO;
    while dec.ranks[0].status(1) != Some(RoomStatus::Failed) {
        // One heartbeat interval, then enough real time for the probe (200 ms timeout).
        manual.advance(Duration::from_secs(5));
        advanced += Duration::from_secs(5);
        for _ in 0..60 {
            dec.ranks[0].poll();
            healthy.ranks[0].poll();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(start.elapsed() < Duration::from_secs(60));
    }
    let e = dec.ranks[0].error(1).unwrap();
    assert!(e.contains("heartbeats"), "{e}");
    // Missed heartbeats (2 needed; slack for a loaded machine), not the 300 s waiting timeout.
    assert!(
        advanced <= Duration::from_secs(60),
        "failed after {advanced:?}"
    );
    // The other prefill's room is unaffected and completes.
    assert_ne!(dec.ranks[0].status(2), Some(RoomStatus::Failed));
    healthy.ranks[0].send(2, &[4]).unwrap();
    poll_until(&mut healthy, &mut dec, |_, dec| {
        dec.ranks[0].status(2) == Some(RoomStatus::Success)
    });
}

/// A decode that never shows up and a prefill that never sends both time out.
pub fn waiting_and_bootstrap_timeouts<F: TransportFactory>(f: &F) {
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.decode_config = |cfg| cfg.waiting_timeout = Duration::from_secs(300);
    s.prefill_config = |cfg| cfg.bootstrap_timeout = Duration::from_secs(30);
    let mut pre = prefill_on(f, &s, "timeouts", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "timeouts", c);
    // Prefill room whose decode never shows up: fails after the bootstrap timeout.
    pre.ranks[0].add_room(7, 1, None, vec![]);
    manual.advance(Duration::from_secs(29));
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].status(7), Some(RoomStatus::Bootstrapping));
    manual.advance(Duration::from_secs(2));
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].status(7), Some(RoomStatus::Failed));
    // Decode room the prefill never sends: fails after the waiting timeout.
    let port = pre.registry.port();
    dec.ranks[0].add_room(8, ("127.0.0.1", port), vec![1], None, vec![]);
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(8) == Some(RoomStatus::WaitingForInput)
    });
    manual.advance(Duration::from_secs(301));
    dec.ranks[0].poll();
    assert_eq!(dec.ranks[0].status(8), Some(RoomStatus::Failed));
}

/// An abort on either side fails the room on the other.
pub fn abort_reaches_the_other_side<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill_on(f, &s, "abort", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "abort", c);
    let port = pre.registry.port();
    for room in [1u64, 2] {
        dec.ranks[0].add_room(room, ("127.0.0.1", port), vec![room as u32], None, vec![]);
        pre.ranks[0].add_room(room, 1, None, vec![]);
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        [1, 2]
            .iter()
            .all(|&r| pre.ranks[0].status(r) == Some(RoomStatus::WaitingForInput))
    });
    // Decode aborts room 1: the prefill fails it. Prefill aborts room 2: the decode fails it.
    // Through the room API both sides share (`Rooms`), as the Python binding calls it.
    for room in [1, 2] {
        assert_eq!(Rooms::error(&pre.ranks[0], room), None, "prefill {room}");
        assert_eq!(Rooms::error(&dec.ranks[0], room), None, "decode {room}");
    }
    Rooms::abort(&mut dec.ranks[0], 1);
    Rooms::abort(&mut pre.ranks[0], 2);
    poll_until(&mut pre, &mut dec, |pre, dec| {
        pre.ranks[0].status(1) == Some(RoomStatus::Failed)
            && dec.ranks[0].status(2) == Some(RoomStatus::Failed)
    });
    dec.mem[0].kv.verify(&[]).expect("nothing moved");
    for room in [1, 2] {
        assert!(
            Rooms::error(&pre.ranks[0], room).is_some(),
            "prefill {room}"
        );
        assert!(Rooms::error(&dec.ranks[0], room).is_some(), "decode {room}");
        Rooms::remove_room(&mut pre.ranks[0], room);
        Rooms::remove_room(&mut dec.ranks[0], room);
        assert_eq!(Rooms::status(&pre.ranks[0], room), None);
        assert_eq!(Rooms::status(&dec.ranks[0], room), None);
    }
}

/// A prefill restarted at the same registry address serves new rooms; the decode registers
/// with the new instance once, and a room the old instance was to fill fails as soon as a
/// bootstrap shows the restart (its liveness probes still succeed: the address answers).
pub fn restarted_prefill_at_the_same_address_serves_new_rooms<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill_on(f, &s, "restart", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "restart", Arc::clone(&c));
    assert_eq!(
        run_room(&mut pre, &mut dec, 1, &[1], &[2], 1, None, (vec![], vec![])),
        vec![RoomStatus::Success]
    );
    let port = pre.registry.port();
    // Room 10 bootstraps against the old instance, which never sends it.
    dec.ranks[0].add_room(10, ("127.0.0.1", port), vec![7], None, vec![]);
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks[0].status(10) == Some(RoomStatus::WaitingForInput)
    });
    drop(pre);
    // A new instance binds the same registry port, with new agents and memory.
    let registry = (0..100)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            kvxfer_core::push::BootstrapRegistry::bind("127.0.0.1", port).ok()
        })
        .expect("rebind the registry port");
    let mut pre2 = prefill_on(f, &s, "restart2", c, Some(registry), None);
    assert_eq!(
        run_room(
            &mut pre2,
            &mut dec,
            2,
            &[3],
            &[4],
            1,
            None,
            (vec![], vec![])
        ),
        vec![RoomStatus::Success]
    );
    assert_eq!(dec.ranks[0].status(10), Some(RoomStatus::Failed));
    let e = dec.ranks[0].error(10).unwrap();
    assert!(e.contains("restarted"), "{e}");
    // The decode registered with the new instance once, not again for each later room.
    assert_eq!(
        run_room(
            &mut pre2,
            &mut dec,
            3,
            &[5],
            &[6],
            1,
            None,
            (vec![], vec![])
        ),
        vec![RoomStatus::Success]
    );
    assert_eq!(pre2.ranks[0].take_metrics().registrations, 1);
    dec.mem[0]
        .kv
        .verify(&[(1, 2), (3, 4), (5, 6)])
        .expect("bytes from both instances");
}

/// Malformed and foreign control messages are answered with errors; serving continues.
pub fn malformed_control_messages_are_dropped_and_serving_continues<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let c = clock();
    let mut pre = prefill_on(f, &s, "junk", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "junk", c);
    let port = pre.ranks[0].port();
    let to = kvxfer_core::sidechannel::auth::Destination::mailbox(&pre.ranks[0].rank_info().agent);
    let t = Duration::from_secs(5);
    let limit = kvxfer_core::push::messages::MAX_MESSAGE_BYTES;
    for junk in [
        &b"garbage"[..],
        b"\x81\xa4kind\xa4Room",
        b"\xc1",
        &[0xdd, 0xff, 0xff, 0xff, 0xff],
    ] {
        let reply = kvxfer_core::sidechannel::request_bytes("127.0.0.1", port, &to, junk, t, limit)
            .expect("a reply");
        assert!(String::from_utf8_lossy(&reply).contains("Error"));
    }
    let foreign = kvxfer_core::push::messages::encode(
        &kvxfer_core::push::messages::ToPrefill::Room(kvxfer_core::push::messages::RoomRequest {
            room: 1,
            agent: "stranger".into(),
            pages: vec![1],
            aux_index: None,
            state_indices: vec![],
            digest: false,
            prefix_tokens: 0,
            group_pages: Vec::new(),
        }),
    );
    // A room from an agent that never registered is answered: register first.
    let reply = kvxfer_core::sidechannel::request_bytes("127.0.0.1", port, &to, &foreign, t, limit)
        .expect("reply");
    assert_eq!(
        kvxfer_core::push::messages::decode(&reply, "reply").ok(),
        Some(kvxfer_core::push::messages::FromPrefill::Unregistered)
    );
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].status(1), None, "nothing queued");
    // Real traffic still works.
    assert_eq!(
        run_room(&mut pre, &mut dec, 3, &[1], &[2], 1, None, (vec![], vec![])),
        vec![RoomStatus::Success]
    );
}

/// A decode's room request may reach the prefill before its engine adds the room (a served
/// prefill adds rooms as they are asked for): the room is listed as requested, and adding
/// it then makes it ready; the decode registering again keeps the same peer.
pub fn room_requested_before_the_engine_adds_it<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 2);
    let c = clock();
    let mut pre = prefill_on(f, &s, "asked", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "asked", Arc::clone(&c));
    let port = pre.registry.port();
    for (r, d) in dec.ranks.iter_mut().enumerate() {
        d.add_room(9, ("127.0.0.1", port), vec![r as u32 + 1], None, vec![]);
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].requested_rooms() == vec![9]
    });
    assert_eq!(pre.ranks[0].status(9), Some(RoomStatus::Bootstrapping));
    pre.ranks[0].add_room(9, 1, None, vec![]);
    assert!(pre.ranks[0].requested_rooms().is_empty());
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(9) == Some(RoomStatus::WaitingForInput)
    });
    // A second room from the same decodes (they register again per bootstrap).
    for (r, d) in dec.ranks.iter_mut().enumerate() {
        d.add_room(10, ("127.0.0.1", port), vec![r as u32 + 3], None, vec![]);
    }
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].requested_rooms() == vec![10]
    });
    pre.ranks[0].add_room(10, 1, None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(10) == Some(RoomStatus::WaitingForInput)
    });
    pre.ranks[0].send(9, &[6]).unwrap();
    pre.ranks[0].send(10, &[5]).unwrap();
    poll_until(&mut pre, &mut dec, |_, dec| {
        dec.ranks.iter().all(|d| {
            d.status(9) == Some(RoomStatus::Success) && d.status(10) == Some(RoomStatus::Success)
        })
    });
    for (r, m) in dec.mem.iter().enumerate() {
        m.kv.verify(&[(6, r as u32 + 1), (5, r as u32 + 3)])
            .expect("bytes");
    }
}

/// A room the decode aborts while the prefill's WRITEs are in flight (their completions held
/// back by the [`Faulty`](crate::faulty::Faulty) decorator) is not drained, so its pages are
/// not handed back, until the prefill released those WRITEs and acknowledged; afterwards no
/// byte changes in the decode's cache, and none outside the room's page ever did.
pub fn an_aborted_room_drains_only_after_its_writes_stopped<F: TransportFactory>(f: &F) {
    let s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    let faulty = WithFaults(f);
    let c = clock();
    let mut pre = prefill_on(&faulty, &s, "drain", Arc::clone(&c), None, None);
    let mut dec = decode_on(&faulty, &s, "drain", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], Some(2), vec![]);
    pre.ranks[0].add_room(1, 1, Some(0), vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    let faults = pre.ranks[0].transport().faults();
    faults.hold_completions(true);
    pre.ranks[0].send(1, &[3]).expect("send");
    assert_eq!(
        pre.ranks[0].transport().in_flight(),
        2,
        "KV and aux WRITEs posted"
    );
    dec.ranks[0].abort(1);
    dec.ranks[0].remove_room(1);
    for _ in 0..50 {
        dec.ranks[0].poll();
        assert!(
            !dec.ranks[0].drained(1),
            "drained while the prefill may write"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    poll_until(&mut pre, &mut dec, |_, dec| dec.ranks[0].drained(1));
    assert_eq!(
        pre.ranks[0].transport().in_flight(),
        0,
        "acknowledged before release"
    );
    let at_release = dec.mem[0].kv.mem.to_vec();
    faults.hold_completions(false);
    for _ in 0..50 {
        pre.ranks[0].poll();
        dec.ranks[0].poll();
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(
        *dec.mem[0].kv.mem == *at_release,
        "a byte landed after the room drained"
    );
    dec.mem[0]
        .kv
        .verify_except(&[], &[5])
        .expect("nothing outside the room's page");
}

/// A hybrid model's cache: layer 0 in KV cache group 0 (full attention), layer 1 in group 1
/// (sliding window), each with its own pages. On the decode the two layers overlay the same
/// memory, as vLLM lays them out; the prefill's are apart. A room names group 0's pages,
/// then group 1's (`add_room_in_groups`): each group's pages are written through its own
/// layers only, in chunks that straddle the groups, TP 1→1 and 1→2, and nothing else. A
/// decode whose groups differ from the prefill's is refused naming both; a room whose
/// counts do not add up to its pages fails naming them.
pub fn hybrid_groups_write_each_groups_pages<F: TransportFactory>(f: &F) {
    use kvxfer_core::connector::KvCache;
    fn grouped(kv: &mut KvCache) {
        kv.groups =
            Some(kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).expect("groups"));
    }
    fn overlaid(kv: &mut KvCache) {
        grouped(kv);
        // Split K/V regions [K0, V0, K1, V1]: layer 1 over layer 0's memory.
        kv.bases = vec![kv.bases[0], kv.bases[1], kv.bases[0], kv.bases[1]];
    }
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.aux = 0;
    s.prefill_kv = grouped;
    s.decode_kv = overlaid;
    // Group 0: prefill blocks 1, 2, 3 into 8, 9, 10; group 1 (layer 1): block 6 into 12.
    let (src, dst, counts) = ([1u32, 2, 3, 6], vec![8u32, 9, 10, 12], vec![3u32, 1]);
    for d in [1, 2] {
        s.d = d;
        let c = clock();
        let mut pre = prefill_on(f, &s, &format!("hyb{d}"), Arc::clone(&c), None, None);
        let mut dec = decode_on(f, &s, &format!("hyb{d}"), c);
        let port = pre.registry.port();
        for r in &mut dec.ranks {
            r.add_room_in_groups(1, ("127.0.0.1", port), dst.clone(), counts.clone(), 0);
        }
        pre.ranks[0].add_room(1, src.len(), None, vec![]);
        poll_until(&mut pre, &mut dec, |pre, _| {
            pre.ranks[0].destinations_ready(1)
        });
        assert_eq!(pre.ranks[0].decode_group_pages(1), Some(counts.clone()));
        // Chunks of 2: the second holds group 0's last page and group 1's.
        for part in src.chunks(2) {
            pre.ranks[0].send(1, part).expect("send");
        }
        poll_until(&mut pre, &mut dec, |pre, dec| settled(pre, dec, 1));
        for (r, m) in dec.mem.iter().enumerate() {
            assert_eq!(
                dec.ranks[r].status(1),
                Some(RoomStatus::Success),
                "{:?}",
                dec.ranks[r].error(1)
            );
            // Layer 0's regions hold group 0's pages of layer 0 and group 1's page of
            // layer 1; layer 1's own regions (unused by the overlay) stay untouched.
            m.kv.verify_with(&|layer, b| {
                Some(match (layer, b) {
                    (0, 8..=10) => Some((0, b - 7)),
                    (0, 12) => Some((1, 6)),
                    _ => None,
                })
            })
            .unwrap_or_else(|e| panic!("tp 1x{d}, decode rank {r}: {e}"));
        }
    }
    // Counts that do not add up to the pages: the room fails, nothing is written.
    s.d = 1;
    let c = clock();
    let mut pre = prefill_on(f, &s, "hyb-sum", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "hyb-sum", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room_in_groups(2, ("127.0.0.1", port), dst.clone(), vec![3, 2], 0);
    pre.ranks[0].add_room(2, src.len(), None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, dec| settled(pre, dec, 2));
    assert_eq!(dec.ranks[0].status(2), Some(RoomStatus::Failed));
    let e = pre.ranks[0].error(2).unwrap_or_default();
    assert!(e.contains("add up to 5, the room names 4 pages"), "{e}");
    dec.mem[0].kv.verify(&[]).expect("nothing written");
    // A decode of one group: its registration is refused, naming both partitions.
    s.decode_kv = |_| {};
    let c = clock();
    let mut plain = decode_on(f, &s, "hyb-plain", c);
    plain.ranks[0].add_room(3, ("127.0.0.1", port), vec![8, 9, 10, 12], None, vec![]);
    poll_until(&mut pre, &mut plain, |_, dec| {
        dec.ranks[0].status(3) == Some(RoomStatus::Failed)
    });
    let e = plain.ranks[0].error(3).unwrap_or_default();
    assert!(
        e.contains("KV cache groups differ: decode one, prefill [[0], [1]]"),
        "{e}"
    );
    plain.mem[0].kv.verify(&[]).expect("nothing written");
}

/// Mamba layers beside attention layers (Nemotron-H-style): layer 0's KV cache group holds
/// state pages (one per request, a whole block each), layer 1's attention KV; on the decode
/// both layers overlay one region. A room names the state group's page, then the attention
/// group's: the state page moves whole, the attention blocks as KV, nothing else is written.
/// A decode of another TP size is refused naming both sizes.
pub fn state_group_beside_attention_writes_whole_pages<F: TransportFactory>(f: &F) {
    use kvxfer_core::connector::KvCache;
    fn marked(kv: &mut KvCache) {
        kv.groups = Some(
            kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2)
                .and_then(|g| g.with_state(&[0]))
                .expect("groups"),
        );
    }
    fn overlaid(kv: &mut KvCache) {
        marked(kv);
        kv.bases = vec![kv.bases[0], kv.bases[0]];
    }
    let model = Model {
        kind: kvxfer_layout::CacheKind::PackedKv,
        ..Model::small(BlockOrder::Hnd, 2)
    };
    let mut s = Setup::new(model, 1, 1);
    s.aux = 0;
    s.prefill_kv = marked;
    s.decode_kv = overlaid;
    let c = clock();
    let mut pre = prefill_on(f, &s, "state", Arc::clone(&c), None, None);
    let mut dec = decode_on(f, &s, "state", Arc::clone(&c));
    let port = pre.registry.port();
    // The state page: prefill block 3 into 9; attention: blocks 5, 6 into 12, 13.
    let src = [3u32, 5, 6];
    dec.ranks[0].add_room_in_groups(1, ("127.0.0.1", port), vec![9, 12, 13], vec![1, 2], 0);
    pre.ranks[0].add_room(1, src.len(), None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, _| {
        pre.ranks[0].destinations_ready(1)
    });
    pre.ranks[0].send(1, &src).expect("send");
    poll_until(&mut pre, &mut dec, |pre, dec| settled(pre, dec, 1));
    assert_eq!(
        dec.ranks[0].status(1),
        Some(RoomStatus::Success),
        "{:?} / {:?}",
        dec.ranks[0].error(1),
        pre.ranks[0].error(1)
    );
    // The decode's one region (layer 0's): block 9 holds layer 0's page 3 whole, blocks 12
    // and 13 layer 1's blocks 5 and 6; layer 1's own memory, unused, stays untouched.
    dec.mem[0]
        .kv
        .verify_with(&|layer, b| {
            Some(match (layer, b) {
                (0, 9) => Some((0, 3)),
                (0, 12 | 13) => Some((1, b - 7)),
                _ => None,
            })
        })
        .expect("bytes");
    // A decode of TP 2: each rank's state page is its own shard, so it cannot pair.
    s.d = 2;
    let mut wide = decode_on(f, &s, "state-wide", c);
    for r in &mut wide.ranks {
        r.add_room_in_groups(2, ("127.0.0.1", port), vec![9, 12, 13], vec![1, 2], 0);
    }
    poll_until(&mut pre, &mut wide, |_, dec| {
        dec.ranks
            .iter()
            .all(|r| r.status(2) == Some(RoomStatus::Failed))
    });
    let e = wide.ranks[0].error(2).unwrap_or_default();
    assert!(
        e.contains("move between equal TP sizes only: decode 2, prefill 1"),
        "{e}"
    );
    for m in &wide.mem {
        m.kv.verify(&[]).expect("nothing written");
    }
}
