//! One room on the decode side of the push connector, without I/O: who must write into this
//! decode rank (from the prefill's layout), which chunk, aux, state and abort notes arrived
//! from whom, and when the room succeeds, fails or times out. [`crate::push::PushDecode`] feeds it
//! from its control thread and transport; the `push_decode_room` fuzz target drives it with
//! arbitrary layouts and notes.
//!
//! Public for the fuzz targets; engines use [`PushDecode`](crate::push::PushDecode).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kvxfer_layout::{HeadSharding, LinkKind, TpMapping};

use crate::push::digests::Coverage;
use crate::push::messages::{PushNote, RankInfo};
use crate::push::status::RoomStatus;

/// A writer of this decode rank's data: prefill agent and its PP stage.
type Writer = (String, u32);

/// What a room needs before it is complete.
#[derive(Debug)]
struct Expectation {
    /// Each writer, and what it writes of this rank's cache (for its content digest).
    writers: HashMap<Writer, Coverage>,
    aux_from: Option<String>,
    state_stages: u32,
}

/// One room of a decode rank.
#[derive(Debug)]
pub struct DecodeRoom {
    pub(super) addr: (String, u16),
    status: RoomStatus,
    created: Duration,
    pages: Vec<u32>,
    aux_index: Option<u32>,
    state_indices: Vec<u32>,
    expect: Option<Expectation>,
    /// Per writer: chunks noted, and the id of its last chunk once noted.
    chunks: HashMap<Writer, (HashSet<u32>, Option<u32>)>,
    /// Agents that noted aux data (only the expected one counts).
    aux: HashSet<String>,
    /// Writers that noted state data (only expected writers count, once per stage).
    states: HashSet<Writer>,
    /// Agents that noted an abort (only the room's prefill ranks count).
    aborts: HashSet<String>,
    ranks: Vec<RankInfo>,
    /// The prefill instance the bootstrap answered for.
    pub(super) instance: Option<u64>,
    error: Option<String>,
    /// The prefill agents that were sent this room's pages, once the bootstrap ended: the
    /// ones that may write into them. `None` while it runs (pages may be on their way).
    reached: Option<HashSet<String>>,
    /// The prefill was declared dead: none of its ranks writes any more.
    prefill_gone: bool,
    /// The room is checked against content digests before it succeeds.
    digest: bool,
    /// Per writer, the fold of its content digests, from its last KV note.
    folds: HashMap<Writer, u64>,
    /// The content check was handed out ([`DecodeRoom::take_check`]).
    checking: bool,
}

/// One writer's share of a room's content check: the fold its last note carried, over
/// what it wrote of this rank's cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterCheck {
    /// The writer's agent.
    pub agent: String,
    /// Its PP stage.
    pub pp_rank: u32,
    /// The heads and layers it wrote.
    pub cover: Coverage,
    /// The fold it sent.
    pub expected: u64,
}

impl DecodeRoom {
    /// A room bootstrapping from the prefill at `addr`, created at `created` (the
    /// connector's clock): destination `pages` (empty for a rank that only completes its
    /// status), `aux_index`, `state_indices`.
    pub fn new(
        addr: (String, u16),
        created: Duration,
        pages: Vec<u32>,
        aux_index: Option<u32>,
        state_indices: Vec<u32>,
    ) -> Self {
        DecodeRoom {
            addr,
            status: RoomStatus::Bootstrapping,
            created,
            pages,
            aux_index,
            state_indices,
            expect: None,
            chunks: HashMap::new(),
            aux: HashSet::new(),
            states: HashSet::new(),
            aborts: HashSet::new(),
            ranks: Vec::new(),
            instance: None,
            error: None,
            reached: None,
            prefill_gone: false,
            digest: false,
            folds: HashMap::new(),
            checking: false,
        }
    }

    /// The room is checked against content digests before it succeeds (its writers are
    /// asked for them).
    pub fn check_digests(&mut self) {
        self.digest = !self.pages.is_empty();
    }

    /// The room's destination pages.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// The room's status.
    pub fn status(&self) -> RoomStatus {
        self.status
    }

    /// Why the room failed.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// The prefill ranks named by the bootstrap (empty before it).
    pub fn ranks(&self) -> &[RankInfo] {
        &self.ranks
    }

    /// The bootstrap of a room that had already ended named the prefill's `ranks`: kept to
    /// tell them and to count their acknowledgements.
    pub fn learn_ranks(&mut self, ranks: Vec<RankInfo>) {
        if self.ranks.is_empty() {
            self.ranks = ranks;
        }
    }

    /// The bootstrap ended, having sent the room's pages to the prefill `agents`.
    pub fn set_reached(&mut self, agents: impl IntoIterator<Item = String>) {
        self.reached = Some(agents.into_iter().collect());
    }

    /// The prefill was declared dead (missed heartbeats): fails the room, and no rank of it
    /// is waited for any more.
    pub fn prefill_gone(&mut self, reason: String) {
        self.fail(reason);
        self.prefill_gone = true;
    }

    /// Whether no prefill rank can still write into the room's pages, so that the engine
    /// may hand them to another request: the room succeeded (every write landed), or the
    /// bootstrap ended and every rank it sent the pages to acknowledged that it stopped (its
    /// abort note, sent once its WRITEs of the room were released), or the prefill was
    /// declared dead.
    pub fn drained(&self) -> bool {
        self.status == RoomStatus::Success
            || self.prefill_gone
            || self
                .reached
                .as_ref()
                .is_some_and(|agents| agents.iter().all(|a| self.aborts.contains(a)))
    }

    /// The room's prefill ranks that have not acknowledged an abort: the ones to tell.
    pub fn unacked_ranks(&self) -> Vec<RankInfo> {
        self.ranks
            .iter()
            .filter(|r| !self.aborts.contains(&r.agent))
            .cloned()
            .collect()
    }

    /// Fails the room unless it is final already; the first reason is kept.
    pub fn fail(&mut self, reason: String) {
        if !self.status.is_final() {
            tracing::warn!(%reason, "push room failed on decode");
            self.error.get_or_insert(reason);
            self.status = RoomStatus::Failed;
        }
    }

    /// The bootstrap named the prefill's `ranks` (checked by `messages::check_layout`):
    /// learns who writes into decode rank `tp.0` of `tp.1`, or fails the room if the layout
    /// cannot serve it.
    pub fn bootstrapped(&mut self, ranks: Vec<RankInfo>, tp: (u32, u32), sharding: HeadSharding) {
        match self.expectation(&ranks, tp, sharding) {
            Ok(e) => {
                self.expect = Some(e);
                self.ranks = ranks;
                self.status = self.status.update(RoomStatus::WaitingForInput);
            }
            Err(reason) => self.fail(reason),
        }
    }

    /// Records `note` from agent `from`; false (nothing recorded) when `from` is not one of
    /// the room's prefill ranks.
    pub fn note(&mut self, from: &str, note: &PushNote) -> bool {
        if !self.may_write(from) {
            // Not one of the room's prefill ranks: it can neither complete nor fail it.
            return false;
        }
        match *note {
            PushNote::Kv {
                chunk,
                is_last,
                pp_rank,
                digest,
                ..
            } => {
                let entry = self.chunks.entry((from.to_string(), pp_rank)).or_default();
                entry.0.insert(chunk);
                if is_last {
                    entry.1 = Some(chunk);
                }
                if let Some(d) = digest {
                    self.folds.insert((from.to_string(), pp_rank), d);
                }
                self.status = self.status.update(RoomStatus::Transferring);
            }
            PushNote::Aux { .. } => {
                self.aux.insert(from.to_string());
            }
            PushNote::State { pp_rank, .. } => {
                self.states.insert((from.to_string(), pp_rank));
            }
            PushNote::Abort { .. } => {
                self.aborts.insert(from.to_string());
            }
        }
        true
    }

    /// Moves the room on at `now`: failed if one of its prefill ranks aborted it, complete
    /// once every expected note arrived, failed once it waited longer than
    /// `waiting_timeout`. `id` names the room in the failure.
    pub fn advance(&mut self, id: u64, now: Duration, waiting_timeout: Duration) {
        if self.aborted_by_prefill() {
            self.fail("aborted by the prefill".into());
        }
        if !self.status.is_final() && self.complete() {
            if !self.digest {
                self.status = RoomStatus::Success;
            } else if let Some((agent, pp)) = self.unfolded_writer() {
                self.fail(format!(
                    "prefill rank {agent} (stage {pp}) sent no content digest: it does not digest (a kvxfer from before push-mode digests?)"
                ));
            }
            // Otherwise every note and fold arrived: the check decides (`checked`).
        }
        if !self.status.is_final() && now.saturating_sub(self.created) > waiting_timeout {
            self.fail(format!("room {id} waited longer than {waiting_timeout:?}"));
        }
    }

    /// A writer whose last note carried no fold.
    fn unfolded_writer(&self) -> Option<Writer> {
        let e = self.expect.as_ref()?;
        e.writers
            .keys()
            .find(|w| !self.folds.contains_key(*w))
            .cloned()
    }

    /// The room's content check, once: when it checks digests, every note arrived with
    /// every writer's fold, and it is still live. The room stays `Transferring` until
    /// [`DecodeRoom::checked`].
    pub fn take_check(&mut self) -> Option<Vec<WriterCheck>> {
        if !self.digest || self.checking || self.status.is_final() || !self.complete() {
            return None;
        }
        let e = self.expect.as_ref()?;
        let checks = e
            .writers
            .iter()
            .map(|(w, &cover)| {
                self.folds.get(w).map(|&expected| WriterCheck {
                    agent: w.0.clone(),
                    pp_rank: w.1,
                    cover,
                    expected,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        self.checking = true;
        Some(checks)
    }

    /// The content check ended: the room succeeds, or fails with the mismatch (unless it
    /// ended otherwise meanwhile).
    pub fn checked(&mut self, outcome: Result<(), String>) {
        if !self.checking || self.status.is_final() {
            return;
        }
        match outcome {
            Ok(()) => self.status = RoomStatus::Success,
            Err(e) => self.fail(e),
        }
    }

    fn complete(&self) -> bool {
        let Some(e) = &self.expect else { return false };
        let kv = e.writers.keys().all(|w| match self.chunks.get(w) {
            // Every chunk 0..=last, and no other.
            Some((got, Some(last))) => {
                got.len() as u64 == u64::from(*last) + 1 && got.iter().all(|c| c <= last)
            }
            _ => false,
        });
        let aux = e.aux_from.as_ref().is_none_or(|a| self.aux.contains(a));
        let stages: HashSet<u32> = self
            .states
            .iter()
            .filter(|w| e.writers.contains_key(*w))
            .map(|w| w.1)
            .collect();
        kv && aux && stages.len() as u32 >= e.state_stages
    }

    /// Whether `agent` is one of the room's prefill ranks; before the bootstrap named them,
    /// nobody can be ruled out (notes may overtake the bootstrap's reply).
    fn may_write(&self, agent: &str) -> bool {
        self.ranks.is_empty() || self.ranks.iter().any(|r| r.agent == agent)
    }

    /// Whether one of the room's prefill writers told it that the room failed there.
    pub fn aborted_by_prefill(&self) -> bool {
        self.ranks.iter().any(|r| self.aborts.contains(&r.agent))
    }

    /// Which prefill ranks write into decode rank `tp.0`, and who sends aux and state.
    fn expectation(
        &self,
        ranks: &[RankInfo],
        tp: (u32, u32),
        sharding: HeadSharding,
    ) -> Result<Expectation, String> {
        let first = ranks.first().ok_or("the prefill registered no ranks")?;
        let mapping = TpMapping::new(first.tp_size, tp.1, sharding).map_err(|e| e.to_string())?;
        let links = mapping.links_for_decode(tp.0).map_err(|e| e.to_string())?;
        let data: Vec<(u32, kvxfer_layout::HeadSlice)> = links
            .iter()
            .filter_map(|l| match l.kind {
                LinkKind::Data(s) => Some((l.prefill_rank, s)),
                _ => None,
            })
            .collect();
        let rank = |tp_rank: u32, pp_rank: u32| {
            ranks
                .iter()
                .find(|r| r.tp_rank == tp_rank && r.pp_rank == pp_rank)
        };
        let agent = |tp_rank: u32, pp_rank: u32| rank(tp_rank, pp_rank).map(|r| r.agent.clone());
        let dummy = self.pages.is_empty();
        let mut writers = HashMap::new();
        if !dummy {
            for pp in 0..first.pp_size {
                for &(q, slice) in &data {
                    let r = rank(q, pp).ok_or(format!("prefill rank tp {q} pp {pp} missing"))?;
                    let cover = Coverage {
                        first_head: slice.dst_first,
                        heads: slice.count,
                        first_layer: r.first_layer,
                        layers: r.num_layers,
                    };
                    writers.insert((r.agent.clone(), pp), cover);
                }
            }
        }
        let lead = data.iter().map(|d| d.0).min();
        let wants_aux = !dummy && self.aux_index.is_some();
        let wants_state = !dummy && !self.state_indices.is_empty();
        Ok(Expectation {
            writers,
            aux_from: if wants_aux {
                // The lead writer of the last stage.
                lead.zip(first.pp_size.checked_sub(1))
                    .and_then(|(q, last)| agent(q, last))
            } else {
                None
            },
            state_stages: if wants_state { first.pp_size } else { 0 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(300);

    fn rank(tp: (u32, u32), pp: (u32, u32)) -> RankInfo {
        RankInfo {
            agent: format!("p{}.{}", tp.0, pp.0),
            tp_size: tp.1,
            tp_rank: tp.0,
            pp_size: pp.1,
            pp_rank: pp.0,
            dp_size: 1,
            dp_rank: 0,
            host: "127.0.0.1".into(),
            port: 1,
            page_size: 16,
            dtype: "bf16".into(),
            first_layer: 0,
            num_layers: 1,
        }
    }

    /// Every rank of a prefill with `tp` × `pp` ranks.
    fn prefill(tp: u32, pp: u32) -> Vec<RankInfo> {
        (0..pp)
            .flat_map(|p| (0..tp).map(move |t| rank((t, tp), (p, pp))))
            .collect()
    }

    fn kv(chunk: u32, is_last: bool, pp_rank: u32) -> PushNote {
        PushNote::Kv {
            room: 7,
            chunk,
            is_last,
            pp_rank,
            digest: None,
        }
    }

    fn last_with_fold(chunk: u32, fold: u64) -> PushNote {
        PushNote::Kv {
            room: 7,
            chunk,
            is_last: true,
            pp_rank: 0,
            digest: Some(fold),
        }
    }

    /// A room of decode rank 0 of 1 (both heads), bootstrapped from `ranks`.
    fn room(
        pages: Vec<u32>,
        aux: Option<u32>,
        state: Vec<u32>,
        ranks: Vec<RankInfo>,
    ) -> DecodeRoom {
        let mut r = DecodeRoom::new(("h".into(), 1), Duration::ZERO, pages, aux, state);
        r.bootstrapped(ranks, (0, 1), HeadSharding::Split { total_kv_heads: 2 });
        r
    }

    /// A room of `pages` that checks content digests, bootstrapped from `ranks` as in
    /// [`room`].
    fn checking(pages: Vec<u32>, ranks: Vec<RankInfo>) -> DecodeRoom {
        let mut r = DecodeRoom::new(("h".into(), 1), Duration::ZERO, pages, None, Vec::new());
        r.check_digests();
        r.bootstrapped(ranks, (0, 1), HeadSharding::Split { total_kv_heads: 2 });
        r
    }

    fn settle(r: &mut DecodeRoom) -> RoomStatus {
        r.advance(7, Duration::ZERO, WAIT);
        r.status()
    }

    #[test]
    fn a_room_succeeds_once_every_writer_sent_every_chunk() {
        let mut r = room(vec![1, 2], None, Vec::new(), prefill(2, 1));
        assert_eq!(r.ranks().len(), 2);
        assert_eq!(settle(&mut r), RoomStatus::WaitingForInput);
        assert!(r.note("p0.0", &kv(0, false, 0)));
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        assert!(r.note("p0.0", &kv(1, true, 0)));
        assert_eq!(
            settle(&mut r),
            RoomStatus::Transferring,
            "p1.0 has sent nothing"
        );
        assert!(r.note("p1.0", &kv(0, true, 0)));
        assert_eq!(settle(&mut r), RoomStatus::Success);
        assert_eq!(r.error(), None);
    }

    #[test]
    fn with_digests_a_complete_room_succeeds_only_once_its_check_passes() {
        let mut r = checking(vec![1, 2], prefill(2, 1));
        assert_eq!(r.take_check(), None, "nothing arrived");
        assert!(r.note("p0.0", &last_with_fold(0, 0xa)));
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        assert_eq!(r.take_check(), None, "p1.0 has sent nothing");
        assert!(r.note("p1.0", &last_with_fold(1, 0xb)));
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        assert_eq!(
            r.take_check(),
            None,
            "every fold, but p1.0's chunk 0 is missing"
        );
        assert!(r.note("p1.0", &kv(0, false, 0)));
        assert_eq!(settle(&mut r), RoomStatus::Transferring, "not checked yet");
        let mut checks = r.take_check().expect("the check");
        checks.sort_by(|a, b| a.agent.cmp(&b.agent));
        let share = |agent: &str, head: u32, expected: u64| WriterCheck {
            agent: agent.into(),
            pp_rank: 0,
            cover: Coverage {
                first_head: head,
                heads: 1,
                first_layer: 0,
                layers: 1,
            },
            expected,
        };
        assert_eq!(checks, vec![share("p0.0", 0, 0xa), share("p1.0", 1, 0xb)]);
        assert_eq!(r.take_check(), None, "handed out once");
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        r.checked(Ok(()));
        assert_eq!(r.status(), RoomStatus::Success);
        r.checked(Err("late".into()));
        assert_eq!((r.status(), r.error()), (RoomStatus::Success, None));
    }

    #[test]
    fn with_digests_a_missing_fold_or_a_failed_check_fails_the_room() {
        let mut r = checking(vec![1], prefill(1, 1));
        r.checked(Ok(()));
        assert_eq!(
            r.status(),
            RoomStatus::WaitingForInput,
            "no check was handed out"
        );
        assert!(r.note("p0.0", &kv(0, true, 0)));
        assert_eq!(settle(&mut r), RoomStatus::Failed);
        assert!(
            r.error()
                .expect("why")
                .contains("p0.0 (stage 0) sent no content digest")
        );
        assert_eq!(r.take_check(), None);

        let mut r = checking(vec![1], prefill(1, 1));
        assert!(r.note("p0.0", &last_with_fold(0, 1)));
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        let [share] = &r.take_check().expect("the check")[..] else {
            panic!("one writer")
        };
        assert_eq!((share.cover.first_head, share.cover.heads), (0, 2));
        r.checked(Err("mismatch".into()));
        assert_eq!(
            (r.status(), r.error()),
            (RoomStatus::Failed, Some("mismatch"))
        );
        // A room without pages checks nothing.
        let mut r = room(Vec::new(), None, Vec::new(), prefill(1, 1));
        r.check_digests();
        assert_eq!(settle(&mut r), RoomStatus::Success);
    }

    #[test]
    fn chunks_must_be_exactly_zero_to_the_last() {
        for (chunks, last, done) in [
            (&[0u32, 2][..], 2, false),
            (&[0, 1, 2], 2, true),
            (&[5], 1, false),
            (&[0, 1, 5], 1, false),
            (&[0], 0, true),
            (&[1], 1, false),
        ] {
            let mut r = room(vec![1], None, Vec::new(), prefill(1, 1));
            for &c in chunks {
                assert!(r.note("p0.0", &kv(c, false, 0)));
            }
            assert!(r.note("p0.0", &kv(last, true, 0)));
            assert_eq!(
                settle(&mut r) == RoomStatus::Success,
                done,
                "{chunks:?} last {last}"
            );
        }
    }

    #[test]
    fn aux_comes_from_the_lead_writer_of_the_last_stage() {
        let mut r = room(vec![1], Some(0), Vec::new(), prefill(1, 2));
        assert!(r.note("p0.0", &kv(0, true, 0)));
        assert!(r.note("p0.1", &kv(0, true, 1)));
        assert!(
            r.note("p0.0", &PushNote::Aux { room: 7 }),
            "a rank's note is taken"
        );
        assert_eq!(
            settle(&mut r),
            RoomStatus::Transferring,
            "aux from the first stage"
        );
        assert!(r.note("p0.1", &PushNote::Aux { room: 7 }));
        assert_eq!(settle(&mut r), RoomStatus::Success);
    }

    #[test]
    fn state_comes_from_every_stage_under_its_own_stage() {
        let mut r = room(vec![1], None, vec![0], prefill(1, 2));
        assert!(r.note("p0.0", &kv(0, true, 0)));
        assert!(r.note("p0.1", &kv(0, true, 1)));
        assert!(r.note(
            "p0.0",
            &PushNote::State {
                room: 7,
                pp_rank: 1
            }
        ));
        assert_eq!(
            settle(&mut r),
            RoomStatus::Transferring,
            "state under another's stage"
        );
        assert!(r.note(
            "p0.0",
            &PushNote::State {
                room: 7,
                pp_rank: 0
            }
        ));
        assert_eq!(
            settle(&mut r),
            RoomStatus::Transferring,
            "stage 1's state missing"
        );
        assert!(r.note(
            "p0.1",
            &PushNote::State {
                room: 7,
                pp_rank: 1
            }
        ));
        assert_eq!(settle(&mut r), RoomStatus::Success);
    }

    #[test]
    fn a_dummy_room_needs_no_data() {
        let mut r = room(Vec::new(), Some(0), vec![0], prefill(2, 2));
        assert_eq!(settle(&mut r), RoomStatus::Success);
    }

    #[test]
    fn strangers_count_only_before_the_bootstrap_names_the_ranks() {
        let mut r = DecodeRoom::new(("h".into(), 1), Duration::ZERO, vec![1], None, Vec::new());
        assert!(
            r.note("x", &kv(0, false, 0)),
            "before the bootstrap nobody is ruled out"
        );
        r.bootstrapped(
            prefill(1, 1),
            (0, 1),
            HeadSharding::Split { total_kv_heads: 2 },
        );
        assert!(!r.note("x", &kv(0, true, 0)));
        assert!(!r.note("x", &PushNote::Abort { room: 7 }));
        assert_eq!(settle(&mut r), RoomStatus::Transferring);
        assert!(r.note("p0.0", &PushNote::Abort { room: 7 }));
        assert_eq!(settle(&mut r), RoomStatus::Failed);
        assert_eq!(r.error(), Some("aborted by the prefill"));
    }

    #[test]
    fn a_room_times_out_after_the_waiting_timeout_not_at_it() {
        let mut r = room(vec![1], None, Vec::new(), prefill(1, 1));
        r.advance(7, WAIT, WAIT);
        assert_eq!(r.status(), RoomStatus::WaitingForInput);
        r.advance(7, WAIT + Duration::from_nanos(1), WAIT);
        assert_eq!(r.status(), RoomStatus::Failed);
        assert_eq!(r.error(), Some("room 7 waited longer than 300s"));
    }

    #[test]
    fn the_first_failure_wins_and_success_is_final() {
        let mut r = room(vec![1], None, Vec::new(), prefill(1, 1));
        r.fail("first".into());
        r.fail("second".into());
        assert_eq!((r.status(), r.error()), (RoomStatus::Failed, Some("first")));
        let mut r = room(Vec::new(), None, Vec::new(), prefill(1, 1));
        assert_eq!(settle(&mut r), RoomStatus::Success);
        r.fail("late".into());
        assert_eq!((r.status(), r.error()), (RoomStatus::Success, None));
    }

    #[test]
    fn a_layout_missing_a_writer_fails_the_room() {
        let mut ranks = prefill(2, 1);
        ranks.pop();
        let r = room(vec![1], None, Vec::new(), ranks);
        assert_eq!(r.status(), RoomStatus::Failed);
        assert_eq!(r.error(), Some("prefill rank tp 1 pp 0 missing"));
        assert!(r.ranks().is_empty());
    }
}
