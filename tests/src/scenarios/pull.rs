//! Pull-connector scenarios, generic over the transport: each moves real bytes (verified
//! against the prefill's identity-filled cache) or checks a failure path, and each can fail.
//! Run on the loopback by `tests/pull.rs` (and by `tests/pull_prepared.rs` on loopback agents
//! that prefer prepared lists), on UCX by `tests/ucx.rs` and on NIXL by `tests/nixl.rs`.
//! Held completions and failing posts come from the [`Faulty`] decorator, over any
//! transport; scenarios that need a vanishing peer stay with the loopback.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::Transport;
use kvxfer_core::clock::{Clock, ManualClock, SystemClock};
use kvxfer_core::pull::{FailedLoad, Finished, FinishedAggregator, LocalAggregator, PullConfig};
use kvxfer_layout::{BlockOrder, Dtype};

use crate::conformance::TransportFactory;
use crate::faulty::{Faulty, REFUSED};
use crate::pull_env::{Engine, Model, engine, poll_until};

pub use super::digest::{
    a_corrupted_read_and_a_changed_source_fail_their_loads,
    a_decode_with_digests_refuses_a_prefill_without_them,
    content_digests_verify_correct_loads_across_tp_sizes,
};
pub use super::stamped::{
    a_reference_never_held_fails_at_the_transfer_timeout,
    a_reference_read_before_its_hold_started_loads_once_it_starts,
    a_request_held_again_keeps_only_its_new_reference, an_expired_lease_refutes_its_reference,
    an_unsent_read_done_note_is_counted_and_the_blocks_stay_held,
    consumed_foreign_and_unstamped_references_fail_their_loads,
    the_prefill_holds_the_blocks_until_their_stamp_was_read,
};

/// The factory as the maker `engine` takes.
pub fn mk<F: TransportFactory>(f: &F) -> impl Fn(&str) -> F::T + '_ {
    move |name| f.create(name)
}

/// Leaves the configuration as it is.
pub fn no_tune(_: &mut PullConfig) {}

/// A clock that follows real time.
pub fn clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock::default())
}

/// Polls decode rank 0 until a load fails; returns the failures of that step.
pub fn first_failure<T: Transport>(dec: &mut Engine<T>) -> Vec<FailedLoad> {
    let mut failed = Vec::new();
    poll_until(&mut [dec], |_, f| {
        failed.extend(f[0].failed.clone());
        !failed.is_empty()
    });
    failed
}

/// Runs one request prefill(p) -> decode(d) and checks bytes on every decode rank and that
/// every prefill rank freed the request.
pub fn pull_roundtrip<F: TransportFactory>(f: &F, model: Model, p: u32, d: u32, name: &str) {
    let c = clock();
    let mut pre = engine(
        &format!("{name}-P"),
        &model,
        p,
        true,
        Arc::clone(&c),
        &mk(f),
        &no_tune,
    );
    let mut dec = engine(&format!("{name}-D"), &model, d, false, c, &mk(f), &no_tune);
    let remote = [3u32, 4, 9];
    let local = [0u32, 7, 8];
    let params = pre.finish_prefill("req-1", &remote);
    dec.start_load("req-1", &params, &local, 12);
    let mut recv_done = vec![false; d as usize];
    let mut send_done = vec![false; p as usize];
    let mut failures: Vec<FailedLoad> = Vec::new();
    poll_until_pair(
        &mut dec,
        &mut pre,
        &mut recv_done,
        &mut send_done,
        &mut failures,
    );
    assert!(failures.is_empty(), "{failures:?}");
    let pairs: Vec<(u32, u32)> = remote.iter().copied().zip(local.iter().copied()).collect();
    for (r, cache) in dec.caches.iter().enumerate() {
        if let Err(e) = cache.verify(&pairs) {
            panic!("decode rank {r} of {name}: {e}");
        }
    }
}

/// Polls both engines until every decode rank reported the request received and every
/// prefill rank reported it sent (60 s hang guard).
pub fn poll_until_pair<T: Transport>(
    dec: &mut Engine<T>,
    pre: &mut Engine<T>,
    recv_done: &mut [bool],
    send_done: &mut [bool],
    failures: &mut Vec<FailedLoad>,
) {
    let start = std::time::Instant::now();
    while !(recv_done.iter().all(|&x| x) && send_done.iter().all(|&x| x)) {
        for (r, f) in dec.poll().into_iter().enumerate() {
            if !f.recving.is_empty() {
                recv_done[r] = true;
            }
            failures.extend(f.failed);
        }
        for (r, f) in pre.poll().into_iter().enumerate() {
            if !f.sending.is_empty() {
                send_done[r] = true;
            }
        }
        assert!(
            start.elapsed().as_secs() < 60,
            "recv {recv_done:?} send {send_done:?}"
        );
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Every (decode TP, prefill TP) pair in both block orders moves the right head slices.
pub fn tp_combinations_move_the_right_bytes<F: TransportFactory>(f: &F) {
    // (decode TP, prefill TP) as the reference tests them, plus prefill TP > decode TP.
    for (d, p) in [(1, 1), (2, 1), (4, 2), (4, 4), (2, 4), (1, 2)] {
        for order in [BlockOrder::Hnd, BlockOrder::Nhd] {
            pull_roundtrip(
                f,
                Model::small(order, 4),
                p,
                d,
                &format!("tp{d}x{p}{order:?}"),
            );
        }
    }
}

/// Fewer KV heads than ranks (replication both ways), MLA, joint K/V, and packed K/V (vLLM's
/// CPU cache) split across decode ranks and gathered from prefill ranks; Mamba state pages
/// rank to rank.
pub fn replicated_heads_and_mla<F: TransportFactory>(f: &F) {
    // 2 KV heads on 4 decode ranks: source heads [0, 0, 1, 1].
    pull_roundtrip(f, Model::small(BlockOrder::Hnd, 2), 1, 4, "repl");
    // 2 heads on 4 prefill ranks into 1 decode rank: two ranks are notify-only.
    pull_roundtrip(f, Model::small(BlockOrder::Nhd, 2), 4, 1, "repl-p");
    for (d, p) in [(1, 1), (2, 1), (1, 2)] {
        pull_roundtrip(f, Model::mla(), p, d, &format!("mla{d}x{p}"));
    }
    let mut joint = Model::small(BlockOrder::Hnd, 4);
    joint.kind = kvxfer_layout::CacheKind::JointKv;
    pull_roundtrip(f, joint, 1, 2, "joint");
    let mut packed = Model::small(BlockOrder::Hnd, 4);
    packed.kind = kvxfer_layout::CacheKind::PackedKv;
    pull_roundtrip(f, packed, 1, 2, "packed");
    pull_roundtrip(f, packed, 2, 1, "packed-p");
    let mut cross = Model::small(BlockOrder::Hnd, 4);
    cross.kind = kvxfer_layout::CacheKind::CrossLayer;
    pull_roundtrip(f, cross, 1, 2, "cross");
    pull_roundtrip(f, cross, 2, 1, "cross-p");
    cross.order = BlockOrder::Nhd;
    pull_roundtrip(f, cross, 1, 2, "cross-nhd");
    // State pages (Mamba) move whole, rank to rank.
    for tp in [1, 2] {
        pull_roundtrip(f, Model::state(tp), tp, tp, &format!("state{tp}"));
    }
}

/// Five requests in flight at once on TP 2:2; each reported once, when both ranks are done.
pub fn five_concurrent_requests<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("five-P", &model, 2, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("five-D", &model, 2, false, c, &mk(f), &no_tune);
    let mut expected = Vec::new();
    for i in 0..5u32 {
        let remote = [i, i + 5];
        let local = [2 * i, 2 * i + 1];
        let params = pre.finish_prefill(&format!("r{i}"), &remote);
        dec.start_load(&format!("r{i}"), &params, &local, 8);
        expected.push((remote, local));
    }
    let mut recv: HashSet<(usize, String)> = HashSet::new();
    let mut sent: HashSet<(usize, String)> = HashSet::new();
    // Rank 0 reports a request only once both decode ranks finished it.
    let mut agg = LocalAggregator::new(2);
    let mut engine_done: Vec<String> = Vec::new();
    poll_until(&mut [&mut dec], |_, f| {
        for (r, x) in f.iter().enumerate() {
            assert!(x.failed.is_empty(), "{:?}", x.failed);
            recv.extend(x.recving.iter().map(|id| (r, id.clone())));
            engine_done.extend(agg.submit(r as u32, x.recving.clone()));
        }
        recv.len() == 10
    });
    engine_done.sort();
    assert_eq!(
        engine_done,
        (0..5).map(|i| format!("r{i}")).collect::<Vec<_>>()
    );
    let mut stats = kvxfer_core::pull::PullMetrics::default();
    for w in &mut dec.workers {
        stats.merge(&w.take_metrics());
    }
    assert_eq!(stats.transfers, 10, "5 requests x 2 ranks");
    poll_until(&mut [&mut pre], |_, f| {
        for (r, x) in f.iter().enumerate() {
            sent.extend(x.sending.iter().map(|id| (r, id.clone())));
        }
        sent.len() == 10
    });
    let pairs: Vec<(u32, u32)> = expected
        .iter()
        .flat_map(|(r, l)| r.iter().copied().zip(l.iter().copied()))
        .collect();
    for cache in &dec.caches {
        cache.verify(&pairs).expect("bytes");
    }
}

/// A full prefix hit only notifies the prefill, and is not reported (the engine did not wait
/// for it); a partial hit reads only the tail.
pub fn full_prefix_hit_only_notifies_and_partial_hit_reads_the_tail<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Nhd, 4);
    let c = clock();
    let mut pre = engine(
        "prefix-P",
        &model,
        1,
        true,
        Arc::clone(&c),
        &mk(f),
        &no_tune,
    );
    let mut dec = engine("prefix-D", &model, 1, false, c, &mk(f), &no_tune);
    let params = pre.finish_prefill("full", &[1, 2, 3]);
    dec.start_load("full", &params, &[], 0);
    let params = pre.finish_prefill("part", &[4, 5, 6]);
    dec.start_load("part", &params, &[9], 4);
    // Only the partial hit is reported: the engine never waited for the full one.
    let mut recv = HashSet::new();
    poll_until(&mut [&mut dec], |_, f| {
        recv.extend(f[0].recving.iter().cloned());
        assert!(f[0].failed.is_empty());
        recv.contains("part")
    });
    let mut sent = HashSet::new();
    poll_until(&mut [&mut pre], |_, f| {
        sent.extend(f[0].sending.iter().cloned());
        sent.len() == 2
    });
    assert!(!recv.contains("full"), "{recv:?}");
    assert!(dec.poll()[0].recving.is_empty());
    // Only the tail block 6 was read, into local block 9.
    dec.caches[0].verify(&[(6, 9)]).expect("tail read");
    let m = dec.workers[0].take_metrics();
    assert_eq!(m.transfers, 1);
    assert!(m.descriptors_posted <= m.descriptors_raw);
    assert_eq!(
        dec.workers[0].take_metrics().transfers,
        0,
        "metrics reset on read"
    );
}

/// An incompatible prefill layout is refused naming the fields; nothing is written.
pub fn layout_mismatch_is_refused_naming_fields<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut other = model;
    other.dtype = Dtype::Bf16;
    other.head_dim = 8;
    let c = clock();
    let mut pre = engine(
        "mismatch-P",
        &other,
        1,
        true,
        Arc::clone(&c),
        &mk(f),
        &no_tune,
    );
    let mut dec = engine("mismatch-D", &model, 1, false, c, &mk(f), &no_tune);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[3, 4], 8);
    let failed = first_failure(&mut dec);
    let reason = &failed[0].reason;
    assert!(
        reason.contains("dtype") && reason.contains("head dim"),
        "{reason}"
    );
    assert_eq!(failed[0].invalid_blocks, vec![3, 4]);
    dec.caches[0].verify(&[]).expect("nothing written");
}

/// A prefill that never answers fails the load with its blocks marked invalid.
pub fn handshake_failure_returns_request_with_invalid_blocks<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut dec = engine(
        "hsfail-D",
        &model,
        1,
        false,
        clock(),
        &mk(f),
        &|c: &mut PullConfig| {
            c.handshake_timeout = std::time::Duration::from_millis(200);
        },
    );
    let params = ghost_params(&[1, 2]);
    // A full prefix hit ("n": no local block) fails with it, unreported: the engine never
    // waited for it.
    dec.start_load("n", &params, &[], 0);
    dec.start_load("r", &params, &[5, 6], 8);
    let mut failed = Vec::new();
    let mut recv = Vec::new();
    poll_until(&mut [&mut dec], |_, f| {
        failed.extend(f[0].failed.clone());
        recv.extend(f[0].recving.clone());
        !failed.is_empty()
    });
    for f in dec.poll() {
        failed.extend(f.failed);
        recv.extend(f.recving);
    }
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        recv,
        vec!["r".to_string()],
        "failed request still reported finished"
    );
    assert_eq!(failed[0].invalid_blocks, vec![5, 6]);
    assert!(
        failed[0].reason.contains("handshake"),
        "{}",
        failed[0].reason
    );
    assert_eq!(dec.workers[0].take_metrics().failed_handshakes, 1);
}

/// Params naming a prefill `ghost` at a port where nothing listens: its handshake fails.
fn ghost_params(blocks: &[u32]) -> kvxfer_core::wire::params::KvTransferParams {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    kvxfer_core::wire::params::KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![blocks.to_vec()]),
        remote_engine_id: Some("ghost".into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        ..Default::default()
    }
}

/// The configured failure policy reaches the engine with each failed load, whichever it is.
pub fn failure_policy_reaches_the_report<F: TransportFactory>(f: &F) {
    use kvxfer_core::pull::FailurePolicy;
    let model = Model::small(BlockOrder::Hnd, 4);
    for policy in [FailurePolicy::Fail, FailurePolicy::Recompute] {
        let tune = move |c: &mut PullConfig| {
            c.handshake_timeout = std::time::Duration::from_millis(200);
            c.failure_policy = policy;
        };
        let mut dec = engine("policy-D", &model, 1, false, clock(), &mk(f), &tune);
        let params = ghost_params(&[1]);
        dec.start_load("r", &params, &[5], 4);
        let failed = first_failure(&mut dec);
        assert_eq!(
            (failed[0].policy, failed[0].invalid_blocks.clone()),
            (policy, vec![5])
        );
    }
}

/// Starting a load and polling return while the handshake is still unanswered.
pub fn loads_never_block_on_a_slow_handshake<F: TransportFactory>(f: &F) {
    // A side channel that answers only when the test says so (or after 10 s).
    let model = Model::small(BlockOrder::Hnd, 4);
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let port: u16 = router
        .get_last_endpoint()
        .unwrap()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    let replied = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let replied2 = Arc::clone(&replied);
    let server = std::thread::spawn(move || {
        let frames = router.recv_multipart(0).unwrap();
        let _ = gate_rx.recv_timeout(std::time::Duration::from_secs(10));
        replied2.store(true, std::sync::atomic::Ordering::SeqCst);
        router
            .send_multipart([frames[0].as_slice(), b"", b"not metadata"], 0)
            .unwrap();
    });
    let mut dec = engine("slow-D", &model, 1, false, clock(), &mk(f), &no_tune);
    let params = kvxfer_core::wire::params::KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![vec![1]]),
        remote_engine_id: Some("slow".into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        ..Default::default()
    };
    dec.start_load("r", &params, &[2], 4);
    let f = dec.poll();
    // Both calls returned while the server still withholds its reply.
    assert!(
        !replied.load(std::sync::atomic::Ordering::SeqCst),
        "start_load_kv waited for the handshake"
    );
    assert!(f[0].recving.is_empty());
    gate_tx.send(()).unwrap();
    server.join().unwrap();
    let failed = first_failure(&mut dec);
    assert!(failed[0].reason.contains("handshake"));
}

/// Blocks held for a decode that never reads are freed when the lease expires, not before.
pub fn lease_expiry_frees_held_blocks<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut pre = engine(
        "lease-P",
        &model,
        1,
        true,
        c,
        &mk(f),
        &|cfg: &mut PullConfig| {
            cfg.lease = std::time::Duration::from_secs(30);
        },
    );
    let _ = pre.finish_prefill("abandoned", &[1, 2]);
    for _ in 0..3 {
        assert!(
            pre.poll()[0].sending.is_empty(),
            "freed before the lease expired"
        );
    }
    manual.advance(std::time::Duration::from_secs(29));
    assert!(pre.poll()[0].sending.is_empty());
    manual.advance(std::time::Duration::from_secs(2));
    assert_eq!(pre.poll()[0].sending, vec!["abandoned".to_string()]);
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 1);
}

/// Mismatched attention backends are refused by default and accepted with enforcement off.
pub fn compat_enforcement_can_be_disabled<F: TransportFactory>(f: &F) {
    // Backends differ: refused by default, accepted (and transferred) with enforcement off.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine(
        "compat-P",
        &model,
        1,
        true,
        Arc::clone(&c),
        &mk(f),
        &|cfg: &mut PullConfig| {
            cfg.backend_name = "FLASHINFER".into();
        },
    );
    let mut strict = engine(
        "compat-D1",
        &model,
        1,
        false,
        Arc::clone(&c),
        &mk(f),
        &no_tune,
    );
    let params = pre.finish_prefill("a", &[1]);
    strict.start_load("a", &params, &[2], 4);
    let failed = first_failure(&mut strict);
    assert!(
        failed[0].reason.contains("attention backend"),
        "{}",
        failed[0].reason
    );
    let mut lax = engine(
        "compat-D2",
        &model,
        1,
        false,
        c,
        &mk(f),
        &|cfg: &mut PullConfig| cfg.enforce_compat = false,
    );
    let params = pre.finish_prefill("b", &[1]);
    lax.start_load("b", &params, &[2], 4);
    poll_until(&mut [&mut lax], |_, f| {
        assert!(f[0].failed.is_empty());
        !f[0].recving.is_empty()
    });
    lax.caches[0].verify(&[(1, 2)]).expect("bytes");
}

/// A load that cannot be planned fails before any byte moves.
pub fn setup_failure_returns_invalid_blocks<F: TransportFactory>(f: &F) {
    // A local block id beyond the cache cannot be planned: the load fails before any byte moves.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("setup-P", &model, 1, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("setup-D", &model, 1, false, c, &mk(f), &no_tune);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[3, 999], 8);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![3, 999]);
    assert_eq!(dec.workers[0].take_metrics().failed_setups, 1);
    dec.caches[0].verify(&[]).expect("nothing written");
}

/// An engine over `F`'s transport behind the [`Faulty`] decorator.
pub type FaultyEngine<F> = Engine<Faulty<<F as TransportFactory>::T>>;

/// A prefill of `prefill_tp` ranks and a one-rank decode (the small HND model, `name-P` and
/// `name-D`), both over `f`'s transport behind the [`Faulty`] decorator.
pub fn faulty_pair<F: TransportFactory>(
    f: &F,
    name: &str,
    prefill_tp: u32,
) -> (FaultyEngine<F>, FaultyEngine<F>) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let faulty = |n: &str| Faulty::new(f.create(n));
    let pre = engine(
        &format!("{name}-P"),
        &model,
        prefill_tp,
        true,
        Arc::clone(&c),
        &faulty,
        &no_tune,
    );
    let dec = engine(&format!("{name}-D"), &model, 1, false, c, &faulty, &no_tune);
    (pre, dec)
}

/// A load whose setup fails part-way (the READ to the second prefill rank refused after the
/// one to the first was posted) is reported failed only once the READ it posted ended: with
/// that READ's completion held back (the [`Faulty`] decorator), the load stays unreported
/// and its READ unreleased however often the engine polls; released, the load fails with
/// all its blocks, and no byte lands outside them.
pub fn a_failed_setup_is_reported_only_after_its_posted_reads_ended<F: TransportFactory>(f: &F) {
    let (mut pre, mut dec) = faulty_pair(f, "fence", 2);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    faults.fail_after(1, 1, true);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[5, 6], 8);
    let unreported = |f: &[Finished]| {
        assert!(
            f.iter()
                .all(|f| f.failed.is_empty() && f.recving.is_empty()),
            "reported while a READ may still land: {f:?}"
        );
    };
    let start = Instant::now();
    while dec.workers[0].transport().in_flight() == 0 {
        unreported(&dec.poll());
        pre.poll();
        assert!(start.elapsed() < Duration::from_secs(60), "no READ posted");
        std::thread::yield_now();
    }
    for _ in 0..50 {
        unreported(&dec.poll());
        pre.poll();
        let posted = dec.workers[0].transport().in_flight();
        assert_eq!(posted, 1, "the posted READ was released while in flight");
    }
    faults.hold_completions(false);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![5, 6]);
    assert!(failed[0].reason.contains(REFUSED), "{}", failed[0].reason);
    assert_eq!(
        dec.workers[0].transport().in_flight(),
        0,
        "the READ was not released"
    );
    dec.caches[0]
        .verify_except(&[], &[5, 6])
        .expect("nothing outside the load's blocks");
}

/// Sliding-window layers read only the blocks in their window.
pub fn per_layer_windows_move_only_the_last_blocks<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("win-P", &model, 1, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("win-D", &model, 1, false, c, &mk(f), &no_tune);
    // Rebuild decode worker 0 with layer 0 windowed to 1 block.
    let cache = &dec.caches[0];
    let kv = kvxfer_core::connector::KvCache {
        spec: cache.spec,
        bases: cache.bases(),
        memory: kvxfer_core::MemoryKind::Host,
        total_kv_heads: 4,
        total_layers: 2,
        first_layer: 0,
        layer_windows: Some(vec![Some(1), None]),
        groups: None,
    };
    let mut cfg = PullConfig::new("win-D", 0, 1);
    cfg.side_channel_port = 0;
    dec.workers.clear();
    dec.workers.push(
        kvxfer_core::pull::PullWorker::new(f.create("win-D-0b"), cfg, kv, clock()).expect("worker"),
    );
    let params = pre.finish_prefill("r", &[1, 2, 3]);
    dec.start_load("r", &params, &[4, 5, 6], 12);
    poll_until(&mut [&mut dec], |_, f| {
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        !f[0].recving.is_empty()
    });
    // Layer 1 has all three blocks, layer 0 only the last; check a byte of each.
    let m = dec.workers[0].take_metrics();
    let per_block_region = model.tokens as u64 * 4 * 4 * 2; // tokens * heads * dim * f16
    assert_eq!(
        m.bytes,
        per_block_region * 2 * (1 + 3),
        "K and V: 1 block in layer 0, 3 in layer 1"
    );
}

/// Fragmented requests go by index into per-block lists prepared at the handshake (every TP
/// slice pattern included), mostly contiguous ones as coalesced raw plans; the bytes are
/// right either way. For transports that prefer prepared lists (NIXL, or the loopback set
/// to).
pub fn fragmented_requests_post_by_index<F: TransportFactory>(f: &F) {
    for (order, p, d) in [
        (kvxfer_layout::BlockOrder::Hnd, 2, 1),
        (kvxfer_layout::BlockOrder::Nhd, 1, 2),
    ] {
        let model = Model::small(order, 4);
        let c = clock();
        let name = format!("idx-{order:?}-{p}{d}");
        let mut pre = engine(
            &format!("{name}-P"),
            &model,
            p,
            true,
            c.clone(),
            &mk(f),
            &no_tune,
        );
        let mut dec = engine(&format!("{name}-D"), &model, d, false, c, &mk(f), &no_tune);
        let mut expected = Vec::new();
        for (req, remote, local) in [
            ("scattered", vec![9u32, 2, 14], vec![1u32, 11, 5]),
            ("contiguous", vec![3, 4, 5, 6], vec![6, 7, 8, 9]),
        ] {
            let params = pre.finish_prefill(req, &remote);
            dec.start_load(req, &params, &local, 4 * remote.len());
            let mut failures = Vec::new();
            poll_until_pair(
                &mut dec,
                &mut pre,
                &mut vec![false; d as usize],
                &mut vec![false; p as usize],
                &mut failures,
            );
            assert!(failures.is_empty(), "{failures:?}");
            expected.extend(remote.iter().copied().zip(local.iter().copied()));
            let mut m = kvxfer_core::pull::PullMetrics::default();
            for w in &mut dec.workers {
                m.merge(&w.take_metrics());
            }
            let want = if req == "scattered" { m.transfers } else { 0 };
            assert_eq!(m.indexed_transfers, want, "{name} {req}: {m:?}");
        }
        for (r, cache) in dec.caches.iter().enumerate() {
            cache
                .verify(&expected)
                .unwrap_or_else(|e| panic!("{name} rank {r}: {e}"));
        }
    }
}

/// A hybrid model's cache: layer 0 in KV cache group 0 (full attention), layer 1 in group 1
/// (sliding window), each with its own block ids. On the decode the two layers share their
/// regions, as vLLM overlays them; the prefill's are apart. Each group's blocks move through
/// its own layers only, in one READ per link; a decode whose groups differ from the
/// prefill's is refused naming them.
pub fn hybrid_groups_move_each_groups_blocks<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let groups = || kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).unwrap();
    let grouped = |c: &crate::pull_env::RankCache| kvxfer_core::connector::KvCache {
        groups: Some(groups()),
        ..model.kv_cache(c)
    };
    let overlaid = |c: &crate::pull_env::RankCache| {
        let mut kv = grouped(c);
        // Split K/V regions [K0, V0, K1, V1]: layer 1 over layer 0's memory.
        kv.bases = vec![kv.bases[0], kv.bases[1], kv.bases[0], kv.bases[1]];
        kv
    };
    let mut pre = crate::pull_env::engine_with("hyb-P", &model, true, &mk(f), &grouped);
    let mut dec = crate::pull_env::engine_with("hyb-D", &model, false, &mk(f), &overlaid);
    // Group 1 (the window) holds fewer blocks than group 0; its local blocks take the tail.
    loaded_handoff(
        &mut pre,
        &mut dec,
        &[vec![1, 2, 3], vec![5, 6]],
        &[vec![8, 9, 10], vec![12]],
        12,
    );
    let m = dec.workers[0].take_metrics();
    let block = model.spec(4).block_len();
    assert_eq!(
        m.bytes,
        block * 2 * (3 + 1),
        "K and V: 3 blocks of group 0, 1 of group 1"
    );
    assert_eq!(m.transfers, 1, "all groups in one READ");
    // Decode regions 0 and 1 (K, V of the shared memory): group 0's blocks hold layer 0's
    // bytes, group 1's block layer 1's (from the prefill's regions 2 and 3); nothing else
    // was written, and layer 1's own regions stay untouched.
    let (src, dst) = (&pre.caches[0], &dec.caches[0]);
    let region = src.spec.region_len() as usize;
    let at = |r: usize, b: u32| r * region + b as usize * block as usize;
    for r in 0..4 {
        for b in 0..model.blocks {
            let got = &dst.mem[at(r, b)..at(r, b) + block as usize];
            let from = match (r, b) {
                (0 | 1, 8..=10) => Some(at(r, b - 7)),
                (0 | 1, 12) => Some(at(r + 2, 6)),
                _ => None,
            };
            match from {
                Some(s) => assert!(
                    got == &src.mem[s..s + block as usize],
                    "region {r} block {b}"
                ),
                None => assert!(
                    got.iter().all(|&x| x == crate::pull_env::GUARD),
                    "region {r} block {b} was written"
                ),
            }
        }
    }
    // A decode of one group loading from this prefill: refused, naming the groups.
    let mut plain = engine("hyb-D1", &model, 1, false, clock(), &mk(f), &no_tune);
    let (handed, local) = ([vec![4], vec![7]], [vec![1], vec![2]]);
    let failed = failed_handoff(&mut pre, &mut plain, "r2", &handed, &local, 4, None);
    assert!(
        failed
            .reason
            .contains("KV cache groups (layers of each): local one, remote [[0], [1]]"),
        "{}",
        failed.reason
    );
    assert_eq!(failed.invalid_blocks, vec![1, 2]);
    plain.caches[0].verify(&[]).expect("nothing written");
}

/// Mamba layers beside attention layers (Nemotron-H-style): layer 0's KV cache group holds
/// state pages (one per request, each a whole block: vLLM pads the state page to the
/// attention block), layer 1's attention KV; on the decode both layers share one region, as
/// vLLM overlays them. The state block moves whole and the attention blocks as KV, in one
/// READ; nothing else is written. A decode whose groups do not mark the state group is
/// refused naming both partitions, and so is a decode of another TP size.
pub fn state_beside_attention_moves_whole_pages<F: TransportFactory>(f: &F) {
    use crate::pull_env::{RankCache, engine_tp_with, engine_with};
    use kvxfer_core::connector::KvCache;
    let model = Model {
        kind: kvxfer_layout::CacheKind::PackedKv,
        ..Model::small(BlockOrder::Hnd, 2)
    };
    let groups = |state: &[u32]| {
        kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2)
            .and_then(|g| g.with_state(state))
            .unwrap()
    };
    let marked = |state: &'static [u32]| {
        move |c: &RankCache| KvCache {
            groups: Some(groups(state)),
            ..model.kv_cache(c)
        }
    };
    let overlaid = |state: &'static [u32]| {
        let kv = marked(state);
        move |c: &RankCache| {
            let mut out = kv(c);
            out.bases = vec![out.bases[0], out.bases[0]];
            out
        }
    };
    let mut pre = engine_with("mix-P", &model, true, &mk(f), &marked(&[0]));
    let mut dec = engine_with("mix-D", &model, false, &mk(f), &overlaid(&[0]));
    loaded_handoff(
        &mut pre,
        &mut dec,
        &[vec![3], vec![5, 6]],
        &[vec![9], vec![12, 13]],
        8,
    );
    let m = dec.workers[0].take_metrics();
    let block = model.spec(2).block_len();
    assert_eq!(
        m.bytes,
        block * (1 + 2),
        "one state page, two attention blocks"
    );
    assert_eq!(m.transfers, 1, "both groups in one READ");
    // The decode's one region: block 9 holds the prefill's layer-0 page of block 3 whole,
    // blocks 12 and 13 its layer-1 blocks 5 and 6; every other block keeps its guard bytes.
    let (src, dst) = (&pre.caches[0], &dec.caches[0]);
    let region = src.spec.region_len() as usize;
    let at = |r: usize, b: u32| r * region + b as usize * block as usize;
    for b in 0..model.blocks {
        let got = &dst.mem[at(0, b)..at(0, b) + block as usize];
        let from = match b {
            9 => Some(at(0, 3)),
            12 | 13 => Some(at(1, b - 7)),
            _ => None,
        };
        match from {
            Some(s) => assert!(got == &src.mem[s..s + block as usize], "block {b}"),
            None => assert!(
                got.iter().all(|&x| x == crate::pull_env::GUARD),
                "block {b} was written"
            ),
        }
    }
    // The same partition without the state mark: refused, naming both.
    let mut unmarked = engine_with("mix-D1", &model, false, &mk(f), &overlaid(&[]));
    let (handed, local) = ([vec![4], vec![7]], [vec![1], vec![2]]);
    let failed = failed_handoff(&mut pre, &mut unmarked, "r2", &handed, &local, 4, None);
    assert!(
        failed.reason.contains(
            "KV cache groups (layers of each): local [[0], [1]], remote [[0] state, [1]]"
        ),
        "{}",
        failed.reason
    );
    unmarked.caches[0].verify(&[]).expect("nothing written");
    // A decode of TP 2 (one head per rank): each rank's state page is its own shard.
    let mut wide = engine_tp_with("mix-D2", &model, 2, false, &mk(f), &overlaid(&[0]));
    let failed = failed_handoff(&mut pre, &mut wide, "r3", &handed, &local, 4, None);
    assert!(
        failed
            .reason
            .contains("state KV cache groups (Mamba) move between equal TP sizes only"),
        "{}",
        failed.reason
    );
    for c in &wide.caches {
        c.verify(&[]).expect("nothing written");
    }
}

/// A prefill whose blocks hold 4 tokens and a decode whose blocks hold 8, then the reverse:
/// the load maps token ranges. The decode already holds the first 8 tokens (a prefix hit)
/// and loads tokens 8..21; each lands at its own place in the decode's blocks with the
/// prefill's bytes for that token, nothing before token 8 or outside the listed blocks is
/// written, and a load that does not name its tokens fails cleanly, writing nothing.
pub fn a_prefill_with_another_block_size_is_read_by_token_ranges<F: TransportFactory>(f: &F) {
    use crate::pull_env::{GUARD, RankCache, element_byte, engine_with};
    let asks = kvxfer_core::wire::params::KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let (first, end) = (8u32, 21u32);
    for (name, ptok, dtok) in [("bs4-8", 4u32, 8u32), ("bs8-4", 8, 4)] {
        let pm = Model {
            tokens: ptok,
            ..Model::small(BlockOrder::Hnd, 2)
        };
        let dm = Model {
            tokens: dtok,
            ..Model::small(BlockOrder::Hnd, 2)
        };
        let pkv = |c: &RankCache| pm.kv_cache(c);
        let dkv = |c: &RankCache| dm.kv_cache(c);
        let mut pre = engine_with(&format!("{name}-P"), &pm, true, &mk(f), &pkv);
        let mut dec = engine_with(&format!("{name}-D"), &dm, false, &mk(f), &dkv);
        // Scattered ids: the prefill's blocks of tokens 0..21, the decode's of 8..21.
        let src: Vec<u32> = (0..end.div_ceil(ptok)).map(|i| 15 - 2 * i).collect();
        let dst: Vec<u32> = (first / dtok..end.div_ceil(dtok))
            .map(|i| 2 * i + 1)
            .collect();
        // The prefill hands off the blocks from token `ptok` on: its list ends at the last
        // token's block, and the decode aligns it there.
        let mut params = pre
            .scheduler
            .request_finished("r", Some(&asks), true, &[src[1..].to_vec()], None)
            .params
            .expect("params");
        let meta = pre.scheduler.build_step_meta();
        pre.workers[0].start_load_kv(&meta);
        dec.scheduler
            .after_alloc(
                "r",
                &mut params,
                std::slice::from_ref(&dst),
                (end - first) as usize,
                Some(end as usize),
                None,
            )
            .expect("after alloc");
        let meta = dec.scheduler.build_step_meta();
        dec.workers[0].start_load_kv(&meta);
        let mut failures = Vec::new();
        poll_until_pair(
            &mut dec,
            &mut pre,
            &mut [false],
            &mut [false],
            &mut failures,
        );
        assert!(failures.is_empty(), "{name}: {failures:?}");
        let d = &dec.caches[0];
        let at = |c: &RankCache, layer, part, block, t, h| {
            let (region, r) = c.spec.head_token_range(layer, part, block, t, h).unwrap();
            let start = (u64::from(region) * c.spec.region_len() + r.offset) as usize;
            start..start + r.len as usize
        };
        let mut checked = 0;
        for layer in 0..dm.layers {
            for &part in d.spec.parts() {
                for (i, &db) in dst.iter().enumerate() {
                    for t in 0..dtok {
                        let token = first + i as u32 * dtok + t;
                        for h in 0..dm.heads {
                            let got = &d.mem[at(d, layer, part, db, t, h)];
                            if token >= end {
                                continue; // past the prompt: may hold its unit's copy
                            }
                            let (pb, pt) = (src[(token / ptok) as usize], token % ptok);
                            let want: Vec<u8> = (0..got.len() as u64)
                                .map(|e| element_byte(layer, part, pb, pt, h, e))
                                .collect();
                            assert_eq!(
                                got,
                                &want[..],
                                "{name}: layer {layer} token {token} head {h}"
                            );
                            checked += 1;
                        }
                    }
                }
                // Blocks not listed: untouched.
                for b in (0..dm.blocks).filter(|b| !dst.contains(b)) {
                    for t in 0..dtok {
                        for h in 0..dm.heads {
                            let got = &d.mem[at(d, layer, part, b, t, h)];
                            assert!(got.iter().all(|&x| x == GUARD), "{name}: block {b} written");
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 2 * (end - first) * 2, "{name}");
        // The same load without its tokens: refused by name, nothing written.
        let mut plain = engine_with(&format!("{name}-E"), &dm, false, &mk(f), &dkv);
        let one = |b: &[u32]| vec![b.to_vec()];
        let failed = failed_handoff(&mut pre, &mut plain, "r2", &one(&src), &one(&dst), 13, None);
        assert!(
            failed.reason.contains("did not name"),
            "{name}: {}",
            failed.reason
        );
        assert_eq!(failed.invalid_blocks, dst);
        plain.caches[0].verify(&[]).expect("nothing written");
        // A decode with KV cache groups: token ranges cover one block table, so the
        // handshake refuses the other block size by name.
        let grouped = |c: &RankCache| kvxfer_core::connector::KvCache {
            groups: Some(kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).unwrap()),
            ..dm.kv_cache(c)
        };
        let mut hybrid = engine_with(&format!("{name}-G"), &dm, false, &mk(f), &grouped);
        let (handed, local) = ([src.clone(), Vec::new()], [dst.clone(), Vec::new()]);
        let load_end = Some(end as usize);
        let failed = failed_handoff(&mut pre, &mut hybrid, "r3", &handed, &local, 13, load_end);
        assert!(
            failed
                .reason
                .contains("with KV cache groups both sides need the same block size"),
            "{name}: {}",
            failed.reason
        );
        hybrid.caches[0].verify(&[]).expect("nothing written");
    }
}

/// Hands request `req` off from `pre` with `handed` blocks per group, starts its load into
/// `dec`'s `local` blocks (`external` tokens, ending at `load_end`) and returns its failure.
/// Hands request `r` off from `pre` (its blocks per group, `handed`) to `dec` (`local`,
/// `external` tokens) and polls both until the load ended, failing the scenario if it failed.
fn loaded_handoff<T: Transport>(
    pre: &mut Engine<T>,
    dec: &mut Engine<T>,
    handed: &[Vec<u32>],
    local: &[Vec<u32>],
    external: usize,
) {
    loaded_handoff_with(pre, dec, handed, local, external, &|_| {});
}

/// One request `r` handed off per KV cache group (`handed`: the prefill's blocks of each
/// group, `local`: the decode's; `external` tokens) and loaded, its params changed by `edit`
/// on their way to the decode (as another peer would hand them); fails the test on any
/// failure.
pub fn loaded_handoff_with<T: Transport>(
    pre: &mut Engine<T>,
    dec: &mut Engine<T>,
    handed: &[Vec<u32>],
    local: &[Vec<u32>],
    external: usize,
    edit: &dyn Fn(&mut kvxfer_core::wire::params::KvTransferParams),
) {
    let asks = kvxfer_core::wire::params::KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let decision = pre
        .scheduler
        .request_finished("r", Some(&asks), true, handed, None);
    let mut params = decision.params.expect("params");
    edit(&mut params);
    let meta = pre.scheduler.build_step_meta();
    pre.workers[0].start_load_kv(&meta);
    dec.scheduler
        .after_alloc("r", &mut params, local, external, None, None)
        .expect("after alloc");
    let meta = dec.scheduler.build_step_meta();
    dec.workers[0].start_load_kv(&meta);
    let mut failures = Vec::new();
    poll_until_pair(dec, pre, &mut [false], &mut [false], &mut failures);
    assert!(failures.is_empty(), "{failures:?}");
}

fn failed_handoff<T: Transport>(
    pre: &mut Engine<T>,
    dec: &mut Engine<T>,
    req: &str,
    handed: &[Vec<u32>],
    local: &[Vec<u32>],
    external: usize,
    load_end: Option<usize>,
) -> FailedLoad {
    let asks = kvxfer_core::wire::params::KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let mut params = pre
        .scheduler
        .request_finished(req, Some(&asks), true, handed, None)
        .params
        .expect("params");
    let meta = pre.scheduler.build_step_meta();
    pre.workers[0].start_load_kv(&meta);
    dec.scheduler
        .after_alloc(req, &mut params, local, external, load_end, None)
        .expect("after alloc");
    let meta = dec.scheduler.build_step_meta();
    dec.workers[0].start_load_kv(&meta);
    first_failure(dec).swap_remove(0)
}
