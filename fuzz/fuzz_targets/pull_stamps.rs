//! The pull prefill's stamp table (`kvxfer_core::pull::stamps`): a scheduler drawing
//! generations (some a multiple of `SLOTS` apart, so sharing slots), its worker starting the
//! holds in the order drawn and ending them in any order, every reference checked after every
//! step against a model of which hold last took each slot: a reference passes exactly while
//! its hold lasts and no later hold took its slot, reads as not held yet before its hold
//! starts, and content is compared only where both sides named one.
#![no_main]
use std::collections::{HashMap, VecDeque};

use kvxfer_core::pull::stamps::{Held, SLOTS, Stamp, StampTable, StaleReference, check, slot};
use libfuzzer_sys::fuzz_target;

/// Where a drawn generation's hold is.
#[derive(Clone, Copy, PartialEq)]
enum State {
    Drawn,
    Live,
    Ended,
}

fuzz_target!(|data: &[u8]| {
    let table = StampTable::new();
    let base = 0x5a5u64 << 32;
    let mut counter = 1u64;
    let mut refs: Vec<(Stamp, State)> = Vec::new();
    let mut to_start: VecDeque<usize> = VecDeque::new();
    // The generation that last started in each slot.
    let mut owner: HashMap<u32, u64> = HashMap::new();
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let arg = bytes.next().unwrap_or(0);
        match op % 3 {
            0 => {
                // The scheduler draws a generation: the next, or one a few slots' laps later.
                counter += 1 + u64::from(op >> 6) * u64::from(SLOTS);
                if counter >= 1 << 32 {
                    return;
                }
                let stamp = Stamp {
                    generation: base | counter,
                    content: u64::from(arg >> 2),
                };
                to_start.push_back(refs.len());
                refs.push((stamp, State::Drawn));
            }
            1 => {
                // The worker starts the oldest drawn hold.
                if let Some(i) = to_start.pop_front() {
                    table.set(refs[i].0);
                    refs[i].1 = State::Live;
                    owner.insert(slot(refs[i].0.generation), refs[i].0.generation);
                }
            }
            _ => {
                // A live hold ends.
                let live: Vec<usize> = (0..refs.len()).filter(|&i| refs[i].1 == State::Live).collect();
                if let Some(&i) = live.get(usize::from(arg) % live.len().max(1)) {
                    table.release(refs[i].0);
                    refs[i].1 = State::Ended;
                }
            }
        }
        let state: HashMap<u64, State> = refs.iter().map(|(s, st)| (s.generation, *st)).collect();
        for (s, _) in &refs {
            let read = table.read(s.generation);
            let expected = match owner.get(&slot(s.generation)) {
                None => Ok(Held::NotYet),
                Some(&g) if g < s.generation => Ok(Held::NotYet),
                Some(&g) if g > s.generation => Err(StaleReference::Superseded),
                Some(&g) if state[&g] == State::Live => Ok(Held::Yes),
                Some(_) => Err(StaleReference::Released),
            };
            assert_eq!(check(read, *s), expected, "{s:?} read {read:?}");
            // Another prompt's content: refuted exactly where both name one and differ.
            let other = Stamp {
                content: s.content ^ 1,
                ..*s
            };
            let foreign = match expected {
                Ok(Held::Yes) if s.content != 0 && other.content != 0 => {
                    Err(StaleReference::OtherContent)
                }
                e => e,
            };
            assert_eq!(check(read, other), foreign);
            // The same counter from an earlier and a later incarnation of the scheduler (bit
            // 40 of the base is set, bit 45 is not): never held here.
            let unknown = if owner.contains_key(&slot(s.generation)) {
                Err(StaleReference::Superseded)
            } else {
                Ok(Held::NotYet)
            };
            for bit in [40, 45] {
                let other = Stamp {
                    generation: s.generation ^ (1 << bit),
                    ..*s
                };
                assert_eq!(check(read, other), unknown);
            }
        }
    }
});
