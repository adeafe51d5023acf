//! Cache contents that say what they are: every (layer, part, block, token, global head) run
//! of a prefill cache is filled from a generator seeded by that identity, so any rank
//! holding a head (replicas included) holds the same bytes, and a decode rank's bytes can be
//! checked independently of the planner that moved them.

use kvxfer_layout::{CacheSpec, Part};

fn seed(layer: u32, part: Part, block: u32, token: u32, head: u32) -> u64 {
    let p = match part {
        Part::Key => 1u64,
        Part::Value => 2,
        Part::Latent => 3,
        Part::PackedKv => 4,
        Part::State => 5,
    };
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in [
        u64::from(layer),
        p,
        u64::from(block),
        u64::from(token),
        u64::from(head),
    ] {
        h = (h ^ v).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

fn generate(out: &mut [u8], mut state: u64) {
    for chunk in out.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

/// Visits every head-token run of `blocks` (all blocks when `None`): `(offset in the cache
/// memory, length, identity seed)`, with `map_block` giving the identity block of a block.
fn for_each_run(
    spec: &CacheSpec,
    (first_head, first_layer): (u32, u32),
    blocks: &[u32],
    map_block: impl Fn(usize) -> u32,
    mut f: impl FnMut(usize, usize, u64),
) {
    let region_len = spec.region_len() as usize;
    for layer in 0..spec.num_layers() {
        for &part in spec.parts() {
            for (i, &b) in blocks.iter().enumerate() {
                let id_block = map_block(i);
                for t in 0..spec.tokens_per_block() {
                    for h in 0..spec.kv_heads() {
                        // Indices are in range by construction of `blocks`.
                        if let Ok((region, r)) = spec.head_token_range(layer, part, b, t, h) {
                            let at = region as usize * region_len + r.offset as usize;
                            f(
                                at,
                                r.len as usize,
                                seed(first_layer + layer, part, id_block, t, first_head + h),
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Fills a whole prefill cache (`mem` holds its regions back to back) whose first head and
/// first layer are `origin`.
pub fn fill(mem: &mut [u8], spec: &CacheSpec, origin: (u32, u32)) {
    let all: Vec<u32> = (0..spec.num_blocks()).collect();
    for_each_run(
        spec,
        origin,
        &all,
        |i| i as u32,
        |at, len, s| generate(&mut mem[at..at + len], s),
    );
}

/// Checks that decode block `pairs[i].1` holds prefill block `pairs[i].0` for every head this
/// rank holds (`origin`: its first head and first layer). Returns the bytes checked, or the
/// first mismatch.
pub fn verify(
    mem: &[u8],
    spec: &CacheSpec,
    origin: (u32, u32),
    pairs: &[(u32, u32)],
) -> Result<u64, String> {
    let dst: Vec<u32> = pairs.iter().map(|p| p.1).collect();
    let mut expected = Vec::new();
    let mut checked = 0u64;
    let mut bad = None;
    for_each_run(
        spec,
        origin,
        &dst,
        |i| pairs[i].0,
        |at, len, s| {
            if bad.is_some() {
                return;
            }
            expected.resize(len, 0);
            generate(&mut expected, s);
            if mem[at..at + len] != expected[..] {
                bad = Some(format!(
                    "bytes at offset {at} (len {len}) differ from the prefill's"
                ));
            }
            checked += len as u64;
        },
    );
    match bad {
        Some(e) => Err(e),
        None => Ok(checked),
    }
}
