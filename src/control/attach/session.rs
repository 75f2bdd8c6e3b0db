//! Decoder attach: [`DecoderDaemon`] over a [`Receiver`], and one attached
//! decoder's session: its subscriptions and held requests, served until
//! its socket closes (the lease) or the daemon stops. Everything the client
//! held is released when the session ends.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use kvferry_ring::spsc::Consumer;
use parking_lot::Mutex;

use super::daemon::{AttachConfig, Daemon, DaemonShared, Role};
use super::layout::{
    error_number, DecoderEvent, DecoderSubmit, Hello, Refusal, EV_CHUNK, EV_FAILED, EV_READY,
    EV_REFUSED, NO_TOKENS, OP_RELEASE, OP_SUBSCRIBE, ROLE_DECODER, STATUS_OK,
};
use super::poll::readable;
use super::serve::{open_rings, serve, Completions, RingFiles, Serve};
use crate::protocol::ErrorCode;
use crate::receiver::{Receiver, RequestChunks, RequestHandle, RequestStatus};
use crate::region::DATA_OFFSET;

/// The decoder role's daemon state.
pub(super) struct Decoders {
    receiver: Arc<Receiver>,
    /// `req_id`s subscribed by any client (one subscriber per request),
    /// at most `max_clients * max_outstanding` entries.
    subscribed: Mutex<HashSet<String>>,
}

/// Serves attached decoder processes over a running [`Receiver`] (see
/// `docs/attach.md`). Dropping it stops accepting, ends every session
/// (releasing what their clients held) and removes the socket and ring
/// directory.
#[derive(Debug)]
pub struct DecoderDaemon(Daemon<Decoders>);

impl DecoderDaemon {
    /// Binds `cfg.socket` (mode 0600), creates `cfg.ring_dir` (mode 0700) and
    /// starts the accept thread.
    pub fn start(receiver: Arc<Receiver>, cfg: AttachConfig) -> io::Result<Self> {
        let role = Decoders {
            receiver,
            subscribed: Mutex::new(HashSet::new()),
        };
        Daemon::start(role, cfg).map(Self)
    }

    /// The socket clients connect to.
    pub fn socket(&self) -> &Path {
        self.0.socket()
    }

    /// The directory of the per-client ring files
    /// ([`AttachConfig::ring_dir`]).
    pub fn ring_dir(&self) -> &Path {
        &self.0.shared.dir
    }

    /// Requests subscribed (pending or held) over all clients.
    pub fn subscriptions(&self) -> usize {
        self.0.shared.role.subscribed.lock().len()
    }

    /// Live attachments.
    pub fn clients(&self) -> usize {
        self.0.clients()
    }
}

impl Role for Decoders {
    type Session = Session;

    fn open(shared: &Arc<DaemonShared<Self>>, id: u32, sock: &UnixStream) -> io::Result<Session> {
        let region = shared.role.receiver.region();
        let mut hello = Hello::refusal(STATUS_OK);
        hello.role = ROLE_DECODER;
        hello.slots = region.capacity_chunks();
        hello.chunk_bytes = region.chunk_bytes();
        hello.data_offset = DATA_OFFSET;
        hello.buffer_path = region.path().to_string_lossy().into_owned();
        let rings = open_rings::<DecoderSubmit, DecoderEvent, _>(shared, id, sock, hello)?;
        let sq_cap = rings.sq.capacity();
        Ok(Session {
            id,
            sq: rings.sq,
            cq: rings.cq,
            _files: rings.files,
            tags: HashMap::with_capacity(shared.cfg.max_outstanding),
            waiting: Vec::with_capacity(shared.cfg.max_outstanding),
            scratch: Vec::new(),
            inbox: vec![DecoderSubmit::release(0); sq_cap],
            shared: Arc::clone(shared),
        })
    }

    fn run(mut session: Session, sock: UnixStream) {
        let span = tracing::debug_span!("attach_session", client = session.id);
        let _enter = span.enter();
        tracing::debug!("attached");
        let shared = Arc::clone(&session.shared);
        serve(&shared, sock, &mut session);
        // Dropping `session` releases every held request and subscription.
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
    req_id: String,
    sub: Sub,
}

/// One client's session (see the module docs).
pub(super) struct Session {
    shared: Arc<DaemonShared<Decoders>>,
    id: u32,
    sq: Consumer<DecoderSubmit>,
    /// Single events (FAILED, REFUSED) wait in its outbox for room.
    cq: Completions<DecoderEvent>,
    _files: RingFiles,
    tags: HashMap<u64, Entry>,
    /// Tags of `Sub::Waiting` entries, in the order of their descriptors
    /// after the first two of the last poll.
    waiting: Vec<u64>,
    /// Reused buffer for one request's READY + CHUNK entries.
    scratch: Vec<DecoderEvent>,
    /// Reused buffer for drained submissions.
    inbox: Vec<DecoderSubmit>,
}

impl Serve for Session {
    fn interest(&mut self, fds: &mut Vec<libc::pollfd>) -> bool {
        self.waiting.clear();
        let mut retry = !self.cq.outbox.is_empty();
        for (tag, e) in &self.tags {
            match &e.sub {
                Sub::Waiting(h) => {
                    fds.push(readable(h.as_raw_fd()));
                    self.waiting.push(*tag);
                }
                Sub::Taken { posted: false, .. } => retry = true,
                Sub::Taken { posted: true, .. } => {}
            }
        }
        retry
    }

    fn wake(&mut self, fds: &[libc::pollfd]) {
        self.cq.flush();
        self.read_submissions();
        let waiting = std::mem::take(&mut self.waiting);
        for (tag, fd) in waiting.iter().zip(fds) {
            if fd.revents != 0 {
                self.request_ended(*tag);
            }
        }
        self.waiting = waiting;
        self.post_taken();
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
                _ => self.refuse(s.tag, Refusal::BadOp),
            }
        }
    }

    fn subscribe(&mut self, s: &DecoderSubmit) {
        let Some(req_id) = s.req_id() else {
            return self.refuse(s.tag, Refusal::BadReqId);
        };
        if self.tags.contains_key(&s.tag) {
            return self.refuse(s.tag, Refusal::DuplicateTag);
        }
        if self.tags.len() >= self.shared.cfg.max_outstanding {
            return self.refuse(s.tag, Refusal::TooManyOutstanding);
        }
        if !self.shared.role.subscribed.lock().insert(req_id.to_owned()) {
            return self.refuse(s.tag, Refusal::AlreadySubscribed);
        }
        match self.shared.role.receiver.watch(req_id) {
            Ok(h) => {
                tracing::debug!(tag = s.tag, req_id, "subscribed");
                let req_id = req_id.to_owned();
                self.tags.insert(
                    s.tag,
                    Entry {
                        req_id,
                        sub: Sub::Waiting(h),
                    },
                );
                // It may have ended already: its fd is readable then and
                // the next poll returns at once.
            }
            Err(e) => {
                tracing::warn!(error = %e, "attach: cannot watch a request");
                self.shared.role.subscribed.lock().remove(req_id);
                self.refuse(s.tag, Refusal::TakeRefused);
            }
        }
    }

    fn release(&mut self, tag: u64) {
        match self.tags.remove(&tag) {
            Some(e) => {
                tracing::debug!(tag, req_id = %e.req_id, "released");
                self.shared.role.subscribed.lock().remove(&e.req_id);
            }
            None => self.refuse(tag, Refusal::UnknownTag),
        }
    }

    /// `tag`'s request ended (its fd became readable): take it or report.
    fn request_ended(&mut self, tag: u64) {
        let Some(e) = self.tags.get(&tag) else { return };
        let Sub::Waiting(h) = &e.sub else { return };
        let failed = match h.status() {
            RequestStatus::Pending => return,
            RequestStatus::Ready => match self.shared.role.receiver.take(&e.req_id) {
                Ok(chunks) if chunks.len() < self.cq.ring.capacity() => {
                    let e = self.tags.get_mut(&tag).expect("looked up above");
                    e.sub = Sub::Taken {
                        chunks,
                        posted: false,
                    };
                    return;
                }
                Ok(_) => Err(Refusal::TooManyChunks),
                Err(err) => {
                    tracing::debug!(tag, error = %err, "take refused");
                    Err(Refusal::TakeRefused)
                }
            },
            RequestStatus::Failed(code) => Ok(code),
            RequestStatus::ShutDown => Ok(ErrorCode::ShuttingDown),
        };
        if let Some(e) = self.tags.remove(&tag) {
            self.shared.role.subscribed.lock().remove(&e.req_id);
        }
        match failed {
            Ok(code) => self
                .cq
                .send(DecoderEvent::of(EV_FAILED, tag, error_number(code))),
            Err(why) => self.refuse(tag, why),
        }
    }

    /// Posts every taken request that is not on the ring yet and fits.
    fn post_taken(&mut self) {
        if !self.cq.outbox.is_empty() {
            return;
        }
        for (tag, e) in self.tags.iter_mut() {
            let Sub::Taken { chunks, posted } = &mut e.sub else {
                continue;
            };
            if *posted {
                continue;
            }
            self.scratch.clear();
            let mut ready = DecoderEvent::of(EV_READY, *tag, 0);
            ready.a = chunks.len() as u32;
            self.scratch.push(ready);
            for (i, c) in chunks.iter().enumerate() {
                self.scratch.push(DecoderEvent {
                    kind: EV_CHUNK,
                    code: 0,
                    tag: *tag,
                    a: c.slot(),
                    b: i as u32,
                    // A slot holds at most chunk_bytes, which the receiver
                    // keeps far below 4 GiB per chunk (lens are u32 on the
                    // wire).
                    len: u32::try_from(c.len()).unwrap_or(u32::MAX),
                    tokens: c.tokens().unwrap_or(NO_TOKENS),
                });
            }
            let Some(mut batch) = self.cq.ring.reserve(self.scratch.len()) else {
                return;
            };
            batch.fill_from(&self.scratch);
            batch.commit();
            *posted = true;
            tracing::debug!(tag, req_id = %e.req_id, chunks = chunks.len(), "delivered");
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let entries: Vec<Entry> = self.tags.drain().map(|(_, e)| e).collect();
        {
            let mut subscribed = self.shared.role.subscribed.lock();
            for e in &entries {
                subscribed.remove(&e.req_id);
            }
        }
        // Outside the subscription lock: dropping a held request's chunks
        // (or a watch) takes the receiver's lock.
        drop(entries);
        tracing::debug!(client = self.id, "detached; everything it held is released");
    }
}
