//! [`CancelToken`]: a cloneable cancellation flag that wakes every thread
//! blocked in a ledger admission or slot allocation that holds it.

use std::fmt;

use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering, Thread};

/// A cloneable cancellation flag. Clones share one flag.
///
/// [`cancel`](Self::cancel) sets the flag and unparks every thread that is
/// blocked in [`SlotAllocator::alloc`](crate::slots::SlotAllocator::alloc)
/// with a clone of this token; the call then returns its `Cancelled` error. The sender's
/// abort path uses this to unblock a caller waiting for staging slots.
/// Cancellation is permanent: a cancelled token stays cancelled.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    cancelled: AtomicBool,
    /// Threads currently blocked with this token, keyed by a registration id.
    sleepers: Mutex<Sleepers>,
}

#[derive(Default)]
struct Sleepers {
    next_id: u64,
    threads: Vec<(u64, Thread)>,
}

impl CancelToken {
    /// A new, not cancelled token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the token and wakes every thread blocked with it. Idempotent.
    pub fn cancel(&self) {
        // SeqCst store before taking the sleepers lock: a waiter registers
        // under that lock and then loads the flag, so either we see its
        // registration (and unpark it) or it sees the flag.
        self.inner.cancelled.store(true, Ordering::SeqCst);
        let sleepers = std::mem::take(&mut lock(&self.inner.sleepers).threads);
        if !sleepers.is_empty() {
            tracing::trace!(woken = sleepers.len(), "cancel token woke blocked waiters");
        }
        for (_, t) in sleepers {
            t.unpark();
        }
    }

    /// Whether [`cancel`](Self::cancel) was called on this token or a clone.
    pub fn is_cancelled(&self) -> bool {
        // SeqCst load: pairs with the SeqCst store in `cancel` (see there).
        self.inner.cancelled.load(Ordering::SeqCst)
    }

    /// Registers the current thread to be unparked on cancel. The returned
    /// guard unregisters it when dropped. Check `is_cancelled` *after* this.
    pub(crate) fn register_current(&self, thread: Thread) -> CancelRegistration<'_> {
        let mut s = lock(&self.inner.sleepers);
        let id = s.next_id;
        s.next_id = s.next_id.wrapping_add(1);
        s.threads.push((id, thread));
        CancelRegistration { token: self, id }
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

/// Removes a thread's registration from its token when dropped.
pub(crate) struct CancelRegistration<'a> {
    token: &'a CancelToken,
    id: u64,
}

impl Drop for CancelRegistration<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.token.inner.sleepers);
        if let Some(pos) = s.threads.iter().position(|(id, _)| *id == self.id) {
            s.threads.swap_remove(pos);
        }
    }
}

#[cfg(all(test, not(feature = "shuttle-model")))]
mod tests {
    use super::*;

    #[test]
    fn clones_share_the_flag() {
        let a = CancelToken::new();
        let b = a.clone();
        assert!(!b.is_cancelled());
        a.cancel();
        assert!(b.is_cancelled());
        a.cancel();
        assert!(a.is_cancelled());
        assert!(format!("{a:?}").contains("cancelled: true"));
    }

    #[test]
    fn registration_is_removed_on_drop() {
        let t = CancelToken::new();
        {
            let _r1 = t.register_current(std::thread::current());
            let _r2 = t.register_current(std::thread::current());
            assert_eq!(lock(&t.inner.sleepers).threads.len(), 2);
        }
        assert!(lock(&t.inner.sleepers).threads.is_empty());
    }
}
