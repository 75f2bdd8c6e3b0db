//! The sender's staging-slot allocator: a bitmap over fixed-size slots with
//! all-or-nothing multi-slot allocation (DESIGN.md invariant 2: a batch
//! takes all its staging slots or none, so a batch never holds part of the
//! staging area while it waits for the rest).
//!
//! Counting and waiting go through the same FIFO hand-off semaphore as the
//! ledger: `alloc(n)` first takes `n` permits (so it never holds a partial
//! set), then claims `n` clear bits, which always exist because there are
//! at least as many clear bits as permits granted but not yet claimed. `free` clears the bits first and
//! then returns the permits, waking the queued allocators that now fit.

mod bitmap;
mod error;
mod slot_set;

use std::cell::Cell;
use std::fmt;
use std::time::Instant;

use bitvec::vec::BitVec;
use smallvec::SmallVec;

pub use error::AllocError;
pub use slot_set::SlotSet;

use crate::cancel::CancelToken;
use crate::ledger::fifo_semaphore::{AcquireError, FifoSemaphore, Waiter, Wake, Withdrawn};
use crate::sync::{Arc, AtomicUsize, Ordering};
use bitmap::AtomicBitmap;

/// A bitmap allocator over fixed-size staging slots. A cheap, cloneable
/// handle (an `Arc` inside); `free` may be called from any thread.
#[derive(Clone)]
pub struct SlotAllocator {
    inner: Arc<Inner>,
}

struct Inner {
    /// Permits = slots; `committed` = slots handed out (or being claimed).
    sem: FifoSemaphore,
    bits: AtomicBitmap,
    /// Slots passed to `free` that were not in use (caller bugs, ignored).
    bad_frees: AtomicUsize,
}

thread_local! {
    /// Per-thread starting word for the bitmap scan, so threads start in
    /// different words and rarely collide on one cache line.
    static HINT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The calling thread's starting word. Deterministic (always 0) under the
/// shuttle model, where all model threads share one OS thread.
fn hint() -> usize {
    if cfg!(feature = "shuttle-model") {
        return 0;
    }
    HINT.with(|h| {
        let v = h.get();
        if v != usize::MAX {
            return v;
        }
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        // Relaxed: only spreads threads over words; no data depends on it.
        // Stride 8 words = one 64-byte cache line of words.
        let v = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) * 8;
        h.set(v);
        v
    })
}

fn set_hint(word: usize) {
    if !cfg!(feature = "shuttle-model") {
        HINT.with(|h| h.set(word));
    }
}

impl SlotAllocator {
    /// An allocator over `slots` slots (indices `0..slots`; at most
    /// `u32::MAX + 1`, larger values are clamped).
    pub fn new(slots: usize) -> Self {
        let slots = slots.min(u32::MAX as usize + 1);
        Self {
            inner: Arc::new(Inner {
                sem: FifoSemaphore::new(slots),
                bits: AtomicBitmap::new(slots),
                bad_frees: AtomicUsize::new(0),
            }),
        }
    }

    /// Total number of slots.
    pub fn capacity(&self) -> usize {
        self.inner.sem.capacity()
    }

    fn claim(&self, n: usize) -> SlotSet {
        let mut out: SmallVec<[u32; 16]> = SmallVec::with_capacity(n);
        if n > 0 {
            let words = self.inner.bits.words();
            let h = hint();
            let start = if h < words { h } else { h % words };
            let end = self.inner.bits.claim(n, start, &mut out);
            set_hint(end);
            out.sort_unstable();
        }
        SlotSet::from_sorted(out)
    }

    /// Takes `n` slots at once or none. `None` if they are not free now, if
    /// allocators are queued ahead (FIFO), or if `n > capacity()`.
    /// `n == 0` gives an empty set.
    pub fn try_alloc(&self, n: usize) -> Option<SlotSet> {
        self.inner.sem.try_acquire(n).ok()?;
        Some(self.claim(n))
    }

    /// Takes `n` slots at once, waiting in FIFO order (spin, yield, park)
    /// until they are free, `deadline` passes or `cancel` is cancelled.
    /// Never holds part of the set while waiting. `n > capacity()` fails at
    /// once with [`AllocError::TooLarge`].
    pub fn alloc(
        &self,
        n: usize,
        deadline: Option<Instant>,
        cancel: &CancelToken,
    ) -> Result<SlotSet, AllocError> {
        match self.inner.sem.acquire(n, deadline, cancel) {
            Ok(()) => Ok(self.claim(n)),
            Err(AcquireError::TooLarge) => Err(AllocError::TooLarge {
                requested: n,
                slots: self.capacity(),
            }),
            Err(AcquireError::Timeout) => Err(AllocError::Timeout),
            Err(AcquireError::Cancelled) => Err(AllocError::Cancelled),
        }
    }

    /// Queues a request for `n` slots without blocking, for a thread that
    /// must not wait (the sender's ctrl thread). It takes its place in the
    /// same FIFO queue as [`alloc`](Self::alloc): whoever frees slots hands
    /// them over in order and calls `waker`; the owner then collects them
    /// with [`SlotRequest::take`]. Dropping the request withdraws it (and
    /// gives back slots granted but not taken). `n > capacity()` fails at
    /// once with [`AllocError::TooLarge`].
    pub fn request(
        &self,
        n: usize,
        waker: impl Fn() + Send + Sync + 'static,
    ) -> Result<SlotRequest, AllocError> {
        if n > self.capacity() {
            return Err(AllocError::TooLarge {
                requested: n,
                slots: self.capacity(),
            });
        }
        let waker: Arc<dyn Fn() + Send + Sync> = Arc::new(waker);
        let waiter = (n > 0).then(|| self.inner.sem.enqueue(n, Wake::Callback(Some(waker))));
        Ok(SlotRequest {
            alloc: self.clone(),
            waiter,
            n,
            taken: false,
        })
    }

    /// Gives the slots of `set` back and wakes queued allocators that now
    /// fit. Slots that are not in use (or out of range) are ignored and
    /// counted in [`bad_frees`](Self::bad_frees); they never corrupt the
    /// count. (A slot freed by someone who does not own it while another
    /// owner holds it cannot be detected: callers must free only their own.)
    pub fn free(&self, set: SlotSet) {
        self.free_sorted(set.iter());
    }

    /// Gives one slot back (see [`free`](Self::free)).
    pub fn free_one(&self, slot: u32) {
        self.free_sorted(std::iter::once(slot));
    }

    fn free_sorted(&self, sorted: impl IntoIterator<Item = u32>) {
        let c = self.inner.bits.clear(sorted);
        if c.bad > 0 {
            // Relaxed: diagnostics counter.
            self.inner.bad_frees.fetch_add(c.bad, Ordering::Relaxed);
            tracing::debug!(bad = c.bad, "freed staging slots that were not in use");
        }
        // Bits are clear before the permits come back (program order, and
        // the semaphore's SeqCst release), so a grantee finds them.
        self.inner.sem.release(c.cleared);
    }

    /// Slots in use (handed out, or permits taken and bits being claimed).
    pub fn in_use(&self) -> usize {
        self.inner.sem.committed()
    }

    /// True if `slot` is handed out right now (false for a free or
    /// out-of-range slot). Lock-free and read-only; a point-in-time answer
    /// (another thread may allocate or free it right after).
    pub fn is_in_use(&self, slot: u32) -> bool {
        self.inner.bits.is_set(slot as usize)
    }

    /// Allocators queued in `alloc`.
    pub fn waiters(&self) -> usize {
        self.inner.sem.waiters()
    }

    /// Slots passed to `free`/`free_one` that were not in use (ignored).
    pub fn bad_frees(&self) -> usize {
        // Relaxed: diagnostics counter.
        self.inner.bad_frees.load(Ordering::Relaxed)
    }

    /// A debug view of the bitmap, one bit per slot, 1 = in use.
    pub fn snapshot(&self) -> BitVec<u64> {
        self.inner.bits.snapshot()
    }
}

impl fmt::Debug for SlotAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotAllocator")
            .field("capacity", &self.capacity())
            .field("in_use", &self.in_use())
            .field("waiters", &self.waiters())
            .finish()
    }
}

/// A queued, non-blocking slot request (see [`SlotAllocator::request`]).
#[must_use]
pub struct SlotRequest {
    alloc: SlotAllocator,
    /// `None` for a request of zero slots.
    waiter: Option<Arc<Waiter>>,
    n: usize,
    taken: bool,
}

impl fmt::Debug for SlotRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRequest")
            .field("n", &self.n)
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl SlotRequest {
    /// Slots requested.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True for a request of zero slots.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The slots were handed over and can be taken.
    pub fn is_ready(&self) -> bool {
        !self.taken && self.waiter.as_ref().is_none_or(|w| w.is_granted())
    }

    /// The slots, once granted (then the request is spent: later calls
    /// return `None`).
    pub fn take(&mut self) -> Option<SlotSet> {
        if !self.is_ready() {
            return None;
        }
        self.taken = true;
        Some(self.alloc.claim(self.n))
    }
}

impl Drop for SlotRequest {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        if let Some(w) = &self.waiter {
            if self.alloc.inner.sem.withdraw(w) == Withdrawn::WasGranted {
                // Granted but never claimed: give the units back.
                self.alloc.inner.sem.release(self.n);
            }
        }
    }
}

#[cfg(all(test, not(feature = "shuttle-model")))]
mod request_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize as StdAtomic, Ordering as StdOrdering};

    #[test]
    fn queued_request_is_granted_in_fifo_order_and_wakes_its_owner() {
        let a = SlotAllocator::new(4);
        let held = a.try_alloc(3).expect("3 free");
        let woken = std::sync::Arc::new(StdAtomic::new(0));
        let w = std::sync::Arc::clone(&woken);
        let mut r = a
            .request(2, move || {
                w.fetch_add(1, StdOrdering::SeqCst);
            })
            .expect("fits capacity");
        assert!(!r.is_ready() && r.take().is_none());
        assert!(
            a.try_alloc(1).is_none(),
            "no queue jumping past the request"
        );
        a.free(held);
        assert_eq!(
            woken.load(StdOrdering::SeqCst),
            1,
            "the freeing thread woke the owner"
        );
        let set = r.take().expect("granted");
        assert_eq!(set.len(), 2);
        assert!(r.take().is_none(), "spent");
        a.free(set);
        assert_eq!(a.in_use(), 0);
        assert!(matches!(
            a.request(5, || {}),
            Err(AllocError::TooLarge { .. })
        ));
    }

    #[test]
    fn dropped_requests_leave_no_trace() {
        let a = SlotAllocator::new(2);
        let held = a.try_alloc(2).expect("free");
        let pending = a.request(2, || {}).expect("fits");
        drop(pending);
        assert_eq!(a.waiters(), 0, "withdrawn");
        a.free(held);
        let granted = a.request(1, || {}).expect("fits");
        assert!(granted.is_ready());
        drop(granted);
        assert_eq!(a.in_use(), 0, "granted but untaken slots go back");
        assert!(a.try_alloc(2).is_some());
    }
}
