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

use std::sync::OnceLock;

use crate::cancel::CancelToken;
use crate::eventfd::EventFd;
use crate::ledger::fifo_semaphore::{AcquireError, FifoSemaphore, Waiter, Wake, Withdrawn};
use crate::sync::{Arc, AtomicBool, AtomicUsize, Ordering};
use bitmap::AtomicBitmap;

/// A bitmap allocator over fixed-size staging slots. A cheap, cloneable
/// handle (an `Arc` inside); `free` may be called from any thread.
///
/// The slots may be split into *pools* ([`with_pools`](Self::with_pools)):
/// consecutive index ranges, each with its own count, bitmap and FIFO queue,
/// so an allocation never spans two pools. The last pool is the *default*
/// one, which [`alloc`](Self::alloc), [`try_alloc`](Self::try_alloc) and
/// [`request`](Self::request) use; the others are reached only through
/// [`try_alloc_in`](Self::try_alloc_in) (the sender's per-worker staging
/// shares, `docs/attach.md`). [`new`](Self::new) makes one pool of every slot.
#[derive(Clone)]
pub struct SlotAllocator {
    inner: Arc<Inner>,
}

struct Inner {
    /// In index order; the last is the default pool.
    pools: Box<[Pool]>,
    /// Slots passed to `free` that were not in use (caller bugs, ignored).
    bad_frees: AtomicUsize,
}

/// One pool: slots `base..base + sem.capacity()`.
struct Pool {
    base: u32,
    /// Permits = slots; `committed` = slots handed out (or being claimed).
    sem: FifoSemaphore,
    /// Bit `i` is slot `base + i`.
    bits: AtomicBitmap,
    /// Set by a `try_alloc_in` that came up short while the pool has a
    /// `signal`: the next free that returns slots signals it (and clears
    /// this), so the owner can sleep until then.
    armed: AtomicBool,
    signal: OnceLock<std::sync::Arc<EventFd>>,
}

impl Pool {
    fn new(base: u32, slots: usize) -> Self {
        Self {
            base,
            sem: FifoSemaphore::new(slots),
            bits: AtomicBitmap::new(slots),
            armed: AtomicBool::new(false),
            signal: OnceLock::new(),
        }
    }
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
    /// `u32::MAX + 1`, larger values are clamped), all in one pool.
    pub fn new(slots: usize) -> Self {
        Self::with_pools(&[slots])
    }

    /// An allocator over `sizes.iter().sum()` slots split into pools of
    /// these sizes, in index order (pool `i` starts where pool `i - 1`
    /// ends); the last is the default pool. The total is clamped to
    /// `u32::MAX + 1` slots (later pools shrink). No pools at all means one
    /// empty default pool.
    pub fn with_pools(sizes: &[usize]) -> Self {
        let mut left = u32::MAX as usize + 1;
        let mut base = 0usize;
        let mut pools: Vec<Pool> = sizes
            .iter()
            .map(|&n| {
                let n = n.min(left);
                left -= n;
                // `base <= u32::MAX` while any slot is left to give; a pool
                // past the clamp is empty and its base is never used.
                let p = Pool::new(base.min(u32::MAX as usize) as u32, n);
                base += n;
                p
            })
            .collect();
        if pools.is_empty() {
            pools.push(Pool::new(0, 0));
        }
        Self {
            inner: Arc::new(Inner {
                pools: pools.into_boxed_slice(),
                bad_frees: AtomicUsize::new(0),
            }),
        }
    }

    fn default_pool(&self) -> &Pool {
        // Never empty (see `with_pools`).
        &self.inner.pools[self.inner.pools.len() - 1]
    }

    /// Slots of the default pool (all slots for [`new`](Self::new)).
    pub fn capacity(&self) -> usize {
        self.default_pool().sem.capacity()
    }

    /// Number of pools (at least 1).
    pub fn pools(&self) -> usize {
        self.inner.pools.len()
    }

    /// The slot indices of `pool` (`None` if there is no such pool).
    pub fn pool_range(&self, pool: usize) -> Option<std::ops::Range<u32>> {
        let p = self.inner.pools.get(pool)?;
        Some(p.base..p.base + p.sem.capacity() as u32)
    }

    fn claim(pool: &Pool, n: usize) -> SlotSet {
        let mut out: SmallVec<[u32; 16]> = SmallVec::with_capacity(n);
        if n > 0 {
            let words = pool.bits.words();
            let h = hint();
            let start = if h < words { h } else { h % words };
            let end = pool.bits.claim(n, start, &mut out);
            set_hint(end);
            out.sort_unstable();
            if pool.base != 0 {
                for s in &mut out {
                    *s += pool.base;
                }
            }
        }
        SlotSet::from_sorted(out)
    }

    /// Takes `n` slots at once or none. `None` if they are not free now, if
    /// allocators are queued ahead (FIFO), or if `n > capacity()`.
    /// `n == 0` gives an empty set.
    pub fn try_alloc(&self, n: usize) -> Option<SlotSet> {
        let p = self.default_pool();
        p.sem.try_acquire(n).ok()?;
        Some(Self::claim(p, n))
    }

    /// [`try_alloc`](Self::try_alloc) from `pool` (`None` also for an
    /// unknown pool). If it comes up short and the pool has a free signal
    /// (`set_free_signal`), the signal is armed:
    /// the next [`free`](Self::free) that gives slots of this pool back
    /// signals it once.
    pub fn try_alloc_in(&self, pool: usize, n: usize) -> Option<SlotSet> {
        let p = self.inner.pools.get(pool)?;
        if p.sem.try_acquire(n).is_ok() {
            return Some(Self::claim(p, n));
        }
        p.signal.get()?;
        // SeqCst, with the SeqCst permit operations: either this retry sees
        // the permits a concurrent free returned, or that free (which
        // returns its permits before its SeqCst swap of `armed`) sees the
        // flag and signals. No wake-up is lost.
        p.armed.store(true, Ordering::SeqCst);
        p.sem.try_acquire(n).ok()?;
        Some(Self::claim(p, n))
    }

    /// Makes `signal` the eventfd that `pool`'s armed frees signal (see
    /// [`try_alloc_in`](Self::try_alloc_in)). Set once; false if the pool
    /// does not exist or already has one.
    pub(crate) fn set_free_signal(&self, pool: usize, signal: std::sync::Arc<EventFd>) -> bool {
        self.inner
            .pools
            .get(pool)
            .is_some_and(|p| p.signal.set(signal).is_ok())
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
        let p = self.default_pool();
        match p.sem.acquire(n, deadline, cancel) {
            Ok(()) => Ok(Self::claim(p, n)),
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
        let waiter = (n > 0).then(|| {
            self.default_pool()
                .sem
                .enqueue(n, Wake::Callback(Some(waker)))
        });
        Ok(SlotRequest {
            alloc: self.clone(),
            waiter,
            n,
            taken: false,
        })
    }

    /// Gives the slots of `set` back (each to its pool) and wakes queued
    /// allocators that now fit. Slots that are not in use (or out of range)
    /// are ignored and counted in [`bad_frees`](Self::bad_frees); they never
    /// corrupt the count. (A slot freed by someone who does not own it while
    /// another owner holds it cannot be detected: callers must free only
    /// their own.)
    pub fn free(&self, set: SlotSet) {
        self.free_sorted(set.iter());
    }

    /// Gives one slot back (see [`free`](Self::free)).
    pub fn free_one(&self, slot: u32) {
        self.free_sorted(std::iter::once(slot));
    }

    fn free_sorted(&self, sorted: impl IntoIterator<Item = u32>) {
        let pools = &self.inner.pools;
        if pools.len() == 1 {
            return self.free_in(&pools[0], sorted);
        }
        let mut it = sorted.into_iter().peekable();
        while let Some(&first) = it.peek() {
            // The last pool whose base is at or below the slot (pool 0's
            // base is 0); a slot past the end lands in the last pool, whose
            // bitmap counts it as a bad free.
            let i = pools.partition_point(|p| p.base <= first).max(1) - 1;
            let end = pools.get(i + 1).map_or(u64::MAX, |p| u64::from(p.base));
            self.free_in(
                &pools[i],
                std::iter::from_fn(|| it.next_if(|&s| u64::from(s) < end)),
            );
        }
    }

    fn free_in(&self, pool: &Pool, sorted: impl IntoIterator<Item = u32>) {
        let c = pool.bits.clear(sorted.into_iter().map(|s| s - pool.base));
        if c.bad > 0 {
            // Relaxed: diagnostics counter.
            self.inner.bad_frees.fetch_add(c.bad, Ordering::Relaxed);
            tracing::debug!(bad = c.bad, "freed staging slots that were not in use");
        }
        // Bits are clear before the permits come back (program order, and
        // the semaphore's SeqCst release), so a grantee finds them.
        pool.sem.release(c.cleared);
        // SeqCst: the freeing side of the pair in `try_alloc_in`.
        if c.cleared > 0 && pool.armed.swap(false, Ordering::SeqCst) {
            if let Some(fd) = pool.signal.get() {
                fd.signal();
            }
        }
    }

    /// Slots in use over all pools (handed out, or permits taken and bits
    /// being claimed).
    pub fn in_use(&self) -> usize {
        self.inner.pools.iter().map(|p| p.sem.committed()).sum()
    }

    /// Slots of `pool` in use (0 for an unknown pool).
    pub fn in_use_in(&self, pool: usize) -> usize {
        self.inner.pools.get(pool).map_or(0, |p| p.sem.committed())
    }

    /// True if `slot` is handed out right now (false for a free or
    /// out-of-range slot). Lock-free and read-only; a point-in-time answer
    /// (another thread may allocate or free it right after).
    pub fn is_in_use(&self, slot: u32) -> bool {
        let pools = &self.inner.pools;
        let i = pools.partition_point(|p| p.base <= slot).max(1) - 1;
        let p = &pools[i];
        p.bits.is_set((slot - p.base) as usize)
    }

    /// Allocators queued in `alloc` (all pools).
    pub fn waiters(&self) -> usize {
        self.inner.pools.iter().map(|p| p.sem.waiters()).sum()
    }

    /// Slots passed to `free`/`free_one` that were not in use (ignored).
    pub fn bad_frees(&self) -> usize {
        // Relaxed: diagnostics counter.
        self.inner.bad_frees.load(Ordering::Relaxed)
    }

    /// A debug view of the bitmap, one bit per slot (all pools in index
    /// order), 1 = in use.
    pub fn snapshot(&self) -> BitVec<u64> {
        let mut all = BitVec::<u64>::new();
        for p in self.inner.pools.iter() {
            all.extend_from_bitslice(&p.bits.snapshot());
        }
        all
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
        Some(SlotAllocator::claim(self.alloc.default_pool(), self.n))
    }
}

impl Drop for SlotRequest {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        if let Some(w) = &self.waiter {
            let sem = &self.alloc.default_pool().sem;
            if sem.withdraw(w) == Withdrawn::WasGranted {
                // Granted but never claimed: give the units back.
                sem.release(self.n);
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

#[cfg(all(test, not(feature = "shuttle-model")))]
mod pool_tests {
    use super::*;

    #[test]
    fn pools_allocate_only_their_own_range_and_frees_go_home() {
        // Pools 0 and 1 (2 slots each), default pool of 3 slots.
        let a = SlotAllocator::with_pools(&[2, 2, 3]);
        assert_eq!((a.pools(), a.capacity()), (3, 3));
        assert_eq!(a.pool_range(1), Some(2..4));
        assert_eq!(a.pool_range(3), None);
        let s1 = a.try_alloc_in(1, 2).expect("pool 1 free");
        assert_eq!(s1.as_slice(), &[2, 3]);
        assert!(a.try_alloc_in(1, 1).is_none(), "pool 1 is full");
        assert!(a.try_alloc_in(9, 1).is_none(), "no pool 9");
        let d = a.try_alloc(3).expect("default pool free");
        assert_eq!(d.as_slice(), &[4, 5, 6]);
        assert!(
            a.try_alloc(1).is_none(),
            "the default pool never lends pool 0"
        );
        let s0 = a.try_alloc_in(0, 2).expect("pool 0 free");
        assert_eq!(s0.as_slice(), &[0, 1]);
        assert_eq!((a.in_use(), a.in_use_in(1)), (7, 2));
        // A set spanning pools (as the completion path may free) is split.
        let mut all = s0;
        let rest = all.split_off(1);
        a.free(SlotSet::from_slots(
            all.iter().chain(rest.iter()).chain(s1.iter()).chain([99]),
        ));
        assert_eq!((a.in_use(), a.in_use_in(0), a.in_use_in(1)), (3, 0, 0));
        assert_eq!(a.bad_frees(), 1, "slot 99 is nobody's");
        a.free(d);
        assert_eq!(a.in_use(), 0);
        assert!(a.snapshot().not_any() && a.snapshot().len() == 7);
    }

    #[test]
    fn an_armed_pool_signals_its_eventfd_once_slots_come_back() {
        let a = SlotAllocator::with_pools(&[2, 0]);
        let fd = std::sync::Arc::new(EventFd::new().unwrap());
        assert!(a.set_free_signal(0, std::sync::Arc::clone(&fd)));
        assert!(
            !a.set_free_signal(0, std::sync::Arc::clone(&fd)),
            "set once"
        );
        let held = a.try_alloc_in(0, 2).unwrap();
        a.free(a.try_alloc_in(0, 0).unwrap());
        assert_eq!(fd.clear(), 0, "nothing was waiting");
        assert!(a.try_alloc_in(0, 1).is_none(), "full: arms the signal");
        a.free(held);
        assert_eq!(fd.clear(), 1, "the free signalled the waiting owner");
        let again = a.try_alloc_in(0, 2).unwrap();
        a.free(again);
        assert_eq!(fd.clear(), 0, "disarmed by the signal");
    }
}

/// Shuttle model of the pool free signal (the `armed` handshake between
/// `try_alloc_in` and `free`): an owner whose allocation came up short is
/// always either served by its retry or signalled. Run:
/// `cargo test -p kvferry --lib --features shuttle-model pool_model`.
#[cfg(all(test, feature = "shuttle-model"))]
mod pool_model {
    use super::*;

    #[test]
    fn a_short_allocation_is_retried_or_signalled_never_lost() {
        let body = || {
            let a = SlotAllocator::with_pools(&[2, 0]);
            let fd = std::sync::Arc::new(EventFd::new().unwrap());
            a.set_free_signal(0, std::sync::Arc::clone(&fd));
            let held = a.try_alloc_in(0, 2).unwrap();
            let b = a.clone();
            let freer = shuttle::thread::spawn(move || b.free(held));
            let got = a.try_alloc_in(0, 1);
            freer.join().unwrap();
            let signalled = fd.clear() > 0;
            // Short (the free came too late for both tries) implies a signal.
            assert!(got.is_some() || signalled, "a lost wake-up");
            if let Some(s) = got {
                a.free(s);
            }
            assert_eq!(a.in_use(), 0);
        };
        shuttle::check_random(body, 2000);
        shuttle::check_pct(body, 2000, 3);
    }
}
