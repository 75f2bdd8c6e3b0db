//! Shared helpers of the transport tests (shm, tcp, rdma): building write
//! ops, posting them within the credit limit, and collecting completions
//! with a deadline that names what hung.
#![allow(dead_code)] // each test file uses its own subset

use std::time::{Duration, Instant};

use kvferry::region::Region;
use kvferry::transport::{Completion, Completions, PollStatus, Poster, WriteOp};

/// Copies the first `len` bytes (at most the chunk size) of receive-buffer
/// slot `slot` out of `region`. Call it only once the writes to that slot
/// have completed (the tests collect their completions first).
pub fn read_slot(region: &Region, slot: u32, len: usize) -> Vec<u8> {
    let ptr = region
        .slot_ptr(slot)
        .unwrap_or_else(|| panic!("slot {slot} is outside the region"));
    let len = len.min(region.chunk_bytes() as usize);
    // SAFETY: `ptr..ptr + len` lies inside the slot (len <= chunk_bytes) of
    // a live mapping; every transfer into it has completed, so nothing
    // writes these bytes while we copy them.
    unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec()
}

/// How long any single wait in these tests may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// A write op of `len` bytes from staging offset `local_offset` to receive
/// buffer offset `remote_offset` at `peer`.
pub fn op(work_id: u64, local_offset: u64, remote_offset: u64, len: u64, peer: u32) -> WriteOp {
    WriteOp {
        work_id,
        local_offset,
        remote_offset,
        len,
        peer,
        local_region: 0,
    }
}

/// Polls until `n` completions arrived; fails naming what hung.
pub fn collect(comps: &mut dyn Completions, n: usize, what: &str) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        let want = n - out.len();
        match comps.poll(&mut out, want, Some(deadline)) {
            PollStatus::Ready(_) => {}
            s => panic!(
                "{what}: waiting for {n} completions, got {} then {s:?}",
                out.len()
            ),
        }
    }
    out
}

/// Posts all `ops`, polling completions whenever credits run out.
pub fn post_all(
    poster: &mut dyn Poster,
    comps: &mut dyn Completions,
    ops: &[WriteOp],
) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut done = Vec::new();
    let mut next = 0;
    while next < ops.len() {
        next += poster.post(&ops[next..]).unwrap();
        if next < ops.len() {
            assert!(
                poster.in_flight() > 0,
                "post accepted nothing with nothing in flight"
            );
            match comps.poll(&mut done, usize::MAX, Some(deadline)) {
                PollStatus::Ready(_) => {}
                s => panic!("post_all: completion poll hung or closed: {s:?}"),
            }
        }
    }
    let missing = ops.len() - done.len();
    done.extend(collect(comps, missing, "post_all drain"));
    done
}

/// `len` deterministic non-zero bytes that differ with `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8 + 1)
        .collect()
}
