//! The receiver's reservation ledger: admit a request only when its whole
//! chunk count fits, so every later allocation of an admitted request is
//! guaranteed (DESIGN.md invariants 1, 2 and 4; docs/admission.md).
//!
//! Words used everywhere: *reserved* = chunks admitted but not yet allocated
//! to a slot; *allocated* = slots held; *committed* = reserved + allocated.
//! One atomic counter `committed` never exceeds the capacity.
//!
//! - [`Ledger::try_admit`]: lock-free CAS, never blocks.
//! - [`AdmissionQueue`]: for the receiver's control thread, which must never
//!   block: requests that do not fit are parked in the ledger's FIFO queue,
//!   granted by whoever frees capacity, and collected without blocking.
//!
//! Admission is first-come first-served: while anyone is queued,
//! `try_admit` does not jump the queue, so a large request is not starved by
//! a stream of small ones.

mod admission_queue;
mod error;
pub(crate) mod fifo_semaphore;
mod reservation;

use std::fmt;

pub use admission_queue::AdmissionQueue;
pub use error::{AdmitError, OverAllocate};
pub use reservation::Reservation;

use crate::sync::{Arc, AtomicUsize, Ordering};
use fifo_semaphore::{FifoSemaphore, TryAcquireError};

/// The receiver's reservation ledger. A cheap, cloneable handle (an `Arc`
/// inside); clones share one ledger.
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Inner {
    /// `committed` (reserved + allocated) and the FIFO wait queue.
    sem: FifoSemaphore,
    /// Allocated chunks (slots held). Statistics and the `free` clamp only.
    allocated: AtomicUsize,
    /// Chunks passed to `free` beyond what was allocated (caller bugs).
    over_frees: AtomicUsize,
}

/// A snapshot of the ledger's counters. The fields are read one after the
/// other, so under concurrent use they may be from slightly different
/// instants (`reserved` is computed as `committed - allocated`, saturating).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LedgerStats {
    /// Total capacity in chunks.
    pub capacity: usize,
    /// Reserved + allocated chunks.
    pub committed: usize,
    /// Admitted but not yet allocated chunks.
    pub reserved: usize,
    /// Chunks allocated to slots and not yet freed.
    pub allocated: usize,
    /// Requests parked by an [`AdmissionQueue`] and not yet granted.
    pub waiters: usize,
}

impl Ledger {
    /// A ledger over `capacity` chunks.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                sem: FifoSemaphore::new(capacity),
                allocated: AtomicUsize::new(0),
                over_frees: AtomicUsize::new(0),
            }),
        }
    }

    /// Total capacity in chunks.
    pub fn capacity(&self) -> usize {
        self.inner.sem.capacity()
    }

    fn too_large(&self, n: usize) -> AdmitError {
        AdmitError::TooLarge {
            requested: n,
            capacity: self.capacity(),
        }
    }

    /// Admits `n` chunks if they fit now and nobody is queued ahead.
    /// Never blocks. `n == 0` gives an empty reservation.
    pub fn try_admit(&self, n: usize) -> Result<Reservation, AdmitError> {
        match self.inner.sem.try_acquire(n) {
            Ok(()) => Ok(Reservation::new(self.clone(), n)),
            Err(TryAcquireError::TooLarge) => Err(self.too_large(n)),
            Err(TryAcquireError::WouldBlock) => Err(AdmitError::WouldBlock),
        }
    }

    /// Returns `k` allocated chunks (their slots were freed) and grants
    /// queued requests that now fit. Freeing more than is allocated is a
    /// caller bug: only what is allocated is freed, the excess is counted in
    /// [`over_frees`](Self::over_frees) and nothing else changes.
    pub fn free(&self, k: usize) {
        if k == 0 {
            return;
        }
        // Relaxed: `allocated` is a plain count (statistics and this clamp);
        // the capacity hand-off itself goes through the SeqCst `committed`.
        let prev = self
            .inner
            .allocated
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| Some(a - k.min(a)))
            .unwrap_or_else(|a| a);
        let freed = k.min(prev);
        if freed < k {
            // Relaxed: an error counter, read only for diagnostics.
            self.inner
                .over_frees
                .fetch_add(k - freed, Ordering::Relaxed);
            tracing::debug!(k, allocated = prev, "Ledger::free of more than allocated");
        }
        self.inner.sem.release(freed);
    }

    /// A snapshot of the counters (see [`LedgerStats`]).
    pub fn stats(&self) -> LedgerStats {
        let allocated = self.inner.allocated.load(Ordering::Relaxed);
        let committed = self.inner.sem.committed();
        LedgerStats {
            capacity: self.capacity(),
            committed,
            reserved: committed.saturating_sub(allocated),
            allocated,
            waiters: self.inner.sem.waiters(),
        }
    }

    /// Chunks passed to [`free`](Self::free) beyond what was allocated
    /// (caller bugs that were ignored).
    pub fn over_frees(&self) -> usize {
        // Relaxed: diagnostics counter.
        self.inner.over_frees.load(Ordering::Relaxed)
    }

    /// Whether two handles refer to the same ledger.
    pub fn same_ledger(&self, other: &Ledger) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn sem(&self) -> &FifoSemaphore {
        &self.inner.sem
    }

    fn note_allocated(&self, k: usize) {
        // Relaxed: statistics count, see `free`.
        self.inner.allocated.fetch_add(k, Ordering::Relaxed);
    }

    fn release_reserved(&self, r: usize) {
        self.inner.sem.release(r);
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Ledger").field(&self.stats()).finish()
    }
}
