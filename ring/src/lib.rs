//! io_uring-style rings of plain-data entries for kvferry's pinned threads
//! and processes.
//!
//! - [`spsc`]: single producer, single consumer (Lamport ring with cached
//!   opposite indices, as in Rigtorp's `SPSCQueue` and `rtrb`).
//! - [`mpsc`]: many producers, one consumer (Vyukov's bounded queue with
//!   per-slot sequence stamps, as in crossbeam's `ArrayQueue`).
//!
//! Both come heap-backed (`channel`) or in a shared-memory file
//! (`spsc::shared` / `mpsc::shared`, memmap2) that another process opens;
//! the producer and consumer types are the same for both backings.
//! Entries are [`Plain`]: any bit pattern is valid and they hold no
//! pointers, so a ring can live in memory two processes map.
//!
//! Batching follows io_uring: [`WriteBatch`] (from `reserve(n)`) is filled in
//! place and published with one Release store; [`ReadBatch`] (from `peek()`)
//! is read in place and released with one store.
//!
//! # Doorbell
//! A consumer that finds the ring empty ([`spsc::Consumer::wait`],
//! [`mpsc::Consumer::wait`]) spins briefly, yields, then sets a need-wakeup
//! flag and futex-waits on a 32-bit word inside the ring's own memory (a
//! shared, not `FUTEX_PRIVATE`, futex: it works across processes). This is
//! io_uring's `IORING_SQ_NEED_WAKEUP` idea. A producer issues `FUTEX_WAKE`
//! only when it sees the flag, because a wake with no waiter still costs a
//! syscall (~170 ns on the project machine).
//!
//! Why no wakeup is lost: the consumer stores the flag, runs a full
//! store→load barrier, loads the bell counter and re-checks the ring; the
//! producer publishes, runs the same barrier and loads the flag. Full
//! barriers on both sides order this store→load (Dekker) pattern, so either
//! the producer sees the flag (and bumps the bell, then wakes) or the
//! consumer's re-check sees the entry. The barrier is a SeqCst fence (module
//! `barrier` says why neither a `lock xchg` publish nor a membarrier-based
//! asymmetric barrier replaced it). The futex itself sleeps only if the bell
//! still holds the value read after the barrier, so a bump between the
//! re-check and the sleep makes the wait return at once. See `docs/ring.md`
//! for the full argument; `tests/loom.rs` model-checks it and shows that the
//! variant without the producer's fence loses wakeups.
//!
//! # Closing
//! Dropping the last producer (SPSC: the producer; MPSC: the last clone or
//! attached process handle) closes the ring and wakes a sleeping consumer,
//! which drains what was committed and then gets [`WaitStatus::Closed`].
//! Dropping the consumer closes the ring for producers: `push` then gives
//! the entry back, `push_slice` returns 0, `reserve` returns `None` (a push
//! racing with the drop may still succeed; its entry is simply never read).
//!
//! # Threads
//! Handles are `Send` (move each to its thread) but not `Sync`; the MPSC
//! producer is `Clone`, one clone per producing thread. Nothing allocates
//! after construction. Linux only (futex).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod backoff;
mod barrier;
mod batch;
mod error;
#[cfg(not(loom))]
mod futex;
mod layout;
pub mod mpsc;
mod plain;
mod ring;
#[cfg(not(loom))]
mod shm;
pub mod spsc;
mod sync;

pub use backoff::{Backoff, Step};
pub use batch::{ReadBatch, WriteBatch};
pub use error::{CapacityError, ShmError, Side};
pub use layout::{LAYOUT_VERSION, MAX_CAPACITY};
pub use plain::Plain;

/// Why a consumer's `wait` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitStatus {
    /// At least one entry is available.
    Ready,
    /// Every producer is gone and the ring is empty.
    Closed,
    /// The deadline passed with the ring still empty and open.
    TimedOut,
}
