//! The Rust decoder client: attach to a receiver's socket, subscribe to
//! requests, read their chunks in place from the read-only receive buffer,
//! release them.

use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::{self, Consumer, Producer};
use kvferry_ring::{Plain, ShmError, WaitStatus};
use memmap2::Mmap;

use super::affinity::keep_off_engine_cpu;
use super::fds::recv_with_fds;
use super::layout::{
    error_from_number, DecoderEvent, DecoderSubmit, Hello, HelloError, Refusal, DAEMON_TAG,
    EV_CHUNK, EV_FAILED, EV_NAME, EV_READY, EV_REFUSED, HELLO_FDS, HELLO_LEN, MAX_REQ_ID,
    NAME_PART, NO_TOKENS, OP_SUBSCRIBE_ALL, ROLE_DECODER, STATUS_OK,
};
use crate::protocol::ErrorCode;
use crate::util::linger::{linger, slept};

/// Errors of a [`DecoderClient`].
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The socket or a file could not be used.
    #[error("attach: {0}")]
    Io(#[from] io::Error),
    /// The hello could not be parsed.
    #[error("attach hello: {0}")]
    Hello(#[from] HelloError),
    /// The daemon refused the attachment with this hello status.
    #[error("attach refused by the daemon (status {0})")]
    Refused(u32),
    /// A ring failed validation or its side was taken.
    #[error("attach ring: {0}")]
    Ring(#[from] ShmError),
    /// An accepting hello came without exactly its descriptors
    /// (`SCM_RIGHTS`: none, too few, or more than the role's; every one
    /// received was closed).
    #[error("attach hello carried {got} descriptors (and {extra} more), expected {expected}")]
    Descriptors {
        /// Descriptors the hello must carry ([`HELLO_FDS`]).
        expected: u32,
        /// Descriptors received, up to `expected`.
        got: usize,
        /// Descriptors received past `expected` (closed).
        extra: usize,
    },
    /// The daemon sent something that breaks the protocol.
    #[error("attach protocol: {0}")]
    Protocol(String),
    /// `req_id` is empty or longer than the inline field.
    #[error("req_id must be 1..={MAX_REQ_ID} bytes")]
    BadReqId,
    /// This client already has its maximum of outstanding requests.
    #[error("too many outstanding requests")]
    TooManyOutstanding,
    /// The submission ring is full (the daemon is behind); retry.
    #[error("submission ring full")]
    Full,
    /// The daemon closed the attachment.
    #[error("the daemon closed the attachment")]
    Closed,
    /// The deadline passed without an event.
    #[error("no event before the deadline")]
    Timeout,
}

/// One chunk of a delivered request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkDesc {
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// Length in bytes.
    pub len: u32,
    /// Token count, if the chunk carried one.
    pub tokens: Option<u32>,
}

/// A request delivered to this client: its chunks are held for it until
/// [`DecoderClient::release`] (or the client's exit).
#[derive(Debug)]
pub struct Delivery {
    tag: u64,
    serial: u64,
    req_id: String,
    chunks: Vec<ChunkDesc>,
}

impl Delivery {
    /// The request id.
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// The chunks, in key order.
    pub fn chunks(&self) -> &[ChunkDesc] {
        &self.chunks
    }

    /// The tag the subscription returned; for a wildcard delivery, the
    /// daemon's tag of this delivery (bit 63 set).
    pub fn tag(&self) -> u64 {
        self.tag
    }
}

/// What [`DecoderClient::next_event`] returns.
#[derive(Debug)]
pub enum Event {
    /// A subscribed request is complete; read it with
    /// [`DecoderClient::chunk`], then [`DecoderClient::release`] it.
    Ready(Delivery),
    /// A subscribed request failed (`code` is `None` for a code this build
    /// does not know).
    Failed {
        /// The subscription's tag.
        tag: u64,
        /// Its request id.
        req_id: String,
        /// Why.
        code: Option<ErrorCode>,
    },
    /// The daemon refused a submission.
    Refused {
        /// The submission's tag.
        tag: u64,
        /// Its request id, if the tag was a subscription.
        req_id: Option<String>,
        /// Why (`None` for a code this build does not know).
        reason: Option<Refusal>,
    },
}

enum TagState {
    Subscribed(String),
    Held(u64),
}

/// The descriptors an accepting hello hands over, in the order of the
/// ancillary data (docs/attach.md, "Handshake").
pub(super) struct Handoff {
    /// The submission ring's memfd.
    pub(super) sq: File,
    /// The completion ring's memfd.
    pub(super) cq: File,
    /// The receive buffer (read-only) or the worker's staging share.
    pub(super) data: File,
}

/// Connects to `socket`, reads and checks the hello (status, `role`, entry
/// sizes of `S` and `E`) and takes exactly its [`HELLO_FDS`] descriptors.
pub(super) fn handshake<S, E>(
    socket: &Path,
    timeout: Duration,
    role: u32,
) -> Result<(UnixStream, Hello, Handoff), AttachError> {
    let sock = UnixStream::connect(socket)?;
    sock.set_read_timeout(Some(timeout))?;
    let mut b = [0u8; HELLO_LEN];
    let got = recv_with_fds(&sock, &mut b, HELLO_FDS as usize)?;
    if got.len < HELLO_LEN {
        return Err(AttachError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the daemon closed after {} bytes of the hello", got.len),
        )));
    }
    let hello = Hello::decode(&b)?;
    if hello.status != STATUS_OK {
        return Err(AttachError::Refused(hello.status));
    }
    let bad = AttachError::Descriptors {
        expected: HELLO_FDS,
        got: got.fds.len(),
        extra: got.extra,
    };
    let [sq, cq, data]: [_; HELLO_FDS as usize] = match got.fds.try_into() {
        Ok(fds) if got.extra == 0 && hello.fds == HELLO_FDS => fds,
        _ => return Err(bad),
    };
    let handoff = Handoff {
        sq: File::from(sq),
        cq: File::from(cq),
        data: File::from(data),
    };
    if hello.role != role
        || hello.sq_entry as usize != std::mem::size_of::<S>()
        || hello.cq_entry as usize != std::mem::size_of::<E>()
    {
        return Err(AttachError::Protocol(format!(
            "role {} or entry sizes {}/{} not this build's",
            hello.role, hello.sq_entry, hello.cq_entry
        )));
    }
    Ok((sock, hello, handoff))
}

/// Rings the submission doorbell after pushing to `sq`: one byte on the
/// socket, only if the session armed its need-wakeup flag before sleeping
/// (docs/attach.md, "Doorbell"); a session still lingering finds the
/// entries without it.
pub(super) fn doorbell<S: Plain>(
    sq: &mut Producer<S>,
    sock: &mut UnixStream,
) -> Result<(), AttachError> {
    if sq.take_wakeup() {
        ring_socket(sock)?;
    }
    Ok(())
}

/// Why a push onto `sq` failed: the daemon's session closed the ring, or
/// it is full.
pub(super) fn full_or_closed<S: Plain>(sq: &Producer<S>) -> AttachError {
    if sq.is_closed() {
        AttachError::Closed
    } else {
        AttachError::Full
    }
}

/// Writes one doorbell byte whatever the flag says (a full ring: wake the
/// session to drain it). A byte the session did not need is harmless.
pub(super) fn ring_socket(sock: &mut UnixStream) -> Result<(), AttachError> {
    sock.write_all(&[1]).map_err(|e| match e.kind() {
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => AttachError::Closed,
        _ => AttachError::Io(e),
    })
}

/// Waits for the next completion entry until `deadline`: pops it, else
/// stays awake a moment (the daemon's answer usually comes sooner than a
/// futex wake-up would), else sleeps on the ring's futex.
pub(super) fn next_entry(
    cq: &mut Consumer<DecoderEvent>,
    deadline: Instant,
) -> Result<DecoderEvent, AttachError> {
    loop {
        if let Some(ev) = cq.pop() {
            return Ok(ev);
        }
        if linger(|| !cq.is_empty()) {
            continue;
        }
        let asleep = Instant::now();
        match cq.wait(Some(deadline)) {
            // The sleep after a failed linger: it adapts the next one.
            WaitStatus::Ready => slept(asleep.elapsed()),
            WaitStatus::Closed => return Err(AttachError::Closed),
            WaitStatus::TimedOut => return Err(AttachError::Timeout),
        }
    }
}

/// Pops the `n` entries of kind `kind` that follow `head` (published with
/// it, in one tail store): each must carry `head`'s tag and its index in
/// `b`, and `each` checks and maps the rest (`None`: a bad entry).
pub(super) fn follow_ons<T>(
    cq: &mut Consumer<DecoderEvent>,
    head: &DecoderEvent,
    kind: u32,
    n: usize,
    what: &str,
    mut each: impl FnMut(&DecoderEvent) -> Option<T>,
) -> Result<Vec<T>, AttachError> {
    if n >= cq.capacity() {
        return Err(AttachError::Protocol(format!(
            "{what}: more entries than the ring holds: {head:?}"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let c = cq.pop().ok_or_else(|| {
            AttachError::Protocol(format!("{what}: not followed by its entries: {head:?}"))
        })?;
        let item = (c.kind == kind && c.tag == head.tag && c.b as usize == i)
            .then(|| each(&c))
            .flatten()
            .ok_or_else(|| AttachError::Protocol(format!("{what}: bad entry {c:?}")))?;
        out.push(item);
    }
    Ok(out)
}

/// Pops the `n` entries that follow `head`, checked as [`follow_ons`]
/// checks them, and drops them: an event the client does not hand out.
pub(super) fn skip_follow_ons(
    cq: &mut Consumer<DecoderEvent>,
    head: &DecoderEvent,
    kind: u32,
    n: usize,
    what: &str,
) -> Result<(), AttachError> {
    follow_ons(cq, head, kind, n, what, |_| Some(())).map(drop)
}

/// How often [`DecoderClient::next_event`] retries releases that found
/// the submission ring full.
const DEFERRED_RETRY: Duration = Duration::from_millis(1);

/// An attached decoder (see `docs/attach.md`). Not `Sync`: one thread
/// drives it.
///
/// A decoder reads a request in place from a receiver daemon (here in
/// the same process; usually `kvferry receiver --attach` or `kvferry
/// node`) and gives its slots back:
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvferry::attach::{DecoderClient, Event};
///
/// let deadline = Instant::now() + Duration::from_secs(20);
/// # use std::sync::Arc;
/// # use kvferry::attach::{AttachConfig, DecoderDaemon};
/// # use kvferry::{Receiver, ReceiverConfig, RequestSpec, Sender, SenderConfig};
/// # let receiver = Arc::new(Receiver::start(ReceiverConfig {
/// #     listen: "tcp://127.0.0.1:0".into(),
/// #     capacity_chunks: 8,
/// #     chunk_bytes: 4096,
/// #     ..Default::default()
/// # })?);
/// # let socket = std::env::temp_dir().join(format!("kvferry-doc-d{}.sock", std::process::id()));
/// # let cfg = AttachConfig { keep_dumpable: true, ..AttachConfig::new(&socket) };
/// # let daemon = DecoderDaemon::start(Arc::clone(&receiver), cfg)?;
/// # let sender = Sender::new(SenderConfig { chunk_bytes: 4096, staging_slots: 4, ..Default::default() })?;
/// # let req = sender.begin(RequestSpec::new("req-7", receiver.endpoint(), 2))?;
/// # req.store(&["req-7/0", "req-7/1"], &[&[0u8; 4096][..], &[1u8; 100][..]])?;
/// // `socket` is the path the daemon printed ("kvferry receiver attach on ...").
/// let mut decoder = DecoderClient::connect(&socket, Duration::from_secs(5))?;
/// let tag = decoder.subscribe("req-7")?;
/// let Event::Ready(delivery) = decoder.next_event(deadline)? else {
///     panic!("expected req-7");
/// };
/// assert_eq!(delivery.tag(), tag);
/// for i in 0..delivery.chunks().len() {
///     // In place, in the receive buffer (mapped read-only).
///     // (Every chunk is full but the last, as LMCache sends them.)
///     let bytes = decoder.chunk(&delivery, i).expect("a delivered chunk");
///     assert!(bytes.iter().all(|&b| b == i as u8));
/// }
/// decoder.release(delivery)?; // the slots go back to the receiver
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DecoderClient {
    sock: UnixStream,
    sq: Producer<DecoderSubmit>,
    cq: Consumer<DecoderEvent>,
    buf: Mmap,
    hello: Hello,
    /// [`DecoderClient::kept_off_cpu`].
    kept_off: Option<usize>,
    tags: HashMap<u64, TagState>,
    /// The wildcard subscription's tag, while it stands.
    wild: Option<u64>,
    /// Set by the first wildcard subscription: deliveries with daemon tags
    /// are accepted from then on (some may arrive after an unsubscribe).
    wild_ever: bool,
    next_tag: u64,
    next_serial: u64,
    /// Tags of releases that found the submission ring full, oldest
    /// first: sent before any later submission (one per delivery given
    /// up, so at most `max_outstanding`).
    deferred: VecDeque<u64>,
}

impl std::fmt::Debug for DecoderClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecoderClient")
            .field("client_id", &self.hello.client_id)
            .field("outstanding", &self.tags.len())
            .finish()
    }
}

impl DecoderClient {
    /// Attaches to the daemon listening on `socket`, waiting at most
    /// `timeout` for its hello.
    pub fn connect(socket: impl AsRef<Path>, timeout: Duration) -> Result<Self, AttachError> {
        let (sock, hello, fds) =
            handshake::<DecoderSubmit, DecoderEvent>(socket.as_ref(), timeout, ROLE_DECODER)?;
        let sq = spsc::shared::from_file::<DecoderSubmit>(&fds.sq, "attach sq")?.producer()?;
        let cq = spsc::shared::from_file::<DecoderEvent>(&fds.cq, "attach cq")?.consumer()?;
        let file = fds.data;
        let need = hello
            .slots
            .checked_mul(hello.chunk_bytes)
            .and_then(|d| d.checked_add(hello.data_offset))
            .ok_or_else(|| AttachError::Protocol("buffer geometry overflows".into()))?;
        if file.metadata()?.len() < need {
            return Err(AttachError::Protocol(format!(
                "buffer file shorter than {need} bytes"
            )));
        }
        // SAFETY: the descriptor is read-only (the daemon opened it so) and
        // mapped read-only (we never write through it). The receiver never truncates its buffer
        // while running, and it writes a slot only while no client holds it:
        // bytes are read (`chunk`) only for slots of a held `Delivery`.
        let buf = unsafe { Mmap::map(&file) }?;
        if (buf.len() as u64) < need {
            return Err(AttachError::Protocol("buffer mapping too short".into()));
        }
        // The slots' page tables filled now, not by a page fault as the
        // first deliveries reach each page (several µs each on a VM; a
        // 256 KiB chunk is 64 pages). Best effort: a kernel before 5.14
        // refuses the advice, and the pages fault in on first use.
        let _ = buf.advise_range(memmap2::Advice::PopulateRead, 0, need as usize);
        // Last: a refused attach leaves the thread's set as it was.
        let kept_off = keep_off_engine_cpu(&hello);
        Ok(Self {
            sock,
            sq,
            cq,
            buf,
            hello,
            kept_off,
            tags: HashMap::new(),
            wild: None,
            wild_ever: false,
            deferred: VecDeque::new(),
            next_tag: 1,
            next_serial: 1,
        })
    }

    /// The daemon's hello (geometry, limits).
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The CPU this attach took out of the attaching thread's affinity set
    /// (the one the daemon keeps for a copy engine, [`Hello::engine_cpu`]);
    /// `None` if the daemon keeps none, the thread may run there only, or
    /// [`KEEP_AFFINITY_ENV`](super::KEEP_AFFINITY_ENV) is set
    /// (docs/attach.md, "Placing the threads").
    pub fn kept_off_cpu(&self) -> Option<usize> {
        self.kept_off
    }

    fn submit(&mut self, s: DecoderSubmit) -> Result<(), AttachError> {
        // After the releases still waiting for room, in order.
        if !self.flush_deferred()? {
            return Err(full_or_closed(&self.sq));
        }
        self.sq.push(s).map_err(|_| full_or_closed(&self.sq))?;
        doorbell(&mut self.sq, &mut self.sock)
    }

    /// Pushes the deferred releases while the ring has room; true once
    /// none is left. A ring still full is rung: the session drains it as
    /// soon as its completion ring has room (the caller reads events).
    fn flush_deferred(&mut self) -> Result<bool, AttachError> {
        if self.deferred.is_empty() {
            return Ok(true);
        }
        while let Some(&tag) = self.deferred.front() {
            if self.sq.push(DecoderSubmit::release(tag)).is_err() {
                ring_socket(&mut self.sock)?;
                return Ok(false);
            }
            self.deferred.pop_front();
        }
        doorbell(&mut self.sq, &mut self.sock)?;
        Ok(true)
    }

    /// Subscribes to `req_id`; returns the tag its events carry.
    pub fn subscribe(&mut self, req_id: &str) -> Result<u64, AttachError> {
        if self.tags.len() >= self.hello.max_outstanding as usize {
            return Err(AttachError::TooManyOutstanding);
        }
        let tag = self.next_tag;
        let s = DecoderSubmit::subscribe(tag, req_id).ok_or(AttachError::BadReqId)?;
        self.submit(s)?;
        self.next_tag += 1;
        self.tags
            .insert(tag, TagState::Subscribed(req_id.to_owned()));
        Ok(tag)
    }

    /// Subscribes to every request that becomes ready and that no `req_id`
    /// subscription (of any client) claims, as routed in `docs/attach.md`
    /// ("Routing"); returns the wildcard's tag (give it to
    /// [`unsubscribe`](Self::unsubscribe) to stop). Its deliveries arrive
    /// as [`Event::Ready`] with [`Delivery::req_id`] and a daemon tag, and
    /// count against the outstanding bound until released.
    pub fn subscribe_all(&mut self) -> Result<u64, AttachError> {
        if self.wild.is_some() {
            return Err(AttachError::Protocol(
                "a wildcard subscription stands".into(),
            ));
        }
        let tag = self.next_tag;
        let mut s = DecoderSubmit::release(tag);
        s.op = OP_SUBSCRIBE_ALL;
        self.submit(s)?;
        self.next_tag += 1;
        self.wild = Some(tag);
        self.wild_ever = true;
        Ok(tag)
    }

    /// Sends a raw submission, unchecked (for tests of the daemon's
    /// validation: a client that lies about its tags).
    #[doc(hidden)]
    pub fn submit_raw(&mut self, s: DecoderSubmit) -> Result<(), AttachError> {
        self.submit(s)
    }

    /// Drops a subscription not delivered yet. A delivery or failure the
    /// daemon posted before it read the unsubscribe is skipped by
    /// [`next_event`](Self::next_event), never returned: the daemon
    /// releases such a delivery (the request is consumed, its slots go
    /// back) as it would a RELEASE of a delivery.
    pub fn unsubscribe(&mut self, tag: u64) -> Result<(), AttachError> {
        if self.wild == Some(tag) {
            self.submit(DecoderSubmit::release(tag))?;
            self.wild = None;
            return Ok(());
        }
        match self.tags.get(&tag) {
            Some(TagState::Subscribed(_)) => {
                self.submit(DecoderSubmit::release(tag))?;
                self.tags.remove(&tag);
                Ok(())
            }
            _ => Err(AttachError::Protocol(format!(
                "tag {tag} is not a subscription"
            ))),
        }
    }

    /// Gives a delivered request's slots back to the receiver. Never
    /// fails for a full submission ring (the delivery is consumed, so it
    /// could not be released again): the RELEASE then waits in the client
    /// and goes out before any later submission, at the latest from the
    /// next [`next_event`](Self::next_event) that finds room.
    pub fn release(&mut self, d: Delivery) -> Result<(), AttachError> {
        match self.tags.get(&d.tag) {
            Some(TagState::Held(serial)) if *serial == d.serial => {}
            _ => return Err(AttachError::Protocol("not this client's delivery".into())),
        }
        self.tags.remove(&d.tag);
        // Behind any release still waiting, and out at once if there is
        // room (the queue reuses its buffer: nothing allocated per release).
        self.deferred.push_back(d.tag);
        self.flush_deferred().map(drop)
    }

    /// The bytes of chunk `i` of `d`, in place (read-only mapping). `None`
    /// if `i` is out of range or `d` is not held by this client.
    pub fn chunk<'a>(&'a self, d: &'a Delivery, i: usize) -> Option<&'a [u8]> {
        match self.tags.get(&d.tag) {
            Some(TagState::Held(serial)) if *serial == d.serial => {}
            _ => return None,
        }
        let c = d.chunks.get(i)?;
        // In range: checked against the geometry when the event arrived.
        let off = (self.hello.data_offset + u64::from(c.slot) * self.hello.chunk_bytes) as usize;
        self.buf.get(off..off + c.len as usize)
    }

    /// Waits until the next event or `deadline`.
    pub fn next_event(&mut self, deadline: Instant) -> Result<Event, AttachError> {
        loop {
            // Releases waiting for room are retried every millisecond
            // meanwhile: the event waited for may need their slots.
            let slice = if self.flush_deferred()? {
                deadline
            } else {
                deadline.min(Instant::now() + DEFERRED_RETRY)
            };
            let ev = match next_entry(&mut self.cq, slice) {
                Err(AttachError::Timeout) if slice < deadline => continue,
                ev => ev?,
            };
            if let Some(out) = self.on_event(ev)? {
                return Ok(out);
            }
        }
    }

    /// The `req_id` of a wildcard delivery: the NAME entries after its
    /// READY (`ev.b` bytes, published with it).
    fn read_name(&mut self, ev: &DecoderEvent) -> Result<String, AttachError> {
        let len = ev.b as usize;
        if len == 0 || len > MAX_REQ_ID {
            return Err(AttachError::Protocol(format!("bad req_id length: {ev:?}")));
        }
        let mut name = Vec::with_capacity(len);
        while name.len() < len {
            let e = self
                .cq
                .pop()
                .ok_or_else(|| AttachError::Protocol("READY not followed by its name".into()))?;
            let (bytes, n) = e.name_bytes();
            let want = (len - name.len()).min(NAME_PART);
            if e.kind != EV_NAME || e.tag != ev.tag || n != want {
                return Err(AttachError::Protocol(format!("bad NAME entry {e:?}")));
            }
            name.extend_from_slice(&bytes[..n]);
        }
        String::from_utf8(name).map_err(|_| AttachError::Protocol("req_id not UTF-8".into()))
    }

    /// True for a tag this client gave out and no longer tracks: one it
    /// unsubscribed (or released). An event for it was posted before the
    /// daemon read the RELEASE (the daemon posts nothing for a tag after
    /// that): a delivery it then released unseen, or a failure. Tags are
    /// never reused, so no bookkeeping of past tags is needed.
    fn let_go(&self, tag: u64) -> bool {
        tag & DAEMON_TAG == 0 && tag < self.next_tag && !self.tags.contains_key(&tag)
    }

    fn on_event(&mut self, ev: DecoderEvent) -> Result<Option<Event>, AttachError> {
        let bad = |what: &str| AttachError::Protocol(format!("{what}: {ev:?}"));
        match ev.kind {
            EV_READY => {
                // A subscription's name moves out of its entry below, once
                // the delivery is whole; a wildcard delivery's comes next.
                let named = match self.tags.get(&ev.tag) {
                    Some(TagState::Subscribed(_)) if ev.b == 0 => None,
                    None if ev.tag & DAEMON_TAG != 0 && self.wild_ever => {
                        Some(self.read_name(&ev)?)
                    }
                    None if ev.b == 0 && self.let_go(ev.tag) => {
                        // Unsubscribed while its READY was on the way: the
                        // daemon released it on the RELEASE (its slots are
                        // another request's by now). Its entries are
                        // skipped, never shown.
                        skip_follow_ons(&mut self.cq, &ev, EV_CHUNK, ev.a as usize, "READY")?;
                        return Ok(None);
                    }
                    _ => return Err(bad("READY for a tag not subscribed")),
                };
                let (slots, chunk_bytes) = (self.hello.slots, self.hello.chunk_bytes);
                let chunks =
                    follow_ons(&mut self.cq, &ev, EV_CHUNK, ev.a as usize, "READY", |c| {
                        (u64::from(c.a) < slots && u64::from(c.len) <= chunk_bytes).then_some(
                            ChunkDesc {
                                slot: c.a,
                                len: c.len,
                                tokens: (c.tokens != NO_TOKENS).then_some(c.tokens),
                            },
                        )
                    })?;
                let serial = self.next_serial;
                self.next_serial += 1;
                let held = TagState::Held(serial);
                let req_id = match (named, self.tags.insert(ev.tag, held)) {
                    (Some(name), _) => name,
                    (None, Some(TagState::Subscribed(req_id))) => req_id,
                    _ => return Err(bad("READY for a tag not subscribed")),
                };
                Ok(Some(Event::Ready(Delivery {
                    tag: ev.tag,
                    serial,
                    req_id,
                    chunks,
                })))
            }
            EV_FAILED => {
                if self.let_go(ev.tag) {
                    // Unsubscribed while its FAILED was on the way.
                    return Ok(None);
                }
                let Some(TagState::Subscribed(req_id)) = self.tags.remove(&ev.tag) else {
                    return Err(bad("FAILED for a tag not subscribed"));
                };
                Ok(Some(Event::Failed {
                    tag: ev.tag,
                    req_id,
                    code: error_from_number(ev.code),
                }))
            }
            EV_REFUSED => {
                // A refused SUBSCRIBE_ALL ends the wildcard; a request too
                // large for the ring (7), refused to it, does not.
                if self.wild == Some(ev.tag)
                    && Refusal::from_code(ev.code) != Some(Refusal::TooManyChunks)
                {
                    self.wild = None;
                }
                // A refused RELEASE leaves the tag as it was; a refused
                // SUBSCRIBE frees it.
                let req_id = match self.tags.get(&ev.tag) {
                    Some(TagState::Subscribed(r)) => {
                        let r = r.clone();
                        self.tags.remove(&ev.tag);
                        Some(r)
                    }
                    _ => None,
                };
                Ok(Some(Event::Refused {
                    tag: ev.tag,
                    req_id,
                    reason: Refusal::from_code(ev.code),
                }))
            }
            _ => Err(bad("unknown event kind")),
        }
    }
}
