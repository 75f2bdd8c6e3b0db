//! Shared helpers of the sender integration tests (`tests/sender_*.rs`):
//! in-process receivers, senders and proxy listeners over loopback TCP with
//! the shm data plane, deterministic payloads, and deadline-bounded waits
//! whose failure message names what hung.

#![allow(dead_code)]

use std::ops::Range;
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvferry::protocol::Descriptor;
use kvferry::proxy::ProxyListener;
use kvferry::receiver::{Receiver, ReceiverConfig};
use kvferry::runner::payload::{ChunkId, Payloads};
use kvferry::sender::{RequestStatus, Sender, SenderConfig, StoreError, TransferSpec};
use kvferry::transport::RemoteBuffer;

/// Bytes per chunk (staging slot and receiver slot) in these tests.
pub const CHUNK: u64 = 4096;

/// The longest any single wait of a test may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// A deadline [`WAIT`] from now.
pub fn deadline() -> Instant {
    Instant::now() + WAIT
}

/// The run-wide payload pool (same seed, same bytes).
pub fn payloads() -> &'static Payloads {
    static P: OnceLock<Payloads> = OnceLock::new();
    P.get_or_init(|| Payloads::new(CHUNK as usize, 0x5EED))
}

/// A unique id for receivers and senders of this process.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    // Relaxed: only uniqueness of the returned number matters.
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A receiver configuration with `capacity` slots of [`CHUNK`] bytes and a
/// short quarantine.
pub fn receiver_cfg(capacity: usize) -> ReceiverConfig {
    ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        receiver_id: unique("recv"),
        capacity_chunks: capacity,
        chunk_bytes: CHUNK,
        quarantine_grace: Duration::from_millis(200),
        ..ReceiverConfig::default()
    }
}

/// Starts a receiver with `capacity` slots.
pub fn receiver(capacity: usize) -> Receiver {
    Receiver::start(receiver_cfg(capacity)).expect("receiver starts")
}

/// Starts a receiver with `capacity` slots that also offers the TCP data
/// plane on loopback, and a sender of `staging` slots writing to it over
/// TCP.
pub fn tcp_pair(capacity: usize, staging: usize) -> (Receiver, Sender) {
    let r = Receiver::start(ReceiverConfig {
        tcp_data: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        ..receiver_cfg(capacity)
    })
    .expect("receiver starts");
    let s = sender(SenderConfig {
        transport: "tcp".into(),
        ..sender_cfg(staging, None)
    });
    (r, s)
}

/// A sender configuration with `staging` slots of [`CHUNK`] bytes,
/// notifying `proxy` if given.
pub fn sender_cfg(staging: usize, proxy: Option<&ProxyListener>) -> SenderConfig {
    SenderConfig {
        sender_id: unique("send"),
        proxy: proxy.map(|p| p.endpoint().to_owned()),
        staging_slots: staging,
        chunk_bytes: CHUNK,
        reply_timeout: Duration::from_secs(60),
        staging_timeout: Duration::from_secs(60),
        ..SenderConfig::default()
    }
}

/// Starts a sender.
pub fn sender(cfg: SenderConfig) -> Sender {
    Sender::new(cfg).expect("sender starts")
}

/// Binds a proxy listener on a free loopback port.
pub fn proxy() -> ProxyListener {
    ProxyListener::bind("tcp://127.0.0.1:0").expect("proxy binds")
}

/// The static descriptor of a receiver's buffer (for LMCache-mode peers).
pub fn remote_buffer(r: &Receiver) -> RemoteBuffer {
    RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: r.shm_path().to_string_lossy().into_owned(),
            len: r.region().data_len(),
        },
        chunk_bytes: r.region().chunk_bytes(),
        capacity_chunks: r.region().capacity_chunks(),
    }
}

/// Identity of chunk `index` of request number `request`.
pub fn chunk_id(request: u64, index: u32, total: u32) -> ChunkId {
    ChunkId {
        request,
        index,
        total,
    }
}

/// The key of chunk `index` of `req_id`.
pub fn key(req_id: &str, request: u64, index: u32, total: u32) -> String {
    chunk_id(request, index, total).key(req_id)
}

/// Stores chunks `range` of request `req_id` (number `request`, `total`
/// chunks) as one batch; the batch is the last one if it ends the request.
pub fn store_batch(
    s: &Sender,
    receiver: &str,
    req_id: &str,
    request: u64,
    total: u32,
    range: Range<u32>,
) -> Result<(), StoreError> {
    let is_last = range.end == total;
    let spec = TransferSpec::new(req_id, receiver, total as usize, is_last);
    let keys: Vec<String> = range
        .clone()
        .map(|i| key(req_id, request, i, total))
        .collect();
    let bufs: Vec<Vec<u8>> = range
        .map(|i| {
            let mut b = Vec::new();
            payloads().fill(chunk_id(request, i, total), &mut b);
            b
        })
        .collect();
    let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    s.store(&spec, &keys, &chunks)
}

/// Stores a whole request in batches of at most `batch` chunks.
pub fn store_request(
    s: &Sender,
    receiver: &str,
    req_id: &str,
    request: u64,
    total: u32,
    batch: u32,
) -> Result<(), StoreError> {
    let mut next = 0;
    while next < total {
        let end = (next + batch).min(total);
        store_batch(s, receiver, req_id, request, total, next..end)?;
        next = end;
    }
    Ok(())
}

/// Reads every chunk of a ready request, checks its bytes against what was
/// stored, and releases it (the decoder's job). The request must be ready
/// (see [`Receiver::wait_ready`]); `Err` names the first bad chunk.
pub fn read_and_release(
    r: &Receiver,
    req_id: &str,
    request: u64,
    total: u32,
) -> Result<(), String> {
    // Borrow every chunk first, then drop them together.
    let mut refs = Vec::with_capacity(total as usize);
    for i in 0..total {
        let k = key(req_id, request, i, total);
        let c = r.get(&k).ok_or_else(|| {
            format!("{req_id}: key {k} is not held (or not ready) at the receiver")
        })?;
        if !payloads().verify(chunk_id(request, i, total), c.bytes()) {
            return Err(format!(
                "{req_id}: chunk {i} (slot {}) does not hold the bytes stored",
                c.slot()
            ));
        }
        refs.push(c);
    }
    drop(refs);
    Ok(())
}

/// Waits (bounded) until the receiver reports `req_id` ready, then verifies
/// and releases its chunks.
pub fn consume(r: &Receiver, req_id: &str, request: u64, total: u32) -> Result<(), String> {
    r.wait_ready(req_id, deadline())
        .map_err(|e| format!("decoder waiting for {req_id} to be ready at the receiver: {e}"))?;
    read_and_release(r, req_id, request, total)
}

/// Polls `cond` until it holds; panics naming `what` after [`WAIT`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = deadline();
    let mut nap = Duration::from_micros(200);
    while !cond() {
        assert!(
            Instant::now() < end,
            "timed out after {WAIT:?} waiting for {what}"
        );
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(10));
    }
}

/// Waits (bounded) for a terminal status of `req_id` and returns it.
pub fn terminal(s: &Sender, req_id: &str) -> RequestStatus {
    let st = s
        .wait(req_id, deadline())
        .unwrap_or_else(|| panic!("sender does not know request {req_id}"));
    assert!(
        st.is_terminal(),
        "request {req_id} still in progress after {WAIT:?}; sender state: {:?}; staging slots in use {}, pending bytes {}",
        s.dump(),
        s.staging_in_use(),
        s.pending_bytes()
    );
    st
}

/// Joins a thread, failing the test (naming `what`) if it does not end
/// within [`WAIT`].
pub fn join_within<T>(what: &str, h: JoinHandle<T>) -> T {
    wait_for(what, || h.is_finished());
    match h.join() {
        Ok(v) => v,
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Waits until the receiver holds nothing: no reservation, no slot, no
/// tracked or parked request, nothing quarantined.
pub fn wait_receiver_empty(r: &Receiver, what: &str) {
    let mut last = None;
    let end = deadline();
    loop {
        let s = r.stats();
        if s.reserved_chunks == 0
            && s.allocated_chunks == 0
            && s.core.tracked_requests == 0
            && s.core.parked_requests == 0
            && s.core.quarantined_slots == 0
            && s.core.slots_in_use == 0
        {
            return;
        }
        assert!(
            Instant::now() < end,
            "timed out after {WAIT:?} waiting for the receiver to release everything ({what}); last stats: {last:?}"
        );
        last = Some(s);
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits until the sender holds no staging slot and no pending bytes.
pub fn wait_sender_empty(s: &Sender, what: &str) {
    let end = deadline();
    while s.staging_in_use() != 0 || s.pending_bytes() != 0 {
        assert!(
            Instant::now() < end,
            "timed out after {WAIT:?} waiting for the sender to free its staging and pending area ({what}); staging slots in use {}, pending bytes {}, requests: {:?}",
            s.staging_in_use(),
            s.pending_bytes(),
            s.dump()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A prefill daemon whose sender writes to a raw ZMQ ROUTER standing in
/// for an LMCache receiver (no Hello; the sender writes into `buffer`'s
/// file, a static peer; the test hands out its slots in the replies).
pub struct RawReceiverDaemon {
    /// The stand-in receiver's socket (its endpoint is receiver 0).
    pub router: zmq::Socket,
    /// A kvferry receiver only for its buffer file.
    pub buffer: Receiver,
    /// The sender: 8 staging slots in one share, LMCache mode.
    pub sender: std::sync::Arc<Sender>,
    /// The daemon serving attached workers on `sock`.
    pub daemon: kvferry::attach::PrefillDaemon,
}

impl RawReceiverDaemon {
    /// The next AllocRequest the stand-in receiver gets and the sender's
    /// identity; `None` if none comes within `wait`. Any other message
    /// fails the test.
    pub fn next_alloc(&self, wait: Duration) -> Option<(Vec<u8>, kvferry::protocol::AllocRequest)> {
        use kvferry::protocol::Message;
        let end = Instant::now() + wait;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut items = [self.router.as_poll_item(zmq::POLLIN)];
            if zmq::poll(&mut items, left.as_millis().clamp(1, 100) as i64).expect("poll") == 0 {
                continue;
            }
            let frames = self.router.recv_multipart(0).expect("recv");
            match kvferry::protocol::decode(frames.last().expect("a frame")) {
                Ok(Message::AllocRequest(m)) => return Some((frames[0].clone(), m)),
                other => panic!("expected an AllocRequest, got {other:?}"),
            }
        }
    }

    /// [`next_alloc`](Self::next_alloc) within [`WAIT`]; fails the test
    /// naming `what` if none comes.
    pub fn recv_alloc(&self, what: &str) -> (Vec<u8>, kvferry::protocol::AllocRequest) {
        self.next_alloc(WAIT)
            .unwrap_or_else(|| panic!("hung: no AllocRequest for {what}"))
    }

    /// Answers the AllocRequest of sender `id` with receiver slots
    /// `indexes` (one per key; none for an admission).
    pub fn reply(&self, id: &[u8], indexes: Vec<i64>) {
        use kvferry::protocol::{AllocResponse, Message};
        let r = kvferry::protocol::encode(&Message::AllocResponse(AllocResponse::ok(
            indexes,
            Vec::new(),
            None,
        )));
        self.router
            .send_multipart([id, &[][..], &r[..]], 0)
            .expect("reply");
    }
}

/// Starts a [`RawReceiverDaemon`] listening on `sock`.
pub fn raw_receiver_daemon(sock: &std::path::Path) -> RawReceiverDaemon {
    let buffer = receiver(8);
    let router = kvferry::zmq_io::context()
        .socket(zmq::ROUTER)
        .expect("router");
    router.set_linger(0).expect("linger");
    router.bind("tcp://127.0.0.1:0").expect("bind");
    let ep = router.get_last_endpoint().unwrap().unwrap();
    let run = kvferry::runner::RunConfig {
        static_buffers: vec![format!("{ep}={}", buffer.shm_path().display())],
        ..Default::default()
    };
    let sender = std::sync::Arc::new(self::sender(SenderConfig {
        staging_shares: 1,
        use_extensions: false,
        static_peers: run.static_peers().expect("static peer"),
        ..sender_cfg(8, None)
    }));
    let daemon = kvferry::attach::PrefillDaemon::start(
        std::sync::Arc::clone(&sender),
        vec![ep],
        kvferry::attach::AttachConfig::new(sock),
    )
    .expect("daemon starts");
    RawReceiverDaemon {
        router,
        buffer,
        sender,
        daemon,
    }
}

/// The next event of an attached worker (`what` names it if none comes).
pub fn next(c: &mut kvferry::attach::PrefillClient, what: &str) -> kvferry::attach::PrefillEvent {
    c.next_event(deadline())
        .unwrap_or_else(|e| panic!("no event for {what}: {e}"))
}

/// The next event of an attached worker, which must be STAGED.
pub fn staged(c: &mut kvferry::attach::PrefillClient, what: &str) -> kvferry::attach::StagedSlots {
    match next(c, what) {
        kvferry::attach::PrefillEvent::Staged(b) => b,
        other => panic!("{what}: expected STAGED, got {other:?}"),
    }
}

/// The next event of an attached worker, which must be REFUSED(`want`)
/// of `tag`.
pub fn expect_refused(
    c: &mut kvferry::attach::PrefillClient,
    tag: u64,
    want: kvferry::attach::Refusal,
    what: &str,
) {
    match next(c, what) {
        kvferry::attach::PrefillEvent::Refused { tag: t, reason } => {
            assert_eq!((t, reason), (tag, Some(want)), "{what}")
        }
        other => panic!("{what}: expected REFUSED({want:?}), got {other:?}"),
    }
}

/// The next event of an attached worker, which must be DONE of `tag`.
pub fn expect_done(c: &mut kvferry::attach::PrefillClient, tag: u64, what: &str) {
    match next(c, what) {
        kvferry::attach::PrefillEvent::Done { tag: t } => assert_eq!(t, tag, "{what}"),
        other => panic!("{what}: expected DONE, got {other:?}"),
    }
}
