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
pub fn guard_byte(i: usize) -> u8 {
    (i.wrapping_mul(31).wrapping_add(7) % 251) as u8
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
        None => data
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = guard_byte(i)),
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

    /// FNV-1a checksum of a sub-range.
    pub fn checksum(&self, offset: u64, len: u64) -> u64 {
        let s = &self.bytes()[offset as usize..(offset + len) as usize];
        s.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
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
    let mut written = vec![false; dst.len()];
    for (i, c) in copies.iter().enumerate() {
        let (s, d, n) = (c.src as usize, c.dst as usize, c.len as usize);
        if src.bytes()[s..s + n] != dst.bytes()[d..d + n] {
            let first = (0..n)
                .find(|&k| src.bytes()[s + k] != dst.bytes()[d + k])
                .unwrap_or(0);
            return Err(format!("copy {i} ({c:?}) differs at byte {first}"));
        }
        written[d..d + n].iter_mut().for_each(|w| *w = true);
    }
    match (0..dst.len()).find(|&i| !written[i] && dst.bytes()[i] != guard_byte(i)) {
        Some(i) => Err(format!("guard byte {i} outside every copy was overwritten")),
        None => Ok(()),
    }
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
