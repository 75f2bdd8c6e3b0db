//! The copy engine's copy: non-temporal ("streaming") stores for large
//! copies on x86-64, a plain `memcpy` otherwise.
//!
//! The engine writes each receive slot once and never reads it back; the
//! decoder (a GPU's DMA, another process) reads it later. Ordinary stores
//! first read every destination line into the cache (read for ownership)
//! and fill the shared L3 with lines nobody on this core needs, evicting
//! the staging bytes the next copies read. With several requests in flight
//! the working set (staging plus receive slots) outgrows the 2-vCPU VM's
//! 32 MiB L3, and the engine's copy fell from memcpy speed (11 GiB/s with
//! one request in flight) to 6 GiB/s with three (`docs/benchmarks.md`,
//! "Python end to end"). Streaming stores skip the read and the cache.
//! glibc's `memcpy` switches to them only above ~3/4 of the L3 per call,
//! far above a 256 KiB chunk.

/// Copies at least this long stream; shorter ones (a 4 KiB chunk, whose
/// receiver may read it at once from the cache) use `memcpy`.
pub(super) const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst`, streaming when `len >=
/// STREAM_MIN` on x86-64. The streamed stores are fenced (`sfence`) before
/// it returns, so a Release store after it (the completion's publish)
/// orders them like ordinary stores.
///
/// # Safety
///
/// `src` is valid for reads and `dst` for writes of `len` bytes, the two
/// ranges do not overlap, and nobody else writes `dst` meanwhile.
pub(super) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: the caller's contract, passed on.
        unsafe { stream_x86_64(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Streams `len` bytes: a plain copy up to the first 16-byte-aligned
/// destination address, 64-byte blocks of unaligned loads and aligned
/// non-temporal stores, a plain copy of the tail, then `sfence`.
///
/// # Safety
///
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_x86_64(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: `head <= len`: inside both ranges (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 64 <= len {
        // SAFETY: `i + 64 <= len`, so all four 16-byte loads and stores lie
        // inside the ranges; `dst + i` is 16-byte aligned (`head` aligned
        // it and `i` advances by 64), as `_mm_stream_si128` needs; the
        // loads may be unaligned. SSE2 is part of the x86-64 baseline.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: `i <= len`: the tail lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
    // SAFETY: `sfence` has no memory operands. It orders the streamed
    // (weakly ordered) stores before every later store, so the engine's
    // Release publish of the completion cannot be seen before them.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every alignment of source and destination, lengths around the
    /// streaming threshold and the 64-byte block: the bytes arrive exactly,
    /// and nothing outside the destination range changes.
    #[test]
    fn copies_every_alignment_and_length_exactly() {
        let src: Vec<u8> = (0..STREAM_MIN + 300).map(|i| (i * 7 + 3) as u8).collect();
        for len in [
            0,
            1,
            63,
            64,
            65,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 1,
            STREAM_MIN + 63,
        ] {
            for s_off in 0..3 {
                for d_off in 0..17 {
                    let mut dst = vec![0xeeu8; len + 40];
                    // SAFETY: `src[s_off..s_off + len]` and
                    // `dst[d_off..d_off + len]` are in bounds (src has 300
                    // spare bytes, dst 40) and distinct allocations.
                    unsafe { copy(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len) };
                    assert_eq!(
                        &dst[d_off..d_off + len],
                        &src[s_off..s_off + len],
                        "len {len} src+{s_off} dst+{d_off}"
                    );
                    assert!(
                        dst[..d_off].iter().all(|&b| b == 0xee),
                        "wrote before the range"
                    );
                    assert!(
                        dst[d_off + len..].iter().all(|&b| b == 0xee),
                        "wrote after the range"
                    );
                }
            }
        }
    }
}
