//! Push-mode content digest scenarios (#38): the decode checks every room's pages against
//! the folds its writers send, across TP sizes, replicated heads, pipeline stages and MLA;
//! a byte corrupted in flight, or a source changed after its digest, fails the room (and
//! goes through unnoticed without digests: the negative control).

use std::sync::Arc;

use kvxfer_core::push::{PushDecodeConfig, RoomStatus};
use kvxfer_layout::BlockOrder;

use crate::conformance::TransportFactory;
use crate::faulty::WithFaults;
use crate::pull_env::Model;
use crate::push_env::{Setup, decode_on, prefill_on, run_room};
use crate::scenarios::pull::clock;

pub(crate) fn digests_on(c: &mut PushDecodeConfig) {
    c.digest = true;
}

/// Pages the rooms below send and receive.
const SRC: [u32; 5] = [2, 3, 4, 9, 10];
const DST: [u32; 5] = [0, 5, 6, 7, 1];

/// Every deployment's room verifies on every decode rank, with bytes intact.
pub fn content_digests_verify_rooms_across_tp_stages_and_mla<F: TransportFactory>(f: &F) {
    let small = |order, heads| Model::small(order, heads);
    let mut setups = Vec::new();
    for (p, d) in [(1, 1), (1, 2), (2, 1), (4, 2), (1, 4)] {
        setups.push((
            format!("tp{p}x{d}"),
            Setup::new(small(BlockOrder::Nhd, 4), p, d),
        ));
    }
    setups.push(("repl".into(), Setup::new(small(BlockOrder::Hnd, 2), 1, 4)));
    setups.push(("mla".into(), Setup::new(Model::mla(), 2, 1)));
    let mut model = small(BlockOrder::Nhd, 4);
    model.layers = 3;
    let mut staged = Setup::new(model, 2, 1);
    staged.stages = vec![1, 2];
    setups.push(("pp".into(), staged));
    for (name, mut s) in setups {
        s.decode_config = digests_on;
        let c = clock();
        let mut pre = prefill_on(f, &s, &name, Arc::clone(&c), None, None);
        let mut dec = decode_on(f, &s, &name, c);
        let st = run_room(
            &mut pre,
            &mut dec,
            42,
            &SRC,
            &DST,
            2,
            Some((3, 6)),
            (vec![], vec![]),
        );
        let pairs: Vec<(u32, u32)> = SRC.iter().copied().zip(DST).collect();
        for (r, d) in dec.ranks.iter_mut().enumerate() {
            assert_eq!(
                st[r],
                RoomStatus::Success,
                "{name}: decode rank {r}: {:?}",
                d.error(42)
            );
            let m = d.take_metrics();
            assert_eq!(
                (m.verified_rooms, m.digest_mismatches),
                (1, 0),
                "{name}: rank {r}"
            );
            dec.mem[r].kv.verify(&pairs).expect("bytes");
        }
        let digested: u64 = pre
            .ranks
            .iter_mut()
            .map(|p| p.take_metrics().digested_pages)
            .sum();
        assert!(
            digested >= SRC.len() as u64,
            "{name}: {digested} pages digested"
        );
    }
}

/// One room, TP 2 → 1, on a decorated transport with its first WRITE corrupted as `restore`
/// says: the decode rank's status and error, and its mismatch count.
fn corrupted<F: TransportFactory>(
    f: &F,
    name: &str,
    digest: bool,
    restore: bool,
) -> (RoomStatus, Option<String>, u64) {
    let mut s = Setup::new(Model::small(BlockOrder::Nhd, 4), 2, 1);
    if digest {
        s.decode_config = digests_on;
    }
    let f = WithFaults(f);
    let c = clock();
    let mut pre = prefill_on(&f, &s, name, Arc::clone(&c), None, None);
    let mut dec = decode_on(&f, &s, name, c);
    pre.ranks[1]
        .transport()
        .faults()
        .corrupt_next_writes(1, restore);
    let st = run_room(&mut pre, &mut dec, 7, &SRC, &DST, 2, None, (vec![], vec![]));
    let m = dec.ranks[0].take_metrics();
    let digested: u64 = pre
        .ranks
        .iter_mut()
        .map(|p| p.take_metrics().digested_pages)
        .sum();
    // Two prefill ranks, each digesting every page for the one decode rank, or none.
    let expected = if digest { 2 * SRC.len() as u64 } else { 0 };
    assert_eq!(digested, expected, "{name}: pages digested");
    let pairs: Vec<(u32, u32)> = SRC.iter().copied().zip(DST).collect();
    assert!(
        dec.mem[0].kv.verify(&pairs).is_err(),
        "{name}: the flipped byte landed"
    );
    (st[0], dec.ranks[0].error(7), m.digest_mismatches)
}

/// A byte flipped in flight, and a source changed after its digest: each fails its room on a
/// digest mismatch, naming the writer. Without digests the same corruption succeeds.
pub fn a_corrupted_write_and_a_changed_source_fail_their_rooms<F: TransportFactory>(f: &F) {
    for (name, restore) in [("flight", true), ("source", false)] {
        let (status, error, mismatches) = corrupted(f, name, true, restore);
        assert_eq!(status, RoomStatus::Failed, "{name}");
        let e = error.expect("why");
        assert!(
            e.contains("content digest mismatch") && e.contains(&format!("{name}-p0-1")),
            "{name}: {e}"
        );
        assert_eq!(mismatches, 1, "{name}");
    }
    let (status, _, mismatches) = corrupted(f, "unchecked", false, true);
    assert_eq!(
        (status, mismatches),
        (RoomStatus::Success, 0),
        "without digests a corrupted room goes through"
    );
}
