//! Synchronisation shim: std atomics and a Linux futex normally, loom's
//! atomics, cells and a Mutex/Condvar futex model under `--cfg loom`.
//!
//! Everything in the crate that loom must see goes through this module, so the
//! loom tests check the very code that runs in production; only the futex
//! syscall itself is swapped for a model with the same semantics
//! (`wait(expected)` sleeps only if the word still equals `expected`, checked
//! atomically with respect to `wake`).

use std::time::Duration;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// One busy-wait step (of [`crate::backoff::Backoff`]).
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Give the CPU away once (a [`crate::backoff::Backoff`] yield round).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// A ring slot: an `UnsafeCell` around a plain entry (loom's cell under loom,
/// so loom checks every slot access for data races).
#[repr(transparent)]
pub(crate) struct SlotCell<T> {
    #[cfg(not(loom))]
    cell: core::cell::UnsafeCell<T>,
    #[cfg(loom)]
    cell: loom::cell::UnsafeCell<T>,
}

impl<T: Copy> SlotCell<T> {
    /// A slot holding `value`.
    #[cfg(not(loom))]
    pub(crate) fn new(value: T) -> Self {
        Self {
            cell: core::cell::UnsafeCell::new(value),
        }
    }

    /// A slot holding `value`.
    #[cfg(loom)]
    pub(crate) fn new(value: T) -> Self {
        Self {
            cell: loom::cell::UnsafeCell::new(value),
        }
    }

    /// Copy the entry out.
    ///
    /// # Safety
    /// No other thread may be writing this slot (the ring protocol gives the
    /// consumer the slot only after the producer's release store).
    #[cfg(not(loom))]
    #[inline]
    pub(crate) unsafe fn read(&self) -> T {
        // SAFETY: the caller guarantees no concurrent writer; the pointer is
        // valid and aligned because it comes from the cell.
        unsafe { self.cell.get().read() }
    }

    /// Copy the entry out.
    ///
    /// # Safety
    /// As the non-loom version; loom checks the claim.
    #[cfg(loom)]
    pub(crate) unsafe fn read(&self) -> T {
        self.cell.with(|p| {
            // SAFETY: the caller guarantees no concurrent writer.
            unsafe { p.read() }
        })
    }

    /// Store an entry.
    ///
    /// # Safety
    /// The caller must own the slot exclusively (no concurrent reader or writer).
    #[cfg(not(loom))]
    #[inline]
    pub(crate) unsafe fn write(&self, value: T) {
        // SAFETY: the caller guarantees exclusive access; the pointer is valid
        // and aligned because it comes from the cell.
        unsafe { self.cell.get().write(value) }
    }

    /// Store an entry.
    ///
    /// # Safety
    /// As the non-loom version; loom checks the claim.
    #[cfg(loom)]
    pub(crate) unsafe fn write(&self, value: T) {
        self.cell.with_mut(|p| {
            // SAFETY: the caller guarantees exclusive access.
            unsafe { p.write(value) }
        })
    }
}

/// Result of one futex wait.
#[cfg_attr(loom, allow(dead_code))] // the loom model never sees EINTR
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FutexWait {
    /// Woken by `wake` (or spuriously).
    Woken,
    /// The word did not hold the expected value (EAGAIN).
    Changed,
    /// Interrupted by a signal (EINTR).
    Interrupted,
    /// The relative timeout elapsed (ETIMEDOUT).
    TimedOut,
}

/// The doorbell word: a 32-bit counter that waiters futex-wait on and that
/// wakers bump before waking. `repr(C)` with only the word outside loom, so it
/// can live in shared memory.
#[repr(C)]
pub(crate) struct Bell {
    word: AtomicU32,
    #[cfg(loom)]
    lock: loom::sync::Mutex<()>,
    #[cfg(loom)]
    cv: loom::sync::Condvar,
}

impl Bell {
    /// A bell with counter 0.
    pub(crate) fn new() -> Self {
        Self {
            word: AtomicU32::new(0),
            #[cfg(loom)]
            lock: loom::sync::Mutex::new(()),
            #[cfg(loom)]
            cv: loom::sync::Condvar::new(),
        }
    }

    /// Current counter value.
    #[inline]
    pub(crate) fn load(&self, order: Ordering) -> u32 {
        self.word.load(order)
    }

    /// Bump the counter and wake every waiter.
    pub(crate) fn ring(&self) {
        // Release: pairs with the waiter's Acquire load of the counter
        // (`Ring::wait_until`), so a waiter that sees the bump also sees
        // everything published before it.
        self.word.fetch_add(1, Ordering::Release);
        self.wake_all();
    }

    #[cfg(not(loom))]
    fn wake_all(&self) {
        crate::futex::wake_all(&self.word);
    }

    #[cfg(loom)]
    fn wake_all(&self) {
        // Taking the lock orders this wake after any waiter's
        // check-then-sleep, which is what the kernel's futex bucket lock does.
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }

    /// Sleep while the counter equals `expected`, at most `timeout`.
    #[cfg(not(loom))]
    pub(crate) fn wait(&self, expected: u32, timeout: Option<Duration>) -> FutexWait {
        crate::futex::wait(&self.word, expected, timeout)
    }

    /// Sleep while the counter equals `expected`. loom has no clock: a wait
    /// with a timeout returns at once (a spurious wakeup, which futex allows).
    #[cfg(loom)]
    pub(crate) fn wait(&self, expected: u32, timeout: Option<Duration>) -> FutexWait {
        if timeout.is_some() {
            return FutexWait::TimedOut;
        }
        let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // Relaxed is enough under the lock: the waker bumps the word before it
        // takes the same lock, so the mutex orders the two.
        if self.word.load(Ordering::Relaxed) != expected {
            return FutexWait::Changed;
        }
        let _guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        FutexWait::Woken
    }
}
