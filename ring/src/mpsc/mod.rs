//! Multi-producer single-consumer ring.
//!
//! Algorithm: Dmitry Vyukov's bounded MPMC queue
//! (<https://www.1024cores.net/home/lock-free-algorithms/queues/bounded-mpmc-queue>,
//! also the basis of crossbeam's `ArrayQueue`), specialised to one consumer:
//! - producers claim positions by CAS on the shared `tail` (never waiting on
//!   one another: a failed CAS means another producer made progress);
//! - fullness is checked against the consumer's `head`, cached per producer
//!   handle and reloaded with Acquire only when the ring looks full;
//! - each slot carries a sequence stamp: a producer writes the entry, then
//!   stores `stamp = pos + 1` with Release; the consumer reads position
//!   `pos` only after an Acquire load of the stamp returns `pos + 1`.
//!
//! A producer that is slow (or preempted) between claiming and stamping only
//! delays the consumer at its own position; it cannot corrupt other
//! producers' entries, and the others keep claiming later slots until the
//! ring is full. Each producer's entries keep their order (per-producer FIFO).

mod consumer;
mod producer;
#[cfg(not(loom))]
pub mod shared;

pub use consumer::Consumer;
pub use producer::Producer;

pub use crate::batch::{ReadBatch, WriteBatch};

use std::sync::Arc;

use crate::layout::{round_capacity, Kind};
use crate::ring::Ring;
use crate::{CapacityError, Plain};

/// A heap-backed MPSC ring of `capacity` entries, rounded up to a power of
/// two (at least 1). Clone the producer for more producers.
///
/// # Panics
/// If `capacity` exceeds [`crate::MAX_CAPACITY`]; use [`try_channel`] to get
/// an error instead.
pub fn channel<T: Plain>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    match try_channel(capacity) {
        Ok(pair) => pair,
        Err(e) => panic!("{e}"),
    }
}

/// Like [`channel`], but returns an error for a too-large capacity.
pub fn try_channel<T: Plain>(capacity: usize) -> Result<(Producer<T>, Consumer<T>), CapacityError> {
    let cap = round_capacity(capacity).ok_or(CapacityError {
        requested: capacity,
    })?;
    let ring = Arc::new(Ring::<T>::new_heap(cap, Kind::Mpsc));
    Ok((Producer::attach(ring.clone()), Consumer::attach(ring)))
}
