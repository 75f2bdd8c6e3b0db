//! `Ring<T>`: the memory of one ring (heap or mapped) and the protocol steps
//! both ring kinds share: slot access, attach/detach, close, and the doorbell
//! (producer-side notify, consumer-side wait).

use std::ptr::NonNull;
use std::time::Instant;

use crate::backoff::{Backoff, Step};
use crate::layout::{fingerprint, Control, Geometry, Kind, SyncWords, PRODUCERS_GONE};
use crate::sync::{AtomicU64, Ordering, SlotCell};
use crate::{Plain, WaitStatus};

/// Bit 63 of a published word (the SPSC tail, an MPSC stamp): set by a
/// consumer on its way to sleep, so that the producer's publishing swap sees
/// it and rings the bell (see [`Ring::publish`] and [`Ring::wait_until`]).
/// Positions never reach 2^63, so the bit is free; readers of the tail mask
/// it, and an MPSC stamp with the bit set never equals `pos + 1`.
pub(crate) const WAITING: u64 = 1 << 63;

/// Who owns the memory the ring's pointers point into.
enum Backing<T> {
    /// Boxes leaked with `Box::into_raw`, rebuilt and dropped in `Drop`.
    Heap {
        ctrl: *mut Control,
        stamps: *mut [AtomicU64],
        slots: *mut [SlotCell<T>],
    },
    /// A shared file mapping; dropping it unmaps.
    #[cfg(not(loom))]
    Mapped(#[allow(dead_code)] memmap2::MmapMut),
}

/// One ring's memory plus the shared protocol steps.
pub(crate) struct Ring<T> {
    ctrl: NonNull<Control>,
    /// MPSC: `capacity` stamps; SPSC: dangling, never read.
    stamps: *const AtomicU64,
    slots: *const SlotCell<T>,
    mask: u64,
    capacity: u64,
    kind: Kind,
    backing: Backing<T>,
}

// SAFETY: the ring only hands out plain `T: Send` values, its shared words are
// atomics, and slot access is serialised by the index/stamp protocol; the raw
// pointers point into memory owned by `backing`, which lives as long as `self`.
unsafe impl<T: Plain> Send for Ring<T> {}
// SAFETY: as above; every `&self` method is safe to call from several threads
// (the single-producer/consumer rules are enforced by the handle types).
unsafe impl<T: Plain> Sync for Ring<T> {}

impl<T> Drop for Ring<T> {
    #[cfg_attr(loom, allow(irrefutable_let_patterns))] // loom has no Mapped variant
    fn drop(&mut self) {
        if let Backing::Heap {
            ctrl,
            stamps,
            slots,
        } = self.backing
        {
            // SAFETY: the three pointers came from `Box::into_raw` in
            // `new_heap` and are dropped exactly once, here; no handle is
            // alive any more (they hold an `Arc<Ring>`).
            unsafe {
                drop(Box::from_raw(ctrl));
                drop(Box::from_raw(stamps));
                drop(Box::from_raw(slots));
            }
        }
    }
}

impl<T: Plain> Ring<T> {
    /// A heap ring of `capacity` (a power of two) entries with one producer
    /// and the consumer already attached.
    pub(crate) fn new_heap(capacity: u64, kind: Kind) -> Self {
        let geom = Geometry::of::<T>(capacity, kind);
        // Geometry only fails on u64 overflow, impossible for capacity <= 2^30
        // and an allocatable T; fall back to a zeroed header if it ever did.
        let geom = geom.unwrap_or(Geometry {
            capacity,
            entry_size: 0,
            entry_align: 0,
            stamps_offset: 0,
            slots_offset: 0,
            total_len: 0,
        });
        let ctrl = Box::into_raw(Box::new(Control::new(&geom, kind, fingerprint::<T>(), 1)));
        let n_stamps = if kind == Kind::Mpsc { capacity } else { 0 };
        let stamps: Box<[AtomicU64]> = (0..n_stamps).map(|_| AtomicU64::new(0)).collect();
        // SAFETY: T: Plain, so the all-zero bit pattern is a valid T.
        let zero: T = unsafe { std::mem::MaybeUninit::<T>::zeroed().assume_init() };
        let slots: Box<[SlotCell<T>]> = (0..capacity).map(|_| SlotCell::new(zero)).collect();
        let stamps = Box::into_raw(stamps);
        let slots = Box::into_raw(slots);
        // SAFETY: `ctrl` came from Box::into_raw, so it is non-null and valid.
        let ctrl_ref = unsafe { &*ctrl };
        let sync = &ctrl_ref.sync.0;
        // Relaxed: the ring is not shared with anyone yet.
        sync.producer_taken.store(1, Ordering::Relaxed);
        sync.consumer_taken.store(1, Ordering::Relaxed);
        Self {
            // SAFETY: Box::into_raw never returns null.
            ctrl: unsafe { NonNull::new_unchecked(ctrl) },
            stamps: stamps as *const AtomicU64,
            slots: slots as *const SlotCell<T>,
            mask: capacity - 1,
            capacity,
            kind,
            backing: Backing::Heap {
                ctrl,
                stamps,
                slots,
            },
        }
    }

    /// A ring over a mapping whose header was validated (or just written)
    /// for `geom` and `kind`.
    ///
    /// # Safety
    /// `map` must be at least `geom.total_len` bytes, page aligned, and hold
    /// an initialised control block (and zeroed or valid stamps) laid out as
    /// `geom` says.
    #[cfg(not(loom))]
    pub(crate) unsafe fn from_mapping(
        mut map: memmap2::MmapMut,
        geom: &Geometry,
        kind: Kind,
    ) -> Self {
        let base = map.as_mut_ptr();
        // SAFETY: the offsets are within the mapping (caller contract), and
        // the stamp/slot offsets are aligned for u64 / T (Geometry rounds
        // them up to 128 and align_of::<T>(), and the mapping is page aligned).
        let (stamps, slots) = unsafe {
            (
                base.add(geom.stamps_offset as usize) as *const AtomicU64,
                base.add(geom.slots_offset as usize) as *const SlotCell<T>,
            )
        };
        Self {
            // SAFETY: a mapping's address is never null.
            ctrl: unsafe { NonNull::new_unchecked(base as *mut Control) },
            stamps,
            slots,
            mask: geom.capacity - 1,
            capacity: geom.capacity,
            kind,
            backing: Backing::Mapped(map),
        }
    }

    /// The control block.
    #[inline]
    pub(crate) fn ctrl(&self) -> &Control {
        // SAFETY: `ctrl` points to a live, initialised control block owned by
        // `backing` for as long as `self` lives.
        unsafe { self.ctrl.as_ref() }
    }

    /// The rarely written sync words.
    #[inline]
    pub(crate) fn sync(&self) -> &SyncWords {
        &self.ctrl().sync.0
    }

    /// The tail index word.
    #[inline]
    pub(crate) fn tail(&self) -> &AtomicU64 {
        &self.ctrl().tail.0
    }

    /// The head index word.
    #[inline]
    pub(crate) fn head(&self) -> &AtomicU64 {
        &self.ctrl().head.0
    }

    /// Number of slots.
    #[inline]
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The slot that position `pos` maps to.
    #[inline]
    pub(crate) fn slot(&self, pos: u64) -> &SlotCell<T> {
        // SAFETY: `pos & mask < capacity`, and `slots` points to `capacity`
        // initialised slots owned by `backing`.
        unsafe { &*self.slots.add((pos & self.mask) as usize) }
    }

    /// Raw pointer to the entry of position `pos` (for slice views).
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn slot_ptr(&self, pos: u64) -> *mut T {
        // `SlotCell<T>` is repr(transparent) over `UnsafeCell<T>`, itself
        // repr(transparent) over `T`.
        self.slot(pos) as *const SlotCell<T> as *mut T
    }

    /// The MPSC stamp of position `pos`'s slot.
    #[inline]
    pub(crate) fn stamp(&self, pos: u64) -> &AtomicU64 {
        debug_assert_eq!(self.kind, Kind::Mpsc);
        // SAFETY: MPSC rings have `capacity` initialised stamps owned by
        // `backing`, and `pos & mask < capacity`.
        unsafe { &*self.stamps.add((pos & self.mask) as usize) }
    }

    /// True once the consumer dropped. Relaxed: advisory, it orders nothing.
    #[inline]
    pub(crate) fn consumer_gone(&self) -> bool {
        self.sync().consumer_gone.load(Ordering::Relaxed) != 0
    }

    /// True once every producer detached.
    #[inline]
    pub(crate) fn producers_gone(&self) -> bool {
        // Acquire: pairs with the AcqRel CAS in `detach_producer`, so a
        // consumer that sees GONE also sees every entry published before it.
        self.sync().producers.load(Ordering::Acquire) & PRODUCERS_GONE != 0
    }

    /// Either side closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.consumer_gone() || self.producers_gone()
    }

    /// Register one more producer handle. `exclusive` (SPSC) also claims the
    /// producer side. Fails if taken or if the ring is already closed.
    #[cfg(not(loom))]
    pub(crate) fn attach_producer(&self, exclusive: bool) -> Result<(), crate::ShmError> {
        let sync = self.sync();
        if exclusive
            && sync
                .producer_taken
                // Relaxed: the flag only arbitrates ownership; the data this
                // side will touch is ordered by the index protocol.
                .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return Err(crate::ShmError::SideTaken(crate::Side::Producer));
        }
        let mut cur = sync.producers.load(Ordering::Relaxed);
        loop {
            if cur & PRODUCERS_GONE != 0 {
                return Err(crate::ShmError::Closed);
            }
            // Relaxed: like Arc's increment, joining needs no ordering; GONE
            // is only set by a CAS that would then fail here.
            match sync.producers.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(c) => cur = c,
            }
        }
    }

    /// A clone of a live producer joins (cannot fail: the source keeps the
    /// count above zero, so GONE cannot be set meanwhile).
    pub(crate) fn clone_producer(&self) {
        // Relaxed: as Arc::clone; see `attach_producer`.
        self.sync().producers.fetch_add(1, Ordering::Relaxed);
    }

    /// Claim the consumer side (shared rings).
    #[cfg(not(loom))]
    pub(crate) fn attach_consumer(&self) -> Result<(), crate::ShmError> {
        self.sync()
            .consumer_taken
            // Relaxed: arbitration only, as in `attach_producer`.
            .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed)
            .map(|_| ())
            .map_err(|_| crate::ShmError::SideTaken(crate::Side::Consumer))
    }

    /// A producer handle goes away; the last one closes the ring and wakes
    /// the consumer.
    pub(crate) fn detach_producer(&self) {
        let producers = &self.sync().producers;
        let mut cur = producers.load(Ordering::Relaxed);
        loop {
            let count = cur & !PRODUCERS_GONE;
            let new = if count <= 1 { PRODUCERS_GONE } else { cur - 1 };
            // AcqRel: Release makes this producer's published entries visible
            // to the consumer's Acquire load of GONE (`producers_gone`);
            // Acquire chains the earlier producers' detaches into the final
            // (GONE) store, so the consumer sees all of their entries too.
            match producers.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    if new == PRODUCERS_GONE {
                        // Unconditional wake: closing is rare, and the
                        // consumer may be asleep with any word armed. The
                        // bump alone is enough: see `seen` in `wait_until`.
                        self.sync().bell.ring();
                    }
                    return;
                }
                Err(c) => cur = c,
            }
        }
    }

    /// The consumer goes away: producers see the ring closed.
    pub(crate) fn detach_consumer(&self) {
        // Release: pairs with nothing in particular (producers read it Relaxed
        // as a hint); it only keeps the close after the consumer's last read.
        self.sync().consumer_gone.store(1, Ordering::Release);
    }

    /// Producer side of the doorbell: store `value` into `word` (the SPSC
    /// tail, or the MPSC stamp of the batch's first position) and wake the
    /// consumer if it armed that word on its way to sleep. One RMW, no fence,
    /// and a syscall only when the consumer sleeps.
    #[inline]
    pub(crate) fn publish(&self, word: &AtomicU64, value: u64) {
        // AcqRel swap: Release publishes the slots written before it (pairs
        // with the consumer's Acquire loads of `word`). Acquire pairs with the
        // consumer's Release arming CAS in `wait_until`, so its bell load
        // (sequenced before the CAS) happens before our bump below and cannot
        // read it. Being an RMW, the swap reads the latest value of `word`:
        // either the consumer armed before it (we see WAITING and wake) or
        // after it (its CAS fails or its re-check sees `value`). That is the
        // whole no-lost-wakeup argument; loom checks it (`tests/loom.rs`).
        if word.swap(value, Ordering::AcqRel) & WAITING != 0 {
            self.sync().bell.ring();
        }
    }

    /// MPSC: publish the `n` claimed positions from `start`. The later stamps
    /// are plain Release stores; the first goes last, through
    /// [`publish`](Self::publish). The consumer cannot pass `start` before
    /// its stamp, so the first position is the only one of the batch it can
    /// be asleep on, and one swap per batch is enough.
    #[inline]
    pub(crate) fn publish_stamps(&self, start: u64, n: u64) {
        if n == 0 {
            return;
        }
        for pos in start + 1..start + n {
            // Release: pairs with the consumer's Acquire load of this stamp
            // before it reads the slot. (It is also sequenced before the
            // swap below, so a consumer that saw the first stamp sees these.)
            self.stamp(pos).store(pos + 1, Ordering::Release);
        }
        self.publish(self.stamp(start), start + 1);
    }

    /// Consumer side of the doorbell: return once `ready(word)` is true
    /// (Ready), the producers are gone and nothing is left (Closed), or the
    /// deadline passed (TimedOut). `word` is what the producer publishes into
    /// (the SPSC tail, the MPSC stamp of the consumer's head), and `ready`
    /// gets its value without the [`WAITING`] bit. Backs off (spin, yield),
    /// then arms `word` and futex-waits on the bell.
    pub(crate) fn wait_until(
        &self,
        deadline: Option<Instant>,
        word: &AtomicU64,
        ready: impl Fn(u64) -> bool,
    ) -> WaitStatus {
        // Ok(status) to return, or Err(current value of `word`).
        let check = || {
            // Acquire: pairs with the Release part of the producer's swap in
            // `publish`, so the published slots are visible.
            let cur = word.load(Ordering::Acquire);
            if ready(cur & !WAITING) {
                return Ok(WaitStatus::Ready);
            }
            if self.producers_gone() {
                // GONE was read with Acquire, so every entry published before
                // the close is visible now: re-check before saying Closed.
                // Acquire: as above.
                let cur = word.load(Ordering::Acquire);
                return Ok(if ready(cur & !WAITING) {
                    WaitStatus::Ready
                } else {
                    WaitStatus::Closed
                });
            }
            Err(cur)
        };
        if let Ok(s) = check() {
            return s;
        }
        let bell = &self.sync().bell;
        let mut backoff = Backoff::new();
        loop {
            if backoff.snooze() != Step::ShouldPark {
                match check() {
                    Ok(s) => return s,
                    Err(_) => continue,
                }
            }
            // Acquire: pairs with the Release bump in `Bell::ring`. Read
            // before `word` is armed (below) or re-checked: if this read sees
            // a producer's bump, the entry published before that bump is
            // visible to `check`; if it reads an older value, FUTEX_WAIT
            // returns at once on a later bump (EAGAIN), or the bump's wake
            // finds us queued.
            let seen = bell.load(Ordering::Acquire);
            let cur = match check() {
                Ok(s) => return s,
                Err(cur) => cur,
            };
            let timeout = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        if cur & WAITING != 0 {
                            // Disarm, so no producer pays for a wake nobody
                            // waits for. Relaxed: the bit orders nothing
                            // here; if the CAS fails, a producer's swap
                            // already cleared it.
                            let _ = word.compare_exchange(
                                cur,
                                cur & !WAITING,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            );
                        }
                        return WaitStatus::TimedOut;
                    }
                    Some(left)
                }
                None => None,
            };
            // Arm: ask the next publish into `word` to ring the bell.
            // Release: pairs with the Acquire part of the producer's swap (see
            // `publish`). Acquire on failure: the word changed, so `check`
            // must see what was published (it re-loads with Acquire anyway).
            // An already armed word (a wakeup that found nothing, e.g. EINTR)
            // stays armed: that CAS happened before this round's `seen` load,
            // and a producer swap after it is either visible to `check`
            // above or made `seen` stale.
            if cur & WAITING == 0
                && word
                    .compare_exchange(cur, cur | WAITING, Ordering::Release, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            // EINTR, EAGAIN, ETIMEDOUT and wakeups all loop back to the
            // re-check (and the deadline check).
            let _ = bell.wait(seen, timeout);
        }
    }
}
