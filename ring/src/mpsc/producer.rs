//! The MPSC producer handle.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::batch::{Publish, WriteBatch};
use crate::ring::Ring;
use crate::sync::Ordering;
use crate::Plain;

/// A producing end of an MPSC ring. `Clone + Send`, not `Sync`: give each
/// producing thread its own clone. The ring closes when the last clone drops
/// (the consumer drains what was committed, then sees
/// [`crate::WaitStatus::Closed`]).
pub struct Producer<T: Plain> {
    ring: Arc<Ring<T>>,
    /// Last head this handle saw; refreshed only when the ring looks full.
    cached_head: u64,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T: Plain> Producer<T> {
    pub(crate) fn attach(ring: Arc<Ring<T>>) -> Self {
        // Acquire: start from the head the consumer published.
        let cached_head = ring.head().load(Ordering::Acquire);
        Self {
            ring,
            cached_head,
            _not_sync: PhantomData,
        }
    }

    /// Free slots when the tail is `t`, by the cached head. 0 also when `t`
    /// is older than the cached head (stale tail read).
    #[inline]
    fn free_at(&self, t: u64) -> u64 {
        self.ring
            .capacity()
            .saturating_sub(t.wrapping_sub(self.cached_head))
    }

    /// Claim `want` positions (exactly, or as many as fit if `!exact`).
    /// Returns the first claimed position and the count.
    #[inline]
    fn claim(&mut self, want: u64, exact: bool) -> Option<(u64, u64)> {
        if want == 0 || self.ring.consumer_gone() {
            return None;
        }
        let tail = self.ring.tail();
        // Relaxed: the CAS below validates the value; slot ownership needs no
        // ordering among producers (they write disjoint slots), and slot
        // reuse is ordered by the Acquire load of head.
        let mut t = tail.load(Ordering::Relaxed);
        loop {
            let mut free = self.free_at(t);
            if free < want {
                // Acquire: pairs with the consumer's Release store of head
                // after it read the slots we may now reuse.
                self.cached_head = self.ring.head().load(Ordering::Acquire);
                // Relaxed: reloaded because `t` may predate that head.
                t = tail.load(Ordering::Relaxed);
                free = self.free_at(t);
                if free < want {
                    // The tail may be much newer than the head we read (this
                    // thread was preempted between the two loads while the
                    // others moved on), which looks full when it is not. The
                    // ring was full at the moment of the tail load only if
                    // the head still reads the same after it.
                    // Acquire: as above.
                    let head = self.ring.head().load(Ordering::Acquire);
                    if head != self.cached_head {
                        self.cached_head = head;
                        continue;
                    }
                    if exact || free == 0 {
                        return None;
                    }
                }
            }
            let n = want.min(free);
            // Relaxed (both): see the load above.
            match tail.compare_exchange_weak(
                t,
                t.wrapping_add(n),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some((t, n)),
                Err(cur) => t = cur,
            }
        }
    }

    #[inline]
    fn stamp(&self, start: u64, n: u64) {
        for i in 0..n {
            let pos = start.wrapping_add(i);
            // Release: pairs with the consumer's Acquire load of this stamp
            // before it reads the slot.
            self.ring
                .stamp(pos)
                .store(pos.wrapping_add(1), Ordering::Release);
        }
        let _ = self.ring.notify();
    }

    /// Push one entry. Gives it back if the ring is full or closed (the
    /// consumer dropped). Never waits for other producers.
    #[inline]
    pub fn push(&mut self, value: T) -> Result<(), T> {
        let Some((pos, _)) = self.claim(1, true) else {
            return Err(value);
        };
        // SAFETY: the CAS gave this handle position `pos` alone, and head >
        // pos - capacity (checked against an Acquire-loaded head), so the
        // consumer is done with the slot and cannot read it before the stamp.
        unsafe { self.ring.slot(pos).write(value) };
        self.stamp(pos, 1);
        Ok(())
    }

    /// Push as many entries of `items` as fit, in order (one tail CAS).
    /// Returns how many (0 if full or closed).
    pub fn push_slice(&mut self, items: &[T]) -> usize {
        let Some((start, n)) = self.claim(items.len() as u64, false) else {
            return 0;
        };
        for (i, v) in items[..n as usize].iter().enumerate() {
            // SAFETY: positions start..start+n were claimed by this handle
            // alone and are free (see `push`).
            unsafe { self.ring.slot(start.wrapping_add(i as u64)).write(*v) };
        }
        self.stamp(start, n);
        n as usize
    }

    /// Reserve exactly `n` slots to fill in place, or `None` if fewer are free
    /// or the ring is closed. [`WriteBatch::commit`] (or drop) stamps them all
    /// and rings the doorbell once. Other producers keep going meanwhile; the
    /// consumer waits at the first unstamped slot.
    pub fn reserve(&mut self, n: usize) -> Option<WriteBatch<'_, T>> {
        if n == 0 {
            if self.ring.consumer_gone() {
                return None;
            }
            return Some(WriteBatch::new(&self.ring, 0, 0, Publish::Stamps));
        }
        let (start, n) = self.claim(n as u64, true)?;
        Some(WriteBatch::new(&self.ring, start, n, Publish::Stamps))
    }

    /// Entries claimed and not yet consumed (includes entries still being
    /// written by other producers).
    pub fn len(&self) -> usize {
        // Relaxed (both): a snapshot for statistics only.
        let head = self.ring.head().load(Ordering::Relaxed);
        let tail = self.ring.tail().load(Ordering::Relaxed);
        tail.saturating_sub(head).min(self.ring.capacity()) as usize
    }

    /// True if `len() == 0`.
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

impl<T: Plain> Clone for Producer<T> {
    fn clone(&self) -> Self {
        self.ring.clone_producer();
        Self {
            ring: self.ring.clone(),
            cached_head: self.cached_head,
            _not_sync: PhantomData,
        }
    }
}

impl<T: Plain> Drop for Producer<T> {
    fn drop(&mut self) {
        self.ring.detach_producer();
    }
}

impl<T: Plain> std::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("mpsc::Producer")
            .field("capacity", &self.ring.capacity())
            .finish()
    }
}
