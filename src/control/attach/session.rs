//! Decoder attach: [`DecoderDaemon`] over a [`Receiver`], and one attached
//! decoder's session: its subscriptions and held requests, served until
//! its socket closes (the lease) or the daemon stops. Everything the client
//! held is released when the session ends.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use kvferry_ring::spsc::Consumer;
use parking_lot::Mutex;

use super::daemon::{AttachConfig, Daemon, DaemonShared, Role};
use super::layout::{
    error_number, DecoderEvent, DecoderSubmit, Hello, Refusal, DAEMON_TAG, EV_CHUNK, EV_FAILED,
    EV_READY, EV_REFUSED, MAX_REQ_ID, NAME_PART, NO_TOKENS, OP_RELEASE, OP_SUBSCRIBE,
    OP_SUBSCRIBE_ALL, ROLE_DECODER, STATUS_OK,
};
use super::poll::readable;
use super::poll::Peer;
use super::serve::{open_rings, woken, Completions, Doorbell, Serve};
use crate::eventfd::EventFd;
use crate::protocol::ErrorCode;
use crate::receiver::{
    ReadyFeed, Receiver, RequestChunks, RequestHandle, RequestStatus, TakeError,
};
use crate::region::DATA_OFFSET;

/// The decoder role's daemon state.
pub(super) struct Decoders {
    receiver: Arc<Receiver>,
    /// A read-only descriptor of the receive buffer (every client gets a
    /// copy of it in its hello).
    buffer: std::fs::File,
    /// `req_id`s subscribed by any client or delivered to a wildcard (one
    /// subscriber per request), at most `max_clients * max_outstanding`
    /// entries.
    subscribed: Mutex<HashSet<Arc<str>>>,
    /// The receiver's feed of ready requests while any client has a
    /// wildcard subscription.
    wild: Mutex<Wild>,
}

/// The ready feed the wildcard subscriptions share.
#[derive(Default)]
struct Wild {
    feed: Option<Arc<ReadyFeed>>,
    subscribers: usize,
}

/// Ready ids the shared feed holds at most beyond the receive buffer's
/// slot count (every ready request but an empty one holds a slot).
const FEED_SLACK: usize = 64;

/// Serves attached decoder processes over a running [`Receiver`] (see
/// `docs/attach.md`). Dropping it stops accepting, ends every session
/// (releasing what their clients held) and removes the socket.
#[derive(Debug)]
pub struct DecoderDaemon(Daemon<Decoders>);

impl DecoderDaemon {
    /// Makes the process non-dumpable (unless [`AttachConfig::keep_dumpable`]),
    /// binds `cfg.socket` (mode 0600) and starts the accept thread. An
    /// error if the receiver's buffer is caller memory at a pointer (no
    /// file a client could map).
    pub fn start(receiver: Arc<Receiver>, cfg: AttachConfig) -> io::Result<Self> {
        // The client gets a read-only descriptor of the receive buffer: it
        // cannot map it writable. Opened once, here, through the
        // receiver's own descriptor: the buffer keeps its name (senders of
        // the shm transport open it by path, docs/attach.md "Trust"), and
        // another process of the user may replace that name, with a FIFO
        // that would block an open on the accept thread, or another file.
        let buffer = receiver.region().reopen_read_only().ok_or_else(|| {
            io::Error::other("attach: the receive buffer is caller memory without a file")
        })??;
        let role = Decoders {
            buffer,
            receiver,
            subscribed: Mutex::new(HashSet::new()),
            wild: Mutex::new(Wild::default()),
        };
        Daemon::start(role, cfg).map(Self)
    }

    /// The socket clients connect to.
    pub fn socket(&self) -> &Path {
        self.0.socket()
    }

    /// Requests subscribed (pending or held) over all clients.
    pub fn subscriptions(&self) -> usize {
        self.0.shared.role.subscribed.lock().len()
    }

    /// Live attachments.
    pub fn clients(&self) -> usize {
        self.0.clients()
    }

    /// Times a session of this daemon moved off the CPU it shared with its
    /// client, where every hand-off between the two was a context switch
    /// (`docs/attach.md`, "Placing the threads"). Many of them mean the
    /// scheduler keeps placing sessions beside their clients: give the
    /// daemon CPUs of its own (`--cpus`).
    pub fn stepped_off(&self) -> u64 {
        self.0.stepped_off()
    }
}

impl Role for Decoders {
    const NAME: &'static str = "decoder";
    type Session = Session;

    fn open(
        shared: &Arc<DaemonShared<Self>>,
        id: u32,
        _peer: Peer,
        sock: &UnixStream,
    ) -> io::Result<Session> {
        let region = shared.role.receiver.region();
        let mut hello = Hello::refusal(STATUS_OK);
        hello.role = ROLE_DECODER;
        hello.slots = region.capacity_chunks();
        hello.chunk_bytes = region.chunk_bytes();
        hello.data_offset = DATA_OFFSET;
        let rings = open_rings::<DecoderSubmit, DecoderEvent, _>(
            shared,
            id,
            sock,
            hello,
            shared.role.buffer.as_fd(),
        )?;
        let sq_cap = rings.sq.capacity();
        Ok(Session {
            id,
            ended: Arc::new(EventFd::new()?),
            sq: rings.sq,
            cq: rings.cq,
            tags: HashMap::with_capacity(shared.cfg.max_outstanding),
            unposted: VecDeque::with_capacity(shared.cfg.max_outstanding),
            released: Vec::with_capacity(shared.cfg.max_outstanding),
            waiting: Vec::with_capacity(shared.cfg.max_outstanding),
            scratch: Vec::new(),
            inbox: vec![DecoderSubmit::release(0); sq_cap],
            wild: None,
            next_delivery: 0,
            shared: Arc::clone(shared),
        })
    }
}

/// Where one of the client's tags stands.
enum Sub {
    /// Subscribed; the request has not ended yet.
    Waiting(RequestHandle),
    /// Taken from the receiver for the client. `posted` once its READY and
    /// CHUNK entries are on the completion ring.
    Taken { chunks: RequestChunks, posted: bool },
}

struct Entry {
    /// Shared with the daemon's `subscribed` set: one copy per request.
    req_id: Arc<str>,
    sub: Sub,
    /// A wildcard delivery: its READY carries the `req_id` (NAME entries).
    named: bool,
}

/// One client's session (see the module docs).
pub(super) struct Session {
    shared: Arc<DaemonShared<Decoders>>,
    id: u32,
    sq: Consumer<DecoderSubmit>,
    /// Single events (FAILED, REFUSED) wait in its outbox for room.
    cq: Completions<DecoderEvent>,
    tags: HashMap<u64, Entry>,
    /// The tags of the `Sub::Taken { posted: false }` entries, oldest
    /// first: exactly those (a RELEASE of one removes it here too), so at
    /// most `max_outstanding`. Posted in this order, without a walk over
    /// every tag per wake-up.
    unposted: VecDeque<u64>,
    /// Entries the client released, whose return to the receiver (the
    /// chunks' slots, the subscription) waits until the session has
    /// answered what the client submitted behind the RELEASE (see
    /// [`Serve::idle`]); at most `max_outstanding`.
    released: Vec<Entry>,
    /// Signalled by every `Sub::Waiting` handle of this session when its
    /// request ends: one descriptor to poll, however many are waiting.
    ended: Arc<EventFd>,
    /// Reused buffer for the tags of waiting entries that ended.
    waiting: Vec<u64>,
    /// Reused buffer for one request's READY + CHUNK entries.
    scratch: Vec<DecoderEvent>,
    /// Reused buffer for drained submissions.
    inbox: Vec<DecoderSubmit>,
    /// The client's wildcard subscription: its tag and the shared feed.
    wild: Option<(u64, Arc<ReadyFeed>)>,
    /// Number of the next wildcard delivery (its tag is `DAEMON_TAG | n`).
    next_delivery: u64,
}

impl Serve for Session {
    fn signalled(&self) -> bool {
        self.ended.raised()
            || (self.wants_feed() && self.wild.as_ref().is_some_and(|(_, f)| f.raised()))
    }

    fn interest(&mut self, fds: &mut Vec<libc::pollfd>) -> bool {
        let retry = !self.cq.outbox.is_empty() || !self.unposted.is_empty();
        // First (`wake` reads its revents at index 0).
        fds.push(readable(self.ended.as_fd().as_raw_fd()));
        // Polled only while the client has room, so a full client does not
        // spin on it.
        if let Some((_, feed)) = &self.wild {
            if self.wants_feed() {
                fds.push(readable(feed.as_raw_fd()));
            }
        }
        retry
    }

    fn wake(&mut self, fds: &[libc::pollfd]) {
        self.cq.flush();
        self.read_submissions();
        if woken(&self.ended, fds.first()) {
            // Cleared before the statuses are read: an end signalled after
            // this raises the flag and leaves the fd readable anew.
            self.ended.clear();
            let mut waiting = std::mem::take(&mut self.waiting);
            waiting.clear();
            waiting.extend(self.tags.iter().filter_map(|(tag, e)| match &e.sub {
                Sub::Waiting(h) if h.status() != RequestStatus::Pending => Some(*tag),
                _ => None,
            }));
            for tag in &waiting {
                self.request_ended(*tag);
            }
            self.waiting = waiting;
        }
        self.claim_wild();
        if self.post_taken() {
            // The client reads what was just posted: the session's time is
            // its own until the next submission.
            self.return_released();
        }
    }

    fn submissions(&self) -> &dyn Doorbell {
        &self.sq
    }

    fn deferred(&self) -> bool {
        !self.released.is_empty()
    }

    fn idle(&mut self) {
        self.return_released();
    }
}

impl Session {
    fn refuse(&mut self, tag: u64, why: Refusal) {
        tracing::debug!(tag, reason = %why, "refused a submission");
        self.cq.send(DecoderEvent::of(EV_REFUSED, tag, why as u32));
    }

    fn read_submissions(&mut self) {
        // Bounded: not while the outbox is long, and at most one ring's
        // worth per wake-up (a client's bogus tail cannot keep us here).
        let room = self
            .cq
            .room(self.inbox.len(), self.shared.cfg.max_outstanding);
        let n = self.sq.pop_into(&mut self.inbox[..room]);
        for i in 0..n {
            let s = self.inbox[i];
            match s.op {
                OP_SUBSCRIBE => self.subscribe(&s),
                OP_RELEASE => self.release(s.tag),
                OP_SUBSCRIBE_ALL => self.subscribe_all(s.tag),
                _ => self.refuse(s.tag, Refusal::BadOp),
            }
        }
    }

    fn subscribe(&mut self, s: &DecoderSubmit) {
        let Some(req_id) = s.req_id() else {
            return self.refuse(s.tag, Refusal::BadReqId);
        };
        if self.tag_taken(s.tag) {
            return self.refuse(s.tag, Refusal::DuplicateTag);
        }
        if !self.has_room() {
            return self.refuse(s.tag, Refusal::TooManyOutstanding);
        }
        let id: Arc<str> = Arc::from(req_id);
        if !self.claim_id(&id) {
            return self.refuse(s.tag, Refusal::AlreadySubscribed);
        }
        // A request that is complete already (a decoder subscribing to one
        // it was told is done) is taken at once: no watch.
        let sub = match self.take(s.tag, req_id) {
            Ok(Some(chunks)) => Sub::Taken {
                chunks,
                posted: false,
            },
            Ok(None) => Sub::Waiting(
                self.shared
                    .role
                    .receiver
                    .watch_signalling(req_id, &self.ended),
            ),
            Err(why) => {
                self.shared.role.subscribed.lock().remove(req_id);
                return self.refuse(s.tag, why);
            }
        };
        tracing::debug!(tag = s.tag, req_id, "subscribed");
        let waiting = matches!(sub, Sub::Waiting(_));
        if !waiting {
            self.unposted.push_back(s.tag);
        }
        self.tags.insert(
            s.tag,
            Entry {
                req_id: id,
                sub,
                named: false,
            },
        );
        if waiting {
            // It may have ended between the take and the watch: handle it
            // now rather than after another poll (it failed, or became
            // ready just then).
            self.request_ended(s.tag);
        }
    }

    fn has_room(&self) -> bool {
        self.tags.len() < self.shared.cfg.max_outstanding
    }

    /// True while the wildcard's feed is worth watching: the client has
    /// room and nothing waits for room on its ring (else a full client
    /// would keep the session spinning on a feed it cannot take from).
    fn wants_feed(&self) -> bool {
        self.has_room() && self.cq.outbox.is_empty()
    }

    /// A tag the client cannot use: outstanding, its wildcard's, or the
    /// daemon's.
    fn tag_taken(&self, tag: u64) -> bool {
        tag & DAEMON_TAG != 0
            || self.tags.contains_key(&tag)
            || self.wild.as_ref().is_some_and(|(t, _)| *t == tag)
    }

    /// SUBSCRIBE_ALL: joins the wildcard subscribers (one per client).
    fn subscribe_all(&mut self, tag: u64) {
        if self.tag_taken(tag) {
            return self.refuse(tag, Refusal::DuplicateTag);
        }
        if self.wild.is_some() {
            return self.refuse(tag, Refusal::AlreadySubscribed);
        }
        let mut w = self.shared.role.wild.lock();
        let feed = match &w.feed {
            Some(f) => Arc::clone(f),
            None => {
                let r = &self.shared.role.receiver;
                match r.ready_feed(r.region().capacity_chunks() as usize + FEED_SLACK) {
                    Ok(f) => Arc::clone(w.feed.insert(Arc::new(f))),
                    Err(e) => {
                        drop(w);
                        tracing::warn!(error = %e, "attach: cannot set up the ready feed");
                        return self.refuse(tag, Refusal::TakeRefused);
                    }
                }
            }
        };
        w.subscribers += 1;
        drop(w);
        tracing::debug!(tag, "wildcard subscribed");
        self.wild = Some((tag, feed));
    }

    /// Ends the client's wildcard subscription, if any (deliveries it holds
    /// stay held).
    fn end_wild(&mut self) {
        let Some((_, feed)) = self.wild.take() else {
            return;
        };
        let mut w = self.shared.role.wild.lock();
        w.subscribers -= 1;
        let last = if w.subscribers == 0 {
            w.feed.take()
        } else {
            None
        };
        drop(w);
        // Outside the wild lock: dropping the feed takes the receiver's.
        drop((feed, last));
    }

    /// Claims ready requests nobody subscribed to from the feed while the
    /// client has room (`docs/attach.md`, "Routing").
    fn claim_wild(&mut self) {
        let Some((wtag, feed)) = &self.wild else {
            return;
        };
        let (wtag, feed) = (*wtag, Arc::clone(feed));
        while self.has_room() && self.cq.outbox.is_empty() {
            let Some(req_id) = feed.pop() else { break };
            // Longer ids are not nameable by a SUBSCRIBE either: they stay
            // in the receiver.
            if req_id.len() > MAX_REQ_ID {
                continue;
            }
            let req_id: Arc<str> = req_id.into();
            // A req_id subscription (or another wildcard) has it.
            if !self.claim_id(&req_id) {
                continue;
            }
            let names = req_id.len().div_ceil(NAME_PART);
            match self.shared.role.receiver.take(&req_id) {
                Ok(chunks) if chunks.len() + 1 + names <= self.cq.ring.capacity() => {
                    let tag = DAEMON_TAG | self.next_delivery;
                    self.next_delivery = (self.next_delivery + 1) & !DAEMON_TAG;
                    tracing::debug!(tag, req_id = &*req_id, "claimed by the wildcard");
                    self.unposted.push_back(tag);
                    self.tags.insert(
                        tag,
                        Entry {
                            req_id,
                            sub: Sub::Taken {
                                chunks,
                                posted: false,
                            },
                            named: true,
                        },
                    );
                }
                Ok(_) => {
                    self.shared.role.subscribed.lock().remove(&*req_id);
                    self.refuse(wtag, Refusal::TooManyChunks);
                }
                Err(e) => {
                    // Taken by id in process, ambiguous, an LMCache request.
                    tracing::debug!(req_id = &*req_id, error = %e, "wildcard: take refused");
                    self.shared.role.subscribed.lock().remove(&*req_id);
                }
            }
        }
    }

    fn release(&mut self, tag: u64) {
        if self.wild.as_ref().is_some_and(|(t, _)| *t == tag) {
            tracing::debug!(tag, "wildcard released");
            return self.end_wild();
        }
        match self.tags.remove(&tag) {
            Some(e) => {
                tracing::debug!(tag, req_id = %e.req_id, "released");
                if matches!(e.sub, Sub::Taken { posted: false, .. }) {
                    // Released before its READY was posted (a client that
                    // does not wait for it).
                    self.unposted.retain(|t| *t != tag);
                }
                // Returned after the session answered what follows (the
                // client's next SUBSCRIBE, most often): a drop takes the
                // receiver's lock and frees slots, work the client need
                // not wait for.
                self.released.push(e);
                if self.released.len() >= self.shared.cfg.max_outstanding {
                    self.return_released();
                }
            }
            None => self.refuse(tag, Refusal::UnknownTag),
        }
    }

    /// Adds `req_id` to the daemon's subscriptions; false if a
    /// subscription (of any client) has it. One this client released and
    /// the session has not returned yet is returned first: a RELEASE and a
    /// new SUBSCRIBE of the same `req_id` behave as if returned at once.
    fn claim_id(&mut self, req_id: &Arc<str>) -> bool {
        let insert = |s: &Self| s.shared.role.subscribed.lock().insert(Arc::clone(req_id));
        if insert(self) {
            return true;
        }
        if !self.released.iter().any(|e| e.req_id == *req_id) {
            return false;
        }
        self.return_released();
        insert(self)
    }

    /// Gives the released entries back: their subscriptions, then (outside
    /// the subscription lock: a drop takes the receiver's) their chunks'
    /// slots or their watches.
    fn return_released(&mut self) {
        if self.released.is_empty() {
            return;
        }
        {
            let mut subscribed = self.shared.role.subscribed.lock();
            for e in &self.released {
                subscribed.remove(&*e.req_id);
            }
        }
        self.released.clear();
    }

    /// Takes `req_id`'s chunks for the client under `tag`: `None` if it is
    /// not complete (or not known) yet, the refusal if it cannot be
    /// delivered.
    fn take(&self, tag: u64, req_id: &str) -> Result<Option<RequestChunks>, Refusal> {
        match self.shared.role.receiver.take(req_id) {
            Ok(chunks) if chunks.len() < self.cq.ring.capacity() => Ok(Some(chunks)),
            Ok(_) => Err(Refusal::TooManyChunks),
            Err(TakeError::NotReady(_)) => Ok(None),
            Err(err) => {
                tracing::debug!(tag, error = %err, "take refused");
                Err(Refusal::TakeRefused)
            }
        }
    }

    /// `tag`'s request may have ended (`ended` was signalled): take it or
    /// report.
    fn request_ended(&mut self, tag: u64) {
        let Some(e) = self.tags.get(&tag) else { return };
        let Sub::Waiting(h) = &e.sub else { return };
        let failed = match h.status() {
            RequestStatus::Pending => return,
            RequestStatus::Ready => match self.take(tag, &e.req_id) {
                Ok(Some(chunks)) => {
                    let e = self.tags.get_mut(&tag).expect("looked up above");
                    e.sub = Sub::Taken {
                        chunks,
                        posted: false,
                    };
                    self.unposted.push_back(tag);
                    return;
                }
                // Ready, yet nothing to take: taken by id in process.
                Ok(None) => Err(Refusal::TakeRefused),
                Err(why) => Err(why),
            },
            RequestStatus::Failed(code) => Ok(code),
            RequestStatus::ShutDown => Ok(ErrorCode::ShuttingDown),
        };
        if let Some(e) = self.tags.remove(&tag) {
            self.shared.role.subscribed.lock().remove(&*e.req_id);
        }
        match failed {
            Ok(code) => self
                .cq
                .send(DecoderEvent::of(EV_FAILED, tag, error_number(code))),
            Err(why) => self.refuse(tag, why),
        }
    }

    /// Posts the taken requests not on the ring yet, oldest first, while
    /// they fit; true if it posted any.
    fn post_taken(&mut self) -> bool {
        if !self.cq.outbox.is_empty() {
            return false;
        }
        let mut posted_any = false;
        while let Some(&tag) = self.unposted.front() {
            let Some(Entry {
                req_id,
                sub: Sub::Taken { chunks, posted },
                named,
            }) = self.tags.get_mut(&tag)
            else {
                // Not reachable (`unposted` holds exactly the unposted
                // entries); dropped rather than trusted.
                self.unposted.pop_front();
                continue;
            };
            if *posted {
                self.unposted.pop_front();
                continue;
            }
            self.scratch.clear();
            let mut ready = DecoderEvent::of(EV_READY, tag, 0);
            ready.a = chunks.len() as u32;
            if *named {
                // At most MAX_REQ_ID bytes (claim_wild).
                ready.b = req_id.len() as u32;
                self.scratch.push(ready);
                for part in req_id.as_bytes().chunks(NAME_PART) {
                    self.scratch.push(DecoderEvent::name_part(tag, part));
                }
            } else {
                self.scratch.push(ready);
            }
            for (i, c) in chunks.iter().enumerate() {
                self.scratch.push(DecoderEvent {
                    kind: EV_CHUNK,
                    code: 0,
                    tag,
                    a: c.slot(),
                    b: i as u32,
                    // A slot holds at most chunk_bytes, which the receiver
                    // refuses at 4 GiB or more (`Receiver::start`), so the
                    // length always fits.
                    len: u32::try_from(c.len()).unwrap_or(u32::MAX),
                    tokens: c.tokens().unwrap_or(NO_TOKENS),
                });
            }
            let Some(mut batch) = self.cq.ring.reserve(self.scratch.len()) else {
                return posted_any;
            };
            batch.fill_from(&self.scratch);
            batch.commit();
            *posted = true;
            posted_any = true;
            self.unposted.pop_front();
            tracing::debug!(tag, req_id = %req_id, chunks = chunks.len(), "delivered");
        }
        posted_any
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.end_wild();
        // Everything the client held or waited for goes back as a release.
        self.released.extend(self.tags.drain().map(|(_, e)| e));
        self.return_released();
        tracing::debug!(client = self.id, "detached; everything it held is released");
    }
}
