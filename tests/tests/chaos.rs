//! Chaos: a pull workload on the loopback with a random fault before each request — failed
//! transfers, completions held for a random while, lost and duplicated notifications — and
//! finally a prefill rank vanishing mid-transfer. Every request must end, within the hang
//! guard, either as a success whose bytes are all right or as a reported failure naming its
//! blocks; none hangs, none is reported successful with wrong bytes. The decode cache is
//! scrubbed before each request, so a stale copy cannot pass for a fresh one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::{Clock, SystemClock};
use kvxfer_core::pull::PullConfig;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::memory::Rng;
use kvxfer_tests::pull_env::{Engine, GUARD, Model, engine};
use kvxfer_transport_loopback::LoopbackTransport;

const REQUESTS: usize = 120;

fn lb(name: &str) -> LoopbackTransport {
    LoopbackTransport::new(name).expect("loopback")
}

fn distinct(rng: &mut Rng, n: usize, of: u32) -> Vec<u32> {
    let mut all: Vec<u32> = (0..of).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.range(0, i as u64) as usize);
    }
    all.truncate(n);
    all
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Success,
    Failed(Vec<u32>),
}

/// Polls both engines until request `id` ends on the decode; `release_after` polls in, held
/// completions are released.
fn run_to_end(
    dec: &mut Engine<LoopbackTransport>,
    pre: &mut Engine<LoopbackTransport>,
    id: &str,
    release_after: Option<usize>,
) -> Outcome {
    let start = Instant::now();
    let mut polls = 0usize;
    loop {
        polls += 1;
        if release_after == Some(polls) {
            dec.workers[0].transport().faults().release_held();
        }
        let f = dec.poll();
        let _ = pre.poll();
        if let Some(failed) = f[0].failed.iter().find(|l| l.req_id == id) {
            return Outcome::Failed(failed.invalid_blocks.clone());
        }
        if f[0].recving.iter().any(|r| r == id) {
            return Outcome::Success;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "request {id} neither finished nor failed within 60 s"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

#[test]
fn pull_under_random_faults() {
    let model = Model::small(BlockOrder::Hnd, 4);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let tune = |c: &mut PullConfig| {
        // Dropped read-done notifications are recovered by the lease, not by waiting.
        c.lease = Duration::from_millis(200);
    };
    let mut pre = engine("chaos-P", &model, 2, true, Arc::clone(&clock), &lb, &tune);
    let mut dec = engine("chaos-D", &model, 1, false, clock, &lb, &tune);
    let blocks = dec.caches[0].spec.num_blocks();
    let mut rng = Rng::new(2026);
    let mut counts = [0usize; 5];
    let (mut ok, mut failed) = (0, 0);
    for i in 0..REQUESTS {
        dec.caches[0].mem.fill(GUARD);
        let n = rng.range(1, 4) as usize;
        let remote = distinct(&mut rng, n, blocks);
        let local = distinct(&mut rng, n, blocks);
        let faults = dec.workers[0].transport().faults();
        let fault = rng.range(0, 4) as usize;
        counts[fault] += 1;
        let mut release_after = None;
        match fault {
            1 => faults.fail_next_transfers(rng.range(1, 2) as usize),
            2 => {
                faults.hold_completions(true);
                release_after = Some(rng.range(1, 200) as usize);
            }
            3 => faults.drop_next_notifications(1),
            4 => faults.duplicate_next_notifications(1),
            _ => {}
        }
        let id = format!("chaos-{i}");
        let params = pre.finish_prefill(&id, &remote);
        dec.start_load(&id, &params, &local, n * model.tokens as usize);
        match run_to_end(&mut dec, &mut pre, &id, release_after) {
            Outcome::Success => {
                let pairs: Vec<(u32, u32)> =
                    remote.iter().copied().zip(local.iter().copied()).collect();
                dec.caches[0]
                    .verify(&pairs)
                    .unwrap_or_else(|e| panic!("{id} (fault {fault}) reported success: {e}"));
                ok += 1;
            }
            Outcome::Failed(invalid) => {
                let mut got = invalid.clone();
                let mut want = local.clone();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "{id}: invalid blocks must be the request's");
                failed += 1;
            }
        }
        faults.fail_next_transfers(0);
        faults.release_held();
    }
    println!("chaos: {ok} succeeded, {failed} failed (reported), faults by kind {counts:?}");
    assert!(
        ok > 0 && failed > 0,
        "both outcomes exercised: {ok} ok, {failed} failed"
    );
    assert_eq!(ok + failed, REQUESTS);

    // A prefill rank vanishes while a READ is held in flight: that request fails, and so do
    // the next ones (its blocks cannot be read), each within the guard.
    dec.caches[0].mem.fill(GUARD);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let params = pre.finish_prefill("vanish-0", &[1, 2]);
    dec.start_load("vanish-0", &params, &[3, 4], 2 * model.tokens as usize);
    for _ in 0..50 {
        let _ = dec.poll();
    }
    pre.workers[1].transport().faults().vanish();
    let outcome = run_to_end(&mut dec, &mut pre, "vanish-0", Some(1));
    assert!(
        matches!(outcome, Outcome::Failed(_)),
        "vanished peer: {outcome:?}"
    );
    let params = pre.finish_prefill("vanish-1", &[5]);
    dec.start_load("vanish-1", &params, &[6], model.tokens as usize);
    let outcome = run_to_end(&mut dec, &mut pre, "vanish-1", None);
    assert!(
        matches!(outcome, Outcome::Failed(_)),
        "after the vanish: {outcome:?}"
    );
}

/// Push under random faults on the prefill (the writer): failed WRITEs, completions held for
/// a random while, lost and duplicated notifications. Every room ends on both sides; a decode
/// rank that reports success has every byte.
#[test]
fn push_under_random_faults() {
    use kvxfer_core::push::RoomStatus;
    use kvxfer_tests::push_env::{Setup, decode, prefill};

    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 2);
    // A room whose notification was lost ends by the decode's waiting timeout.
    s.decode_config = |c| c.waiting_timeout = Duration::from_millis(300);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let mut pre = prefill(&s, "chaos-push", Arc::clone(&clock), None, None);
    let mut dec = decode(&s, "chaos-push", clock);
    let port = pre.registry.port();
    let blocks = dec.mem[0].kv.spec.num_blocks();
    let mut rng = Rng::new(7);
    let (mut ok, mut failed) = (0, 0);
    for room in 0..60u64 {
        for m in &mut dec.mem {
            m.kv.mem.fill(GUARD);
        }
        let n = rng.range(1, 6) as usize;
        let src = distinct(&mut rng, n, blocks);
        let dst = distinct(&mut rng, n, blocks);
        let faults = pre.ranks[0].transport().faults();
        let mut release_after = None;
        match rng.range(0, 4) {
            1 => faults.fail_next_transfers(1),
            2 => {
                faults.hold_completions(true);
                release_after = Some(rng.range(1, 100) as usize);
            }
            3 => faults.drop_next_notifications(1),
            4 => faults.duplicate_next_notifications(1),
            _ => {}
        }
        for d in &mut dec.ranks {
            d.add_room(room, ("127.0.0.1", port), dst.clone(), None, vec![]);
        }
        pre.ranks[0].add_room(room, n, None, vec![]);
        let start = Instant::now();
        let (mut polls, mut sent) = (0usize, false);
        loop {
            polls += 1;
            if release_after == Some(polls) {
                faults.release_held();
            }
            pre.ranks[0].poll();
            for d in &mut dec.ranks {
                d.poll();
            }
            if !sent && pre.ranks[0].status(room) == Some(RoomStatus::WaitingForInput) {
                for chunk in src.chunks(2) {
                    if pre.ranks[0].send(room, chunk).is_err() {
                        break;
                    }
                }
                sent = true;
            }
            let final_everywhere = pre.ranks[0].status(room).is_some_and(RoomStatus::is_final)
                && dec
                    .ranks
                    .iter()
                    .all(|d| d.status(room).is_some_and(RoomStatus::is_final));
            if final_everywhere {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "room {room} did not end within 60 s"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        let pairs: Vec<(u32, u32)> = src.iter().copied().zip(dst.iter().copied()).collect();
        for (r, d) in dec.ranks.iter().enumerate() {
            if d.status(room) == Some(RoomStatus::Success) {
                dec.mem[r].kv.verify(&pairs).unwrap_or_else(|e| {
                    panic!("room {room} decode rank {r} reported success: {e}")
                });
                ok += 1;
            } else {
                failed += 1;
            }
        }
        faults.fail_next_transfers(0);
        faults.release_held();
        pre.ranks[0].remove_room(room);
        for d in &mut dec.ranks {
            d.remove_room(room);
        }
    }
    println!("push chaos: {ok} rank-rooms succeeded, {failed} failed (reported)");
    assert!(
        ok > 0 && failed > 0,
        "both outcomes exercised: {ok} ok, {failed} failed"
    );
}
