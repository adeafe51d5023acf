//! The push decode's room state machine (`kvxfer_core::push::decode_room`): a prefill layout
//! (TP and PP sizes, possibly a missing rank), then chunk, aux, state and abort notes from
//! the prefill's ranks and from strangers, the bootstrap's reply at any point among them, and
//! clock steps. Checked: no panic; a final status never changes; after the bootstrap a
//! stranger's note is refused; and, where every prefill rank writes into the one decode rank,
//! success exactly when a model of "every chunk 0..=last of every writer, the aux note of the
//! lead writer of the last stage, the state of every stage" says so. Drained (the pages may
//! be handed out) exactly when the room succeeded, its prefill was declared dead, or the
//! bootstrap ended and every rank it reached acknowledged with an abort note. With content
//! digests, a complete room fails when a writer's last note carried no fold, and otherwise
//! hands out its check once and succeeds exactly when that check passes.
#![no_main]
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kvxfer_core::push::RoomStatus;
use kvxfer_core::push::decode_room::DecodeRoom;
use kvxfer_core::push::messages::{PushNote, RankInfo};
use kvxfer_layout::HeadSharding;
use libfuzzer_sys::fuzz_target;

const TIMEOUT: Duration = Duration::from_secs(300);

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn u32(&mut self) -> Option<u32> {
        // Mostly small chunk ids, sometimes anything (u32::MAX included).
        let b = self.byte()?;
        if b < 0xf0 {
            return Some(u32::from(b & 0x0f));
        }
        let mut v = [0u8; 4];
        for x in &mut v {
            *x = self.byte()?;
        }
        Some(u32::from_le_bytes(v))
    }
}

fn agent(tp: u32, pp: u32) -> String {
    format!("p{tp}.{pp}")
}

fn rank(tp: (u32, u32), pp: (u32, u32)) -> RankInfo {
    RankInfo {
        agent: agent(tp.0, pp.0),
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

/// What the room has seen, kept independently of it.
#[derive(Default)]
struct Model {
    chunks: HashMap<(String, u32), (HashSet<u32>, Option<u32>)>,
    aux: HashSet<String>,
    states: HashSet<(String, u32)>,
    /// Writers whose last note carried a content-digest fold.
    folds: HashSet<(String, u32)>,
}

/// The room's needs where every prefill rank writes into the one decode rank.
struct Needs {
    writers: Vec<(String, u32)>,
    aux_from: Option<String>,
    stages: u32,
}

impl Model {
    fn complete(&self, n: &Needs) -> bool {
        let kv = n.writers.iter().all(|w| match self.chunks.get(w) {
            // Distinct chunk ids, none above the last: all of 0..=last iff as many.
            Some((got, Some(last))) => {
                got.iter().all(|c| c <= last) && got.len() as u64 == u64::from(*last) + 1
            }
            _ => false,
        });
        let aux = n.aux_from.as_ref().is_none_or(|a| self.aux.contains(a));
        let states = (0..n.stages).all(|pp| {
            n.writers
                .iter()
                .any(|w| w.1 == pp && self.states.contains(w))
        });
        kv && aux && states
    }

    fn folded(&self, n: &Needs) -> bool {
        n.writers.iter().all(|w| self.folds.contains(w))
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let (Some(a), Some(b), Some(c)) = (inp.byte(), inp.byte(), inp.byte()) else {
        return;
    };
    let p_tp = 1u32 << (a & 3); // 1, 2, 4, 8
    let p_pp = u32::from((a >> 2) & 3) + 1;
    let d_tp = 1u32 << ((a >> 4) & 3);
    let d_rank = u32::from(b) % d_tp;
    let sharding = if b & 0x80 == 0 {
        HeadSharding::Split {
            total_kv_heads: 1 << (c & 3),
        }
    } else {
        HeadSharding::Replicated
    };
    let dummy = c & 0x10 != 0;
    let aux = (c & 0x20 != 0).then_some(0);
    let state = if c & 0x40 != 0 { vec![0] } else { Vec::new() };
    let missing = (c & 0x80 != 0).then(|| (u32::from(b >> 3) % p_tp, 0));
    let mut ranks = Vec::new();
    for pp in 0..p_pp {
        for tp in 0..p_tp {
            if missing != Some((tp, pp)) {
                ranks.push(rank((tp, p_tp), (pp, p_pp)));
            }
        }
    }
    // Where the model applies: one decode rank, heads split evenly over the prefill's ranks.
    let simple = d_tp == 1
        && matches!(sharding, HeadSharding::Split { total_kv_heads } if total_kv_heads % p_tp == 0);
    let needs = Needs {
        writers: if dummy {
            Vec::new()
        } else {
            ranks.iter().map(|r| (r.agent.clone(), r.pp_rank)).collect()
        },
        aux_from: (!dummy && aux.is_some()).then(|| agent(0, p_pp - 1)),
        stages: if !dummy && !state.is_empty() { p_pp } else { 0 },
    };
    let pages = if dummy { Vec::new() } else { vec![1, 2] };
    let mut room = DecodeRoom::new(("127.0.0.1".into(), 1), Duration::ZERO, pages, aux, state);
    // Content digests (a room without pages has none to check).
    let digest = c & 0x04 != 0 && !dummy;
    if c & 0x04 != 0 {
        room.check_digests();
    }
    let mut checks_taken = 0u32;
    let mut model = Model::default();
    let mut bootstrapped = false;
    let mut now = Duration::ZERO;
    let mut last_final: Option<RoomStatus> = None;
    let mut ops = 0u32;
    // The drain model: ranks the bootstrap reached (once it ended), accepted abort notes,
    // and whether the prefill was declared dead.
    let mut reached: Option<Vec<String>> = None;
    let mut acked: HashSet<String> = HashSet::new();
    let mut gone = false;
    loop {
        let drained = room.status() == RoomStatus::Success
            || gone
            || reached
                .as_ref()
                .is_some_and(|r| r.iter().all(|a| acked.contains(a)));
        assert_eq!(room.drained(), drained, "drained disagrees with the model");
        let op = inp.byte();
        if op.is_none() || op.is_some_and(|op| op & 7 == 6) {
            // A clock step (and the end of the input): the room moves on.
            let step = u64::from(op.unwrap_or(0) >> 4) * 20;
            now = now.saturating_add(Duration::from_secs(step));
            let was_final = room.status().is_final();
            room.advance(7, now, TIMEOUT);
            if let Some(f) = last_final {
                assert_eq!(room.status(), f, "a final status changed");
            }
            // The check is handed out once, to a live room; its outcome decides.
            let mut passed = None;
            if let Some(checks) = room.take_check() {
                assert!(digest, "a check without digests");
                assert!(!was_final && !room.status().is_final(), "a final room checked");
                checks_taken += 1;
                assert_eq!(checks_taken, 1, "a check handed out twice");
                if simple {
                    assert_eq!(checks.len(), needs.writers.len(), "one share per writer");
                }
                let ok = op.unwrap_or(0) & 0x08 == 0;
                room.checked(if ok { Ok(()) } else { Err("mismatch".into()) });
                passed = Some(ok);
            }
            if room.status() == RoomStatus::Success {
                assert!(bootstrapped, "success before the bootstrap");
            }
            if simple && bootstrapped && !was_final && room.status() != RoomStatus::Failed {
                assert!(
                    missing.is_none() || dummy,
                    "a missing writer did not fail the room"
                );
                let complete = model.complete(&needs);
                assert_eq!(
                    room.status() == RoomStatus::Success,
                    complete && (!digest || passed == Some(true)),
                    "success disagrees with the model after {ops} operations"
                );
                if digest && complete {
                    assert!(model.folded(&needs), "complete without every fold yet live");
                    assert!(passed.is_some(), "complete and folded, but never checked");
                }
            }
            if room.status().is_final() {
                last_final = Some(room.status());
            }
            if op.is_none() {
                return;
            }
            continue;
        }
        let op = op.unwrap_or(0);
        ops += 1;
        let from = if op & 0x08 == 0 {
            let n = inp.byte().unwrap_or(0);
            agent(u32::from(n & 7), u32::from((n >> 3) & 3))
        } else {
            "stranger".to_string()
        };
        let pp_rank = u32::from(op >> 6);
        let note = match op & 7 {
            0 | 1 => {
                let Some(chunk) = inp.u32() else { continue };
                let is_last = op & 1 == 1;
                PushNote::Kv {
                    room: 7,
                    chunk,
                    is_last,
                    pp_rank,
                    digest: (is_last && op & 0x10 != 0).then_some(u64::from(op)),
                }
            }
            2 => PushNote::Aux { room: 7 },
            3 => PushNote::State { room: 7, pp_rank },
            4 => PushNote::Abort { room: 7 },
            5 => {
                if !bootstrapped {
                    bootstrapped = true;
                    // The ranks sent pages: any of them, as the input says.
                    let mask = inp.byte().unwrap_or(0xff);
                    let sent: Vec<String> = ranks
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| mask & (1 << (i % 8)) != 0)
                        .map(|(_, r)| r.agent.clone())
                        .collect();
                    room.set_reached(sent.clone());
                    reached = Some(sent);
                    room.bootstrapped(ranks.clone(), (d_rank, d_tp), sharding);
                }
                continue;
            }
            _ => {
                room.prefill_gone("declared dead".into());
                gone = true;
                if let Some(f) = last_final {
                    assert_eq!(room.status(), f, "a final status changed");
                }
                assert!(room.status().is_final(), "a dead prefill's room lives on");
                last_final = Some(room.status());
                continue;
            }
        };
        let known = ranks.iter().any(|r| r.agent == from);
        let accepted = room.note(&from, &note);
        if !room.ranks().is_empty() {
            assert_eq!(
                accepted, known,
                "after the bootstrap only the prefill's ranks count"
            );
        }
        if accepted {
            match note {
                PushNote::Kv {
                    chunk,
                    is_last,
                    pp_rank,
                    digest,
                    ..
                } => {
                    if digest.is_some() {
                        model.folds.insert((from.clone(), pp_rank));
                    }
                    let e = model.chunks.entry((from, pp_rank)).or_default();
                    e.0.insert(chunk);
                    if is_last {
                        e.1 = Some(chunk);
                    }
                }
                PushNote::Aux { .. } => {
                    model.aux.insert(from);
                }
                PushNote::State { pp_rank, .. } => {
                    model.states.insert((from, pp_rank));
                }
                PushNote::Abort { .. } => {
                    acked.insert(from);
                }
            }
        }
        if let Some(f) = last_final {
            assert_eq!(room.status(), f, "a final status changed");
        }
    }
});
