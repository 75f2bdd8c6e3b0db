//! Write credits shared by the poster and completion halves of the copy-engine
//! transports (shm, tcp).

use std::sync::atomic::{AtomicU64, Ordering};

use kvferry_ring::spsc::Producer;

use super::{TransportError, WriteOp};

/// Counts completions returned to the caller; the poster compares it with
/// its own count of posted ops to know how many are in flight.
#[derive(Debug, Default)]
pub(crate) struct Returned(AtomicU64);

impl Returned {
    /// Called by the completion half after it popped `n` completions.
    pub(crate) fn add(&self, n: usize) {
        // Release: pairs with the Acquire in `get`. The completion ring's head
        // was advanced (Release) before this, so a poster that sees the new
        // count and then posts an op makes that head visible to the engine
        // (through the submission ring's Release/Acquire), which therefore
        // finds room for the op's completion.
        self.0.fetch_add(n as u64, Ordering::Release);
    }

    /// Completions returned so far.
    pub(crate) fn get(&self) -> u64 {
        // Acquire: pairs with the Release in `add` (see there).
        self.0.load(Ordering::Acquire)
    }
}

/// Pushes as many of `ops` as the free credits allow onto the submission
/// ring (`None` once the poster closed it) and counts them in `posted`.
/// `Ok(0)` when no credit is free; `Closed` once the engine is gone.
pub(crate) fn push_within_credits(
    sq: Option<&mut Producer<WriteOp>>,
    posted: &mut u64,
    credits: usize,
    returned: &Returned,
    ops: &[WriteOp],
) -> Result<usize, TransportError> {
    let sq = sq.ok_or(TransportError::Closed)?;
    if sq.is_closed() {
        return Err(TransportError::Closed);
    }
    let in_flight = posted.wrapping_sub(returned.get()) as usize;
    let room = credits.saturating_sub(in_flight).min(ops.len());
    if room == 0 {
        return Ok(0);
    }
    // The submission ring has the completion ring's capacity and holds at
    // most the ops in flight, so all `room` ops fit unless the engine is
    // gone.
    let pushed = sq.push_slice(&ops[..room]);
    *posted += pushed as u64;
    if pushed == 0 {
        return Err(TransportError::Closed);
    }
    Ok(pushed)
}
