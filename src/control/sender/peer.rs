//! One receiver as seen by the sender's ctrl thread: its DEALER socket, the
//! handshake, and how replies are matched to what was sent.
//!
//! A kvferry receiver answers `Hello`; then requests are pipelined and
//! replies matched by `seq` (many AllocRequests in flight, no per-receiver
//! lock across a round trip). A receiver that does not answer in time is
//! treated as an LMCache receiver: no extensions, one outstanding message,
//! replies matched in order, and one request at a time (LMCache's own rule,
//! which keeps a parked request from blocking the batches of an admitted one
//! behind the single outstanding slot).

use std::collections::HashMap;
use std::time::Instant;

use crate::protocol::Descriptor;

use super::core::{InOrder, Turn};
use super::table::ReqKey;
use crate::transport::{PeerIndex, RemoteBuffer};

/// Replies queued per receiver connection before ZMQ stops reading it
/// (so at most `REPLY_QUEUE` × the 4 MiB frame limit; replies are a few
/// hundred bytes in practice). The ctrl thread drains every readable reply
/// each step, so a well-behaved receiver never meets the bound.
pub const REPLY_QUEUE: i32 = 16;

/// What a reply answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outstanding {
    /// The AllocRequest of this batch.
    Batch(u64),
    /// The CancelNotif of this request.
    Cancel(String),
}

/// The peer's protocol mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Mode {
    /// `Hello` sent at this instant, no answer yet.
    Handshaking(Instant),
    /// kvferry receiver: extensions, pipelining.
    Extended,
    /// LMCache-style receiver: one message at a time.
    Legacy,
    /// The Hello-negotiated data plane to this receiver was lost (writes
    /// completed with `ConnectionLost`): its requests are being aborted
    /// (fenced, CancelNotif still goes out on this socket) and new ones
    /// wait; once the aborts are done and the re-Hello backoff has passed,
    /// ctrl says `Hello` again on a fresh socket.
    Reconnecting,
    /// Unusable (no descriptor, transport refused it).
    Failed(String),
}

/// A `Hello` that timed out: its socket keeps listening for a late
/// `HelloAck` (a loaded kvferry receiver), with what was prepared for it.
pub(super) struct LateHello {
    pub sock: zmq::Socket,
    pub prepared: Descriptor,
    /// When to stop listening (then the prepared side is discarded).
    pub until: Instant,
    /// The late `HelloAck`, once read: applied when the peer is idle.
    pub ack: Option<crate::protocol::HelloAck>,
}

/// A receiver connection.
pub(super) struct Peer {
    pub endpoint: String,
    pub sock: zmq::Socket,
    pub mode: Mode,
    pub index: Option<PeerIndex>,
    pub remote: Option<RemoteBuffer>,
    /// What `Poster::prepare` made for this receiver and the `Hello`
    /// carried, until the `HelloAck` connects it (or it is discarded).
    pub prepared: Option<Descriptor>,
    /// Extended mode: sent and unanswered, by seq.
    pub by_seq: HashMap<u64, (Outstanding, Instant)>,
    /// Legacy mode: the one unanswered message and the encoded ones
    /// waiting for it.
    pub in_order: InOrder<Outstanding, Vec<u8>, Instant>,
    /// Legacy mode: the one request being transferred.
    pub turn: Turn<ReqKey>,
    pub last_heartbeat: Instant,
    /// Incarnation of the socket (the identity changes when it is replaced).
    pub generation: u32,
    /// The data plane to this receiver was set up per pair through `Hello`
    /// (`prepare` made a descriptor other than `Descriptor::None`, e.g. an
    /// RDMA queue pair) and connected at least once: a lost connection is
    /// re-handshaken. Never set for shm and tcp.
    pub rehandshake: bool,
    /// When the last `Hello` went out (the re-Hello backoff counts from it).
    pub last_hello: Option<Instant>,
    /// The last handshake failed while connecting the data plane (e.g. the
    /// receiver closed the connection during setup): a request after
    /// `rehello_backoff` tries a new `Hello` instead of failing for good.
    pub retry_hello: bool,
    /// The timed-out `Hello` still listened to (see [`LateHello`]).
    pub late: Option<LateHello>,
}

/// This process's random identity part (drawn once).
fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(rand::random::<u64>)
}

impl Peer {
    /// Opens a DEALER to `endpoint` (identity: see [`Peer::socket`]).
    pub fn connect(sender_id: &str, endpoint: &str, generation: u32) -> Result<Self, zmq::Error> {
        let sock = Self::socket(sender_id, endpoint, generation)?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            sock,
            mode: Mode::Handshaking(Instant::now()),
            index: None,
            remote: None,
            prepared: None,
            by_seq: HashMap::new(),
            in_order: InOrder::default(),
            turn: Turn::default(),
            last_heartbeat: Instant::now(),
            generation,
            rehandshake: false,
            last_hello: None,
            retry_hello: false,
            late: None,
        })
    }

    /// A fresh DEALER socket (used again when a late reply must be shed).
    /// Its identity is `"{sender_id}-to-{endpoint}-{nonce}"` (plus
    /// `#{generation}` once replaced), where `nonce` is random per process:
    /// two processes configured with the same `sender_id` (a restart, a
    /// copy-pasted config) never share an identity, so a receiver never
    /// routes one's replies to the other or lets it act on the other's
    /// requests.
    pub fn socket(
        sender_id: &str,
        endpoint: &str,
        generation: u32,
    ) -> Result<zmq::Socket, zmq::Error> {
        let sock = crate::zmq_io::context().socket(zmq::DEALER)?;
        // A per-process random part, so nobody can squat the identity
        // (issue 13): `"{sender_id}-to-{endpoint}~{nonce}[#{generation}]"`.
        let nonce = process_nonce();
        let identity = if generation == 0 {
            format!("{sender_id}-to-{endpoint}~{nonce:016x}")
        } else {
            format!("{sender_id}-to-{endpoint}~{nonce:016x}#{generation}")
        };
        sock.set_identity(identity.as_bytes())?;
        // Replies are bounded by the same frame limit as everything else.
        sock.set_maxmsgsize(crate::protocol::Limits::DEFAULT_MAX_FRAME_BYTES as i64)?;
        sock.set_linger(0)?;
        // The sender's own messages are bounded by its requests (sndhwm 0:
        // never dropped). Replies wait at most REPLY_QUEUE frames deep;
        // past that ZMQ stops reading the connection, so a receiver that
        // floods replies is held back by TCP, not buffered here.
        sock.set_sndhwm(0)?;
        sock.set_rcvhwm(REPLY_QUEUE)?;
        sock.connect(endpoint)?;
        Ok(sock)
    }

    /// Sends one payload with the `[b"", payload]` envelope.
    pub fn send_raw(&self, payload: &[u8]) -> Result<(), zmq::Error> {
        self.sock.send_multipart([&[][..], payload], 0)
    }

    /// The oldest unanswered message's send time.
    pub fn oldest(&self) -> Option<Instant> {
        self.by_seq
            .values()
            .map(|(_, t)| *t)
            .chain(self.in_order.sent_at())
            .min()
    }
}
