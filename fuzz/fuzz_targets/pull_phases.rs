//! The phases of one pull load after its data READs (`kvxfer_core::pull::phases`): a load
//! with up to three stamping ranks, content digests on or off, failed at posting or not;
//! then, in any order, clock steps, transfers ending or failing, digest check parts
//! ending (with a mismatch or not) and polls, each poll answering every action the machine
//! asks for (stamp and digest READs all posted, short of scratch, or failing part-way;
//! stamps that confirm, find the hold not started, or refute). The fuzz target plays the
//! driver and checks against a model: nothing lent is checked, handed back or reported while
//! a transfer is in flight; every slot and run lent comes back once; a read-done note goes
//! once, only for a rank whose stamp confirmed the hold, and (digests) only at the report;
//! a load is reported once, done only when nothing failed, every stamp confirmed the hold and
//! (digests) the check ended clean, failed only for a reason the model saw; and a load whose
//! driver keeps polling as time passes is reported, however the answers go.
#![no_main]
use std::collections::HashSet;
use std::time::Duration;

use kvxfer_core::pull::phases::{Counted, Next, Phases, Posted, Ranked};
use kvxfer_core::pull::stamps::Held;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Rank(u32);

impl Ranked for Rank {
    fn rank(&self) -> u32 {
        self.0
    }
}

const TIMEOUT: Duration = Duration::from_secs(5);

/// The driver and the model.
struct Driver {
    p: Phases<Rank, u32, u32>,
    ranks: Vec<Rank>,
    digests: bool,
    now: Duration,
    /// Transfers of the load in flight.
    busy: u32,
    /// Stamp slots and digest runs lent (ids the driver draws).
    slots: HashSet<u32>,
    runs: HashSet<u32>,
    next_id: u32,
    /// Digest check parts running.
    parts: u32,
    checked: bool,
    /// What the model saw.
    confirmed: HashSet<Rank>,
    notified: HashSet<Rank>,
    failure: bool,
    refuted: bool,
    mismatch: bool,
    setup_failed: bool,
    since: Option<Duration>,
    reported: bool,
}

impl Driver {
    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// The wait since verification began passed the timeout.
    fn timed_out(&self) -> bool {
        self.since.is_some_and(|s| self.now.saturating_sub(s) > TIMEOUT)
    }

    /// Polls: answers every action until the load waits or is reported, answers drawn from
    /// `answer`.
    fn poll(&mut self, answer: &mut impl FnMut() -> u8) {
        for _ in 0..64 {
            let busy = self.busy > 0;
            let n = self.p.next(self.now, TIMEOUT, busy);
            if self.reported {
                assert!(matches!(n, Next::Wait), "an action after the report: {n:?}");
                return;
            }
            let lent_touched = matches!(
                n,
                Next::CheckStamps(_)
                    | Next::DropStamps(_)
                    | Next::CheckDigests(_)
                    | Next::DropDigests(_)
                    | Next::Report { .. }
                    | Next::ReadStamps
                    | Next::ReadDigests
            );
            assert!(!(busy && lent_touched), "{n:?} while a transfer is in flight");
            match n {
                Next::Wait => return,
                Next::ReadStamps => {
                    self.since.get_or_insert(self.now);
                    let pending = self.p.pending().to_vec();
                    assert!(!pending.is_empty());
                    for r in &pending {
                        assert!(self.ranks.contains(r) && !self.confirmed.contains(r), "{r:?}");
                    }
                    let a = answer();
                    let posted: Posted<Vec<u32>> = match a % 3 {
                        0 => Posted::All(pending.iter().map(|_| self.id()).collect()),
                        1 => Posted::Short,
                        _ => {
                            let k = usize::from(a / 3) % (pending.len() + 1);
                            self.setup_failed = true;
                            Posted::Failed((0..k).map(|_| self.id()).collect(), "post".into())
                        }
                    };
                    if let Posted::All(s) | Posted::Failed(s, _) = &posted {
                        self.busy += s.len() as u32;
                        self.slots.extend(s.iter().copied());
                    }
                    self.p.stamps_posted(posted);
                }
                Next::CheckStamps(posted) => {
                    let mut found = Vec::new();
                    for (slot, r) in posted {
                        assert!(self.slots.remove(&slot), "slot {slot} not lent");
                        let held = match answer() % 3 {
                            0 => Ok(Held::Yes),
                            1 => Ok(Held::NotYet),
                            _ => Err("released".to_string()),
                        };
                        match &held {
                            Ok(Held::Yes) => assert!(self.confirmed.insert(r)),
                            Ok(Held::NotYet) => {}
                            Err(_) => self.refuted = true,
                        }
                        found.push((r, held));
                    }
                    self.p.stamps_checked(found);
                }
                Next::DropStamps(slots) => {
                    assert!(self.failure || self.setup_failed || self.refuted);
                    for s in slots {
                        assert!(self.slots.remove(&s), "slot {s} not lent");
                    }
                }
                Next::ReadDigests => {
                    self.since.get_or_insert(self.now);
                    assert!(self.digests && !self.refuted && !self.failure);
                    assert_eq!(self.confirmed.len(), self.ranks.len());
                    assert_eq!(self.p.confirmed().len(), self.ranks.len());
                    let a = answer();
                    let posted = match a % 3 {
                        0 => Posted::All(self.id()),
                        1 => Posted::Short,
                        _ => {
                            self.setup_failed = true;
                            Posted::Failed(self.id(), "post".into())
                        }
                    };
                    if let Posted::All(d) | Posted::Failed(d, _) = &posted {
                        self.busy += u32::from(a & 4 == 0 || matches!(posted, Posted::All(_)));
                        self.runs.insert(*d);
                    }
                    self.p.digests_posted(posted);
                }
                Next::CheckDigests(d) => {
                    assert!(self.runs.remove(&d), "run {d} not lent");
                    assert!(!self.checked, "checked twice");
                    self.checked = true;
                    self.parts = u32::from(answer() % 4);
                    self.p.checking(self.parts as usize);
                }
                Next::DropDigests(d) => {
                    assert!(self.failure || self.setup_failed);
                    assert!(self.runs.remove(&d), "run {d} not lent");
                }
                Next::Notify(ranks) => {
                    assert!(!self.digests, "with digests the notes wait for the report");
                    self.notify(&ranks);
                }
                Next::Count(c) => match c {
                    Counted::VerifiedReference => {
                        assert_eq!(self.confirmed.len(), self.ranks.len())
                    }
                    Counted::StaleReference => assert!(self.refuted || self.timed_out()),
                    Counted::VerifiedDigests => assert!(self.checked && !self.mismatch),
                    Counted::DigestMismatch => assert!(self.mismatch),
                    Counted::FailedSetup => assert!(self.setup_failed),
                },
                Next::Report { failed, notes } => {
                    assert!(self.slots.is_empty() && self.runs.is_empty(), "scratch still lent");
                    assert_eq!(self.parts, 0, "reported while the check runs");
                    self.notify(&notes);
                    self.reported = true;
                    match failed {
                        None => {
                            assert!(!self.failure && !self.setup_failed && !self.refuted);
                            assert_eq!(self.confirmed.len(), self.ranks.len());
                            assert_eq!(self.notified.len(), self.ranks.len());
                            if self.digests && !self.ranks.is_empty() {
                                assert!(self.checked && !self.mismatch);
                            }
                        }
                        Some(why) => assert!(
                            self.failure
                                || self.setup_failed
                                || self.refuted
                                || self.mismatch
                                || self.timed_out(),
                            "failed for no reason seen: {why}"
                        ),
                    }
                }
            }
        }
        panic!("64 actions in one poll");
    }

    fn notify(&mut self, ranks: &[Rank]) {
        for r in ranks {
            assert!(self.confirmed.contains(r), "{r:?} notified unconfirmed");
            assert!(self.notified.insert(*r), "{r:?} notified twice");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let ranks: Vec<Rank> = (0..u32::from(first % 4)).map(Rank).collect();
    let digests = first & 4 != 0;
    let failed = first & 8 != 0;
    let mut d = Driver {
        p: Phases::new(ranks.clone(), digests, failed.then(|| "setup".into())),
        ranks,
        digests,
        now: Duration::ZERO,
        busy: 1 + u32::from(first >> 4),
        slots: HashSet::new(),
        runs: HashSet::new(),
        next_id: 0,
        parts: 0,
        checked: false,
        confirmed: HashSet::new(),
        notified: HashSet::new(),
        failure: failed,
        refuted: false,
        mismatch: false,
        setup_failed: false,
        since: None,
        reported: false,
    };
    let mut bytes = rest.iter().copied();
    while let Some(op) = bytes.next() {
        match op % 5 {
            0 => d.now += Duration::from_secs(u64::from(op / 5 % 8)),
            1 => d.busy = 0,
            2 if d.busy > 0 => {
                d.failure = true;
                d.p.fail("transfer failed".into());
            }
            3 if d.parts > 0 => {
                d.parts -= 1;
                let mismatch = (op / 5) & 1 == 1;
                d.mismatch |= mismatch;
                assert!(d.p.part_checked(mismatch.then(|| "mismatch".into())));
            }
            4 => {
                let mut answer = || bytes.next().unwrap_or(0);
                d.poll(&mut answer);
            }
            _ => {}
        }
    }
    // Liveness: transfers end, checks end, time passes; the answers stay as the input's
    // last byte chose (all posted and confirmed, or scratch short and holds not started).
    let stubborn = data.last().copied().unwrap_or(0) & 1;
    for _ in 0..8 {
        d.busy = 0;
        while d.parts > 0 {
            d.parts -= 1;
            d.p.part_checked(None);
        }
        d.poll(&mut || stubborn);
        d.poll(&mut || stubborn);
        d.now += TIMEOUT + Duration::from_secs(1);
    }
    assert!(d.reported, "never reported");
});
