//! Store→load barrier for the doorbell handshake, asymmetric where the
//! kernel lets us make it so.
//!
//! The doorbell is a Dekker pattern: the producer stores its publish and
//! loads `need_wakeup`; the consumer stores `need_wakeup` and loads the
//! publish. Each side needs a full (store→load) barrier between its store and
//! its load. A SeqCst fence on the producer's side costs a store-buffer drain
//! on *every* push, which stalls the producer on the cross-core transfer of
//! the tail's cache line (measured here: ~200 ns per item instead of ~40).
//!
//! So for rings whose producers and consumer live in **one process** (heap
//! rings) the barrier is asymmetric, as in folly's `asymmetricLightBarrier` /
//! `asymmetricHeavyBarrier` and the Linux `membarrier(2)` man page's own
//! example: the frequent side (producer) only stops the compiler from
//! reordering (`light`); the rare side (consumer about to sleep) runs a SeqCst
//! fence and `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (`heavy`), which
//! interrupts every CPU currently running a thread of this process and makes
//! it pass a full memory barrier before the call returns. A thread that is
//! not running passed one at its context switch. The process registers
//! (`MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`) before its first producer
//! handle exists; if registration fails, producers fall back to a real SeqCst
//! fence, and if the consumer's `heavy` call fails it caps its futex sleeps
//! at 1 ms (late, never lost, wakeups).
//!
//! Rings in **shared memory** (producers possibly in other processes) use
//! the symmetric protocol: a SeqCst fence on both sides. The cross-process
//! variant, `MEMBARRIER_CMD_GLOBAL_EXPEDITED`, picks the CPUs to interrupt
//! from per-runqueue state that the scheduler only refreshes when it switches
//! between address spaces, and with it the two-process MPSC test lost a
//! wakeup in about one run of six on Linux 6.18 (none in 20 runs with
//! fences; see `docs/ring.md`). `PRIVATE_EXPEDITED` selects CPUs by the mm
//! they are running, which has no such window.
//!
//! Under loom both sides are a SeqCst fence: the symmetric protocol is what
//! the asymmetric one implements, and what loom can check.

/// Who may produce into a ring, which decides the barrier it can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Producers and consumer are threads of this process (heap rings).
    Process,
    /// Producers may be other processes (shared-memory rings).
    #[cfg_attr(loom, allow(dead_code))] // loom models heap rings only
    Shared,
}

#[cfg(not(loom))]
mod imp {
    use super::Scope;
    use std::sync::atomic::{compiler_fence, fence, AtomicU8, Ordering};

    const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    const UNKNOWN: u8 = 0;
    const ASYMMETRIC: u8 = 1;
    const SYMMETRIC: u8 = 2;

    /// This process's mode for `Scope::Process` rings.
    static MODE: AtomicU8 = AtomicU8::new(UNKNOWN);

    fn membarrier(cmd: libc::c_int) -> bool {
        // SAFETY: membarrier takes two integer arguments (cmd, flags) and no
        // pointers; it only affects memory ordering.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_int) == 0 }
    }

    /// Register this process for expedited private membarriers (once).
    /// Called whenever a producer handle is created, before it can push.
    pub(crate) fn register_producer_process() {
        // Relaxed: MODE is only a hint; a stale UNKNOWN means SYMMETRIC,
        // which is always correct.
        if MODE.load(Ordering::Relaxed) != UNKNOWN {
            return;
        }
        let mode = if membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) {
            ASYMMETRIC
        } else {
            SYMMETRIC
        };
        // Relaxed: see above. Registration is complete (the syscall returned)
        // before any thread can read ASYMMETRIC, and the handle reaches other
        // threads through a synchronising move.
        MODE.store(mode, Ordering::Relaxed);
    }

    fn asymmetric(scope: Scope) -> bool {
        // Relaxed: see `register_producer_process`.
        scope == Scope::Process && MODE.load(Ordering::Relaxed) == ASYMMETRIC
    }

    /// Producer side, between the publish store and the `need_wakeup` load.
    #[inline]
    pub(crate) fn light(scope: Scope) {
        if asymmetric(scope) {
            // The consumer's `heavy` supplies the CPU barrier; only stop the
            // compiler from hoisting the flag load above the publish store.
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// Consumer side, between the `need_wakeup` store and the ring re-check.
    /// Returns false if the membarrier failed (the caller then bounds its
    /// sleep, since asymmetric producers may not have been fenced).
    pub(crate) fn heavy(scope: Scope) -> bool {
        fence(Ordering::SeqCst);
        // A process whose producers fence for themselves needs no IPIs. The
        // consumer of a `Process` ring shares MODE with its producers, which
        // set it before their first push.
        !asymmetric(scope) || membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)
    }
}

#[cfg(loom)]
mod imp {
    use super::Scope;
    use crate::sync::{fence, Ordering};

    pub(crate) fn register_producer_process() {}

    pub(crate) fn light(_: Scope) {
        fence(Ordering::SeqCst);
    }

    pub(crate) fn heavy(_: Scope) -> bool {
        fence(Ordering::SeqCst);
        true
    }
}

pub(crate) use imp::{heavy, light, register_producer_process};
