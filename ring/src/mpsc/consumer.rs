//! The MPSC consumer handle.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::ReadBatch;
use crate::ring::Ring;
use crate::sync::Ordering;
use crate::{Plain, WaitStatus};

/// The consuming end of an MPSC ring. `Send` but not `Sync`: one thread
/// consumes at a time. Dropping it closes the ring for the producers.
pub struct Consumer<T: Plain> {
    ring: Arc<Ring<T>>,
    /// Own index: the next position to read.
    head: u64,
    /// Positions below this are known to be stamped (published); lets pops
    /// after a `peek`/scan skip re-reading stamps.
    ready_end: u64,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T: Plain> Consumer<T> {
    pub(crate) fn attach(ring: Arc<Ring<T>>) -> Self {
        // Acquire: start from the head a previous owner published.
        let head = ring.head().load(Ordering::Acquire);
        Self {
            ring,
            head,
            ready_end: head,
            _not_sync: PhantomData,
        }
    }

    #[inline]
    fn stamped(&self, pos: u64) -> bool {
        // Acquire: pairs with the producer's Release stamp store after it
        // wrote the slot.
        self.ring.stamp(pos).load(Ordering::Acquire) == pos.wrapping_add(1)
    }

    /// Number of consecutive published entries from head, up to `max`.
    #[inline]
    fn scan(&mut self, max: u64) -> u64 {
        let cap = self.ring.capacity();
        let mut n = self.ready_end.wrapping_sub(self.head);
        while n < max && n < cap && self.stamped(self.head.wrapping_add(n)) {
            n += 1;
        }
        self.ready_end = self.head.wrapping_add(n);
        n
    }

    #[inline]
    fn release(&mut self, n: u64) {
        self.head = self.head.wrapping_add(n);
        // Release: pairs with the producers' Acquire load of head before they
        // reuse the slots we just read.
        self.ring.head().store(self.head, Ordering::Release);
    }

    /// Take the oldest entry, if it is published. (An entry claimed but not
    /// yet written by a slow producer blocks later ones: order is by claim.)
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        if self.scan(1) == 0 {
            return None;
        }
        // SAFETY: the stamp of `head` reads head + 1 (Acquire), so the entry
        // is written, and no producer reuses the slot before we store a head
        // past it.
        let v = unsafe { self.ring.slot(self.head).read() };
        self.release(1);
        Some(v)
    }

    /// Move up to `out.len()` published entries into `out`, in order, with
    /// one head store. Returns how many.
    pub fn pop_into(&mut self, out: &mut [T]) -> usize {
        let n = self.scan(out.len() as u64);
        for (i, o) in out[..n as usize].iter_mut().enumerate() {
            // SAFETY: positions head..head+n are stamped (see `pop`).
            *o = unsafe { self.ring.slot(self.head.wrapping_add(i as u64)).read() };
        }
        if n > 0 {
            self.release(n);
        }
        n as usize
    }

    /// All consecutive published entries, as a batch released with one store
    /// on [`ReadBatch::release`] or drop.
    pub fn peek(&mut self) -> ReadBatch<'_, T> {
        let n = self.scan(u64::MAX);
        ReadBatch::new(&self.ring, &mut self.head, n)
    }

    /// Wait until the next entry is published ([`WaitStatus::Ready`]), all
    /// producers are gone and the ring is drained ([`WaitStatus::Closed`]),
    /// or the deadline passes ([`WaitStatus::TimedOut`]; `None` waits
    /// forever). Spins briefly, yields, then sleeps on the futex doorbell.
    pub fn wait(&self, deadline: Option<Instant>) -> WaitStatus {
        if self.ready_end != self.head {
            return WaitStatus::Ready;
        }
        let head = self.head;
        let ring = &*self.ring;
        // Acquire: pairs with the producer's Release stamp store.
        ring.wait_until(deadline, || {
            ring.stamp(head).load(Ordering::Acquire) == head.wrapping_add(1)
        })
    }

    /// Entries claimed by producers and not yet consumed (some may still be
    /// being written).
    pub fn len(&self) -> usize {
        // Relaxed: a snapshot for statistics only.
        let tail = self.ring.tail().load(Ordering::Relaxed);
        tail.saturating_sub(self.head).min(self.ring.capacity()) as usize
    }

    /// True if `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of slots (a power of two).
    pub fn capacity(&self) -> usize {
        self.ring.capacity() as usize
    }

    /// True once every producer dropped (entries may remain: drain them).
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
        f.debug_struct("mpsc::Consumer")
            .field("head", &self.head)
            .field("capacity", &self.ring.capacity())
            .finish()
    }
}
