//! Asymmetric store→load barrier for the doorbell handshake.
//!
//! The doorbell is a Dekker pattern: the producer stores the tail and loads
//! `need_wakeup`; the consumer stores `need_wakeup` and loads the tail. Each
//! side needs a full (store→load) barrier between its store and its load.
//! A SeqCst fence on the producer's side costs a store-buffer drain on
//! *every* push, which stalls the producer on the cross-core transfer of the
//! tail's cache line (measured here: ~200 ns per item instead of ~40).
//!
//! So the barrier is asymmetric, as in folly's `asymmetricLightBarrier` /
//! `asymmetricHeavyBarrier` and the Linux `membarrier(2)` man page's own
//! example: the frequent side (producer) only stops the compiler from
//! reordering (`light`); the rare side (consumer about to sleep) runs a SeqCst
//! fence and `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)` (`heavy`), which
//! makes every running thread of every registered process pass a full memory
//! barrier before it returns. A thread that is not running passed one at its
//! context switch. Every process that creates a producer handle registers
//! first (`MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED`); if registration fails,
//! that process's producers fall back to a real SeqCst fence, and if the
//! consumer's `heavy` call fails it caps its futex sleeps at 1 ms (late, never
//! lost, wakeups).
//!
//! Under loom both sides are a SeqCst fence: the symmetric protocol is what
//! the asymmetric one implements, and what loom can check.

#[cfg(not(loom))]
mod imp {
    use std::sync::atomic::{compiler_fence, fence, AtomicU8, Ordering};

    const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
    const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;

    const UNKNOWN: u8 = 0;
    const ASYMMETRIC: u8 = 1;
    const SYMMETRIC: u8 = 2;

    /// This process's producer-side mode.
    static MODE: AtomicU8 = AtomicU8::new(UNKNOWN);

    fn membarrier(cmd: libc::c_int) -> bool {
        // SAFETY: membarrier takes two integer arguments (cmd, flags) and no
        // pointers; it only affects memory ordering.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_int) == 0 }
    }

    /// Register this process for expedited global membarriers (once). Called
    /// whenever a producer handle is created, before it can push.
    pub(crate) fn register_producer_process() {
        // Relaxed: MODE is only a hint; a stale UNKNOWN means SYMMETRIC,
        // which is always correct.
        if MODE.load(Ordering::Relaxed) != UNKNOWN {
            return;
        }
        let mode = if membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) {
            ASYMMETRIC
        } else {
            SYMMETRIC
        };
        // Relaxed: see above. Registration is complete (the syscall returned)
        // before any thread can read ASYMMETRIC, and the handle reaches other
        // threads through a synchronising move.
        MODE.store(mode, Ordering::Relaxed);
    }

    /// Producer side, between the publish store and the `need_wakeup` load.
    #[inline]
    pub(crate) fn light() {
        // Relaxed: see `register_producer_process`.
        if MODE.load(Ordering::Relaxed) == ASYMMETRIC {
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
    pub(crate) fn heavy() -> bool {
        fence(Ordering::SeqCst);
        membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)
    }
}

#[cfg(loom)]
mod imp {
    use crate::sync::{fence, Ordering};

    pub(crate) fn register_producer_process() {}

    pub(crate) fn light() {
        fence(Ordering::SeqCst);
    }

    pub(crate) fn heavy() -> bool {
        fence(Ordering::SeqCst);
        true
    }
}

pub(crate) use imp::{heavy, light, register_producer_process};
