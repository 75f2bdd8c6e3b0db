//! Single-producer single-consumer ring.
//!
//! Algorithm: the classic Lamport ring with free-running indices and a
//! power-of-two mask, plus the cached-opposite-index trick of Rigtorp's
//! `SPSCQueue`, `rtrb` and io_uring's user-side ring copies: each side keeps
//! a private copy of the other side's index and reloads the shared one (with
//! Acquire) only when the ring looks full (producer) or empty (consumer).
//! In the steady state an operation is one slot access plus one Release
//! store of the own index, and batches (`push_slice`, `reserve`/`commit`,
//! `pop_into`, `peek`/`release`) publish many entries with that one store.
//!
//! Ordering: the producer writes the slot, then stores `tail` with Release;
//! the consumer loads `tail` with Acquire, then reads the slot. The consumer
//! reads the slot, then stores `head` with Release; the producer loads `head`
//! with Acquire before reusing the slot. The doorbell adds a SeqCst fence on
//! each side (see the crate docs and `docs/ring.md`).

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

/// A heap-backed SPSC ring of `capacity` entries, rounded up to a power of
/// two (at least 1).
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
    let ring = Arc::new(Ring::<T>::new_heap(cap, Kind::Spsc));
    Ok((Producer::attach(ring.clone()), Consumer::attach(ring)))
}
