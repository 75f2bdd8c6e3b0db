//! The sender's queue pairs, shared by the poster (which posts on them) and
//! the CQ thread (which maps their completions back to ops).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::eventfd::EventFd;
use crate::transport::{Completion, CompletionStatus, PeerIndex};

use super::inflight::Inflight;
use super::info::QpInfo;
use super::plan::PeerState;
use super::verbs::Qp;

/// One connected receiver: its queue pair, its region and the ops in flight.
pub(super) struct PeerQp {
    pub(super) qp: Qp,
    pub(super) remote: QpInfo,
    /// Held while posting, so an op is recorded before the NIC can complete it.
    pub(super) inflight: Mutex<Inflight>,
}

/// State shared by the poster and the CQ thread.
pub(super) struct Shared {
    /// By [`PeerIndex`]; indices are never reused.
    pub(super) peers: RwLock<Vec<Option<Arc<PeerQp>>>>,
    /// By local QP number (work completions carry it).
    pub(super) by_qpn: RwLock<HashMap<u32, Arc<PeerQp>>>,
    /// Completions decided by the poster without the NIC (bad ops, failed
    /// or unknown peers); the CQ thread moves them to the completion ring.
    pub(super) immediate: Mutex<Vec<Completion>>,
    /// Completions returned by `Completions::poll` so far.
    pub(super) returned: AtomicU64,
    /// Set when the poster is dropped: the CQ thread exits once idle.
    pub(super) closing: AtomicBool,
    /// Wakes the CQ thread from its sleep (the poster's doorbell).
    pub(super) wake: EventFd,
}

impl Shared {
    pub(super) fn new() -> io::Result<Self> {
        Ok(Self {
            peers: RwLock::new(Vec::new()),
            by_qpn: RwLock::new(HashMap::new()),
            immediate: Mutex::new(Vec::new()),
            returned: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            wake: EventFd::new()?,
        })
    }

    /// The planner's view of `peer`.
    pub(super) fn state(&self, peer: PeerIndex) -> Option<PeerState> {
        let peers = self.peers.read();
        let p = peers.get(peer as usize)?.as_ref()?;
        Some(if p.inflight.lock().failed() {
            PeerState::Failed
        } else {
            PeerState::Ready {
                remote_len: p.remote.len,
            }
        })
    }

    /// The connected peer `peer`.
    pub(super) fn peer(&self, peer: PeerIndex) -> Option<Arc<PeerQp>> {
        self.peers.read().get(peer as usize)?.clone()
    }

    /// Queues completions for the CQ thread to deliver and wakes it.
    pub(super) fn complete_now(&self, done: impl IntoIterator<Item = (u64, CompletionStatus)>) {
        let mut q = self.immediate.lock();
        let before = q.len();
        q.extend(done.into_iter().map(|(w, s)| Completion::new(w, s)));
        let added = q.len() > before;
        drop(q);
        if added {
            self.wake.signal();
        }
    }

    /// Ops in flight on every queue pair (for the exit check).
    pub(super) fn all_idle(&self) -> bool {
        self.immediate.lock().is_empty()
            && self
                .by_qpn
                .read()
                .values()
                .all(|p| p.inflight.lock().is_empty())
    }

    /// Completions returned so far.
    pub(super) fn returned(&self) -> u64 {
        // Acquire: pairs with the Release in `add_returned`; a poster that
        // sees the count also sees the ring room those completions freed.
        self.returned.load(Ordering::Acquire)
    }

    /// Called by the completion half after it popped `n` completions.
    pub(super) fn add_returned(&self, n: usize) {
        // Release: pairs with the Acquire in `returned` (see there).
        self.returned.fetch_add(n as u64, Ordering::Release);
    }

    /// True once the poster is gone.
    pub(super) fn is_closing(&self) -> bool {
        // Acquire: pairs with the Release in `close`, so the CQ thread sees
        // every post the poster made before it closed.
        self.closing.load(Ordering::Acquire)
    }

    /// Marks the poster gone and wakes the CQ thread.
    pub(super) fn close(&self) {
        // Release: pairs with the Acquire in `is_closing`.
        self.closing.store(true, Ordering::Release);
        self.wake.signal();
    }
}
