//! The SPSC producer handle.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::batch::{Publish, WriteBatch};
use crate::ring::Ring;
use crate::sync::Ordering;
use crate::Plain;

/// The producing end of an SPSC ring. `Send` (move it to the producing
/// thread) but not `Sync`; not `Clone` (use [`crate::mpsc`] for that).
/// Dropping it closes the ring: the consumer drains what was committed, then
/// sees [`crate::WaitStatus::Closed`].
pub struct Producer<T: Plain> {
    ring: Arc<Ring<T>>,
    /// Own index: the next position to publish (authoritative copy).
    tail: u64,
    /// Last head seen; refreshed only when the ring looks full.
    cached_head: u64,
    /// A publish since the last [`Producer::take_wakeup`] found the
    /// consumer asking for a wake-up.
    woke: bool,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T: Plain> Producer<T> {
    pub(crate) fn attach(ring: Arc<Ring<T>>) -> Self {
        // Acquire (both): a handle attaching to an existing (shared) ring
        // starts from the indices its peers published.
        let tail = ring.tail().load(Ordering::Acquire);
        let cached_head = ring.head().load(Ordering::Acquire);
        Self {
            ring,
            tail,
            cached_head,
            woke: false,
            _not_sync: PhantomData,
        }
    }

    /// Free slots, refreshing the cached head only if fewer than `want`
    /// look free.
    #[inline]
    fn free(&mut self, want: u64) -> u64 {
        let free = self.ring.free(self.tail, self.cached_head);
        if free >= want {
            return free;
        }
        // Acquire: pairs with the consumer's Release store of head after it
        // read the slots, so our writes to them come after its reads.
        self.cached_head = self.ring.head().load(Ordering::Acquire);
        self.ring.free(self.tail, self.cached_head)
    }

    #[inline]
    fn publish(&mut self, n: u64) {
        self.tail = self.tail.wrapping_add(n);
        // Release: pairs with the consumer's Acquire load of tail before it
        // reads the slots we just wrote.
        self.ring.tail().store(self.tail, Ordering::Release);
        self.woke |= self.ring.notify();
    }

    /// Push one entry. Gives it back if the ring is full or closed (the
    /// consumer dropped).
    #[inline]
    pub fn push(&mut self, value: T) -> Result<(), T> {
        if self.free(1) == 0 || self.ring.consumer_gone() {
            return Err(value);
        }
        // SAFETY: tail - head < capacity, so the slot at `tail` is not
        // readable by the consumer, and only this producer writes slots.
        unsafe { self.ring.slot(self.tail).write(value) };
        self.publish(1);
        Ok(())
    }

    /// Push as many entries of `items` as fit, in order, with one publish.
    /// Returns how many were pushed (0 if full or closed).
    pub fn push_slice(&mut self, items: &[T]) -> usize {
        if self.ring.consumer_gone() {
            return 0;
        }
        let n = (items.len() as u64).min(self.free(items.len() as u64));
        if n == 0 {
            return 0;
        }
        for (i, v) in items[..n as usize].iter().enumerate() {
            // SAFETY: positions tail..tail+n are free (n <= free slots) and
            // owned by this producer until published.
            unsafe { self.ring.slot(self.tail.wrapping_add(i as u64)).write(*v) };
        }
        self.publish(n);
        n as usize
    }

    /// Reserve exactly `n` slots to fill in place, or `None` if fewer than
    /// `n` are free or the ring is closed. The batch is published with one
    /// Release store on [`WriteBatch::commit`] or drop.
    pub fn reserve(&mut self, n: usize) -> Option<WriteBatch<'_, T>> {
        let n = n as u64;
        if self.ring.consumer_gone() || self.free(n) < n {
            return None;
        }
        let start = self.tail;
        Some(WriteBatch::new(
            &self.ring,
            start,
            n,
            Publish::Tail(&mut self.tail, &mut self.woke),
        ))
    }

    /// True (once) if a publish since the last call found the consumer
    /// asking for a wake-up: it had armed one with
    /// [`Consumer::arm_wakeup`](crate::spsc::Consumer::arm_wakeup) to sleep
    /// elsewhere than on the ring's futex (a consumer in `wait` was already
    /// woken by the publish). A consumer that sleeps in `poll(2)` on a
    /// socket is then woken by writing to the socket. Never losing a
    /// wake-up: the publish and the flag check are ordered by the
    /// doorbell's barrier pair (crate docs, "Doorbell").
    pub fn take_wakeup(&mut self) -> bool {
        std::mem::take(&mut self.woke)
    }

    /// Entries currently in the ring (exact from this side's view, the
    /// consumer may have taken some since).
    pub fn len(&self) -> usize {
        // Relaxed: a snapshot for statistics only.
        let head = self.ring.head().load(Ordering::Relaxed);
        self.tail.wrapping_sub(head).min(self.ring.capacity()) as usize
    }

    /// True if the ring holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of slots (a power of two).
    pub fn capacity(&self) -> usize {
        self.ring.capacity() as usize
    }

    /// True once the consumer dropped (pushes then fail).
    pub fn is_closed(&self) -> bool {
        self.ring.is_closed()
    }
}

impl<T: Plain> Drop for Producer<T> {
    fn drop(&mut self) {
        self.ring.detach_producer();
    }
}

impl<T: Plain> std::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("spsc::Producer")
            .field("tail", &self.tail)
            .field("capacity", &self.ring.capacity())
            .finish()
    }
}
