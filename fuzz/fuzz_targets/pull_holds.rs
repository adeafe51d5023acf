//! The pull prefill's holds (`kvxfer_core::pull::holds`): holds, read-done notes from a few
//! agents naming any reader count, heartbeats, clock steps and lease expiry, in any order,
//! for a few request ids. Checked against a model after every step: what each call returns,
//! which requests are freed (each once per hold, only once all its readers noted or its
//! lease ran out), and how many holds and early notes are kept. (The bound on early notes
//! needs more request ids than these inputs name; a unit test of `holds.rs` covers it.)
#![no_main]
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kvxfer_core::pull::holds::Holds;
use kvxfer_core::pull::notify::PullNote;
use libfuzzer_sys::fuzz_target;

const LEASE: Duration = Duration::from_secs(30);

/// One request as the model sees it.
struct Entry {
    readers: Option<u32>,
    senders: HashSet<String>,
    deadline: Duration,
    held: bool,
}

impl Entry {
    fn count(&mut self, from: &str, readers: u32) -> bool {
        if self.readers.is_some_and(|r| r != readers) || self.senders.contains(from) {
            return false;
        }
        self.readers = Some(readers);
        self.senders.insert(from.to_string());
        true
    }

    fn all_read(&self) -> bool {
        self.readers
            .is_some_and(|r| self.senders.len() as u64 >= u64::from(r))
    }
}

fuzz_target!(|data: &[u8]| {
    let mut holds = Holds::new(LEASE);
    let mut model: HashMap<String, Entry> = HashMap::new();
    let mut now = Duration::ZERO;
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let req = format!("r{}", op >> 5);
        let mut freed = Vec::new();
        let mut expected: Vec<String> = Vec::new();
        match op & 7 {
            0 => {
                holds.hold(&req, now, &mut freed);
                let e = model.entry(req.clone()).or_insert(Entry {
                    readers: None,
                    senders: HashSet::new(),
                    deadline: now,
                    held: false,
                });
                let was_held = e.held;
                e.held = true;
                e.deadline = now.saturating_add(LEASE);
                if !was_held && e.all_read() {
                    model.remove(&req);
                    expected.push(req.clone());
                }
            }
            1 | 2 => {
                let from = format!("d{}", (op >> 3) & 3);
                let readers = match bytes.next().unwrap_or(0) {
                    b if b >= 0xfe => u32::MAX,
                    b => u32::from(b % 5),
                };
                let counted = holds.note(
                    &from,
                    &PullNote::Read {
                        req_id: &req,
                        readers,
                    },
                    now,
                    &mut freed,
                );
                let e = model.entry(req.clone()).or_insert(Entry {
                    readers: None,
                    senders: HashSet::new(),
                    deadline: now.saturating_add(LEASE),
                    held: false,
                });
                assert_eq!(
                    counted,
                    e.count(&from, readers),
                    "note {from} {req} {readers}"
                );
                if e.held && e.all_read() {
                    model.remove(&req);
                    expected.push(req.clone());
                }
            }
            3 => {
                assert!(holds.note("d0", &PullNote::Heartbeat { req_id: &req }, now, &mut freed));
                if let Some(e) = model.get_mut(&req).filter(|e| e.held) {
                    e.deadline = now.saturating_add(LEASE);
                }
            }
            4 => {
                let n = holds.expire(now, &mut freed);
                let gone: Vec<String> = model
                    .iter()
                    .filter(|(_, e)| e.deadline <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    if model.remove(&id).is_some_and(|e| e.held) {
                        expected.push(id);
                    }
                }
                assert_eq!(n, expected.len() as u64);
            }
            _ => now = now.saturating_add(Duration::from_secs(u64::from(op >> 3) * 3)),
        }
        // Sorted, not deduplicated: a request freed twice must show.
        freed.sort_unstable();
        expected.sort_unstable();
        assert_eq!(freed, expected, "freed after op {op:#x}");
        assert_eq!(holds.held(), model.values().filter(|e| e.held).count());
        assert_eq!(holds.early(), model.values().filter(|e| !e.held).count());
        for (id, e) in &model {
            assert_eq!(holds.is_held(id), e.held);
        }
    }
});
