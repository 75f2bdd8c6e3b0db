//! The core's public types: its configuration, what a step asks of the
//! control thread, how a request ended, and the counters.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::protocol::{Descriptor, ErrorCode, Message};

use super::super::bounds::Bounds;
use super::PeerId;

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
