//! The handles a server holds: a [`Request`] (one transfer, from
//! [`Sender::begin`](super::Sender::begin)) and a [`StagedBatch`] (staging
//! slots of an admitted request, filled in place and then submitted).

use std::io;
use std::num::NonZeroU64;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::slots::{AllocError, SlotSet};
use crate::stats::Stage;

use smallvec::SmallVec;

use super::completion::Signal;
use super::registered::{MemoryRegion, RegionEntry, WriteHandle, WriteLease};
use super::table::ReqKey;
use super::{RequestStatus, Shared, StoreError};

/// What one transfer is: the per-request part of LMCache's `transfer_spec`.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// The request (non-empty; unique among this sender's live requests).
    pub req_id: String,
    /// The receiver's ZMQ endpoint.
    pub receiver: String,
    /// Chunks in the whole request.
    pub total_chunks: usize,
    /// KV memory format code (at least 0), passed through.
    pub fmt: i64,
    /// Shape of one full chunk (empty: `[chunk_bytes]` of `uint8`); a full
    /// chunk fits a staging slot.
    pub shape: Vec<i64>,
    /// Element type with `shape` (default `"uint8"`).
    pub dtype: String,
}

impl RequestSpec {
    /// A spec with byte-shaped chunks.
    pub fn new(
        req_id: impl Into<String>,
        receiver: impl Into<String>,
        total_chunks: usize,
    ) -> Self {
        Self {
            req_id: req_id.into(),
            receiver: receiver.into(),
            total_chunks,
            fmt: 0,
            shape: Vec::new(),
            dtype: "uint8".into(),
        }
    }
}

/// What a request's handles, its table entry and (by its id) the sender's
/// name index share: everything a caller thread reads or changes of a
/// request without the table lock.
#[derive(Debug)]
pub(crate) struct Common {
    /// The request's slot in the sender's table (no lookup by id).
    pub key: ReqKey,
    /// The id, for the wire and logs (one allocation per request).
    pub req_id: Arc<str>,
    /// The receiver's endpoint.
    pub receiver: String,
    /// The request's `total_chunks`.
    pub total: usize,
    /// What the callers stored of it (reserved by handles, read by ctrl).
    pub stored: super::count::StoredCount,
    /// Admission, terminal status, waiters, and the life word that decides
    /// between a caller's cancel and ctrl's own ending.
    pub signal: Signal,
    /// Fired by whoever stops the request: wakes its staging waiters.
    pub cancel: crate::cancel::CancelToken,
    /// The request's chunk geometry, as its batches are checked against it.
    pub geometry: Geometry,
    /// Its chunk format, as its AllocRequests carry it.
    pub format: Format,
    /// Chunks of the batch declared at begin
    /// ([`Sender::begin_declared`](super::Sender::begin_declared)), 0 if
    /// none: its keys went out with the admission, its bytes come with
    /// [`StagedBatch::submit_declared`].
    pub declared: usize,
    /// The declared batch's bytes have not been submitted yet (taken once,
    /// by the submit that hands them over).
    pub declared_open: AtomicBool,
}

/// A request's chunk format as its AllocRequests carry it: the caller's
/// `fmt`, `shape` and `dtype`, the byte shape (`[]`) as `[slot_bytes]`.
/// Every batch of a request names the one it began with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Format {
    pub fmt: i64,
    pub shape: Vec<i64>,
    pub dtype: String,
}

impl Format {
    /// The format of a request of `fmt`, `shape` and `dtype` on a sender
    /// of `slot_bytes` staging slots.
    pub(crate) fn of(fmt: i64, shape: &[i64], dtype: &str, slot_bytes: u64) -> Self {
        Self {
            fmt,
            shape: on_the_wire(shape, slot_bytes, <[i64]>::to_vec),
            dtype: dtype.to_owned(),
        }
    }

    /// True if a batch naming `fmt`, `shape` and `dtype` names this format
    /// (compared in place: nothing allocated per batch).
    pub(crate) fn is(&self, fmt: i64, shape: &[i64], dtype: &str, slot_bytes: u64) -> bool {
        self.fmt == fmt
            && self.dtype == dtype
            && on_the_wire(shape, slot_bytes, |s| self.shape == s)
    }
}

/// `f` of `shape` as a request carries it: the byte shape (`[]`) as
/// `[slot_bytes]`.
fn on_the_wire<T>(shape: &[i64], slot_bytes: u64, f: impl FnOnce(&[i64]) -> T) -> T {
    let bytes = [i64::try_from(slot_bytes).unwrap_or(i64::MAX)];
    f(if shape.is_empty() { &bytes } else { shape })
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fmt {}, shape {:?}, dtype {}",
            self.fmt, self.shape, self.dtype
        )
    }
}

/// Why a request's `fmt`, `shape` and `dtype` cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A negative `fmt` (a format code is an index: LMCache's receiver
    /// reads it as one).
    #[error("negative fmt {0}")]
    NegativeFmt(i64),
    /// They make no chunk size: an unknown dtype, a dimension below 1, an
    /// overflow (the receiver refuses the request).
    #[error("{0}")]
    Chunk(crate::protocol::ProtocolError),
    /// A full chunk is larger than the sender's staging slots (the byte
    /// shape of a dtype wider than a byte is too: `[slot_bytes]` of it).
    #[error("a chunk of this shape is {bytes} bytes, larger than the {max}-byte slots")]
    TooLarge {
        /// Bytes of one full chunk.
        bytes: u64,
        /// The sender's `chunk_bytes`.
        max: u64,
    },
}

/// Bytes of one full chunk of `shape` of `dtype` (an empty shape is the
/// byte shape, which requests carry as `[slot_bytes]`) in format `fmt` on
/// a sender of `slot_bytes` staging slots, if it can send them: the one
/// check of a request's geometry before anything of it is sent, in
/// process (`Sender::begin`) and attached (`BeginGeometry::check`).
pub(crate) fn full_chunk(
    fmt: i64,
    shape: &[i64],
    dtype: &str,
    slot_bytes: u64,
) -> Result<u64, ShapeError> {
    if fmt < 0 {
        return Err(ShapeError::NegativeFmt(fmt));
    }
    let bytes = on_the_wire(shape, slot_bytes, |s| {
        crate::protocol::chunk_bytes_of(s, dtype)
    })
    .map_err(ShapeError::Chunk)?;
    if bytes > slot_bytes {
        return Err(ShapeError::TooLarge {
            bytes,
            max: slot_bytes,
        });
    }
    Ok(bytes)
}

/// A request's chunk geometry as the sender checks its batches' lengths
/// against it (`Shared::check_lens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Bytes of one whole chunk: its `shape` of `dtype`, or a staging slot
    /// for the default byte shape (which the AllocRequests then carry as
    /// `[slot_bytes]`); never more than a staging slot.
    pub full: u64,
    /// Bytes per token of a one-dimensional shape (`[tokens]`; 1 for the
    /// byte shape): the receiver makes a batch's last chunk
    /// `last_chunk_toks` of them. `None` for more dimensions, whose token
    /// axis depends on `fmt` (the receiver reports their last chunk
    /// whole).
    pub token_bytes: Option<NonZeroU64>,
}

impl Geometry {
    /// The geometry of a request of `fmt`, `shape` and `dtype` on a sender
    /// of `slot_bytes` staging slots, if it can send it ([`full_chunk`]).
    pub(crate) fn of(
        fmt: i64,
        shape: &[i64],
        dtype: &str,
        slot_bytes: u64,
    ) -> Result<Self, ShapeError> {
        let full = full_chunk(fmt, shape, dtype, slot_bytes)?;
        let token_bytes = match shape {
            // `[slot_bytes]` of a one-byte dtype (`full_chunk` refused a
            // wider one: two slots).
            [] => Some(NonZeroU64::MIN),
            // `full_chunk` checked the dimension is positive, and a whole
            // chunk is `tokens` elements of at least one byte.
            [tokens] => NonZeroU64::new(full / *tokens as u64),
            _ => None,
        };
        Ok(Self { full, token_bytes })
    }
}

impl Common {
    /// A request of `spec`, whose `geometry` (`Geometry::of` its `spec`)
    /// the sender checked.
    /// `declared`: the chunks of its declared first batch (0: none).
    pub fn new(
        key: ReqKey,
        spec: &RequestSpec,
        geometry: Geometry,
        slot_bytes: u64,
        declared: usize,
    ) -> Self {
        Self {
            declared,
            declared_open: AtomicBool::new(declared > 0),
            key,
            geometry,
            format: Format::of(spec.fmt, &spec.shape, &spec.dtype, slot_bytes),
            req_id: Arc::from(spec.req_id.as_str()),
            receiver: spec.receiver.clone(),
            total: spec.total_chunks,
            stored: Default::default(),
            signal: Signal::default(),
            cancel: crate::cancel::CancelToken::new(),
        }
    }
}

/// What a [`Request`] and its batches share: the request's [`Common`]
/// state (reached through `Deref`), the sender, and this handle's end of
/// the submission ring.
pub(crate) struct Handle {
    pub shared: Arc<Shared>,
    pub c: Arc<Common>,
    /// This handle's end of the submission ring (its batches go to ctrl
    /// through it, not through the table).
    pub outbox: super::submit::Outbox,
}

impl std::ops::Deref for Handle {
    type Target = Common;

    fn deref(&self) -> &Common {
        &self.c
    }
}

/// One transfer, from [`Sender::begin`](super::Sender::begin) to its
/// terminal status. A cheap handle (clones share the request); dropping it
/// does not cancel the request (use [`cancel`](Self::cancel)).
///
/// Chunks go in through one of:
/// - [`stage`](Self::stage) / [`try_stage`](Self::try_stage): staging slots
///   to fill in place (e.g. the target of a device-to-host copy), then
///   [`StagedBatch::submit`]: one copy on shm (the copy engine's), none on
///   the sender's side;
/// - [`write`](Self::write): straight from memory registered with
///   [`Sender::register`](super::Sender::register), no staging at all (one
///   copy on shm, the copy engine's; none but the socket's on tcp);
/// - [`store`](Self::store): copies the caller's bytes (for short-lived
///   buffers).
///
/// The request's last batch is the one that brings it to `total_chunks`.
#[derive(Clone)]
pub struct Request {
    pub(crate) h: Arc<Handle>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("req_id", &&*self.h.req_id)
            .field("admitted", &self.h.signal.is_admitted())
            .field("status", &self.h.signal.status())
            .finish()
    }
}

impl Request {
    /// The request's id.
    pub fn id(&self) -> &str {
        &self.h.req_id
    }

    /// The current status; never blocks.
    pub fn status(&self) -> RequestStatus {
        self.h.signal.status()
    }

    /// Whether the receiver admitted the request (staging is available to
    /// it from then on).
    pub fn is_admitted(&self) -> bool {
        self.h.signal.is_admitted()
    }

    /// Waits until the request is terminal or `deadline` passes; returns
    /// its status then (`InProgress` on timeout).
    ///
    /// `Completed` means every write completed and ProxyNotif/TransferDone
    /// were sent.
    pub fn wait(&self, deadline: Instant) -> RequestStatus {
        let s = &self.h.signal;
        s.wait_until(deadline, || s.terminal().is_some());
        s.status()
    }

    /// A file descriptor (an eventfd) that becomes readable once the
    /// request is terminal, for an event loop (`epoll`, `mio`, tokio's
    /// `AsyncFd`). Made on first call; read it (8 bytes) or just drop
    /// interest after it fired, then call [`status`](Self::status). It lives
    /// as long as the request's handles.
    pub fn completion_fd(&self) -> io::Result<BorrowedFd<'_>> {
        self.h.signal.fd()
    }

    /// Makes `share`'s [`ready_fd`](super::StagingShare::ready_fd) also
    /// become readable when this request becomes terminal, so one `poll` of
    /// that descriptor covers every request staged from the share (the
    /// attach daemon's prefill sessions: no eventfd per request). Returns
    /// whether the request is terminal already. Whoever polls the fd clears
    /// it, then reads each request's [`status`](Self::status): the status
    /// is recorded before the signal.
    pub(crate) fn notify_end_on(&self, share: &super::StagingShare) -> bool {
        self.h.signal.notify_terminal(&share.ready)
    }

    /// Cancels the request (see [`Sender::cancel_request`](super::Sender::cancel_request)).
    /// False if it already ended.
    pub fn cancel(&self) -> bool {
        self.h.shared.cancel(&self.h.c, Some(&self.h.outbox))
    }

    /// Staging slots for the next `n` chunks, to fill in place and
    /// [`submit`](StagedBatch::submit).
    ///
    /// Staging is only handed to admitted requests (DESIGN.md invariant 2):
    /// while the receiver has not admitted the request this waits for the
    /// admission holding nothing, then for `n` slots, all or none, in FIFO
    /// order with the other callers. Both waits end at `deadline`
    /// ([`StoreError::AdmissionTimeout`], [`StoreError::StagingTimeout`]),
    /// on cancel ([`StoreError::Cancelled`]) or when the request ends.
    pub fn stage(&self, n: usize, deadline: Instant) -> Result<StagedBatch, StoreError> {
        self.check_stage(n)?;
        self.wait_admitted(deadline)?;
        let t0 = Instant::now();
        let set = self
            .h
            .shared
            .slots
            .alloc(n, Some(deadline), &self.h.cancel)
            .map_err(|e| match e {
                AllocError::Cancelled => Shared::stopped(&self.h.signal),
                AllocError::Timeout => StoreError::StagingTimeout,
                AllocError::TooLarge { requested, slots } => StoreError::BatchTooLarge {
                    chunks: requested,
                    slots,
                },
            })?;
        self.h.shared.stats.record_since(Stage::StagingWait, t0);
        Ok(self.batch(set))
    }

    /// [`stage`](Self::stage) without blocking: [`StoreError::NotAdmitted`]
    /// before admission, [`StoreError::NoStagingNow`] if `n` slots are not
    /// free right now (or other callers queue for staging ahead of this one).
    pub fn try_stage(&self, n: usize) -> Result<StagedBatch, StoreError> {
        self.check_stage(n)?;
        self.live()?;
        if !self.is_admitted() {
            return Err(StoreError::NotAdmitted);
        }
        match self.h.shared.slots.try_alloc(n) {
            Some(set) => Ok(self.batch(set)),
            None => Err(StoreError::NoStagingNow),
        }
    }

    /// [`try_stage`](Self::try_stage) from a staging share
    /// ([`Sender::take_share`](super::Sender::take_share)): the batch's
    /// slots are the share's only. When it fails with
    /// [`StoreError::NotAdmitted`] or [`StoreError::NoStagingNow`] the
    /// share's [`ready_fd`](super::StagingShare::ready_fd) is armed: it
    /// becomes readable once the request is admitted or slots of the share
    /// are freed, so the caller can sleep in `poll` until then.
    /// [`StoreError::BatchTooLarge`] past the share's size,
    /// [`StoreError::ForeignShare`] for another sender's share.
    pub fn try_stage_in(
        &self,
        share: &super::StagingShare,
        n: usize,
    ) -> Result<StagedBatch, StoreError> {
        if !Arc::ptr_eq(&share.shared, &self.h.shared) {
            return Err(StoreError::ForeignShare);
        }
        let slots = share.layout().slots;
        if n > slots {
            return Err(StoreError::BatchTooLarge { chunks: n, slots });
        }
        self.live()?;
        if !self.is_admitted() && !self.h.signal.notify_admission(&share.ready) {
            return Err(StoreError::NotAdmitted);
        }
        match self.h.shared.slots.try_alloc_in(share.index, n) {
            Some(set) => Ok(self.batch(set)),
            None => Err(StoreError::NoStagingNow),
        }
    }

    /// Copies one batch (`keys[i]` names `chunks[i]`; every chunk whole
    /// but the last, which may be short, as [`StagedBatch::submit`] says)
    /// and returns without waiting for the network: into staging if the
    /// request is admitted (waiting up to the sender's `staging_timeout`
    /// for slots), otherwise into the bounded pending area
    /// ([`StoreError::Backpressure`] at once if full).
    pub fn store(&self, keys: &[impl AsRef<str>], chunks: &[&[u8]]) -> Result<(), StoreError> {
        self.h
            .shared
            .validate_batch(self.h.geometry, keys.len(), chunks, None)?;
        self.h.shared.store_copy(&self.h, keys, chunks, None, None)
    }

    /// Posts one batch straight from registered memory: chunk `i` is named
    /// `keys[i]` and is the `len` bytes at `offset` of `region`, for each
    /// `chunks[i] = (region, offset, len)`. No staging and no copy on the
    /// sender: the transport reads the region (the shm copy engine copies it
    /// into the receiver, tcp sends it from there).
    ///
    /// Like [`stage`](Self::stage), this first waits (up to `deadline`) for
    /// the receiver to admit the request, so writes are only posted for
    /// admitted requests (DESIGN.md invariant 2). Returns without waiting for
    /// the network; the [`WriteHandle`] says when the chunks' memory may be
    /// written again. The batch is the request's last if it brings the
    /// request to `total_chunks`.
    ///
    /// Errors (nothing is sent): [`StoreError::KeyCountMismatch`],
    /// [`StoreError::ForeignRegion`], [`StoreError::RegionNotRegistered`],
    /// [`StoreError::OutsideRegion`], [`StoreError::ChunkTooLarge`] (longer
    /// than the receiver's slot, `chunk_bytes`), the admission errors of
    /// `stage` and the count errors of `submit`.
    pub fn write(
        &self,
        keys: &[impl AsRef<str>],
        chunks: &[(&MemoryRegion, u64, u32)],
        deadline: Instant,
    ) -> Result<WriteHandle, StoreError> {
        if keys.len() != chunks.len() {
            return Err(StoreError::KeyCountMismatch {
                keys: keys.len(),
                chunks: chunks.len(),
            });
        }
        let shared = &self.h.shared;
        Shared::check_lens(
            self.h.geometry,
            chunks.iter().map(|&(_, _, len)| u64::from(len)),
            None,
        )?;
        let mut regions: Vec<Arc<RegionEntry>> = Vec::new();
        for (index, &(region, offset, len)) in chunks.iter().enumerate() {
            let e = &region.entry;
            if !e.belongs_to(shared) {
                return Err(StoreError::ForeignRegion { index });
            }
            if offset
                .checked_add(u64::from(len))
                .is_none_or(|end| end > e.len as u64)
            {
                return Err(StoreError::OutsideRegion {
                    index,
                    offset,
                    len,
                    region_len: e.len,
                });
            }
            if !regions.iter().any(|r| r.id == e.id) {
                regions.push(Arc::clone(e));
            }
        }
        self.wait_admitted(deadline)?;
        let ids: SmallVec<[u32; 4]> = regions.iter().map(|r| r.id).collect();
        let lease = WriteLease::acquire(regions).map_err(|i| {
            let index = chunks
                .iter()
                .position(|c| c.0.entry.id == ids[i])
                .unwrap_or(0);
            StoreError::RegionNotRegistered { index }
        })?;
        let handle = lease.handle();
        let src = chunks.iter().map(|c| (c.0.entry.id, c.1)).collect();
        let lens: SmallVec<[u32; 16]> = chunks.iter().map(|c| c.2).collect();
        shared.submit_registered(&self.h, keys, lens, src, lease)?;
        Ok(handle)
    }

    /// Waits for admission (see [`stage`](Self::stage)).
    fn wait_admitted(&self, deadline: Instant) -> Result<(), StoreError> {
        let s = &self.h.signal;
        let admitted = s.wait_until(deadline, || {
            s.is_admitted() || s.terminal().is_some() || self.h.cancel.is_cancelled()
        });
        self.live()?;
        if !admitted {
            return Err(StoreError::AdmissionTimeout);
        }
        Ok(())
    }

    fn check_stage(&self, n: usize) -> Result<(), StoreError> {
        let slots = self.h.shared.cfg.staging_slots;
        if n > slots {
            return Err(StoreError::BatchTooLarge { chunks: n, slots });
        }
        Ok(())
    }

    /// Err if the request ended or is being cancelled.
    fn live(&self) -> Result<(), StoreError> {
        if let Some(s) = self.h.signal.terminal() {
            return Err(StoreError::RequestEnded(s.clone()));
        }
        if self.h.cancel.is_cancelled() {
            return Err(Shared::stopped(&self.h.signal));
        }
        Ok(())
    }

    fn batch(&self, set: SlotSet) -> StagedBatch {
        StagedBatch {
            h: Arc::clone(&self.h),
            set: Some(set),
            last_chunk_toks: None,
        }
    }
}

/// Staging slots of an admitted request, owned by the caller until
/// [`submit`](Self::submit)ted: one `&mut [u8]` of `slot_bytes` per slot to
/// fill in place. Not `Clone` and only made by [`Request::stage`], so
/// nobody else can touch these bytes until the write from them completes.
/// Dropping it without submitting gives the slots back.
pub struct StagedBatch {
    h: Arc<Handle>,
    /// `None` once submitted.
    set: Option<SlotSet>,
    last_chunk_toks: Option<i64>,
}

impl std::fmt::Debug for StagedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedBatch")
            .field("req_id", &&*self.h.req_id)
            .field("slots", &self.len())
            .finish()
    }
}

impl StagedBatch {
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.set.as_ref().map_or(0, SlotSet::len)
    }

    /// True for a batch of no slots (to submit an empty last batch).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per slot (the sender's `chunk_bytes`).
    pub fn slot_bytes(&self) -> usize {
        self.h.shared.cfg.chunk_bytes as usize
    }

    /// The batch's staging slot indexes, in order (see
    /// [`Sender::staging_file`](super::Sender::staging_file)).
    pub fn slot_indexes(&self) -> &[u32] {
        self.set.as_ref().map_or(&[], SlotSet::as_slice)
    }

    /// Slot `i` of the batch, to fill in place (`None` if `i >= len()`).
    pub fn slot_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let slot = self.set.as_ref()?.as_slice().get(i).copied()?;
        self.slice(slot)
    }

    /// Every slot, in order, each `slot_bytes` long.
    pub fn slots_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        let len = self.slot_bytes();
        let staging = Arc::clone(&self.h.shared.staging);
        let slots: &[u32] = self.set.as_ref().map_or(&[], |s| s.as_slice());
        slots.iter().filter_map(move |&slot| {
            let p = staging.slot_ptr(slot)?;
            // SAFETY: `slot` comes from this batch's `SlotSet`, which the
            // allocator handed out to this batch alone and which is not
            // `Clone`; no write is posted from it before `submit` consumes the
            // batch, so nothing else reads or writes these `len` bytes while
            // the returned borrows (tied to `&mut self`) live. The set's
            // slots are distinct, so the slices never overlap. `slot_ptr`
            // returned a pointer inside the mapping, and `len == slot_bytes`
            // keeps the slice inside the slot.
            Some(unsafe { std::slice::from_raw_parts_mut(p, len) })
        })
    }

    fn slice(&mut self, slot: u32) -> Option<&mut [u8]> {
        let len = self.slot_bytes();
        // `None` cannot happen: a set's slots are below the slot count.
        let p = self.h.shared.staging.slot_ptr(slot)?;
        // SAFETY: as in `slots_mut`: the slot is owned by this batch alone,
        // nothing reads it before submit, the borrow is tied to `&mut self`,
        // and `len` bytes from the slot's start stay inside the slot.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    /// Sets the token count of the batch's last chunk (default: the
    /// tokens it holds: its bytes over the element size of a
    /// one-dimensional shape, its bytes otherwise). For a one-dimensional
    /// shape the receiver makes the chunk that many tokens' bytes, so
    /// [`submit`](Self::submit) refuses a chunk of another length
    /// ([`StoreError::LastChunkTokens`]); on any shape it refuses a count
    /// outside `0..=u32::MAX` ([`StoreError::TokensOutOfRange`]).
    pub fn set_last_chunk_toks(&mut self, toks: i64) {
        self.last_chunk_toks = Some(toks);
    }

    /// Hands the first `keys.len()` slots over: chunk `i` is named
    /// `keys[i]` and is `lens[i]` bytes long (the start of slot `i`). Every
    /// chunk but the last is whole (one chunk of the request's geometry: a
    /// staging slot for the default byte shape;
    /// [`StoreError::ShortChunk`]), and none is longer
    /// ([`StoreError::ChunkTooLarge`]): the receiver takes every chunk of a
    /// batch but its last as whole. Slots past `keys.len()` go back at
    /// once. Returns without waiting for the network. The batch is the
    /// request's last if it brings the request to `total_chunks`; only a
    /// last batch may be empty.
    ///
    /// On error the slots go back and nothing is sent.
    pub fn submit(mut self, keys: &[impl AsRef<str>], lens: &[u32]) -> Result<(), StoreError> {
        let Some(mut set) = self.set.take() else {
            return Err(StoreError::Closed);
        };
        let shared = Arc::clone(&self.h.shared);
        let check = (|| {
            if keys.len() != lens.len() {
                return Err(StoreError::KeyCountMismatch {
                    keys: keys.len(),
                    chunks: lens.len(),
                });
            }
            if keys.len() > set.len() {
                return Err(StoreError::MoreChunksThanSlots {
                    chunks: keys.len(),
                    slots: set.len(),
                });
            }
            Shared::check_lens(
                self.h.geometry,
                lens.iter().map(|&l| u64::from(l)),
                self.last_chunk_toks,
            )
        })();
        if let Err(e) = check {
            shared.slots.free(set);
            return Err(e);
        }
        let unused = set.split_off(keys.len());
        shared.slots.free(unused);
        shared.submit_staged(&self.h, keys, lens, set, self.last_chunk_toks)
    }
}

impl StagedBatch {
    /// Hands the first `n` slots over as the request's declared batch
    /// ([`Sender::begin_declared`](super::Sender::begin_declared) of `n`
    /// chunks): slot `i` holds the chunk declared as `keys[i]`, `lens[i]`
    /// bytes long (the declaration's lengths and last-chunk tokens count;
    /// [`set_last_chunk_toks`](Self::set_last_chunk_toks) does not apply).
    /// Its receiver slots were allocated with the admission, so its writes
    /// are posted at once. Slots past `n` go back. Returns without waiting
    /// for the network.
    ///
    /// Errors (the slots go back, nothing is sent):
    /// [`StoreError::NoDeclaredBatch`] if the request declared none or it
    /// was submitted already, [`StoreError::MoreChunksThanSlots`] if this
    /// batch has fewer than `n` slots, and the request's end or stop (the
    /// declaration then stays open).
    pub fn submit_declared(mut self) -> Result<(), StoreError> {
        let Some(mut set) = self.set.take() else {
            return Err(StoreError::Closed);
        };
        let shared = Arc::clone(&self.h.shared);
        let n = self.h.declared;
        // Acquire: pairs with the Release re-open in `fill_declared`; the
        // flag publishes nothing else (the swap alone makes one submit
        // take it).
        if n == 0 || !self.h.declared_open.swap(false, Ordering::Acquire) {
            shared.slots.free(set);
            return Err(StoreError::NoDeclaredBatch {
                req_id: self.h.req_id.to_string(),
            });
        }
        if set.len() < n {
            // Open again for a later submit (Release: as in `fill_declared`;
            // it publishes nothing but the flag).
            self.h.declared_open.store(true, Ordering::Release);
            let slots = set.len();
            shared.slots.free(set);
            return Err(StoreError::MoreChunksThanSlots { chunks: n, slots });
        }
        let unused = set.split_off(n);
        shared.slots.free(unused);
        shared.fill_declared(&self.h, set)
    }
}

impl Drop for StagedBatch {
    fn drop(&mut self) {
        if let Some(set) = self.set.take() {
            self.h.shared.slots.free(set);
        }
    }
}
