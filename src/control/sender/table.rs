//! The sender's shared request table: per-request progress, batches waiting
//! to be sent or written, and writes in flight. One lock guards it; caller,
//! ctrl and poll threads hold it for short, allocation-free steps.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use crate::cancel::CancelToken;
use crate::slots::SlotSet;
use crate::transport::PeerIndex;

use super::completion::Signal;
use super::core::{Phase, Progress};
use super::keys::KeyList;
use super::registered::WriteLease;
use super::{RequestSpec, RequestStatus};

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
}

/// One `store` call's batch.
#[derive(Debug)]
pub(crate) struct Batch {
    pub req_id: String,
    /// The chunks' keys, copied once from the caller (one buffer).
    pub keys: KeyList,
    pub lens: SmallVec<[u32; 16]>,
    pub data: BatchData,
    pub is_last: bool,
    pub stored_at: Instant,
    pub fmt: i64,
    pub shape: Vec<i64>,
    pub dtype: String,
    pub last_chunk_toks: i64,
    /// Total payload bytes (pending-area accounting).
    pub bytes: usize,
    /// After the reply: receiver slot per chunk position.
    pub remote: Vec<i64>,
    /// After the reply: chunk positions to write (dedup'd ones removed).
    pub writes: SmallVec<[u32; 16]>,
}

/// A request's lifecycle on the sender (see [`Phase`]).
pub(crate) type ReqState = Phase<RequestStatus>;

/// Source of [`Req::order`].
static NEXT_ORDER: AtomicU64 = AtomicU64::new(0);

/// A request's progress.
#[derive(Debug)]
pub(crate) struct Req {
    pub req_id: String,
    /// The same id, shared by the request's writes in flight (one
    /// allocation per request, not one per posted write).
    pub id: Arc<str>,
    /// Creation order (first `store`): the ctrl thread serves older
    /// requests first, so first batches leave in store order.
    pub order: u64,
    pub receiver: String,
    pub total: usize,
    /// Chunk geometry of the request's batches (from its `RequestSpec`).
    pub fmt: i64,
    pub shape: Vec<i64>,
    pub dtype: String,
    /// The protocol state (decisions in `core.rs`).
    pub p: Progress<RequestStatus>,
    pub cancel: CancelToken,
    /// What the request's handles read (admission, terminal status).
    pub signal: Arc<Signal>,
    /// Every key named in an AllocRequest (for CancelNotif).
    pub keys_sent: KeyList,
    pub first_sent_at: Option<Instant>,
    pub last_completion_at: Option<Instant>,
    pub bytes: u64,
}

impl Req {
    pub fn new(spec: &RequestSpec, chunk_bytes: u64, signal: Arc<Signal>) -> Self {
        Self {
            req_id: spec.req_id.clone(),
            id: Arc::from(spec.req_id.as_str()),
            // Relaxed: one RMW chain is totally ordered on its own, and
            // requests are created under the table lock, so the numbers
            // follow creation order; nothing else is published through it.
            order: NEXT_ORDER.fetch_add(1, Ordering::Relaxed),
            receiver: spec.receiver.clone(),
            total: spec.total_chunks,
            fmt: spec.fmt,
            shape: if spec.shape.is_empty() {
                vec![chunk_bytes as i64]
            } else {
                spec.shape.clone()
            },
            dtype: spec.dtype.clone(),
            p: Progress::default(),
            cancel: CancelToken::new(),
            signal,
            keys_sent: KeyList::default(),
            first_sent_at: None,
            last_completion_at: None,
            bytes: 0,
        }
    }

    /// Starts the abort path of a live request (`Pending`/`Admitted`):
    /// records the status to report, wakes the callers blocked for it
    /// (staging waits and admission waits). False if it is not live.
    pub fn abort_with(&mut self, status: RequestStatus) -> bool {
        if !self.p.abort_with(status) {
            return false;
        }
        self.aborted();
        true
    }

    /// The core moved the request to `Aborting`: wake its callers.
    pub fn aborted(&self) {
        self.cancel.cancel();
        self.signal.wake();
    }

    /// The status callers see.
    pub fn status(&self) -> RequestStatus {
        match &self.p.state {
            ReqState::Done(s) => s.clone(),
            _ => RequestStatus::InProgress,
        }
    }

    /// One line for state dumps.
    pub fn describe(&self) -> String {
        format!(
            "req {} -> {}: {:?}, stored {}/{} completed {}, queued {}, awaiting reply {}, unstaged {}, in flight {}, last stored {} replied {}",
            self.req_id,
            self.receiver,
            self.p.state,
            self.p.stored_chunks,
            self.total,
            self.p.completed_chunks,
            self.p.queued.len(),
            self.p.awaiting_reply,
            self.p.unstaged.len(),
            self.p.in_flight_ops,
            self.p.last_stored,
            self.p.last_replied
        )
    }
}

/// A posted write: which request, how many chunks, which staging slots.
#[derive(Debug)]
pub(crate) struct InFlight {
    /// The request's [`Req::id`] (shared, not copied per write).
    pub req_id: Arc<str>,
    pub chunks: u32,
    pub bytes: u64,
    pub slots: SlotSet,
    /// A write from registered memory: released with this op.
    pub lease: Option<Arc<WriteLease>>,
    pub posted_at: Instant,
    /// The transport peer it was posted to (so the poll thread can tell
    /// ctrl which peer lost its connection).
    pub peer: PeerIndex,
}

/// How many terminal requests the table remembers for `status` queries.
pub(crate) const TERMINAL_MEMORY: usize = 1 << 16;

/// The shared table.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub reqs: HashMap<String, Req>,
    pub batches: HashMap<u64, Batch>,
    pub inflight: HashMap<u64, InFlight>,
    pub next_batch: u64,
    /// Requests the ctrl thread must look at (set by poll and caller threads).
    pub attention: Vec<String>,
    /// Transport peers whose writes completed with `ConnectionLost` (set by
    /// the poll thread, drained by ctrl, which decides whether to
    /// re-handshake; no duplicates).
    pub lost_peers: Vec<PeerIndex>,
    /// Terminal requests in the order they ended (for forgetting old ones).
    pub terminal_order: VecDeque<String>,
    pub closing: bool,
}

impl Table {
    /// Marks a request terminal and forgets the oldest terminal ones.
    pub fn finish(&mut self, req_id: &str, status: RequestStatus) {
        if let Some(r) = self.reqs.get_mut(req_id) {
            r.signal.set_terminal(status.clone());
            r.p.finish(status);
            self.terminal_order.push_back(req_id.to_owned());
        }
        while self.terminal_order.len() > TERMINAL_MEMORY {
            if let Some(old) = self.terminal_order.pop_front() {
                if matches!(
                    self.reqs.get(&old).map(|r| &r.p.state),
                    Some(ReqState::Done(_))
                ) {
                    self.reqs.remove(&old);
                }
            }
        }
    }
}
