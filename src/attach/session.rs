//! One attached decoder: its rings, its subscriptions and held requests,
//! and the loop that serves them until its socket closes (the lease) or the
//! daemon stops. Everything the client held is released when the loop ends.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvferry_ring::spsc::{self, Consumer, Producer};

use super::daemon::DaemonShared;
use super::layout::{
    error_number, DecoderEvent, DecoderSubmit, Hello, Refusal, ATTACH_VERSION, EV_CHUNK, EV_FAILED,
    EV_READY, EV_REFUSED, NO_TOKENS, OP_RELEASE, OP_SUBSCRIBE, ROLE_DECODER, STATUS_OK,
};
use super::poll::{poll, readable};
use crate::protocol::ErrorCode;
use crate::receiver::{RequestChunks, RequestHandle, RequestStatus};
use crate::region::DATA_OFFSET;

/// How long the loop sleeps between retries while the completion ring is
/// too full for what it has to post (the client frees it without telling).
const FULL_RETRY: Duration = Duration::from_millis(1);

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
    shared: Arc<DaemonShared>,
    id: u32,
    sq: Consumer<DecoderSubmit>,
    cq: Producer<DecoderEvent>,
    files: [PathBuf; 2],
    tags: HashMap<u64, Entry>,
    /// Single events (FAILED, REFUSED) waiting for room on the completion
    /// ring; at most `sq capacity + max_outstanding` (submissions are not
    /// read while it is that long).
    outbox: VecDeque<DecoderEvent>,
    /// Reused buffer for one request's READY + CHUNK entries.
    scratch: Vec<DecoderEvent>,
    /// Reused buffer for drained submissions.
    inbox: Vec<DecoderSubmit>,
}

impl Session {
    /// Creates the client's ring files, takes the daemon's sides and writes
    /// the hello on `sock`.
    pub(super) fn open(shared: Arc<DaemonShared>, id: u32, sock: &UnixStream) -> io::Result<Self> {
        let sq_path = shared.dir.join(format!("{id}.sq"));
        let cq_path = shared.dir.join(format!("{id}.cq"));
        let files = [sq_path.clone(), cq_path.clone()];
        let result = (|| {
            let ring_err = |e: kvferry_ring::ShmError| io::Error::other(e.to_string());
            let sq_ring = spsc::shared::create::<DecoderSubmit>(&sq_path, shared.cfg.sq_capacity)
                .map_err(ring_err)?;
            let cq_ring = spsc::shared::create::<DecoderEvent>(&cq_path, shared.cfg.cq_capacity)
                .map_err(ring_err)?;
            let sq = sq_ring.consumer().map_err(ring_err)?;
            let cq = cq_ring.producer().map_err(ring_err)?;
            let region = shared.receiver.region();
            let hello = Hello {
                version: ATTACH_VERSION,
                role: ROLE_DECODER,
                status: STATUS_OK,
                client_id: id,
                sq_entry: std::mem::size_of::<DecoderSubmit>() as u32,
                cq_entry: std::mem::size_of::<DecoderEvent>() as u32,
                sq_capacity: sq_ring.capacity() as u32,
                cq_capacity: cq_ring.capacity() as u32,
                slots: region.capacity_chunks(),
                chunk_bytes: region.chunk_bytes(),
                data_offset: DATA_OFFSET,
                max_outstanding: shared.cfg.max_outstanding as u32,
                sq_path: sq_path.to_string_lossy().into_owned(),
                cq_path: cq_path.to_string_lossy().into_owned(),
                buffer_path: region.path().to_string_lossy().into_owned(),
            };
            let bytes = hello.encode().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "attach paths too long")
            })?;
            (&*sock).write_all(&bytes)?;
            sock.set_nonblocking(true)?;
            let sq_cap = sq.capacity();
            Ok(Session {
                id,
                sq,
                cq,
                files: files.clone(),
                tags: HashMap::with_capacity(shared.cfg.max_outstanding),
                outbox: VecDeque::new(),
                scratch: Vec::new(),
                inbox: vec![DecoderSubmit::release(0); sq_cap],
                shared: Arc::clone(&shared),
            })
        })();
        if result.is_err() {
            for f in &files {
                let _ = std::fs::remove_file(f);
            }
        }
        result
    }

    /// Serves the client until its socket closes or the daemon stops.
    pub(super) fn run(mut self, mut sock: UnixStream) {
        let span = tracing::debug_span!("attach_session", client = self.id);
        let _enter = span.enter();
        tracing::debug!("attached");
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.shared.cfg.max_outstanding + 2);
        let mut waiting: Vec<u64> = Vec::with_capacity(self.shared.cfg.max_outstanding);
        loop {
            fds.clear();
            waiting.clear();
            fds.push(readable(sock.as_raw_fd()));
            fds.push(readable(self.shared.stop.as_fd().as_raw_fd()));
            let mut retry = !self.outbox.is_empty();
            for (tag, e) in &self.tags {
                match &e.sub {
                    Sub::Waiting(h) => {
                        fds.push(readable(h.as_raw_fd()));
                        waiting.push(*tag);
                    }
                    Sub::Taken { posted: false, .. } => retry = true,
                    Sub::Taken { posted: true, .. } => {}
                }
            }
            if let Err(e) = poll(&mut fds, retry.then_some(FULL_RETRY)) {
                tracing::warn!(error = %e, "attach: poll failed; detaching the client");
                break;
            }
            if fds[1].revents != 0 {
                break;
            }
            if fds[0].revents != 0 && !drain_doorbell(&mut sock) {
                tracing::debug!("client gone (socket closed)");
                break;
            }
            self.flush_outbox();
            self.read_submissions();
            for (i, tag) in waiting.iter().enumerate() {
                if fds[i + 2].revents != 0 {
                    self.request_ended(*tag);
                }
            }
            self.post_taken();
        }
        // Dropping `self` releases every held request and subscription.
    }

    fn flush_outbox(&mut self) {
        while let Some(ev) = self.outbox.pop_front() {
            if let Err(ev) = self.cq.push(ev) {
                self.outbox.push_front(ev);
                return;
            }
        }
    }

    fn send(&mut self, ev: DecoderEvent) {
        if !self.outbox.is_empty() || self.cq.push(ev).is_err() {
            self.outbox.push_back(ev);
        }
    }

    fn refuse(&mut self, tag: u64, why: Refusal) {
        tracing::debug!(tag, reason = %why, "refused a submission");
        self.send(DecoderEvent::of(EV_REFUSED, tag, why as u32));
    }

    fn read_submissions(&mut self) {
        // Bounded: not while the outbox is long, and at most one ring's
        // worth per wake-up (a client's bogus tail cannot keep us here).
        let room = (self.inbox.len() + self.shared.cfg.max_outstanding)
            .saturating_sub(self.outbox.len())
            .min(self.inbox.len());
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
        if !self.shared.subscribed.lock().insert(req_id.to_owned()) {
            return self.refuse(s.tag, Refusal::AlreadySubscribed);
        }
        match self.shared.receiver.watch(req_id) {
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
                self.shared.subscribed.lock().remove(req_id);
                self.refuse(s.tag, Refusal::TakeRefused);
            }
        }
    }

    fn release(&mut self, tag: u64) {
        match self.tags.remove(&tag) {
            Some(e) => {
                tracing::debug!(tag, req_id = %e.req_id, "released");
                self.shared.subscribed.lock().remove(&e.req_id);
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
            RequestStatus::Ready => match self.shared.receiver.take(&e.req_id) {
                Ok(chunks) if chunks.len() < self.cq.capacity() => {
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
            self.shared.subscribed.lock().remove(&e.req_id);
        }
        match failed {
            Ok(code) => self.send(DecoderEvent::of(EV_FAILED, tag, error_number(code))),
            Err(why) => self.refuse(tag, why),
        }
    }

    /// Posts every taken request that is not on the ring yet and fits.
    fn post_taken(&mut self) {
        if !self.outbox.is_empty() {
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
            let Some(mut batch) = self.cq.reserve(self.scratch.len()) else {
                return;
            };
            batch.fill_from(&self.scratch);
            batch.commit();
            *posted = true;
            tracing::debug!(tag, req_id = %e.req_id, chunks = chunks.len(), "delivered");
        }
    }
}

/// Reads and discards doorbell bytes; false once the client is gone (EOF,
/// error, hang-up).
fn drain_doorbell(sock: &mut UnixStream) -> bool {
    let mut buf = [0u8; 64];
    for _ in 0..4 {
        match sock.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

impl Drop for Session {
    fn drop(&mut self) {
        let entries: Vec<Entry> = self.tags.drain().map(|(_, e)| e).collect();
        {
            let mut subscribed = self.shared.subscribed.lock();
            for e in &entries {
                subscribed.remove(&e.req_id);
            }
        }
        // Outside the subscription lock: dropping a held request's chunks
        // (or a watch) takes the receiver's lock.
        drop(entries);
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        tracing::debug!(client = self.id, "detached; everything it held is released");
    }
}
