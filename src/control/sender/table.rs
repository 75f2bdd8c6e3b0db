//! The sender's shared request table: per-request progress (in a slab, by
//! the [`ReqKey`] a [`Request`](super::Request) handle carries), batches
//! waiting to be sent or written. One lock guards it, held for short,
//! allocation-free steps by the ctrl thread. Caller threads take it only in
//! `begin` (to insert the request, or take it out again if its admission
//! message could not be handed over) and in the `Sender::dump` debug dump:
//! submits, cancels, give-backs, error paths and the calls naming a request
//! by id go through the request's `Common` state, the submission ring and
//! the name index (`names.rs`). The poll thread never takes it: writes in
//! flight ([`InFlight`]) are ctrl's own, and completions reach ctrl through
//! a ring (`poll.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use crate::slots::SlotSet;
use crate::transport::PeerIndex;

use super::core::{Phase, Progress};
use super::keys::KeyList;
use super::registered::WriteLease;
use super::request::Common;
use super::slab::{Key, Slab};
use super::RequestStatus;

/// Where a batch's bytes are.
#[derive(Debug)]
pub(crate) enum BatchData {
    /// In the pending area (request not admitted when stored).
    Pending(Vec<u8>),
    /// In staging slots, one per chunk, in order.
    Staged(SlotSet),
    /// In caller-registered memory: chunk `i` is `src[i] = (region id,
    /// offset)`; the lease keeps the regions registered until the writes
    /// completed.
    Registered {
        src: SmallVec<[(u32, u64); 16]>,
        lease: Arc<WriteLease>,
    },
    /// An empty last batch.
    Empty,
    /// A declared batch's bytes, still with its caller (its AllocRequest
    /// is the request's admission): they come in a [`Batch`] with `fills`
    /// set, staged.
    Declared,
}

/// A request's key in [`Table::reqs`]: a stale one (of a request the table
/// forgot) reaches nothing, even once its slot holds a newer request.
pub(crate) type ReqKey = Key;

/// One `store` call's batch.
#[derive(Debug)]
pub(crate) struct Batch {
    pub req: ReqKey,
    /// The chunks' keys, copied once from the caller (one buffer).
    pub keys: KeyList,
    pub lens: SmallVec<[u32; 16]>,
    pub data: BatchData,
    pub is_last: bool,
    pub stored_at: Instant,
    pub last_chunk_toks: i64,
    /// Total payload bytes (pending-area accounting).
    pub bytes: usize,
    /// After the reply: receiver slot per chunk position.
    pub remote: Vec<i64>,
    /// After the reply: chunk positions to write (dedup'd ones removed).
    pub writes: SmallVec<[u32; 16]>,
    /// Not a batch of its own: the bytes (staged) of its request's
    /// declared batch, which ctrl moves into that batch.
    pub fills: bool,
}

/// A request's lifecycle on the sender (see [`Phase`]).
pub(crate) type ReqState = Phase<RequestStatus>;

/// Source of [`Req::order`].
static NEXT_ORDER: AtomicU64 = AtomicU64::new(0);

/// A request's progress.
#[derive(Debug)]
pub(crate) struct Req {
    /// What its handles (and the name index) share: id, receiver, total,
    /// stored count, signal with the life word, cancel token.
    pub c: Arc<Common>,
    /// Creation order (first `store`): the ctrl thread serves older
    /// requests first, so first batches leave in store order.
    pub order: u64,
    /// The protocol state (decisions in `core.rs`).
    pub p: Progress<RequestStatus>,
    /// Every key named in an AllocRequest (for CancelNotif).
    pub keys_sent: KeyList,
    /// The batch id of its declared batch until its bytes came.
    pub declared: Option<u64>,
    pub first_sent_at: Option<Instant>,
    pub last_completion_at: Option<Instant>,
    pub bytes: u64,
}

impl Req {
    pub fn new(c: Arc<Common>) -> Self {
        Self {
            c,
            // Relaxed: one RMW chain is totally ordered on its own, and
            // requests are created under the table lock, so the numbers
            // follow creation order; nothing else is published through it.
            order: NEXT_ORDER.fetch_add(1, Ordering::Relaxed),
            p: Progress::default(),
            keys_sent: KeyList::default(),
            declared: None,
            first_sent_at: None,
            last_completion_at: None,
            bytes: 0,
        }
    }

    /// Starts ctrl's own abort of a live request (`Pending`/`Admitted`):
    /// records the status to report and wakes the callers blocked for it
    /// (see [`aborted`](Self::aborted)). False if it is not live.
    pub fn abort_with(&mut self, status: RequestStatus) -> bool {
        if !self.p.abort_with(status) {
            return false;
        }
        self.aborted();
        true
    }

    /// The core moved the request to `Aborting` for ctrl's own reason (a
    /// refusal, a failed write, a timeout...): claims the request in its
    /// life word, and if a caller stopped it first (a cancel that returned
    /// `true`), reports the caller's status instead; then wakes its callers.
    pub fn aborted(&mut self) {
        if let ReqState::Aborting(status) = &self.p.state {
            if let Some(stop) = self.c.signal.life.abort(status) {
                self.p.state = ReqState::Aborting(stop.status());
            }
        }
        self.wake_stopped();
    }

    /// Takes over a caller's stop (cancel, orphaning give-back) that ctrl
    /// has not acted on: a live request a caller stopped moves to
    /// `Aborting` with the caller's status. True if it did.
    pub fn take_caller_stop(&mut self) -> bool {
        if !self.p.state.live() {
            return false;
        }
        let Some(stop) = self.c.signal.life.stopped_by_caller() else {
            return false;
        };
        self.p.abort_with(stop.status());
        self.wake_stopped();
        true
    }

    /// Fires the cancel token and wakes the waiters (both idempotent: the
    /// caller that stopped the request did so too).
    fn wake_stopped(&self) {
        self.c.cancel.cancel();
        self.c.signal.wake();
    }

    /// One line for state dumps.
    pub fn describe(&self) -> String {
        let stored = self.c.stored.get();
        format!(
            "req {} -> {}: {:?}, stored {}/{} completed {}, queued {}, awaiting reply {}, unstaged {}, in flight {}, last stored {} replied {}",
            self.c.req_id,
            self.c.receiver,
            self.p.state,
            stored.chunks,
            self.c.total,
            self.p.completed_chunks,
            self.p.queued.len(),
            self.p.awaiting_reply,
            self.p.unstaged.len(),
            self.p.in_flight_ops,
            stored.last,
            self.p.last_replied
        )
    }
}

/// A posted write: which request, how many chunks, which staging slots.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub req: ReqKey,
    pub chunks: u32,
    pub bytes: u64,
    pub slots: SlotSet,
    /// A write from registered memory: released with this op.
    pub lease: Option<Arc<WriteLease>>,
    pub posted_at: Instant,
    /// The transport peer it was posted to (so a `ConnectionLost`
    /// completion names the peer that lost its connection).
    pub peer: PeerIndex,
}

/// How many terminal requests the table remembers for `status` queries.
pub(crate) const TERMINAL_MEMORY: usize = 1 << 16;

/// The shared table.
#[derive(Debug)]
pub(crate) struct Table {
    /// Live requests and the last [`TERMINAL_MEMORY`] terminal ones.
    pub reqs: Slab<Req>,
    /// Batches ctrl took from the submission ring, by the id it gave them.
    pub batches: HashMap<u64, Batch>,
    /// Terminal requests in the order they ended (for forgetting old ones).
    pub terminal_order: VecDeque<ReqKey>,
    /// How many terminal requests are remembered ([`TERMINAL_MEMORY`]; the
    /// tests lower it to make slots reused).
    pub terminal_memory: usize,
}

impl Default for Table {
    fn default() -> Self {
        Self {
            reqs: Slab::default(),
            batches: HashMap::new(),
            terminal_order: VecDeque::new(),
            terminal_memory: TERMINAL_MEMORY,
        }
    }
}

impl Table {
    /// Registers the request `make` builds for its key (`begin`, which
    /// also names it in the sender's name index).
    pub fn insert(&mut self, make: impl FnOnce(ReqKey) -> Req) -> ReqKey {
        self.reqs.insert_with(make)
    }

    /// Forgets a request (the caller forgets its name).
    pub fn remove(&mut self, key: ReqKey) -> Option<Req> {
        self.reqs.remove(key)
    }

    /// Marks a request terminal and forgets the oldest terminal ones,
    /// adding their ids and keys to `forgotten` (ctrl removes them from the
    /// name index once it released the table lock).
    pub fn finish(
        &mut self,
        key: ReqKey,
        status: RequestStatus,
        forgotten: &mut Vec<(Arc<str>, ReqKey)>,
    ) {
        if let Some(r) = self.reqs.get_mut(key) {
            r.c.signal.set_terminal(status.clone());
            r.p.finish(status);
            self.terminal_order.push_back(key);
        }
        while self.terminal_order.len() > self.terminal_memory {
            if let Some(old) = self.terminal_order.pop_front() {
                if matches!(
                    self.reqs.get(old).map(|r| &r.p.state),
                    Some(ReqState::Done(_))
                ) {
                    if let Some(r) = self.remove(old) {
                        forgotten.push((Arc::clone(&r.c.req_id), old));
                    }
                }
            }
        }
    }
}
