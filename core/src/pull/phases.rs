//! The phases of one pull load after its data READs, without I/O: the stamp READs that
//! prove the prefill held the blocks for the whole READ (read again while a hold has not
//! started), the READs of the content digests of the blocks and their check, the read-done
//! notes, and when the load is reported. [`super::PullWorker`] is the driver: it owns the
//! scratch the stamps and digests land in and does the READs and notes; each load keeps a
//! [`Phases`], asks it [`Phases::next`] whenever none of the load's transfers is in flight,
//! and answers each [`Next`]. The `pull_phases` fuzz target drives it against a model.
//!
//! What it guarantees, whatever the order of events and answers (#38, no wrong KV):
//! - nothing lent to a READ (a stamp slot, a digest run) is checked, handed back or reported
//!   while a transfer of the load is in flight: the driver says so on every call;
//! - a load is reported done only when no failure was heard, every rank that stamps its
//!   references confirmed the hold, and (with content digests) the check of every block
//!   ended without a mismatch; it is reported once;
//! - a rank's read-done note goes once, and only after its stamp confirmed the hold (with
//!   content digests: at the report, so the hold and its digest entries stand until then);
//! - a load never waits forever: a hold that has not started, or scratch all lent, fails it
//!   once `timeout` passed since its data READs ended.
//!
//! Public for the fuzz targets; engines use [`PullWorker`](crate::pull::PullWorker).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::time::Duration;

use super::stamps::Held;

/// A rank whose stamp a load reads: the driver's record (the note to send, where to read).
pub trait Ranked {
    /// The prefill rank.
    fn rank(&self) -> u32;
}

/// How posting a phase's READs went. `P` is what the READs land in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Posted<P> {
    /// Every READ was posted.
    All(P),
    /// Nothing was posted: the scratch is short. Tried again at the next poll.
    Short,
    /// Posting failed: what the READs posted before the failure land in (handed back once
    /// they ended), and why.
    Failed(P, String),
}

/// An event the driver counts in its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Every stamp confirmed the hold.
    VerifiedReference,
    /// A stamp refuted the reference, or its hold never started.
    StaleReference,
    /// The blocks matched the prefill's digests.
    VerifiedDigests,
    /// A block did not.
    DigestMismatch,
    /// Posting a phase's READs failed.
    FailedSetup,
}

/// What the driver does next for a load; each answer goes back as the method named.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<V, S, D> {
    /// Nothing now: keep the load in flight and ask again at the next poll.
    Wait,
    /// Post the stamp READs of [`Phases::pending`]; answer [`Phases::stamps_posted`].
    ReadStamps,
    /// Read these stamp slots and hand them back; answer [`Phases::stamps_checked`].
    CheckStamps(Vec<(S, V)>),
    /// Hand back these stamp slots unread (the load failed).
    DropStamps(Vec<S>),
    /// Post the READs of the digest entries of [`Phases::confirmed`]'s blocks; answer
    /// [`Phases::digests_posted`].
    ReadDigests,
    /// Start checking the blocks against these landed entries (handing the scratch back);
    /// answer [`Phases::checking`], then [`Phases::part_checked`] as each part ends.
    CheckDigests(D),
    /// Hand back this digest scratch unchecked (the load failed).
    DropDigests(D),
    /// Send these ranks' read-done notes now.
    Notify(Vec<V>),
    /// Count this in the metrics.
    Count(Counted),
    /// Report the load (done, or failed with this reason) after sending these ranks'
    /// read-done notes. The last action.
    Report {
        /// Why it failed, if it did.
        failed: Option<String>,
        /// Read-done notes still owed.
        notes: Vec<V>,
    },
}

/// What is in flight or lent.
#[derive(Debug)]
enum Stage<V, S, D> {
    /// The data READs.
    Data,
    /// Nothing: the next phase is decided at the next call.
    Between,
    /// Stamp READs, each landing in a slot.
    Stamps(Vec<(S, V)>),
    /// Digest READs, landing in `D`.
    Digests(D),
    /// The check of the blocks: parts still running, the first mismatch found.
    Checking {
        parts: usize,
        mismatch: Option<String>,
    },
    /// Reported: nothing more.
    Reported,
}

/// One load's phases after its data READs; `V` is the driver's record of a rank whose stamp
/// is read, `S` a stamp scratch slot, `D` the digest scratch of one READ of digest entries.
#[derive(Debug)]
pub struct Phases<V, S, D> {
    stage: Stage<V, S, D>,
    /// Why the load failed: the first reason heard.
    failed: Option<String>,
    /// Ranks whose stamps are still to read (again).
    pending: Vec<V>,
    /// With content digests: ranks whose stamps confirmed the hold, their notes held back
    /// until the report.
    confirmed: Vec<V>,
    /// Content digests are checked.
    digests: bool,
    /// Their entries were read.
    digests_read: bool,
    /// Since when the load waits for its verification (from its data READs' end).
    since: Option<Duration>,
    /// A stamp READ found the hold not started.
    hold_pending: bool,
    /// Tried once this poll and could not go on (scratch short, a hold not started): wait
    /// for the next poll.
    later: bool,
    notify: Vec<V>,
    counts: Vec<Counted>,
}

impl<V: Ranked, S, D> Phases<V, S, D> {
    /// A load whose data READs are in flight: `stamped` are the ranks whose stamps are read
    /// once they ended; `digests` whether the blocks are then checked against the
    /// prefill's content digests; `failed` why it already failed (READs posted before a
    /// failure may still land: the load is reported once they ended).
    pub fn new(stamped: Vec<V>, digests: bool, failed: Option<String>) -> Self {
        Phases {
            stage: Stage::Data,
            failed,
            pending: stamped,
            confirmed: Vec::new(),
            digests,
            digests_read: false,
            since: None,
            hold_pending: false,
            later: false,
            notify: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// A transfer of the load failed (or timed out, and was released): the first reason is
    /// kept.
    pub fn fail(&mut self, reason: String) {
        self.failed.get_or_insert(reason);
    }

    /// Whether the load already failed.
    pub fn failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Whether the transfers in flight are the data READs (counted as data).
    pub fn reading_data(&self) -> bool {
        matches!(self.stage, Stage::Data)
    }

    /// Whether a stamp READ found the hold not started.
    pub fn hold_pending(&self) -> bool {
        self.hold_pending
    }

    /// The ranks whose stamps [`Next::ReadStamps`] reads, in order.
    pub fn pending(&self) -> &[V] {
        &self.pending
    }

    /// The ranks whose stamps confirmed the hold (content digests), in order.
    pub fn confirmed(&self) -> &[V] {
        &self.confirmed
    }

    /// What the driver does next; `busy` is whether a transfer of the load is in flight.
    pub fn next(&mut self, now: Duration, timeout: Duration, busy: bool) -> Next<V, S, D> {
        if !self.notify.is_empty() {
            return Next::Notify(std::mem::take(&mut self.notify));
        }
        if !self.counts.is_empty() {
            return Next::Count(self.counts.remove(0));
        }
        if busy {
            return Next::Wait;
        }
        match std::mem::replace(&mut self.stage, Stage::Between) {
            Stage::Data | Stage::Between => {}
            Stage::Stamps(posted) if self.failed.is_some() => {
                return Next::DropStamps(posted.into_iter().map(|(s, _)| s).collect());
            }
            Stage::Stamps(posted) => return Next::CheckStamps(posted),
            Stage::Digests(landed) if self.failed.is_some() => return Next::DropDigests(landed),
            Stage::Digests(landed) => {
                self.stage = Stage::Checking {
                    parts: 0,
                    mismatch: None,
                };
                return Next::CheckDigests(landed);
            }
            Stage::Checking { parts, mismatch } if parts > 0 => {
                self.stage = Stage::Checking { parts, mismatch };
                return Next::Wait;
            }
            Stage::Checking { mismatch, .. } => {
                self.counts.push(match mismatch {
                    Some(_) => Counted::DigestMismatch,
                    None => Counted::VerifiedDigests,
                });
                if let Some(why) = mismatch {
                    self.fail(why);
                }
                return self.next(now, timeout, busy);
            }
            Stage::Reported => {
                self.stage = Stage::Reported;
                return Next::Wait;
            }
        }
        if self.failed.is_none() && (!self.pending.is_empty() || self.digests_due()) {
            if std::mem::take(&mut self.later) {
                return Next::Wait;
            }
            let since = *self.since.get_or_insert(now);
            if now.saturating_sub(since) <= timeout {
                return match self.pending.is_empty() {
                    false => Next::ReadStamps,
                    true => Next::ReadDigests,
                };
            }
            self.timed_out(timeout);
            return self.next(now, timeout, busy);
        }
        self.stage = Stage::Reported;
        Next::Report {
            failed: self.failed.take(),
            notes: std::mem::take(&mut self.confirmed),
        }
    }

    /// Digest entries still to read: every stamp confirmed the hold.
    fn digests_due(&self) -> bool {
        self.digests && !self.digests_read && !self.confirmed.is_empty()
    }

    /// The load waited `timeout` for its verification: it fails.
    fn timed_out(&mut self, timeout: Duration) {
        let reason = if self.pending.is_empty() {
            format!("no room in the digest scratch within {timeout:?}")
        } else if self.hold_pending {
            // A forged reference, or one from the prefill's previous incarnation.
            self.counts.push(Counted::StaleReference);
            let ranks: Vec<u32> = self.pending.iter().map(Ranked::rank).collect();
            format!(
                "stale reference: prefill ranks {ranks:?} did not hold it within {timeout:?} (unknown to them)"
            )
        } else {
            format!("no scratch slot for the stamp READ within {timeout:?}")
        };
        self.fail(reason);
    }

    /// Where a phase's posted READs land, if any were posted: with the scratch short,
    /// none (tried again at the next poll); a failure part-way is heard and counted.
    fn landing<P>(&mut self, posted: Posted<P>) -> Option<P> {
        match posted {
            Posted::All(landing) => Some(landing),
            Posted::Short => {
                self.later = true;
                None
            }
            Posted::Failed(landing, why) => {
                self.counts.push(Counted::FailedSetup);
                self.fail(why);
                Some(landing)
            }
        }
    }

    /// How posting [`Next::ReadStamps`] went: the slots of the READs posted, in the order
    /// of [`Phases::pending`].
    pub fn stamps_posted(&mut self, posted: Posted<Vec<S>>) {
        let Some(slots) = self.landing(posted) else {
            return;
        };
        let n = slots.len().min(self.pending.len());
        let ranks = self.pending.drain(..n);
        self.stage = Stage::Stamps(slots.into_iter().zip(ranks).collect());
    }

    /// What each stamp READ of [`Next::CheckStamps`] found: whether the hold stands, or
    /// why the slot refutes the reference.
    pub fn stamps_checked(&mut self, found: Vec<(V, Result<Held, String>)>) {
        let mut refuted = None;
        for (v, held) in found {
            match held {
                Ok(Held::Yes) if self.digests => self.confirmed.push(v),
                Ok(Held::Yes) => self.notify.push(v),
                Ok(Held::NotYet) => {
                    self.hold_pending = true;
                    self.pending.push(v);
                }
                Err(why) => {
                    refuted.get_or_insert(format!(
                        "stale reference: prefill rank {}: {why}",
                        v.rank()
                    ));
                }
            }
        }
        match refuted {
            Some(why) => {
                self.counts.push(Counted::StaleReference);
                self.fail(why);
            }
            None if self.pending.is_empty() => self.counts.push(Counted::VerifiedReference),
            // A hold not started yet: its slot is read again at the next poll.
            None => self.later = true,
        }
    }

    /// How posting [`Next::ReadDigests`] went.
    pub fn digests_posted(&mut self, posted: Posted<D>) {
        let Some(landed) = self.landing(posted) else {
            return;
        };
        self.digests_read = true;
        self.stage = Stage::Digests(landed);
    }

    /// The check [`Next::CheckDigests`] started runs in `parts`.
    pub fn checking(&mut self, parts: usize) {
        if let Stage::Checking { parts: p, .. } = &mut self.stage {
            *p = parts;
        }
    }

    /// A part of the check ended, with the mismatch it found if any; false when the load
    /// was not checking (an outcome to ignore).
    pub fn part_checked(&mut self, mismatch: Option<String>) -> bool {
        let Stage::Checking {
            parts,
            mismatch: first,
        } = &mut self.stage
        else {
            return false;
        };
        *parts = parts.saturating_sub(1);
        if first.is_none() {
            *first = mismatch;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank as the tests name it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct R(u32);

    impl Ranked for R {
        fn rank(&self) -> u32 {
            self.0
        }
    }

    type P = Phases<R, u32, &'static str>;
    type N = Next<R, u32, &'static str>;

    const T: Duration = Duration::from_secs(5);

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// The actions until the load waits or is reported, at `now`, with nothing in flight.
    fn run(p: &mut P, now: u64) -> Vec<N> {
        let mut out = Vec::new();
        loop {
            let n = p.next(at(now), T, false);
            let last = matches!(
                n,
                Next::Wait
                    | Next::Report { .. }
                    | Next::ReadStamps
                    | Next::ReadDigests
                    | Next::CheckStamps(_)
                    | Next::CheckDigests(_)
            );
            out.push(n);
            if last {
                return out;
            }
        }
    }

    #[test]
    fn stamps_that_confirm_the_hold_send_their_notes_and_report_the_load_done() {
        let mut p = P::new(vec![R(0), R(1)], false, None);
        assert!(p.reading_data() && !p.failed() && !p.hold_pending());
        assert_eq!(p.next(at(0), T, true), Next::Wait, "data READs in flight");
        assert_eq!(run(&mut p, 1), [Next::ReadStamps]);
        assert_eq!(p.pending(), [R(0), R(1)]);
        p.stamps_posted(Posted::All(vec![7, 8]));
        assert!(!p.reading_data());
        assert_eq!(p.next(at(1), T, true), Next::Wait, "stamp READs in flight");
        assert_eq!(
            run(&mut p, 1),
            [Next::CheckStamps(vec![(7, R(0)), (8, R(1))])]
        );
        p.stamps_checked(vec![(R(0), Ok(Held::Yes)), (R(1), Ok(Held::Yes))]);
        assert_eq!(
            run(&mut p, 1),
            [
                Next::Notify(vec![R(0), R(1)]),
                Next::Count(Counted::VerifiedReference),
                Next::Report {
                    failed: None,
                    notes: vec![]
                }
            ]
        );
        assert_eq!(run(&mut p, 2), [Next::Wait], "reported once");
    }

    #[test]
    fn a_load_without_stamps_is_reported_once_its_reads_ended() {
        let mut p = P::new(vec![], true, None);
        assert_eq!(p.next(at(0), T, true), Next::Wait);
        let done = Next::Report {
            failed: None,
            notes: vec![],
        };
        assert_eq!(run(&mut p, 0), [done]);
    }

    #[test]
    fn a_hold_not_started_is_read_again_at_the_next_poll_until_the_timeout() {
        let mut p = P::new(vec![R(0), R(1)], false, None);
        assert_eq!(run(&mut p, 10), [Next::ReadStamps]);
        p.stamps_posted(Posted::All(vec![1, 2]));
        assert_eq!(
            run(&mut p, 10),
            [Next::CheckStamps(vec![(1, R(0)), (2, R(1))])]
        );
        p.stamps_checked(vec![(R(0), Ok(Held::Yes)), (R(1), Ok(Held::NotYet))]);
        assert!(p.hold_pending());
        assert_eq!(run(&mut p, 10), [Next::Notify(vec![R(0)]), Next::Wait]);
        // The next poll reads rank 1's slot again, alone.
        assert_eq!(run(&mut p, 11), [Next::ReadStamps]);
        assert_eq!(p.pending(), [R(1)]);
        p.stamps_posted(Posted::All(vec![3]));
        assert_eq!(run(&mut p, 12), [Next::CheckStamps(vec![(3, R(1))])]);
        p.stamps_checked(vec![(R(1), Ok(Held::NotYet))]);
        assert_eq!(run(&mut p, 12), [Next::Wait]);
        assert_eq!(run(&mut p, 15), [Next::ReadStamps], "at the timeout: still");
        p.stamps_posted(Posted::All(vec![4]));
        assert_eq!(run(&mut p, 15), [Next::CheckStamps(vec![(4, R(1))])]);
        p.stamps_checked(vec![(R(1), Ok(Held::NotYet))]);
        assert_eq!(run(&mut p, 15), [Next::Wait]);
        let out = run(&mut p, 16);
        assert_eq!(out[0], Next::Count(Counted::StaleReference));
        let Next::Report {
            failed: Some(why),
            notes,
        } = &out[1]
        else {
            panic!("{out:?}");
        };
        assert!(
            why.starts_with("stale reference: prefill ranks [1] did not hold it"),
            "{why}"
        );
        assert!(notes.is_empty());
    }

    #[test]
    fn a_refuting_stamp_fails_the_load_and_the_confirmed_ranks_still_get_their_notes() {
        let mut p = P::new(vec![R(0), R(2)], false, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::All(vec![1, 2]));
        assert_eq!(run(&mut p, 0).len(), 1);
        p.stamps_checked(vec![(R(0), Ok(Held::Yes)), (R(2), Err("released".into()))]);
        assert_eq!(
            run(&mut p, 0),
            [
                Next::Notify(vec![R(0)]),
                Next::Count(Counted::StaleReference),
                Next::Report {
                    failed: Some("stale reference: prefill rank 2: released".into()),
                    notes: vec![]
                }
            ]
        );
    }

    #[test]
    fn scratch_short_is_tried_at_each_poll_and_fails_the_load_at_the_timeout() {
        let mut p = P::new(vec![R(0)], false, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::Short);
        assert_eq!(run(&mut p, 0), [Next::Wait]);
        assert_eq!(run(&mut p, 5), [Next::ReadStamps]);
        p.stamps_posted(Posted::Short);
        assert_eq!(run(&mut p, 5), [Next::Wait]);
        let out = run(&mut p, 6);
        let [
            Next::Report {
                failed: Some(why), ..
            },
        ] = out.as_slice()
        else {
            panic!("{out:?}");
        };
        assert!(
            why.starts_with("no scratch slot for the stamp READ"),
            "{why}"
        );
    }

    #[test]
    fn a_failure_hands_back_the_slots_lent_only_once_the_reads_ended() {
        // Posting failed after one READ: it is kept until it ended, then handed back.
        let mut p = P::new(vec![R(0), R(1)], false, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::Failed(vec![4], "no peer".into()));
        assert_eq!(p.next(at(0), T, true), Next::Count(Counted::FailedSetup));
        assert_eq!(p.next(at(0), T, true), Next::Wait);
        assert!(p.failed());
        assert_eq!(
            run(&mut p, 0),
            [
                Next::DropStamps(vec![4]),
                Next::Report {
                    failed: Some("no peer".into()),
                    notes: vec![]
                }
            ]
        );
        // A transfer failure while the stamp READs are in flight: the first reason stays.
        let mut p = P::new(vec![R(0)], false, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::All(vec![9]));
        p.fail("lost".into());
        p.fail("later".into());
        assert_eq!(p.next(at(0), T, true), Next::Wait);
        assert_eq!(
            run(&mut p, 0),
            [
                Next::DropStamps(vec![9]),
                Next::Report {
                    failed: Some("lost".into()),
                    notes: vec![]
                }
            ]
        );
        // A load that failed as it was posted reads no stamp.
        let mut p = P::new(vec![R(0)], true, Some("setup".into()));
        let failed = Next::Report {
            failed: Some("setup".into()),
            notes: vec![],
        };
        assert_eq!(run(&mut p, 0), [failed]);
    }

    #[test]
    fn with_digests_the_notes_wait_for_the_check_whose_mismatch_fails_the_load() {
        let mut p = P::new(vec![R(0), R(1)], true, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::All(vec![1, 2]));
        assert_eq!(run(&mut p, 0).len(), 1);
        p.stamps_checked(vec![(R(0), Ok(Held::Yes)), (R(1), Ok(Held::Yes))]);
        assert_eq!(
            run(&mut p, 0),
            [Next::Count(Counted::VerifiedReference), Next::ReadDigests]
        );
        assert_eq!(p.confirmed(), [R(0), R(1)]);
        p.digests_posted(Posted::All("landed"));
        assert_eq!(p.next(at(0), T, true), Next::Wait);
        assert!(!p.part_checked(None), "not checking yet");
        assert_eq!(run(&mut p, 0), [Next::CheckDigests("landed")]);
        p.checking(2);
        assert_eq!(run(&mut p, 0), [Next::Wait]);
        assert!(p.part_checked(Some("block 3 differs".into())));
        assert_eq!(run(&mut p, 0), [Next::Wait], "a part still runs");
        assert!(p.part_checked(None));
        assert_eq!(
            run(&mut p, 0),
            [
                Next::Count(Counted::DigestMismatch),
                Next::Report {
                    failed: Some("block 3 differs".into()),
                    notes: vec![R(0), R(1)]
                }
            ]
        );
        assert!(!p.part_checked(None), "reported");
    }

    #[test]
    fn digests_that_match_report_the_load_done_with_its_notes() {
        let mut p = P::new(vec![R(0)], true, None);
        assert_eq!(run(&mut p, 0), [Next::ReadStamps]);
        p.stamps_posted(Posted::All(vec![1]));
        run(&mut p, 0);
        p.stamps_checked(vec![(R(0), Ok(Held::Yes))]);
        run(&mut p, 0);
        p.digests_posted(Posted::Short);
        assert_eq!(run(&mut p, 1), [Next::Wait]);
        assert_eq!(run(&mut p, 2), [Next::ReadDigests]);
        p.digests_posted(Posted::All("d"));
        assert_eq!(run(&mut p, 2), [Next::CheckDigests("d")]);
        p.checking(1);
        p.part_checked(None);
        assert_eq!(
            run(&mut p, 2),
            [
                Next::Count(Counted::VerifiedDigests),
                Next::Report {
                    failed: None,
                    notes: vec![R(0)]
                }
            ]
        );
    }

    #[test]
    fn digest_scratch_short_past_the_timeout_or_a_failed_post_fails_the_load() {
        let confirmed = |p: &mut P| {
            run(p, 0);
            p.stamps_posted(Posted::All(vec![1]));
            run(p, 0);
            p.stamps_checked(vec![(R(0), Ok(Held::Yes))]);
            run(p, 0);
        };
        let mut p = P::new(vec![R(0)], true, None);
        confirmed(&mut p);
        p.digests_posted(Posted::Short);
        assert_eq!(run(&mut p, 0), [Next::Wait]);
        assert_eq!(run(&mut p, 5), [Next::ReadDigests]);
        p.digests_posted(Posted::Short);
        assert_eq!(run(&mut p, 5), [Next::Wait]);
        let out = run(&mut p, 6);
        let [
            Next::Report {
                failed: Some(why),
                notes,
            },
        ] = out.as_slice()
        else {
            panic!("{out:?}");
        };
        assert!(why.starts_with("no room in the digest scratch"), "{why}");
        assert_eq!(notes, &[R(0)], "the blocks were read: the note goes");
        let mut p = P::new(vec![R(0)], true, None);
        confirmed(&mut p);
        p.digests_posted(Posted::Failed("half", "peer gone".into()));
        assert_eq!(p.next(at(0), T, true), Next::Count(Counted::FailedSetup));
        assert_eq!(p.next(at(0), T, true), Next::Wait);
        assert_eq!(
            run(&mut p, 0),
            [
                Next::DropDigests("half"),
                Next::Report {
                    failed: Some("peer gone".into()),
                    notes: vec![R(0)]
                }
            ]
        );
    }
}
