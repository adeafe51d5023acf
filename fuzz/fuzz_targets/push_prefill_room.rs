//! The push prefill's room state machine (`kvxfer_core::push::prefill_room`): the engine's
//! side of a room, destinations from a few decode agents (with or without pages, right or
//! wrong page counts, in KV cache groups or not, refused or not), aborts from destinations and from strangers, chunks
//! of any size, WRITEs that finish or fail, and the bootstrap timeout, in any order.
//! Checked after every step against a model: a failed room stays failed; chunks are laid out
//! only while the room takes input, never past its pages nor after the last one (whose
//! WRITEs may still be in flight), and the last exactly when it fills them; aborts count
//! only from destinations and hand back every WRITE in flight; a room takes input as soon as the engine's side and enough destinations are there; it
//! succeeds exactly once the last chunk's WRITEs all finished, or at once for dummy-only
//! rooms.
#![no_main]
use std::collections::HashMap;
use std::time::Duration;

use kvxfer_core::XferId;
use kvxfer_core::push::RoomStatus;
use kvxfer_core::push::messages::RoomRequest;
use kvxfer_core::push::prefill_room::PrefillRoom;
use libfuzzer_sys::fuzz_target;

const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Model {
    total: Option<usize>,
    dests: HashMap<String, usize>,
    /// Per destination that named pages: whether it split them into KV cache groups.
    splits: HashMap<String, bool>,
    sent: usize,
    chunks: u32,
    last_sent: bool,
    in_flight: Vec<XferId>,
    failed: bool,
    /// The engine's side and enough destinations are there: the room must take input.
    ready: bool,
}

fuzz_target!(|data: &[u8]| {
    let mut room = PrefillRoom::new(Duration::ZERO);
    let mut m = Model::default();
    let mut next_xfer = 0u64;
    let mut now = Duration::ZERO;
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let arg = bytes.next().unwrap_or(0);
        let before = room.status();
        match op & 7 {
            // The engine adds a room once.
            0 if m.total.is_none() => {
                let total = usize::from(arg % 6);
                let required = (arg & 0x40 != 0).then_some(u32::from(op >> 6) + 1);
                room.set_engine(total, (arg & 0x80 != 0).then_some(0), Vec::new(), required);
                m.total = Some(total);
                if m.dests.values().any(|&n| n != 0 && n != total) {
                    m.failed = true;
                } else if required.is_some_and(|n| m.dests.len() >= n as usize) {
                    m.ready = true;
                }
            }
            1 => {
                let agent = format!("d{}", op >> 6);
                let pages = usize::from(arg % 7);
                let problem = (arg & 0x80 != 0).then(|| "refused".to_string());
                let required = usize::from((arg >> 3) & 3) + 1;
                // Pages in KV cache groups, or not: destinations that name pages must agree.
                let split = op & 0x08 != 0;
                let was_final = before.is_final();
                room.add_dest(
                    RoomRequest {
                        room: 1,
                        agent: agent.clone(),
                        pages: (0..pages as u32).collect(),
                        aux_index: None,
                        state_indices: Vec::new(),
                        digest: arg & 0x40 != 0,
                        prefix_tokens: 0,
                        group_pages: if split {
                            vec![pages as u32, 0]
                        } else {
                            Vec::new()
                        },
                    },
                    problem.clone(),
                    required,
                );
                if !was_final {
                    let wrong = m.total.is_some_and(|t| pages != 0 && pages != t);
                    let disagrees = pages != 0 && m.splits.values().any(|&s| s != split);
                    if pages != 0 {
                        m.splits.insert(agent.clone(), split);
                    } else {
                        m.splits.remove(&agent);
                    }
                    m.dests.insert(agent, pages);
                    if problem.is_some() || wrong || disagrees {
                        m.failed = true;
                    } else if m.dests.len() >= required && m.total.is_some() {
                        m.ready = true;
                    }
                }
            }
            2 => {
                let agent = format!("d{}", arg % 5); // d4 never asks: a stranger
                let released = room.abort_by(&agent);
                if m.dests.contains_key(&agent) {
                    let mut got = released.expect("a destination's abort was ignored");
                    got.sort_unstable();
                    assert_eq!(
                        got,
                        std::mem::take(&mut m.in_flight),
                        "WRITEs not handed back"
                    );
                    m.failed = true;
                } else {
                    assert!(released.is_none(), "a stranger aborted the room");
                }
            }
            3 => {
                let pages = usize::from(arg % 8);
                let left = m.total.unwrap_or(0).saturating_sub(m.sent);
                let takes = matches!(
                    before,
                    RoomStatus::WaitingForInput | RoomStatus::Transferring
                ) && !m.last_sent;
                // Some layers of the pages, the others to follow (streaming layer by layer).
                let completes = arg & 0x40 == 0;
                match room.next_layer_chunk(1, pages, completes) {
                    Ok(chunk) => {
                        assert!(
                            takes && pages <= left,
                            "chunk laid out in {before:?} or past the pages"
                        );
                        assert_eq!((chunk.start, chunk.id), (m.sent, m.chunks));
                        assert_eq!(chunk.is_last, completes && pages == left);
                        assert_eq!(chunk.advance, if completes { pages } else { 0 });
                        assert!(chunk.dests.iter().all(|d| !d.pages.is_empty()));
                        let posted: Vec<XferId> = (0..u64::from(op >> 6))
                            .map(|_| {
                                next_xfer += 1;
                                XferId(next_xfer)
                            })
                            .collect();
                        let failure = (arg & 0x80 != 0).then(|| "post failed".to_string());
                        m.in_flight.extend(&posted);
                        if failure.is_some() {
                            m.failed = true;
                        } else {
                            m.sent += chunk.advance;
                            m.chunks += 1;
                            m.last_sent = chunk.is_last;
                        }
                        room.chunk_posted(&chunk, posted, failure);
                    }
                    Err(_) => assert!(!takes || pages > left, "a valid chunk refused"),
                }
            }
            4 | 5 => {
                // A poll: the first `arg % 4` WRITEs finished, or one of them failed.
                let mut xfers = room.take_xfers();
                xfers.sort_unstable();
                assert_eq!(xfers, m.in_flight);
                let done = usize::from(arg % 4).min(xfers.len());
                let still = xfers.split_off(done);
                if op & 7 == 5 && done > 0 {
                    room.fail("transfer failed".into());
                    m.failed = true;
                }
                m.in_flight = still.clone();
                room.keep_xfers(still);
            }
            0 => {}
            6 => {
                now = now.saturating_add(Duration::from_secs(u64::from(arg) / 4));
                if room.bootstrap_timed_out(1, now, TIMEOUT) {
                    assert_eq!(before, RoomStatus::Bootstrapping);
                    m.failed = true;
                }
            }
            _ => {
                room.fail("aborted by the prefill engine".into());
                m.failed = true;
            }
        }
        room.settle();
        let status = room.status();
        assert!(
            m.sent <= m.total.unwrap_or(0),
            "more pages sent than the room has"
        );
        if before == RoomStatus::Failed || m.failed {
            assert_eq!(
                status,
                RoomStatus::Failed,
                "a failed room came back (op {op:#x})"
            );
            continue;
        }
        let dummy_only = m.dests.values().all(|&n| n == 0);
        // Never late: ready rooms take input, finished ones succeed.
        if m.ready {
            assert!(
                status >= RoomStatus::WaitingForInput,
                "ready but {status:?}"
            );
        }
        if m.last_sent && m.in_flight.is_empty() || m.ready && dummy_only && m.chunks == 0 {
            assert_eq!(status, RoomStatus::Success, "due to succeed (op {op:#x})");
        }
        if status == RoomStatus::Success && before != RoomStatus::Success {
            let sent_all = m.last_sent && m.in_flight.is_empty();
            assert!(
                sent_all || (dummy_only && m.total.is_some()),
                "success before the last chunk's WRITEs finished"
            );
        }
        if status >= RoomStatus::WaitingForInput {
            assert!(
                m.total.is_some(),
                "{status:?} before the engine added the room"
            );
        }
        assert_eq!(
            room.requested(),
            m.total.is_none() && !status.is_final() && !m.dests.is_empty()
        );
    }
});
