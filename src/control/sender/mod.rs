//! The sender (prefill side): caller threads hand over KV chunks with
//! [`Sender::store`]; the `ctrl` thread runs the protocol with the receivers
//! and posts writes; the `poll` thread turns transport completions into
//! staging frees, chunk counts and, once a request is complete, a ProxyNotif.
//!
//! ```text
//!  caller threads ── store() ──► pending area (not admitted yet)
//!        │                      or staging slots (admitted; all-or-nothing)
//!        └──► MPSC submission ring ──► ctrl ── AllocRequest ──► receiver
//!                                       │  ◄── AllocResponse ──┘
//!                                       └── WriteOps ──► transport (copy engine / NIC)
//!  poll ◄── completions ───────────────────────────────────────┘
//!    └─ free staging, count chunks, wake ctrl ──► ProxyNotif + TransferDone
//! ```
//!
//! Deadlock freedom on the sender side (DESIGN.md invariant 2): staging
//! slots are only taken for batches of requests the receiver has already
//! admitted. A batch of a request still waiting for admission is held as the
//! caller's bytes in a bounded pending area (full → [`StoreError::Backpressure`]
//! at once), so a request parked at a receiver can never hold the staging an
//! admitted request needs to finish. See `docs/architecture.md`.

mod batch;
mod completion;
mod config;
#[doc(hidden)]
pub mod core;
mod count;
mod ctrl;
mod declared;
mod error;
mod handle;
mod keys;
mod lens;
mod life;
pub mod metrics;
mod names;
mod peer;
mod poll;
mod regions;
mod registered;
mod reply;
mod request;
mod share;
mod slab;
mod stop;
mod submit;
mod table;
mod wire;

#[cfg(test)]
mod handle_tests;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use smallvec::SmallVec;
use tracing::debug;

use crate::slots::SlotAllocator;
use crate::staging::StagingBuffer;
use crate::stats::SharedStats;

use self::completion::Announcer;
pub use self::completion::CompletionCallback;
pub use self::config::{RequestStatus, SenderConfig, TransferSpec};
use self::declared::Declared;
pub use self::error::{SenderError, StoreError};
pub use self::handle::Sender;
use self::keys::KeyList;
pub use self::registered::{MemoryRegion, RegisterError, WriteError, WriteHandle};
pub(crate) use self::request::full_chunk;
use self::request::Handle;
pub use self::request::{Request, RequestSpec, ShapeError, StagedBatch};
pub use self::share::{ShareError, StagingShare, MAX_SHARES};
use self::table::{BatchData, Req, Table};

/// Everything the sender's threads share.
pub(crate) struct Shared {
    pub cfg: SenderConfig,
    pub table: Mutex<Table>,
    /// Request id → its `Common` state, for the calls naming a request by
    /// id (its own lock; locked before the table, never after).
    pub names: names::Names,
    pub staging: Arc<StagingBuffer>,
    pub slots: SlotAllocator,
    /// Staging shares not held (`Sender::take_share`).
    pub shares: share::ShareList,
    pub pending_bytes: AtomicUsize,
    pub stats: SharedStats,
    pub waker: Arc<mio::Waker>,
    /// The ctrl thread is (about to be) asleep: producers must wake it.
    pub ctrl_parked: AtomicBool,
    pub stop: AtomicBool,
    /// Set when the ctrl thread ended (also by a panic): nobody drains the
    /// submission ring any more.
    pub ctrl_gone: AtomicBool,
    /// The submission ring's producer each new request handle's
    /// [`Outbox`](submit::Outbox) is cloned from (locked at `begin` only).
    pub submit: Mutex<kvferry_ring::mpsc::Producer<u64>>,
    /// Caller threads → ctrl: the batches themselves, in send order, and
    /// the keys of requests a caller stopped (taken by ctrl only).
    pub inbox: submit::Inbox,
    /// A caller stopped a request and found the submission ring full: ctrl
    /// looks at every live request's life word once (never lost, never a
    /// wait for the caller).
    pub attention_overflow: AtomicBool,
    /// Runs completion callbacks off the ctrl thread.
    pub announcer: Arc<Announcer>,
    /// Handshakes completed on a receiver's same-host control socket
    /// ([`Sender::local_control_handshakes`]).
    pub local_control: AtomicUsize,
}

/// Capacity of the caller → ctrl submission ring.
const SUBMIT_RING: usize = 4096;

impl Shared {
    /// Wakes the ctrl thread if it may be asleep.
    pub fn wake_ctrl(&self) {
        // SeqCst: a Dekker handshake with the ctrl thread, which stores
        // `ctrl_parked = true` (SeqCst) and then re-checks its inputs. Either
        // it sees our published work, or we see its flag and wake it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.ctrl_parked.load(Ordering::SeqCst) {
            let _ = self.waker.wake();
        }
    }

    /// Registers a request and queues its admission message (an
    /// AllocRequest with the request's `total_chunks` and no keys, or the
    /// keys of its `first` batch if declared). With `reuse`, an existing
    /// live request of that id is returned instead.
    fn begin(
        self: &Arc<Self>,
        spec: &RequestSpec,
        reuse: bool,
        first: Option<Declared>,
    ) -> Result<Request, StoreError> {
        if spec.req_id.is_empty() {
            return Err(StoreError::EmptyReqId);
        }
        if spec.total_chunks == 0 {
            return Err(StoreError::ZeroTotalChunks);
        }
        let slot_bytes = self.cfg.chunk_bytes;
        let geometry = request::Geometry::of(spec.fmt, &spec.shape, &spec.dtype, slot_bytes)
            .map_err(StoreError::BadGeometry)?;
        let (declared, toks) = match &first {
            Some(d) => self.check_declared(spec, geometry, d)?,
            None => (0, 0),
        };
        // This handle's own end of the submission ring (cloned outside the
        // table lock; only `begin` takes the prototype's lock).
        let outbox = submit::Outbox::new(self.submit.lock().clone());
        let handle = |c: &Arc<request::Common>, outbox| Handle {
            shared: Arc::clone(self),
            c: Arc::clone(c),
            outbox,
        };
        let h = {
            // Checked and named under one hold of the name index, so two
            // `begin`s of one id cannot both register it.
            let mut names = self.names.lock();
            if let Some(c) = names.get(spec.req_id.as_str()) {
                return match c.signal.terminal() {
                    Some(s) => Err(StoreError::RequestEnded(s.clone())),
                    None if reuse => Ok(Request {
                        h: Arc::new(handle(c, outbox)),
                    }),
                    None => Err(StoreError::DuplicateRequest {
                        req_id: spec.req_id.clone(),
                    }),
                };
            }
            let mut common = None;
            // The table lock, inside the name index's (the one place both
            // are held): only to insert.
            self.table.lock().insert(|key| {
                let c = Arc::new(request::Common::new(
                    key, spec, geometry, slot_bytes, declared,
                ));
                common = Some(Arc::clone(&c));
                Req::new(c)
            });
            // `None` cannot happen: `insert` calls its closure.
            let Some(c) = common else {
                return Err(StoreError::Closed);
            };
            names.insert(Arc::clone(&c.req_id), Arc::clone(&c));
            handle(&c, outbox)
        };
        let batch = match first {
            // Reserved in the fresh request's count: `check_declared` made
            // sure it fits, so this cannot be refused.
            Some(d) => {
                let last = h.stored.reserve(declared, h.total, None).unwrap_or(false);
                Self::batch_for(h.key, d.keys, d.lens, BatchData::Declared, last, toks)
            }
            None => Self::batch_for(
                h.key,
                KeyList::default(),
                SmallVec::new(),
                BatchData::Empty,
                false,
                0,
            ),
        };
        if let Err((_, e)) = self.submit_batch(&h, Box::new(batch)) {
            // The admission message holds no data to give back; ctrl never
            // heard of the request.
            self.names.forget([(Arc::clone(&h.req_id), h.key)]);
            self.table.lock().remove(h.key);
            return Err(e);
        }
        debug!(req_id = %spec.req_id, total = spec.total_chunks, declared, "begun");
        Ok(Request { h: Arc::new(h) })
    }
}
