//! [`AdmissionQueue`]: non-blocking FIFO admission for the receiver's single
//! control thread, which must never block on admission.

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use super::fifo_semaphore::{Waiter, Wake, Withdrawn};
use super::{AdmitError, Ledger, Reservation};
use crate::sync::Arc;

/// Requests parked until the ledger has room for them, in FIFO order.
///
/// Parked entries are queued in the ledger's *own* wait queue (the FIFO
/// semaphore the slot allocator uses too), so admission stays first-come
/// first-served: [`Ledger::try_admit`] never jumps ahead of them. They count
/// in [`LedgerStats::waiters`](super::LedgerStats) until granted.
///
/// Capacity is handed to a parked entry by whichever thread frees it (direct
/// hand-off, the same as for blocked threads); the owner collects granted
/// entries with [`grant_ready`](Self::grant_ready). A granted entry holds its
/// chunks in `committed` until collected, so call `grant_ready` whenever the
/// control thread wakes up; [`with_waker`](Self::with_waker) installs a
/// callback (e.g. a `mio::Waker`) that the granting thread calls.
///
/// Use one ledger per queue. Dropping the queue withdraws every parked entry
/// and gives back any granted but uncollected capacity.
pub struct AdmissionQueue<K> {
    entries: VecDeque<Parked<K>>,
    waker: Option<Arc<dyn Fn() + Send + Sync>>,
}

struct Parked<K> {
    key: K,
    deadline: Instant,
    ledger: Ledger,
    waiter: Arc<Waiter>,
}

impl<K: Clone + Eq> Default for AdmissionQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Clone + Eq> AdmissionQueue<K> {
    /// An empty queue without a waker.
    pub fn new() -> Self {
        Self {
            entries: VecDeque::new(),
            waker: None,
        }
    }

    /// An empty queue whose `waker` is called (from the thread that freed
    /// the capacity, outside any lock) when a parked entry gets granted.
    pub fn with_waker(waker: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            entries: VecDeque::new(),
            waker: Some(Arc::new(waker)),
        }
    }

    /// Admits `n` chunks now if nobody is parked or queued ahead and they
    /// fit (`Ok(Some(reservation))`); otherwise parks the request under
    /// `key` (`Ok(None)`). `n > capacity` is `TooLarge` at once and a
    /// request that cannot be admitted now with `deadline` already past is
    /// `Timeout` at once; in both cases nothing is parked.
    pub fn admit_or_park(
        &mut self,
        ledger: &Ledger,
        key: K,
        n: usize,
        deadline: Instant,
    ) -> Result<Option<Reservation>, AdmitError> {
        if self.entries.is_empty() {
            match ledger.try_admit(n) {
                Ok(r) => return Ok(Some(r)),
                Err(AdmitError::WouldBlock) => {}
                Err(e) => return Err(e),
            }
        } else if n > ledger.capacity() {
            return Err(ledger.too_large(n));
        }
        if Instant::now() >= deadline {
            return Err(AdmitError::Timeout);
        }
        let waiter = ledger.sem().enqueue(n, Wake::Callback(self.waker.clone()));
        if self.entries.is_empty() && waiter.is_granted() {
            // Capacity appeared between try_admit and enqueue.
            return Ok(Some(Reservation::new(ledger.clone(), n)));
        }
        tracing::trace!(n, parked = self.entries.len() + 1, "admission parked");
        self.entries.push_back(Parked {
            key,
            deadline,
            ledger: ledger.clone(),
            waiter,
        });
        Ok(None)
    }

    /// Collects parked requests that were granted, in FIFO order. Call it
    /// after capacity was freed (or on the waker). The ledger grants at the
    /// moment of the free; this also re-runs the grant loop once in case.
    pub fn grant_ready(&mut self, ledger: &Ledger) -> Vec<(K, Reservation)> {
        if let Some(head) = self.entries.front() {
            if !head.waiter.is_granted() {
                ledger.sem().grant_waiters();
            }
        }
        let mut out = Vec::new();
        while self.entries.front().is_some_and(|e| e.waiter.is_granted()) {
            if let Some(e) = self.entries.pop_front() {
                let n = e.waiter.units();
                out.push((e.key, Reservation::new(e.ledger, n)));
            }
        }
        out
    }

    /// Removes every parked (not yet granted) request whose deadline is
    /// `<= now` and returns their keys in FIFO order. Granted entries are
    /// left for [`grant_ready`](Self::grant_ready). Call `grant_ready`
    /// afterwards: removing a large head may let smaller requests behind it
    /// in — but never one that was itself past its deadline.
    pub fn expire(&mut self, now: Instant) -> Vec<K> {
        let mut expired = Vec::new();
        // Back to front: withdrawing the head hands its place to the
        // waiters behind it, so the later expired ones go first, and a
        // request past its deadline is never admitted by an earlier one's
        // withdrawal within the same call. (Front to back, the proptest
        // model caught exactly that: a head expiring granted a 0-chunk
        // request behind it that had expired too.)
        let mut i = self.entries.len();
        while i > 0 {
            i -= 1;
            let e = &self.entries[i];
            if e.deadline <= now && e.ledger.sem().withdraw(&e.waiter) == Withdrawn::Removed {
                if let Some(e) = self.entries.remove(i) {
                    expired.push(e.key);
                }
            }
        }
        expired.reverse();
        expired
    }

    /// Removes the request parked under `key` (e.g. it was cancelled). If it
    /// had already been granted, its capacity is given back. Returns whether
    /// `key` was found.
    pub fn remove(&mut self, key: &K) -> bool {
        match self.entries.iter().position(|e| e.key == *key) {
            Some(pos) => {
                if let Some(e) = self.entries.remove(pos) {
                    e.withdraw();
                }
                true
            }
            None => false,
        }
    }

    /// Number of parked requests (including granted ones not yet collected).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no request is parked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The earliest deadline among the parked requests.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries.iter().map(|e| e.deadline).min()
    }
}

impl<K> Parked<K> {
    /// Takes the entry out of the ledger's queue, giving back a grant.
    fn withdraw(self) {
        if self.ledger.sem().withdraw(&self.waiter) == Withdrawn::WasGranted {
            self.ledger.release_reserved(self.waiter.units());
        }
    }
}

impl<K> Drop for AdmissionQueue<K> {
    fn drop(&mut self) {
        for e in self.entries.drain(..) {
            e.withdraw();
        }
    }
}

impl<K> fmt::Debug for AdmissionQueue<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionQueue")
            .field("parked", &self.entries.len())
            .finish()
    }
}
