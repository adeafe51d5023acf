//! Stamped references (`kvxfer_core::pull::stamps`), generic over the transport: a decode
//! reports a load done only once the prefill's stamp table, read after the blocks,
//! confirms that the blocks were still held for that reference and that content; a
//! consumed, expired, stripped or foreign reference fails its load with its blocks.
//! Re-exported by [`super::pull`], so `pull_scenarios!` runs them on every transport.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::Transport;
use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::pull::{FailedLoad, PullConfig};
use kvxfer_layout::BlockOrder;

use super::pull::{clock, faulty_pair, first_failure, mk, no_tune};
use crate::conformance::TransportFactory;
use crate::pull_env::{Engine, Model, engine, poll_until};

/// Polls until decode rank 0 reported `req` loaded (failing the scenario if it failed) and
/// prefill rank 0 reported it free.
fn loaded_and_freed<T: Transport>(dec: &mut Engine<T>, pre: &mut Engine<T>, req: &str) {
    let (mut loaded, mut freed) = (false, false);
    poll_until(&mut [dec, pre], |i, f| {
        if i == 0 {
            assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
            loaded |= f[0].recving.iter().any(|r| r == req);
        } else {
            freed |= f[0].sending.iter().any(|r| r == req);
        }
        loaded && freed
    });
}

/// The one failure of loading `params` as `req` into `local`.
fn refused<T: Transport>(
    dec: &mut Engine<T>,
    req: &str,
    params: &kvxfer_core::wire::params::KvTransferParams,
    local: &[u32],
) -> FailedLoad {
    dec.start_load(req, params, local, 4 * local.len());
    let failed = first_failure(dec);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].req_id, req);
    assert_eq!(failed[0].invalid_blocks, local, "{failed:?}");
    failed[0].clone()
}

/// A reference read once is consumed; a foreign one (another prompt's content) and one
/// stripped of its stamp are refused; the right reference loads, verified, every time.
pub fn consumed_foreign_and_unstamped_references_fail_their_loads<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("stamp-P", &model, 1, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("stamp-D", &model, 1, false, c, &mk(f), &no_tune);
    pre.content = Some(11);
    dec.content = Some(11);
    let a = pre.finish_prefill("a", &[1, 2]);
    dec.start_load("a", &a, &[5, 6], 8);
    // The read-done note frees the hold: the reference is consumed.
    loaded_and_freed(&mut dec, &mut pre, "a");
    dec.caches[0].verify(&[(1, 5), (2, 6)]).expect("bytes");
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.verified_references, m.stale_references), (1, 0));

    let again = refused(&mut dec, "a-again", &a, &[7, 8]);
    assert!(again.reason.contains("no longer holds"), "{}", again.reason);

    let b = pre.finish_prefill("b", &[3]);
    dec.content = Some(12);
    let foreign = refused(&mut dec, "b", &b, &[9]);
    assert!(
        foreign.reason.contains("another prompt"),
        "{}",
        foreign.reason
    );
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.verified_references, m.stale_references), (0, 2));

    let d = pre.finish_prefill("d", &[4]);
    let mut stripped = d.clone();
    stripped.kvxfer_stamp = None;
    dec.content = Some(11);
    let unstamped = refused(&mut dec, "d-stripped", &stripped, &[10]);
    assert!(
        unstamped.reason.contains("no stamp"),
        "{}",
        unstamped.reason
    );
    // Refused before any READ: the hold stands, and its reference still loads.
    dec.start_load("d", &d, &[11], 4);
    loaded_and_freed(&mut dec, &mut pre, "d");
    // Block 10 untouched: the stripped reference was refused before any READ. The
    // refuted loads' blocks (7, 8, 9) were reported invalid.
    dec.caches[0]
        .verify_except(&[(1, 5), (2, 6), (4, 11)], &[7, 8, 9])
        .expect("bytes");
    assert_eq!(dec.workers[0].take_metrics().verified_references, 1);
    assert_eq!(
        dec.workers[0].stamp_reads_in_flight(),
        0,
        "scratch slots kept"
    );
}

/// A hold whose lease ran out clears its slot before its blocks are reported free: a
/// decode reading them afterwards fails.
pub fn an_expired_lease_refutes_its_reference<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let lease = |cfg: &mut PullConfig| cfg.lease = Duration::from_secs(30);
    let mut pre = engine("expiry-P", &model, 1, true, Arc::clone(&c), &mk(f), &lease);
    let mut dec = engine("expiry-D", &model, 1, false, c, &mk(f), &no_tune);
    let e = pre.finish_prefill("e", &[1, 2]);
    manual.advance(Duration::from_secs(31));
    assert_eq!(pre.poll()[0].sending, vec!["e".to_string()]);
    let late = refused(&mut dec, "e", &e, &[5, 6]);
    assert!(late.reason.contains("no longer holds"), "{}", late.reason);
    assert_eq!(dec.workers[0].take_metrics().stale_references, 1);
}

/// The read-done note travels with the stamp READ, after the data: while the data READ's
/// completion is held back, the prefill keeps the blocks (and their stamp).
pub fn the_prefill_holds_the_blocks_until_their_stamp_was_read<F: TransportFactory>(f: &F) {
    let (mut pre, mut dec) = faulty_pair(f, "order", 1);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let a = pre.finish_prefill("a", &[1, 2]);
    dec.start_load("a", &a, &[5, 6], 8);
    let start = Instant::now();
    while dec.workers[0].transport().in_flight() == 0 {
        dec.poll();
        assert!(start.elapsed() < Duration::from_secs(60), "no READ posted");
        std::thread::yield_now();
    }
    for _ in 0..50 {
        assert!(
            dec.poll()[0].recving.is_empty(),
            "reported while its READ is in flight"
        );
        assert!(
            pre.poll()[0].sending.is_empty(),
            "the prefill freed the blocks before their stamp was read"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    faults.hold_completions(false);
    loaded_and_freed(&mut dec, &mut pre, "a");
    dec.caches[0].verify(&[(1, 5), (2, 6)]).expect("bytes");
    assert_eq!(dec.workers[0].take_metrics().verified_references, 1);
}

/// A request held again (its scheduler said so twice) keeps only the new reference: the
/// old one's slot is cleared then, not left to outlive the hold.
pub fn a_request_held_again_keeps_only_its_new_reference<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("again-P", &model, 1, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("again-D", &model, 1, false, c, &mk(f), &no_tune);
    let old = pre.finish_prefill("r", &[1, 2]);
    let new = pre.finish_prefill("r", &[1, 2]);
    assert_ne!(old.kvxfer_stamp, new.kvxfer_stamp);
    let refuted = refused(&mut dec, "r-old", &old, &[5, 6]);
    assert!(
        refuted.reason.contains("no longer holds"),
        "{}",
        refuted.reason
    );
    // The refuted load's note counted as a reader: the hold ended, and the new reference
    // with it.
    poll_until(&mut [&mut pre], |_, f| {
        f[0].sending.iter().any(|r| r == "r")
    });
    let late = refused(&mut dec, "r-new", &new, &[7, 8]);
    assert!(late.reason.contains("no longer holds"), "{}", late.reason);
}
