//! Which blocks each bench request uses: a seeded choice, scattered or consecutive, and how
//! many blocks the prefill's caches hold.

use super::config::BenchConfig;

pub(crate) fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// `n` sorted distinct blocks out of `range`, scattered or consecutive.
pub(crate) fn choose(
    range: std::ops::Range<u32>,
    n: u32,
    fragmented: bool,
    state: &mut u64,
) -> Vec<u32> {
    if !fragmented {
        return (range.start..range.start + n).collect();
    }
    let mut all: Vec<u32> = range.collect();
    for i in (1..all.len()).rev() {
        let j = (xorshift(state) % (i as u64 + 1)) as usize;
        all.swap(i, j);
    }
    let mut v = all[..n as usize].to_vec();
    v.sort_unstable();
    v
}

/// The prefill blocks requests read from: `--num-blocks`, raised to hold one request. Not
/// the decode's concurrency: a `kvxfer serve` in another process must derive the same.
pub(crate) fn source_blocks(c: &BenchConfig, per_request: u32) -> u32 {
    c.num_blocks.max(per_request)
}
