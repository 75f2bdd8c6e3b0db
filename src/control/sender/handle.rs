//! The public [`Sender`] handle: starting the sender, the calls naming a
//! request, staging, stats, and closing it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::slots::SlotAllocator;
use crate::staging::StagingBuffer;
use crate::stats::{SharedStats, StatsSnapshot};

use super::completion::Announcer;
use super::table::{Req, ReqState, Table};
use super::{
    ctrl, names, poll, request, share, submit, Request, RequestSpec, RequestStatus, SenderConfig,
    SenderError, ShareError, Shared, StagingShare, StoreError, TransferSpec, MAX_SHARES,
    SUBMIT_RING,
};

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
    pub(super) shared: Arc<Shared>,
    /// Where registered memory must also be announced (rdma's MRs), from
    /// [`Poster::local_registry`](crate::transport::Poster::local_registry).
    pub(super) registry: Option<Arc<dyn crate::transport::LocalRegistry>>,
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
            local_control: AtomicUsize::new(0),
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
    /// [`StoreError::BadGeometry`] (a negative `fmt`, a `shape` and
    /// `dtype` that make no chunk size, or a chunk larger than a staging
    /// slot),
    /// [`StoreError::DuplicateRequest`], [`StoreError::RequestEnded`] (the
    /// id was used by a request that ended), [`StoreError::Closed`].
    pub fn begin(&self, spec: RequestSpec) -> Result<Request, StoreError> {
        self.shared.begin(&spec, false, None)
    }

    /// [`begin`](Self::begin) with the request's first batch declared:
    /// chunk `i` of it is named `keys[i]` and will be `lens[i]` bytes
    /// (every one whole but the last, as [`StagedBatch::submit`](super::StagedBatch::submit) checks),
    /// the last `last_chunk_toks` tokens if given (else the tokens its
    /// length holds). The admission AllocRequest carries these keys, so
    /// the receiver allocates the batch's slots as it admits the request
    /// and the batch needs no AllocRequest of its own: one control round
    /// trip per request fewer. Once admitted, stage its slots as usual
    /// ([`Request::stage`]) and hand its bytes over with
    /// [`StagedBatch::submit_declared`](super::StagedBatch::submit_declared); later batches go as usual.
    ///
    /// Errors: those of `begin`, and, nothing registered,
    /// [`StoreError::EmptyDeclaredBatch`], [`StoreError::KeyCountMismatch`],
    /// [`StoreError::BatchTooLarge`] (more chunks than staging slots),
    /// [`StoreError::TooManyChunks`] (more than `total_chunks`) and the
    /// length errors of `submit`.
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
    /// let sender = Sender::new(SenderConfig {
    ///     chunk_bytes: 1024,
    ///     staging_slots: 4,
    ///     ..Default::default()
    /// })?;
    /// // One AllocRequest admits the request and allocates both chunks.
    /// let spec = RequestSpec::new("req-8", decoder, 2);
    /// let req = sender.begin_declared(spec, &["req-8/0", "req-8/1"], &[1024, 100], None)?;
    /// let mut batch = req.stage(2, deadline)?;
    /// for slot in batch.slots_mut() {
    ///     slot.fill(7);
    /// }
    /// batch.submit_declared()?;
    /// assert_eq!(req.wait(deadline), RequestStatus::Completed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn begin_declared(
        &self,
        spec: RequestSpec,
        keys: &[impl AsRef<str>],
        lens: &[u32],
        last_chunk_toks: Option<i64>,
    ) -> Result<Request, StoreError> {
        let first = super::Declared {
            keys: super::KeyList::from_keys(keys),
            lens: lens.iter().copied().collect(),
            toks: last_chunk_toks,
        };
        self.shared.begin(&spec, false, Some(first))
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
        let req = self.shared.begin(&spec.request(), true, None)?;
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
        let slot_bytes = self.shared.cfg.chunk_bytes;
        if !r.format.is(spec.fmt, &spec.shape, &spec.dtype, slot_bytes) {
            let given = request::Format::of(spec.fmt, &spec.shape, &spec.dtype, slot_bytes);
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
        let slot_bytes = self.shared.cfg.chunk_bytes;
        let g = request::Geometry::of(spec.fmt, &spec.shape, &spec.dtype, slot_bytes)
            .map_err(StoreError::BadGeometry)?;
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

    /// Handshakes this sender completed on a receiver's same-host control
    /// socket: receivers it reached over the shm data plane that offered
    /// an `ipc://` endpoint (`HelloAck::control`), whose control messages
    /// it then sent there instead of to the endpoint it was given.
    pub fn local_control_handshakes(&self) -> usize {
        // Relaxed: a statistic, read on its own.
        self.shared.local_control.load(Ordering::Relaxed)
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
