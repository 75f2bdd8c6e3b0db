//! A batch's way to the ctrl thread: the reservation of its chunks in its
//! request's count, its data (staging slots, the pending area or registered
//! memory), its push on the submission ring, and what is given back when it
//! is refused (a method group of `Shared`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tracing::debug;

use crate::slots::{AllocError, SlotSet};
use crate::stats::{Counter, Stage};

use super::keys::KeyList;
use super::request::Handle;
use super::table::{Batch, BatchData, ReqKey};
use super::{core, life, registered, Shared, StoreError};

/// The reservation of a batch's chunks in its request's count.
struct Reserved {
    admitted: bool,
    is_last: bool,
}

impl Shared {
    /// A batch of request `req` (its geometry is the request's).
    pub(super) fn batch_for(
        req: ReqKey,
        keys: KeyList,
        lens: SmallVec<[u32; 16]>,
        data: BatchData,
        is_last: bool,
        last_chunk_toks: i64,
    ) -> Batch {
        let bytes = lens.iter().map(|&l| l as usize).sum();
        Batch {
            req,
            keys,
            lens,
            data,
            is_last,
            stored_at: Instant::now(),
            last_chunk_toks,
            bytes,
            remote: Vec::new(),
            writes: SmallVec::new(),
            fills: false,
        }
    }

    /// Reserves `n` chunks of the request's count (so concurrent batches
    /// cannot overshoot). `is_last`: the caller's claim (copying `store`),
    /// or `None` to end the request when the count reaches its total.
    /// Without the table lock: the count is the handle's atomic word
    /// ([`count::StoredCount`]), liveness its cancel token and terminal
    /// status (an abort fires the token; a request completes only once its
    /// last batch is reserved, after which no reservation succeeds).
    ///
    /// [`count::StoredCount`]: super::count::StoredCount
    fn reserve(&self, h: &Handle, n: usize, is_last: Option<bool>) -> Result<Reserved, StoreError> {
        if let Some(s) = h.signal.terminal() {
            return Err(StoreError::RequestEnded(s.clone()));
        }
        if h.cancel.is_cancelled() {
            return Err(Self::stopped(&h.signal));
        }
        let req_id = || h.req_id.to_string();
        let is_last = h.stored.reserve(n, h.total, is_last).map_err(|r| match r {
            core::Refusal::AfterLast => StoreError::AfterLastBatch { req_id: req_id() },
            core::Refusal::TooMany { chunks } => StoreError::TooManyChunks {
                req_id: req_id(),
                chunks,
                total: h.total,
            },
            core::Refusal::EmptyNotLast => StoreError::EmptyBatchNotLast,
        })?;
        Ok(Reserved {
            admitted: h.signal.is_admitted(),
            is_last,
        })
    }

    /// Publishes a reserved batch: hands it to ctrl through the handle's
    /// end of the submission ring (ring order = send order), no table lock.
    /// On error the batch's data is released and the reservation given
    /// back.
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: SmallVec<[u32; 16]>,
        data: BatchData,
        reserved: &Reserved,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let n = lens.len();
        let toks = Self::last_chunk_toks(h.geometry, lens.last().copied(), last_chunk_toks);
        // A request that stopped since the reservation (cancelled, failed,
        // closed) takes no more batches. Read without the table lock: every
        // abort fires the request's cancel token (`Req::aborted`) under it,
        // and the end sets the terminal status. (A stop after this check
        // is seen by ctrl, which drops the batch when it takes it.)
        if h.signal.terminal().is_some() || h.cancel.is_cancelled() {
            let bytes = lens.iter().map(|&l| l as usize).sum();
            self.release_data(data, bytes);
            self.give_back(h, n, reserved.is_last);
            return Err(Self::stopped(&h.signal));
        }
        let keys = KeyList::from_keys(keys);
        let batch = Self::batch_for(h.key, keys, lens, data, reserved.is_last, toks);
        if let Err((b, e)) = self.submit_batch(h, Box::new(batch)) {
            self.release_data(b.data, b.bytes);
            self.give_back(h, n, reserved.is_last);
            return Err(e);
        }
        self.stats.inc(Counter::Batches);
        debug!(admitted = reserved.admitted, chunks = n, "submitted");
        Ok(())
    }

    /// Submits a staged batch (the slots hold the chunks' bytes).
    pub(super) fn submit_staged(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: &[u32],
        set: SlotSet,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let span = tracing::debug_span!("submit", req_id = %h.req_id, chunks = keys.len());
        let _g = span.enter();
        let reserved = match self.reserve(h, keys.len(), None) {
            Ok(r) => r,
            Err(e) => {
                self.slots.free(set);
                return Err(e);
            }
        };
        let data = if set.is_empty() {
            self.slots.free(set);
            BatchData::Empty
        } else {
            BatchData::Staged(set)
        };
        self.publish(
            h,
            keys,
            lens.iter().copied().collect(),
            data,
            &reserved,
            last_chunk_toks,
        )
    }

    /// Hands the bytes of the request's declared batch (`set`: one slot
    /// per declared chunk, in order) to ctrl, which writes them to the
    /// receiver slots the admission's reply named. Its chunks were
    /// reserved at begin and its lengths checked then. On error the slots
    /// go back and the declaration stays open (a later submit may retry).
    pub(super) fn fill_declared(&self, h: &Handle, set: SlotSet) -> Result<(), StoreError> {
        let span = tracing::debug_span!("submit", req_id = %h.req_id, chunks = set.len());
        let _g = span.enter();
        let reopen = |e| {
            // Release: pairs with the Acquire swap in `submit_declared`.
            h.declared_open.store(true, Ordering::Release);
            Err(e)
        };
        if let Some(s) = h.signal.terminal() {
            self.slots.free(set);
            return reopen(StoreError::RequestEnded(s.clone()));
        }
        if h.cancel.is_cancelled() {
            self.slots.free(set);
            return reopen(Self::stopped(&h.signal));
        }
        let mut b = Self::batch_for(
            h.key,
            KeyList::default(),
            SmallVec::new(),
            BatchData::Staged(set),
            false,
            0,
        );
        b.fills = true;
        if let Err((b, e)) = self.submit_batch(h, Box::new(b)) {
            self.release_data(b.data, 0);
            return reopen(e);
        }
        self.stats.inc(Counter::Batches);
        debug!(chunks = h.declared, "declared batch submitted");
        Ok(())
    }

    /// Submits a batch from registered memory (`src[i]` = region id and
    /// offset of chunk `i`). With no chunks it is an empty last batch.
    pub(super) fn submit_registered(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        lens: SmallVec<[u32; 16]>,
        src: SmallVec<[(u32, u64); 16]>,
        lease: self::registered::WriteLease,
    ) -> Result<(), StoreError> {
        let span = tracing::debug_span!("write", req_id = %h.req_id, chunks = keys.len());
        let _g = span.enter();
        // On error the lease drops here: the write is done, nothing sent.
        let reserved = self.reserve(h, keys.len(), None)?;
        let data = if src.is_empty() {
            BatchData::Empty
        } else {
            BatchData::Registered {
                src,
                lease: Arc::new(lease),
            }
        };
        self.publish(h, keys, lens, data, &reserved, None)
    }

    /// The copying path: into staging slots if the request is admitted,
    /// else into the pending area.
    pub(super) fn store_copy(
        &self,
        h: &Handle,
        keys: &[impl AsRef<str>],
        chunks: &[&[u8]],
        is_last: Option<bool>,
        last_chunk_toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let n = chunks.len();
        let span = tracing::debug_span!("store", req_id = %h.req_id, chunks = n);
        let _g = span.enter();
        let reserved = self.reserve(h, n, is_last)?;
        let lens: SmallVec<[u32; 16]> = chunks.iter().map(|c| c.len() as u32).collect();
        let bytes: usize = chunks.iter().map(|c| c.len()).sum();
        let data = if n == 0 {
            BatchData::Empty
        } else if reserved.admitted {
            let t0 = Instant::now();
            let deadline = t0 + self.cfg.staging_timeout;
            let set = match self.slots.alloc(n, Some(deadline), &h.cancel) {
                Ok(set) => set,
                Err(e) => {
                    self.give_back(h, n, reserved.is_last);
                    return Err(match e {
                        AllocError::Cancelled => Self::stopped(&h.signal),
                        AllocError::Timeout => StoreError::StagingTimeout,
                        AllocError::TooLarge { requested, slots } => StoreError::BatchTooLarge {
                            chunks: requested,
                            slots,
                        },
                    });
                }
            };
            self.stats.record_since(Stage::StagingWait, t0);
            self.copy_into(&set, chunks.iter().copied());
            BatchData::Staged(set)
        } else {
            let max = self.cfg.max_pending_bytes;
            // AcqRel/Acquire: the counter only bounds memory; it publishes no
            // other data, so any ordering that keeps the RMW atomic suffices.
            let reserved_bytes =
                self.pending_bytes
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                        (used + bytes <= max).then_some(used + bytes)
                    });
            if let Err(used) = reserved_bytes {
                self.give_back(h, n, reserved.is_last);
                self.stats.inc(Counter::Backpressure);
                return Err(StoreError::Backpressure {
                    needed: bytes,
                    used,
                    max,
                });
            }
            let mut buf = Vec::with_capacity(bytes);
            for c in chunks {
                buf.extend_from_slice(c);
            }
            BatchData::Pending(buf)
        };
        self.publish(h, keys, lens, data, &reserved, last_chunk_toks)
    }

    /// Copies `chunks` (each at most `chunk_bytes`, checked by the caller)
    /// into the slots of `set`, in order.
    pub(crate) fn copy_into<'a>(&self, set: &SlotSet, chunks: impl Iterator<Item = &'a [u8]>) {
        for (slot, chunk) in set.iter().zip(chunks) {
            let Some(p) = self.staging.slot_ptr(slot) else {
                continue; // cannot happen: a set's slots exist
            };
            let len = chunk.len().min(self.cfg.chunk_bytes as usize);
            // SAFETY: the caller holds `set` (allocated, not freed, not yet
            // published), so it alone owns these slots and no write from them
            // is in flight; `len <= slot_bytes` keeps the copy inside the slot;
            // `chunk` is caller memory, never inside the staging mapping
            // (which no Rust reference outside an owned batch points into).
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), p, len) };
        }
    }

    /// Hands a batch to the ctrl thread through the handle's end of the
    /// submission ring (ring order = send order). If the ring is full the
    /// caller waits for ctrl to drain it (spin, yield, then 100 µs naps), at
    /// most `staging_timeout` ([`StoreError::StagingTimeout`]);
    /// [`StoreError::Closed`] at once if the sender stopped or its ctrl
    /// thread is gone, so nobody waits for a consumer that cannot come
    /// back. On error the batch comes back to the caller.
    pub(super) fn submit_batch(
        &self,
        h: &Handle,
        b: Box<Batch>,
    ) -> Result<(), (Box<Batch>, StoreError)> {
        let mut b = b;
        let mut backoff = crate::backoff::Backoff::new();
        let mut deadline = None;
        loop {
            // Acquire (both): pair with the Release stores in `Sender::close`
            // and in ctrl's drop; the flags publish nothing else.
            if self.stop.load(Ordering::Acquire) || self.ctrl_gone.load(Ordering::Acquire) {
                return Err((b, StoreError::Closed));
            }
            match h.outbox.push(b) {
                Ok(()) => break,
                Err(back) => b = back,
            }
            // The ring is sized far above what staging and the pending area
            // admit, so this only happens under a burst of begins or empty
            // batches: let ctrl drain it.
            let end = *deadline.get_or_insert_with(|| Instant::now() + self.cfg.staging_timeout);
            if Instant::now() >= end {
                return Err((b, StoreError::StagingTimeout));
            }
            self.wake_ctrl();
            if backoff.snooze() == crate::backoff::Step::ShouldPark {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.wake_ctrl();
        Ok(())
    }

    /// Gives a batch's staging slots or pending bytes back.
    pub(crate) fn release_data(&self, data: BatchData, bytes: usize) {
        match data {
            // Batches waiting for staging are queued in the allocator: this
            // free grants them and wakes their owner.
            BatchData::Staged(set) => self.slots.free(set),
            BatchData::Pending(_) => {
                // AcqRel: see the reservation in `store_copy`.
                self.pending_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
            // Dropping the lease lets the regions go once no op holds it.
            BatchData::Registered { .. } | BatchData::Empty | BatchData::Declared => {}
        }
    }

    /// Gives back a reservation of `n` chunks whose batch was never handed
    /// over (`last`: it was the last batch). If another caller reserved the
    /// last batch meanwhile, the given-back chunks can never be stored, so
    /// the request fails instead of completing without them: a caller's
    /// stop ([`life::Stop::Orphan`]), like a cancel, without the table lock.
    pub(super) fn give_back(&self, h: &Handle, n: usize, last: bool) {
        if h.stored.unreserve(n, last) {
            self.stop(&h.c, life::Stop::Orphan { chunks: n }, Some(&h.outbox));
        }
    }
}
