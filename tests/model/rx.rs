//! The receiver in the model is the real [`ReceiverCore`]. The model state
//! keeps the ordered log of every input the receiver was given; whenever the
//! model needs the receiver's reaction to a new input, it builds a fresh core,
//! replays the log (deterministic: one fixed `Instant`, no timers), feeds the
//! new input and reads the outputs and the ledger.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvferry::protocol::{
    AllocRequest, CancelNotif, Descriptor, Hello, Message, TransferDone, PROTOCOL_VERSION,
};
use kvferry::receiver::core::{CoreConfig, Output, ReceiverCore};

use super::config::Cfg;

/// A control message on the wire, sender → receiver (compact form; turned
/// into the real [`Message`] when delivered).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// `Hello` (kvferry senders only).
    Hello,
    /// The AllocRequest of batch `batch` of request `req`.
    Alloc { req: u8, batch: u8 },
    /// CancelNotif of `req`, naming the keys of its first `sent` batches.
    Cancel { req: u8, sent: u8 },
    /// TransferDone of `req` (kvferry senders only).
    Done { req: u8 },
}

/// One input of the receiver, in delivery order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RxIn {
    /// A message from sender `.0`.
    Msg(u8, Wire),
    /// The decoder consumes one reference of key `.0`: `borrow` + `end_borrow`
    /// (what `Receiver::get` + dropping the `ChunkRef` do); if the borrow is
    /// refused, `remove_key` (what `Receiver::remove` does).
    Consume(u8),
}

/// What the receiver looks like after a step (derived from the log, so it
/// adds no states; stored so properties need no replay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RxView {
    /// Ledger: reserved + allocated.
    pub committed: u8,
    /// Ledger: reserved.
    pub reserved: u8,
    /// Ledger: allocated.
    pub allocated: u8,
    /// Slot allocator: slots in use.
    pub slots_in_use: u8,
    /// Keys held.
    pub keys: u8,
    /// Requests tracked.
    pub tracked: u8,
    /// Requests parked.
    pub parked: u8,
    /// Quarantined slots.
    pub quarantined: u8,
}

/// The result of feeding the last input of a log.
pub struct Step {
    /// Outputs of the last input only.
    pub outputs: Vec<Output>,
    /// For a `Consume`: the slot the borrow returned (None: refused).
    pub borrowed: Option<u32>,
    /// The receiver afterwards.
    pub view: RxView,
}

fn t0() -> Instant {
    static T0: OnceLock<Instant> = OnceLock::new();
    *T0.get_or_init(Instant::now)
}

fn core_config(cfg: &Cfg) -> CoreConfig {
    // Leases and timeouts off: one day never passes in the model (no ticks).
    let never = Duration::from_secs(86_400);
    CoreConfig {
        receiver_id: "rx".into(),
        capacity_chunks: cfg.capacity,
        chunk_bytes: 1024,
        admission_timeout: never,
        lease: never,
        quarantine_grace: never,
        transport: "shm".into(),
        descriptor: Descriptor::None,
        answer_hello: true,
        auto_consume: false,
        bounds: kvferry::receiver::bounds::Bounds::default(),
        consume_grace: Duration::from_secs(1),
        other_transports: Vec::new(),
    }
}

/// The real message for a wire message of sender `s`.
pub fn to_message(cfg: &Cfg, s: usize, w: &Wire) -> Message {
    let extended = cfg.rules.hello;
    match *w {
        Wire::Hello => Message::Hello(Hello {
            sender_id: format!("s{s}"),
            version: PROTOCOL_VERSION,
            transport: "shm".into(),
            descriptor: Descriptor::None,
        }),
        Wire::Alloc { req, batch } => {
            let rc = &cfg.reqs[req as usize];
            Message::AllocRequest(AllocRequest {
                keys: rc
                    .batch_keys(batch as usize)
                    .iter()
                    .map(|&k| cfg.key_names[k as usize].clone())
                    .collect(),
                fmt: 1,
                shape: vec![1024],
                dtype: "uint8".into(),
                last_chunk_toks: 1024,
                req_id: Cfg::req_name(req as usize),
                is_last_batch: batch as usize + 1 == rc.batches.len(),
                total_chunks: rc.total() as i64,
                seq: extended.then(|| alloc_seq(req, batch)),
            })
        }
        Wire::Cancel { req, sent } => {
            let rc = &cfg.reqs[req as usize];
            let keys = (0..sent as usize)
                .flat_map(|b| rc.batch_keys(b).iter())
                .map(|&k| cfg.key_names[k as usize].clone())
                .collect();
            Message::CancelNotif(CancelNotif {
                req_id: Cfg::req_name(req as usize),
                keys,
                seq: extended.then(|| cancel_seq(req)),
            })
        }
        Wire::Done { req } => Message::TransferDone(TransferDone {
            req_id: Cfg::req_name(req as usize),
            seq: None,
        }),
    }
}

/// The `seq` of an AllocRequest (kvferry senders number every message).
pub fn alloc_seq(req: u8, batch: u8) -> u64 {
    u64::from(req) * 64 + u64::from(batch) + 1
}

/// The `seq` of a CancelNotif.
pub fn cancel_seq(req: u8) -> u64 {
    u64::from(req) * 64 + 63
}

/// What a seq stands for: `(req, Some(batch))` or `(req, None)` for a cancel.
pub fn decode_seq(seq: u64) -> (u8, Option<u8>) {
    let req = (seq / 64) as u8;
    match seq % 64 {
        63 => (req, None),
        b => (req, Some((b - 1) as u8)),
    }
}

fn apply(cfg: &Cfg, core: &mut ReceiverCore, input: &RxIn, out: &mut Vec<Output>) -> Option<u32> {
    let now = t0();
    match input {
        RxIn::Msg(s, w) => {
            let s = *s as usize;
            core.handle(&Cfg::peer(s), to_message(cfg, s, w), now, out);
            None
        }
        RxIn::Consume(k) => {
            let key = &cfg.key_names[*k as usize];
            match core.borrow(key) {
                Some(b) => {
                    core.end_borrow(key, b.gen, now, out);
                    Some(b.slot)
                }
                None => {
                    core.remove_key(key, now, out);
                    None
                }
            }
        }
    }
}

/// Rebuilds the receiver from `log` and feeds it `next`.
pub fn step(cfg: &Cfg, log: &[RxIn], next: &RxIn) -> Step {
    let mut core = ReceiverCore::new(core_config(cfg), t0());
    let mut out = Vec::new();
    for input in log {
        apply(cfg, &mut core, input, &mut out);
        out.clear();
    }
    let borrowed = apply(cfg, &mut core, next, &mut out);
    Step {
        outputs: out,
        borrowed,
        view: view(&core),
    }
}

/// The receiver's accounting.
pub fn view(core: &ReceiverCore) -> RxView {
    let l = core.ledger().stats();
    let s = core.stats();
    let c = |x: usize| x.min(255) as u8;
    RxView {
        committed: c(l.committed),
        reserved: c(l.reserved),
        allocated: c(l.allocated),
        slots_in_use: c(s.slots_in_use),
        keys: c(s.keys),
        tracked: c(s.tracked_requests),
        parked: c(s.parked_requests),
        quarantined: c(s.quarantined_slots),
    }
}
