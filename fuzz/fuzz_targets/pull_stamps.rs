//! The pull prefill's stamp table (`kvxfer_core::pull::stamps`): holds setting their stamps
//! and ending (clearing them) in any order, with generations that share slots, checked after
//! every step against a model of which hold owns each slot: a reference passes its check
//! exactly while its hold lasts and no later hold took its slot, and content is compared
//! only where both sides named one.
#![no_main]
use std::collections::HashMap;

use kvxfer_core::pull::stamps::{SLOTS, Stamp, StampTable, StaleReference, check, slot};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let table = StampTable::new();
    // Live holds by generation, and the generation that last took each slot.
    let mut live: HashMap<u64, Stamp> = HashMap::new();
    let mut owner: HashMap<u32, u64> = HashMap::new();
    let mut ended: Vec<Stamp> = Vec::new();
    let mut next = 1u64;
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let arg = bytes.next().unwrap_or(0);
        // Generations never repeat: `next` stays below SLOTS, so `next + k * SLOTS` is unique.
        if next >= u64::from(SLOTS) {
            return;
        }
        if op & 1 == 0 {
            // A new hold: a few slots, some generations SLOTS apart (the same slot).
            let generation = next + u64::from(op >> 6) * u64::from(SLOTS);
            next += 1 + u64::from(arg & 3);
            let stamp = Stamp {
                generation,
                content: u64::from(arg >> 2),
            };
            table.set(stamp);
            live.insert(generation, stamp);
            owner.insert(slot(generation), generation);
        } else if let Some(&g) = live.keys().nth(usize::from(arg) % live.len().max(1)) {
            // A hold ends.
            let stamp = live.remove(&g).unwrap();
            table.clear(stamp);
            if owner.get(&slot(g)) == Some(&g) {
                owner.remove(&slot(g));
            }
            ended.push(stamp);
        }
        for s in live.values().chain(&ended) {
            let read = table.read(s.generation);
            let expected = match owner.get(&slot(s.generation)) {
                Some(&g) if g == s.generation && live.contains_key(&g) => Ok(()),
                Some(_) => Err(StaleReference::Superseded),
                None => Err(StaleReference::Released),
            };
            assert_eq!(check(read, *s), expected, "{s:?} read {read:?}");
            // Another prompt's content: refuted exactly where both name one and differ.
            let other = Stamp {
                content: s.content ^ 1,
                ..*s
            };
            let foreign = match expected {
                Ok(()) if s.content != 0 && other.content != 0 => {
                    Err(StaleReference::OtherContent)
                }
                e => e,
            };
            assert_eq!(check(read, other), foreign);
        }
    }
});
