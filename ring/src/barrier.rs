//! The store→load barrier of the doorbell handshake.
//!
//! The doorbell is a Dekker pattern: the producer stores its publish and
//! loads `need_wakeup`; the consumer stores `need_wakeup` and loads the
//! publish. Each side needs a full (store→load) barrier between its store
//! and its load; both run [`store_load`], a SeqCst fence — the protocol the
//! loom models check (`ring/tests/loom.rs`), and io_uring's own choice for
//! `IORING_SQ_NEED_WAKEUP` (liburing issues a full barrier before it reads
//! the flag).
//!
//! Two cheaper-looking alternatives were measured or tried and rejected
//! (`docs/ring.md`, "Why full fences"): folding the flag into the published
//! word and publishing with one `lock xchg` (loom-proven, but a single push
//! took about twice as long as store + `mfence` on this VM), and an
//! asymmetric barrier (compiler fence + `membarrier(2)`), which lost wakeups
//! here.

use crate::sync::{fence, Ordering};

/// Full store→load barrier, run by the producer between its publish store
/// and its `need_wakeup` load, and by the consumer between its `need_wakeup`
/// store and its re-check of the ring.
#[inline]
pub(crate) fn store_load() {
    fence(Ordering::SeqCst);
}
