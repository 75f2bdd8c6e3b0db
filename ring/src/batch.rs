//! Batch views: [`WriteBatch`] (reserved slots, published on commit/drop) and
//! [`ReadBatch`] (available entries, released on release/drop). Shared by the
//! SPSC and MPSC rings.

use crate::ring::Ring;
use crate::sync::Ordering;
use crate::Plain;

/// How a write batch is published.
pub(crate) enum Publish<'a> {
    /// SPSC: one Release store of the producer's tail; the flag records
    /// that the consumer asked for a wake-up ([`Ring::notify`]).
    Tail(&'a mut u64, &'a mut bool),
    /// MPSC: one Release stamp store per slot (the tail was already claimed).
    Stamps,
}

/// A batch of reserved slots (io_uring SQE style). Fill the slots, then
/// [`commit`](WriteBatch::commit) (or drop) publishes all of them at once and
/// rings the doorbell if the consumer sleeps.
///
/// Every slot of the batch is published. A slot you did not write still holds
/// an earlier entry or zeroes (never undefined behaviour, since `T: Plain`),
/// so write them all.
pub struct WriteBatch<'a, T: Plain> {
    ring: &'a Ring<T>,
    start: u64,
    len: u64,
    publish: Publish<'a>,
    done: bool,
}

impl<'a, T: Plain> WriteBatch<'a, T> {
    pub(crate) fn new(ring: &'a Ring<T>, start: u64, len: u64, publish: Publish<'a>) -> Self {
        Self {
            ring,
            start,
            len,
            publish,
            done: false,
        }
    }

    /// Number of slots in the batch.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for a zero-slot batch.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write slot `i` of the batch. Gives the value back if `i >= len()`.
    pub fn set(&mut self, i: usize, value: T) -> Result<(), T> {
        if i as u64 >= self.len {
            return Err(value);
        }
        // SAFETY: the batch owns slots start..start+len exclusively until it
        // publishes them (the producer reserved them; the consumer cannot
        // reach them before the publish store).
        unsafe {
            self.ring
                .slot(self.start.wrapping_add(i as u64))
                .write(value)
        };
        Ok(())
    }

    /// Copy `src` into the first slots; returns how many were copied
    /// (`min(src.len(), len())`).
    pub fn fill_from(&mut self, src: &[T]) -> usize {
        let n = src.len().min(self.len as usize);
        for (i, v) in src[..n].iter().enumerate() {
            // SAFETY: as in `set`; `i < n <= len`.
            unsafe { self.ring.slot(self.start.wrapping_add(i as u64)).write(*v) };
        }
        n
    }

    /// The batch's slots as (at most) two slices, in order; the second is
    /// non-empty when the batch wraps around the end of the ring.
    #[cfg(not(loom))]
    pub fn as_mut_slices(&mut self) -> (&mut [T], &mut [T]) {
        let (first, second) = split(self.ring, self.start, self.len);
        // SAFETY: the batch owns these slots exclusively (see `set`); the two
        // ranges are disjoint, in bounds, and borrowed mutably from `self`.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.ring.slot_ptr(self.start), first),
                std::slice::from_raw_parts_mut(
                    self.ring.slot_ptr(self.start.wrapping_add(first as u64)),
                    second,
                ),
            )
        }
    }

    /// Publish every slot of the batch and wake the consumer if it sleeps.
    pub fn commit(mut self) {
        self.publish_now();
    }

    fn publish_now(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if self.len == 0 {
            return;
        }
        let end = self.start.wrapping_add(self.len);
        match &mut self.publish {
            Publish::Tail(tail, _) => {
                **tail = end;
                // Release: pairs with the consumer's Acquire load of the tail
                // before it reads these slots.
                self.ring.tail().store(end, Ordering::Release);
            }
            Publish::Stamps => {
                for i in 0..self.len {
                    let pos = self.start.wrapping_add(i);
                    // Release: pairs with the consumer's Acquire load of the
                    // stamp before it reads this slot.
                    self.ring
                        .stamp(pos)
                        .store(pos.wrapping_add(1), Ordering::Release);
                }
            }
        }
        let woke = self.ring.notify();
        if let Publish::Tail(_, asked) = &mut self.publish {
            **asked |= woke;
        }
    }
}

impl<T: Plain> Drop for WriteBatch<'_, T> {
    fn drop(&mut self) {
        self.publish_now();
    }
}

/// The entries available to the consumer (io_uring CQE style). Read them,
/// then [`release`](ReadBatch::release) (or drop) frees all their slots with
/// one store of the head index.
pub struct ReadBatch<'a, T: Plain> {
    ring: &'a Ring<T>,
    head: &'a mut u64,
    len: u64,
}

impl<'a, T: Plain> ReadBatch<'a, T> {
    pub(crate) fn new(ring: &'a Ring<T>, head: &'a mut u64, len: u64) -> Self {
        Self { ring, head, len }
    }

    /// Number of entries in the batch.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True if nothing was available.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entry `i` of the batch, if `i < len()`.
    pub fn get(&self, i: usize) -> Option<T> {
        if i as u64 >= self.len {
            return None;
        }
        // SAFETY: slots head..head+len were published (their Release store was
        // observed with Acquire when the batch was made) and producers cannot
        // reuse them before we store the head.
        Some(unsafe { self.ring.slot(self.head.wrapping_add(i as u64)).read() })
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        (0..self.len as usize).filter_map(move |i| self.get(i))
    }

    /// The entries as (at most) two slices, in order; the second is non-empty
    /// when the batch wraps around the end of the ring.
    #[cfg(not(loom))]
    pub fn as_slices(&self) -> (&[T], &[T]) {
        let (first, second) = split(self.ring, *self.head, self.len);
        // SAFETY: see `get`: the slots are published and nobody writes them
        // until we release; ranges are in bounds.
        unsafe {
            (
                std::slice::from_raw_parts(self.ring.slot_ptr(*self.head), first),
                std::slice::from_raw_parts(
                    self.ring.slot_ptr(self.head.wrapping_add(first as u64)),
                    second,
                ),
            )
        }
    }

    /// Free every slot of the batch (one Release store of the head).
    pub fn release(self) {}
}

impl<T: Plain> Drop for ReadBatch<'_, T> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        *self.head = self.head.wrapping_add(self.len);
        // Release: pairs with the producers' Acquire load of the head before
        // they overwrite these slots, so our reads happen before their writes.
        self.ring.head().store(*self.head, Ordering::Release);
    }
}

/// Lengths of the two contiguous pieces of `len` positions from `start`.
#[cfg(not(loom))]
fn split<T: Plain>(ring: &Ring<T>, start: u64, len: u64) -> (usize, usize) {
    let cap = ring.capacity();
    let idx = start & (cap - 1);
    let first = len.min(cap - idx);
    (first as usize, (len - first) as usize)
}
