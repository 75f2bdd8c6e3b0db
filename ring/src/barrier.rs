//! Store→load barrier for the doorbell handshake.
//!
//! The doorbell is a Dekker pattern: the producer stores its publish and
//! loads `need_wakeup`; the consumer stores `need_wakeup` and loads the
//! publish. Each side needs a full (store→load) barrier between its store
//! and its load, and here each side runs a SeqCst fence — the protocol the
//! loom models check (`ring/tests/loom.rs`), and io_uring's own choice for
//! `IORING_SQ_NEED_WAKEUP` (liburing issues a full barrier before it reads
//! the flag).
//!
//! The fence costs the producer a store-buffer drain on every publish
//! (`docs/benchmarks.md` has the figures). An asymmetric version — a compiler
//! fence on the producer and `membarrier(2)` on the consumer's way to sleep,
//! as in folly's `asymmetricLightBarrier` — was tried and removed: on this
//! VM (Linux 6.18 guest, 2 vCPUs) it lost wakeups, about one run in six of
//! the two-process MPSC test with `MEMBARRIER_CMD_GLOBAL_EXPEDITED` and about
//! one in a hundred of the three-thread doorbell test with
//! `MEMBARRIER_CMD_PRIVATE_EXPEDITED`, while the same tests passed 44 and
//! 600 runs with fences on both sides. See `docs/ring.md`.

use crate::sync::{fence, Ordering};

/// Producer side, between the publish store and the `need_wakeup` load.
#[inline]
pub(crate) fn light() {
    fence(Ordering::SeqCst);
}

/// Consumer side, between the `need_wakeup` store and the ring re-check.
#[inline]
pub(crate) fn heavy() {
    fence(Ordering::SeqCst);
}
