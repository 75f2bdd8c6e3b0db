//! What more than one bench needs (not a bench target itself: Cargo
//! discovers only `benches/*.rs` and `benches/*/main.rs`).

#![allow(dead_code)] // each bench uses its own subset

use std::hint::black_box;

/// A page-aligned buffer of `len` bytes filled with `byte`, touched (no
/// page fault is timed). Every buffer the engine copies between is
/// page-aligned (staging, the receive buffer, registered memory), so a
/// memcpy baseline's must be too: a `Vec` of this size starts 16 bytes
/// into its first page, or anywhere once glibc serves it from its heap, and
/// glibc's `rep movsb` copy runs 2–3.5× slower between a page-aligned
/// source and such a destination (1.8 vs 6.4 GiB/s on 2026-12-01's VM;
/// 7.7 vs 15.5–21 GiB/s on 2026-12-07's AMD VM), which made the baseline,
/// not the engine, the slow side of a ratio, by chance of the allocator.
pub fn page_aligned(len: usize, byte: u8) -> memmap2::MmapMut {
    let mut m = memmap2::MmapMut::map_anon(len).expect("bench: baseline buffer mapping");
    m.fill(byte);
    m
}

/// The memcpy baseline: one thread copying `src` into `dst` in
/// `chunk`-sized copies, one per chunk as the engine's copy engine does
/// (up to the shorter of the two).
pub fn memcpy_chunks(src: &[u8], dst: &mut [u8], chunk: usize) {
    for (s, d) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
        d.copy_from_slice(s);
    }
    black_box(dst.as_ptr());
}
