//! Per-request completion: what a [`Request`](super::Request) handle reads
//! without touching the sender's table ([`Signal`]), the file descriptor an
//! event loop polls ([`EventFd`]), and the thread that runs completion
//! callbacks ([`Announcer`]), so that no caller code ever runs on the ctrl
//! thread.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::RequestStatus;
use crate::eventfd::EventFd;

/// One request's state as its handle sees it: admitted yet, terminal
/// status, and the waiters (threads and an optional eventfd).
///
/// Written by the ctrl thread (admission, terminal status, its own ending
/// in the life word) and by `cancel` / a give-back (the life word, a
/// wake-up); read by any thread without taking the sender's table lock.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    /// Who ended the request (a caller's cancel or ctrl), decided by one
    /// CAS; written by callers and ctrl, read by both.
    pub life: super::life::Life,
    admitted: AtomicBool,
    terminal: OnceLock<RequestStatus>,
    /// Guards the wake-ups: a waiter checks its condition under it, a
    /// writer changes state before taking it, so no wake-up is lost.
    lock: Mutex<()>,
    cv: Condvar,
    /// Created on first [`Signal::fd`] call.
    fd: OnceLock<EventFd>,
    /// Signalled at admission, if set ([`Signal::notify_admission`]).
    admit_fd: OnceLock<Arc<EventFd>>,
    /// Signalled at the terminal status, if set ([`Signal::notify_terminal`]).
    end_fd: OnceLock<Arc<EventFd>>,
}

impl Signal {
    /// The receiver admitted the request.
    pub fn set_admitted(&self) {
        // Release: pairs with the Acquire in `is_admitted`; it publishes
        // nothing but the flag itself (staging is arbitrated by the slot
        // allocator), so Release/Acquire is enough.
        self.admitted.store(true, Ordering::Release);
        let _g = self.lock.lock();
        if let Some(fd) = self.admit_fd.get() {
            fd.signal();
        }
        self.cv.notify_all();
    }

    /// Makes `fd` signalled at admission (the first one set stays) and
    /// returns whether the request is admitted already. Both happen under
    /// the wake-up lock, which `set_admitted` takes after storing the flag:
    /// either this sees the flag or `set_admitted` sees the fd.
    pub fn notify_admission(&self, fd: &Arc<EventFd>) -> bool {
        self.arm(&self.admit_fd, fd, || self.is_admitted())
    }

    /// Makes `fd` (which many requests may share) signalled when the
    /// request becomes terminal (the first one set stays) and returns
    /// whether it is terminal already. Under the wake-up lock, which
    /// `set_terminal` takes after recording the status: either this sees
    /// the status or `set_terminal` sees the fd.
    pub fn notify_terminal(&self, fd: &Arc<EventFd>) -> bool {
        self.arm(&self.end_fd, fd, || self.terminal.get().is_some())
    }

    /// Sets `slot` to `fd` (the first one set stays) and reads `done`, both
    /// under the wake-up lock, which the writer of `done`'s state takes
    /// after changing it and before signalling `slot`.
    fn arm(
        &self,
        slot: &OnceLock<Arc<EventFd>>,
        fd: &Arc<EventFd>,
        done: impl FnOnce() -> bool,
    ) -> bool {
        let _g = self.lock.lock();
        let _ = slot.set(Arc::clone(fd));
        done()
    }

    /// Whether the receiver admitted the request.
    pub fn is_admitted(&self) -> bool {
        // Acquire: see `set_admitted`.
        self.admitted.load(Ordering::Acquire)
    }

    /// Records the terminal status (first one wins) and wakes every waiter
    /// and the eventfd. False if it was already terminal.
    pub fn set_terminal(&self, status: RequestStatus) -> bool {
        if self.terminal.set(status).is_err() {
            return false;
        }
        let _g = self.lock.lock();
        if let Some(fd) = self.fd.get() {
            fd.signal();
        }
        if let Some(fd) = self.end_fd.get() {
            fd.signal();
        }
        self.cv.notify_all();
        true
    }

    /// The terminal status, if any.
    pub fn terminal(&self) -> Option<&RequestStatus> {
        self.terminal.get()
    }

    /// The status callers see (never blocks).
    pub fn status(&self) -> RequestStatus {
        self.terminal
            .get()
            .cloned()
            .unwrap_or(RequestStatus::InProgress)
    }

    /// Wakes the waiters so they re-check their condition (e.g. after a
    /// cancel that is not terminal yet).
    pub fn wake(&self) {
        let _g = self.lock.lock();
        self.cv.notify_all();
    }

    /// Waits until `done()` holds or `deadline` passes; returns `done()`.
    /// `done` must only read state whose writers call [`wake`](Self::wake)
    /// (or `set_admitted` / `set_terminal`) after changing it.
    pub fn wait_until(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
        let mut g = self.lock.lock();
        loop {
            if done() {
                return true;
            }
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return done();
            }
        }
    }

    /// The eventfd that becomes readable once the request is terminal
    /// (made on first call; readable at once if it already is).
    pub fn fd(&self) -> io::Result<BorrowedFd<'_>> {
        let _g = self.lock.lock();
        if self.fd.get().is_none() {
            let fd = EventFd::new()?;
            // Cannot fail: set under the lock, after checking it was unset.
            let _ = self.fd.set(fd);
            if self.terminal.get().is_some() {
                // Terminal before the fd existed: `set_terminal` did not see it.
                if let Some(fd) = self.fd.get() {
                    fd.signal();
                }
            }
        }
        match self.fd.get() {
            Some(fd) => Ok(fd.as_fd()),
            None => Err(io::Error::other("eventfd missing after creation")),
        }
    }
}

/// Callback run (on the sender's announcer thread, never on ctrl) when a
/// request reaches a terminal status.
pub type CompletionCallback = Arc<dyn Fn(&str, &RequestStatus) + Send + Sync>;

/// How long the announcer thread sleeps with nothing to do before it
/// re-checks the stop flag (a safety net; work and stop both wake it).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Runs completion callbacks on its own thread, in the order requests ended.
///
/// The queue holds one entry per request that ended while a callback was
/// set and has not been announced yet: at most the number of requests the
/// callers began, never anything a peer can grow.
#[derive(Default)]
pub(crate) struct Announcer {
    queue: Mutex<VecDeque<(String, RequestStatus)>>,
    cv: Condvar,
    stop: AtomicBool,
    callback: Mutex<Option<CompletionCallback>>,
}

impl Announcer {
    pub fn set_callback(&self, cb: Option<CompletionCallback>) {
        *self.callback.lock() = cb;
    }

    /// Queues terminal statuses for the callback (dropped if none is set).
    pub fn announce(&self, finished: &mut Vec<(String, RequestStatus)>) {
        if finished.is_empty() {
            return;
        }
        if self.callback.lock().is_none() {
            finished.clear();
            return;
        }
        self.queue.lock().extend(finished.drain(..));
        self.cv.notify_one();
    }

    /// Asks the thread to stop once the queue is drained.
    pub fn stop(&self) {
        // Release: pairs with the Acquire in `run`; the flag publishes nothing else.
        self.stop.store(true, Ordering::Release);
        let _g = self.queue.lock();
        self.cv.notify_all();
    }

    /// The announcer thread's loop.
    pub fn run(self: Arc<Self>) {
        let mut batch = Vec::new();
        loop {
            {
                let mut q = self.queue.lock();
                // Acquire: see `stop`.
                while q.is_empty() && !self.stop.load(Ordering::Acquire) {
                    let _ = self.cv.wait_for(&mut q, IDLE_WAIT);
                }
                if q.is_empty() {
                    return;
                }
                batch.extend(q.drain(..));
            }
            let cb = self.callback.lock().clone();
            if let Some(cb) = cb {
                for (req, status) in batch.drain(..) {
                    cb(&req, &status);
                }
            }
            batch.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared fd registered before the end is signalled by it; one
    /// registered after is not signalled, and the registration says the
    /// request already ended (the caller then looks at it itself).
    #[test]
    fn notify_terminal_either_signals_or_reports_the_end() {
        let fd = Arc::new(EventFd::new().expect("eventfd"));
        let before = Signal::default();
        assert!(!before.notify_terminal(&fd));
        assert_eq!(fd.clear(), 0, "signalled before the end");
        assert!(before.set_terminal(RequestStatus::Completed));
        assert_eq!(fd.clear(), 1, "the end did not signal the shared fd");

        let after = Signal::default();
        assert!(after.set_terminal(RequestStatus::Cancelled));
        assert!(after.notify_terminal(&fd), "an ended request not reported");
        assert_eq!(fd.clear(), 0);
    }
}
