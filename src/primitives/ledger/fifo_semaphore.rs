//! [`FifoSemaphore`]: the counting core shared by the ledger and the slot
//! allocator. One atomic counter `committed <= capacity`, a lock-free
//! `try_acquire` fast path, and a FIFO wait queue with *direct hand-off*:
//! whoever returns capacity grants it to the queued waiters at the head, in
//! order, while the head fits, and wakes exactly those waiters.
//!
//! Wait protocol (the no-lost-wakeup argument, model-checked in
//! `tests/ledger_model.rs`):
//! - a waiter, holding the queue lock, increments `waiters` (SeqCst), pushes
//!   itself and then runs the grant loop itself (SeqCst CAS on `committed`);
//! - a releaser decrements `committed` (SeqCst) and then loads `waiters`
//!   (SeqCst); only if it is non-zero does it take the lock and run the grant
//!   loop. With no waiter no lock is taken and no thread is woken.
//!
//! In the single total order of SeqCst operations either the releaser's load
//! of `waiters` comes after the waiter's increment (so the releaser runs the
//! grant loop after the waiter is queued) or the releaser's decrement comes
//! before the waiter's grant loop (so the waiter sees the freed capacity).

use std::collections::VecDeque;
use std::time::Instant;

use smallvec::SmallVec;

use crate::cancel::CancelToken;
use crate::sync::{
    backoff, current_thread, lock, park, park_timeout, Arc, AtomicBool, AtomicUsize, Mutex,
    Ordering, Thread,
};
use kvferry_ring::Step;

/// How a granted waiter is told.
pub(crate) enum Wake {
    /// A thread blocked in [`FifoSemaphore::acquire`]: unpark it.
    Thread(Thread),
    /// A parked request of an [`AdmissionQueue`](super::AdmissionQueue):
    /// call the owner's waker, if it set one.
    Callback(Option<Arc<dyn Fn() + Send + Sync>>),
}

/// One queued request for `n` units.
pub(crate) struct Waiter {
    n: usize,
    /// Set (under the queue lock) when the `n` units were granted to this
    /// waiter; from then on the waiter owns them.
    granted: AtomicBool,
    wake: Wake,
}

impl Waiter {
    /// Whether the waiter's units were granted (it owns them now).
    pub(crate) fn is_granted(&self) -> bool {
        // Acquire: pairs with the Release store in `grant_locked`, so the
        // grant (and the bitmap frees that preceded the capacity release it
        // used) happen-before whatever the waiter does next.
        self.granted.load(Ordering::Acquire)
    }

    /// The number of units requested.
    pub(crate) fn units(&self) -> usize {
        self.n
    }
}

/// Why a non-blocking acquire failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TryAcquireError {
    /// More than the whole capacity.
    TooLarge,
    /// Does not fit now, or others are queued ahead (FIFO).
    WouldBlock,
}

/// Why a blocking acquire failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireError {
    /// More than the whole capacity.
    TooLarge,
    /// The deadline passed first.
    Timeout,
    /// The cancel token was cancelled.
    Cancelled,
}

/// Outcome of taking a queued waiter out of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Withdrawn {
    /// It was still waiting; it is gone and holds nothing.
    Removed,
    /// It had already been granted: the caller owns its units now.
    WasGranted,
}

/// A FIFO counting semaphore with direct hand-off (see the module docs).
pub(crate) struct FifoSemaphore {
    capacity: usize,
    /// Units held (granted and not yet released). Never above `capacity`.
    committed: AtomicUsize,
    /// Number of entries in `queue` (readable without the lock).
    waiters: AtomicUsize,
    queue: Mutex<VecDeque<Arc<Waiter>>>,
}

type Woken = SmallVec<[Arc<Waiter>; 4]>;

impl FifoSemaphore {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            committed: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            queue: Mutex::new(VecDeque::new()),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Units currently held.
    pub(crate) fn committed(&self) -> usize {
        self.committed.load(Ordering::SeqCst)
    }

    /// Queued waiters (blocking threads and parked admission-queue entries).
    pub(crate) fn waiters(&self) -> usize {
        self.waiters.load(Ordering::SeqCst)
    }

    /// CAS `committed += n` if it stays within capacity; ignores the queue.
    fn cas_acquire(&self, n: usize) -> bool {
        let mut cur = self.committed.load(Ordering::SeqCst);
        loop {
            if n > self.capacity - cur {
                return false;
            }
            // SeqCst: this is the waiter side of the Dekker pair described
            // in the module docs (and the plain fast path uses the same op).
            match self.committed.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Non-blocking acquire. FIFO: refuses while anyone is queued.
    pub(crate) fn try_acquire(&self, n: usize) -> Result<(), TryAcquireError> {
        if n > self.capacity {
            return Err(TryAcquireError::TooLarge);
        }
        if n == 0 {
            return Ok(());
        }
        if self.waiters.load(Ordering::SeqCst) != 0 {
            return Err(TryAcquireError::WouldBlock);
        }
        if self.cas_acquire(n) {
            Ok(())
        } else {
            Err(TryAcquireError::WouldBlock)
        }
    }

    /// Returns `n` units and grants queued waiters that now fit.
    pub(crate) fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let prev = self.committed.fetch_sub(n, Ordering::SeqCst);
        debug_assert!(prev >= n, "semaphore released more than it held");
        // SeqCst load after the SeqCst decrement: the releaser side of the
        // Dekker pair (module docs). Zero waiters: no lock, no wake.
        if self.waiters.load(Ordering::SeqCst) != 0 {
            self.grant_waiters();
        }
    }

    /// Takes the lock and grants queued waiters that fit, in order.
    pub(crate) fn grant_waiters(&self) {
        let woken = {
            let mut q = lock(&self.queue);
            self.grant_locked(&mut q)
        };
        wake_all(woken);
    }

    /// Grants the head while it fits. Caller holds the queue lock and wakes
    /// the returned waiters after dropping it.
    fn grant_locked(&self, q: &mut VecDeque<Arc<Waiter>>) -> Woken {
        let mut woken = Woken::new();
        while let Some(head) = q.front() {
            if !self.cas_acquire(head.n) {
                break;
            }
            if let Some(w) = q.pop_front() {
                self.waiters.fetch_sub(1, Ordering::SeqCst);
                // Release: pairs with the Acquire load in `Waiter::is_granted`.
                w.granted.store(true, Ordering::Release);
                woken.push(w);
            }
        }
        woken
    }

    /// Queues a waiter for `n` units (n <= capacity, n > 0) and runs the
    /// grant loop, so the returned waiter may already be granted.
    pub(crate) fn enqueue(&self, n: usize, wake: Wake) -> Arc<Waiter> {
        let w = Arc::new(Waiter {
            n,
            granted: AtomicBool::new(false),
            wake,
        });
        let woken = {
            let mut q = lock(&self.queue);
            // SeqCst increment before the grant loop's CAS: waiter side of
            // the Dekker pair (module docs).
            self.waiters.fetch_add(1, Ordering::SeqCst);
            q.push_back(Arc::clone(&w));
            self.grant_locked(&mut q)
        };
        wake_all(woken.into_iter().filter(|x| !Arc::ptr_eq(x, &w)));
        w
    }

    /// Takes `w` out of the queue (cancel, timeout, expiry). If it had been
    /// granted already, the caller owns its units. Removing a waiter may let
    /// the ones behind it fit, so the grant loop runs again.
    pub(crate) fn withdraw(&self, w: &Arc<Waiter>) -> Withdrawn {
        let woken = {
            let mut q = lock(&self.queue);
            if w.is_granted() {
                return Withdrawn::WasGranted;
            }
            if let Some(pos) = q.iter().position(|x| Arc::ptr_eq(x, w)) {
                q.remove(pos);
                self.waiters.fetch_sub(1, Ordering::SeqCst);
            }
            self.grant_locked(&mut q)
        };
        wake_all(woken);
        Withdrawn::Removed
    }

    /// Blocking acquire: spin, yield, then park in the FIFO queue until
    /// granted, cancelled or past `deadline`.
    ///
    /// If the grant and the deadline race, a grant that happened first wins
    /// (Ok). If the grant and a cancel race, cancel wins: granted units are
    /// given back, so a cancelled waiter leaves no trace.
    pub(crate) fn acquire(
        &self,
        n: usize,
        deadline: Option<Instant>,
        cancel: &CancelToken,
    ) -> Result<(), AcquireError> {
        if n > self.capacity {
            return Err(AcquireError::TooLarge);
        }
        if cancel.is_cancelled() {
            return Err(AcquireError::Cancelled);
        }
        // Fast path plus a short spin/yield while nobody is queued.
        let mut wait = backoff();
        loop {
            match self.try_acquire(n) {
                Ok(()) => return Ok(()),
                Err(TryAcquireError::TooLarge) => return Err(AcquireError::TooLarge),
                Err(TryAcquireError::WouldBlock) => {}
            }
            if self.waiters.load(Ordering::SeqCst) != 0 || cancel.is_cancelled() {
                break; // FIFO: queue behind them; spinning cannot help.
            }
            if wait.snooze() == Step::ShouldPark {
                break;
            }
        }
        if cancel.is_cancelled() {
            return Err(AcquireError::Cancelled);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(AcquireError::Timeout);
        }

        let me = current_thread();
        let w = self.enqueue(n, Wake::Thread(me.clone()));
        if w.is_granted() {
            return Ok(());
        }
        let _registration = cancel.register_current(me);
        let mut wait = backoff();
        loop {
            if w.is_granted() {
                return Ok(());
            }
            if cancel.is_cancelled() {
                if self.withdraw(&w) == Withdrawn::WasGranted {
                    self.release(n);
                }
                return Err(AcquireError::Cancelled);
            }
            let timeout = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return match self.withdraw(&w) {
                            Withdrawn::WasGranted => Ok(()),
                            Withdrawn::Removed => Err(AcquireError::Timeout),
                        };
                    }
                    Some(d - now)
                }
                None => None,
            };
            // spin -> yield -> park (spurious wake-ups just loop).
            if wait.snooze() == Step::ShouldPark {
                match timeout {
                    Some(t) => park_timeout(t),
                    None => park(),
                }
            }
        }
    }
}

fn wake_all(woken: impl IntoIterator<Item = Arc<Waiter>>) {
    for w in woken {
        match &w.wake {
            Wake::Thread(t) => t.unpark(),
            Wake::Callback(Some(f)) => f(),
            Wake::Callback(None) => {}
        }
    }
}

#[cfg(all(test, not(feature = "shuttle-model")))]
mod tests {
    use super::*;

    #[test]
    fn try_acquire_respects_capacity_and_queue() {
        let s = FifoSemaphore::new(4);
        assert_eq!(s.try_acquire(5), Err(TryAcquireError::TooLarge));
        assert_eq!(s.try_acquire(0), Ok(()));
        assert_eq!(s.try_acquire(3), Ok(()));
        assert_eq!(s.try_acquire(2), Err(TryAcquireError::WouldBlock));
        let w = s.enqueue(2, Wake::Callback(None));
        assert!(!w.is_granted());
        // 1 unit is free, but a waiter is queued: no queue jumping.
        assert_eq!(s.try_acquire(1), Err(TryAcquireError::WouldBlock));
        s.release(1);
        assert!(w.is_granted());
        assert_eq!(s.committed(), 4);
        assert_eq!(s.waiters(), 0);
        assert_eq!(s.withdraw(&w), Withdrawn::WasGranted);
    }

    #[test]
    fn withdrawing_the_head_lets_the_next_one_in() {
        let s = FifoSemaphore::new(4);
        s.try_acquire(3).unwrap();
        let big = s.enqueue(4, Wake::Callback(None));
        let small = s.enqueue(1, Wake::Callback(None));
        assert!(!small.is_granted(), "small must wait behind big (FIFO)");
        assert_eq!(s.withdraw(&big), Withdrawn::Removed);
        assert!(small.is_granted());
        assert_eq!(s.committed(), 4);
        assert_eq!(s.waiters(), 0);
    }
}
