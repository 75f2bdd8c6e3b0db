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
//!   semantics), and of the asking length. A key held but still being
//!   written, or only at another length, gets a fresh slot: the new request
//!   writes its own, independent copy (its reservation already counts the
//!   chunk).
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
//!
//! [`Bounds`]: crate::control::receiver::bounds::Bounds

mod alloc;
mod anonymous;
mod counters;
mod decoder;
mod end;
mod expiry;
mod fail;
mod parked;
mod peers;
mod release;
mod types;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tracing::debug;

use crate::log_budget::LogBudget;

use crate::ledger::{AdmissionQueue, Ledger, Reservation};
use crate::protocol::{AllocRequest, Descriptor, ErrorCode, Message, ReplyHints};
use crate::slots::SlotAllocator;

use super::acceptor::HelloAcceptor;
use super::grants::{DataKeys, GrantTable, Secret, Token};
use super::keys::KeyTable;
use super::owned::ByRequest;

use self::expiry::lease_scan_period;
use self::peers::PrunedPeers;

pub use self::decoder::{TakeError, TakenChunk};
#[cfg(test)]
pub(crate) use self::peers::identity_stem;
pub use self::types::{CoreConfig, CoreStats, Outcome, Output};
pub use super::owned::PeerId;

/// A request's key in the admission queue: (owner, `req_id`).
type ReqKey = (PeerId, String);

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
    ///
    /// [`chunk_len`]: alloc::chunk_len
    len: u64,
    /// Token count of a batch's last chunk.
    tokens: Option<u32>,
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

impl Request {
    /// A request of `peer` for `total` chunks, nothing seen or held yet,
    /// its lease running from now, in `phase`.
    fn new(
        peer: &[u8],
        extended: bool,
        total: usize,
        lease_deadline: Instant,
        phase: Phase,
    ) -> Self {
        Self {
            peer: peer.to_vec(),
            extended,
            total,
            seen: 0,
            held: Vec::new(),
            lease_deadline,
            phase,
        }
    }
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
    /// The same-host control endpoint a shm `HelloAck` offers
    /// ([`with_control`](Self::with_control)).
    control: Option<String>,
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
            control: None,
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

    /// Offers `endpoint` (an absolute `ipc://` one of this receiver's
    /// socket) in every `HelloAck` that answers with the shm data plane:
    /// a sender that can open the buffer file is on this host and may move
    /// its control messages there (`HelloAck::control`). Default: none.
    pub fn with_control(mut self, endpoint: Option<String>) -> Self {
        self.control = endpoint;
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
}
