//! Prefill attach: [`PrefillDaemon`] over a running [`Sender`], and one
//! attached worker's session. Each worker holds one staging share
//! ([`Sender::take_share`]), gets that share's memfd only (`SCM_RIGHTS`)
//! and maps it writable; it
//! fills the slots the session staged for it in place and submits them; the
//! session drives the sender's API for it (`begin`, `begin_declared`,
//! `try_stage_in`, `StagedBatch::submit`, `submit_declared`, `cancel`) and
//! sleeps in `poll` on the share's
//! readiness eventfd, its one descriptor besides the socket: it becomes
//! readable when a STAGE waiting for admission or free slots may go on
//! and when any of the session's requests ends (`Request::notify_end_on`).
//! When the session ends (socket closed: the worker died or
//! left) its batches not submitted give their slots back, its live requests
//! are cancelled (fenced, like any cancel) and its share goes back.

use foldhash::{HashMap, HashMapExt};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use kvferry_ring::spsc::Consumer;

use super::daemon::{AttachConfig, Daemon, DaemonShared, OpenRefused, Role};
use super::layout::{
    error_number, DecoderEvent, Hello, PrefillSubmit, Refusal, EV_DONE, EV_FAILED, EV_REFUSED,
    EV_SLOT, EV_STAGED, MAX_TEXT, NO_TOKENS, OP_BEGIN, OP_CANCEL, OP_KEY, OP_STAGE, OP_SUBMIT,
    ROLE_PREFILL, STATUS_NO_SHARE, STATUS_OK,
};
use super::poll::readable;
use super::poll::Peer;
use super::serve::{open_rings, woken, Completions, Doorbell, Serve};
use crate::protocol::ErrorCode;
use crate::sender::{
    Request, RequestSpec, RequestStatus, Sender, StagedBatch, StagingShare, StoreError,
};

/// The prefill role's daemon state.
pub(super) struct Prefills {
    sender: Arc<Sender>,
    /// Receiver endpoints a BEGIN names by index.
    receivers: Vec<String>,
}

/// Serves attached prefill workers over a running [`Sender`] (see
/// `docs/attach.md`): admission, staging, transport and ProxyNotif stay in
/// the sender. Dropping it stops accepting, ends every session (cancelling
/// its clients' live requests) and removes the socket.
#[derive(Debug)]
pub struct PrefillDaemon(Daemon<Prefills>);

impl PrefillDaemon {
    /// Makes the process non-dumpable (unless
    /// [`AttachConfig::keep_dumpable`]), binds `cfg.socket` (mode 0600) and
    /// starts the accept thread. A BEGIN names its receiver by index
    /// into `receivers` (ZMQ endpoints). The sender needs staging shares
    /// ([`SenderConfig::staging_shares`](crate::sender::SenderConfig)): each
    /// worker holds one; a worker past the free shares is refused with
    /// [`STATUS_NO_SHARE`](super::layout::STATUS_NO_SHARE).
    pub fn start(
        sender: Arc<Sender>,
        receivers: Vec<String>,
        cfg: AttachConfig,
    ) -> io::Result<Self> {
        if receivers.is_empty() || u32::try_from(receivers.len()).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "attach: a prefill daemon needs at least one receiver",
            ));
        }
        if sender.staging_shares() == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "attach: a prefill daemon needs a sender with staging_shares > 0",
            ));
        }
        Daemon::start(Prefills { sender, receivers }, cfg).map(Self)
    }

    /// The socket clients connect to.
    pub fn socket(&self) -> &Path {
        self.0.socket()
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

impl Role for Prefills {
    const NAME: &'static str = "prefill";
    type Session = Session;

    fn open(
        shared: &Arc<DaemonShared<Self>>,
        id: u32,
        _peer: Peer,
        sock: &UnixStream,
    ) -> io::Result<Session> {
        let sender = &shared.role.sender;
        let share = sender.take_share().map_err(|e| {
            tracing::debug!(client = id, error = %e, "no staging share for the worker");
            io::Error::other(OpenRefused(STATUS_NO_SHARE))
        })?;
        let layout = share.layout().clone();
        let mut hello = Hello::refusal(STATUS_OK);
        hello.role = ROLE_PREFILL;
        hello.slots = layout.slots as u64;
        hello.chunk_bytes = layout.slot_bytes;
        hello.data_offset = 0;
        hello.receivers = shared.role.receivers.len() as u32;
        hello.share = share.index() as u32;
        hello.shares = sender.staging_shares() as u32;
        hello.share_first_slot = u64::from(layout.first_slot);
        let rings = open_rings::<PrefillSubmit, DecoderEvent, _>(
            shared,
            id,
            sock,
            hello,
            share.file().as_fd(),
        )?;
        let sq_cap = rings.sq.capacity();
        Ok(Session {
            id,
            first_slot: layout.first_slot,
            share,
            ring_full: false,
            sq: rings.sq,
            cq: rings.cq,
            tags: HashMap::with_capacity(shared.cfg.max_outstanding),
            declaring: HashMap::new(),
            batches: 0,
            waiting: Vec::with_capacity(shared.cfg.max_outstanding),
            inbox: vec![PrefillSubmit::of(0, 0, 0, 0, 0); sq_cap],
            shared: Arc::clone(shared),
        })
    }
}

/// Chunk keys and lengths from KEY entries, for one batch (one allocation
/// per batch, none per chunk).
struct Keys {
    /// `MAX_TEXT` bytes per chunk; key `i` is `bytes[i * MAX_TEXT..][..key_lens[i]]`.
    bytes: Vec<u8>,
    /// 0: no KEY yet.
    key_lens: Vec<u16>,
    lens: Vec<u32>,
}

impl Keys {
    /// Room for `n` chunks' keys (none for `n == 0`).
    fn new(n: usize) -> Self {
        Self {
            bytes: vec![0; n * MAX_TEXT],
            key_lens: vec![0; n],
            lens: vec![0; n],
        }
    }

    /// Records a KEY entry: chunk `s.b` is `s.len` bytes (at most
    /// `slot_bytes`) named `s.text`. `None` if it does not fit.
    fn set(&mut self, s: &PrefillSubmit, slot_bytes: u64) -> Option<()> {
        let len = s.text()?.len();
        let i = s.b as usize;
        if i >= self.key_lens.len() || u64::from(s.len) > slot_bytes {
            return None;
        }
        self.bytes[i * MAX_TEXT..i * MAX_TEXT + len].copy_from_slice(&s.text[..len]);
        self.key_lens[i] = len as u16;
        self.lens[i] = s.len;
        Some(())
    }

    /// Every one of the first `m` chunks has its KEY.
    fn complete(&self, m: usize) -> bool {
        m <= self.key_lens.len() && self.key_lens[..m].iter().all(|&l| l > 0)
    }

    /// The first `m` keys (one allocation). UTF-8 was checked by
    /// `PrefillSubmit::text` when each KEY came in.
    fn names(&self, m: usize) -> Vec<&str> {
        (0..m)
            .map(|i| {
                let key = &self.bytes[i * MAX_TEXT..][..usize::from(self.key_lens[i])];
                std::str::from_utf8(key).unwrap_or("")
            })
            .collect()
    }
}

/// A batch staged for the worker, with the keys and lengths its KEY
/// entries gave (none for a declared batch: they came before the BEGIN
/// went to the sender).
struct Held {
    batch: StagedBatch,
    keys: Keys,
    /// The request's declared batch (SUBMIT hands it over with
    /// `StagedBatch::submit_declared`).
    declared: bool,
}

/// A BEGIN that declared its first batch (`c` > 0), waiting for that
/// batch's KEY entries: the request begins (`Sender::begin_declared`)
/// once every one came.
struct Declaring {
    spec: RequestSpec,
    max_tokens: u64,
    /// The declared last chunk's token count (`None`: the default).
    tokens: Option<u32>,
    /// The batch id the KEYs name (the first KEY's).
    batch: Option<u32>,
    keys: Keys,
}

/// One request of the worker.
struct Req {
    request: Request,
    /// Most tokens its SUBMITs may give a last chunk (the largest
    /// dimension of its shape).
    max_tokens: u64,
    /// Its declared batch, until submitted: (batch id, chunks).
    declared: Option<(u32, u32)>,
    /// Batches staged and not submitted, by the worker's batch id.
    held: HashMap<u32, Held>,
    /// STAGEs waiting for admission or free staging: (batch id, slots).
    pending: Vec<(u32, u32)>,
    /// Cancelled by the worker; its terminal status is still reported.
    cancelled: bool,
    /// Terminal and reported, but the worker still held batches: they stay
    /// its (it may be writing them) until it acknowledges with CANCEL.
    ended: bool,
}

/// One worker's session (see the module docs).
pub(super) struct Session {
    shared: Arc<DaemonShared<Prefills>>,
    id: u32,
    /// The worker's staging share (dropped after the requests, by field
    /// order after `Drop`, so it goes back last).
    share: StagingShare,
    /// The share's first staging slot: SLOT entries carry `slot - first_slot`.
    first_slot: u32,
    /// The last `stage_pending` found no room on the completion ring (the
    /// worker frees room without telling: retried on a timer).
    ring_full: bool,
    sq: Consumer<PrefillSubmit>,
    cq: Completions<DecoderEvent>,
    /// At most `max_outstanding` requests, with `declaring`.
    tags: HashMap<u64, Req>,
    /// BEGINs waiting for their declared batch's KEYs.
    declaring: HashMap<u64, Declaring>,
    /// Held plus pending batches over all tags, at most `max_outstanding`.
    batches: usize,
    /// Reused buffer for the tags of requests that ended.
    waiting: Vec<u64>,
    inbox: Vec<PrefillSubmit>,
}

impl Serve for Session {
    fn signalled(&self) -> bool {
        self.share.ready.raised()
    }

    fn interest(&mut self, fds: &mut Vec<libc::pollfd>) -> bool {
        // The share's eventfd is the only descriptor: it wakes us when a
        // request waiting for admission is admitted, when slots of the
        // share are freed (a STAGE waiting for either needs no timer) and
        // when any request of this session ends (`notify_end_on`).
        fds.push(readable(self.share.ready_fd().as_raw_fd()));
        !self.cq.outbox.is_empty() || self.ring_full
    }

    fn wake(&mut self, fds: &[libc::pollfd]) {
        let ready = woken(&self.share.ready, fds.first());
        if ready {
            // Before the looks below, so a change after them signals anew.
            self.share.clear_ready();
        }
        self.cq.flush();
        self.read_submissions();
        if ready {
            let mut waiting = std::mem::take(&mut self.waiting);
            waiting.clear();
            waiting.extend(
                self.tags
                    .iter()
                    .filter(|(_, r)| !r.ended && r.request.status() != RequestStatus::InProgress)
                    .map(|(tag, _)| *tag),
            );
            for tag in &waiting {
                self.maybe_ended(*tag);
            }
            self.waiting = waiting;
        }
        self.stage_pending();
    }

    fn submissions(&self) -> &dyn Doorbell {
        &self.sq
    }
}

impl Session {
    fn refuse(&mut self, tag: u64, why: Refusal) {
        tracing::debug!(tag, reason = %why, "refused a submission");
        self.cq.send(DecoderEvent::of(EV_REFUSED, tag, why as u32));
    }

    fn refuse_store(&mut self, tag: u64, e: &StoreError) {
        tracing::debug!(tag, error = %e, "the sender refused");
        self.refuse(tag, Refusal::SenderRefused);
    }

    fn read_submissions(&mut self) {
        // Bounded as the decoder's: at most one ring's worth per wake-up,
        // none while the outbox is long.
        let room = self
            .cq
            .room(self.inbox.len(), self.shared.cfg.max_outstanding);
        let n = self.sq.pop_into(&mut self.inbox[..room]);
        for i in 0..n {
            let s = self.inbox[i];
            if self.declaring.contains_key(&s.tag) && s.op != OP_BEGIN {
                self.declaring_op(&s);
                continue;
            }
            match s.op {
                OP_BEGIN => self.begin(&s),
                OP_STAGE => self.stage(&s),
                OP_KEY => self.key(&s),
                OP_SUBMIT => self.submit(&s),
                OP_CANCEL => self.cancel(s.tag),
                _ => self.refuse(s.tag, Refusal::BadOp),
            }
        }
    }

    fn begin(&mut self, s: &PrefillSubmit) {
        if self.tags.contains_key(&s.tag) || self.declaring.contains_key(&s.tag) {
            return self.refuse(s.tag, Refusal::DuplicateTag);
        }
        if self.tags.len() + self.declaring.len() >= self.shared.cfg.max_outstanding {
            return self.refuse(s.tag, Refusal::TooManyOutstanding);
        }
        let Some(req_id) = s.begin_req_id() else {
            return self.refuse(s.tag, Refusal::BadReqId);
        };
        let Some(receiver) = self.shared.role.receivers.get(s.a as usize) else {
            return self.refuse(s.tag, Refusal::UnknownReceiver);
        };
        let entry = s.geometry();
        let geometry = match entry.check(self.share.layout().slot_bytes) {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(tag = s.tag, error = %e, "bad geometry");
                return self.refuse(s.tag, Refusal::BadGeometry);
            }
        };
        let spec = RequestSpec {
            fmt: geometry.fmt,
            shape: geometry.shape.to_vec(),
            dtype: geometry.dtype.to_owned(),
            ..RequestSpec::new(req_id, receiver.as_str(), s.b as usize)
        };
        let max_tokens = geometry.max_tokens;
        if s.c == 0 {
            let begun = self.shared.role.sender.begin(spec);
            return self.begun(s.tag, begun, max_tokens, None);
        }
        // A declared first batch: its KEYs follow. Its STAGED and SLOTs
        // must fit the ring and its slots the share, as a STAGE's.
        let declared = s.c as usize;
        if declared >= self.cq.ring.capacity() || declared > self.share.layout().slots {
            return self.refuse(s.tag, Refusal::TooManyChunks);
        }
        let tokens = (s.len != NO_TOKENS).then_some(s.len);
        if tokens.is_some_and(|t| u64::from(t) > max_tokens) {
            return self.refuse(s.tag, Refusal::BadTokens);
        }
        self.declaring.insert(
            s.tag,
            Declaring {
                spec,
                max_tokens,
                tokens,
                batch: None,
                keys: Keys::new(declared),
            },
        );
    }

    /// A request `begin` or `begin_declared` returned for `tag` (its
    /// declared batch `declared`: batch id and chunks).
    fn begun(
        &mut self,
        tag: u64,
        begun: Result<Request, StoreError>,
        max_tokens: u64,
        declared: Option<(u32, u32)>,
    ) {
        let request = match begun {
            Ok(r) => r,
            Err(e) => return self.refuse_store(tag, &e),
        };
        tracing::debug!(tag, req_id = request.id(), ?declared, "begun");
        let ended = request.notify_end_on(&self.share);
        self.tags.insert(
            tag,
            Req {
                request,
                max_tokens,
                declared,
                held: HashMap::new(),
                pending: Vec::new(),
                cancelled: false,
                ended: false,
            },
        );
        if ended {
            // Failed at once (e.g. its receiver is gone): no signal will
            // come for it.
            self.maybe_ended(tag);
        }
    }

    /// An entry for a tag whose BEGIN waits for its declared batch's KEYs:
    /// a KEY of that batch is recorded (the request begins with the last
    /// one); CANCEL drops the BEGIN (FAILED `cancelled`, as for a begun
    /// request); anything else, or a bad KEY, drops it with REFUSED `11`.
    fn declaring_op(&mut self, s: &PrefillSubmit) {
        let slot_bytes = self.share.layout().slot_bytes;
        let Some(d) = self.declaring.get_mut(&s.tag) else {
            return;
        };
        if s.op == OP_CANCEL {
            self.declaring.remove(&s.tag);
            let ev = DecoderEvent::of(EV_FAILED, s.tag, error_number(ErrorCode::Cancelled));
            return self.cq.send(ev);
        }
        let batch = *d.batch.get_or_insert(s.a);
        if s.op != OP_KEY || s.a != batch || d.keys.set(s, slot_bytes).is_none() {
            self.declaring.remove(&s.tag);
            return self.refuse(s.tag, Refusal::BadBatch);
        }
        let n = d.keys.key_lens.len();
        if !d.keys.complete(n) {
            return;
        }
        let Some(d) = self.declaring.remove(&s.tag) else {
            return;
        };
        let keys = d.keys.names(n);
        let begun = self.shared.role.sender.begin_declared(
            d.spec,
            &keys,
            &d.keys.lens,
            d.tokens.map(i64::from),
        );
        self.begun(s.tag, begun, d.max_tokens, Some((batch, n as u32)));
    }

    fn stage(&mut self, s: &PrefillSubmit) {
        let cq_cap = self.cq.ring.capacity();
        let full = self.batches >= self.shared.cfg.max_outstanding;
        let Some(r) = self
            .tags
            .get_mut(&s.tag)
            .filter(|r| !r.cancelled && !r.ended)
        else {
            return self.refuse(s.tag, Refusal::UnknownTag);
        };
        if r.held.contains_key(&s.a) || r.pending.iter().any(|p| p.0 == s.a) {
            return self.refuse(s.tag, Refusal::DuplicateTag);
        }
        if r.declared.is_some_and(|(id, n)| id == s.a && n != s.b) {
            // The declared batch is staged whole.
            return self.refuse(s.tag, Refusal::BadBatch);
        }
        // STAGED and its SLOT entries go on the ring in one reservation.
        if s.b as usize >= cq_cap {
            return self.refuse(s.tag, Refusal::TooManyChunks);
        }
        if full {
            return self.refuse(s.tag, Refusal::TooManyOutstanding);
        }
        r.pending.push((s.a, s.b));
        self.batches += 1;
    }

    /// Tries every pending STAGE (FIFO per request) while the completion
    /// ring has room for its entries.
    fn stage_pending(&mut self) {
        self.ring_full = false;
        if !self.cq.outbox.is_empty() {
            return;
        }
        let mut refused: Vec<(u64, StoreError)> = Vec::new();
        'tags: for (tag, r) in self.tags.iter_mut() {
            while let Some(&(id, n)) = r.pending.first() {
                match r.request.try_stage_in(&self.share, n as usize) {
                    Ok(batch) => {
                        // A reservation publishes even when dropped, so it
                        // is only taken once the batch exists; without room
                        // the batch goes back and is retried. The refusals
                        // already taken off `pending` are still answered
                        // (below), into the outbox.
                        let Some(mut entries) = self.cq.ring.reserve(n as usize + 1) else {
                            self.ring_full = true;
                            break 'tags;
                        };
                        let mut staged = DecoderEvent::of(EV_STAGED, *tag, 0);
                        staged.a = id;
                        staged.b = n;
                        let _ = entries.set(0, staged);
                        for (i, slot) in batch.slot_indexes().iter().enumerate() {
                            let mut ev = DecoderEvent::of(EV_SLOT, *tag, 0);
                            // The share's slots: `slot >= first_slot`.
                            ev.a = slot - self.first_slot;
                            ev.b = i as u32;
                            let _ = entries.set(i + 1, ev);
                        }
                        entries.commit();
                        r.pending.remove(0);
                        let declared = r.declared.is_some_and(|d| d.0 == id);
                        let keys = Keys::new(if declared { 0 } else { n as usize });
                        r.held.insert(
                            id,
                            Held {
                                batch,
                                keys,
                                declared,
                            },
                        );
                        tracing::debug!(tag, batch = id, slots = n, "staged");
                    }
                    // Not admitted yet, or no slot of the share free: the
                    // share's eventfd is armed and wakes us.
                    Err(StoreError::NotAdmitted | StoreError::NoStagingNow) => break,
                    Err(e) => {
                        r.pending.remove(0);
                        self.batches -= 1;
                        refused.push((*tag, e));
                    }
                }
            }
        }
        for (tag, e) in refused {
            self.refuse_store(tag, &e);
        }
    }

    fn key(&mut self, s: &PrefillSubmit) {
        let slot_bytes = self.share.layout().slot_bytes;
        let ok = self
            .tags
            .get_mut(&s.tag)
            .and_then(|r| r.held.get_mut(&s.a))
            .and_then(|h| h.keys.set(s, slot_bytes));
        if ok.is_none() {
            self.refuse(s.tag, Refusal::BadBatch);
        }
    }

    fn submit(&mut self, s: &PrefillSubmit) {
        let Some(r) = self.tags.get_mut(&s.tag) else {
            return self.refuse(s.tag, Refusal::UnknownTag);
        };
        let m = s.b as usize;
        let tokens = (s.c != NO_TOKENS).then_some(s.c);
        let tokens_ok = tokens.is_none_or(|t| u64::from(t) <= r.max_tokens);
        // A refused SUBMIT gives the batch back (its slots are freed).
        let Some(h) = r.held.remove(&s.a) else {
            return self.refuse(s.tag, Refusal::BadBatch);
        };
        // The declared batch goes whole, its tokens as declared.
        let complete = if h.declared {
            r.declared.is_some_and(|d| d.1 as usize == m) && tokens.is_none()
        } else {
            h.keys.complete(m)
        };
        if r.ended && r.held.is_empty() {
            // Nothing left to acknowledge (the submit below is refused).
            self.tags.remove(&s.tag);
        }
        self.batches -= 1;
        if !complete {
            return self.refuse(s.tag, Refusal::BadBatch);
        }
        if !tokens_ok {
            return self.refuse(s.tag, Refusal::BadTokens);
        }
        let mut batch = h.batch;
        let result = if h.declared {
            let result = batch.submit_declared();
            if result.is_ok() {
                if let Some(r) = self.tags.get_mut(&s.tag) {
                    r.declared = None;
                }
            }
            result
        } else {
            if let Some(t) = tokens {
                batch.set_last_chunk_toks(i64::from(t));
            }
            batch.submit(&h.keys.names(m), &h.keys.lens[..m])
        };
        match result {
            Ok(()) => tracing::debug!(tag = s.tag, batch = s.a, chunks = m, "submitted"),
            Err(e) => self.refuse_store(s.tag, &e),
        }
    }

    fn cancel(&mut self, tag: u64) {
        let Some(r) = self.tags.get_mut(&tag) else {
            return self.refuse(tag, Refusal::UnknownTag);
        };
        self.batches -= r.held.len() + r.pending.len();
        if r.ended {
            // The acknowledgement of an end the worker held batches at:
            // only now may their slots go back.
            self.tags.remove(&tag);
            return;
        }
        r.cancelled = true;
        r.held.clear();
        r.pending.clear();
        r.request.cancel();
        // Its terminal status (FAILED cancelled) follows on the ring.
    }

    /// Reports `tag`'s request and forgets it if it is terminal (keeping
    /// batches the worker still holds until it acknowledges).
    fn maybe_ended(&mut self, tag: u64) {
        let Some(r) = self.tags.get_mut(&tag).filter(|r| !r.ended) else {
            return;
        };
        let ev = match r.request.status() {
            RequestStatus::InProgress => return,
            RequestStatus::Completed => DecoderEvent::of(EV_DONE, tag, 0),
            RequestStatus::Cancelled => {
                DecoderEvent::of(EV_FAILED, tag, error_number(ErrorCode::Cancelled))
            }
            RequestStatus::Failed { code, .. } => {
                DecoderEvent::of(EV_FAILED, tag, error_number(code))
            }
        };
        self.batches -= r.pending.len();
        r.pending.clear();
        if r.held.is_empty() {
            self.tags.remove(&tag);
        } else {
            r.ended = true;
        }
        tracing::debug!(tag, kind = ev.kind, "ended");
        self.cq.send(ev);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        for (_, r) in self.tags.drain() {
            // Unsubmitted batches first: their slots go back at once.
            drop(r.held);
            if !r.request.status().is_terminal() {
                r.request.cancel();
            }
        }
        tracing::debug!(
            client = self.id,
            "detached; its requests are cancelled and its staging returned"
        );
    }
}
