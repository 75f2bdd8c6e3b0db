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
use std::time::{Duration, Instant};

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
    /// The same-host `ipc://` endpoint of the receiver's socket that this
    /// peer's socket connects to instead of `endpoint`, once the receiver
    /// offered it (`HelloAck::control`; the identity still names
    /// `endpoint`).
    pub route: Option<String>,
    /// The `receiver_id` whose `HelloAck` offered [`route`](Self::route):
    /// the `HelloAck` there must name it too. Set once the move is tried
    /// and never cleared: it is tried once per peer (a `Hello` unanswered
    /// there, or answered by another receiver, goes back to `endpoint`
    /// for good).
    pub local_receiver: Option<String>,
}

/// The sender's peer-level time limits (from its `SenderConfig`): what the
/// decisions below compare the shell's clock reading against.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// `hello_timeout`: a receiver with a static descriptor that has not
    /// answered `Hello` by then is taken for an LMCache one.
    pub hello: Duration,
    /// `hello_answer_timeout`: a receiver without one fails its requests.
    pub hello_answer: Duration,
    /// `reply_timeout`: an unanswered message fails its request.
    pub reply: Duration,
    /// `heartbeat_interval`.
    pub heartbeat: Duration,
    /// `rehello_backoff`: least time between two `Hello`s to a receiver.
    pub rehello_backoff: Duration,
}

impl Limits {
    pub fn new(cfg: &super::SenderConfig) -> Self {
        Self {
            hello: cfg.hello_timeout,
            hello_answer: cfg.hello_answer_timeout,
            reply: cfg.reply_timeout,
            heartbeat: cfg.heartbeat_interval,
            rehello_backoff: cfg.rehello_backoff,
        }
    }
}

/// How long a `Hello` on a receiver's same-host endpoint may go
/// unanswered before the peer goes back to the endpoint it was given.
fn local_hello(limits: &Limits) -> Duration {
    limits.hello.min(limits.hello_answer)
}

/// What a handshaking peer's `Hello` timing calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HelloTimeout {
    /// No answer within `hello_timeout` and a static descriptor exists:
    /// treat it as an LMCache receiver.
    Fallback,
    /// No answer within `hello_answer_timeout` and no static descriptor:
    /// its waiting requests fail.
    Unanswered,
}

/// This process's random identity part (drawn once).
fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(rand::random::<u64>)
}

impl Peer {
    /// Opens a DEALER to `endpoint` (identity: see [`Peer::socket`]).
    /// `now`: the shell's clock reading (the handshake starts then).
    pub fn connect(
        sender_id: &str,
        endpoint: &str,
        generation: u32,
        now: Instant,
    ) -> Result<Self, zmq::Error> {
        let sock = Self::socket(sender_id, endpoint, None, generation)?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            sock,
            mode: Mode::Handshaking(now),
            index: None,
            remote: None,
            prepared: None,
            by_seq: HashMap::new(),
            in_order: InOrder::default(),
            turn: Turn::default(),
            last_heartbeat: now,
            generation,
            rehandshake: false,
            last_hello: None,
            retry_hello: false,
            late: None,
            route: None,
            local_receiver: None,
        })
    }

    /// A fresh DEALER socket (used again when a late reply must be shed),
    /// connected to `route` if given (the receiver's same-host endpoint,
    /// [`Peer::route`]), else to `endpoint`.
    /// Its identity is `"{sender_id}-to-{endpoint}-{nonce}"` (plus
    /// `#{generation}` once replaced), where `nonce` is random per process:
    /// two processes configured with the same `sender_id` (a restart, a
    /// copy-pasted config) never share an identity, so a receiver never
    /// routes one's replies to the other or lets it act on the other's
    /// requests.
    pub fn socket(
        sender_id: &str,
        endpoint: &str,
        route: Option<&str>,
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
        sock.connect(route.unwrap_or(endpoint))?;
        Ok(sock)
    }

    /// Sends one payload with the `[b"", payload]` envelope.
    pub fn send_raw(&self, payload: &[u8]) -> Result<(), zmq::Error> {
        self.sock.send_multipart([&[][..], payload], 0)
    }

    /// Whether this peer's `Hello` on the receiver's same-host endpoint
    /// ([`route`](Self::route)) went unanswered too long at `now`: the
    /// lesser of `hello_timeout` and `hello_answer_timeout`.
    pub fn local_hello_timed_out(&self, now: Instant, limits: &Limits) -> bool {
        match self.mode {
            Mode::Handshaking(since) if self.route.is_some() => {
                now.saturating_duration_since(since) >= local_hello(limits)
            }
            _ => false,
        }
    }

    /// Whether the `Hello` of a handshaking peer timed out at `now`, and
    /// how (`fallback`: a static descriptor is configured for it, so it
    /// may be an LMCache receiver).
    pub fn hello_timeout(
        &self,
        now: Instant,
        limits: &Limits,
        fallback: bool,
    ) -> Option<HelloTimeout> {
        let Mode::Handshaking(since) = self.mode else {
            return None;
        };
        let waited = now.saturating_duration_since(since);
        if fallback && waited >= limits.hello {
            Some(HelloTimeout::Fallback)
        } else if !fallback && waited >= limits.hello_answer {
            Some(HelloTimeout::Unanswered)
        } else {
            None
        }
    }

    /// May this peer be said `Hello` again at `now`: its data plane was
    /// negotiated through `Hello` (or its last data-plane connect failed),
    /// and the last `Hello` is at least `backoff` ago?
    pub fn rehello_allowed(&self, now: Instant, backoff: Duration) -> bool {
        (self.rehandshake || self.retry_hello)
            && self
                .last_hello
                .is_none_or(|t| now.saturating_duration_since(t) >= backoff)
    }

    /// Some message went unanswered for `limit` or longer at `now`.
    pub fn replies_overdue(&self, now: Instant, limit: Duration) -> bool {
        self.oldest()
            .is_some_and(|t| now.saturating_duration_since(t) >= limit)
    }

    /// A kvferry peer's heartbeat is due at `now`.
    pub fn heartbeat_due(&self, now: Instant, interval: Duration) -> bool {
        self.mode == Mode::Extended
            && now.saturating_duration_since(self.last_heartbeat) >= interval
    }

    /// When this peer next needs ctrl without any message arriving, as of
    /// `now`: its `Hello`'s timeout (`fallback` as in
    /// [`hello_timeout`](Self::hello_timeout)), the oldest reply's timeout,
    /// the heartbeat, the end of a late `HelloAck`'s window, or the end of
    /// a reconnecting peer's backoff (only while still ahead: once it
    /// passed, the re-handshake waits for the aborts, whose completions
    /// wake ctrl).
    pub fn next_deadline(&self, now: Instant, limits: &Limits, fallback: bool) -> Option<Instant> {
        let handshake = match self.mode {
            Mode::Handshaking(since) if self.route.is_some() => Some(since + local_hello(limits)),
            Mode::Handshaking(since) => Some(
                since
                    + if fallback {
                        limits.hello
                    } else {
                        limits.hello_answer
                    },
            ),
            _ => None,
        };
        let heartbeat =
            (self.mode == Mode::Extended).then(|| self.last_heartbeat + limits.heartbeat);
        let late = self
            .late
            .as_ref()
            .filter(|l| l.ack.is_none())
            .map(|l| l.until);
        let backoff = (self.mode == Mode::Reconnecting)
            .then(|| self.last_hello.map(|t| t + limits.rehello_backoff))
            .flatten()
            .filter(|&due| due > now);
        [
            handshake,
            self.oldest().map(|t| t + limits.reply),
            heartbeat,
            late,
            backoff,
        ]
        .into_iter()
        .flatten()
        .min()
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

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        hello: Duration::from_secs(1),
        hello_answer: Duration::from_secs(5),
        reply: Duration::from_secs(120),
        heartbeat: Duration::from_secs(5),
        rehello_backoff: Duration::from_secs(1),
    };

    /// The peer-level decisions read no clock: driven by a synthetic one
    /// (instants made up around one base), each flips exactly at its limit,
    /// and a clock that goes back never fires one.
    #[test]
    fn peer_timeouts_follow_the_clock_the_shell_gives() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A lazily connecting socket: nothing listens there, nothing is sent.
        let mut p = Peer::connect("s", "tcp://127.0.0.1:9", 0, at(0)).expect("a socket");
        let l = &LIMITS;

        // Handshake: the LMCache fallback at 1 s, giving up at 5 s.
        assert_eq!(p.hello_timeout(at(999), l, true), None);
        assert_eq!(
            p.hello_timeout(at(1000), l, true),
            Some(HelloTimeout::Fallback)
        );
        assert_eq!(p.hello_timeout(at(4999), l, false), None);
        assert_eq!(
            p.hello_timeout(at(5000), l, false),
            Some(HelloTimeout::Unanswered)
        );
        assert_eq!(p.next_deadline(at(0), l, true), Some(at(1000)));
        assert_eq!(p.next_deadline(at(0), l, false), Some(at(5000)));
        p.mode = Mode::Handshaking(at(10_000));
        assert_eq!(
            p.hello_timeout(at(0), l, false),
            None,
            "the clock went back"
        );
        // A Hello on the receiver's same-host endpoint: back to the given
        // one at the lesser of the two limits, whether or not a static
        // descriptor exists.
        p.mode = Mode::Handshaking(at(0));
        assert!(!p.local_hello_timed_out(at(5000), l), "no route: not local");
        p.route = Some("ipc:///run/kvferry/r.ctl".into());
        assert!(!p.local_hello_timed_out(at(999), l));
        assert!(p.local_hello_timed_out(at(1000), l));
        assert_eq!(p.next_deadline(at(0), l, false), Some(at(1000)));
        assert_eq!(p.next_deadline(at(0), l, true), Some(at(1000)));
        p.route = None;

        // Connected: the reply timeout and the heartbeat.
        p.mode = Mode::Extended;
        p.last_heartbeat = at(0);
        p.by_seq.insert(1, (Outstanding::Batch(1), at(10)));
        assert!(!p.replies_overdue(at(120_009), l.reply));
        assert!(p.replies_overdue(at(120_010), l.reply));
        assert!(!p.heartbeat_due(at(4999), l.heartbeat));
        assert!(p.heartbeat_due(at(5000), l.heartbeat));
        assert_eq!(p.next_deadline(at(0), l, false), Some(at(5000)));
        p.last_heartbeat = at(200_000);
        assert_eq!(p.next_deadline(at(0), l, false), Some(at(120_010)));
        p.by_seq.clear();

        // Re-handshake: only for a Hello-negotiated data plane (or a failed
        // connect), and not within the backoff of the last Hello.
        p.mode = Mode::Reconnecting;
        p.last_hello = Some(at(300_000));
        assert!(
            !p.rehello_allowed(at(400_000), l.rehello_backoff),
            "shm/tcp: never"
        );
        p.rehandshake = true;
        assert!(!p.rehello_allowed(at(300_999), l.rehello_backoff));
        assert!(p.rehello_allowed(at(301_000), l.rehello_backoff));
        assert_eq!(p.next_deadline(at(300_500), l, false), Some(at(301_000)));
        assert_eq!(
            p.next_deadline(at(301_000), l, false),
            None,
            "once the backoff passed, the aborts' completions wake ctrl"
        );
    }
}
