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
//! - The first batch of a `req_id` reserves `total_chunks` in the [`Ledger`](crate::ledger::Ledger);
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
//! - Ownership (invariant 8): requests are keyed by (peer, `req_id`). A
//!   `CancelNotif` or `TransferDone` from a peer that does not own the
//!   request changes nothing and is counted (`not_owner`, answered for a
//!   cancel); a `Heartbeat` renews only its own peer's requests, in O(1):
//!   it moves the peer's liveness, and a request's lease is the later of its
//!   own progress and its peer's liveness. When an admitted request of a
//!   peer lapses the peer is dead: all its requests end, parked ones too.
//! - Bounds (invariant 9, [`Bounds`]): parked requests and their backlog,
//!   ended-request records and per-peer state are charged in bytes; past a
//!   bound the peer is answered `overloaded` at once. Peer state is dropped
//!   when nothing of the peer is left and it was silent for a lease.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tracing::debug;

use crate::log_budget::LogBudget;
use crate::peer_warn;

use crate::ledger::{AdmissionQueue, Ledger, Reservation};
use crate::protocol::{
    AllocRequest, AllocResponse, CancelNotif, Descriptor, ErrorCode, Hello, HelloAck, Message,
    ReplyHints, PROTOCOL_VERSION,
};
use crate::slots::SlotAllocator;

use super::acceptor::HelloAcceptor;
use super::bounds::{self, Bounds};
use super::grants::{DataKeys, GrantTable, Revoked, Secret, Token};
use super::keys::{Borrowed, KeyTable, Unref};
use super::owned::ByRequest;

pub use super::owned::PeerId;

/// How long after an eviction scan of per-peer state that freed nothing
/// the next may run ([`ReceiverCore::evict_empty_peers`]).
const EVICT_RETRY: Duration = Duration::from_millis(100);

/// A request's key in the admission queue: (owner, `req_id`).
type ReqKey = (PeerId, String);

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
    /// Bounds on what peers can make the core hold.
    pub bounds: Bounds,
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
    /// Nothing of `peer` is left in the core: the shell may drop what it
    /// keeps per peer (the envelope style).
    ForgetPeer {
        /// The peer.
        peer: PeerId,
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
    /// `failed`, `lease_expired`, `admission_timeout`, `rejected`), and
    /// `unconsumed_expired`: completed requests whose chunks nobody took
    /// within the unconsumed lifetime.
    pub requests_total: BTreeMap<&'static str, u64>,
    /// Error replies by code (`not_owner` also counts messages from a
    /// peer about another peer's request that get no reply: `TransferDone`,
    /// a `Heartbeat` naming another sender).
    pub errors_total: BTreeMap<&'static str, u64>,
    /// Peers with state in the core (said Hello, or have requests or
    /// records).
    pub peers: usize,
    /// Bytes charged to parked requests and their backlog.
    pub parked_bytes: usize,
    /// Bytes charged to ended-request records and anonymous allocations.
    pub record_bytes: usize,
    /// Bytes charged to per-peer state.
    pub peer_bytes: usize,
    /// Anonymous allocations not yet expired.
    pub anonymous_allocations: usize,
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
    /// The chunk's length in bytes (see [`chunk_len`]).
    len: u64,
    /// Token count of a batch's last chunk.
    tokens: Option<u32>,
}

/// One chunk of a request handed to the decoder by [`ReceiverCore::take`]:
/// a borrow of the copy `(key, gen)`, ended with
/// [`ReceiverCore::end_borrow`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenChunk {
    /// The key.
    pub key: String,
    /// Generation of the copy borrowed.
    pub gen: u64,
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// The chunk's length in bytes (at most a slot).
    pub len: u64,
    /// Token count if this was a batch's (possibly short) last chunk.
    pub tokens: Option<u32>,
}

/// Why [`ReceiverCore::take`] handed out nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeError {
    /// No complete request of that id waits to be taken: it is still in
    /// flight, failed, was already taken, expired unconsumed, completed
    /// without `TransferDone` (LMCache senders: read those by key), or the
    /// receiver consumes automatically.
    #[error("request {0} has no complete chunks waiting to be taken")]
    NotReady(String),
    /// Several peers completed a request of that id: which one is meant is
    /// unknown, so none is handed out (read them by key instead).
    #[error("{peers} peers completed a request named {req_id}; take refuses to guess")]
    Ambiguous {
        /// The request id.
        req_id: String,
        /// How many peers completed one.
        peers: usize,
    },
    /// A chunk of the request was already consumed by key
    /// (`get`/`remove`): the request is now only readable by key.
    #[error("chunk {key} of request {req_id} was already consumed by key")]
    Consumed {
        /// The request id.
        req_id: String,
        /// The first chunk found consumed.
        key: String,
    },
}

/// A request completed with `TransferDone` whose chunks the decoder has not
/// taken yet: its references, in key order, for [`ReceiverCore::take`].
#[derive(Debug)]
struct Delivered {
    chunks: Vec<(String, u64, u64, Option<u32>)>,
    /// When its chunks are released unconsumed, if an expiry is set.
    until: Option<Instant>,
    /// Bytes charged against `delivered_bytes`.
    charge: usize,
}

#[derive(Debug)]
enum Phase {
    /// Waiting for admission; batches received meanwhile, in order.
    Parked {
        backlog: VecDeque<AllocRequest>,
        since: Instant,
        /// Bytes charged against the parked bounds (request + backlog).
        charge: usize,
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
    /// Bytes charged against `max_ended_bytes`.
    charge: usize,
}

/// The references an LMCache peer's request still held when its tracking
/// ended (last batch): what a later `CancelNotif` of that peer for that
/// request releases, and nothing else.
#[derive(Debug)]
struct DoneRefs {
    held: Vec<(String, u64)>,
    until: Instant,
    charge: usize,
}

/// An anonymous allocation (`req_id == ""`): its references, until its
/// lifetime ends.
#[derive(Debug)]
struct Anonymous {
    peer: PeerId,
    /// Copies it wrote (`true`) or pinned (`false`).
    held: Vec<(String, u64, bool)>,
    until: Instant,
    charge: usize,
}

/// What the core keeps per peer.
#[derive(Debug)]
struct PeerState {
    /// The peer said `Hello` (kvferry semantics); its sender id.
    hello: Option<String>,
    /// Its last `Heartbeat` plus a lease: its requests, parked ones
    /// included, are alive until then.
    alive_until: Instant,
    /// Its last message of any kind.
    last_seen: Instant,
    /// Bytes its parked requests are charged.
    parked_bytes: usize,
    /// Anonymous allocations it holds.
    anonymous: usize,
    /// Bytes this state is charged.
    charge: usize,
}

impl PeerState {
    fn extended(&self) -> bool {
        self.hello.is_some()
    }
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
    queue: AdmissionQueue<ReqKey>,
    slots: SlotAllocator,
    keys: KeyTable,
    requests: ByRequest<Request>,
    tombstones: ByRequest<Tombstone>,
    /// LMCache requests whose tracking ended, with the references they hold.
    done_refs: ByRequest<DoneRefs>,
    /// When each record of `done_refs` ends, in that order (the deadline is
    /// a constant after insertion, so this FIFO is sorted): O(1) to find
    /// the next one. An entry whose record was cancelled or replaced since
    /// is skipped.
    done_due: VecDeque<(Instant, PeerId, String)>,
    /// Anonymous allocations, oldest first (all have the same lifetime).
    anonymous: VecDeque<Anonymous>,
    /// Requests completed with `TransferDone`, not yet taken.
    delivered: ByRequest<Delivered>,
    /// When each expiring record of `delivered` ends, in that order (a
    /// constant lifetime, so sorted); stale entries are skipped.
    delivered_due: VecDeque<(Instant, PeerId, String)>,
    /// How long a delivered request's chunks wait to be consumed before
    /// they are released (`None`: forever).
    unconsumed_lifetime: Option<Duration>,
    /// Bytes charged to `delivered`: a budget of its own, of
    /// `bounds.max_ended_bytes`, so a slow decoder never crowds out
    /// tombstones or anonymous allocations.
    delivered_bytes: usize,
    /// Per-peer state, pruned when nothing of the peer is left.
    peers: HashMap<PeerId, PeerState>,
    /// Hello'd peers whose state was pruned (hashes, bounded), so their
    /// next request keeps kvferry semantics.
    pruned_hello: PrunedPeers,
    /// Peers forgotten by [`ReceiverCore::evict_empty_peers`] during the
    /// current message, reported as [`Output::ForgetPeer`] after it.
    evicted_peers: Vec<PeerId>,
    /// No eviction scan before this (the last one freed nothing).
    next_evict_scan: Instant,
    /// Bytes charged: parked requests, ended records + anonymous, peers.
    parked_bytes: usize,
    record_bytes: usize,
    peer_bytes: usize,
    /// Rate limit of warnings a peer's message causes.
    log: LogBudget,
    next_lease_scan: Instant,
    stats: CoreStats,
    /// Admission waits (reserve → grant) not yet collected by the shell.
    admission_waits: Vec<Duration>,
    /// The per-sender data plane offered besides `cfg`'s (RDMA), if any.
    acceptor: Option<Box<dyn HelloAcceptor>>,
    /// Senders the acceptor set up, with the descriptor of their `Hello`.
    accepted: HashMap<PeerId, Descriptor>,
    /// TCP data plane: the secret of each sender that chose it, and which
    /// token may write which slot (see `super::grants`).
    data_keys: DataKeys,
    grants: std::sync::Arc<GrantTable>,
}

impl ReceiverCore {
    /// A core with an empty buffer of `cfg.capacity_chunks` slots.
    pub fn new(cfg: CoreConfig, now: Instant) -> Self {
        let ledger = Ledger::new(cfg.capacity_chunks);
        let cfg_slots = cfg.capacity_chunks;
        let slots = SlotAllocator::new(cfg.capacity_chunks);
        let next_lease_scan = now + lease_scan_period(cfg.lease);
        Self {
            cfg,
            ledger,
            queue: AdmissionQueue::new(),
            slots,
            keys: KeyTable::default(),
            requests: ByRequest::default(),
            tombstones: ByRequest::default(),
            done_refs: ByRequest::default(),
            done_due: VecDeque::new(),
            anonymous: VecDeque::new(),
            delivered: ByRequest::default(),
            delivered_due: VecDeque::new(),
            unconsumed_lifetime: None,
            delivered_bytes: 0,
            peers: HashMap::new(),
            pruned_hello: PrunedPeers::default(),
            evicted_peers: Vec::new(),
            next_evict_scan: now,
            parked_bytes: 0,
            record_bytes: 0,
            peer_bytes: 0,
            log: LogBudget::new(),
            next_lease_scan,
            stats: CoreStats::default(),
            admission_waits: Vec::new(),
            acceptor: None,
            accepted: HashMap::new(),
            data_keys: DataKeys::default(),
            grants: std::sync::Arc::new(GrantTable::new(cfg_slots)),
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

    /// Releases the chunks of a request completed with `TransferDone` that
    /// nobody took or read within `lifetime` of its completion (counted in
    /// `requests_total["unconsumed_expired"]`, logged). Chunks borrowed by
    /// key at that moment stay until their borrow ends. Default: kept until
    /// consumed.
    pub fn with_unconsumed_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.unconsumed_lifetime = lifetime;
        self
    }

    /// True if the core keeps state for `peer` (it said Hello, or has
    /// requests or records); the shell keeps per-peer data only for these.
    pub fn has_peer(&self, peer: &[u8]) -> bool {
        self.peers.contains_key(peer)
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

    /// The per-slot write grants the TCP data thread checks.
    pub(crate) fn grant_table(&self) -> &std::sync::Arc<GrantTable> {
        &self.grants
    }

    /// The token a TCP data connection presenting `secret` acts for.
    pub(crate) fn data_token(&self, secret: &Secret) -> Option<Token> {
        self.data_keys.lookup(secret)
    }

    /// Finishes freeing a slot whose free [`GrantTable::revoke`] deferred
    /// because a TCP read was landing in it (the data thread calls this
    /// once that read returned).
    pub(crate) fn free_deferred(&mut self, slot: u32, now: Instant, out: &mut Vec<Output>) {
        self.slots.free_one(slot);
        self.ledger.free(1);
        self.grant_parked(now, out);
    }

    /// The reservation ledger (for lock-free stats readers).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Handles one decoded message from `peer`.
    pub fn handle(&mut self, peer: &[u8], msg: Message, now: Instant, out: &mut Vec<Output>) {
        if let Some(p) = self.peers.get_mut(peer) {
            p.last_seen = now;
        }
        match msg {
            Message::AllocRequest(req) => self.on_alloc(peer, req, now, out),
            Message::CancelNotif(c) => self.on_cancel(peer, c, now, out),
            Message::TransferDone(d) => self.on_transfer_done(peer, &d.req_id, now, out),
            Message::Heartbeat(h) => self.on_heartbeat(peer, &h.sender_id, now),
            Message::Hello(_) if !self.cfg.answer_hello => {
                debug!("Hello ignored (LMCache emulation)");
            }
            Message::Hello(h) => match self.on_hello(peer, &h, now) {
                Ok(ack) => out.push(Output::Send {
                    peer: peer.to_vec(),
                    message: Message::HelloAck(ack),
                }),
                Err((code, reason)) => self.fail_reply(peer, 1, None, code, reason, out),
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
        for peer in self.evicted_peers.drain(..) {
            out.push(Output::ForgetPeer { peer });
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
        for (peer, req_id) in self.queue.expire(now) {
            if let Some(r) = self.requests.remove(&peer, &req_id) {
                peer_warn!(self.log, now, req_id = %req_id, "admission timeout");
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
        // Records first: slots an expired anonymous allocation (or, with
        // `auto_consume`, a consumed record) frees go to parked requests
        // before their own leases are checked.
        self.expire_records(now, out);
        self.expire_delivered(now, out);
        if now >= self.next_lease_scan {
            self.next_lease_scan = now + lease_scan_period(self.cfg.lease);
            self.expire_leases(now, out);
            self.prune_peers(now, out);
        }
        let dead: Vec<(PeerId, String)> = self
            .tombstones
            .iter()
            .filter(|(_, _, t)| t.until <= now)
            .map(|(p, id, _)| (p.to_vec(), id.to_owned()))
            .collect();
        for (peer, req_id) in dead {
            self.drop_tombstone(&peer, &req_id);
        }
        self.grant_parked(now, out);
    }

    /// Rolls back requests whose lease passed: no batch, `TransferDone` or
    /// (for kvferry peers) `Heartbeat` for a lease. A peer one of whose
    /// admitted requests lapsed is dead: every other request of it ends at
    /// the same time, parked ones included, so they are not admitted one
    /// after another after it died. (A parked request alone has no lease: a
    /// live sender whose requests all wait may be silent for longer than a
    /// lease; the admission timeout bounds it.)
    fn expire_leases(&mut self, now: Instant, out: &mut Vec<Output>) {
        let dead: HashSet<&[u8]> = self
            .requests
            .iter()
            .filter(|(peer, _, r)| {
                let alive = self.peers.get(*peer).map(|p| p.alive_until);
                let deadline = alive.map_or(r.lease_deadline, |a| a.max(r.lease_deadline));
                !matches!(r.phase, Phase::Parked { .. }) && deadline <= now
            })
            .map(|(p, _, _)| p)
            .collect();
        if dead.is_empty() {
            return;
        }
        let expired: Vec<(PeerId, String)> = self
            .requests
            .iter()
            .filter(|(p, _, _)| dead.contains(p))
            .map(|(p, id, _)| (p.to_vec(), id.to_owned()))
            .collect();
        for (peer, req_id) in expired {
            if let Some(r) = self.requests.remove(&peer, &req_id) {
                peer_warn!(self.log, now, req_id = %req_id, "lease expired: no batch, heartbeat or TransferDone; rolling back");
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

    /// Drops expired LMCache reference records, and ends anonymous
    /// allocations past their lifetime: each copy it wrote is detached and
    /// its reference (like each pin's) dropped, so the slot is freed once
    /// no borrow holds it.
    fn expire_records(&mut self, now: Instant, out: &mut Vec<Output>) {
        let mut freed = false;
        while self.done_due.front().is_some_and(|(t, _, _)| *t <= now) {
            let Some((until, peer, req_id)) = self.done_due.pop_front() else {
                break;
            };
            if self
                .done_refs
                .get(&peer, &req_id)
                .is_none_or(|d| d.until != until)
            {
                continue; // cancelled or replaced since
            }
            if let Some(d) = self.done_refs.remove(&peer, &req_id) {
                self.record_bytes -= d.charge;
                if self.cfg.auto_consume {
                    freed |= self.consume_refs(d.held);
                }
            }
        }
        while self.anonymous.front().is_some_and(|a| a.until <= now) {
            let Some(a) = self.anonymous.pop_front() else {
                break;
            };
            self.record_bytes -= a.charge;
            if let Some(p) = self.peers.get_mut(&a.peer) {
                p.anonymous -= 1;
            }
            for (key, gen, wrote) in a.held {
                freed |= self.drop_anonymous_ref(&key, gen, wrote);
            }
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Releases delivered requests nobody took within their lifetime.
    fn expire_delivered(&mut self, now: Instant, out: &mut Vec<Output>) {
        let mut freed = false;
        while self
            .delivered_due
            .front()
            .is_some_and(|(t, _, _)| *t <= now)
        {
            let Some((until, peer, req_id)) = self.delivered_due.pop_front() else {
                break;
            };
            if self
                .delivered
                .get(&peer, &req_id)
                .is_none_or(|d| d.until != Some(until))
            {
                continue; // taken or replaced since
            }
            let Some(d) = self.delivered.remove(&peer, &req_id) else {
                continue;
            };
            self.delivered_bytes -= d.charge;
            self.bump_request("unconsumed_expired");
            peer_warn!(self.log, now, req_id = %req_id, chunks = d.chunks.len(), "unconsumed chunks expired: released");
            for (key, gen, _, _) in d.chunks {
                let u = self.keys.unref_gen(&key, gen);
                freed |= self.release(u);
            }
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Records a request completed with `TransferDone` for
    /// [`ReceiverCore::take`] (not kept when the records are at their
    /// bound: its chunks are then readable by key only).
    fn remember_delivered(&mut self, peer: &[u8], req_id: &str, held: &[Held], now: Instant) {
        if held.is_empty() {
            return;
        }
        let charge = bounds::ended_cost(peer, req_id, held.iter().map(|h| h.key.as_str()));
        if self.delivered_bytes + charge > self.cfg.bounds.max_ended_bytes {
            peer_warn!(self.log, now, req_id, "records of complete requests at their bound: this request's chunks are readable by key only");
            return;
        }
        self.delivered_bytes += charge;
        let until = self.unconsumed_lifetime.map(|l| now + l);
        if let Some(t) = until {
            self.delivered_due
                .push_back((t, peer.to_vec(), req_id.to_owned()));
        }
        let chunks = held
            .iter()
            .map(|h| (h.key.clone(), h.gen, h.len, h.tokens))
            .collect();
        if let Some(old) = self.delivered.insert(
            peer,
            req_id,
            Delivered {
                chunks,
                until,
                charge,
            },
        ) {
            // The peer reused the id of a request nobody took: the older
            // one's chunks stay readable by key.
            self.delivered_bytes -= old.charge;
        }
    }

    /// Forgets peers with nothing left in the core (no request, record or
    /// anonymous allocation) that were silent for a lease. A kvferry peer
    /// is remembered (a hash, in a bounded set) so that its next request
    /// keeps kvferry semantics without a new `Hello`.
    fn prune_peers(&mut self, now: Instant, out: &mut Vec<Output>) {
        let lease = self.cfg.lease;
        for (_, id) in self.empty_peers(|p| p.last_seen + lease <= now) {
            if self.forget_peer_state(&id) {
                debug!("peer state pruned: nothing left, silent for a lease");
                out.push(Output::ForgetPeer { peer: id });
            }
        }
    }

    /// Peers with nothing left in the core (no request, record or
    /// anonymous allocation) that satisfy `pick`, with when each was last
    /// seen.
    fn empty_peers(&self, pick: impl Fn(&PeerState) -> bool) -> Vec<(Instant, PeerId)> {
        let busy: HashSet<&[u8]> = self
            .requests
            .iter()
            .map(|(p, _, _)| p)
            .chain(self.tombstones.iter().map(|(p, _, _)| p))
            .chain(self.done_refs.iter().map(|(p, _, _)| p))
            .collect();
        self.peers
            .iter()
            .filter(|(id, p)| p.anonymous == 0 && pick(p) && !busy.contains(id.as_slice()))
            .map(|(id, p)| (p.last_seen, id.clone()))
            .collect()
    }

    /// Drops the state of a peer with nothing left (see
    /// [`ReceiverCore::prune_peers`]); false if it had none.
    fn forget_peer_state(&mut self, id: &[u8]) -> bool {
        let Some(p) = self.peers.remove(id) else {
            return false;
        };
        self.peer_bytes -= p.charge;
        if p.extended() {
            self.pruned_hello.insert(id);
        }
        true
    }

    /// Per-peer state is at its bound and a new peer needs `need` bytes:
    /// forgets peers holding nothing, least recently seen first, until the
    /// new one fits with an eighth of the bound to spare (so a stream of
    /// new peers pays this scan once per many of them). Forgetting an
    /// empty peer is what pruning does a lease later: a kvferry peer keeps
    /// its semantics (and its data-plane secret) without a new `Hello`. So
    /// idle peers, heartbeating or not, cannot lock new peers out; only
    /// peers holding requests or records fill the bound, and those are
    /// bounded by the capacity and the record bound. A scan that frees
    /// nothing is not repeated for [`EVICT_RETRY`], so peers refused one
    /// after another cost O(1) each.
    fn evict_empty_peers(&mut self, need: usize, now: Instant) {
        if now < self.next_evict_scan {
            return;
        }
        let bound = self.cfg.bounds.max_peer_bytes;
        let target = bound.saturating_sub(need).saturating_sub(bound / 8);
        let mut idle = self.empty_peers(|_| true);
        idle.sort_unstable();
        for (_, id) in idle {
            if self.peer_bytes <= target {
                break;
            }
            if self.forget_peer_state(&id) {
                self.evicted_peers.push(id);
            }
        }
        if self.evicted_peers.is_empty() {
            self.next_evict_scan = now + EVICT_RETRY;
        } else {
            peer_warn!(
                self.log,
                now,
                forgotten = self.evicted_peers.len(),
                "per-peer state at its bound: forgot the least recently seen peers holding nothing"
            );
        }
    }

    /// The earliest instant at which [`ReceiverCore::tick`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next = self.queue.next_deadline();
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        // Leases, records and idle peers are scanned while any exist; with
        // nothing left there is no deadline and the ctrl thread sleeps.
        if !self.requests.is_empty() || !self.peers.is_empty() {
            consider(self.next_lease_scan);
        }
        for t in self.tombstones.values() {
            consider(t.until);
        }
        if let Some((t, _, _)) = self.done_due.front() {
            consider(*t);
        }
        if let Some(a) = self.anonymous.front() {
            consider(a.until);
        }
        if let Some((t, _, _)) = self.delivered_due.front() {
            consider(*t);
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

    /// Borrows every chunk of the complete request `req_id`, in key order
    /// (the order its batches named them), each as a claim on the
    /// request's own reference; end each with [`ReceiverCore::end_borrow`].
    /// Only requests completed with `TransferDone` are taken (their bytes
    /// are known to be in place); a request is taken at most once.
    ///
    /// Requests are the peer's: when several peers completed a request of
    /// this id and none was taken yet, this is [`TakeError::Ambiguous`].
    /// When a chunk was consumed by key meanwhile, [`TakeError::Consumed`]:
    /// nothing is borrowed and the request is readable by key only.
    pub fn take(&mut self, req_id: &str) -> Result<Vec<TakenChunk>, TakeError> {
        let peers: Vec<PeerId> = self
            .delivered
            .peers_of(req_id)
            .map(<[u8]>::to_vec)
            .collect();
        let peer = match peers.as_slice() {
            [] => return Err(TakeError::NotReady(req_id.to_owned())),
            [one] => one,
            more => {
                return Err(TakeError::Ambiguous {
                    req_id: req_id.to_owned(),
                    peers: more.len(),
                })
            }
        };
        let Some(d) = self.delivered.remove(peer, req_id) else {
            return Err(TakeError::NotReady(req_id.to_owned()));
        };
        self.delivered_bytes -= d.charge;
        let mut taken = Vec::with_capacity(d.chunks.len());
        for (key, gen, len, tokens) in d.chunks {
            match self.keys.borrow_gen(&key, gen) {
                Some(b) => taken.push(TakenChunk {
                    key,
                    gen,
                    slot: b.slot,
                    len,
                    tokens,
                }),
                None => {
                    for t in &taken {
                        self.keys.unborrow(&t.key, t.gen);
                    }
                    return Err(TakeError::Consumed {
                        req_id: req_id.to_owned(),
                        key,
                    });
                }
            }
        }
        Ok(taken)
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
        s.peers = self.peers.len();
        s.parked_bytes = self.parked_bytes;
        s.record_bytes = self.record_bytes;
        s.peer_bytes = self.peer_bytes;
        s.anonymous_allocations = self.anonymous.len();
        s
    }

    // ----- message handlers -------------------------------------------------

    /// The `HelloAck` for `h`, or the code and reason of a failure reply:
    /// `overloaded` when per-peer state is at its bound, `peer_unavailable`
    /// when the acceptor could not set up the data plane `h` asked for.
    fn on_hello(
        &mut self,
        peer: &[u8],
        h: &Hello,
        now: Instant,
    ) -> Result<HelloAck, (ErrorCode, String)> {
        debug!(sender_id = %h.sender_id, version = h.version, transport = %h.transport, "hello");
        let p = self
            .peer_state(peer, now)
            .map_err(|m| (ErrorCode::Overloaded, m))?;
        let charge = bounds::peer_cost(peer, &h.sender_id);
        let old = std::mem::replace(&mut p.charge, charge);
        p.hello = Some(h.sender_id.clone());
        self.peer_bytes = self.peer_bytes - old + charge;
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
                    && self
                        .peers
                        .get(*k)
                        .is_some_and(|p| p.hello.as_deref() == Some(h.sender_id.as_str()))
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
                    let msg = format!(
                        "receiver {} cannot set up the {kind} data plane: {e}",
                        self.cfg.receiver_id
                    );
                    (ErrorCode::PeerUnavailable, msg)
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
        // A TCP sender gets its own secret for its data connections (a new
        // Hello replaces it); any other transport needs none.
        let descriptor = match descriptor {
            Descriptor::Tcp { addr, .. } => {
                let (_, secret) = self.data_keys.issue(peer);
                Descriptor::Tcp {
                    addr,
                    secret: Some(crate::transport::tcp::wire::encode_secret(&secret)),
                }
            }
            other => {
                self.data_keys.forget(peer);
                other
            }
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

    /// Per-peer state of `peer`, created (and charged) if it has none;
    /// `Err` with the reason when per-peer state is at its bound.
    fn peer_state(&mut self, peer: &[u8], now: Instant) -> Result<&mut PeerState, String> {
        if !self.peers.contains_key(peer) {
            let charge = bounds::peer_cost(peer, "");
            if self.peer_bytes + charge > self.cfg.bounds.max_peer_bytes {
                self.evict_empty_peers(charge, now);
            }
            if self.peer_bytes + charge > self.cfg.bounds.max_peer_bytes {
                return Err(format!(
                    "receiver overloaded: per-peer state holds {} bytes (bound {}); retry later",
                    self.peer_bytes, self.cfg.bounds.max_peer_bytes
                ));
            }
            self.peer_bytes += charge;
            let hello = self.pruned_hello.take(peer).then(String::new);
            self.peers.insert(
                peer.to_vec(),
                PeerState {
                    hello,
                    alive_until: now,
                    last_seen: now,
                    parked_bytes: 0,
                    anonymous: 0,
                    charge,
                },
            );
        }
        self.peers
            .get_mut(peer)
            .ok_or_else(|| unreachable!("inserted above"))
    }

    fn on_alloc(&mut self, peer: &[u8], req: AllocRequest, now: Instant, out: &mut Vec<Output>) {
        if req.req_id.is_empty() {
            return self.on_anonymous(peer, req, now, out);
        }
        if let Some(t) = self.tombstones.get(peer, &req.req_id) {
            let code = t.code;
            let msg = format!(
                "request {} already ended with {}",
                req.req_id,
                code.as_str()
            );
            return self.fail_reply(peer, req.keys.len(), req.seq, code, msg, out);
        }
        let req_id = req.req_id.clone();
        match self.requests.get_mut(peer, &req_id) {
            Some(r) => match &mut r.phase {
                Phase::Parked {
                    backlog, charge, ..
                } => {
                    let cost = bounds::batch_cost(&req);
                    let peer_parked = self.peers.get(peer).map_or(0, |p| p.parked_bytes);
                    let b = &self.cfg.bounds;
                    if self.parked_bytes + cost > b.max_parked_bytes
                        || peer_parked + cost > b.max_peer_parked_bytes
                    {
                        let msg = format!(
                            "receiver overloaded: request {req_id} is parked and its queued batches reached the bound ({} bytes parked in all, {peer_parked} by this peer; bounds {} and {}); the request is rolled back",
                            self.parked_bytes, b.max_parked_bytes, b.max_peer_parked_bytes
                        );
                        self.bump_request("overloaded");
                        return self.fail_request(
                            &req_id,
                            peer,
                            &req,
                            ErrorCode::Overloaded,
                            msg,
                            now,
                            out,
                        );
                    }
                    *charge += cost;
                    backlog.push_back(req);
                    self.charge_parked(peer, cost as isize);
                }
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
        let extended = match self.peer_state(peer, now) {
            Ok(p) => p.extended(),
            Err(msg) => {
                self.bump_request("overloaded");
                return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
            }
        };
        let req_id = req.req_id.clone();
        let key = (peer.to_vec(), req_id.clone());
        match self
            .queue
            .admit_or_park(&self.ledger, key.clone(), total, deadline)
        {
            Ok(Some(reservation)) => {
                self.bump_request("admitted");
                self.admission_waits.push(Duration::ZERO);
                self.requests.insert(
                    peer,
                    &req_id,
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
                let charge = bounds::request_cost(peer, &req_id) + bounds::batch_cost(&req);
                let peer_parked = self.peers.get(peer).map_or(0, |p| p.parked_bytes);
                let b = &self.cfg.bounds;
                if self.parked_bytes + charge > b.max_parked_bytes
                    || peer_parked + charge > b.max_peer_parked_bytes
                {
                    self.queue.remove(&key);
                    let msg = format!(
                        "receiver overloaded: request {req_id} does not fit now and parked requests hold {} bytes ({peer_parked} of this peer; bounds {} and {}); retry later",
                        self.parked_bytes, b.max_parked_bytes, b.max_peer_parked_bytes
                    );
                    self.bump_request("overloaded");
                    return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
                }
                debug!(req_id = %req_id, total, "parked: does not fit yet");
                self.bump_request("parked");
                self.charge_parked(peer, charge as isize);
                let mut backlog = VecDeque::new();
                backlog.push_back(req);
                self.requests.insert(
                    peer,
                    &req_id,
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
                            charge,
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
        let Some(mut r) = self.requests.remove(peer, &req_id) else {
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
            self.requests.insert(peer, &req_id, r);
            return self.fail_request(&req_id, peer, &req, code, msg, now, out);
        }
        let Phase::Admitted { reservation } = &mut r.phase else {
            // Only admitted requests reach here (callers check the phase).
            self.requests.insert(peer, &req_id, r);
            return;
        };
        let mut remote = Vec::with_capacity(n);
        let mut already = Vec::new();
        let first_new = r.held.len();
        let mut failure = None;
        let full = req.chunk_bytes().unwrap_or(0);
        for (i, key) in req.keys.iter().enumerate() {
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            let len = chunk_len(&req, full, i + 1 == n);
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
                    len,
                    tokens,
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
            if let Some(token) = self.data_keys.token_of(peer) {
                self.grants.grant(slot, token);
            }
            // A new key, or one whose copies are all still being written:
            // this request writes its own copy (its reservation counts it).
            let gen = self.keys.insert_new(key, slot, !r.extended, tokens);
            self.keys.set_len(key, gen, len);
            r.held.push(Held {
                key: key.clone(),
                gen,
                wrote: true,
                granted: false,
                len,
                tokens,
            });
            remote.push(i64::from(slot));
        }
        if let Some(msg) = failure {
            self.requests.insert(peer, &req_id, r);
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
                self.requests.insert(peer, &req_id, r);
            } else {
                // LMCache semantics: tracking ends with the last batch; the
                // keys stay for the decoder, which learns of them from the
                // proxy. What the request holds is remembered for a lease,
                // so the peer's own late CancelNotif releases exactly that.
                self.remember_done_refs(peer, &req_id, r.held, now);
                self.bump_request("completed");
                out.push(Output::Finished {
                    req_id,
                    outcome: Outcome::Ready,
                });
            }
        } else {
            self.requests.insert(peer, &req_id, r);
        }
    }

    /// Records an LMCache request's references for its late `CancelNotif`
    /// (not kept when the records are at their bound: the cancel then
    /// releases nothing and the decoder consumes the keys as usual).
    fn remember_done_refs(&mut self, peer: &[u8], req_id: &str, held: Vec<Held>, now: Instant) {
        let held: Vec<(String, u64)> = held.into_iter().map(|h| (h.key, h.gen)).collect();
        let charge = bounds::ended_cost(peer, req_id, held.iter().map(|(k, _)| k.as_str()));
        if self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            if self.cfg.auto_consume {
                // A counting decoder must still take these, or they leak.
                peer_warn!(self.log, now, req_id, "ended-request records at their bound: consuming this request's chunks without the grace");
                self.consume_refs(held);
            } else {
                peer_warn!(self.log, now, req_id, "ended-request records at their bound: a later cancel of this request will release nothing");
            }
            return;
        }
        self.record_bytes += charge;
        // Kept for the peer's late cancel for a lease; with `auto_consume`,
        // until the grace after which the chunks count as delivered (an
        // LMCache sender's writes cannot be observed; it sends no
        // TransferDone) and are released.
        let until = now
            + if self.cfg.auto_consume {
                self.cfg.consume_grace
            } else {
                self.cfg.lease
            };
        self.done_due
            .push_back((until, peer.to_vec(), req_id.to_owned()));
        if let Some(old) = self.done_refs.insert(
            peer,
            req_id,
            DoneRefs {
                held,
                until,
                charge,
            },
        ) {
            self.record_bytes -= old.charge;
        }
    }

    /// Drops one reference of each copy in `held` (a consuming decoder's
    /// release); true if capacity was freed.
    fn consume_refs(&mut self, held: Vec<(String, u64)>) -> bool {
        let mut freed = false;
        for (key, gen) in held {
            let u = self.keys.unref_gen(&key, gen);
            freed |= self.release(u);
        }
        freed
    }

    /// How long an anonymous allocation is kept: its lifetime, or with
    /// `auto_consume` the consume grace if shorter (no TransferDone comes
    /// for it either).
    fn anonymous_lifetime(&self) -> Duration {
        let life = self.cfg.bounds.anonymous_lifetime;
        if self.cfg.auto_consume {
            life.min(self.cfg.consume_grace)
        } else {
            life
        }
    }

    /// Adds `delta` bytes to what `peer`'s parked requests are charged.
    fn charge_parked(&mut self, peer: &[u8], delta: isize) {
        self.parked_bytes = self.parked_bytes.saturating_add_signed(delta);
        if let Some(p) = self.peers.get_mut(peer) {
            p.parked_bytes = p.parked_bytes.saturating_add_signed(delta);
        }
    }

    /// Allocation for `req_id == ""`: no admission wait, no tracking, but the
    /// chunks are still counted in the ledger so admitted requests keep their
    /// guarantee.
    ///
    /// Anonymous allocations have no owner request that a lease could
    /// cover, so each gets a lifetime ([`Bounds::anonymous_lifetime`]) and
    /// its record is charged against the record bound; they are refused
    /// (`protocol_violation`) when [`Bounds::allow_anonymous`] is off.
    fn on_anonymous(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let n = req.keys.len();
        if !self.cfg.bounds.allow_anonymous {
            let msg = "anonymous allocations (req_id \"\") are disabled on this receiver: send a req_id and total_chunks".to_owned();
            return self.fail_reply(peer, n, req.seq, ErrorCode::ProtocolViolation, msg, out);
        }
        if let Err((code, msg)) = self.check_batch_shape(&req) {
            return self.fail_reply(peer, n, req.seq, code, msg, out);
        }
        let charge = bounds::ended_cost(peer, "", req.keys.iter().map(String::as_str));
        if self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            let msg = format!(
                "receiver overloaded: anonymous allocations and ended-request records hold {} bytes (bound {}); retry later",
                self.record_bytes, self.cfg.bounds.max_ended_bytes
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
        }
        if let Err(msg) = self.peer_state(peer, now) {
            return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
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
        let mut held = Vec::with_capacity(n);
        let full = req.chunk_bytes().unwrap_or(0);
        for (i, key) in req.keys.iter().enumerate() {
            if let Some((_, gen)) = self.keys.pin(key) {
                // Written already: no slot to write (see `process_batch`).
                already.push(i as i64);
                held.push((key.clone(), gen, false));
                continue;
            }
            let slot = match (reservation.allocate(1), self.slots.try_alloc(1)) {
                (Ok(()), Some(set)) => set.as_slice()[0],
                (ok, _) => {
                    if ok.is_ok() {
                        self.ledger.free(1);
                    }
                    peer_warn!(
                        self.log,
                        now,
                        "anonymous allocation found no slot although reserved"
                    );
                    remote.push(-1);
                    continue;
                }
            };
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            let gen = self.keys.insert_new(key, slot, true, tokens);
            self.keys
                .set_len(key, gen, chunk_len(&req, full, i + 1 == n));
            held.push((key.clone(), gen, true));
            remote.push(i64::from(slot));
        }
        drop(reservation);
        if !held.is_empty() {
            self.record_bytes += charge;
            if let Some(p) = self.peers.get_mut(peer) {
                p.anonymous += 1;
            }
            self.anonymous.push_back(Anonymous {
                peer: peer.to_vec(),
                held,
                until: now + self.anonymous_lifetime(),
                charge,
            });
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
        // Everything below is looked up under (peer, req_id): a cancel only
        // ever touches the canceller's own requests.
        let fenced = self.peers.get(peer).is_some_and(PeerState::extended);
        if let Some(r) = self.requests.remove(peer, &c.req_id) {
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
                self.drop_tombstone(peer, &c.req_id);
            }
        } else if self.tombstones.contains(peer, &c.req_id) {
            // The fence for a request the receiver already failed: the
            // sender's in-flight writes are done, quarantined slots are safe.
            if fenced {
                self.drop_tombstone(peer, &c.req_id);
            }
        } else if let Some(d) = self.done_refs.remove(peer, &c.req_id) {
            // An LMCache sender cancelling a request whose tracking already
            // ended: release the references that request held (the keys the
            // message lists are not trusted).
            self.record_bytes -= d.charge;
            let mut freed = false;
            for (key, gen) in d.held {
                let u = self.keys.unref_gen(&key, gen);
                freed |= self.release(u);
            }
            if freed {
                self.grant_parked(now, out);
            }
        } else if c.req_id.is_empty() {
            self.cancel_anonymous(peer, &c.keys, now, out);
        } else if self.requests.owned_by_other(peer, &c.req_id)
            || self.tombstones.owned_by_other(peer, &c.req_id)
            || self.done_refs.owned_by_other(peer, &c.req_id)
        {
            peer_warn!(self.log, now, req_id = %c.req_id, "CancelNotif for another peer's request: ignored");
            let msg = format!(
                "request {} belongs to another peer: this cancel changed nothing",
                c.req_id
            );
            return self.fail_reply(peer, c.keys.len(), c.seq, ErrorCode::NotOwner, msg, out);
        }
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(Vec::new(), Vec::new(), c.seq)),
        });
    }

    /// A cancel of anonymous allocations: releases the listed keys'
    /// references held by `peer`'s own anonymous allocations (one per
    /// listed key), nobody else's.
    fn cancel_anonymous(
        &mut self,
        peer: &[u8],
        keys: &[String],
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if self.peers.get(peer).is_none_or(|p| p.anonymous == 0) {
            return;
        }
        let mut wanted: HashMap<&str, usize> = HashMap::new();
        for k in keys {
            *wanted.entry(k.as_str()).or_default() += 1;
        }
        let mut released = Vec::new();
        for a in self.anonymous.iter_mut().filter(|a| a.peer == peer) {
            a.held
                .retain(|(key, gen, wrote)| match wanted.get_mut(key.as_str()) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        released.push((key.clone(), *gen, *wrote));
                        false
                    }
                    _ => true,
                });
        }
        let mut freed = false;
        for (key, gen, wrote) in released {
            freed |= self.drop_anonymous_ref(&key, gen, wrote);
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Removes `peer`'s tombstone of `req_id` and ends the quarantine of
    /// the copies it kept; each slot is freed unless a reference still
    /// holds it.
    fn drop_tombstone(&mut self, peer: &[u8], req_id: &str) {
        if let Some(t) = self.tombstones.remove(peer, req_id) {
            self.record_bytes -= t.charge;
            for (key, gen) in t.quarantined {
                let u = self.keys.unquarantine(&key, gen);
                self.release(u);
            }
        }
    }

    fn on_transfer_done(&mut self, peer: &[u8], req_id: &str, now: Instant, out: &mut Vec<Output>) {
        match self.requests.get(peer, req_id).map(|r| &r.phase) {
            Some(Phase::AwaitingDone) => {
                if !self.seal_grants(peer, req_id) {
                    let msg = format!(
                        "TransferDone for request {req_id} while a write into it is still landing"
                    );
                    peer_warn!(self.log, now, req_id, "{msg}");
                    if let Some(r) = self.requests.remove(peer, req_id) {
                        self.bump_request("failed");
                        self.bump_error(ErrorCode::ProtocolViolation);
                        self.finish_failed(
                            req_id,
                            r,
                            ErrorCode::ProtocolViolation,
                            Cause::Unfenced,
                            now,
                            out,
                        );
                    }
                    return;
                }
                if let Some(r) = self.requests.remove(peer, req_id) {
                    // The copies this request wrote are now in place: from
                    // here on, later requests are told "already sent".
                    for h in r.held.iter().filter(|h| h.wrote) {
                        self.keys.mark_ready(&h.key, h.gen);
                    }
                    if !self.cfg.auto_consume {
                        self.remember_delivered(peer, req_id, &r.held, now);
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
                peer_warn!(
                    self.log,
                    now,
                    req_id,
                    "TransferDone before the request's last batch; ignored"
                );
                self.bump_error(ErrorCode::ProtocolViolation);
            }
            None if self.requests.owned_by_other(peer, req_id) => {
                peer_warn!(
                    self.log,
                    now,
                    req_id,
                    "TransferDone for another peer's request; ignored"
                );
                self.bump_error(ErrorCode::NotOwner);
            }
            None => debug!(req_id, "TransferDone for an unknown request; ignored"),
        }
    }

    /// Ends the TCP write grants of the slots the request `(peer, req_id)`
    /// wrote (it completed); false if a write is landing in one of them
    /// right now.
    fn seal_grants(&self, peer: &[u8], req_id: &str) -> bool {
        let Some(r) = self.requests.get(peer, req_id) else {
            return true;
        };
        let mut all = true;
        for h in r.held.iter().filter(|h| h.wrote) {
            if let Some(e) = self.keys.get_gen(&h.key, h.gen) {
                all &= self.grants.seal(e.slot);
            }
        }
        all
    }

    /// O(1): moves the peer's liveness; its requests' leases follow it (see
    /// [`ReceiverCore::tick`]). Only a peer that said Hello heartbeats, and
    /// a heartbeat naming a sender id other than its own renews nothing.
    fn on_heartbeat(&mut self, peer: &[u8], sender_id: &str, now: Instant) {
        let lease = self.cfg.lease;
        let Some(p) = self.peers.get_mut(peer) else {
            return debug!("Heartbeat from a peer without state; ignored");
        };
        match p.hello.as_deref() {
            // A pruned-and-revived peer's sender id is not known again.
            Some(id) if id == sender_id || id.is_empty() => p.alive_until = now + lease,
            Some(_) => {
                peer_warn!(
                    self.log,
                    now,
                    sender_id,
                    "Heartbeat naming another sender; ignored"
                );
                self.bump_error(ErrorCode::NotOwner);
            }
            None => debug!("Heartbeat from a peer that did not say Hello; ignored"),
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
        peer_warn!(self.log, now, req_id, code = code.as_str(), "{msg}");
        if let Some(r) = self.requests.remove(peer, req_id) {
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
            Phase::Parked {
                backlog, charge, ..
            } => {
                self.queue.remove(&(r.peer.clone(), req_id.to_owned()));
                self.charge_parked(&r.peer, -(charge as isize));
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
        let charge =
            bounds::ended_cost(&r.peer, req_id, quarantined.iter().map(|(k, _)| k.as_str()));
        // A tombstone that quarantines nothing only answers late batches;
        // past the record bound it is not kept (a late batch then starts a
        // new request of the same peer, which its lease bounds). One that
        // quarantines is always kept: the slots bound those.
        if quarantined.is_empty() && self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            peer_warn!(
                self.log,
                now,
                req_id,
                "ended-request records at their bound: no tombstone kept"
            );
        } else {
            self.record_bytes += charge;
            if let Some(old) = self.tombstones.insert(
                &r.peer,
                req_id,
                Tombstone {
                    code,
                    quarantined,
                    until,
                    charge,
                },
            ) {
                // Cannot happen (a request and its tombstone never coexist),
                // but never leak a quarantine.
                self.record_bytes -= old.charge;
                for (key, gen) in old.quarantined {
                    let u = self.keys.unquarantine(&key, gen);
                    self.release(u);
                }
            }
        }
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
            for ((peer, req_id), reservation) in granted {
                let Some(r) = self.requests.get_mut(&peer, &req_id) else {
                    continue;
                };
                let phase = std::mem::replace(&mut r.phase, Phase::Admitted { reservation });
                let Phase::Parked {
                    backlog,
                    since,
                    charge,
                } = phase
                else {
                    continue;
                };
                r.lease_deadline = now + self.cfg.lease;
                self.charge_parked(&peer, -(charge as isize));
                self.admission_waits
                    .push(now.saturating_duration_since(since));
                self.bump_request("admitted");
                debug!(req_id = %req_id, waited_us = now.saturating_duration_since(since).as_micros() as u64, "admitted after parking");
                for b in backlog {
                    match self.requests.get(&peer, &req_id).map(|r| &r.phase) {
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
                                .get(&peer, &req_id)
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
    /// Drops one reference an anonymous allocation held (`wrote`: its chunk
    /// was written, so the key goes with it, unquarantined); true if a slot
    /// was freed.
    fn drop_anonymous_ref(&mut self, key: &str, gen: u64, wrote: bool) -> bool {
        let u = if wrote {
            self.keys.evict(key, gen, false)
        } else {
            self.keys.unref_gen(key, gen)
        };
        self.release(u)
    }

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
        if self.grants.revoke(slot) == Revoked::Deferred {
            // A TCP read is landing in it: the data thread hands it back
            // (`free_deferred`) once that read returned.
            return;
        }
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
/// Bytes of a chunk of `req`'s batch whose full chunk is `full` bytes
/// (`req.chunk_bytes()`): `full`, except the batch's last chunk when the
/// shape is one-dimensional — `[tokens]`, kvferry's byte-shaped default —
/// which is `last_chunk_toks` of them. (For a multi-dimensional shape the
/// token axis depends on `fmt`, which the receiver does not interpret: a
/// short last chunk is reported whole, with its token count.)
fn chunk_len(req: &AllocRequest, full: u64, last: bool) -> u64 {
    match req.shape.as_slice() {
        [tokens] if last && *tokens > 0 => {
            let toks = req.last_chunk_toks.clamp(0, *tokens) as u64;
            full / *tokens as u64 * toks
        }
        _ => full,
    }
}

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

/// Hashes of kvferry peers (they said Hello) whose state was pruned, so a
/// peer that was only idle keeps kvferry semantics (TransferDone, fenced
/// cancel) on its next request without a new `Hello`. Bounded: the oldest
/// of [`PrunedPeers::CAPACITY`] hashes (8 bytes each) is forgotten first.
/// The hasher is seeded per process, so a peer cannot aim at a collision.
#[derive(Debug, Default)]
struct PrunedPeers {
    hasher: std::collections::hash_map::RandomState,
    set: HashSet<u64>,
    order: VecDeque<u64>,
}

impl PrunedPeers {
    const CAPACITY: usize = 1 << 16;

    fn hash(&self, peer: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(peer)
    }

    fn insert(&mut self, peer: &[u8]) {
        let h = self.hash(peer);
        if self.set.insert(h) {
            self.order.push_back(h);
            while self.order.len() > Self::CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }

    /// True (and forgotten) if `peer` was a pruned kvferry peer.
    fn take(&mut self, peer: &[u8]) -> bool {
        let h = self.hash(peer);
        // The order entry stays until it ages out; `set` is the truth.
        self.set.remove(&h)
    }
}
