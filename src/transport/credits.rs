//! Write credits shared by the poster and completion halves of the copy-engine
//! transports (shm, tcp).

use std::sync::atomic::{AtomicU64, Ordering};

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
