//! Shared helpers of the receiver's black-box tests: a ZMQ DEALER test client
//! speaking kvferry's wire format, message builders, an emulated shm writer,
//! deadline-bounded waits, a raw HTTP scrape, and helpers for `kvferry` run
//! as a child process (its stdout lines, its exit).
//!
//! Every wait here has a deadline; hitting it fails the test with a message
//! naming what it waited for.
#![allow(dead_code)] // each test file uses its own subset

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use kvferry::protocol::{
    decode, encode, AllocRequest, AllocResponse, CancelNotif, Descriptor, ErrorCode, Hello,
    HelloAck, Message, TransferDone, PROTOCOL_VERSION,
};
use kvferry::receiver::{Receiver, ReceiverConfig, ReceiverStats};
use kvferry::region::Region;

/// How long any single wait may take before the test is declared hung.
pub const HANG: Duration = Duration::from_secs(10);

/// Slot size of the test receivers.
pub const CHUNK_BYTES: u64 = 4096;

/// Bytes of one chunk in [`alloc`] requests (shape `[1024]` of `uint8`).
pub const CHUNK_LEN: usize = 1024;

/// A deadline [`HANG`] from now.
pub fn deadline() -> Instant {
    Instant::now() + HANG
}

/// A receiver configuration for tests: loopback, port 0, `capacity` slots of
/// [`CHUNK_BYTES`], generous timeouts (tests shorten what they exercise).
pub fn config(capacity: usize) -> ReceiverConfig {
    ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        receiver_id: "test-receiver".into(),
        capacity_chunks: capacity,
        chunk_bytes: CHUNK_BYTES,
        admission_timeout: Duration::from_secs(60),
        lease: Duration::from_secs(60),
        quarantine_grace: Duration::from_secs(60),
        ..ReceiverConfig::default()
    }
}

/// Starts a receiver with `cfg`.
pub fn start(cfg: ReceiverConfig) -> Receiver {
    Receiver::start(cfg).expect("receiver starts")
}

/// Polls `cond` (every millisecond) until it holds; fails naming `what` after [`HANG`].
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = deadline();
    while !cond() {
        assert!(Instant::now() < end, "hung waiting for: {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the receiver's stats satisfy `cond`; the failure message shows the last stats.
pub fn wait_stats(r: &Receiver, what: &str, mut cond: impl FnMut(&ReceiverStats) -> bool) {
    let end = deadline();
    loop {
        let s = r.stats();
        if cond(&s) {
            return;
        }
        assert!(
            Instant::now() < end,
            "hung waiting for: {what}; last stats: {s:?}"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Asserts the receiver holds nothing: no reservation, no slot, no request, no key.
pub fn assert_idle(r: &Receiver) {
    let s = r.stats();
    assert_eq!(s.reserved_chunks, 0, "reserved chunks left: {s:?}");
    assert_eq!(s.allocated_chunks, 0, "allocated chunks left: {s:?}");
    assert_eq!(s.core.tracked_requests, 0, "tracked requests left: {s:?}");
    assert_eq!(s.core.parked_requests, 0, "parked requests left: {s:?}");
    assert_eq!(s.core.keys, 0, "keys left: {s:?}");
    assert_eq!(s.core.quarantined_slots, 0, "quarantined slots left: {s:?}");
    assert_eq!(s.core.slots_in_use, 0, "slots in use: {s:?}");
}

/// `n` keys `"{prefix}{i}"`.
pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// An AllocRequest of chunks of [`CHUNK_LEN`] bytes (`shape [1024]`, `uint8`).
pub fn alloc(req_id: &str, keys: &[String], total: i64, last: bool, seq: Option<u64>) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: keys.to_vec(),
        fmt: 1,
        shape: vec![CHUNK_LEN as i64],
        dtype: "uint8".into(),
        last_chunk_toks: 16,
        req_id: req_id.into(),
        is_last_batch: last,
        total_chunks: total,
        seq,
    })
}

/// A CancelNotif.
pub fn cancel(req_id: &str, keys: &[String], seq: Option<u64>) -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: req_id.into(),
        keys: keys.to_vec(),
        seq,
    })
}

/// A TransferDone.
pub fn transfer_done(req_id: &str) -> Message {
    Message::TransferDone(TransferDone {
        req_id: req_id.into(),
        seq: None,
    })
}

/// Asserts a reply is a failure with `code` in LMCache's shape
/// (`[-1] * max(n_keys, 1)`), with an `error` text.
#[track_caller]
pub fn assert_failure(r: &AllocResponse, code: ErrorCode, n_keys: usize) {
    assert_eq!(
        r.code.as_deref(),
        Some(code.as_str()),
        "expected code {code}, got reply {r:?}"
    );
    assert_eq!(
        r.remote_indexes,
        vec![-1; n_keys.max(1)],
        "failure shape of {r:?}"
    );
    assert!(
        r.error.as_deref().is_some_and(|e| !e.is_empty()),
        "failure without an error text: {r:?}"
    );
    assert!(r.already_sent_indexes.is_empty(), "{r:?}");
}

/// LMCache 0.5.6's sender checks on the reply to a batch of `n_keys` keys
/// (`PDBackendAsync._async_transfer_task`), written out independently of
/// `protocol::placement`: every `already_sent_indexes` entry in
/// `0..n_keys`, and `len(remote_indexes) == n_keys - len(set(already_sent))`.
/// The one reply allowed to fail the count check is a failure to an empty
/// batch (`[-1] * max(0, 1)`, PROTOCOL.md's failure shape, which LMCache's
/// own receiver sends too): LMCache's sender aborts the request on it, as
/// it does on any `-1`.
#[track_caller]
pub fn assert_lmcache_accepts(n_keys: usize, r: &AllocResponse) {
    let already: std::collections::HashSet<i64> = r.already_sent_indexes.iter().copied().collect();
    assert!(
        already.iter().all(|&i| i >= 0 && (i as usize) < n_keys),
        "LMCache refuses already_sent_indexes for {n_keys} keys: {r:?}"
    );
    if n_keys == 0 && r.remote_indexes == [-1] {
        return;
    }
    assert_eq!(
        r.remote_indexes.len(),
        n_keys - already.len(),
        "LMCache's AllocResponse consistency check fails for {n_keys} keys: {r:?}"
    );
}

/// Asserts a reply is a success with `n` slot indexes and returns them.
#[track_caller]
pub fn assert_ok(r: &AllocResponse, n: usize) -> Vec<u32> {
    assert!(!r.is_failure(), "expected success, got {r:?}");
    assert_eq!(r.remote_indexes.len(), n, "{r:?}");
    r.remote_indexes
        .iter()
        .map(|&i| u32::try_from(i).expect("slot index fits u32"))
        .collect()
}

/// A DEALER connected to a receiver, as an LMCache or kvferry sender uses.
pub struct Client {
    sock: zmq::Socket,
    name: String,
}

impl Client {
    /// Connects a DEALER with identity `name` to `endpoint`.
    pub fn connect(endpoint: &str, name: &str) -> Self {
        let sock = kvferry::zmq_io::context()
            .socket(zmq::DEALER)
            .expect("dealer socket");
        sock.set_identity(name.as_bytes()).expect("identity");
        sock.set_linger(0).expect("linger");
        sock.set_sndhwm(0).expect("sndhwm");
        sock.set_rcvhwm(0).expect("rcvhwm");
        sock.connect(endpoint).expect("connect");
        Self {
            sock,
            name: name.to_owned(),
        }
    }

    /// The identity.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends `[b"", payload]`.
    pub fn send_raw(&self, payload: &[u8]) {
        self.sock
            .send_multipart([&[][..], payload], 0)
            .expect("send");
    }

    /// Sends raw frames as they are (no delimiter added).
    pub fn send_frames(&self, frames: &[&[u8]]) {
        self.sock.send_multipart(frames, 0).expect("send");
    }

    /// Encodes and sends `msg`.
    pub fn send(&self, msg: &Message) {
        self.send_raw(&encode(msg));
    }

    /// Receives one multipart message, or `None` if none arrives before `deadline`.
    pub fn try_recv_frames(&self, deadline: Instant) -> Option<Vec<Vec<u8>>> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.as_millis().min(i64::MAX as u128) as i64;
            let mut items = [self.sock.as_poll_item(zmq::POLLIN)];
            let n = zmq::poll(&mut items, ms).expect("poll");
            if n > 0 {
                return Some(self.sock.recv_multipart(0).expect("recv"));
            }
            if left.is_zero() {
                return None;
            }
        }
    }

    /// Receives one multipart message; fails naming `what` at the deadline.
    pub fn recv_frames(&self, deadline: Instant, what: &str) -> Vec<Vec<u8>> {
        self.try_recv_frames(deadline).unwrap_or_else(|| {
            panic!(
                "client {}: no reply before the deadline while waiting for {what}",
                self.name
            )
        })
    }

    /// Receives the payload (last frame) of one reply, checking the
    /// `[b"", payload]` envelope.
    pub fn recv_raw(&self, deadline: Instant, what: &str) -> Vec<u8> {
        let mut frames = self.recv_frames(deadline, what);
        assert_eq!(frames.len(), 2, "reply envelope for {what}: {frames:?}");
        assert!(frames[0].is_empty(), "delimiter frame for {what}");
        frames.pop().unwrap_or_default()
    }

    /// Receives one message.
    pub fn recv_msg(&self, deadline: Instant, what: &str) -> Message {
        let raw = self.recv_raw(deadline, what);
        decode(&raw).unwrap_or_else(|e| panic!("reply to {what} does not decode: {e}"))
    }

    /// Receives one AllocResponse; fails naming `what` on timeout or another type.
    pub fn recv_reply(&self, deadline: Instant, what: &str) -> AllocResponse {
        match self.recv_msg(deadline, what) {
            Message::AllocResponse(r) => r,
            other => panic!("expected an AllocResponse for {what}, got {other:?}"),
        }
    }

    /// True if a reply is waiting right now (no wait).
    pub fn has_pending(&self) -> bool {
        let mut items = [self.sock.as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, 0).expect("poll") > 0
    }

    /// Sends `msg` and waits for its AllocResponse; the reply to an
    /// AllocRequest must pass LMCache's sender checks
    /// ([`assert_lmcache_accepts`]).
    pub fn call(&self, msg: &Message, what: &str) -> AllocResponse {
        self.send(msg);
        let r = self.recv_reply(deadline(), what);
        if let Message::AllocRequest(req) = msg {
            assert_lmcache_accepts(req.keys.len(), &r);
        }
        r
    }

    /// Says Hello (kvferry mode) and returns the HelloAck.
    pub fn hello(&self) -> HelloAck {
        self.hello_for("shm")
    }

    /// Says Hello asking for the `transport` data plane; returns the HelloAck.
    pub fn hello_for(&self, transport: &str) -> HelloAck {
        self.send(&Message::Hello(Hello {
            sender_id: self.name.clone(),
            version: PROTOCOL_VERSION,
            transport: transport.into(),
            descriptor: Descriptor::None,
        }));
        match self.recv_msg(deadline(), "HelloAck") {
            Message::HelloAck(a) => a,
            other => panic!("expected HelloAck, got {other:?}"),
        }
    }
}

/// A sender's view of the receive buffer: the shm file mapped by path.
pub struct Writer {
    region: Region,
}

impl Writer {
    /// Maps the receiver's buffer file.
    pub fn open(path: &Path, chunk_bytes: u64, capacity: u64) -> Self {
        Self {
            region: Region::open(path, Some((chunk_bytes, capacity))).expect("open shm region"),
        }
    }

    /// Maps the buffer announced in a HelloAck.
    pub fn from_ack(ack: &HelloAck) -> Self {
        match &ack.descriptor {
            Descriptor::Shm { path, len } => {
                assert_eq!(*len, ack.chunk_bytes * ack.capacity_chunks, "shm length");
                Self::open(Path::new(path), ack.chunk_bytes, ack.capacity_chunks)
            }
            other => panic!("expected an shm descriptor, got {other:?}"),
        }
    }

    /// Writes `bytes` at the start of `slot`, as a sender's transport would.
    /// Only call for a slot the receiver granted to the caller's request.
    pub fn write(&self, slot: u32, bytes: &[u8]) {
        assert!(
            bytes.len() as u64 <= self.region.chunk_bytes(),
            "chunk fits"
        );
        let ptr = self.region.slot_ptr(slot).expect("granted slot exists");
        // SAFETY: `slot` exists (slot_ptr returned Some), `bytes` fits in it,
        // and the receiver granted it to the caller's request, so nobody else
        // writes or reads it until the request is done.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
    }
}

/// A recognisable 16-byte pattern for `key`.
pub fn pattern(key: &str) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&h.to_le_bytes());
    out[8..].copy_from_slice(&(!h).to_le_bytes());
    out
}

/// `GET /metrics` over a raw TCP connection; returns the body. Fails on a
/// non-200 answer or after [`HANG`].
pub fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect_timeout(&addr, HANG).expect("connect to the metrics server");
    s.set_read_timeout(Some(HANG)).expect("read timeout");
    s.set_write_timeout(Some(HANG)).expect("write timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .expect("send the scrape request");
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .expect("metrics response (read timed out or failed)");
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header/body split in {resp:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "scrape answered {head:?}");
    body.to_owned()
}

/// The value of the sample line `name_and_labels value` in a Prometheus text body.
pub fn metric(body: &str, name_and_labels: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name_and_labels).then(|| v.parse().ok())?
    })
}

// ----- kvferry as a child process --------------------------------------------

mod process;
#[allow(unused_imports)] // each test file uses its own subset
pub use process::*;
