//! The decode's digest scratch (`kvxfer_core::pull::digests::DigestScratch`): runs of
//! entries taken and given back in any order, checked against a model of which entries are
//! lent after every step: a run is taken only from free entries, inside the scratch;
//! none is refused while the model has a free run that long (first fit finds any); runs
//! given back are whole again; and the free count always matches.
#![no_main]
use kvxfer_core::pull::digests::DigestScratch;
use libfuzzer_sys::fuzz_target;

const CAPACITY: u32 = 64;

/// The longest run of free entries in the model.
fn longest_free(lent: &[bool]) -> u32 {
    let (mut best, mut run) = (0u32, 0u32);
    for &l in lent {
        run = if l { 0 } else { run + 1 };
        best = best.max(run);
    }
    best
}

fuzz_target!(|data: &[u8]| {
    let mut scratch = DigestScratch::with_capacity(CAPACITY);
    let mut lent = vec![false; CAPACITY as usize];
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &op in data {
        if op & 1 == 0 {
            let n = u32::from(op >> 1) % (CAPACITY + 8);
            let fits = n > 0 && longest_free(&lent) >= n;
            match scratch.take(n) {
                Some(start) => {
                    assert!(n > 0 && start + n <= CAPACITY, "run {start}+{n}");
                    for i in start..start + n {
                        assert!(!lent[i as usize], "entry {i} lent twice");
                        assert_eq!(scratch.read(i), 0, "entry {i} lent dirty");
                        lent[i as usize] = true;
                    }
                    runs.push((start, n));
                }
                None => assert!(!fits, "no run of {n} though one is free"),
            }
        } else if !runs.is_empty() {
            let (start, n) = runs.swap_remove(usize::from(op >> 1) % runs.len());
            scratch.give_back(start, n);
            for i in start..start + n {
                lent[i as usize] = false;
            }
        }
        let free = lent.iter().filter(|&&l| !l).count() as u32;
        assert_eq!(scratch.free(), free);
    }
    for (start, n) in runs.drain(..) {
        scratch.give_back(start, n);
    }
    assert_eq!(scratch.take(CAPACITY), Some(0), "given back whole");
});
