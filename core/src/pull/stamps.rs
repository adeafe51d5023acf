//! Stamped references: how a decode knows that the blocks it read were still the ones its
//! reference names, without trusting the reference.
//!
//! A prefill rank keeps a table of [`SLOTS`] slots in registered host memory. When it holds a
//! request's blocks it writes the hold's [`Stamp`] (a generation the scheduler drew, never
//! reused, and the engine's content key, e.g. a digest of the prompt's tokens) into the
//! generation's slot, and marks the slot released before the blocks go back to the engine.
//! The reference (`kv_transfer_params`) carries the generation. A decode reads the blocks,
//! then the slot, and sends its read-done note only once the slot was read: a slot holding the
//! reference's generation, not released (and the content the decode expects) proves the blocks
//! were held, so not reused, for the whole first READ. A released slot, one a later hold took,
//! or one naming other content fails the load, whatever the reference said: a reference
//! consumed already, past its lease, forged, or handed to another request.
//!
//! The engine hands a reference out as its scheduler draws it, one step before the worker's
//! hold writes the slot; until then the engine itself keeps the blocks. A slot that shows an
//! earlier generation (or none) therefore means the hold has not started yet: the decode
//! reads the slot again, up to its transfer timeout (a forged reference, or one from the
//! prefill's previous incarnation whose slot no hold took, fails then).
//!
//! Slots are `generation % SLOTS`, and one scheduler's generations count up from a random
//! base: two holds share a slot only when more than [`SLOTS`] requests are held at once, and
//! then the older one's check fails (never a wrong pass), since a slot is released only by
//! the hold whose generation it holds.
//!
//! Public for the fuzz targets and tests; engines use the pull connector.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::transport::AddrRange;

/// Slots in a prefill rank's stamp table (a power of two: 1 MiB of host memory).
pub const SLOTS: u32 = 1 << 16;

/// Bytes of one slot: the generation (with [`RELEASED`] once the hold ended), then the
/// content key, each a little-endian u64.
pub const SLOT_BYTES: u64 = 16;

/// Set in a slot's generation word when its hold ended: the slot still names the generation,
/// so that a decode tells a released reference from one whose hold has not started.
pub const RELEASED: u64 = 1 << 63;

/// Generations stay below 2^53, so that JSON readers that hold numbers as doubles (a proxy
/// in JavaScript) pass them through unchanged.
const GENERATION_BITS: u32 = 53;

/// What a hold writes into its slot and a decode expects to find there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// The hold's generation: nonzero, drawn once per hold by the prefill's scheduler.
    pub generation: u64,
    /// What the engine says the KV was computed from (kvxfer.vllm: a digest of the prompt's
    /// tokens); 0 when the engine named nothing, and then nothing is compared.
    pub content: u64,
}

/// The slot of `generation` in a stamp table.
pub fn slot(generation: u64) -> u32 {
    (generation & SLOT_MASK) as u32
}

/// `generation & SLOT_MASK` is `generation % SLOTS`.
const SLOT_MASK: u64 = (SLOTS as u64).wrapping_sub(1);

/// One slot: generation, content key.
type Slot = [AtomicU64; 2];

fn empty_slots(n: u32) -> Box<[Slot]> {
    (0..n)
        .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
        .collect()
}

fn load(s: &Slot) -> [u64; 2] {
    [
        u64::from_le(s[0].load(Ordering::SeqCst)),
        u64::from_le(s[1].load(Ordering::SeqCst)),
    ]
}

/// The scheduler incarnation `generation` was drawn by: its base's bits.
fn incarnation(generation: u64) -> u64 {
    generation >> 32
}

/// Draws generations: a random per-scheduler base (so that a restarted prefill's never
/// match its predecessor's) plus a counter, never 0.
#[derive(Debug)]
pub struct Generations {
    base: u64,
    next: u64,
}

impl Generations {
    /// Generations from a random base.
    pub fn random() -> Self {
        Self::from_base(rand::random())
    }

    /// Generations from `seed`'s base (tests).
    pub fn from_base(seed: u64) -> Self {
        // The base's low 32 bits are zero: the counter's low bits pick the slot, so
        // consecutive holds take consecutive slots.
        let base = (seed << 32) & ((1u64 << GENERATION_BITS) - 1);
        Generations { base, next: 1 }
    }

    /// The next generation.
    pub fn draw(&mut self) -> u64 {
        let g = self.base | (self.next & 0xffff_ffff);
        self.next = self.next.wrapping_add(1);
        if g == 0 {
            // A zero base and a wrapped counter: 0 means an empty slot, skip it.
            return self.draw();
        }
        g
    }
}

/// A prefill rank's table, in memory the transport registers so that decodes can read it.
#[derive(Debug)]
pub struct StampTable {
    slots: Box<[Slot]>,
}

impl Default for StampTable {
    fn default() -> Self {
        Self::new()
    }
}

impl StampTable {
    /// An empty table of [`SLOTS`] slots.
    pub fn new() -> Self {
        StampTable {
            slots: empty_slots(SLOTS),
        }
    }

    /// The table's memory, to register and name in the handshake.
    pub fn range(&self) -> AddrRange {
        AddrRange::new(
            self.slots.as_ptr() as u64,
            u64::from(SLOTS).saturating_mul(SLOT_BYTES),
        )
    }

    fn slot(&self, generation: u64) -> &Slot {
        &self.slots[slot(generation) as usize]
    }

    /// Writes `stamp` into its slot: content first, so that a reader that sees the
    /// generation also sees its content (a torn read can only fail a check, never pass one
    /// it should not).
    pub fn set(&self, stamp: Stamp) {
        let s = self.slot(stamp.generation);
        s[1].store(stamp.content.to_le(), Ordering::Relaxed);
        s[0].store(stamp.generation.to_le(), Ordering::SeqCst);
    }

    /// Marks `stamp`'s slot released if it still holds that generation (a later hold that
    /// took the slot keeps it). Called before the hold's blocks go back to the engine.
    pub fn release(&self, stamp: Stamp) {
        let s = self.slot(stamp.generation);
        let _ = s[0].compare_exchange(
            stamp.generation.to_le(),
            (stamp.generation | RELEASED).to_le(),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// The slot of `generation` as a decode would read it (tests).
    pub fn read(&self, generation: u64) -> [u64; 2] {
        load(self.slot(generation))
    }

    /// Where `generation`'s slot lies in a table at `base` (a remote rank's, from its
    /// handshake).
    pub fn slot_range(base: u64, generation: u64) -> Option<AddrRange> {
        let offset = u64::from(slot(generation)).checked_mul(SLOT_BYTES)?;
        Some(AddrRange::new(base.checked_add(offset)?, SLOT_BYTES))
    }
}

/// Why a slot refutes a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StaleReference {
    /// The slot names the reference's generation, released: the hold ended (read by all its
    /// readers, or its lease ran out) before the blocks were read.
    #[error("the prefill no longer holds the blocks (reference already consumed or expired)")]
    Released,
    /// Another hold took the slot (a later one, or one of another incarnation of the
    /// prefill): the reference's hold ended and its blocks may be reused.
    #[error("the prefill's hold of the reference ended and another took its place")]
    Superseded,
    /// The hold computed other content than this request's.
    #[error("the reference's KV was computed for another prompt")]
    OtherContent,
}

/// What a slot says of a reference it does not refute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The hold stands: the blocks read before the slot were the reference's.
    Yes,
    /// No hold of the reference yet (an earlier generation, or none, in its slot): its
    /// prefill's engine keeps the blocks until the hold starts, so read the slot again.
    NotYet,
}

/// Checks a slot read after the blocks against the reference's stamp (`content` 0: not
/// compared, on either side).
pub fn check(read: [u64; 2], expected: Stamp) -> Result<Held, StaleReference> {
    let [word, content] = read;
    let generation = word & !RELEASED;
    if word == 0 {
        return Ok(Held::NotYet);
    }
    if generation != expected.generation {
        let same_scheduler = incarnation(generation) == incarnation(expected.generation);
        return if same_scheduler && generation < expected.generation {
            Ok(Held::NotYet)
        } else {
            Err(StaleReference::Superseded)
        };
    }
    if word & RELEASED != 0 {
        return Err(StaleReference::Released);
    }
    if content != 0 && expected.content != 0 && content != expected.content {
        return Err(StaleReference::OtherContent);
    }
    Ok(Held::Yes)
}

/// Slots of a decode worker's scratch table, where its stamp READs land: one per prefill
/// rank a load reads from, given back when the check is made.
pub const SCRATCH_SLOTS: u32 = 4096;

/// A decode worker's landing area for stamp READs, registered once.
#[derive(Debug)]
pub struct Scratch {
    slots: Box<[Slot]>,
    free: Vec<u32>,
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    /// [`SCRATCH_SLOTS`] free slots.
    pub fn new() -> Self {
        Scratch {
            slots: empty_slots(SCRATCH_SLOTS),
            free: (0..SCRATCH_SLOTS).rev().collect(),
        }
    }

    /// The scratch memory, to register.
    pub fn range(&self) -> AddrRange {
        AddrRange::new(
            self.slots.as_ptr() as u64,
            u64::from(SCRATCH_SLOTS).saturating_mul(SLOT_BYTES),
        )
    }

    /// `n` free slots, zeroed, or none while fewer are free (the load waits a poll).
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        let at = self.free.len().checked_sub(n)?;
        let slots = self.free.split_off(at);
        for &s in &slots {
            for w in &self.slots[s as usize] {
                w.store(0, Ordering::SeqCst);
            }
        }
        Some(slots)
    }

    /// Where slot `s` lies.
    pub fn slot_range(&self, s: u32) -> AddrRange {
        let r = self.range();
        AddrRange::new(
            r.addr
                .saturating_add(u64::from(s).saturating_mul(SLOT_BYTES)),
            SLOT_BYTES,
        )
    }

    /// What landed in slot `s`.
    pub fn read(&self, s: u32) -> [u64; 2] {
        load(&self.slots[s as usize])
    }

    /// Gives slots back once nothing can still land in them.
    pub fn give_back(&mut self, slots: Vec<u32>) {
        self.free.extend(slots);
    }

    /// Free slots (tests).
    pub fn free(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_are_nonzero_distinct_and_below_2_pow_53() {
        let mut g = Generations::from_base(u64::MAX);
        let a: Vec<u64> = (0..1000).map(|_| g.draw()).collect();
        assert!(a.iter().all(|&x| x != 0 && x < 1 << 53));
        let mut s = a.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), a.len());
        // Consecutive holds take consecutive slots.
        assert_eq!(slot(a[1]), slot(a[0]) + 1);
        // Other bases, other generations.
        let mut h = Generations::from_base(7);
        assert!(!a.contains(&h.draw()));
        // A zero base never yields 0, even once the counter wraps.
        let mut z = Generations::from_base(0);
        z.next = 1 << 32;
        assert_ne!(z.draw(), 0);
    }

    #[test]
    fn a_set_slot_passes_its_stamp_and_refutes_others() {
        let t = StampTable::new();
        let s = Stamp {
            generation: 5,
            content: 77,
        };
        assert_eq!(check(t.read(5), s), Ok(Held::NotYet));
        t.set(s);
        assert_eq!(t.read(5), [5, 77]);
        assert_eq!(check(t.read(5), s), Ok(Held::Yes));
        let foreign = Stamp { content: 78, ..s };
        assert_eq!(check(t.read(5), foreign), Err(StaleReference::OtherContent));
        // Content 0 on either side is not compared.
        assert_eq!(check(t.read(5), Stamp { content: 0, ..s }), Ok(Held::Yes));
        assert_eq!(check([5, 0], s), Ok(Held::Yes));
        // A later hold in the same slot refutes the earlier reference, and the earlier
        // hold's end does not release it.
        let later = Stamp {
            generation: 5 + u64::from(SLOTS),
            content: 1,
        };
        assert_eq!(check(t.read(5), later), Ok(Held::NotYet));
        t.set(later);
        assert_eq!(check(t.read(5), s), Err(StaleReference::Superseded));
        t.release(s);
        assert_eq!(check(t.read(later.generation), later), Ok(Held::Yes));
        t.release(later);
        assert_eq!(t.read(5), [later.generation | RELEASED, 1]);
        assert_eq!(check(t.read(5), later), Err(StaleReference::Released));
        assert_eq!(check(t.read(5), s), Err(StaleReference::Superseded));
    }

    #[test]
    fn another_incarnations_slot_refutes_whatever_its_generation() {
        let mut old = Generations::from_base(1);
        let mut new = Generations::from_base(2);
        let (a, b) = (old.draw(), new.draw());
        assert_eq!(slot(a), slot(b));
        let stamp = |generation| Stamp {
            generation,
            content: 0,
        };
        // b's incarnation is later and its counter the same: only the incarnation refutes.
        assert_eq!(check([b, 0], stamp(a)), Err(StaleReference::Superseded));
        assert_eq!(check([a, 0], stamp(b)), Err(StaleReference::Superseded));
        assert_eq!(
            check([a | RELEASED, 0], stamp(b)),
            Err(StaleReference::Superseded)
        );
        // Within one incarnation, an earlier generation in the slot: not held yet.
        let c = a + u64::from(SLOTS);
        assert_eq!(check([a | RELEASED, 0], stamp(c)), Ok(Held::NotYet));
        assert_eq!(check([a, 0], stamp(c)), Ok(Held::NotYet));
    }

    #[test]
    fn slot_ranges_lie_inside_the_table() {
        let t = StampTable::new();
        let r = t.range();
        assert_eq!(r.len, u64::from(SLOTS) * SLOT_BYTES);
        let last = StampTable::slot_range(r.addr, u64::from(SLOTS) - 1).unwrap();
        assert_eq!(last.addr + last.len, r.addr + r.len);
        let first = StampTable::slot_range(r.addr, u64::from(SLOTS)).unwrap();
        assert_eq!(first.addr, r.addr);
        assert!(StampTable::slot_range(u64::MAX - 4, 1).is_none());
    }

    #[test]
    fn scratch_slots_are_lent_zeroed_and_given_back() {
        let mut s = Scratch::new();
        let a = s.take(3).unwrap();
        assert_eq!(s.free(), SCRATCH_SLOTS as usize - 3);
        s.slots[a[0] as usize][0].store(9, Ordering::SeqCst);
        assert_eq!(s.read(a[0]), [9, 0]);
        let r = s.slot_range(a[0]);
        assert_eq!(r.addr, s.range().addr + u64::from(a[0]) * SLOT_BYTES);
        s.give_back(a.clone());
        assert!(s.take(SCRATCH_SLOTS as usize + 1).is_none());
        let all = s.take(SCRATCH_SLOTS as usize).unwrap();
        assert!(all.iter().all(|&x| s.read(x) == [0, 0]));
    }
}
