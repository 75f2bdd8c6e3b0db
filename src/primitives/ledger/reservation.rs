//! [`Reservation`]: the RAII handle for admitted-but-not-yet-allocated chunks.

use std::fmt;

use super::error::OverAllocate;
use super::Ledger;

/// Chunks admitted for one request and not yet allocated to slots.
///
/// Created by [`Ledger::try_admit`] or an
/// [`AdmissionQueue`](super::AdmissionQueue). [`allocate`](Self::allocate)
/// turns reserved chunks into allocated ones; that cannot fail while chunks
/// remain, because they were counted in `committed` at admission.
/// Dropping the reservation gives back whatever is still reserved, so no
/// error path leaks capacity. Allocated chunks are returned separately with
/// [`Ledger::free`] when their slot is freed.
#[must_use = "dropping a Reservation releases it at once"]
pub struct Reservation {
    ledger: Ledger,
    remaining: usize,
}

impl Reservation {
    pub(super) fn new(ledger: Ledger, n: usize) -> Self {
        Self {
            ledger,
            remaining: n,
        }
    }

    /// Converts `k` reserved chunks into allocated ones. Fails only if
    /// `k > remaining()` (a caller bug), and then changes nothing.
    pub fn allocate(&mut self, k: usize) -> Result<(), OverAllocate> {
        if k > self.remaining {
            return Err(OverAllocate {
                requested: k,
                remaining: self.remaining,
            });
        }
        self.remaining -= k;
        self.ledger.note_allocated(k);
        Ok(())
    }

    /// Chunks still reserved (admitted, not yet allocated).
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// The ledger this reservation belongs to.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Gives back the chunks still reserved; returns how many.
    pub fn release(mut self) -> usize {
        self.release_remaining()
    }

    fn release_remaining(&mut self) -> usize {
        let r = std::mem::take(&mut self.remaining);
        self.ledger.release_reserved(r);
        r
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.remaining > 0 {
            self.release_remaining();
        }
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("remaining", &self.remaining)
            .finish()
    }
}
