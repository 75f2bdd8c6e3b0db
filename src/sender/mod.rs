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

mod ctrl;
pub mod metrics;
mod peer;
mod poll;
mod table;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use smallvec::SmallVec;
use tracing::debug;

use crate::protocol::ErrorCode;
use crate::slots::{AllocError, SlotAllocator};
use crate::staging::StagingBuffer;
use crate::stats::{Counter, SharedStats, Stage, StatsSnapshot};
use crate::transport::{RemoteBuffer, TransportConfig};

use self::table::{Batch, BatchData, Req, ReqState, Table};

/// Sender configuration.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// This sender's id (DEALER identities are `"{sender_id}-to-{receiver}~{nonce}"`,
    /// the nonce random per process so an identity cannot be squatted).
    pub sender_id: String,
    /// The proxy's PULL endpoint for ProxyNotif (none: no notifications).
    pub proxy: Option<String>,
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
    /// only to receivers with a static descriptor in `static_peers`; any
    /// other receiver's `Hello` is waited for up to `reply_timeout`.
    pub hello_timeout: Duration,
    /// How long an AllocRequest may stay unanswered before its request
    /// fails (must exceed the receiver's admission timeout).
    pub reply_timeout: Duration,
    /// How long `store` may block waiting for staging slots.
    pub staging_timeout: Duration,
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
            staging_slots: 64,
            chunk_bytes: 256 * 1024,
            max_pending_bytes: 64 << 20,
            transport: "shm".into(),
            transport_config: TransportConfig::default(),
            hello_timeout: Duration::from_secs(1),
            reply_timeout: Duration::from_secs(120),
            staging_timeout: Duration::from_secs(60),
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
    /// Token count of the batch's last chunk (default: its byte length).
    pub last_chunk_toks: Option<i64>,
}

impl TransferSpec {
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

/// Errors of [`Sender::store`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The request is not admitted yet and the pending area is full.
    #[error(
        "back-pressure: {needed} bytes do not fit in the pending area ({used} of {max} bytes used)"
    )]
    Backpressure {
        /// Bytes this batch needs.
        needed: usize,
        /// Bytes in use.
        used: usize,
        /// The bound.
        max: usize,
    },
    /// The arguments are inconsistent.
    #[error("invalid store: {0}")]
    Invalid(String),
    /// A chunk is larger than a staging slot.
    #[error("chunk {index} is {len} bytes, larger than the {max}-byte staging slots")]
    ChunkTooLarge {
        /// Position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// The slot size.
        max: u64,
    },
    /// The request already ended.
    #[error("request already ended: {0:?}")]
    RequestEnded(RequestStatus),
    /// The request was cancelled while this call waited.
    #[error("request cancelled")]
    Cancelled,
    /// No staging slot freed up within `staging_timeout`.
    #[error("no staging slots within the staging timeout")]
    StagingTimeout,
    /// The sender is closing.
    #[error("sender is closed")]
    Closed,
}

/// Errors starting a sender.
#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    /// Invalid configuration.
    #[error("invalid sender configuration: {0}")]
    Config(String),
    /// The data plane could not start.
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// A socket could not be created.
    #[error("sender socket: {0}")]
    Socket(#[from] zmq::Error),
    /// A thread or poller could not be started.
    #[error("cannot start sender threads: {0}")]
    Thread(#[from] std::io::Error),
    /// The staging buffer could not be created.
    #[error("staging buffer: {0}")]
    Staging(String),
}

/// Callback run (on the ctrl thread) when a request reaches a terminal
/// status.
pub type CompletionCallback = Arc<dyn Fn(&str, &RequestStatus) + Send + Sync>;

/// Everything the sender's threads share.
pub(crate) struct Shared {
    pub cfg: SenderConfig,
    pub table: Mutex<Table>,
    /// Signalled when a request reaches a terminal status.
    pub status_cv: Condvar,
    pub staging: Arc<StagingBuffer>,
    pub slots: SlotAllocator,
    pub pending_bytes: AtomicUsize,
    pub stats: SharedStats,
    pub waker: Arc<mio::Waker>,
    /// The ctrl thread is (about to be) asleep: producers must wake it.
    pub ctrl_parked: AtomicBool,
    pub stop: AtomicBool,
    pub callback: Mutex<Option<CompletionCallback>>,
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
}

/// A running sender.
pub struct Sender {
    shared: Arc<Shared>,
    submit: Mutex<kvferry_ring::mpsc::Producer<u64>>,
    ctrl: Option<JoinHandle<()>>,
    poll: Option<JoinHandle<()>>,
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
    /// Creates the staging buffer, starts the data plane and the ctrl and
    /// poll threads. The data plane is [`crate::transport::by_name`]`(cfg.transport)`.
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
        if cfg.chunk_bytes == 0 {
            return Err(SenderError::Config("chunk_bytes must be positive".into()));
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
            StagingBuffer::new(cfg.staging_slots, cfg.chunk_bytes)
                .map_err(|e| SenderError::Staging(e.to_string()))?,
        );
        let (poster, completions) = transport.start(Arc::clone(&staging))?;
        let reactor = crate::zmq_io::Reactor::new()?;
        let (submit, submissions) = kvferry_ring::mpsc::channel::<u64>(SUBMIT_RING);
        let shared = Arc::new(Shared {
            slots: SlotAllocator::new(cfg.staging_slots),
            staging,
            table: Mutex::new(Table::default()),
            status_cv: Condvar::new(),
            pending_bytes: AtomicUsize::new(0),
            stats: SharedStats::new(),
            waker: reactor.waker(),
            ctrl_parked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            callback: Mutex::new(None),
            cfg,
        });
        let mut pins = crate::threads::PinPlan::new(shared.cfg.pin_cpus.clone());
        let ctrl = {
            let ctrl = ctrl::Ctrl::new(Arc::clone(&shared), poster, reactor, submissions)?;
            let name = format!("kvf-send-ctrl-{}", shared.cfg.sender_id);
            crate::threads::spawn_named(&name, pins.next(), move || ctrl.run())?
        };
        let poll = {
            let shared = Arc::clone(&shared);
            let name = format!("kvf-send-poll-{}", shared.cfg.sender_id);
            crate::threads::spawn_named(&name, pins.next(), move || poll::run(shared, completions))?
        };
        Ok(Self {
            shared,
            submit: Mutex::new(submit),
            ctrl: Some(ctrl),
            poll: Some(poll),
        })
    }

    /// Sets the callback run when a request reaches a terminal status.
    pub fn set_callback(&self, f: impl Fn(&str, &RequestStatus) + Send + Sync + 'static) {
        *self.shared.callback.lock() = Some(Arc::new(f));
    }

    /// Removes the callback (it may hold references that keep this sender
    /// alive, e.g. to a structure that owns the sender).
    pub fn clear_callback(&self) {
        *self.shared.callback.lock() = None;
    }

    /// Hands one batch of a request over and returns without waiting for
    /// the network. `keys[i]` names `chunks[i]`; the last chunk may be short.
    ///
    /// If the receiver already admitted the request, the batch takes staging
    /// slots (all-or-nothing; this may block up to `staging_timeout`, and it
    /// always ends because admitted requests always drain). Otherwise the
    /// bytes are copied into the bounded pending area, or
    /// [`StoreError::Backpressure`] is returned at once.
    pub fn store(
        &self,
        spec: &TransferSpec,
        keys: &[impl AsRef<str>],
        chunks: &[&[u8]],
    ) -> Result<(), StoreError> {
        let n = chunks.len();
        self.validate(spec, keys.len(), chunks)?;
        let span =
            tracing::debug_span!("store", req_id = %spec.req_id, chunks = n, last = spec.is_last);
        let _g = span.enter();
        let now = Instant::now();
        // Register the request (first batch) and learn whether it is admitted.
        let (admitted, cancel) = {
            let mut t = self.shared.table.lock();
            if t.closing {
                return Err(StoreError::Closed);
            }
            let req = t
                .reqs
                .entry(spec.req_id.clone())
                .or_insert_with(|| Req::new(spec));
            if req.receiver != spec.receiver {
                return Err(StoreError::Invalid(format!(
                    "request {} goes to {}, not {}",
                    spec.req_id, req.receiver, spec.receiver
                )));
            }
            if req.total != spec.total_chunks {
                return Err(StoreError::Invalid(format!(
                    "request {} declared total_chunks = {}, this batch says {}",
                    spec.req_id, req.total, spec.total_chunks
                )));
            }
            match &req.state {
                ReqState::Done(s) => return Err(StoreError::RequestEnded(s.clone())),
                ReqState::Aborting(_) => return Err(StoreError::Cancelled),
                _ => {}
            }
            if req.last_stored {
                return Err(StoreError::Invalid(format!(
                    "request {} already stored its last batch",
                    spec.req_id
                )));
            }
            if req.stored_chunks + n > req.total {
                return Err(StoreError::Invalid(format!(
                    "request {} would store {} chunks, more than its total_chunks = {}",
                    spec.req_id,
                    req.stored_chunks + n,
                    req.total
                )));
            }
            // Reserve the chunk count now so concurrent stores cannot overshoot.
            req.stored_chunks += n;
            if spec.is_last {
                req.last_stored = true;
            }
            (matches!(req.state, ReqState::Admitted), req.cancel.clone())
        };
        let undo = |this: &Self| {
            let mut t = this.shared.table.lock();
            if let Some(r) = t.reqs.get_mut(&spec.req_id) {
                r.stored_chunks -= n;
                if spec.is_last {
                    r.last_stored = false;
                }
            }
        };
        let lens: SmallVec<[u32; 16]> = chunks.iter().map(|c| c.len() as u32).collect();
        let bytes: usize = chunks.iter().map(|c| c.len()).sum();
        let data = if n == 0 {
            BatchData::Empty
        } else if admitted {
            let t0 = Instant::now();
            let deadline = t0 + self.shared.cfg.staging_timeout;
            let set = match self.shared.slots.alloc(n, Some(deadline), &cancel) {
                Ok(set) => set,
                Err(e) => {
                    undo(self);
                    return Err(match e {
                        AllocError::Cancelled => StoreError::Cancelled,
                        AllocError::Timeout => StoreError::StagingTimeout,
                        AllocError::TooLarge { requested, slots } => StoreError::Invalid(format!(
                            "a batch of {requested} chunks can never fit in {slots} staging slots"
                        )),
                    });
                }
            };
            self.shared.stats.record_since(Stage::StagingWait, t0);
            let copied = set
                .iter()
                .zip(chunks)
                .try_for_each(|(slot, chunk)| self.shared.staging.write_slot(slot, chunk));
            if let Err(e) = copied {
                self.drop_batch_data(BatchData::Staged(set), 0);
                undo(self);
                return Err(StoreError::Invalid(e.to_string()));
            }
            BatchData::Staged(set)
        } else {
            let max = self.shared.cfg.max_pending_bytes;
            let reserved = self.shared.pending_bytes.fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |used| (used + bytes <= max).then_some(used + bytes),
            );
            // AcqRel/Acquire: the counter only bounds memory; it publishes no
            // other data, so any ordering that keeps the RMW atomic suffices.
            if let Err(used) = reserved {
                undo(self);
                self.shared.stats.inc(Counter::Backpressure);
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
        let batch = Batch {
            req_id: spec.req_id.clone(),
            keys: keys.iter().map(|k| k.as_ref().to_owned()).collect(),
            lens,
            data,
            is_last: spec.is_last,
            stored_at: now,
            fmt: spec.fmt,
            shape: if spec.shape.is_empty() {
                vec![self.shared.cfg.chunk_bytes as i64]
            } else {
                spec.shape.clone()
            },
            dtype: spec.dtype.clone(),
            last_chunk_toks: spec
                .last_chunk_toks
                .unwrap_or_else(|| chunks.last().map_or(0, |c| c.len() as i64)),
            bytes,
            remote: Vec::new(),
            writes: SmallVec::new(),
        };
        // Publish the batch, then its id on the ring (ring order = send order).
        let id = {
            let mut t = self.shared.table.lock();
            let aborted = !matches!(
                t.reqs.get(&spec.req_id).map(|r| &r.state),
                Some(ReqState::Pending | ReqState::Admitted)
            );
            if aborted {
                drop(t);
                self.drop_batch_data(batch.data, bytes);
                return Err(StoreError::Cancelled);
            }
            let id = t.next_batch;
            t.next_batch += 1;
            t.batches.insert(id, batch);
            id
        };
        if !self.submit_id(id) {
            // The ctrl thread is gone (it only stops on close, or if it
            // panicked): nobody will ever send this batch.
            let batch = self.shared.table.lock().batches.remove(&id);
            if let Some(b) = batch {
                self.drop_batch_data(b.data, bytes);
            }
            return Err(StoreError::Closed);
        }
        self.shared.stats.inc(Counter::Batches);
        debug!(batch = id, admitted, "stored");
        Ok(())
    }

    fn validate(
        &self,
        spec: &TransferSpec,
        n_keys: usize,
        chunks: &[&[u8]],
    ) -> Result<(), StoreError> {
        if spec.req_id.is_empty() {
            return Err(StoreError::Invalid("req_id must not be empty".into()));
        }
        if spec.total_chunks == 0 {
            return Err(StoreError::Invalid("total_chunks must be positive".into()));
        }
        if n_keys != chunks.len() {
            return Err(StoreError::Invalid(format!(
                "{n_keys} keys for {} chunks",
                chunks.len()
            )));
        }
        if chunks.len() > spec.total_chunks {
            // Checked here too (not only against the running count below)
            // so a refused first batch does not leave the request registered.
            return Err(StoreError::Invalid(format!(
                "request {} would store {} chunks, more than its total_chunks = {}",
                spec.req_id,
                chunks.len(),
                spec.total_chunks
            )));
        }
        if chunks.is_empty() && !spec.is_last {
            return Err(StoreError::Invalid("only a last batch may be empty".into()));
        }
        if chunks.len() > self.shared.cfg.staging_slots {
            return Err(StoreError::Invalid(format!(
                "a batch of {} chunks can never fit in {} staging slots",
                chunks.len(),
                self.shared.cfg.staging_slots
            )));
        }
        for (index, c) in chunks.iter().enumerate() {
            if c.len() as u64 > self.shared.cfg.chunk_bytes {
                return Err(StoreError::ChunkTooLarge {
                    index,
                    len: c.len(),
                    max: self.shared.cfg.chunk_bytes,
                });
            }
        }
        Ok(())
    }

    /// Queues a batch id for the ctrl thread. False if the ctrl thread is
    /// gone (its end of the ring dropped), so the caller never waits for a
    /// consumer that cannot come back.
    fn submit_id(&self, id: u64) -> bool {
        let mut backoff = crate::backoff::Backoff::new();
        loop {
            {
                let mut ring = self.submit.lock();
                if ring.push(id).is_ok() {
                    break;
                }
                if ring.is_closed() {
                    return false;
                }
            }
            // The ring is sized far above what staging and the pending area
            // admit, so this only happens under a burst of empty batches:
            // let ctrl drain it.
            self.shared.wake_ctrl();
            if backoff.snooze() == crate::backoff::Step::ShouldPark {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.shared.wake_ctrl();
        true
    }

    fn drop_batch_data(&self, data: BatchData, bytes: usize) {
        match data {
            BatchData::Staged(set) => {
                // Batches waiting for staging are queued in the allocator:
                // this free grants them and wakes ctrl.
                self.shared.slots.free(set);
            }
            BatchData::Pending(_) => {
                // AcqRel: see the reservation in `store`.
                self.shared.pending_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
            BatchData::Empty => {}
        }
    }

    /// Cancels a request from any thread: wakes its staging waiters, drops
    /// unsent batches, waits (on the ctrl thread) for its in-flight writes,
    /// then tells the receiver to release everything (fenced abort).
    /// Returns false if the request is unknown or already ended.
    pub fn cancel_request(&self, req_id: &str) -> bool {
        let ok = {
            let mut t = self.shared.table.lock();
            let ok = match t.reqs.get_mut(req_id) {
                Some(r) if matches!(r.state, ReqState::Pending | ReqState::Admitted) => {
                    r.state = ReqState::Aborting(RequestStatus::Cancelled);
                    r.cancel.cancel();
                    true
                }
                _ => false,
            };
            if ok {
                t.attention.push(req_id.to_owned());
            }
            ok
        };
        if ok {
            self.shared.wake_ctrl();
        }
        ok
    }

    /// The current status of a request (`None` if unknown or forgotten).
    pub fn status(&self, req_id: &str) -> Option<RequestStatus> {
        self.shared.table.lock().reqs.get(req_id).map(Req::status)
    }

    /// Waits until the request is terminal or `deadline` passes; returns its
    /// status then (`InProgress` on timeout, `None` if unknown).
    ///
    /// `Completed` means every write completed and ProxyNotif/TransferDone
    /// were sent; the receiver may not have processed the TransferDone yet
    /// (a decoder waits with `Receiver::wait_ready`, not on this).
    pub fn wait(&self, req_id: &str, deadline: Instant) -> Option<RequestStatus> {
        let mut t = self.shared.table.lock();
        loop {
            let s = t.reqs.get(req_id).map(Req::status)?;
            if s.is_terminal()
                || self
                    .shared
                    .status_cv
                    .wait_until(&mut t, deadline)
                    .timed_out()
            {
                return t.reqs.get(req_id).map(Req::status);
            }
        }
    }

    /// Requests not yet terminal.
    pub fn active_requests(&self) -> usize {
        self.shared
            .table
            .lock()
            .reqs
            .values()
            .filter(|r| !matches!(r.state, ReqState::Done(_)))
            .count()
    }

    /// Staging slots in use.
    pub fn staging_in_use(&self) -> usize {
        self.shared.slots.in_use()
    }

    /// Bytes held in the pending area.
    pub fn pending_bytes(&self) -> usize {
        // Acquire: a monitoring read; see the reservation in `store`.
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
            .filter(|r| !matches!(r.state, ReqState::Done(_)))
            .map(Req::describe)
            .collect()
    }

    /// Lets in-flight requests finish until `deadline`, cancels what is
    /// left, and stops the threads. Returns how many requests had to be
    /// cancelled.
    pub fn close(mut self, deadline: Instant) -> usize {
        self.close_inner(deadline)
    }

    fn close_inner(&mut self, deadline: Instant) -> usize {
        if self.ctrl.is_none() {
            return 0;
        }
        self.shared.table.lock().closing = true;
        let mut cancelled = 0;
        let quiet = |t: &Table| {
            t.reqs
                .values()
                .all(|r| matches!(r.state, ReqState::Done(_)))
        };
        {
            let mut t = self.shared.table.lock();
            while !quiet(&t)
                && !self
                    .shared
                    .status_cv
                    .wait_until(&mut t, deadline)
                    .timed_out()
            {}
        }
        let active: Vec<String> = {
            let t = self.shared.table.lock();
            t.reqs
                .iter()
                .filter(|(_, r)| !matches!(r.state, ReqState::Done(_)))
                .map(|(k, _)| k.clone())
                .collect()
        };
        for r in active {
            if self.cancel_request(&r) {
                cancelled += 1;
            }
        }
        // Give the fenced aborts a bounded moment to drain.
        {
            let grace = Instant::now() + Duration::from_secs(5);
            let mut t = self.shared.table.lock();
            while !quiet(&t) && !self.shared.status_cv.wait_until(&mut t, grace).timed_out() {}
        }
        // Release: pairs with the Acquire load in the ctrl loop.
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
        if let Some(t) = self.ctrl.take() {
            let _ = t.join();
        }
        if let Some(t) = self.poll.take() {
            let _ = t.join();
        }
        cancelled
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.close_inner(Instant::now() + Duration::from_secs(5));
    }
}
