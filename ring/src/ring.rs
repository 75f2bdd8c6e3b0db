//! `Ring<T>`: the memory of one ring (heap or mapped) and the protocol steps
//! both ring kinds share: slot access, attach/detach, close, and the doorbell
//! (producer-side notify, consumer-side wait).

use std::ptr::NonNull;
use std::time::Instant;

use crate::backoff::{Backoff, Step};
use crate::barrier;
use crate::layout::{fingerprint, Control, Geometry, Kind, SyncWords, PRODUCERS_GONE};
use crate::sync::{AtomicU64, Ordering, SlotCell};
use crate::{Plain, WaitStatus};

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

    /// Entries between the consumer's `head` and the producer's `tail` that
    /// a producer keeping the protocol can have published: `tail - head`,
    /// or 0 when that exceeds the capacity. Only a peer scribbling on a
    /// shared index writes such a `tail` (behind `head`, or more than a
    /// ring ahead): the ring then reads as empty, and nothing is read from
    /// it until the index is sane again (`docs/ring.md`, "Hostile peers").
    #[inline]
    pub(crate) fn published(&self, tail: u64, head: u64) -> u64 {
        let n = tail.wrapping_sub(head);
        if n <= self.capacity {
            n
        } else {
            0
        }
    }

    /// Free slots between the producer's `tail` and the consumer's `head`:
    /// the capacity less `tail - head`, or 0 when that exceeds the
    /// capacity. Only a peer scribbling on a shared index writes such a
    /// `head` (ahead of `tail`, or more than a ring behind): the ring then
    /// reads as full, so no entry is written over one the consumer may not
    /// have read (`docs/ring.md`, "Hostile peers").
    #[inline]
    pub(crate) fn free(&self, tail: u64, head: u64) -> u64 {
        self.capacity.saturating_sub(tail.wrapping_sub(head))
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
                        // Unconditional wake: closing is rare. The bump is
                        // enough for correctness even without the Dekker
                        // fence: see `wait_until`.
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

    /// Producer side of the doorbell, called after publishing entries.
    /// Issues the wake syscall only if the consumer asked for it; returns
    /// true then (a consumer sleeping elsewhere than on the futex, see
    /// [`Ring::arm_wakeup`], needs its own wake-up delivered).
    #[inline]
    pub(crate) fn notify(&self) -> bool {
        let sync = self.sync();
        // Barrier (P): Dekker pairing with the consumer's barrier (C) in
        // `wait_until`. The publish store before (P) and the consumer's
        // `need_wakeup = 1` store before (C) cannot both be missed by the
        // loads after the other barrier: either we see the flag here, or the
        // consumer's re-check sees our entry. (P) is a SeqCst fence; see
        // `barrier.rs` for why it is not cheaper.
        barrier::store_load();
        // Relaxed: ordered by the barrier pair above. The swap makes only one
        // producer pay for the wake when several see the flag.
        if sync.need_wakeup.load(Ordering::Relaxed) != 0
            && sync.need_wakeup.swap(0, Ordering::Relaxed) != 0
        {
            sync.bell.ring();
            return true;
        }
        false
    }

    /// The first half of `wait_until`'s sleep, for a consumer that sleeps
    /// on something else (a `poll(2)` on a socket) and is woken through it
    /// by a producer that saw [`Ring::notify`] return true. Sets the flag,
    /// runs barrier (C) and re-checks: false (flag cleared) if an entry is
    /// already `available`, true if the consumer may sleep — any entry
    /// published from now on makes its producer's `notify` return true.
    pub(crate) fn arm_wakeup(&self, available: impl FnOnce() -> bool) -> bool {
        let words = self.sync();
        // Relaxed: ordered by the barrier below.
        words.need_wakeup.store(1, Ordering::Relaxed);
        // Barrier (C): pairs with (P) in `notify`, as in `wait_until`.
        barrier::store_load();
        if available() {
            // Relaxed: a hint; a stale 1 costs a producer one spare wake.
            words.need_wakeup.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The consumer is awake again: producers need not wake it.
    pub(crate) fn disarm_wakeup(&self) {
        // Relaxed: a hint (see `arm_wakeup`); entries published while the
        // flag reads 0 are found by the consumer's next `arm_wakeup`
        // re-check, which runs before it sleeps again. Stored only if set:
        // a busy consumer calls this every round, and a store would pull
        // the line producers read after each publish away from them.
        let flag = &self.sync().need_wakeup;
        if flag.load(Ordering::Relaxed) != 0 {
            flag.store(0, Ordering::Relaxed);
        }
    }

    /// Consumer side of the doorbell: return once `available()` is true
    /// (Ready), the producers are gone and nothing is left (Closed), or the
    /// deadline passed (TimedOut). Backs off with [`Backoff`] (spin, yield),
    /// then futex-waits.
    pub(crate) fn wait_until(
        &self,
        deadline: Option<Instant>,
        mut available: impl FnMut() -> bool,
    ) -> WaitStatus {
        let mut check = || {
            if available() {
                return Some(WaitStatus::Ready);
            }
            if self.producers_gone() {
                // GONE was read with Acquire, so every entry published before
                // the close is visible now: re-check before saying Closed.
                return Some(if available() {
                    WaitStatus::Ready
                } else {
                    WaitStatus::Closed
                });
            }
            None
        };
        if let Some(s) = check() {
            return s;
        }
        let mut backoff = Backoff::new();
        while backoff.snooze() != Step::ShouldPark {
            if let Some(s) = check() {
                return s;
            }
        }
        let words = self.sync();
        loop {
            // The bell value to sleep on is read *before* the flag is armed,
            // so it never counts a ring that took this arming of the flag.
            // A producer whose publish `check` cannot use yet (MPSC: a later
            // position than the one we wait at; SPSC: a producer that read
            // the flag of our previous arming and swaps it only now) may
            // take the flag and ring between our arming and our `check`. Had
            // we read the bell after that ring, we would sleep on a value
            // that already counts it, with the flag cleared, and the
            // producer of the entry we do need would find the flag clear and
            // wake nobody: the `two_process_mpsc` wedge (docs/ring.md,
            // "Fixed: a swallowed wake-up").
            //
            // Acquire: pairs with the Release bump in `Bell::ring`; it also
            // keeps the flag store below after this load. If we read a bump,
            // the producer's swap that preceded it happens before our flag
            // store, so that swap took an earlier arming, not this one; any
            // producer that takes this arming bumps the bell past `seen`,
            // which makes FUTEX_WAIT return at once or wakes us.
            let seen = words.bell.load(Ordering::Acquire);
            // Relaxed: ordered by the barrier below.
            words.need_wakeup.store(1, Ordering::Relaxed);
            // Barrier (C): a SeqCst fence that pairs with the producer's (P)
            // in `notify` (store->load Dekker; see there and `barrier.rs`).
            barrier::store_load();
            let status = check();
            let timeout = match (status, deadline) {
                (Some(_), _) => None,
                (None, Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        words.need_wakeup.store(0, Ordering::Relaxed);
                        return WaitStatus::TimedOut;
                    }
                    Some(left)
                }
                (None, None) => None,
            };
            if let Some(s) = status {
                // Relaxed: the flag is a hint; a stale 1 only costs a
                // producer one spare wake.
                words.need_wakeup.store(0, Ordering::Relaxed);
                return s;
            }
            // EINTR, EAGAIN, ETIMEDOUT and wakeups all loop back to the
            // re-check (and the deadline check).
            let _ = words.bell.wait(seen, timeout);
        }
    }
}
