//! Per-request readiness for decoders: [`RequestHandle`] (a status that
//! never blocks, a wait with a deadline, and an eventfd an event loop
//! polls), fed by the receiver's finished log.
//!
//! Requests are keyed by (peer, `req_id`) in the core, but a decoder names
//! one by `req_id` alone: a handle reports the **first** request of that id
//! to end (any peer), like [`super::Receiver::wait_ready`]. Taking its
//! chunks ([`super::Receiver::take`]) refuses to guess instead
//! ([`super::TakeError::Ambiguous`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;

use crate::eventfd::EventFd;
use crate::protocol::ErrorCode;

use super::core::Outcome;
use super::{Shared, WaitError};

/// What one handle watches: the outcome, once known, and the eventfd it
/// signals (its own, or one shared by many handles:
/// [`super::Receiver::watch_signalling`]).
#[derive(Debug)]
pub(crate) struct Watch {
    outcome: OnceLock<Outcome>,
    fd: Arc<EventFd>,
}

impl Watch {
    /// Records the outcome (the first one wins) and makes the fd readable.
    fn finish(&self, outcome: Outcome) {
        let _ = self.outcome.set(outcome);
        self.fd.signal();
    }
}

/// The handles waiting for each request id, and the [`ReadyFeed`]s. Grown
/// only by the decoder's own [`super::Receiver::watch`] and
/// [`super::Receiver::ready_feed`] calls (never by a peer); a handle or feed
/// removes itself when dropped, and an id's entry goes when its request ends.
#[derive(Debug, Default)]
pub(crate) struct Watchers(HashMap<String, Vec<Arc<Watch>>>, Vec<Arc<Feed>>);

impl Watchers {
    /// A request ended: tells its handles, and the feeds if it is ready.
    pub fn finished(&mut self, req_id: &str, outcome: Outcome) {
        if let Some(ws) = self.0.remove(req_id) {
            for w in ws {
                w.finish(outcome);
            }
        }
        if outcome == Outcome::Ready {
            for f in &self.1 {
                f.push(req_id);
            }
        }
    }

    /// The receiver shut down: wakes every handle (their status says so)
    /// and feed.
    pub fn shut_down(&mut self) {
        for (_, ws) in self.0.drain() {
            for w in ws {
                w.fd.signal();
            }
        }
        for f in &self.1 {
            f.fd.signal();
        }
    }

    fn remove(&mut self, req_id: &str, watch: &Arc<Watch>) {
        if let Some(ws) = self.0.get_mut(req_id) {
            ws.retain(|w| !Arc::ptr_eq(w, watch));
            if ws.is_empty() {
                self.0.remove(req_id);
            }
        }
    }
}

/// Where a request stands, as [`RequestHandle::status`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Not ended yet (or unknown to the receiver so far).
    Pending,
    /// Every chunk is in place: [`super::Receiver::take`] hands them out.
    Ready,
    /// The request failed or was cancelled, with this code.
    Failed(ErrorCode),
    /// The receiver shut down before the request ended.
    ShutDown,
}

/// A decoder's view of one request id: never-blocking
/// [`status`](Self::status), [`wait`](Self::wait) with a deadline, and a
/// file descriptor ([`AsFd`]) that becomes readable when the request is
/// ready, fails, or the receiver shuts down — for epoll/mio/tokio's
/// `AsyncFd`. The fd stays readable (nothing reads its counter).
///
/// See the module docs for two peers using the same `req_id`.
pub struct RequestHandle {
    shared: Arc<Shared>,
    req_id: String,
    watch: Arc<Watch>,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("req_id", &self.req_id)
            .field("status", &self.status())
            .finish()
    }
}

impl RequestHandle {
    pub(super) fn new(shared: &Arc<Shared>, req_id: &str) -> io::Result<Self> {
        Ok(Self::signalling(shared, req_id, Arc::new(EventFd::new()?)))
    }

    /// A handle that signals `fd` when the request ends (the outcome is
    /// set first, so whoever clears `fd` and then reads the status sees it).
    pub(super) fn signalling(shared: &Arc<Shared>, req_id: &str, fd: Arc<EventFd>) -> Self {
        let watch = Arc::new(Watch {
            outcome: OnceLock::new(),
            fd,
        });
        let mut st = shared.state.lock();
        if let Some(o) = st.finished.get(req_id) {
            watch.finish(*o);
        } else if st.shut_down {
            watch.fd.signal();
        } else {
            st.watchers
                .0
                .entry(req_id.to_owned())
                .or_default()
                .push(Arc::clone(&watch));
        }
        drop(st);
        Self {
            shared: Arc::clone(shared),
            req_id: req_id.to_owned(),
            watch,
        }
    }

    /// The request id watched.
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Where the request stands now. Takes no lock.
    pub fn status(&self) -> RequestStatus {
        match self.watch.outcome.get() {
            Some(Outcome::Ready) => RequestStatus::Ready,
            Some(Outcome::Failed(code)) => RequestStatus::Failed(*code),
            // Acquire: pairs with the Release store in `stop_and_join`; the
            // flag publishes nothing else.
            None if self.shared.stop.load(Ordering::Acquire) => RequestStatus::ShutDown,
            None => RequestStatus::Pending,
        }
    }

    /// Waits until the request is ready (`Ok`), failed
    /// ([`WaitError::Failed`] with its code), the receiver shuts down, or
    /// `deadline` passes ([`WaitError::Timeout`]).
    pub fn wait(&self, deadline: Instant) -> Result<(), WaitError> {
        let mut st = self.shared.state.lock();
        loop {
            // The outcome is set under the state lock, before the condvar
            // is notified: checked under it, no wake-up is lost.
            match self.watch.outcome.get() {
                Some(Outcome::Ready) => return Ok(()),
                Some(Outcome::Failed(code)) => return Err(WaitError::Failed(*code)),
                None if st.shut_down => return Err(WaitError::ShutDown),
                None => {}
            }
            if self
                .shared
                .finished_cv
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                return match self.watch.outcome.get() {
                    Some(Outcome::Ready) => Ok(()),
                    Some(Outcome::Failed(code)) => Err(WaitError::Failed(*code)),
                    None => Err(WaitError::Timeout),
                };
            }
        }
    }
}

impl AsFd for RequestHandle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.watch.fd.as_fd()
    }
}

impl AsRawFd for RequestHandle {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.watch.fd.as_fd().as_raw_fd()
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .watchers
            .remove(&self.req_id, &self.watch);
    }
}

/// One [`ReadyFeed`]'s queue: bounded, readable fd while not empty.
#[derive(Debug)]
pub(crate) struct Feed {
    fd: EventFd,
    ready: Mutex<VecDeque<String>>,
    max: usize,
    dropped: AtomicU64,
}

impl Feed {
    fn push(&self, req_id: &str) {
        let mut q = self.ready.lock();
        if q.len() >= self.max {
            drop(q);
            // Relaxed: a statistic.
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.push_back(req_id.to_owned());
        drop(q);
        self.fd.signal();
    }
}

/// The ids of the requests that become ready (their sender's
/// `TransferDone`) from its creation on, in that order: for a decoder that
/// consumes requests it does not know by id (the attach daemon's wildcard
/// subscriptions). At most `max` ids wait in it; the ids of requests that
/// become ready while it is full are not queued ([`dropped`](Self::dropped)
/// counts them) and stay for [`super::Receiver::take`] by id. Its file
/// descriptor ([`AsRawFd`]) is readable while ids wait (or after the
/// receiver shut down). An id in the feed may already be taken by the time
/// it is popped: `take` says so.
pub struct ReadyFeed {
    shared: Arc<Shared>,
    feed: Arc<Feed>,
}

impl std::fmt::Debug for ReadyFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadyFeed")
            .field("waiting", &self.feed.ready.lock().len())
            .finish()
    }
}

impl ReadyFeed {
    pub(super) fn new(shared: &Arc<Shared>, max: usize) -> io::Result<Self> {
        let feed = Arc::new(Feed {
            fd: EventFd::new()?,
            ready: Mutex::new(VecDeque::new()),
            max,
            dropped: AtomicU64::new(0),
        });
        shared.state.lock().watchers.1.push(Arc::clone(&feed));
        Ok(Self {
            shared: Arc::clone(shared),
            feed,
        })
    }

    /// The oldest waiting id, if any. Never blocks (beyond the feed's own
    /// short lock).
    pub fn pop(&self) -> Option<String> {
        let mut q = self.feed.ready.lock();
        let id = q.pop_front();
        if q.is_empty() {
            // Under the queue lock: a push after this re-signals, so no
            // wake-up is lost (a stale one only makes a poll return early).
            self.feed.fd.clear();
        }
        id
    }

    /// True if ids may be waiting (the fd's flag: no syscall, no lock).
    pub(crate) fn raised(&self) -> bool {
        self.feed.fd.raised()
    }

    /// Ids not queued because the feed was full.
    pub fn dropped(&self) -> u64 {
        // Relaxed: a statistic.
        self.feed.dropped.load(Ordering::Relaxed)
    }
}

impl AsRawFd for ReadyFeed {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.feed.fd.as_fd().as_raw_fd()
    }
}

impl Drop for ReadyFeed {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .watchers
            .1
            .retain(|f| !Arc::ptr_eq(f, &self.feed));
    }
}
