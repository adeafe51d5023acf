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
/// prefill rank 0 reported `held` free.
fn loaded_and_freed<T: Transport>(dec: &mut Engine<T>, pre: &mut Engine<T>, req: &str, held: &str) {
    let (mut loaded, mut freed) = (false, false);
    poll_until(&mut [dec, pre], |i, f| {
        if i == 0 {
            assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
            loaded |= f[0].recving.iter().any(|r| r == req);
        } else {
            freed |= f[0].sending.iter().any(|r| r == held);
        }
        loaded && freed
    });
    // Freed by the decode's read-done note, not by the lease running out.
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 0);
}

/// Polls decode rank 0 until its transport holds a posted READ.
fn until_read_posted<T: Transport>(dec: &mut Engine<crate::faulty::Faulty<T>>) {
    let start = Instant::now();
    while dec.workers[0].transport().in_flight() == 0 {
        dec.poll();
        assert!(start.elapsed() < Duration::from_secs(60), "no READ posted");
        std::thread::yield_now();
    }
}

/// Polls until decode rank 0's one load read its stamp and found the hold not started,
/// failing the scenario if a load ended.
fn awaiting_hold<T: Transport>(dec: &mut Engine<T>) {
    let start = Instant::now();
    while dec.workers[0].loads_awaiting_holds() == 0 {
        let f = dec.poll();
        assert!(
            f[0].failed.is_empty() && f[0].recving.is_empty(),
            "{:?}",
            f[0]
        );
        assert!(start.elapsed() < Duration::from_secs(60), "no stamp READ");
        std::thread::yield_now();
    }
    assert_eq!(dec.workers[0].loads_awaiting_holds(), 1);
}

/// The one failure of loading `params` as `req` into `local`.
pub(super) fn refused<T: Transport>(
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
    loaded_and_freed(&mut dec, &mut pre, "a", "a");
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
    loaded_and_freed(&mut dec, &mut pre, "d", "d");
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

/// A hold whose lease ran out releases its slot before its blocks are reported free: a
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

/// The read-done note goes only once the stamp READ, after the data, confirmed the hold: while
/// the data READ's completion is held back, the prefill keeps the blocks (and their stamp).
pub fn the_prefill_holds_the_blocks_until_their_stamp_was_read<F: TransportFactory>(f: &F) {
    let (mut pre, mut dec) = faulty_pair(f, "order", 1);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let a = pre.finish_prefill("a", &[1, 2]);
    dec.start_load("a", &a, &[5, 6], 8);
    until_read_posted(&mut dec);
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
    loaded_and_freed(&mut dec, &mut pre, "a", "a");
    dec.caches[0].verify(&[(1, 5), (2, 6)]).expect("bytes");
    assert_eq!(dec.workers[0].take_metrics().verified_references, 1);
}

/// A read-done note that cannot be sent (its send fails after the data and the stamp were
/// read): the load is still done (the stamp confirmed the blocks), the failure is counted,
/// and the prefill keeps holding the blocks (its lease frees them later).
pub fn an_unsent_read_done_note_is_counted_and_the_blocks_stay_held<F: TransportFactory>(f: &F) {
    let (mut pre, mut dec) = faulty_pair(f, "unsent", 1);
    let faults = dec.workers[0].transport().faults();
    faults.hold_completions(true);
    let a = pre.finish_prefill("a", &[1, 2]);
    dec.start_load("a", &a, &[5, 6], 8);
    until_read_posted(&mut dec);
    // Heartbeats went out with the load's start; the next notification is the note.
    faults.fail_next_notifications(1);
    faults.hold_completions(false);
    poll_until(&mut [&mut dec], |_, f| {
        assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
        f[0].recving.iter().any(|r| r == "a")
    });
    dec.caches[0].verify(&[(1, 5), (2, 6)]).expect("bytes");
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.verified_references, m.failed_notifications), (1, 1));
    for _ in 0..50 {
        assert!(
            pre.poll()[0].sending.is_empty(),
            "the prefill freed blocks whose read-done note never came"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A request held again (its scheduler said so twice) keeps only the new reference: the
/// old one's slot is released then, not left to outlive the hold.
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
    // A refuted load sends no read-done note: the new reference's hold stands.
    dec.start_load("r-new", &new, &[7, 8], 8);
    loaded_and_freed(&mut dec, &mut pre, "r-new", "r");
    dec.caches[0]
        .verify_except(&[(1, 7), (2, 8)], &[5, 6])
        .expect("bytes");
}

/// An engine answers with the reference before its next step starts the hold: a decode that
/// reads the blocks in between finds the slot not yet stamped, reads it again, and loads once
/// the hold started (the engine kept the blocks meanwhile); the prefill frees them only
/// after that.
pub fn a_reference_read_before_its_hold_started_loads_once_it_starts<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let c = clock();
    let mut pre = engine("early-P", &model, 1, true, Arc::clone(&c), &mk(f), &no_tune);
    let mut dec = engine("early-D", &model, 1, false, c, &mk(f), &no_tune);
    pre.content = Some(3);
    dec.content = Some(3);
    let (a, step) = pre.hand_out("a", &[1, 2]);
    dec.start_load("a", &a, &[5, 6], 8);
    awaiting_hold(&mut dec);
    for _ in 0..20 {
        let f = dec.poll();
        assert!(
            f[0].failed.is_empty() && f[0].recving.is_empty(),
            "{:?}",
            f[0]
        );
        assert!(
            pre.poll()[0].sending.is_empty(),
            "freed before the hold started"
        );
    }
    pre.start_step(&step);
    loaded_and_freed(&mut dec, &mut pre, "a", "a");
    dec.caches[0].verify(&[(1, 5), (2, 6)]).expect("bytes");
    let m = dec.workers[0].take_metrics();
    assert_eq!((m.verified_references, m.stale_references), (1, 0));
    assert_eq!(
        dec.workers[0].stamp_reads_in_flight(),
        0,
        "scratch slots kept"
    );
}

/// A reference whose hold never starts (forged, or from the prefill's previous incarnation)
/// fails its load at the transfer timeout, counted stale.
pub fn a_reference_never_held_fails_at_the_transfer_timeout<F: TransportFactory>(f: &F) {
    let model = Model::small(BlockOrder::Hnd, 4);
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    // The real reference's lease outlasts the test. With the default 30 s, whether it stood
    // at the end depended on the decode's heartbeats for the same request reaching the
    // prefill in time (they travel asynchronously), and an expiry reads like a free.
    let long = |cfg: &mut PullConfig| cfg.lease = Duration::from_secs(120);
    let mut pre = engine("never-P", &model, 1, true, Arc::clone(&c), &mk(f), &long);
    let mut dec = engine("never-D", &model, 1, false, c, &mk(f), &no_tune);
    let mut forged = pre.finish_prefill("a", &[1, 2]);
    let stamp = forged.kvxfer_stamp.as_mut().expect("stamp");
    *stamp += 1000;
    dec.start_load("f", &forged, &[5, 6], 8);
    awaiting_hold(&mut dec);
    // A second at a time, so that no single stamp READ is in flight for the whole timeout.
    let mut failed = Vec::new();
    let start = Instant::now();
    let mut waited = 0;
    while failed.is_empty() {
        waited += 1;
        assert!(waited <= 32, "not failed at the 30 s transfer timeout");
        manual.advance(Duration::from_secs(1));
        loop {
            failed.extend(dec.poll()[0].failed.clone());
            if dec.workers[0].stamp_reads_in_flight() == 0 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "stamp READ stuck"
            );
            std::thread::yield_now();
        }
    }
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].reason.contains("did not hold it"),
        "{}",
        failed[0].reason
    );
    assert_eq!(failed[0].invalid_blocks, vec![5, 6]);
    assert_eq!(dec.workers[0].take_metrics().stale_references, 1);
    assert_eq!(
        dec.workers[0].stamp_reads_in_flight(),
        0,
        "scratch slots kept"
    );
    // The real reference's hold was never read: it stands.
    assert!(pre.poll()[0].sending.is_empty());
}
