//! Pull-connector scenarios on the loopback: every one moves real bytes (verified against
//! the prefill's contents) or checks a failure path, and each can fail.

use std::collections::HashSet;
use std::sync::Arc;

use kvxfer_core::clock::{Clock, ManualClock, SystemClock};
use kvxfer_core::pull::{FailedLoad, FinishedAggregator, LocalAggregator, PullConfig};
use kvxfer_layout::{BlockOrder, Dtype};
use kvxfer_tests::pull_env::{Engine, Model, engine, poll_until};
use kvxfer_transport_loopback::LoopbackTransport;

fn lb(name: &str) -> LoopbackTransport {
    LoopbackTransport::new(name).expect("loopback")
}

fn no_tune(_: &mut PullConfig) {}

/// Polls decode rank 0 until a load fails; returns the failures of that step.
fn first_failure(dec: &mut Engine<LoopbackTransport>) -> Vec<FailedLoad> {
    let mut failed = Vec::new();
    poll_until(&mut [dec], |_, f| {
        failed.extend(f[0].failed.clone());
        !failed.is_empty()
    });
    failed
}

fn clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock::default())
}

/// Runs one request prefill(p) -> decode(d) and checks bytes on every decode rank and that
/// every prefill rank freed the request.
fn pull_roundtrip(model: Model, p: u32, d: u32, name: &str) {
    let c = clock();
    let mut pre = engine(
        &format!("{name}-P"),
        &model,
        p,
        true,
        Arc::clone(&c),
        &lb,
        &no_tune,
    );
    let mut dec = engine(&format!("{name}-D"), &model, d, false, c, &lb, &no_tune);
    let remote = [3u32, 4, 9];
    let local = [0u32, 7, 8];
    let params = pre.finish_prefill("req-1", &remote);
    dec.start_load("req-1", &params, &local, 12);
    let mut recv_done = vec![false; d as usize];
    let mut send_done = vec![false; p as usize];
    let mut failures: Vec<FailedLoad> = Vec::new();
    {
        let (a, b) = (&mut dec, &mut pre);
        poll_until_pair(a, b, &mut recv_done, &mut send_done, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:?}");
    let pairs: Vec<(u32, u32)> = remote.iter().copied().zip(local.iter().copied()).collect();
    for (r, cache) in dec.caches.iter().enumerate() {
        if let Err(e) = cache.verify(&pairs) {
            panic!("decode rank {r} of {name}: {e}");
        }
    }
}

fn poll_until_pair(
    dec: &mut Engine<LoopbackTransport>,
    pre: &mut Engine<LoopbackTransport>,
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

#[test]
fn tp_combinations_move_the_right_bytes() {
    // (decode TP, prefill TP) as the reference tests them, plus prefill TP > decode TP.
    for (d, p) in [(1, 1), (2, 1), (4, 2), (4, 4), (2, 4), (1, 2)] {
        for order in [BlockOrder::Hnd, BlockOrder::Nhd] {
            pull_roundtrip(Model::small(order, 4), p, d, &format!("tp{d}x{p}{order:?}"));
        }
    }
}

#[test]
fn replicated_heads_and_mla() {
    // 2 KV heads on 4 decode ranks: source heads [0, 0, 1, 1].
    pull_roundtrip(Model::small(BlockOrder::Hnd, 2), 1, 4, "repl");
    // 2 heads on 4 prefill ranks into 1 decode rank: two ranks are notify-only.
    pull_roundtrip(Model::small(BlockOrder::Nhd, 2), 4, 1, "repl-p");
    for (d, p) in [(1, 1), (2, 1), (1, 2)] {
        pull_roundtrip(Model::mla(), p, d, &format!("mla{d}x{p}"));
    }
    let mut joint = Model::small(BlockOrder::Hnd, 4);
    joint.kind = kvxfer_layout::CacheKind::JointKv;
    pull_roundtrip(joint, 1, 2, "joint");
}

#[test]
fn five_concurrent_requests() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("five-P", &model, 2, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("five-D", &model, 2, false, c, &lb, &no_tune);
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

#[test]
fn full_prefix_hit_only_notifies_and_partial_hit_reads_the_tail() {
    let model = Model::small(BlockOrder::Nhd, 4);
    let c = clock();
    let mut pre = engine("prefix-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("prefix-D", &model, 1, false, c, &lb, &no_tune);
    let params = pre.finish_prefill("full", &[1, 2, 3]);
    dec.start_load("full", &params, &[], 0);
    let params = pre.finish_prefill("part", &[4, 5, 6]);
    dec.start_load("part", &params, &[9], 4);
    let mut recv = HashSet::new();
    poll_until(&mut [&mut dec], |_, f| {
        recv.extend(f[0].recving.iter().cloned());
        assert!(f[0].failed.is_empty());
        recv.len() == 2
    });
    let mut sent = HashSet::new();
    poll_until(&mut [&mut pre], |_, f| {
        sent.extend(f[0].sending.iter().cloned());
        sent.len() == 2
    });
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

#[test]
fn layout_mismatch_is_refused_naming_fields() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut other = model;
    other.dtype = Dtype::Bf16;
    other.head_dim = 8;
    let c = clock();
    let mut pre = engine("mismatch-P", &other, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("mismatch-D", &model, 1, false, c, &lb, &no_tune);
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

#[test]
fn handshake_failure_returns_request_with_invalid_blocks() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let mut dec = engine(
        "hsfail-D",
        &model,
        1,
        false,
        clock(),
        &lb,
        &|c: &mut PullConfig| {
            c.handshake_timeout = std::time::Duration::from_millis(200);
        },
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let params = kvxfer_core::wire::params::KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![1, 2]),
        remote_engine_id: Some("ghost".into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        ..Default::default()
    };
    dec.start_load("r", &params, &[5, 6], 8);
    let mut failed = Vec::new();
    let mut recv = Vec::new();
    poll_until(&mut [&mut dec], |_, f| {
        failed.extend(f[0].failed.clone());
        recv.extend(f[0].recving.clone());
        !failed.is_empty()
    });
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

#[test]
fn transfer_failure_is_reported_not_done() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("xfail-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("xfail-D", &model, 1, false, c, &lb, &no_tune);
    dec.workers[0].transport().faults().fail_next_transfers(1);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![2]);
    assert_eq!(dec.workers[0].take_metrics().failed_transfers, 1);
}

#[test]
fn request_finishes_only_when_all_its_transfers_do() {
    // Prefill TP 2 into decode TP 1: two READs for one request.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("multi-P", &model, 2, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("multi-D", &model, 1, false, c, &lb, &no_tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    // Wait until both READs are posted (handshake done), still held.
    poll_until(&mut [&mut dec], |_, f| {
        assert!(f[0].recving.is_empty(), "finished while transfers are held");
        true
    });
    let start = std::time::Instant::now();
    loop {
        let f = dec.poll();
        assert!(f[0].recving.is_empty(), "finished while transfers are held");
        if dec.workers[0].transport().open_transfers() == 2 {
            break;
        }
        assert!(start.elapsed().as_secs() < 60);
        std::thread::yield_now();
    }
    for _ in 0..100 {
        assert!(dec.poll()[0].recving.is_empty());
    }
    faults.release_held();
    poll_until(&mut [&mut dec], |_, f| {
        f[0].recving == vec!["r".to_string()]
    });
    dec.caches[0].verify(&[(1, 2)]).expect("bytes");
}

#[test]
fn loads_never_block_on_a_slow_handshake() {
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
    let mut dec = engine("slow-D", &model, 1, false, clock(), &lb, &no_tune);
    let params = kvxfer_core::wire::params::KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(vec![1]),
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

#[test]
fn lease_expiry_frees_held_blocks() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut pre = engine(
        "lease-P",
        &model,
        1,
        true,
        c,
        &lb,
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

#[test]
fn shutdown_releases_exactly_what_was_created() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("shut-P", &model, 2, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("shut-D", &model, 1, false, c, &lb, &no_tune);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
    let (peers, lists, xfers, regions) = dec.workers[0].transport().resource_counts();
    assert_eq!(
        (peers, lists, xfers),
        (2, 0, 0),
        "two prefill ranks loaded, transfers released"
    );
    assert!(regions >= 1);
    dec.workers[0].shutdown();
    assert_eq!(dec.workers[0].transport().resource_counts(), (0, 0, 0, 0));
    dec.workers[0].shutdown();
    assert_eq!(
        dec.workers[0].transport().resource_counts(),
        (0, 0, 0, 0),
        "idempotent"
    );
    assert!(dec.workers[0].listener_port().is_none());
}

#[test]
fn compat_enforcement_can_be_disabled() {
    // Backends differ: refused by default, accepted (and transferred) with enforcement off.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine(
        "compat-P",
        &model,
        1,
        true,
        Arc::clone(&c),
        &lb,
        &|cfg: &mut PullConfig| {
            cfg.backend_name = "FLASHINFER".into();
        },
    );
    let mut strict = engine("compat-D1", &model, 1, false, Arc::clone(&c), &lb, &no_tune);
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
        &lb,
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

#[test]
fn setup_failure_returns_invalid_blocks() {
    // A local block id beyond the cache cannot be planned: the load fails before any byte moves.
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("setup-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("setup-D", &model, 1, false, c, &lb, &no_tune);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[3, 999], 8);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![3, 999]);
    assert_eq!(dec.workers[0].take_metrics().failed_setups, 1);
    dec.caches[0].verify(&[]).expect("nothing written");
}

#[test]
fn prefill_vanishing_mid_transfer_fails_the_load() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("vanish-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("vanish-D", &model, 1, false, c, &lb, &no_tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        assert!(dec.poll()[0].recving.is_empty());
        assert!(start.elapsed().as_secs() < 60);
    }
    pre.workers[0].transport().faults().vanish();
    faults.release_held();
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![2]);
}

#[test]
fn heartbeats_keep_the_lease_while_decode_loads() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let tune = |cfg: &mut PullConfig| {
        cfg.lease = std::time::Duration::from_secs(30);
        cfg.heartbeat_interval = std::time::Duration::from_secs(5);
        // The held READ stays pending for two minutes here: longer than the default
        // transfer timeout, which is not what this test is about.
        cfg.transfer_timeout = std::time::Duration::from_secs(600);
    };
    let mut pre = engine("hb-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("hb-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1]);
    dec.start_load("r", &params, &[2], 4);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        dec.poll();
        assert!(start.elapsed().as_secs() < 60);
    }
    // Two minutes of held transfer: heartbeats every 5 s renew the 30 s lease.
    for _ in 0..24 {
        manual.advance(std::time::Duration::from_secs(5));
        assert!(dec.poll()[0].recving.is_empty());
        // Heartbeats are delivered synchronously on the loopback.
        assert!(
            pre.poll()[0].sending.is_empty(),
            "lease expired despite heartbeats"
        );
    }
    faults.release_held();
    poll_until(&mut [&mut dec], |_, f| !f[0].recving.is_empty());
    poll_until(&mut [&mut pre], |_, f| !f[0].sending.is_empty());
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 0);
    // Without heartbeats (decode gone), the same wait expires the lease.
    let _ = pre.finish_prefill("orphan", &[3]);
    manual.advance(std::time::Duration::from_secs(31));
    assert_eq!(pre.poll()[0].sending, vec!["orphan".to_string()]);
}

#[test]
fn per_layer_windows_move_only_the_last_blocks() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("win-P", &model, 1, true, Arc::clone(&c), &lb, &no_tune);
    let mut dec = engine("win-D", &model, 1, false, c, &lb, &no_tune);
    // Rebuild decode worker 0 with layer 0 windowed to 1 block.
    let cache = &dec.caches[0];
    let kv = kvxfer_core::pull::KvCache {
        spec: cache.spec,
        bases: cache.bases(),
        memory: kvxfer_core::MemoryKind::Host,
        total_kv_heads: 4,
        total_layers: 2,
        first_layer: 0,
        layer_windows: Some(vec![Some(1), None]),
    };
    let mut cfg = PullConfig::new("win-D", 0, 1);
    cfg.side_channel_port = 0;
    dec.workers.clear();
    dec.workers.push(
        kvxfer_core::pull::PullWorker::new(lb("win-D-0b"), cfg, kv, clock()).expect("worker"),
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

/// A READ that never completes (a cut link: TCP keeps retrying) is cancelled after
/// `transfer_timeout` and its load reported failed with its blocks; not a moment before.
#[test]
fn stuck_transfer_times_out_and_fails_the_load() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let tune = |cfg: &mut PullConfig| cfg.transfer_timeout = std::time::Duration::from_secs(10);
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let mut pre = engine("stuck-P", &model, 1, true, Arc::clone(&c), &lb, &tune);
    let mut dec = engine("stuck-D", &model, 1, false, c, &lb, &tune);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("r", &[1, 2]);
    dec.start_load("r", &params, &[5, 6], 8);
    let start = std::time::Instant::now();
    while dec.workers[0].transport().open_transfers() == 0 {
        let f = dec.poll();
        assert!(f[0].recving.is_empty() && f[0].failed.is_empty());
        assert!(start.elapsed().as_secs() < 60, "the READ was never posted");
        std::thread::yield_now();
    }
    manual.advance(std::time::Duration::from_secs(9));
    for _ in 0..20 {
        let f = dec.poll();
        assert!(f[0].failed.is_empty(), "failed before the timeout");
    }
    manual.advance(std::time::Duration::from_secs(2));
    let f = dec.poll();
    assert_eq!(f[0].failed.len(), 1, "{:?}", f[0]);
    assert_eq!(f[0].failed[0].invalid_blocks, vec![5, 6]);
    assert!(
        f[0].failed[0].reason.contains("no completion"),
        "{}",
        f[0].failed[0].reason
    );
    assert_eq!(
        dec.workers[0].transport().open_transfers(),
        0,
        "the stuck READ was released"
    );
    faults.release_held();
}
