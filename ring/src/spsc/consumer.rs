//! The SPSC consumer handle.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::ReadBatch;
use crate::ring::Ring;
use crate::sync::Ordering;
use crate::{Plain, WaitStatus};

/// The consuming end of an SPSC ring. `Send` but not `Sync`: one thread
/// consumes at a time. Dropping it closes the ring for the producer.
pub struct Consumer<T: Plain> {
    ring: Arc<Ring<T>>,
    /// Own index: the next position to read (authoritative copy).
    head: u64,
    /// Last tail seen; refreshed only when the ring looks empty.
    cached_tail: u64,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T: Plain> Consumer<T> {
    pub(crate) fn attach(ring: Arc<Ring<T>>) -> Self {
        // Acquire (both): start from the indices peers published.
        let head = ring.head().load(Ordering::Acquire);
        let cached_tail = ring.tail().load(Ordering::Acquire);
        Self {
            ring,
            head,
            cached_tail,
            _not_sync: PhantomData,
        }
    }

    /// Entries available, refreshing the cached tail only if fewer than
    /// `want` look available.
    #[inline]
    fn available(&mut self, want: u64) -> u64 {
        let avail = self.ring.published(self.cached_tail, self.head);
        if avail >= want {
            return avail;
        }
        // Acquire: pairs with the producer's Release store of tail after it
        // wrote the slots.
        self.cached_tail = self.ring.tail().load(Ordering::Acquire);
        self.ring.published(self.cached_tail, self.head)
    }

    #[inline]
    fn release(&mut self, n: u64) {
        self.head = self.head.wrapping_add(n);
        // Release: pairs with the producer's Acquire load of head before it
        // reuses the slots we just read.
        self.ring.head().store(self.head, Ordering::Release);
    }

    /// Take the oldest entry, if any.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        if self.available(1) == 0 {
            return None;
        }
        // SAFETY: head < tail (as published with Release and read with
        // Acquire), so the slot holds a published entry the producer will not
        // touch until we store a head past it.
        let v = unsafe { self.ring.slot(self.head).read() };
        self.release(1);
        Some(v)
    }

    /// Move up to `out.len()` entries into `out`, in order, with one head
    /// store. Returns how many.
    pub fn pop_into(&mut self, out: &mut [T]) -> usize {
        let n = (out.len() as u64).min(self.available(out.len() as u64));
        for (i, o) in out[..n as usize].iter_mut().enumerate() {
            // SAFETY: positions head..head+n are published (see `pop`).
            *o = unsafe { self.ring.slot(self.head.wrapping_add(i as u64)).read() };
        }
        if n > 0 {
            self.release(n);
        }
        n as usize
    }

    /// All entries available now, as a batch released with one store on
    /// [`ReadBatch::release`] or drop.
    pub fn peek(&mut self) -> ReadBatch<'_, T> {
        let n = self.available(u64::MAX);
        ReadBatch::new(&self.ring, &mut self.head, n)
    }

    /// Wait until an entry is available ([`WaitStatus::Ready`]), the producer
    /// is gone and the ring is drained ([`WaitStatus::Closed`]), or the
    /// deadline passes ([`WaitStatus::TimedOut`]; `None` waits forever).
    /// Spins briefly, yields, then sleeps on the ring's futex doorbell.
    pub fn wait(&self, deadline: Option<Instant>) -> WaitStatus {
        let head = self.head;
        let ring = &*self.ring;
        // Acquire: pairs with the producer's Release store of tail.
        ring.wait_until(deadline, || {
            ring.published(ring.tail().load(Ordering::Acquire), head) != 0
        })
    }

    /// Before sleeping elsewhere than in [`Consumer::wait`] (a `poll(2)`
    /// that also watches other descriptors): publishes the need-wakeup
    /// flag and re-checks the ring. False if an entry is already there
    /// (the flag is cleared: do not sleep); true if the consumer may
    /// sleep: every entry published from now on makes the producer's
    /// [`Producer::take_wakeup`](crate::spsc::Producer::take_wakeup) return
    /// true, and the producer then wakes the consumer its own way. This is
    /// the handshake of [`Consumer::wait`] with the futex left out (crate
    /// docs, "Doorbell"). Call [`Consumer::disarm_wakeup`] on waking.
    pub fn arm_wakeup(&self) -> bool {
        let head = self.head;
        let ring = &*self.ring;
        // Acquire: pairs with the producer's Release store of tail.
        ring.arm_wakeup(|| ring.published(ring.tail().load(Ordering::Acquire), head) != 0)
    }

    /// Clears the need-wakeup flag once awake (producers then skip the
    /// wake-up; a stale flag only costs one spare wake-up).
    pub fn disarm_wakeup(&self) {
        self.ring.disarm_wakeup();
    }

    /// Entries currently in the ring.
    pub fn len(&self) -> usize {
        // Relaxed: a snapshot for statistics only.
        let tail = self.ring.tail().load(Ordering::Relaxed);
        self.ring.published(tail, self.head) as usize
    }

    /// True if the ring holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of slots (a power of two).
    pub fn capacity(&self) -> usize {
        self.ring.capacity() as usize
    }

    /// True once the producer dropped (entries may remain: drain them).
    pub fn is_closed(&self) -> bool {
        self.ring.is_closed()
    }
}

impl<T: Plain> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.ring.detach_consumer();
    }
}

impl<T: Plain> std::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("spsc::Consumer")
            .field("head", &self.head)
            .field("capacity", &self.ring.capacity())
            .finish()
    }
}
