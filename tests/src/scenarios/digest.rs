//! Content digests in pull mode (`PullConfig::digest`, `kvxfer_core::pull::digests`),
//! generic over the transport: a correct load verifies, across TP sizes that differ; a READ
//! corrupted in flight and a source changed after it was digested both fail their loads
//! with their blocks (never reported done), and a load failed in any phase gives its digest
//! scratch back; a decode with digests refuses a prefill without them. Re-exported by [`super::pull`], so `pull_scenarios!` runs them on every
//! transport.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::Transport;
use kvxfer_core::pull::{PullConfig, PullWorker};
use kvxfer_layout::{BlockOrder, Part};

use super::pull::{clock, first_failure, mk, no_tune};
use super::stamped::refused;
use crate::conformance::TransportFactory;
use crate::faulty::Faulty;
use crate::pull_env::{Engine, Model, RankCache, engine, poll_until};

fn digests_on(c: &mut PullConfig) {
    c.digest = true;
}

/// Polls until every decode rank reported `req` loaded (failing on any failure) and every
/// prefill rank freed it.
fn loaded<T: Transport>(dec: &mut Engine<T>, pre: &mut Engine<T>, req: &str) {
    let mut recv = vec![false; dec.workers.len()];
    let mut sent = vec![false; pre.workers.len()];
    let (nd, np) = (recv.len(), sent.len());
    poll_until(&mut [dec, pre], |i, f| {
        for (r, fin) in f.iter().enumerate() {
            if i == 0 {
                assert!(fin.failed.is_empty(), "{:?}", fin.failed);
                recv[r] |= fin.recving.iter().any(|x| x == req);
            } else {
                sent[r] |= fin.sending.iter().any(|x| x == req);
            }
        }
        recv.iter().all(|&x| x) && sent.iter().all(|&x| x)
    });
    assert_eq!((recv.len(), sent.len()), (nd, np));
}

/// Correct loads verify on every decode rank, whichever prefill ranks hold their heads:
/// TP 1 → 2, 2 → 1 and 2 → 2, split and joint K/V, HND and NHD.
pub fn content_digests_verify_correct_loads_across_tp_sizes<F: TransportFactory>(f: &F) {
    for (p, d, order) in [
        (1, 2, BlockOrder::Hnd),
        (2, 1, BlockOrder::Nhd),
        (2, 2, BlockOrder::Hnd),
    ] {
        let model = Model::small(order, 4);
        let name = format!("digest-tp{p}{d}{order}");
        let c = clock();
        let mk = mk(f);
        let mut pre = engine(
            &format!("{name}-P"),
            &model,
            p,
            true,
            Arc::clone(&c),
            &mk,
            &digests_on,
        );
        let mut dec = engine(&format!("{name}-D"), &model, d, false, c, &mk, &digests_on);
        let params = pre.finish_prefill("r", &[3, 4, 9]);
        dec.start_load("r", &params, &[0, 7, 8], 12);
        loaded(&mut dec, &mut pre, "r");
        for (r, cache) in dec.caches.iter().enumerate() {
            cache
                .verify(&[(3, 0), (4, 7), (9, 8)])
                .unwrap_or_else(|e| panic!("{name} rank {r}: {e}"));
        }
        for (r, w) in dec.workers.iter_mut().enumerate() {
            let m = w.take_metrics();
            assert_eq!(
                (m.verified_digests, m.digest_mismatches),
                (1, 0),
                "{name} rank {r}"
            );
            assert_eq!(
                w.digest_reads_in_flight(),
                0,
                "{name} rank {r}: scratch kept"
            );
        }
        assert!(
            pre.workers
                .iter_mut()
                .all(|w| w.take_metrics().expired_leases == 0)
        );
    }
}

/// A byte flipped in flight (the [`Faulty`] decorator corrupts what one READ landed) and a
/// byte of the prefill's block changed after it was digested both fail the load, with its
/// blocks, counted; the prefill still hears the blocks were read. A load after them verifies.
pub fn a_corrupted_read_and_a_changed_source_fail_their_loads<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let faulty = |n: &str| Faulty::new(f.create(n));
    let mut pre = engine(
        "corrupt-P",
        &model,
        1,
        true,
        Arc::clone(&c),
        &faulty,
        &digests_on,
    );
    let mut dec = engine("corrupt-D", &model, 1, false, c, &faulty, &digests_on);

    let a = pre.finish_prefill("a", &[1, 2]);
    dec.workers[0].transport().faults().corrupt_next_reads(1);
    let failed = refused(&mut dec, "a", &a, &[5, 6]);
    assert!(
        failed.reason.contains("digest mismatch"),
        "{}",
        failed.reason
    );

    let b = pre.finish_prefill("b", &[3]);
    // The source changes after the hold digested it (a kernel still writing, a reuse).
    let (region, range) = pre.caches[0]
        .spec
        .head_token_range(1, Part::Value, 3, 2, 3)
        .expect("range");
    let at = u64::from(region) * pre.caches[0].spec.region_len() + range.offset;
    pre.caches[0].mem[at as usize] ^= 0x80;
    let failed = refused(&mut dec, "b", &b, &[7]);
    assert!(failed.reason.contains("head 3"), "{}", failed.reason);
    pre.caches[0].mem[at as usize] ^= 0x80;

    let m = dec.workers[0].take_metrics();
    assert_eq!((m.verified_digests, m.digest_mismatches), (0, 2));
    // Both holds ended by the decode's read-done notes, not by their leases.
    let mut freed = Vec::new();
    poll_until(&mut [&mut pre], |_, f| {
        freed.extend(f[0].sending.clone());
        freed.len() == 2
    });
    freed.sort();
    assert_eq!(freed, ["a", "b"]);

    let d = pre.finish_prefill("d", &[4]);
    dec.start_load("d", &d, &[8], 4);
    // Polled one step at a time: the step that posts the digest READ leaves its landing
    // lent (one block of 4 heads) until a later step starts the check.
    let (mut lent, mut done, mut freed) = (0, false, false);
    let start = Instant::now();
    while !(done && freed) {
        let f = dec.poll();
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        done |= f[0].recving.iter().any(|r| r == "d");
        lent = lent.max(dec.workers[0].digest_reads_in_flight());
        freed |= pre.poll()[0].sending.iter().any(|r| r == "d");
        assert!(start.elapsed() < Duration::from_secs(60), "d not loaded");
    }
    assert_eq!(lent, 4, "entries lent to the digest READ");
    // The failed loads' blocks were reported invalid; nothing else was written.
    dec.caches[0]
        .verify_except(&[(4, 8)], &[5, 6, 7])
        .expect("bytes");
    assert_eq!(dec.workers[0].take_metrics().verified_digests, 1);
    assert_eq!(dec.workers[0].digest_reads_in_flight(), 0);

    // The digest READ itself fails (the third post: data, stamp, digests): the load fails
    // once it ended, and its landing goes back.
    let e = pre.finish_prefill("e", &[5]);
    dec.workers[0].transport().faults().fail_after(2, 1, false);
    dec.start_load("e", &e, &[9], 4);
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![9]);
    assert!(
        failed[0].reason.contains("transfer failed"),
        "{}",
        failed[0].reason
    );
    assert_eq!(dec.workers[0].digest_reads_in_flight(), 0, "landing kept");

    // The digest READ's post is refused: the load fails at once, its landing given back.
    let g = pre.finish_prefill("g", &[6]);
    dec.workers[0].transport().faults().fail_after(2, 1, true);
    let failed = refused(&mut dec, "g", &g, &[10]);
    assert!(
        failed.reason.contains("reading prefill rank 0's digests"),
        "{}",
        failed.reason
    );
    assert_eq!(dec.workers[0].digest_reads_in_flight(), 0, "landing kept");

    // The prefill is lost while the digest READ's landing is lent: the load fails with its
    // blocks, and the landing goes back.
    let h = pre.finish_prefill("h", &[7]);
    dec.start_load("h", &h, &[11], 4);
    let start = Instant::now();
    while dec.workers[0].digest_reads_in_flight() == 0 {
        let f = dec.poll();
        assert!(
            f[0].recving.is_empty(),
            "h ended before its digest READ: {f:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(60), "no digest READ");
    }
    dec.workers[0].engine_lost("corrupt-P", "restarted");
    let failed = first_failure(&mut dec);
    assert_eq!(failed[0].invalid_blocks, vec![11]);
    assert!(failed[0].reason.contains("lost"), "{}", failed[0].reason);
    assert_eq!(dec.workers[0].digest_reads_in_flight(), 0, "landing kept");
}

/// A decode with digests refuses a prefill that publishes none, before any READ; a worker
/// asked for digests without stamped references refuses to start.
pub fn a_decode_with_digests_refuses_a_prefill_without_them<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine(
        "nodigest-P",
        &model,
        1,
        true,
        Arc::clone(&c),
        &mk(f),
        &no_tune,
    );
    let mut dec = engine(
        "nodigest-D",
        &model,
        1,
        false,
        Arc::clone(&c),
        &mk(f),
        &digests_on,
    );
    let a = pre.finish_prefill("a", &[1]);
    dec.start_load("a", &a, &[5], 4);
    let failed = first_failure(&mut dec);
    assert!(
        failed[0].reason.contains("publishes no content digests"),
        "{}",
        failed[0].reason
    );
    dec.caches[0].verify(&[]).expect("nothing read");

    let cache = RankCache::new(model.spec(4), 0, false);
    let mut cfg = PullConfig::new("nodigest-U", 0, 1);
    (cfg.side_channel_port, cfg.digest, cfg.stamp_references) = (0, true, false);
    let refused = PullWorker::new(f.create("nodigest-U"), cfg, model.kv_cache(&cache), c);
    let why = refused.err().expect("refused").to_string();
    assert!(why.contains("stamped references"), "{why}");
}
