//! Host-to-host copies as the loopback's copy workers and the bench's ceiling make them:
//! plain `memmove` for small or overlapping pieces, and streaming (non-temporal) stores for
//! transfers too large to stay in cache.
//!
//! A KV transfer is usually far larger than the caches and its destination is not read by
//! the copying core again, so ordinary stores first read each destination line into cache
//! (read-for-ownership) and then evict it: about a third more memory traffic than the copy
//! needs. Streaming stores write whole lines straight to memory. They are weakly ordered, so
//! each copying thread ends with [`fence`] before its completion is published.

/// A transfer moving at least this many bytes in total streams its large pieces: about a
/// core's share of a server's last-level cache. Below it, the destination may well still be
/// in cache when the engine reads it.
pub const STREAM_MIN_BYTES: u64 = 8 << 20;

/// Pieces shorter than this are copied plainly even in a streaming transfer: the aligned
/// head and tail would be most of the work.
pub const STREAM_MIN_PIECE: usize = 4 << 10;

/// How a transfer's pieces are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `ptr::copy` (memmove) for every piece.
    Plain,
    /// Streaming stores for pieces of at least [`STREAM_MIN_PIECE`] bytes.
    Streaming,
}

/// The method for a transfer of `bytes` bytes on this machine.
pub fn method_for(bytes: u64) -> Method {
    if bytes >= STREAM_MIN_BYTES && streaming_supported() {
        Method::Streaming
    } else {
        Method::Plain
    }
}

/// Whether this CPU has the streaming stores used here (x86-64 with AVX2).
pub fn streaming_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `len` bytes from `src` to `dst` with `method`.
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable for the whole call. The
/// ranges may overlap (overlapping pieces are copied plainly). After a streaming copy the
/// caller must call [`fence`] before another thread is told the bytes are there.
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, method: Method) {
    let overlap = (src as usize) < (dst as usize).wrapping_add(len)
        && (dst as usize) < (src as usize).wrapping_add(len);
    if method == Method::Streaming && len >= STREAM_MIN_PIECE && !overlap {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `method_for` only chooses streaming where AVX2 was detected (and a
            // caller passing `Streaming` by hand is checked here again); the ranges are valid
            // per this function's contract and do not overlap.
            if streaming_supported() {
                unsafe { stream_avx2(dst, src, len) };
                return;
            }
        }
    }
    // SAFETY: valid ranges per this function's contract; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// Orders earlier streaming stores before later stores (the completion flag's).
pub fn fence(method: Method) {
    #[cfg(target_arch = "x86_64")]
    if method == Method::Streaming {
        // SAFETY: `sfence` has no preconditions (SSE is part of x86-64).
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = method;
}

/// Unaligned 32-byte loads, aligned 32-byte streaming stores, four per 128-byte step; a plain
/// copy for the head up to the destination's alignment and for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    const STEP: usize = 128;
    let head = (dst as usize).wrapping_neg() & 31;
    let head = head.min(len);
    // SAFETY (whole body): every access stays inside `dst..dst+len` and `src..src+len`,
    // which the caller guarantees valid and disjoint; `d` is 32-byte aligned after `head`.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut d = dst.add(head);
        let mut s = src.add(head);
        let mut left = len - head;
        while left >= STEP {
            let a = _mm256_loadu_si256(s.cast::<__m256i>());
            let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
            let c = _mm256_loadu_si256(s.add(64).cast::<__m256i>());
            let e = _mm256_loadu_si256(s.add(96).cast::<__m256i>());
            _mm256_stream_si256(d.cast::<__m256i>(), a);
            _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
            _mm256_stream_si256(d.add(64).cast::<__m256i>(), c);
            _mm256_stream_si256(d.add(96).cast::<__m256i>(), e);
            d = d.add(STEP);
            s = s.add(STEP);
            left -= STEP;
        }
        std::ptr::copy_nonoverlapping(s, d, left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    /// Every combination of misalignment and length around the step and alignment edges
    /// lands exactly the source bytes, and nothing outside the destination range.
    #[test]
    fn streaming_copies_exact_bytes_at_every_alignment() {
        let src = pattern(3 * STREAM_MIN_PIECE + 512);
        for s_off in [0usize, 1, 7, 31, 32, 33] {
            for d_off in [0usize, 1, 5, 31, 32, 63] {
                for len in [
                    STREAM_MIN_PIECE,
                    STREAM_MIN_PIECE + 1,
                    STREAM_MIN_PIECE + 127,
                    STREAM_MIN_PIECE + 128,
                    2 * STREAM_MIN_PIECE + 77,
                ] {
                    let mut dst = vec![0xAAu8; len + 128];
                    unsafe {
                        copy(
                            dst.as_mut_ptr().add(d_off),
                            src.as_ptr().add(s_off),
                            len,
                            Method::Streaming,
                        )
                    };
                    fence(Method::Streaming);
                    assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "head guard");
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA), "tail guard");
                }
            }
        }
    }

    /// Overlapping ranges take memmove's path, so a shifted copy inside one buffer is exact.
    #[test]
    fn overlapping_ranges_copy_like_memmove() {
        for shift in [1usize, 64, STREAM_MIN_PIECE / 2] {
            let mut buf = pattern(4 * STREAM_MIN_PIECE);
            let want = buf[..2 * STREAM_MIN_PIECE].to_vec();
            let p = buf.as_mut_ptr();
            unsafe { copy(p.add(shift), p, 2 * STREAM_MIN_PIECE, Method::Streaming) };
            assert_eq!(&buf[shift..shift + 2 * STREAM_MIN_PIECE], &want[..]);
        }
    }

    #[test]
    fn small_transfers_copy_plainly_and_large_ones_stream_where_supported() {
        assert_eq!(method_for(STREAM_MIN_BYTES - 1), Method::Plain);
        let large = method_for(STREAM_MIN_BYTES);
        assert_eq!(large == Method::Streaming, streaming_supported());
    }
}
