//! The Rust prefill-worker client: attach to a sender daemon, begin
//! requests, fill staged slots in place in the shared staging buffer and
//! submit them with their keys.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::{self, Consumer, Producer};
use memmap2::MmapMut;

use super::affinity::keep_off_engine_cpu;
use super::client::{
    doorbell, follow_ons, full_or_closed, handshake, next_entry, ring_socket, skip_follow_ons,
    AttachError,
};
use super::layout::{
    error_from_number, BeginGeometry, DecoderEvent, Hello, PrefillSubmit, Refusal, EV_DONE,
    EV_FAILED, EV_REFUSED, EV_SLOT, EV_STAGED, MAX_REQ_ID, MAX_TEXT, NO_TOKENS, OP_CANCEL, OP_KEY,
    OP_STAGE, ROLE_PREFILL,
};
use crate::protocol::ErrorCode;

/// Staging slots the daemon handed to this worker for one batch: fill them
/// with [`PrefillClient::slot_mut`], then [`PrefillClient::submit`].
#[derive(Debug)]
pub struct StagedSlots {
    tag: u64,
    id: u32,
    slots: Vec<u32>,
    last_chunk_toks: Option<u32>,
    /// The declared batch of a [`PrefillClient::begin_declared`].
    declared: bool,
}

impl StagedSlots {
    /// The request's tag.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True for a batch of no slots (an empty last batch).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// True for the declared batch of a
    /// [`PrefillClient::begin_declared`] (submit it with
    /// [`PrefillClient::submit_declared`]).
    pub fn is_declared(&self) -> bool {
        self.declared
    }

    /// Sets the token count of the batch's last submitted chunk
    /// (`AllocRequest.last_chunk_toks`; default: the tokens it holds, its
    /// bytes over the element size of a one-dimensional shape, its bytes
    /// otherwise), as
    /// `StagedBatch::set_last_chunk_toks` does in process. At most the
    /// largest dimension of the request's shape (the daemon refuses the
    /// SUBMIT otherwise, [`Refusal::BadTokens`]); `u32::MAX` means the
    /// default.
    pub fn set_last_chunk_toks(&mut self, toks: u32) {
        self.last_chunk_toks = Some(toks);
    }
}

/// The first batch of a request, declared at its begin
/// ([`PrefillClient::begin_declared`]): chunk `i` is named `keys[i]`
/// (1..=[`MAX_TEXT`] bytes) and is `lens[i]` bytes (whole but the last),
/// the last `last_chunk_toks` tokens (`None`: the tokens it holds).
#[derive(Debug, Clone, Copy)]
pub struct DeclaredBatch<'a> {
    /// The chunks' keys.
    pub keys: &'a [&'a str],
    /// The chunks' lengths.
    pub lens: &'a [u32],
    /// The last chunk's token count (`None`: the default).
    pub last_chunk_toks: Option<u32>,
}

/// A [`PrefillClient::submit`] that failed.
#[derive(Debug, thiserror::Error)]
#[error("batch not submitted: {error}")]
pub struct SubmitError {
    /// Why.
    pub error: AttachError,
    /// The batch, unless its SUBMIT went out and only the doorbell after
    /// it failed (the daemon is gone). Still the worker's: its slots keep
    /// what was written into them.
    pub batch: Option<StagedSlots>,
}

impl From<SubmitError> for AttachError {
    fn from(e: SubmitError) -> Self {
        e.error
    }
}

/// What [`PrefillClient::next_event`] returns.
#[derive(Debug)]
pub enum PrefillEvent {
    /// A STAGE was answered: its slots are this worker's to fill.
    Staged(StagedSlots),
    /// The request of `tag` completed: every chunk written, the proxy
    /// notified.
    Done {
        /// The request's tag.
        tag: u64,
    },
    /// The request of `tag` failed or was cancelled.
    Failed {
        /// The request's tag.
        tag: u64,
        /// Why (`None` for a code this build does not know).
        code: Option<ErrorCode>,
    },
    /// The daemon refused a submission about `tag`.
    Refused {
        /// The submission's tag.
        tag: u64,
        /// Why (`None` for a code this build does not know).
        reason: Option<Refusal>,
    },
}

/// An attached prefill worker (see `docs/attach.md`). Not `Sync`: one
/// thread drives it.
///
/// A worker writes a two-chunk request in place through a sender daemon
/// (here in the same process; usually `kvferry sender --attach` or
/// `kvferry node`):
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvferry::attach::{PrefillClient, PrefillEvent};
///
/// let deadline = Instant::now() + Duration::from_secs(20);
/// # use std::sync::Arc;
/// # use kvferry::attach::{AttachConfig, PrefillDaemon};
/// # use kvferry::{Receiver, ReceiverConfig, Sender, SenderConfig};
/// # let receiver = Receiver::start(ReceiverConfig {
/// #     listen: "tcp://127.0.0.1:0".into(),
/// #     capacity_chunks: 8,
/// #     chunk_bytes: 4096,
/// #     ..Default::default()
/// # })?;
/// # let sender = Arc::new(Sender::new(SenderConfig {
/// #     chunk_bytes: 4096,
/// #     staging_slots: 4,
/// #     staging_shares: 1,
/// #     ..Default::default()
/// # })?);
/// # let socket = std::env::temp_dir().join(format!("kvferry-doc-p{}.sock", std::process::id()));
/// # let cfg = AttachConfig { keep_dumpable: true, ..AttachConfig::new(&socket) };
/// # let daemon = PrefillDaemon::start(sender, vec![receiver.endpoint().into()], cfg)?;
/// // `socket` is the path the daemon printed ("kvferry sender attach on ...").
/// let mut worker = PrefillClient::connect(&socket, Duration::from_secs(5))?;
/// let tag = worker.begin("req-7", 0, 2)?; // two chunks to the daemon's receiver 0
/// worker.stage(tag, 2)?;
/// let PrefillEvent::Staged(batch) = worker.next_event(deadline)? else {
///     panic!("expected the staged slots");
/// };
/// for i in 0..batch.len() {
///     // In place, in the sender's staging: e.g. the target of a
///     // device-to-host copy.
///     worker.slot_mut(&batch, i).expect("a held slot").fill(i as u8);
/// }
/// // Every chunk full but the last, as LMCache sends them.
/// worker.submit(batch, &["req-7/0", "req-7/1"], &[4096, 100])?;
/// assert!(matches!(worker.next_event(deadline)?, PrefillEvent::Done { tag: t } if t == tag));
/// # receiver.wait_ready("req-7", deadline)?;
/// # assert_eq!(receiver.get("req-7/1").unwrap().bytes(), &[1u8; 100][..]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PrefillClient {
    sock: UnixStream,
    sq: Producer<PrefillSubmit>,
    cq: Consumer<DecoderEvent>,
    staging: MmapMut,
    /// The share's memfd (the mapping does not need it; kept for
    /// [`share_file`](Self::share_file)).
    share: File,
    hello: Hello,
    /// [`PrefillClient::kept_off_cpu`].
    kept_off: Option<usize>,
    /// Live requests (tags).
    tags: HashSet<u64>,
    /// Batches staged for this worker and not submitted: (tag, id).
    held: HashSet<(u64, u32)>,
    /// Batch ids asked for and not answered yet, per tag.
    asked: HashMap<u64, u32>,
    /// Declared batches not submitted yet: (tag, id).
    declared: HashSet<(u64, u32)>,
    /// Live requests this worker cancelled (until their end event): a
    /// STAGED of one was posted before the daemon read the CANCEL, which
    /// gave the batch back, so it is skipped, its slots never handed out.
    cancelled: HashSet<u64>,
    next_tag: u64,
    next_batch: u32,
    /// How long a submit waits for room on a full submission ring.
    full_wait: Duration,
}

impl std::fmt::Debug for PrefillClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillClient")
            .field("client_id", &self.hello.client_id)
            .field("requests", &self.tags.len())
            .finish()
    }
}

/// How long [`PrefillClient::submit`] waits for room on a full submission
/// ring unless [`PrefillClient::set_full_wait`] says otherwise.
const FULL_WAIT: Duration = Duration::from_secs(10);

impl PrefillClient {
    /// Attaches to the sender daemon listening on `socket`, waiting at
    /// most `timeout` for its hello, and maps its staging buffer writable.
    pub fn connect(socket: impl AsRef<Path>, timeout: Duration) -> Result<Self, AttachError> {
        let (sock, hello, fds) =
            handshake::<PrefillSubmit, DecoderEvent>(socket.as_ref(), timeout, ROLE_PREFILL)?;
        let sq = spsc::shared::from_file::<PrefillSubmit>(&fds.sq, "attach sq")?.producer()?;
        let cq = spsc::shared::from_file::<DecoderEvent>(&fds.cq, "attach cq")?.consumer()?;
        let file = fds.data;
        let need = hello
            .slots
            .checked_mul(hello.chunk_bytes)
            .ok_or_else(|| AttachError::Protocol("staging geometry overflows".into()))?;
        // SAFETY: the file is the sender's staging share memfd, sealed
        // against shrinking. This client writes only slots the daemon
        // staged for it (`slot_mut` checks that the batch is held) and only
        // before submitting them; the daemon's transport reads a slot only
        // after the SUBMIT, and no other process can open the memfd (it
        // has no name; the daemon is non-dumpable).
        let staging = unsafe { MmapMut::map_mut(&file) }?;
        if (staging.len() as u64) < need {
            return Err(AttachError::Protocol("staging mapping too short".into()));
        }
        // The share's page tables filled now, not by a page fault as the
        // worker first fills each page (several µs each on a VM; a 256 KiB
        // chunk is 64 pages). Best effort: a kernel before 5.14 refuses the
        // advice, and the pages fault in on first use.
        let _ = staging.advise_range(memmap2::Advice::PopulateWrite, 0, need as usize);
        // A child this process forks does not inherit the share: it could
        // otherwise write it after this worker left (docs/attach.md, "Trust").
        staging.advise(memmap2::Advice::DontFork)?;
        // Last: a refused attach leaves the thread's set as it was.
        let kept_off = keep_off_engine_cpu(&hello);
        Ok(Self {
            sock,
            sq,
            cq,
            staging,
            share: file,
            hello,
            kept_off,
            tags: HashSet::new(),
            held: HashSet::new(),
            asked: HashMap::new(),
            declared: HashSet::new(),
            cancelled: HashSet::new(),
            next_tag: 1,
            next_batch: 1,
            full_wait: FULL_WAIT,
        })
    }

    /// The daemon's hello (geometry, limits, receiver count).
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

    /// The staging share's memfd the daemon passed (exactly `slots *
    /// chunk_bytes` long, sealed against resizing), e.g. to register it
    /// with a device. Writing it is the same as writing [`slot_mut`]
    /// slices, with the same rules.
    ///
    /// [`slot_mut`]: Self::slot_mut
    pub fn share_file(&self) -> &File {
        &self.share
    }

    fn push(&mut self, s: PrefillSubmit) -> Result<(), AttachError> {
        self.sq.push(s).map_err(|_| full_or_closed(&self.sq))?;
        doorbell(&mut self.sq, &mut self.sock)
    }

    /// How long [`submit`](Self::submit) waits for room on a full
    /// submission ring before it gives the batch back with
    /// [`AttachError::Full`] (default 10 s). The ring stays full only
    /// while this worker leaves its events unread: the daemon's session
    /// stops reading submissions when it has no room for their answers.
    pub fn set_full_wait(&mut self, wait: Duration) {
        self.full_wait = wait;
    }

    /// Pushes `s`, waiting (ringing the doorbell) while the ring is full,
    /// up to [`set_full_wait`](Self::set_full_wait).
    fn push_waiting(&mut self, s: PrefillSubmit) -> Result<(), AttachError> {
        let deadline = Instant::now() + self.full_wait;
        let mut s = s;
        loop {
            match self.sq.push(s) {
                Ok(()) => return Ok(()),
                Err(back) if !self.sq.is_closed() && Instant::now() < deadline => {
                    s = back;
                    ring_socket(&mut self.sock)?;
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(_) => return Err(full_or_closed(&self.sq)),
            }
        }
    }

    /// Begins request `req_id` (1..=[`MAX_REQ_ID`] bytes) of
    /// `total_chunks` chunks to the daemon's receiver number `receiver`,
    /// with the sender's default chunk geometry (shape `[chunk_bytes]` of
    /// `uint8`, fmt 0); returns its tag.
    pub fn begin(
        &mut self,
        req_id: &str,
        receiver: u32,
        total_chunks: u32,
    ) -> Result<u64, AttachError> {
        self.begin_with(req_id, receiver, total_chunks, &BeginGeometry::default())
    }

    /// [`begin`](Self::begin) with the request's chunk geometry (fmt,
    /// shape, dtype: what every AllocRequest of the request carries, as a
    /// `RequestSpec` does in process). The daemon checks it
    /// ([`BeginGeometry::check`]) and refuses the BEGIN with
    /// [`Refusal::BadGeometry`] if it is out of range.
    pub fn begin_with(
        &mut self,
        req_id: &str,
        receiver: u32,
        total_chunks: u32,
        geometry: &BeginGeometry,
    ) -> Result<u64, AttachError> {
        let tag = self.next_tag;
        let s = PrefillSubmit::begin(tag, receiver, total_chunks, req_id, geometry)
            .ok_or(AttachError::BadReqId)?;
        self.push(s)?;
        self.next_tag += 1;
        self.tags.insert(tag);
        Ok(tag)
    }

    /// Begins a request (as [`begin_with`](Self::begin_with)) with its
    /// first batch declared, and asks for that batch's slots: one
    /// publish of its BEGIN, the batch's KEYs and its STAGE. The
    /// admission carries the keys, so the receiver allocates the batch's
    /// slots as it admits the request: one control round trip fewer than
    /// `begin`, `stage` and `submit`. The slots come as a
    /// [`PrefillEvent::Staged`] ([`StagedSlots::is_declared`]); fill them
    /// and hand them over with [`submit_declared`](Self::submit_declared).
    /// Returns the tag.
    ///
    /// On an error after the BEGIN went out (the ring stayed full, the
    /// daemon left) the tag is taken: [`cancel`](Self::cancel) it.
    pub fn begin_declared(
        &mut self,
        req_id: &str,
        receiver: u32,
        total_chunks: u32,
        geometry: &BeginGeometry,
        first: &DeclaredBatch<'_>,
    ) -> Result<u64, AttachError> {
        let n = first.keys.len();
        if n == 0 || n != first.lens.len() {
            return Err(AttachError::Protocol(
                "a declared batch needs as many keys as lengths, at least one".into(),
            ));
        }
        check_keys(first.keys)?;
        let (tag, id) = (self.next_tag, self.next_batch);
        let mut begin = PrefillSubmit::begin(tag, receiver, total_chunks, req_id, geometry)
            .ok_or(AttachError::BadReqId)?;
        begin.c = n as u32;
        begin.len = first.last_chunk_toks.unwrap_or(NO_TOKENS);
        self.push_waiting(begin)?;
        self.next_tag += 1;
        self.tags.insert(tag);
        self.push_keys(tag, id, first.keys, first.lens)?;
        self.push_waiting(PrefillSubmit::of(OP_STAGE, tag, id, n as u32, 0))?;
        self.asked_for(tag);
        self.declared.insert((tag, id));
        doorbell(&mut self.sq, &mut self.sock)?;
        Ok(tag)
    }

    /// Hands the declared batch `b` (of [`begin_declared`](Self::begin_declared))
    /// over, its slots filled: its keys, lengths and tokens are the
    /// declared ones. On error the batch comes back as in
    /// [`submit`](Self::submit).
    pub fn submit_declared(&mut self, b: StagedSlots) -> Result<(), SubmitError> {
        if !b.declared || !self.held.contains(&(b.tag, b.id)) {
            return Err(SubmitError {
                error: AttachError::Protocol("not this client's declared batch".into()),
                batch: Some(b),
            });
        }
        let s = PrefillSubmit::submit(b.tag, b.id, b.slots.len() as u32, None);
        if let Err(error) = self.push_waiting(s) {
            return Err(SubmitError {
                error,
                batch: Some(b),
            });
        }
        self.held.remove(&(b.tag, b.id));
        self.declared.remove(&(b.tag, b.id));
        doorbell(&mut self.sq, &mut self.sock).map_err(|error| SubmitError { error, batch: None })
    }

    /// Asks for `n` staging slots for request `tag`; they come as a
    /// [`PrefillEvent::Staged`] once the request is admitted and the slots
    /// are free.
    pub fn stage(&mut self, tag: u64, n: u32) -> Result<(), AttachError> {
        if !self.tags.contains(&tag) {
            return Err(AttachError::Protocol(format!("tag {tag} is not a request")));
        }
        self.push(PrefillSubmit::of(OP_STAGE, tag, self.next_batch, n, 0))?;
        self.asked_for(tag);
        Ok(())
    }

    /// Books the STAGE just pushed for `tag` (batch id `next_batch`): the
    /// next batch gets the next id, and one more STAGED is expected.
    fn asked_for(&mut self, tag: u64) {
        self.next_batch = self.next_batch.wrapping_add(1);
        *self.asked.entry(tag).or_default() += 1;
    }

    /// Pushes one KEY entry per chunk of batch `id` of `tag` (`keys[i]`,
    /// `lens[i]` bytes; the keys checked by [`check_keys`]), without
    /// ringing.
    fn push_keys(
        &mut self,
        tag: u64,
        id: u32,
        keys: &[&str],
        lens: &[u32],
    ) -> Result<(), AttachError> {
        for (i, (k, &len)) in keys.iter().zip(lens).enumerate() {
            let s = PrefillSubmit::with_text(OP_KEY, tag, id, i as u32, len, k)
                .ok_or_else(|| AttachError::Protocol(format!("key {i} out of range")))?;
            self.push_waiting(s)?;
        }
        Ok(())
    }

    /// Slot `i` of a held batch, to fill in place (`None` if out of range
    /// or not held).
    pub fn slot_mut(&mut self, b: &StagedSlots, i: usize) -> Option<&mut [u8]> {
        if !self.held.contains(&(b.tag, b.id)) {
            return None;
        }
        let slot = *b.slots.get(i)?;
        let sb = self.hello.chunk_bytes as usize;
        // In range: checked against the geometry when STAGED arrived.
        let off = slot as usize * sb;
        self.staging.get_mut(off..off + sb)
    }

    /// Hands the first `keys.len()` slots of `b` to the sender: chunk `i`
    /// is named `keys[i]` (1..=[`MAX_TEXT`] bytes) and is `lens[i]` bytes.
    /// Waits for room on a full submission ring (see
    /// [`set_full_wait`](Self::set_full_wait)).
    ///
    /// On error the batch comes back in [`SubmitError::batch`] unless its
    /// SUBMIT already went out: still this worker's, its slots as filled,
    /// to submit again or to let go with its request's
    /// [`cancel`](Self::cancel).
    pub fn submit(
        &mut self,
        b: StagedSlots,
        keys: &[&str],
        lens: &[u32],
    ) -> Result<(), SubmitError> {
        if let Err(error) = self.check_batch(&b, keys, lens) {
            return Err(SubmitError {
                error,
                batch: Some(b),
            });
        }
        let pushed = self.push_batch(&b, keys, lens);
        // Once per batch, after the SUBMIT (the KEYs rang only if the ring
        // was full), and also after a batch cut short: a KEY already pushed
        // may have taken the session's wake-up request.
        let rung = doorbell(&mut self.sq, &mut self.sock);
        if let Err(error) = pushed {
            // The SUBMIT is not on the ring: the daemon still holds the
            // batch for this worker, and the KEYs that went out are
            // written again by the next try.
            return Err(SubmitError {
                error,
                batch: Some(b),
            });
        }
        self.held.remove(&(b.tag, b.id));
        rung.map_err(|error| SubmitError { error, batch: None })
    }

    /// What [`submit`](Self::submit) checks before it pushes anything.
    fn check_batch(&self, b: &StagedSlots, keys: &[&str], lens: &[u32]) -> Result<(), AttachError> {
        if !self.held.contains(&(b.tag, b.id)) {
            return Err(AttachError::Protocol("not this client's batch".into()));
        }
        if keys.len() != lens.len() || keys.len() > b.slots.len() {
            return Err(AttachError::Protocol(
                "keys, lens and slots disagree".into(),
            ));
        }
        check_keys(keys)
    }

    /// Pushes the KEY entries of `b`, then its SUBMIT, without ringing
    /// (the keys checked by [`check_batch`](Self::check_batch)).
    fn push_batch(
        &mut self,
        b: &StagedSlots,
        keys: &[&str],
        lens: &[u32],
    ) -> Result<(), AttachError> {
        self.push_keys(b.tag, b.id, keys, lens)?;
        self.push_waiting(PrefillSubmit::submit(
            b.tag,
            b.id,
            keys.len() as u32,
            b.last_chunk_toks,
        ))
    }

    /// Cancels request `tag` (its FAILED event follows). A batch staged
    /// for it before the daemon read the CANCEL is given back by the
    /// daemon and skipped by [`next_event`](Self::next_event), never
    /// returned.
    pub fn cancel(&mut self, tag: u64) -> Result<(), AttachError> {
        self.held.retain(|h| h.0 != tag);
        self.declared.retain(|h| h.0 != tag);
        self.push(PrefillSubmit::of(OP_CANCEL, tag, 0, 0, 0))?;
        if self.tags.contains(&tag) {
            self.cancelled.insert(tag);
        }
        Ok(())
    }

    /// Sends a raw submission, unchecked (for tests of the daemon's
    /// validation: a worker that lies).
    #[doc(hidden)]
    pub fn submit_raw(&mut self, s: PrefillSubmit) -> Result<(), AttachError> {
        self.push(s)
    }

    /// Takes the next completion entry as it is on the ring, without the
    /// client's bookkeeping (for tests of the daemon's answers to raw
    /// submissions, which the checked events would refuse: a STAGED not
    /// asked for).
    #[doc(hidden)]
    pub fn next_raw(&mut self, deadline: Instant) -> Result<DecoderEvent, AttachError> {
        next_entry(&mut self.cq, deadline)
    }

    /// Waits until the next event or `deadline`.
    pub fn next_event(&mut self, deadline: Instant) -> Result<PrefillEvent, AttachError> {
        loop {
            let ev = next_entry(&mut self.cq, deadline)?;
            if let Some(out) = self.on_event(ev)? {
                return Ok(out);
            }
        }
    }

    fn on_event(&mut self, ev: DecoderEvent) -> Result<Option<PrefillEvent>, AttachError> {
        let bad = |what: &str| AttachError::Protocol(format!("{what}: {ev:?}"));
        match ev.kind {
            EV_STAGED if self.cancelled.contains(&ev.tag) => {
                // Staged before the daemon read our CANCEL: the daemon gave
                // the batch back (its slots may be another batch's now).
                skip_follow_ons(&mut self.cq, &ev, EV_SLOT, ev.b as usize, "STAGED")?;
                Ok(None)
            }
            EV_STAGED => {
                let asked = self.asked.get_mut(&ev.tag).filter(|n| **n > 0);
                let Some(asked) = asked else {
                    return Err(bad("STAGED not asked for"));
                };
                *asked -= 1;
                let share = self.hello.slots;
                let slots = follow_ons(&mut self.cq, &ev, EV_SLOT, ev.b as usize, "STAGED", |c| {
                    (u64::from(c.a) < share).then_some(c.a)
                })?;
                self.held.insert((ev.tag, ev.a));
                Ok(Some(PrefillEvent::Staged(StagedSlots {
                    tag: ev.tag,
                    id: ev.a,
                    slots,
                    last_chunk_toks: None,
                    declared: self.declared.contains(&(ev.tag, ev.a)),
                })))
            }
            EV_DONE | EV_FAILED => {
                if !self.tags.remove(&ev.tag) {
                    return Err(bad("end of a tag not begun"));
                }
                let held = self.held.len();
                self.held.retain(|h| h.0 != ev.tag);
                self.declared.retain(|h| h.0 != ev.tag);
                if self.held.len() != held {
                    // The daemon keeps batches we held until we say we no
                    // longer write them.
                    self.push_waiting(PrefillSubmit::of(OP_CANCEL, ev.tag, 0, 0, 0))?;
                    doorbell(&mut self.sq, &mut self.sock)?;
                }
                self.asked.remove(&ev.tag);
                self.cancelled.remove(&ev.tag);
                Ok(Some(if ev.kind == EV_DONE {
                    PrefillEvent::Done { tag: ev.tag }
                } else {
                    PrefillEvent::Failed {
                        tag: ev.tag,
                        code: error_from_number(ev.code),
                    }
                }))
            }
            // Changes no bookkeeping here: a refused BEGIN's tag gets no
            // end event (the caller knows which submission it was).
            EV_REFUSED => Ok(Some(PrefillEvent::Refused {
                tag: ev.tag,
                reason: Refusal::from_code(ev.code),
            })),
            _ => Err(bad("unknown event kind")),
        }
    }
}

/// Every key is 1..=[`MAX_TEXT`] bytes (what a KEY entry carries).
fn check_keys(keys: &[&str]) -> Result<(), AttachError> {
    match keys.iter().position(|k| k.is_empty() || k.len() > MAX_TEXT) {
        Some(i) => Err(AttachError::Protocol(format!(
            "key {i} must be 1..={MAX_TEXT} bytes"
        ))),
        None => Ok(()),
    }
}

const _: () = assert!(MAX_TEXT <= u16::MAX as usize && MAX_REQ_ID <= MAX_TEXT);
