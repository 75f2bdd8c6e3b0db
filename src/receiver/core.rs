//! The receiver's decision core: every rule of the receiver side of the
//! protocol as a single-threaded state machine with no I/O.
//!
//! The control thread feeds it decoded messages (with the sender's routing
//! identity and the current time) and sends the [`Output`]s it produces;
//! decoder threads call into it (under the receiver's lock) to borrow and
//! release chunks. Because it does no I/O and takes time as an argument, tests
//! drive it directly, message by message, and so does the model checker.
//!
//! Rules (PROTOCOL.md "Receiver semantics" and DESIGN.md invariants):
//! - The first batch of a `req_id` reserves `total_chunks` in the [`Ledger`];
//!   when it does not fit the request is *parked* (FIFO) and answered later.
//!   Later batches draw from the reservation, so they never wait and their
//!   slot allocation cannot fail.
//! - `total_chunks == 0` with a `req_id`, `total_chunks > capacity`, a chunk
//!   larger than a slot, cumulative chunks above `total_chunks` (dedup
//!   included), a changed `total_chunks` and a batch after the last one are
//!   errors; any error of an admitted request rolls back every chunk it holds
//!   and releases its reservation.
//! - Dedup only against written keys: a key is reported in
//!   `already_sent_indexes` (and pinned, ref count up) only when a copy of it
//!   is `ready` — its writer's `TransferDone` arrived (kvferry peers), or at
//!   allocation (LMCache peers and anonymous allocations, LMCache's own
//!   semantics). A key held but still being written gets a fresh slot: the
//!   new request writes its own, independent copy (its reservation already
//!   counts the chunk).
//! - A slot is never freed while a reference holds it: a failed writer's copy
//!   is detached (nobody new pins or reads it) and its slot freed with the
//!   last reference (and, if the writer's writes may still land, after the
//!   fence below).
//! - A request's tracking ends when its last batch is allocated (LMCache
//!   peers) or when its `TransferDone` arrives (kvferry peers, which said
//!   `Hello`), on failure, on cancel, or when its lease expires.
//! - Fenced reuse (invariant 7): slots a failed request was granted, whose
//!   writes may still be in flight, are quarantined — still counted as
//!   allocated — until the sender's `CancelNotif` (which a kvferry sender sends
//!   only after its in-flight writes completed) or `quarantine_grace` passes.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::ledger::{AdmissionQueue, Ledger, Reservation};
use crate::protocol::{
    AllocRequest, AllocResponse, CancelNotif, Descriptor, ErrorCode, Hello, HelloAck, Message,
    ReplyHints, PROTOCOL_VERSION,
};
use crate::slots::SlotAllocator;

use super::acceptor::HelloAcceptor;
use super::consume_later::ConsumeLater;
use super::keys::{Borrowed, KeyTable, Unref};

/// Routing identity of a sender (the ZMQ identity frame).
pub type PeerId = Vec<u8>;

/// Static configuration of the core.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Identity announced in `HelloAck`.
    pub receiver_id: String,
    /// Slots in the receive buffer (= ledger capacity).
    pub capacity_chunks: usize,
    /// Bytes per slot.
    pub chunk_bytes: u64,
    /// How long a parked request may wait for admission.
    pub admission_timeout: Duration,
    /// An admitted request with no batch, heartbeat or `TransferDone` for
    /// this long is rolled back.
    pub lease: Duration,
    /// How long slots of a failed request stay quarantined when no fence
    /// (`CancelNotif` from a kvferry sender) arrives.
    pub quarantine_grace: Duration,
    /// Transport name announced in `HelloAck` (the default offer).
    pub transport: String,
    /// Transport descriptor announced in `HelloAck` (e.g. the shm path).
    pub descriptor: Descriptor,
    /// Further data planes offered (e.g. `("tcp", Descriptor::Tcp {..})`).
    /// `HelloAck` answers with the offer named by `Hello.transport`; when
    /// none matches, with the default offer above, whose differing name
    /// tells the sender its transport is not available here.
    pub other_transports: Vec<(String, Descriptor)>,
    /// Answer `Hello` (default). `false` makes the receiver behave like an
    /// LMCache receiver, which knows no extensions: `Hello` goes unanswered.
    pub answer_hello: bool,
    /// Release each request's chunks as soon as its `TransferDone` arrives,
    /// like a decoder that only counts (load tests and benchmarks).
    /// Allocations that never get a `TransferDone` (an LMCache peer's
    /// requests, anonymous batches) are released `consume_grace` after
    /// their last reply instead.
    pub auto_consume: bool,
    /// With `auto_consume`: how long after its last batch was answered an
    /// allocation without `TransferDone` counts as delivered (its writes
    /// cannot be observed). Must exceed the time the sender takes to write
    /// a batch; a shorter grace lets a slot be reused under a late write.
    pub consume_grace: Duration,
}

/// Something the control thread must do after a step of the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send `message` to `peer`.
    Send {
        /// Destination.
        peer: PeerId,
        /// The reply.
        message: Message,
    },
    /// A request reached a terminal state (for `wait_ready` and stats).
    Finished {
        /// The request.
        req_id: String,
        /// How it ended.
        outcome: Outcome,
    },
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every chunk is in place (`TransferDone`, or the last batch of an
    /// LMCache peer).
    Ready,
    /// Rolled back with this reason.
    Failed(ErrorCode),
}

/// Counters and gauges of the core.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Requests waiting for admission.
    pub parked_requests: usize,
    /// Requests being tracked (parked, admitted, awaiting `TransferDone`).
    pub tracked_requests: usize,
    /// Key copies held in the buffer, readable or being written (a key two
    /// requests first-wrote concurrently counts twice; a failed writer's
    /// detached copy, kept by other holders or quarantine, counts in
    /// `slots_in_use` only).
    pub keys: usize,
    /// Slots held in quarantine.
    pub quarantined_slots: usize,
    /// Slots in use (allocator view).
    pub slots_in_use: usize,
    /// Most requests admitted (not parked, not finished) at once so far.
    pub peak_admitted: usize,
    /// Requests by outcome (`admitted`, `parked`, `completed`, `cancelled`,
    /// `failed`, `lease_expired`, `admission_timeout`, `rejected`).
    pub requests_total: BTreeMap<&'static str, u64>,
    /// Error replies by code.
    pub errors_total: BTreeMap<&'static str, u64>,
}

/// One key a request holds a reference on.
#[derive(Debug, Clone)]
struct Held {
    key: String,
    gen: u64,
    /// This request allocated the slot (it is the writer), as opposed to a
    /// dedup pin.
    wrote: bool,
    /// The batch was answered, so the sender may be writing the slot.
    granted: bool,
}

#[derive(Debug)]
enum Phase {
    /// Waiting for admission; batches received meanwhile, in order.
    Parked {
        backlog: VecDeque<AllocRequest>,
        since: Instant,
    },
    /// Admitted, more batches to come.
    Admitted { reservation: Reservation },
    /// Last batch allocated; waiting for the sender's `TransferDone`.
    AwaitingDone,
}

#[derive(Debug)]
struct Request {
    peer: PeerId,
    /// The peer said `Hello` (kvferry semantics: TransferDone, fenced cancel).
    extended: bool,
    total: usize,
    seen: usize,
    held: Vec<Held>,
    lease_deadline: Instant,
    phase: Phase,
}

/// A request that failed or was cancelled: later messages for it get its
/// error, and its quarantined slots wait for the fence.
#[derive(Debug)]
struct Tombstone {
    code: ErrorCode,
    /// Copies `(key, gen)` whose slot is kept until the fence.
    quarantined: Vec<(String, u64)>,
    until: Instant,
}

/// Why a request is being rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The sender cancelled; a kvferry sender's writes are already fenced.
    SenderCancel,
    /// The receiver refused a batch or the lease expired: writes of earlier
    /// batches may still land.
    Unfenced,
}

/// The receiver's state machine. See the module docs.
#[derive(Debug)]
pub struct ReceiverCore {
    cfg: CoreConfig,
    ledger: Ledger,
    queue: AdmissionQueue<String>,
    slots: SlotAllocator,
    keys: KeyTable,
    requests: HashMap<String, Request>,
    tombstones: HashMap<String, Tombstone>,
    /// Peers that said Hello, with their sender id.
    peers: HashMap<PeerId, String>,
    next_lease_scan: Instant,
    stats: CoreStats,
    /// Admission waits (reserve → grant) not yet collected by the shell.
    admission_waits: Vec<Duration>,
    /// The per-sender data plane offered besides `cfg`'s (RDMA), if any.
    acceptor: Option<Box<dyn HelloAcceptor>>,
    /// Senders the acceptor set up, with the descriptor of their `Hello`.
    accepted: HashMap<PeerId, Descriptor>,
    /// `auto_consume` of allocations without `TransferDone`: the
    /// references `(key, gen)` each holds, released after `consume_grace`.
    consume_later: ConsumeLater<Vec<(String, u64)>>,
}

impl ReceiverCore {
    /// A core with an empty buffer of `cfg.capacity_chunks` slots.
    pub fn new(cfg: CoreConfig, now: Instant) -> Self {
        let ledger = Ledger::new(cfg.capacity_chunks);
        let slots = SlotAllocator::new(cfg.capacity_chunks);
        let next_lease_scan = now + lease_scan_period(cfg.lease);
        Self {
            cfg,
            ledger,
            queue: AdmissionQueue::new(),
            slots,
            keys: KeyTable::default(),
            requests: HashMap::new(),
            tombstones: HashMap::new(),
            peers: HashMap::new(),
            next_lease_scan,
            stats: CoreStats::default(),
            admission_waits: Vec::new(),
            acceptor: None,
            accepted: HashMap::new(),
            consume_later: ConsumeLater::default(),
        }
    }

    /// Also offers the per-sender data plane of `acceptor` (RDMA): a `Hello`
    /// asking for `acceptor.kind()` is answered with the descriptor of
    /// [`HelloAcceptor::accept`], or, if that fails, with a
    /// `peer_unavailable` failure reply carrying the reason. What was set up
    /// for a sender is forgotten when a lease of its requests expires or it
    /// says `Hello` again.
    pub fn with_acceptor(mut self, acceptor: Box<dyn HelloAcceptor>) -> Self {
        self.acceptor = Some(acceptor);
        self
    }

    /// Senders the acceptor has set up and not forgotten.
    pub fn accepted_senders(&self) -> usize {
        self.accepted.len()
    }

    /// The core's configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The slot allocator of the receive buffer (a cheap cloneable handle;
    /// the TCP data thread asks it which slots are in use).
    pub fn slot_allocator(&self) -> &crate::slots::SlotAllocator {
        &self.slots
    }

    /// The reservation ledger (for lock-free stats readers).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Handles one decoded message from `peer`.
    pub fn handle(&mut self, peer: &[u8], msg: Message, now: Instant, out: &mut Vec<Output>) {
        match msg {
            Message::AllocRequest(req) => self.on_alloc(peer, req, now, out),
            Message::CancelNotif(c) => self.on_cancel(peer, c, now, out),
            Message::TransferDone(d) => self.on_transfer_done(&d.req_id, now, out),
            Message::Heartbeat(h) => self.on_heartbeat(&h.sender_id, now),
            Message::Hello(_) if !self.cfg.answer_hello => {
                debug!("Hello ignored (LMCache emulation)");
            }
            Message::Hello(h) => match self.on_hello(peer, &h) {
                Ok(ack) => out.push(Output::Send {
                    peer: peer.to_vec(),
                    message: Message::HelloAck(ack),
                }),
                Err(reason) => {
                    self.fail_reply(peer, 1, None, ErrorCode::PeerUnavailable, reason, out)
                }
            },
            other => {
                // AllocResponse / ProxyNotif / HelloAck are never sent to a
                // receiver: answer so a confused peer is not left waiting.
                debug!(kind = other.type_name(), "unexpected message at receiver");
                self.fail_reply(
                    peer,
                    1,
                    None,
                    ErrorCode::BadMessage,
                    "message type not accepted by a receiver".into(),
                    out,
                );
            }
        }
        self.grant_parked(now, out);
    }

    /// Replies to a frame that could not be decoded, echoing the `seq` and
    /// key count recovered from it where possible (`hints`), so a pipelining
    /// sender can match the failure to its request.
    pub fn bad_frame(
        &mut self,
        peer: &[u8],
        reason: String,
        hints: ReplyHints,
        out: &mut Vec<Output>,
    ) {
        self.fail_reply(
            peer,
            hints.n_keys.unwrap_or(1),
            hints.seq,
            ErrorCode::BadMessage,
            reason,
            out,
        );
    }

    /// Time-driven work: parked requests past their admission deadline,
    /// expired leases, quarantines and tombstones. Call when
    /// [`ReceiverCore::next_deadline`] has passed (calling earlier is harmless).
    pub fn tick(&mut self, now: Instant, out: &mut Vec<Output>) {
        for req_id in self.queue.expire(now) {
            if let Some(r) = self.requests.remove(&req_id) {
                warn!(req_id = %req_id, "admission timeout");
                self.bump_request("admission_timeout");
                self.finish_failed(
                    &req_id,
                    r,
                    ErrorCode::AdmissionTimeout,
                    Cause::Unfenced,
                    now,
                    out,
                );
            }
        }
        if now >= self.next_lease_scan {
            self.next_lease_scan = now + lease_scan_period(self.cfg.lease);
            let expired: Vec<String> = self
                .requests
                .iter()
                .filter(|(_, r)| {
                    !matches!(r.phase, Phase::Parked { .. }) && r.lease_deadline <= now
                })
                .map(|(k, _)| k.clone())
                .collect();
            for req_id in expired {
                if let Some(r) = self.requests.remove(&req_id) {
                    warn!(req_id = %req_id, "lease expired: no batch, heartbeat or TransferDone; rolling back");
                    self.bump_request("lease_expired");
                    // The sender stopped renewing: take down its data plane.
                    self.forget_sender(&r.peer);
                    self.finish_failed(
                        &req_id,
                        r,
                        ErrorCode::LeaseExpired,
                        Cause::Unfenced,
                        now,
                        out,
                    );
                }
            }
        }
        while let Some(held) = self.consume_later.pop_due(now) {
            self.consume_refs(&held);
        }
        let dead: Vec<String> = self
            .tombstones
            .iter()
            .filter(|(_, t)| t.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for req_id in dead {
            self.drop_tombstone(&req_id);
        }
        self.grant_parked(now, out);
    }

    /// The earliest instant at which [`ReceiverCore::tick`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next = self.queue.next_deadline();
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        if self
            .requests
            .values()
            .any(|r| !matches!(r.phase, Phase::Parked { .. }))
        {
            consider(self.next_lease_scan);
        }
        for t in self.tombstones.values() {
            consider(t.until);
        }
        if let Some(t) = self.consume_later.next_due() {
            consider(t);
        }
        next
    }

    /// Claims one reference of a ready copy of `key` as a decoder borrow.
    pub fn borrow(&mut self, key: &str) -> Option<Borrowed> {
        self.keys.borrow(key)
    }

    /// Ends a borrow of the copy of generation `gen` (from [`Borrowed`]),
    /// consuming its reference; frees the slot if it was the last. Returns
    /// true if capacity was freed.
    pub fn end_borrow(&mut self, key: &str, gen: u64, now: Instant, out: &mut Vec<Output>) -> bool {
        let u = self.keys.end_borrow(key, gen);
        let freed = self.release(u);
        if freed {
            self.grant_parked(now, out);
        }
        freed
    }

    /// Drops one unborrowed reference of `key` (decoder `remove`). Returns
    /// false if the key is not held or all its references are borrowed.
    pub fn remove_key(&mut self, key: &str, now: Instant, out: &mut Vec<Output>) -> bool {
        match self.keys.unref(key) {
            Unref::NotHeld => false,
            u => {
                if self.release(u) {
                    self.grant_parked(now, out);
                }
                true
            }
        }
    }

    /// True if a copy of `key` is held and its bytes are in place.
    pub fn is_ready(&self, key: &str) -> bool {
        self.keys.get(key).is_some_and(|e| e.ready)
    }

    /// Takes the admission waits recorded since the last call.
    pub fn take_admission_waits(&mut self) -> Vec<Duration> {
        std::mem::take(&mut self.admission_waits)
    }

    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> CoreStats {
        let mut s = self.stats.clone();
        s.parked_requests = self.queue.len();
        s.tracked_requests = self.requests.len();
        s.keys = self.keys.len();
        s.quarantined_slots = self.tombstones.values().map(|t| t.quarantined.len()).sum();
        s.slots_in_use = self.slots.in_use();
        s
    }

    // ----- message handlers -------------------------------------------------

    /// The `HelloAck` for `h`, or the reason for a `peer_unavailable` reply
    /// when the acceptor could not set up the data plane `h` asked for.
    fn on_hello(&mut self, peer: &[u8], h: &Hello) -> Result<HelloAck, String> {
        debug!(sender_id = %h.sender_id, version = h.version, transport = %h.transport, "hello");
        self.peers.insert(peer.to_vec(), h.sender_id.clone());
        // Whatever this peer set up before is stale: it says Hello again.
        self.forget_sender(peer);
        // So is what an earlier socket of the same sender to this receiver
        // set up: a kvferry sender that re-handshakes (its data plane was
        // lost) does so on a new socket, whose identity differs only by the
        // generation suffix (`"{sender_id}-to-{endpoint}#{generation}"`).
        let stem = identity_stem(peer);
        let earlier: Vec<PeerId> = self
            .accepted
            .keys()
            .filter(|k| {
                k.as_slice() != peer
                    && identity_stem(k) == stem
                    && self.peers.get(*k).is_some_and(|id| *id == h.sender_id)
            })
            .cloned()
            .collect();
        for k in earlier {
            self.forget_sender(&k);
        }
        let (transport, descriptor) = match &mut self.acceptor {
            Some(a) if a.kind() == h.transport => {
                let kind = a.kind();
                let d = a.accept(&h.descriptor).map_err(|e| {
                    debug!(sender_id = %h.sender_id, error = %e, "data plane refused");
                    format!(
                        "receiver {} cannot set up the {kind} data plane: {e}",
                        self.cfg.receiver_id
                    )
                })?;
                self.accepted.insert(peer.to_vec(), h.descriptor.clone());
                (kind.to_owned(), d)
            }
            _ => self
                .cfg
                .other_transports
                .iter()
                .find(|(name, _)| *name == h.transport && *name != self.cfg.transport)
                .map_or(
                    (self.cfg.transport.clone(), self.cfg.descriptor.clone()),
                    |(n, d)| (n.clone(), d.clone()),
                ),
        };
        Ok(HelloAck {
            receiver_id: self.cfg.receiver_id.clone(),
            version: PROTOCOL_VERSION,
            transport,
            descriptor,
            chunk_bytes: self.cfg.chunk_bytes,
            capacity_chunks: self.cfg.capacity_chunks as u64,
        })
    }

    /// Tears down the acceptor's data plane to `peer`, if it has one.
    fn forget_sender(&mut self, peer: &[u8]) {
        if let (Some(a), Some(d)) = (&mut self.acceptor, self.accepted.remove(peer)) {
            debug!(kind = a.kind(), "forgetting a sender's data plane");
            a.forget(&d);
        }
    }

    fn on_alloc(&mut self, peer: &[u8], req: AllocRequest, now: Instant, out: &mut Vec<Output>) {
        if req.req_id.is_empty() {
            return self.on_anonymous(peer, req, now, out);
        }
        if let Some(t) = self.tombstones.get(&req.req_id) {
            let code = t.code;
            let msg = format!(
                "request {} already ended with {}",
                req.req_id,
                code.as_str()
            );
            return self.fail_reply(peer, req.keys.len(), req.seq, code, msg, out);
        }
        let req_id = req.req_id.clone();
        match self.requests.get_mut(&req_id) {
            Some(r) => match &mut r.phase {
                Phase::Parked { backlog, .. } => backlog.push_back(req),
                Phase::Admitted { .. } => self.process_batch(peer, req, now, out),
                Phase::AwaitingDone => {
                    let msg = format!("batch for request {req_id} after its last batch");
                    self.fail_request(
                        &req_id,
                        peer,
                        &req,
                        ErrorCode::ProtocolViolation,
                        msg,
                        now,
                        out,
                    );
                }
            },
            None => self.first_batch(peer, req, now, out),
        }
    }

    fn first_batch(&mut self, peer: &[u8], req: AllocRequest, now: Instant, out: &mut Vec<Output>) {
        let n = req.keys.len();
        if req.total_chunks <= 0 {
            self.bump_request("rejected");
            let msg = format!(
                "request {} has total_chunks = {}: every sender must declare the request's chunk count on each batch",
                req.req_id, req.total_chunks
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::ZeroTotalChunks, msg, out);
        }
        let total = req.total_chunks as usize;
        if total > self.cfg.capacity_chunks {
            self.bump_request("rejected");
            let msg = format!(
                "buffer too small: request {} needs {total} chunks, the receive buffer holds {}",
                req.req_id, self.cfg.capacity_chunks
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::BufferTooSmall, msg, out);
        }
        if let Err((code, msg)) = self.check_batch_shape(&req) {
            self.bump_request("rejected");
            return self.fail_reply(peer, n, req.seq, code, msg, out);
        }
        if n > total {
            self.bump_request("rejected");
            let msg = format!(
                "protocol violation: request {} sends {n} chunks in its first batch but declared total_chunks = {total}",
                req.req_id
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::ProtocolViolation, msg, out);
        }
        let deadline = now + self.cfg.admission_timeout;
        let extended = self.peers.contains_key(peer);
        let req_id = req.req_id.clone();
        match self
            .queue
            .admit_or_park(&self.ledger, req_id.clone(), total, deadline)
        {
            Ok(Some(reservation)) => {
                self.bump_request("admitted");
                self.admission_waits.push(Duration::ZERO);
                self.requests.insert(
                    req_id,
                    Request {
                        peer: peer.to_vec(),
                        extended,
                        total,
                        seen: 0,
                        held: Vec::new(),
                        lease_deadline: now + self.cfg.lease,
                        phase: Phase::Admitted { reservation },
                    },
                );
                self.note_admitted();
                self.process_batch(peer, req, now, out);
            }
            Ok(None) => {
                debug!(req_id = %req_id, total, "parked: does not fit yet");
                self.bump_request("parked");
                let mut backlog = VecDeque::new();
                backlog.push_back(req);
                self.requests.insert(
                    req_id,
                    Request {
                        peer: peer.to_vec(),
                        extended,
                        total,
                        seen: 0,
                        held: Vec::new(),
                        lease_deadline: now + self.cfg.lease,
                        phase: Phase::Parked {
                            backlog,
                            since: now,
                        },
                    },
                );
            }
            Err(e) => {
                self.bump_request("rejected");
                let msg = format!("request {req_id} refused: {e}");
                self.fail_reply(peer, n, req.seq, ErrorCode::BufferTooSmall, msg, out);
            }
        }
    }

    /// Allocates one batch of an admitted request and answers it.
    fn process_batch(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let req_id = req.req_id.clone();
        let Some(mut r) = self.requests.remove(&req_id) else {
            return;
        };
        let n = req.keys.len();
        let check = if req.total_chunks < 0 || req.total_chunks as usize != r.total {
            Err((
                ErrorCode::InconsistentRequest,
                format!(
                    "request {req_id} changed total_chunks from {} to {}",
                    r.total, req.total_chunks
                ),
            ))
        } else if r.seen + n > r.total {
            Err((
                ErrorCode::ProtocolViolation,
                format!(
                    "protocol violation: request {req_id} sent {} chunks, more than its declared total_chunks = {}",
                    r.seen + n,
                    r.total
                ),
            ))
        } else {
            self.check_batch_shape(&req)
        };
        if let Err((code, msg)) = check {
            self.requests.insert(req_id.clone(), r);
            return self.fail_request(&req_id, peer, &req, code, msg, now, out);
        }
        let Phase::Admitted { reservation } = &mut r.phase else {
            // Only admitted requests reach here (callers check the phase).
            self.requests.insert(req_id.clone(), r);
            return;
        };
        let mut remote = Vec::with_capacity(n);
        let mut already = Vec::new();
        let first_new = r.held.len();
        let mut failure = None;
        for (i, key) in req.keys.iter().enumerate() {
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            // Dedup only against a written copy (`pin` skips copies still
            // being written): "already sent" then means the bytes are in
            // place, so the sender may count the chunk complete at once.
            if let Some((_slot, gen)) = self.keys.pin(key) {
                // The chunk needs no slot, so its share of the reservation
                // goes back at once (allocate it, then free it).
                if reservation.allocate(1).is_ok() {
                    self.ledger.free(1);
                }
                r.held.push(Held {
                    key: key.clone(),
                    gen,
                    wrote: false,
                    granted: false,
                });
                // LMCache's reply shape: `remote_indexes` lists only the
                // keys to write, so a dedup hit gets no entry there
                // (`len(remote) == len(keys) - len(already)`).
                already.push(i as i64);
                continue;
            }
            if reservation.allocate(1).is_err() {
                failure = Some(format!(
                    "request {req_id}: reservation exhausted (internal accounting error)"
                ));
                break;
            }
            let Some(set) = self.slots.try_alloc(1) else {
                self.ledger.free(1);
                failure = Some(format!(
                    "request {req_id}: no free slot although admitted (internal accounting error)"
                ));
                break;
            };
            let slot = set.as_slice()[0];
            // A new key, or one whose copies are all still being written:
            // this request writes its own copy (its reservation counts it).
            let gen = self.keys.insert_new(key, slot, !r.extended, tokens);
            r.held.push(Held {
                key: key.clone(),
                gen,
                wrote: true,
                granted: false,
            });
            remote.push(i64::from(slot));
        }
        if let Some(msg) = failure {
            self.requests.insert(req_id.clone(), r);
            return self.fail_request(
                &req_id,
                peer,
                &req,
                ErrorCode::AllocationFailed,
                msg,
                now,
                out,
            );
        }
        for h in &mut r.held[first_new..] {
            h.granted = true;
        }
        r.seen += n;
        r.lease_deadline = now + self.cfg.lease;
        debug!(req_id = %req_id, chunks = n, dedup = already.len(), seen = r.seen, total = r.total, last = req.is_last_batch, "batch allocated");
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(remote, already, req.seq)),
        });
        if req.is_last_batch {
            // Whatever was reserved but not sent goes back now.
            if let Phase::Admitted { reservation } =
                std::mem::replace(&mut r.phase, Phase::AwaitingDone)
            {
                drop(reservation);
            }
            if r.extended {
                self.requests.insert(req_id, r);
            } else {
                // LMCache semantics: tracking ends with the last batch; the
                // keys stay for the decoder, which learns of them from the
                // proxy. A counting decoder takes them after the grace.
                if self.cfg.auto_consume && !r.held.is_empty() {
                    let held = r.held.iter().map(|h| (h.key.clone(), h.gen)).collect();
                    self.consume_later
                        .push(now + self.cfg.consume_grace, peer, &req_id, held);
                }
                self.bump_request("completed");
                out.push(Output::Finished {
                    req_id,
                    outcome: Outcome::Ready,
                });
            }
        } else {
            self.requests.insert(req_id, r);
        }
    }

    /// Allocation for `req_id == ""`: no admission wait, no tracking, but the
    /// chunks are still counted in the ledger so admitted requests keep their
    /// guarantee.
    fn on_anonymous(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let n = req.keys.len();
        if let Err((code, msg)) = self.check_batch_shape(&req) {
            return self.fail_reply(peer, n, req.seq, code, msg, out);
        }
        let fresh: HashSet<&str> = req
            .keys
            .iter()
            .map(String::as_str)
            .filter(|k| !self.keys.pinnable(k))
            .collect();
        let busy = !self.queue.is_empty();
        let reservation = if busy {
            None
        } else {
            self.ledger.try_admit(fresh.len()).ok()
        };
        let Some(mut reservation) = reservation else {
            let msg = format!(
                "no room for {} anonymous chunks ({} of {} committed, {} requests parked)",
                fresh.len(),
                self.ledger.stats().committed,
                self.cfg.capacity_chunks,
                self.queue.len()
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::AllocationFailed, msg, out);
        };
        let mut remote = Vec::with_capacity(n);
        let mut already = Vec::new();
        let mut held = Vec::new();
        for (i, key) in req.keys.iter().enumerate() {
            if let Some((_, gen)) = self.keys.pin(key) {
                // Written already: no slot to write (see `process_batch`).
                already.push(i as i64);
                held.push((key.clone(), gen));
                continue;
            }
            let slot = match (reservation.allocate(1), self.slots.try_alloc(1)) {
                (Ok(()), Some(set)) => set.as_slice()[0],
                (ok, _) => {
                    if ok.is_ok() {
                        self.ledger.free(1);
                    }
                    warn!("anonymous allocation found no slot although reserved");
                    remote.push(-1);
                    continue;
                }
            };
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            held.push((key.clone(), self.keys.insert_new(key, slot, true, tokens)));
            remote.push(i64::from(slot));
        }
        drop(reservation);
        if self.cfg.auto_consume && !held.is_empty() {
            // No TransferDone will come: delivered after the grace.
            self.consume_later
                .push(now + self.cfg.consume_grace, peer, "", held);
        }
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(remote, already, req.seq)),
        });
    }

    fn on_cancel(&mut self, peer: &[u8], c: CancelNotif, now: Instant, out: &mut Vec<Output>) {
        // Only a kvferry sender (it said Hello) promises that its writes for
        // the request completed before it cancels; an LMCache sender's
        // cancel is no fence, so its quarantined slots wait for the grace.
        let fenced = self.peers.contains_key(peer);
        if let Some(r) = self.requests.remove(&c.req_id) {
            debug!(req_id = %c.req_id, "cancelled by sender");
            self.bump_request("cancelled");
            self.finish_failed(
                &c.req_id,
                r,
                ErrorCode::Cancelled,
                Cause::SenderCancel,
                now,
                out,
            );
            // The sender ended it: nothing later needs the tombstone's error.
            if fenced {
                self.drop_tombstone(&c.req_id);
            }
        } else if self.tombstones.contains_key(&c.req_id) {
            // The fence for a request the receiver already failed: the
            // sender's in-flight writes are done, quarantined slots are safe.
            if fenced {
                self.drop_tombstone(&c.req_id);
            }
        } else if !fenced {
            // An LMCache sender cancelling a request whose tracking already
            // ended: release its references — exactly those it holds if a
            // counting decoder was about to take them, else one reference
            // of each listed key.
            if let Some(held) = self.consume_later.take(peer, &c.req_id) {
                self.consume_refs(&held);
            } else {
                for key in &c.keys {
                    let u = self.keys.unref(key);
                    self.release(u);
                }
            }
        }
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(Vec::new(), Vec::new(), c.seq)),
        });
    }

    /// Drops the references `(key, gen)` of a delivered allocation, as a
    /// counting decoder would (parked requests are granted by the caller).
    fn consume_refs(&mut self, held: &[(String, u64)]) {
        for (key, gen) in held {
            let u = self.keys.unref_gen(key, *gen);
            self.release(u);
        }
    }

    /// Removes a tombstone and ends the quarantine of the copies it kept;
    /// each slot is freed unless a reference still holds it.
    fn drop_tombstone(&mut self, req_id: &str) {
        if let Some(t) = self.tombstones.remove(req_id) {
            for (key, gen) in t.quarantined {
                let u = self.keys.unquarantine(&key, gen);
                self.release(u);
            }
        }
    }

    fn on_transfer_done(&mut self, req_id: &str, now: Instant, out: &mut Vec<Output>) {
        match self.requests.get(req_id).map(|r| &r.phase) {
            Some(Phase::AwaitingDone) => {
                if let Some(r) = self.requests.remove(req_id) {
                    // The copies this request wrote are now in place: from
                    // here on, later requests are told "already sent".
                    for h in r.held.iter().filter(|h| h.wrote) {
                        self.keys.mark_ready(&h.key, h.gen);
                    }
                    if self.cfg.auto_consume {
                        // A decoder that only counts: drop this request's
                        // references at once.
                        for h in &r.held {
                            let u = self.keys.unref_gen(&h.key, h.gen);
                            if self.release(u) {
                                self.grant_parked(now, out);
                            }
                        }
                    }
                    self.bump_request("completed");
                    out.push(Output::Finished {
                        req_id: req_id.to_owned(),
                        outcome: Outcome::Ready,
                    });
                }
            }
            Some(_) => {
                warn!(
                    req_id,
                    "TransferDone before the request's last batch; ignored"
                );
                self.bump_error(ErrorCode::ProtocolViolation);
            }
            None => debug!(req_id, "TransferDone for an unknown request; ignored"),
        }
    }

    fn on_heartbeat(&mut self, sender_id: &str, now: Instant) {
        let lease = now + self.cfg.lease;
        for r in self.requests.values_mut() {
            if self.peers.get(&r.peer).is_some_and(|s| s == sender_id) {
                r.lease_deadline = lease;
            }
        }
    }

    // ----- shared steps -----------------------------------------------------

    /// Validates the chunk geometry against the slot size.
    fn check_batch_shape(&self, req: &AllocRequest) -> Result<(), (ErrorCode, String)> {
        if req.keys.is_empty() {
            return Ok(());
        }
        match req.chunk_bytes() {
            Ok(b) if b <= self.cfg.chunk_bytes => Ok(()),
            Ok(b) => Err((
                ErrorCode::ChunkTooLarge,
                format!(
                    "chunk of shape {:?} {} is {b} bytes, larger than this receiver's {}-byte slots",
                    req.shape, req.dtype, self.cfg.chunk_bytes
                ),
            )),
            Err(e) => Err((ErrorCode::BadMessage, format!("bad chunk geometry: {e}"))),
        }
    }

    /// Rolls back a tracked request because of `req`'s batch and answers it.
    #[allow(clippy::too_many_arguments)]
    fn fail_request(
        &mut self,
        req_id: &str,
        peer: &[u8],
        req: &AllocRequest,
        code: ErrorCode,
        msg: String,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        warn!(req_id, code = code.as_str(), "{msg}");
        if let Some(r) = self.requests.remove(req_id) {
            self.bump_request("failed");
            self.finish_failed(req_id, r, code, Cause::Unfenced, now, out);
        }
        self.fail_reply(peer, req.keys.len(), req.seq, code, msg, out);
    }

    /// Ends a request in failure: answers its parked batches, drops its
    /// reservation and references, quarantines slots that may still be
    /// written, and leaves a tombstone.
    fn finish_failed(
        &mut self,
        req_id: &str,
        r: Request,
        code: ErrorCode,
        cause: Cause,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        match r.phase {
            Phase::Parked { backlog, .. } => {
                self.queue.remove(&req_id.to_owned());
                for b in backlog {
                    let msg = format!(
                        "request {req_id} ended while waiting for admission: {}",
                        code.as_str()
                    );
                    self.fail_reply(&r.peer, b.keys.len(), b.seq, code, msg, out);
                }
            }
            Phase::Admitted { reservation } => drop(reservation),
            Phase::AwaitingDone => {}
        }
        let fence = !(cause == Cause::SenderCancel && r.extended);
        let mut quarantined = Vec::new();
        for h in &r.held {
            if h.wrote {
                // A tracked request never completed, so the bytes it was
                // writing are not whole: its copy is detached (nobody new
                // pins or reads it). A kvferry peer's copy was never pinned
                // (only ready copies are), but an LMCache peer's keys are
                // pinnable from allocation on, so others may hold it: their
                // references keep the slot until they go, and a granted
                // slot is also kept until the fence.
                let quarantine = h.granted && fence;
                let u = self.keys.evict(&h.key, h.gen, quarantine);
                self.release(u);
                if quarantine && self.keys.get_gen(&h.key, h.gen).is_some() {
                    quarantined.push((h.key.clone(), h.gen));
                }
            } else {
                let u = self.keys.unref_gen(&h.key, h.gen);
                self.release(u);
            }
        }
        if !quarantined.is_empty() {
            debug!(
                req_id,
                slots = quarantined.len(),
                "slots quarantined until the fence"
            );
        }
        let until = now + self.cfg.quarantine_grace;
        self.tombstones.insert(
            req_id.to_owned(),
            Tombstone {
                code,
                quarantined,
                until,
            },
        );
        out.push(Output::Finished {
            req_id: req_id.to_owned(),
            outcome: Outcome::Failed(code),
        });
    }

    /// Grants parked requests that now fit, in FIFO order, and processes
    /// their backlog.
    fn grant_parked(&mut self, now: Instant, out: &mut Vec<Output>) {
        loop {
            let granted = self.queue.grant_ready(&self.ledger);
            if granted.is_empty() {
                return;
            }
            for (req_id, reservation) in granted {
                let Some(r) = self.requests.get_mut(&req_id) else {
                    continue;
                };
                let phase = std::mem::replace(&mut r.phase, Phase::Admitted { reservation });
                let Phase::Parked { backlog, since } = phase else {
                    continue;
                };
                r.lease_deadline = now + self.cfg.lease;
                let peer = r.peer.clone();
                self.admission_waits
                    .push(now.saturating_duration_since(since));
                self.bump_request("admitted");
                debug!(req_id = %req_id, waited_us = now.saturating_duration_since(since).as_micros() as u64, "admitted after parking");
                for b in backlog {
                    match self.requests.get(&req_id).map(|r| &r.phase) {
                        Some(Phase::Admitted { .. }) => self.process_batch(&peer, b, now, out),
                        Some(Phase::AwaitingDone) => {
                            let msg = format!("batch for request {req_id} after its last batch");
                            self.fail_request(
                                &req_id,
                                &peer,
                                &b,
                                ErrorCode::ProtocolViolation,
                                msg,
                                now,
                                out,
                            );
                        }
                        _ => {
                            // Rolled back by an earlier batch of the backlog.
                            let code = self
                                .tombstones
                                .get(&req_id)
                                .map_or(ErrorCode::Cancelled, |t| t.code);
                            let msg =
                                format!("request {req_id} already ended with {}", code.as_str());
                            self.fail_reply(&peer, b.keys.len(), b.seq, code, msg, out);
                        }
                    }
                }
            }
        }
    }

    /// Frees the slot of a dropped last reference. Returns true if a slot
    /// was freed.
    fn release(&mut self, u: Unref) -> bool {
        match u {
            Unref::Freed(slot) => {
                self.free_slot(slot);
                true
            }
            Unref::Held | Unref::NotHeld => false,
        }
    }

    fn free_slot(&mut self, slot: u32) {
        self.slots.free_one(slot);
        self.ledger.free(1);
    }

    fn fail_reply(
        &mut self,
        peer: &[u8],
        n_keys: usize,
        seq: Option<u64>,
        code: ErrorCode,
        msg: String,
        out: &mut Vec<Output>,
    ) {
        self.bump_error(code);
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::failure(n_keys, seq, code, msg)),
        });
    }

    /// Records the number of admitted requests if it is a new peak.
    fn note_admitted(&mut self) {
        let admitted = self.requests.len() - self.queue.len();
        self.stats.peak_admitted = self.stats.peak_admitted.max(admitted);
    }

    fn bump_request(&mut self, outcome: &'static str) {
        *self.stats.requests_total.entry(outcome).or_default() += 1;
    }

    fn bump_error(&mut self, code: ErrorCode) {
        *self.stats.errors_total.entry(code.as_str()).or_default() += 1;
    }
}

/// A sender socket's identity without its generation suffix: kvferry's
/// sender names its sockets `"{sender_id}-to-{endpoint}"` and, when it
/// replaces one, appends `#{generation}`. Identities without a numeric
/// `#` suffix are their own stem.
pub(crate) fn identity_stem(identity: &[u8]) -> &[u8] {
    match identity.iter().rposition(|&b| b == b'#') {
        Some(at)
            if at + 1 < identity.len() && identity[at + 1..].iter().all(u8::is_ascii_digit) =>
        {
            &identity[..at]
        }
        _ => identity,
    }
}

fn lease_scan_period(lease: Duration) -> Duration {
    (lease / 4).max(Duration::from_millis(1))
}
