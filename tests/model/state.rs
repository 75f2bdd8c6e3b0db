//! The model's state: senders (request table, staging, pending area, peer
//! queues), the network channels, the receiver's input log, in-flight
//! writes, the decoder and the proxy, plus ground truth about receiver slots
//! that the safety properties check the protocol against.

use std::collections::VecDeque;

use kvferry::protocol::AllocResponse;
use kvferry::sender::core::{InOrder, Phase, Progress, Stored, Turn};
use kvferry::ErrorCode;

use super::config::Cfg;
use super::rx::{RxIn, RxView, Wire};

/// How a request ended on the sender (`RequestStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Every chunk written, ProxyNotif sent.
    Completed,
    /// Cancelled by the caller.
    Cancelled,
    /// Refused by the receiver.
    Failed,
}

impl kvferry::sender::core::Status for Status {
    fn failed(_: ErrorCode, _: String) -> Self {
        Status::Failed
    }
}

/// A request's lifecycle: the real core's `Phase`.
pub type RState = Phase<Status>;

/// Where a batch's bytes are (`BatchData`), in chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Data {
    /// Not stored yet, released, or handed to a posted write.
    Gone,
    /// In the pending area.
    Pending(u8),
    /// In staging slots.
    Staged(u8),
}

/// One batch on the sender.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SBatch {
    /// Its bytes.
    pub data: Data,
    /// After the reply: `(key, receiver slot)` of each chunk to write.
    pub writes: Vec<(u8, u8)>,
}

/// One request on the sender: the real core's protocol state
/// (`Progress`, batch ids = batch indexes) plus what the caller side and the
/// model's bookkeeping need.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SReq {
    /// The sender core's state of the request.
    pub p: Progress<Status>,
    /// What the caller stored (the shell's atomic count, `count.rs`).
    pub count: Stored,
    /// `store` was called at least once (the table has an entry).
    pub registered: bool,
    /// Batches the caller finished storing.
    pub stored: u8,
    /// Batches whose AllocRequest was sent (`keys_sent`).
    pub sent: u8,
    pub batches: Vec<SBatch>,
}

/// What an unanswered message was (`Outstanding` of src/control/sender/peer.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Out {
    /// AllocRequest of `(req, batch)`.
    Batch(u8, u8),
    /// CancelNotif of `req`.
    Cancel(u8),
}

/// One sender: its caller thread, staging, pending area and its peer state
/// for the (single) receiver.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Snd {
    pub staging_free: u8,
    pub pending_used: u8,
    /// The caller thread is blocked in the staging allocation of the next
    /// batch of this request.
    pub blocked_on: Option<u8>,
    /// One-outstanding mode: the unanswered message and the ones queued
    /// behind it (the core's `InOrder`, as `Peer::in_order`).
    pub out: InOrder<Out, Wire, ()>,
    /// One-request-at-a-time mode: the request being transferred (the
    /// core's `Turn`).
    pub turn: Turn<u8>,
}

/// An AllocResponse on the wire (receiver → sender).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reply {
    pub seq: Option<u64>,
    pub remote: Vec<i64>,
    pub already: Vec<i64>,
    pub failed: bool,
}

impl Reply {
    /// The `AllocResponse` it stands for (what the sender core reads).
    pub fn to_response(&self) -> AllocResponse {
        if self.failed {
            AllocResponse::failure(
                self.remote.len().max(1),
                self.seq,
                ErrorCode::AllocationFailed,
                "refused",
            )
        } else {
            AllocResponse::ok(self.remote.clone(), self.already.clone(), self.seq)
        }
    }
}

/// A write posted to the transport (one op per batch: the batch's chunks
/// are contiguous in staging and in the receiver, so the engine coalesces
/// them into one `WriteOp`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Write {
    pub req: u8,
    pub batch: u8,
    /// `(key, receiver slot)`; staging slots held = its length.
    pub chunks: Vec<(u8, u8)>,
}

/// Violation flags recorded by transitions (each one a safety property).
pub mod viol {
    /// A slot was granted to a new writer while a request still held it.
    pub const SLOT_SHARED: u16 = 1 << 0;
    /// A write landed in a slot its request does not own.
    pub const UNFENCED_WRITE: u16 = 1 << 1;
    /// A second ProxyNotif for one request.
    pub const NOTIFY_TWICE: u16 = 1 << 2;
    /// ProxyNotif while a chunk of the request was not in place.
    pub const NOTIFY_EARLY: u16 = 1 << 3;
    /// The decoder read a slot whose bytes are not the key's.
    pub const READ_UNLANDED: u16 = 1 << 4;
    /// The decoder could not borrow a key of a request reported ready.
    pub const DECODER_MISS: u16 = 1 << 5;
    /// Ledger: committed > capacity.
    pub const OVERCOMMIT: u16 = 1 << 6;
    /// Sender accounting under/overflow (a model or engine bug).
    pub const ACCOUNTING: u16 = 1 << 7;
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Every input the receiver got, in order (the receiver's state).
    pub log: Vec<RxIn>,
    /// The receiver's accounting after the last input (derived from `log`).
    pub rx: RxView,
    /// Receiver outcome per request: `Some(true)` Ready, `Some(false)` failed.
    pub rx_outcome: Vec<Option<bool>>,
    /// Sender → receiver channel per sender (FIFO: one ZMQ DEALER/ROUTER pair).
    pub to_rx: Vec<VecDeque<Wire>>,
    /// Receiver → sender channel per sender (FIFO).
    pub to_tx: Vec<VecDeque<Reply>>,
    pub snd: Vec<Snd>,
    pub reqs: Vec<SReq>,
    /// Posted writes, kept sorted (a multiset: completions in any order).
    pub writes: Vec<Write>,
    /// Keys of each request the decoder consumed (in key order).
    pub consumed: Vec<u8>,
    /// ProxyNotifs the proxy received per request.
    pub proxy: Vec<u8>,
    /// Ground truth, per receiver slot: requests holding it (bit per request).
    pub slot_hold: Vec<u8>,
    /// Ground truth: the key the slot was last granted to (for writing).
    pub slot_key: Vec<Option<u8>>,
    /// Ground truth: whose bytes are in the slot (the key of the last write
    /// that landed there since it was granted).
    pub slot_data: Vec<Option<u8>>,
    /// Slot each chunk position of each request was given (write or dedup).
    pub req_slot: Vec<Vec<Option<u8>>>,
    /// Violations seen so far (`viol::*`).
    pub viol: u16,
}

impl State {
    /// The initial state: nothing stored; `Hello`s already handled (kvferry
    /// senders start after the handshake).
    pub fn init(cfg: &Cfg) -> State {
        let log = if cfg.rules.hello {
            (0..cfg.senders)
                .map(|s| RxIn::Msg(s as u8, Wire::Hello))
                .collect()
        } else {
            Vec::new()
        };
        let sreq = |r: usize| SReq {
            p: Progress::default(),
            count: Stored::default(),
            registered: false,
            stored: 0,
            sent: 0,
            batches: vec![
                SBatch {
                    data: Data::Gone,
                    writes: Vec::new()
                };
                cfg.reqs[r].batches.len()
            ],
        };
        State {
            log,
            rx: RxView::default(),
            rx_outcome: vec![None; cfg.reqs.len()],
            to_rx: vec![VecDeque::new(); cfg.senders],
            to_tx: vec![VecDeque::new(); cfg.senders],
            snd: vec![
                Snd {
                    staging_free: cfg.staging,
                    pending_used: 0,
                    blocked_on: None,
                    out: InOrder::default(),
                    turn: Turn::default(),
                };
                cfg.senders
            ],
            reqs: (0..cfg.reqs.len()).map(sreq).collect(),
            writes: Vec::new(),
            consumed: vec![0; cfg.reqs.len()],
            proxy: vec![0; cfg.reqs.len()],
            slot_hold: vec![0; cfg.capacity],
            slot_key: vec![None; cfg.capacity],
            slot_data: vec![None; cfg.capacity],
            req_slot: cfg.reqs.iter().map(|r| vec![None; r.total()]).collect(),
            viol: 0,
        }
    }

    /// Every request ended: terminal on its sender, and a completed one
    /// consumed by the decoder.
    pub fn all_ended(&self, cfg: &Cfg) -> bool {
        self.reqs.iter().enumerate().all(|(r, q)| match q.p.state {
            RState::Done(Status::Completed) => self.consumed[r] as usize == cfg.reqs[r].total(),
            RState::Done(_) => true,
            _ => false,
        })
    }

    /// Nothing held anywhere: staging, pending area, receiver ledger, slots,
    /// keys, tracking, quarantine, channels, writes.
    pub fn nothing_held(&self, cfg: &Cfg) -> bool {
        let rx = self.rx;
        self.snd
            .iter()
            .all(|s| s.staging_free == cfg.staging && s.pending_used == 0)
            && rx.committed == 0
            && rx.slots_in_use == 0
            && rx.keys == 0
            && rx.tracked == 0
            && rx.parked == 0
            && rx.quarantined == 0
            && self.writes.is_empty()
            && self.to_rx.iter().all(VecDeque::is_empty)
            && self.to_tx.iter().all(VecDeque::is_empty)
    }
}
