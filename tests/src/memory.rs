//! Host test buffers: random source data, guard patterns, and checks that a transfer wrote
//! exactly the ranges it should and nothing else.

use kvxfer_core::{AddrRange, MemoryKind, Registration, Transport, TransportResult};

use crate::shared_mem::SharedMem;

/// Deterministic xorshift64* generator, so failures reproduce from the seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// The guard byte expected at offset `i` of an untouched destination buffer: position-
/// dependent, so a copy landing at the wrong offset is caught even if it copies guard bytes.
pub const fn guard_byte(i: usize) -> u8 {
    (i.wrapping_mul(31).wrapping_add(7) % GUARD_PERIOD) as u8
}

/// The guard pattern repeats every 251 bytes (31 is invertible modulo the prime 251).
const GUARD_PERIOD: usize = 251;

/// Two periods of the guard pattern, so that a period starting anywhere in the first is one
/// slice of it.
const GUARD_PATTERN: [u8; 2 * GUARD_PERIOD] = {
    let mut p = [0u8; 2 * GUARD_PERIOD];
    let mut i = 0;
    while i < p.len() {
        p[i] = guard_byte(i);
        i += 1;
    }
    p
};

/// Writes the guard pattern over `data`, whose first byte is at offset `at` of its buffer,
/// a period at a time: test buffers reach 64 MiB and the suite runs unoptimised, where a
/// loop per byte costs seconds.
pub fn fill_guard(data: &mut [u8], at: usize) {
    let start = at % GUARD_PERIOD;
    // Every chunk starts a whole number of periods after `at`.
    for chunk in data.chunks_mut(GUARD_PERIOD) {
        chunk.copy_from_slice(&GUARD_PATTERN[start..start + chunk.len()]);
    }
}

/// Fills `data` from `seed` (random bytes) or, with `None`, with the guard pattern.
pub fn fill(data: &mut [u8], seed: Option<u64>) {
    match seed {
        Some(s) => {
            let mut rng = Rng::new(s);
            for chunk in data.chunks_mut(8) {
                let v = rng.next_u64().to_le_bytes();
                chunk.copy_from_slice(&v[..chunk.len()]);
            }
        }
        None => fill_guard(data, 0),
    }
}

/// A registered host buffer, in memory a helper process can attach ([`crate::shared_mem`]).
/// Fields drop in order: the registration before the memory.
pub struct Buffer {
    /// The registration (dropped first).
    pub registration: Option<Registration>,
    data: SharedMem,
    addr: u64,
}

impl Buffer {
    /// A buffer of `len` bytes filled from `seed` (`None` fills with the guard pattern).
    pub fn new(len: usize, seed: Option<u64>) -> Self {
        let mut data = SharedMem::new(len);
        fill(data.as_mut_slice(), seed);
        let addr = data.addr();
        Buffer {
            registration: None,
            data,
            addr,
        }
    }

    /// Registers the whole buffer with `t`.
    pub fn register<T: Transport>(mut self, t: &mut T) -> TransportResult<Self> {
        self.registration = Some(t.register(MemoryKind::Host, self.range())?);
        Ok(self)
    }

    /// Absolute address of byte `offset`.
    pub fn addr(&self, offset: u64) -> u64 {
        self.addr + offset
    }

    /// The whole buffer as a range.
    pub fn range(&self) -> AddrRange {
        AddrRange::new(self.addr, self.len() as u64)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.as_slice().len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes (read only after the transfers touching them completed).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// The bytes, to write (only while no transfer touches them).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }

    /// FNV-1a-style checksum of a sub-range, taken a 64-bit word at a time (the suite runs
    /// unoptimised) and then the tail bytes.
    pub fn checksum(&self, offset: u64, len: u64) -> u64 {
        let s = &self.bytes()[offset as usize..(offset + len) as usize];
        let mix = |h: u64, v: u64| (h ^ v).wrapping_mul(0x100_0000_01b3);
        let words = s.chunks_exact(8);
        let tail = words.remainder();
        let h = words.fold(0xcbf2_9ce4_8422_2325u64, |h, w| {
            mix(h, u64::from_le_bytes(w.try_into().expect("8 bytes")))
        });
        tail.iter().fold(h, |h, &b| mix(h, u64::from(b)))
    }
}

/// One expected copy, as offsets into a source and a destination buffer.
#[derive(Debug, Clone, Copy)]
pub struct Copy {
    /// Offset in the source buffer.
    pub src: u64,
    /// Offset in the destination buffer.
    pub dst: u64,
    /// Length.
    pub len: u64,
}

/// Checks that every copy landed and that every other destination byte still holds its
/// guard value. Returns a description of the first problem.
pub fn verify(src: &Buffer, dst: &Buffer, copies: &[Copy]) -> Result<(), String> {
    for (i, c) in copies.iter().enumerate() {
        let (s, d, n) = (c.src as usize, c.dst as usize, c.len as usize);
        if src.bytes()[s..s + n] != dst.bytes()[d..d + n] {
            let first = (0..n)
                .find(|&k| src.bytes()[s + k] != dst.bytes()[d + k])
                .unwrap_or(0);
            return Err(format!("copy {i} ({c:?}) differs at byte {first}"));
        }
    }
    // The gaps between the written ranges, compared as slices against the guard pattern.
    let mut written: Vec<(usize, usize)> = copies
        .iter()
        .map(|c| (c.dst as usize, (c.dst + c.len) as usize))
        .collect();
    written.sort_unstable();
    let mut guard = vec![0u8; dst.len()];
    fill_guard(&mut guard, 0);
    let bytes = dst.bytes();
    let overwritten = |a: usize, b: usize| {
        let i = (a..b).find(|&i| bytes[i] != guard[i]).unwrap_or(a);
        Err(format!("guard byte {i} outside every copy was overwritten"))
    };
    let mut at = 0;
    for &(start, end) in &written {
        if start > at && bytes[at..start] != guard[at..start] {
            return overwritten(at, start);
        }
        at = at.max(end);
    }
    if bytes[at..] != guard[at..] {
        return overwritten(at, bytes.len());
    }
    Ok(())
}

/// `n` random non-overlapping destination ranges of `min..=max` bytes with random gaps,
/// each paired with a random source offset; returns the copies and the buffer sizes needed.
pub fn random_copies(rng: &mut Rng, n: usize, min: u64, max: u64) -> (Vec<Copy>, u64, u64) {
    let mut copies = Vec::with_capacity(n);
    let mut at = rng.range(0, 64);
    let lens: Vec<u64> = (0..n).map(|_| rng.range(min, max)).collect();
    let src_len: u64 = lens.iter().sum::<u64>() + 4096;
    for &len in &lens {
        let src = rng.range(0, src_len - len);
        copies.push(Copy { src, dst: at, len });
        at += len + rng.range(0, 16);
    }
    // Shuffle the order so destinations are not sorted (Fisher-Yates).
    for i in (1..copies.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        copies.swap(i, j);
    }
    (copies, src_len, at + rng.range(1, 64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source of random bytes and a guard-filled destination with two copies applied.
    fn copied() -> (Buffer, Buffer, Vec<Copy>) {
        let src = Buffer::new(1000, Some(1));
        let mut dst = Buffer::new(1200, None);
        let copies = vec![
            Copy {
                src: 10,
                dst: 600,
                len: 300,
            },
            Copy {
                src: 500,
                dst: 100,
                len: 200,
            },
        ];
        for c in &copies {
            let (s, d, n) = (c.src as usize, c.dst as usize, c.len as usize);
            let part = src.bytes()[s..s + n].to_vec();
            dst.bytes_mut()[d..d + n].copy_from_slice(&part);
        }
        (src, dst, copies)
    }

    #[test]
    fn the_guard_fill_is_the_guard_byte_at_every_offset() {
        let mut data = vec![0u8; 3 * GUARD_PERIOD + 17];
        fill_guard(&mut data, 0);
        assert!(data.iter().enumerate().all(|(i, &b)| b == guard_byte(i)));
        fill_guard(&mut data, 5);
        assert!(
            data.iter()
                .enumerate()
                .all(|(i, &b)| b == guard_byte(i + 5))
        );
    }

    #[test]
    fn exact_copies_verify() {
        let (src, dst, copies) = copied();
        verify(&src, &dst, &copies).expect("exact copies");
    }

    #[test]
    fn a_guard_byte_overwritten_before_between_or_after_the_copies_is_named() {
        for at in [0usize, 99, 300, 599, 900, 1199] {
            let (src, mut dst, copies) = copied();
            dst.bytes_mut()[at] ^= 0xff;
            let err = verify(&src, &dst, &copies).expect_err("overwritten guard");
            assert_eq!(
                err,
                format!("guard byte {at} outside every copy was overwritten")
            );
        }
    }

    #[test]
    fn a_copy_that_differs_is_named_with_its_first_byte() {
        let (src, mut dst, copies) = copied();
        dst.bytes_mut()[100 + 7] ^= 1;
        let err = verify(&src, &dst, &copies).expect_err("differing copy");
        assert!(
            err.starts_with("copy 1 ") && err.ends_with("differs at byte 7"),
            "{err}"
        );
    }

    #[test]
    fn the_checksum_sees_a_change_in_a_word_and_in_the_tail() {
        let mut b = Buffer::new(100, Some(2));
        let before = b.checksum(3, 90);
        for at in [3usize, 50, 92] {
            b.bytes_mut()[at] ^= 1;
            assert_ne!(b.checksum(3, 90), before, "byte {at}");
            b.bytes_mut()[at] ^= 1;
        }
        assert_eq!(b.checksum(3, 90), before);
    }
}
