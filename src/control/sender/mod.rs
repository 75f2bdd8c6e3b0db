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

mod completion;
#[doc(hidden)]
pub mod core;
mod count;
mod ctrl;
mod error;
mod keys;
mod life;
pub mod metrics;
mod names;
mod peer;
mod poll;
mod registered;
mod reply;
mod request;
mod share;
mod slab;
mod submit;
mod table;
mod wire;

#[cfg(test)]
mod handle_tests;

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smallvec::SmallVec;
use tracing::debug;

use crate::protocol::ErrorCode;
use crate::slots::{AllocError, SlotAllocator, SlotSet};
use crate::staging::StagingBuffer;
use crate::stats::{Counter, SharedStats, Stage, StatsSnapshot};
use crate::transport::{RemoteBuffer, TransportConfig};

pub use self::completion::CompletionCallback;
use self::completion::{Announcer, Signal};
pub use self::error::{SenderError, StoreError};
use self::keys::KeyList;
pub use self::registered::{MemoryRegion, RegisterError, WriteError, WriteHandle};
use self::request::Handle;
pub use self::request::{Request, RequestSpec, StagedBatch};
pub use self::share::{ShareError, StagingShare, MAX_SHARES};
use self::table::{Batch, BatchData, Req, ReqKey, ReqState, Table};

/// Sender configuration.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// This sender's id (DEALER identities are `"{sender_id}-to-{receiver}~{nonce}"`,
    /// the nonce random per process so an identity cannot be squatted).
    pub sender_id: String,
    /// The proxy's PULL endpoint for ProxyNotif (none: no notifications).
    pub proxy: Option<String>,
    /// Also push a `ProxyFailed` (kvferry extension) to the proxy when a
    /// request to a kvferry receiver (one that answered `Hello`) fails or is
    /// cancelled, so the router stops waiting for it (default `true`). Turn off for a proxy whose decoder stops at an
    /// unknown message type (docs/protocol.md, "ProxyFailed").
    pub proxy_failures: bool,
    /// Staging slots (each `chunk_bytes`); must hold the largest batch.
    pub staging_slots: usize,
    /// Bytes per staging slot: the largest chunk `store` accepts.
    pub chunk_bytes: u64,
    /// Bound of the pending area holding batches of not-yet-admitted
    /// requests (default 64 MiB).
    pub max_pending_bytes: usize,
    /// Data plane: `"shm"` (default), `"tcp"` or `"rdma"`.
    pub transport: String,
    /// Data-plane options (ring sizes, fault injection).
    pub transport_config: TransportConfig,
    /// How long to wait for a receiver's `HelloAck` before treating it as
    /// an LMCache receiver (one request at a time, no extensions). Applies
    /// only to receivers with a static descriptor in `static_peers` (a
    /// `HelloAck` that comes later still upgrades them to kvferry mode);
    /// any other receiver's `Hello` is waited for `hello_answer_timeout`.
    pub hello_timeout: Duration,
    /// How long a receiver *without* a static descriptor may take to answer
    /// `Hello` (a loaded kvferry receiver still registering memory answers
    /// late, and is connected by its late `HelloAck`) before the requests
    /// waiting for it fail `peer_unavailable`, saying that a static buffer
    /// is needed if it is an LMCache receiver; a request after
    /// `rehello_backoff` tries a new `Hello` (default 5 s).
    pub hello_answer_timeout: Duration,
    /// How long an AllocRequest may stay unanswered before its request
    /// fails (must exceed the receiver's admission timeout).
    pub reply_timeout: Duration,
    /// How long `store` may block waiting for staging slots.
    pub staging_timeout: Duration,
    /// Per-worker staging shares (0, the default: none). With `n > 0` the
    /// first slots of staging form `n` equal shares, each its own memfd and
    /// slot pool, handed out by [`Sender::take_share`] and staged from with
    /// [`Request::try_stage_in`] only (`docs/attach.md`); the other calls
    /// stage from the remaining slots. At most [`MAX_SHARES`].
    pub staging_shares: usize,
    /// Interval of `Heartbeat`s renewing this sender's leases.
    pub heartbeat_interval: Duration,
    /// Least time between two `Hello`s to the same receiver when the sender
    /// re-handshakes after losing a `Hello`-negotiated data plane (rdma):
    /// a receiver that keeps refusing, or whose connection keeps breaking,
    /// gets at most one `Hello` per this period (default 1 s).
    pub rehello_backoff: Duration,
    /// Receive buffers of receivers that do not answer `Hello` (LMCache
    /// style), by endpoint.
    pub static_peers: Vec<(String, RemoteBuffer)>,
    /// Send `Hello` and use kvferry's extensions with receivers that answer.
    pub use_extensions: bool,
    /// CPUs for the ctrl and poll threads (round-robin; empty: unpinned).
    pub pin_cpus: Vec<usize>,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            sender_id: format!("sender-{}", std::process::id()),
            proxy: None,
            proxy_failures: true,
            staging_slots: 64,
            chunk_bytes: 256 * 1024,
            max_pending_bytes: 64 << 20,
            transport: "shm".into(),
            transport_config: TransportConfig::default(),
            hello_timeout: Duration::from_secs(1),
            hello_answer_timeout: Duration::from_secs(5),
            reply_timeout: Duration::from_secs(120),
            staging_timeout: Duration::from_secs(60),
            staging_shares: 0,
            heartbeat_interval: Duration::from_secs(5),
            rehello_backoff: Duration::from_secs(1),
            static_peers: Vec::new(),
            use_extensions: true,
            pin_cpus: Vec::new(),
        }
    }
}

/// What one `store` call transfers (like LMCache's `transfer_spec`).
#[derive(Debug, Clone, PartialEq)]
pub struct TransferSpec {
    /// The request.
    pub req_id: String,
    /// The receiver's ZMQ endpoint.
    pub receiver: String,
    /// Chunks in the whole request (same on every batch).
    pub total_chunks: usize,
    /// This batch ends the request.
    pub is_last: bool,
    /// KV memory format code, passed through.
    pub fmt: i64,
    /// Shape of one full chunk (empty: `[chunk_bytes]` of `uint8`).
    pub shape: Vec<i64>,
    /// Element type with `shape` (default `"uint8"`).
    pub dtype: String,
    /// Token count of the batch's last chunk (default: the tokens it
    /// holds, as `StagedBatch::set_last_chunk_toks` says).
    pub last_chunk_toks: Option<i64>,
}

impl TransferSpec {
    /// The per-request part of the spec.
    pub fn request(&self) -> RequestSpec {
        RequestSpec {
            req_id: self.req_id.clone(),
            receiver: self.receiver.clone(),
            total_chunks: self.total_chunks,
            fmt: self.fmt,
            shape: self.shape.clone(),
            dtype: self.dtype.clone(),
        }
    }

    /// A spec with byte-shaped chunks.
    pub fn new(
        req_id: impl Into<String>,
        receiver: impl Into<String>,
        total_chunks: usize,
        is_last: bool,
    ) -> Self {
        Self {
            req_id: req_id.into(),
            receiver: receiver.into(),
            total_chunks,
            is_last,
            fmt: 0,
            shape: Vec::new(),
            dtype: "uint8".into(),
            last_chunk_toks: None,
        }
    }
}

/// Terminal (or current) status of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestStatus {
    /// Still moving.
    InProgress,
    /// Every chunk written and the proxy notified.
    Completed,
    /// Cancelled by the caller; the receiver released everything.
    Cancelled,
    /// Failed; the receiver released everything.
    Failed {
        /// Machine-readable reason (the receiver's code, or the sender's).
        code: ErrorCode,
        /// Human-readable reason.
        reason: String,
    },
}

impl RequestStatus {
    /// True for every status but `InProgress`.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, RequestStatus::InProgress)
    }
}

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
}

/// The reservation of a batch's chunks in its request's count.
struct Reserved {
    admitted: bool,
    is_last: bool,
}

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
    /// AllocRequest with no keys and the request's `total_chunks`). With
    /// `reuse`, an existing live request of that id is returned instead.
    fn begin(self: &Arc<Self>, spec: &RequestSpec, reuse: bool) -> Result<Request, StoreError> {
        if spec.req_id.is_empty() {
            return Err(StoreError::EmptyReqId);
        }
        if spec.total_chunks == 0 {
            return Err(StoreError::ZeroTotalChunks);
        }
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
                let c = Arc::new(request::Common::new(key, spec, self.cfg.chunk_bytes));
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
        let batch = Self::batch_for(
            h.key,
            KeyList::default(),
            SmallVec::new(),
            BatchData::Empty,
            false,
            0,
        );
        if let Err((_, e)) = self.submit_batch(&h, Box::new(batch)) {
            // The admission message holds no data to give back; ctrl never
            // heard of the request.
            self.names.forget([(Arc::clone(&h.req_id), h.key)]);
            self.table.lock().remove(h.key);
            return Err(e);
        }
        debug!(req_id = %spec.req_id, total = spec.total_chunks, "begun");
        Ok(Request { h: Arc::new(h) })
    }

    /// A batch of request `req` (its geometry is the request's).
    fn batch_for(
        req: ReqKey,
        keys: KeyList,
        lens: SmallVec<[u32; 16]>,
        data: BatchData,
        is_last: bool,
        last_chunk_toks: i64,
    ) -> Batch {
        let bytes = lens.iter().map(|&l| l as usize).sum();
        Batch {
            req,
            keys,
            lens,
            data,
            is_last,
            stored_at: Instant::now(),
            last_chunk_toks,
            bytes,
            remote: Vec::new(),
            writes: SmallVec::new(),
        }
    }

    /// The checks of a copied batch of a request of geometry `g`, its last
    /// chunk `toks` tokens if given.
    fn validate_batch(
        &self,
        g: request::Geometry,
        n_keys: usize,
        chunks: &[&[u8]],
        toks: Option<i64>,
    ) -> Result<(), StoreError> {
        if n_keys != chunks.len() {
            return Err(StoreError::KeyCountMismatch {
                keys: n_keys,
                chunks: chunks.len(),
            });
        }
        if chunks.len() > self.cfg.staging_slots {
            return Err(StoreError::BatchTooLarge {
                chunks: chunks.len(),
                slots: self.cfg.staging_slots,
            });
        }
        self.check_lens(g, chunks.iter().map(|c| c.len() as u64), toks)
    }

    /// The lengths of a batch's chunks, in order, for a request of geometry
    /// `g`, its last chunk `toks` tokens if given: none longer than a
    /// staging slot or than a whole chunk, every one but the last whole
    /// (the receiver takes those as whole), and for a one-dimensional shape
    /// the last exactly `toks` tokens, or a whole number of them (the
    /// receiver sizes it so). The one check of every path a batch takes
    /// (staged, copied, registered).
    fn check_lens(
        &self,
        g: request::Geometry,
        lens: impl ExactSizeIterator<Item = u64>,
        toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let full = g.full;
        let max = full.map_or(self.cfg.chunk_bytes, |f| f.min(self.cfg.chunk_bytes));
        let last = lens.len().saturating_sub(1);
        for (index, len) in lens.enumerate() {
            if len > max {
                return Err(StoreError::ChunkTooLarge {
                    index,
                    len: len as usize,
                    max,
                });
            }
            match full {
                Some(full) if index < last && len != full => {
                    return Err(StoreError::ShortChunk {
                        index,
                        len: len as usize,
                        full,
                    })
                }
                _ if index == last => Self::check_tokens(g, len, toks)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// A batch's last chunk of `len` bytes and `toks` tokens (default: as
    /// many as `len` holds) against a one-dimensional geometry `g`.
    fn check_tokens(g: request::Geometry, len: u64, toks: Option<i64>) -> Result<(), StoreError> {
        let Some(unit) = g.token_bytes.map(NonZeroU64::get) else {
            return Ok(());
        };
        let fits = match toks {
            Some(t) => u64::try_from(t).is_ok_and(|t| t.checked_mul(unit) == Some(len)),
            None => len % unit == 0,
        };
        if fits {
            Ok(())
        } else {
            Err(StoreError::LastChunkTokens {
                len: len as usize,
                tokens: toks,
                token_bytes: unit,
            })
        }
    }

    /// Reserves `n` chunks of the request's count (so concurrent batches
    /// cannot overshoot). `is_last`: the caller's claim (copying `store`),
    /// or `None` to end the request when the count reaches its total.
    /// Without the table lock: the count is the handle's atomic word
    /// ([`count::StoredCount`]), liveness its cancel token and terminal
    /// status (an abort fires the token; a request completes only once its
    /// last batch is reserved, after which no reservation succeeds).
    fn reserve(&self, h: &Handle, n: usize, is_last: Option<bool>) -> Result<Reserved, StoreError> {
        if let Some(s) = h.signal.terminal() {
            return Err(StoreError::RequestEnded(s.clone()));
        }
        if h.cancel.is_cancelled() {
            return Err(Self::stopped(&h.signal));
        }
        let req_id = || h.req_id.to_string();
        let is_last = h.stored.reserve(n, h.total, is_last).map_err(|r| match r {
            core::Refusal::AfterLast => StoreError::AfterLastBatch { req_id: req_id() },
            core::Refusal::TooMany { chunks } => StoreError::TooManyChunks {
                req_id: req_id(),
                chunks,
                total: h.total,
            },
            core::Refusal::EmptyNotLast => StoreError::EmptyBatchNotLast,
        })?;
        Ok(Reserved {
            admitted: h.signal.is_admitted(),
            is_last,
        })
    }

    /// Publishes a reserved batch: hands it to ctrl through the handle's
    /// end of the submission ring (ring order = send order), no table lock.
    /// On error the batch's data is released and the reservation given
    /// back.
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: SmallVec<[u32; 16]>,
        data: BatchData,
        reserved: &Reserved,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let n = lens.len();
        // The default: the whole tokens the last chunk holds (its bytes for
        // the byte shape; `check_lens` refused a partial token).
        let unit = h.geometry.token_bytes.map_or(1, NonZeroU64::get);
        let toks = last_chunk_toks
            .unwrap_or_else(|| lens.last().map_or(0, |&l| (u64::from(l) / unit) as i64));
        // A request that stopped since the reservation (cancelled, failed,
        // closed) takes no more batches. Read without the table lock: every
        // abort fires the request's cancel token (`Req::aborted`) under it,
        // and the end sets the terminal status. (A stop after this check
        // is seen by ctrl, which drops the batch when it takes it.)
        if h.signal.terminal().is_some() || h.cancel.is_cancelled() {
            let bytes = lens.iter().map(|&l| l as usize).sum();
            self.release_data(data, bytes);
            self.give_back(h, n, reserved.is_last);
            return Err(Self::stopped(&h.signal));
        }
        let keys = KeyList::from_keys(keys);
        let batch = Self::batch_for(h.key, keys, lens, data, reserved.is_last, toks);
        if let Err((b, e)) = self.submit_batch(h, Box::new(batch)) {
            self.release_data(b.data, b.bytes);
            self.give_back(h, n, reserved.is_last);
            return Err(e);
        }
        self.stats.inc(Counter::Batches);
        debug!(admitted = reserved.admitted, chunks = n, "submitted");
        Ok(())
    }

    /// Submits a staged batch (the slots hold the chunks' bytes).
    fn submit_staged(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: &[u32],
        set: SlotSet,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let span = tracing::debug_span!("submit", req_id = %h.req_id, chunks = keys.len());
        let _g = span.enter();
        let reserved = match self.reserve(h, keys.len(), None) {
            Ok(r) => r,
            Err(e) => {
                self.slots.free(set);
                return Err(e);
            }
        };
        let data = if set.is_empty() {
            self.slots.free(set);
            BatchData::Empty
        } else {
            BatchData::Staged(set)
        };
        self.publish(
            h,
            keys,
            lens.iter().copied().collect(),
            data,
            &reserved,
            last_chunk_toks,
        )
    }

    /// Submits a batch from registered memory (`src[i]` = region id and
    /// offset of chunk `i`). With no chunks it is an empty last batch.
    fn submit_registered(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: SmallVec<[u32; 16]>,
        src: SmallVec<[(u32, u64); 16]>,
        lease: self::registered::WriteLease,
    ) -> Result<(), StoreError> {
        let span = tracing::debug_span!("write", req_id = %h.req_id, chunks = keys.len());
        let _g = span.enter();
        // On error the lease drops here: the write is done, nothing sent.
        let reserved = self.reserve(h, keys.len(), None)?;
        let data = if src.is_empty() {
            BatchData::Empty
        } else {
            BatchData::Registered {
                src,
                lease: Arc::new(lease),
            }
        };
        self.publish(h, keys, lens, data, &reserved, None)
    }

    /// The copying path: into staging slots if the request is admitted,
    /// else into the pending area.
    fn store_copy(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        chunks: &[&[u8]],
        is_last: Option<bool>,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let n = chunks.len();
        let span = tracing::debug_span!("store", req_id = %h.req_id, chunks = n);
        let _g = span.enter();
        let reserved = self.reserve(h, n, is_last)?;
        let lens: SmallVec<[u32; 16]> = chunks.iter().map(|c| c.len() as u32).collect();
        let bytes: usize = chunks.iter().map(|c| c.len()).sum();
        let data = if n == 0 {
            BatchData::Empty
        } else if reserved.admitted {
            let t0 = Instant::now();
            let deadline = t0 + self.cfg.staging_timeout;
            let set = match self.slots.alloc(n, Some(deadline), &h.cancel) {
                Ok(set) => set,
                Err(e) => {
                    self.give_back(h, n, reserved.is_last);
                    return Err(match e {
                        AllocError::Cancelled => Self::stopped(&h.signal),
                        AllocError::Timeout => StoreError::StagingTimeout,
                        AllocError::TooLarge { requested, slots } => StoreError::BatchTooLarge {
                            chunks: requested,
                            slots,
                        },
                    });
                }
            };
            self.stats.record_since(Stage::StagingWait, t0);
            self.copy_into(&set, chunks.iter().copied());
            BatchData::Staged(set)
        } else {
            let max = self.cfg.max_pending_bytes;
            // AcqRel/Acquire: the counter only bounds memory; it publishes no
            // other data, so any ordering that keeps the RMW atomic suffices.
            let reserved_bytes =
                self.pending_bytes
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                        (used + bytes <= max).then_some(used + bytes)
                    });
            if let Err(used) = reserved_bytes {
                self.give_back(h, n, reserved.is_last);
                self.stats.inc(Counter::Backpressure);
                return Err(StoreError::Backpressure {
                    needed: bytes,
                    used,
                    max,
                });
            }
            let mut buf = Vec::with_capacity(bytes);
            for c in chunks {
                buf.extend_from_slice(c);
            }
            BatchData::Pending(buf)
        };
        self.publish(h, keys, lens, data, &reserved, last_chunk_toks)
    }

    /// Copies `chunks` (each at most `chunk_bytes`, checked by the caller)
    /// into the slots of `set`, in order.
    pub(crate) fn copy_into<'a>(&self, set: &SlotSet, chunks: impl Iterator<Item = &'a [u8]>) {
        for (slot, chunk) in set.iter().zip(chunks) {
            let Some(p) = self.staging.slot_ptr(slot) else {
                continue; // cannot happen: a set's slots exist
            };
            let len = chunk.len().min(self.cfg.chunk_bytes as usize);
            // SAFETY: the caller holds `set` (allocated, not freed, not yet
            // published), so it alone owns these slots and no write from them
            // is in flight; `len <= slot_bytes` keeps the copy inside the slot;
            // `chunk` is caller memory, never inside the staging mapping
            // (which no Rust reference outside an owned batch points into).
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), p, len) };
        }
    }

    /// Hands a batch to the ctrl thread through the handle's end of the
    /// submission ring (ring order = send order). If the ring is full the
    /// caller waits for ctrl to drain it (spin, yield, then 100 µs naps), at
    /// most `staging_timeout` ([`StoreError::StagingTimeout`]);
    /// [`StoreError::Closed`] at once if the sender stopped or its ctrl
    /// thread is gone, so nobody waits for a consumer that cannot come
    /// back. On error the batch comes back to the caller.
    fn submit_batch(&self, h: &Handle, b: Box<Batch>) -> Result<(), (Box<Batch>, StoreError)> {
        let mut b = b;
        let mut backoff = crate::backoff::Backoff::new();
        let mut deadline = None;
        loop {
            // Acquire (both): pair with the Release stores in `Sender::close`
            // and in ctrl's drop; the flags publish nothing else.
            if self.stop.load(Ordering::Acquire) || self.ctrl_gone.load(Ordering::Acquire) {
                return Err((b, StoreError::Closed));
            }
            match h.outbox.push(b) {
                Ok(()) => break,
                Err(back) => b = back,
            }
            // The ring is sized far above what staging and the pending area
            // admit, so this only happens under a burst of begins or empty
            // batches: let ctrl drain it.
            let end = *deadline.get_or_insert_with(|| Instant::now() + self.cfg.staging_timeout);
            if Instant::now() >= end {
                return Err((b, StoreError::StagingTimeout));
            }
            self.wake_ctrl();
            if backoff.snooze() == crate::backoff::Step::ShouldPark {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.wake_ctrl();
        Ok(())
    }

    /// Gives a batch's staging slots or pending bytes back.
    pub(crate) fn release_data(&self, data: BatchData, bytes: usize) {
        match data {
            // Batches waiting for staging are queued in the allocator: this
            // free grants them and wakes their owner.
            BatchData::Staged(set) => self.slots.free(set),
            BatchData::Pending(_) => {
                // AcqRel: see the reservation in `store_copy`.
                self.pending_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
            // Dropping the lease lets the regions go once no op holds it.
            BatchData::Registered { .. } | BatchData::Empty => {}
        }
    }

    /// Why a request stopped taking batches, as the caller sees it:
    /// [`StoreError::Cancelled`] only for a cancel; a failure (or any ended
    /// request) is [`StoreError::RequestEnded`] with the status it ends with.
    /// The one mapping for every wait that a request's cancel token ends.
    /// Without the table lock: the request's terminal status, else its life
    /// word. Whoever fires the token set the word before (a caller's CAS,
    /// or ctrl's, whose status is published by that CAS's Release), and the
    /// token's SeqCst flag, which this caller saw fired, orders it after.
    pub(crate) fn stopped(signal: &Signal) -> StoreError {
        if let Some(s) = signal.terminal() {
            return StoreError::RequestEnded(s.clone());
        }
        match signal.life.state() {
            life::State::Stopped(life::Stop::Cancel) => StoreError::Cancelled,
            life::State::Stopped(stop) => StoreError::RequestEnded(stop.status()),
            life::State::Aborted(Some(s)) => StoreError::RequestEnded(s.clone()),
            // Live with a fired token, or completed: cannot happen (only
            // stops fire the token, a completed request is terminal first).
            life::State::Aborted(None) | life::State::Live | life::State::Completed => {
                StoreError::Cancelled
            }
        }
    }

    /// Gives back a reservation of `n` chunks whose batch was never handed
    /// over (`last`: it was the last batch). If another caller reserved the
    /// last batch meanwhile, the given-back chunks can never be stored, so
    /// the request fails instead of completing without them: a caller's
    /// stop ([`life::Stop::Orphan`]), like a cancel, without the table lock.
    fn give_back(&self, h: &Handle, n: usize, last: bool) {
        if h.stored.unreserve(n, last) {
            self.stop(&h.c, life::Stop::Orphan { chunks: n }, Some(&h.outbox));
        }
    }

    /// Cancels request `c`; true iff this call stopped a live request.
    fn cancel(&self, c: &request::Common, outbox: Option<&submit::Outbox>) -> bool {
        self.stop(c, life::Stop::Cancel, outbox)
    }

    /// A caller stops request `c` (see `life.rs`): true iff this call took
    /// it out of its live phase (then it ends with `stop`'s status, whatever
    /// ctrl was about to do). Then wakes the request's waiters and tells
    /// ctrl: the key through the submission ring (`outbox`, or an end of it
    /// cloned for this call), or, if the ring is full, the overflow flag;
    /// then `wake_ctrl`. Why that is enough: the CAS that won is before the
    /// ring push (Release) or the flag store, which ctrl's pop or flag swap
    /// (Acquire) reads before it reads the word; a push or flag ctrl missed
    /// before parking is caught by the Dekker handshake of `wake_ctrl`
    /// (ctrl re-checks the ring and the flag after publishing
    /// `ctrl_parked`). No table lock, no wait.
    fn stop(&self, c: &request::Common, stop: life::Stop, outbox: Option<&submit::Outbox>) -> bool {
        if !c.signal.life.stop(stop) {
            return false;
        }
        c.cancel.cancel();
        c.signal.wake();
        let sent = match outbox {
            Some(o) => o.attend(c.key),
            None => submit::Outbox::new(self.submit.lock().clone()).attend(c.key),
        };
        if !sent {
            // Release: pairs with ctrl's Acquire swap (it then reads the
            // words this CAS wrote); the Dekker fence is wake_ctrl's.
            self.attention_overflow.store(true, Ordering::Release);
        }
        self.wake_ctrl();
        true
    }
}

/// A running sender.
///
/// One per prefill process: it owns the control-plane thread (one ZMQ
/// DEALER per receiver), the data-plane transport and the staging buffer.
/// Each transfer is a [`Request`] from [`Sender::begin`].
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvferry::{Receiver, ReceiverConfig, RequestSpec, RequestStatus, Sender, SenderConfig};
///
/// let deadline = Instant::now() + Duration::from_secs(20);
/// # let receiver = Receiver::start(ReceiverConfig {
/// #     listen: "tcp://127.0.0.1:0".into(),
/// #     capacity_chunks: 8,
/// #     chunk_bytes: 1024,
/// #     ..Default::default()
/// # })?;
/// # let decoder = receiver.endpoint().to_owned();
/// // `decoder` is a receiver's endpoint, e.g. "tcp://10.0.0.7:7400".
/// let sender = Sender::new(SenderConfig {
///     chunk_bytes: 1024,
///     staging_slots: 4,
///     transport: "shm".into(), // the default; "tcp" across hosts
///     ..Default::default()
/// })?;
/// let req = sender.begin(RequestSpec::new("req-7", decoder, 3))?;
///
/// // In place: staging slots handed out once the receiver admitted the request.
/// let mut batch = req.stage(2, deadline)?;
/// for (i, slot) in batch.slots_mut().enumerate() {
///     slot.fill(i as u8); // e.g. the target of a device-to-host copy
/// }
/// batch.submit(&["req-7/0", "req-7/1"], &[1024, 1024])?;
/// // Or copied from bytes the caller keeps (here the short last chunk).
/// req.store(&["req-7/2"], &[&[9u8; 10][..]])?;
///
/// assert_eq!(req.wait(deadline), RequestStatus::Completed);
/// assert_eq!(sender.close(deadline), 0); // nothing left to cancel
/// # receiver.watch("req-7")?.wait(deadline)?;
/// # assert_eq!(receiver.take("req-7")?.get(2).unwrap().bytes(), &[9u8; 10][..]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Sender {
    shared: Arc<Shared>,
    /// Where registered memory must also be announced (rdma's MRs), from
    /// [`Poster::local_registry`](crate::transport::Poster::local_registry).
    registry: Option<Arc<dyn crate::transport::LocalRegistry>>,
    ctrl: Option<JoinHandle<()>>,
    poll: Option<JoinHandle<()>>,
    announcer: Option<JoinHandle<()>>,
    /// How long stopping waits for the ctrl and poll threads: they drop
    /// the transport, which may wait that long for its engine.
    stop_limit: Duration,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("sender_id", &self.shared.cfg.sender_id)
            .finish_non_exhaustive()
    }
}

/// Capacity of the caller → ctrl submission ring.
const SUBMIT_RING: usize = 4096;

impl Sender {
    /// Creates the staging buffer, starts the data plane and the ctrl,
    /// poll and announcer threads. The data plane is
    /// [`crate::transport::by_name`]`(cfg.transport)`.
    pub fn new(cfg: SenderConfig) -> Result<Self, SenderError> {
        Self::check(&cfg)?;
        let transport = crate::transport::by_name(&cfg.transport, &cfg.transport_config)?;
        Self::with_transport(cfg, transport)
    }

    /// The configuration checks done before anything is started.
    fn check(cfg: &SenderConfig) -> Result<(), SenderError> {
        if cfg.staging_slots == 0 || cfg.staging_slots > u32::MAX as usize {
            return Err(SenderError::Config(format!(
                "staging_slots must be in 1..={}",
                u32::MAX
            )));
        }
        if cfg.chunk_bytes == 0 || cfg.chunk_bytes > u64::from(u32::MAX) {
            return Err(SenderError::Config(format!(
                "chunk_bytes must be in 1..={}",
                u32::MAX
            )));
        }
        if cfg.staging_shares > MAX_SHARES {
            return Err(SenderError::Config(format!(
                "staging_shares must be at most {MAX_SHARES}"
            )));
        }
        Ok(())
    }

    /// [`Sender::new`] over a data plane built by the caller (e.g. an
    /// `RdmaTransport` with an explicit `RdmaConfig`, or a test transport).
    /// Its [`kind`](crate::transport::Transport::kind) must be
    /// `cfg.transport`, the name the `Hello` asks receivers for.
    pub fn with_transport(
        cfg: SenderConfig,
        transport: Box<dyn crate::transport::Transport>,
    ) -> Result<Self, SenderError> {
        if transport.kind() != cfg.transport {
            return Err(SenderError::Config(format!(
                "the transport is {}, the configuration says {}",
                transport.kind(),
                cfg.transport
            )));
        }
        Self::check(&cfg)?;
        let staging = Arc::new(
            StagingBuffer::with_shares(cfg.staging_slots, cfg.chunk_bytes, cfg.staging_shares)
                .map_err(|e| SenderError::Staging(e.to_string()))?,
        );
        let slots = SlotAllocator::with_pools(&staging.pool_slots());
        let shares = share::ShareList::new(staging.shares())?;
        for i in 0..staging.shares() {
            if let Some(fd) = shares.ready(i) {
                slots.set_free_signal(i, Arc::clone(fd));
            }
        }
        let (poster, completions) = transport.start(Arc::clone(&staging))?;
        let stop_limit = crate::threads::STOP_JOIN_DEADLINE + poster.drop_deadline();
        let registry = poster.local_registry();
        let reactor = crate::zmq_io::Reactor::new()?;
        let (submit, inbox) = submit::channel(SUBMIT_RING);
        // poll → ctrl: the transport's completion records (poll.rs).
        let (to_ctrl, from_poll) =
            kvferry_ring::spsc::channel(poll::ring_capacity(poster.credits()));
        let shared = Arc::new(Shared {
            slots,
            shares,
            staging,
            table: Mutex::new(Table::default()),
            names: names::Names::default(),
            pending_bytes: AtomicUsize::new(0),
            stats: SharedStats::new(),
            waker: reactor.waker(),
            ctrl_parked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            ctrl_gone: AtomicBool::new(false),
            submit: Mutex::new(submit),
            inbox,
            attention_overflow: AtomicBool::new(false),
            announcer: Arc::new(Announcer::default()),
            cfg,
        });
        let mut pins = crate::threads::PinPlan::new(shared.cfg.pin_cpus.clone());
        let ctrl = {
            let ctrl = ctrl::Ctrl::new(Arc::clone(&shared), poster, reactor, from_poll)?;
            let name = format!("kvf-send-ctrl-{}", shared.cfg.sender_id);
            crate::threads::spawn_named(&name, pins.next(), move || ctrl.run())?
        };
        let poll = {
            let shared = Arc::clone(&shared);
            let name = format!("kvf-send-poll-{}", shared.cfg.sender_id);
            crate::threads::spawn_named(&name, pins.next(), move || {
                poll::run(shared, completions, to_ctrl)
            })?
        };
        let announcer = {
            let a = Arc::clone(&shared.announcer);
            let name = format!("kvf-send-cb-{}", shared.cfg.sender_id);
            crate::threads::spawn_named(&name, None, move || a.run())?
        };
        Ok(Self {
            shared,
            registry,
            ctrl: Some(ctrl),
            poll: Some(poll),
            announcer: Some(announcer),
            stop_limit,
        })
    }

    /// Starts a transfer: registers the request and sends its admission
    /// message at once (an AllocRequest with no keys and `total_chunks`,
    /// which LMCache receivers also admit and answer with `[]`), so its
    /// batches never wait for admission as copies. Errors:
    /// [`StoreError::EmptyReqId`], [`StoreError::ZeroTotalChunks`],
    /// [`StoreError::DuplicateRequest`], [`StoreError::RequestEnded`] (the
    /// id was used by a request that ended), [`StoreError::Closed`].
    pub fn begin(&self, spec: RequestSpec) -> Result<Request, StoreError> {
        self.shared.begin(&spec, false)
    }

    /// Sets the callback run when a request reaches a terminal status. It
    /// runs on the sender's announcer thread (never on ctrl), in the order
    /// requests ended.
    pub fn set_callback(&self, f: impl Fn(&str, &RequestStatus) + Send + Sync + 'static) {
        self.shared.announcer.set_callback(Some(Arc::new(f)));
    }

    /// Removes the callback (it may hold references that keep this sender
    /// alive, e.g. to a structure that owns the sender).
    pub fn clear_callback(&self) {
        self.shared.announcer.set_callback(None);
    }

    /// Hands one batch of a request over by copying it, and returns without
    /// waiting for the network. `keys[i]` names `chunks[i]`; every chunk is
    /// whole but the last, which may be short (as
    /// [`StagedBatch::submit`](crate::sender::StagedBatch::submit) says).
    /// The first batch of a `req_id` begins the request (see
    /// [`Sender::begin`]); later ones must agree with it on `receiver`,
    /// `total_chunks` and the chunk format (`fmt`, `shape`, `dtype`).
    ///
    /// If the receiver already admitted the request, the batch takes staging
    /// slots (all-or-nothing; this may block up to `staging_timeout`, and it
    /// always ends because admitted requests always drain). Otherwise the
    /// bytes are copied into the bounded pending area, or
    /// [`StoreError::Backpressure`] is returned at once. Callers that can
    /// fill staging in place should use [`Request::stage`] instead (one copy
    /// fewer).
    pub fn store(
        &self,
        spec: &TransferSpec,
        keys: &[impl AsRef<str>],
        chunks: &[&[u8]],
    ) -> Result<(), StoreError> {
        self.validate(spec, keys.len(), chunks)?;
        let req = self.shared.begin(&spec.request(), true)?;
        // The request's geometry, from its handle (no table lock).
        let r = &req.h.c;
        if r.receiver != spec.receiver {
            return Err(StoreError::ReceiverMismatch {
                req_id: spec.req_id.clone(),
                begun: r.receiver.clone(),
                given: spec.receiver.clone(),
            });
        }
        if r.total != spec.total_chunks {
            return Err(StoreError::TotalMismatch {
                req_id: spec.req_id.clone(),
                begun: r.total,
                given: spec.total_chunks,
            });
        }
        // So the batch was checked against the request's geometry (its
        // spec's, in `validate`), which its AllocRequest carries.
        let given = request::Format::of(
            spec.fmt,
            &spec.shape,
            &spec.dtype,
            self.shared.cfg.chunk_bytes,
        );
        if r.format != given {
            return Err(StoreError::GeometryMismatch {
                req_id: spec.req_id.clone(),
                begun: r.format.to_string(),
                given: given.to_string(),
            });
        }
        self.shared.store_copy(
            &req.h,
            keys,
            chunks,
            Some(spec.is_last),
            spec.last_chunk_toks,
        )
    }

    fn validate(
        &self,
        spec: &TransferSpec,
        n_keys: usize,
        chunks: &[&[u8]],
    ) -> Result<(), StoreError> {
        if spec.req_id.is_empty() {
            return Err(StoreError::EmptyReqId);
        }
        if spec.total_chunks == 0 {
            return Err(StoreError::ZeroTotalChunks);
        }
        let g = request::Geometry::of(&spec.shape, &spec.dtype, self.shared.cfg.chunk_bytes);
        self.shared
            .validate_batch(g, n_keys, chunks, spec.last_chunk_toks)?;
        if chunks.len() > spec.total_chunks {
            // Checked here too (not only against the running count) so a
            // refused first batch does not leave the request registered.
            return Err(StoreError::TooManyChunks {
                req_id: spec.req_id.clone(),
                chunks: chunks.len(),
                total: spec.total_chunks,
            });
        }
        if chunks.is_empty() && !spec.is_last {
            return Err(StoreError::EmptyBatchNotLast);
        }
        Ok(())
    }

    /// Cancels a request from any thread: wakes its staging waiters, drops
    /// unsent batches, waits (on the ctrl thread) for its in-flight writes,
    /// then tells the receiver to release everything (fenced abort).
    /// Returns false if the request is unknown or already ended.
    pub fn cancel_request(&self, req_id: &str) -> bool {
        let c = self.shared.names.get(req_id);
        c.is_some_and(|c| self.shared.cancel(&c, None))
    }

    /// The current status of a request (`None` if unknown or forgotten).
    pub fn status(&self, req_id: &str) -> Option<RequestStatus> {
        self.shared.names.get(req_id).map(|c| c.signal.status())
    }

    /// Waits until the request is terminal or `deadline` passes; returns its
    /// status then (`InProgress` on timeout, `None` if unknown). Waits on
    /// the request's own `Signal`, like [`Request::wait`].
    ///
    /// `Completed` means every write completed and ProxyNotif/TransferDone
    /// were sent; the receiver may not have processed the TransferDone yet
    /// (a decoder waits with `Receiver::wait_ready`, not on this).
    pub fn wait(&self, req_id: &str, deadline: Instant) -> Option<RequestStatus> {
        let c = self.shared.names.get(req_id)?;
        let s = &c.signal;
        s.wait_until(deadline, || s.terminal().is_some());
        Some(s.status())
    }

    /// Requests not yet terminal.
    pub fn active_requests(&self) -> usize {
        self.shared.names.active().len()
    }

    /// Registers `len` bytes of caller-owned host memory at `ptr` (e.g. a
    /// pinned buffer from `cudaHostAlloc`, the target of the device-to-host
    /// copy) as a source of [`Request::write`]s, which post writes straight
    /// from it: no staging copy. On shm the copy engine's copy into the
    /// receiver is the only one; on tcp the socket reads it directly; on
    /// rdma this registers a memory region over it (`ibv_reg_mr`, local
    /// read only) and the RDMA WRITEs' scatter/gather entries carry its
    /// lkey, so the NIC reads the caller's memory: no copy on the sender.
    ///
    /// Errors: [`RegisterError::Null`], [`RegisterError::Empty`],
    /// [`RegisterError::Unaligned`] (`ptr` must be page-aligned),
    /// [`RegisterError::Overflow`], [`RegisterError::TooMany`] (more than
    /// [`crate::staging::MAX_REGIONS`] at once),
    /// [`RegisterError::Transport`] if the transport cannot register it
    /// (rdma: `ibv_reg_mr` failed, e.g. because pinning the pages exceeds
    /// the locked-memory limit `RLIMIT_MEMLOCK`; the reason names the
    /// limit).
    ///
    /// # Safety
    ///
    /// `unsafe` because kvferry reads the memory from its transport threads
    /// while the caller owns it, so the caller must guarantee, for as long
    /// as the region is registered (until [`deregister`](Self::deregister)
    /// returned `Ok`, or this sender was closed or dropped):
    /// - `ptr..ptr + len` is allocated, readable host memory and stays so
    ///   (not freed, unmapped or remapped);
    /// - nobody writes a byte range named in a [`Request::write`] from that
    ///   call until its [`WriteHandle::is_done`] (ranges not in flight may be
    ///   written freely, e.g. the next layer's device-to-host copy).
    ///
    /// This is the raw-pointer contract of NIXL's and Mooncake's memory
    /// registration, because the memory a server writes from is not a Rust
    /// object (pinned allocations, a KV pool): an owning safe wrapper could
    /// not let the caller refill one part while another is in flight.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use kvferry::receiver::{Receiver, ReceiverConfig};
    /// use kvferry::sender::{RequestSpec, RequestStatus, Sender, SenderConfig};
    ///
    /// let receiver = Receiver::start(ReceiverConfig {
    ///     listen: "tcp://127.0.0.1:0".into(),
    ///     capacity_chunks: 8,
    ///     chunk_bytes: 4096,
    ///     ..Default::default()
    /// })?;
    /// let sender = Sender::new(SenderConfig { chunk_bytes: 4096, staging_slots: 1, ..Default::default() })?;
    /// let deadline = Instant::now() + Duration::from_secs(10);
    ///
    /// // The caller's pinned KV memory (here an anonymous mapping: page-aligned).
    /// let mut kv = memmap2::MmapMut::map_anon(2 * 4096)?;
    /// kv[..4096].fill(7);
    /// kv[4096..].fill(8);
    /// // SAFETY: `kv` outlives the region (deregistered below) and is not
    /// // written while the write from it is in flight.
    /// let region = unsafe { sender.register(kv.as_ptr(), kv.len()) }?;
    ///
    /// let req = sender.begin(RequestSpec::new("req-1", receiver.endpoint(), 2))?;
    /// let done = req.write(&["req-1/0", "req-1/1"], &[(&region, 0, 4096), (&region, 4096, 4096)], deadline)?;
    /// assert!(done.wait(deadline)); // `kv` may be written again
    /// assert_eq!(req.wait(deadline), RequestStatus::Completed);
    /// sender.deregister(&region)?; // `kv` may be freed
    ///
    /// receiver.wait_ready("req-1", deadline)?;
    /// assert_eq!(&receiver.get("req-1/1").expect("written").bytes()[..4096], &[8u8; 4096][..]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        let addr = ptr as usize;
        if ptr.is_null() {
            return Err(RegisterError::Null);
        }
        if len == 0 {
            return Err(RegisterError::Empty);
        }
        let page = self::registered::page_size();
        if addr % page != 0 {
            return Err(RegisterError::Unaligned { addr, page });
        }
        if addr.checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(RegisterError::Overflow { addr, len });
        }
        let id = self
            .shared
            .staging
            .add_region(ptr, len as u64)
            .ok_or(RegisterError::TooMany {
                max: crate::staging::MAX_REGIONS,
            })?;
        if let Some(registry) = &self.registry {
            // SAFETY: the caller's contract above keeps the memory
            // allocated until `deregister` returned `Ok`, which calls the
            // registry's `deregister` first (or until this sender is
            // dropped, which drops the registry).
            if let Err(e) = unsafe { registry.register(id, ptr, len as u64) } {
                self.shared.staging.remove_region(id);
                return Err(RegisterError::Transport {
                    transport: self.shared.cfg.transport.clone(),
                    addr,
                    len,
                    reason: e.to_string(),
                });
            }
        }
        debug!(region = id, len, "registered memory");
        Ok(MemoryRegion {
            entry: Arc::new(self::registered::RegionEntry::new(id, len, &self.shared)),
        })
    }

    /// Deregisters `region`: from `Ok` on, kvferry never reads it again and
    /// the caller may free it (on rdma its memory region is deregistered:
    /// the NIC can no longer access it). [`RegisterError::Busy`] while
    /// writes from it are in flight (wait for their [`WriteHandle`]s, or
    /// use [`deregister_by`](Self::deregister_by)),
    /// [`RegisterError::NotRegistered`] if already deregistered,
    /// [`RegisterError::ForeignRegion`] for another sender's region.
    pub fn deregister(&self, region: &MemoryRegion) -> Result<(), RegisterError> {
        self.deregister_within(region, None)
    }

    /// [`deregister`](Self::deregister), waiting until `deadline` for the
    /// writes in flight from `region` to complete;
    /// [`RegisterError::Busy`] if some still are at the deadline (then
    /// nothing changed).
    pub fn deregister_by(
        &self,
        region: &MemoryRegion,
        deadline: Instant,
    ) -> Result<(), RegisterError> {
        self.deregister_within(region, Some(deadline))
    }

    fn deregister_within(
        &self,
        region: &MemoryRegion,
        deadline: Option<Instant>,
    ) -> Result<(), RegisterError> {
        let e = &region.entry;
        if !e.belongs_to(&self.shared) {
            return Err(RegisterError::ForeignRegion { id: e.id });
        }
        e.retire_by(deadline)?;
        // Retired: no write can take it any more, none is in flight.
        if let Some(registry) = &self.registry {
            registry.deregister(e.id);
        }
        self.shared.staging.remove_region(e.id);
        debug!(region = e.id, "deregistered memory");
        Ok(())
    }

    /// Staging shares the sender has ([`SenderConfig::staging_shares`]).
    pub fn staging_shares(&self) -> usize {
        self.shared.staging.shares()
    }

    /// Takes a free staging share (see [`SenderConfig::staging_shares`]),
    /// zeroed, for one owner until the [`StagingShare`] is dropped. Errors:
    /// [`ShareError::NoShares`], [`ShareError::AllHeld`],
    /// [`ShareError::Draining`] (a free share's slots are still read by
    /// writes its last owner posted), [`ShareError::Renew`] (a fresh memfd
    /// for the share could not be made), [`ShareError::Register`] (the
    /// transport could not register the renewed share, e.g. rdma's
    /// `ibv_reg_mr`).
    pub fn take_share(&self) -> Result<StagingShare, ShareError> {
        StagingShare::take(&self.shared, self.registry.as_deref())
    }

    /// The staging buffer's file (for an attached worker to map) and its
    /// slot count and size: slot `i` at offset `i * slot_bytes`. With
    /// staging shares it names share 0's memfd only (slot count included);
    /// a worker maps its own share ([`take_share`](Self::take_share)).
    /// The path is `/proc/<pid>/fd/<memfd>`: another process of this user
    /// opens it only while this process is dumpable, which an attach daemon
    /// is not (attached workers get their share's descriptor instead).
    pub fn staging_file(&self) -> (std::path::PathBuf, usize, u64) {
        let s = &self.shared.staging;
        let slots = s.share(0).map_or(s.slots(), |l| l.slots);
        (s.file_path(), slots, s.slot_bytes())
    }

    /// Staging slots in use.
    pub fn staging_in_use(&self) -> usize {
        self.shared.slots.in_use()
    }

    /// Bytes held in the pending area.
    pub fn pending_bytes(&self) -> usize {
        // Acquire: a monitoring read; see the reservation in `store_copy`.
        self.shared.pending_bytes.load(Ordering::Acquire)
    }

    /// Counters and per-stage latency histograms.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// The shared stats recorder (to merge into a run report).
    pub fn shared_stats(&self) -> SharedStats {
        self.shared.stats.clone()
    }

    /// Per-request state dump (for watchdogs and debugging).
    pub fn dump(&self) -> Vec<String> {
        self.shared
            .table
            .lock()
            .reqs
            .values()
            .filter(|r| !matches!(r.p.state, ReqState::Done(_)))
            .map(Req::describe)
            .collect()
    }

    /// Lets in-flight requests finish until `deadline`, cancels what is
    /// left, and stops the threads. Returns how many requests had to be
    /// cancelled.
    pub fn close(mut self, deadline: Instant) -> usize {
        self.close_inner(deadline)
    }

    /// Waits until no request is active (also those begun meanwhile) or
    /// `deadline` passes, on each request's `Signal`.
    fn wait_quiet(&self, deadline: Instant) {
        loop {
            let active = self.shared.names.active();
            if active.is_empty() || Instant::now() >= deadline {
                return;
            }
            for c in active {
                let s = &c.signal;
                s.wait_until(deadline, || s.terminal().is_some());
            }
        }
    }

    fn close_inner(&mut self, deadline: Instant) -> usize {
        if self.ctrl.is_none() {
            return 0;
        }
        let mut cancelled = 0;
        self.wait_quiet(deadline);
        let outbox = submit::Outbox::new(self.shared.submit.lock().clone());
        for c in self.shared.names.active() {
            if self.shared.cancel(&c, Some(&outbox)) {
                cancelled += 1;
            }
        }
        // Give the fenced aborts a bounded moment to drain.
        self.wait_quiet(Instant::now() + Duration::from_secs(5));
        // Release: pairs with the Acquire load in the ctrl loop.
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
        use crate::threads::{join_or_wait, join_within, STOP_JOIN_DEADLINE};
        // ctrl owns the transport, whose engine may still read registered
        // memory: never detached (see join_or_wait).
        if let Some(t) = self.ctrl.take() {
            let _ = join_or_wait(t, self.stop_limit, "sender ctrl");
        }
        if let Some(t) = self.poll.take() {
            let _ = join_within(t, self.stop_limit, "sender poll");
        }
        self.shared.announcer.stop();
        if let Some(t) = self.announcer.take() {
            // A callback that drops the last owner of this sender runs on
            // the announcer thread itself: join_within then leaves it.
            let _ = join_within(t, STOP_JOIN_DEADLINE, "sender announcer");
        }
        cancelled
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.close_inner(Instant::now() + Duration::from_secs(5));
    }
}
