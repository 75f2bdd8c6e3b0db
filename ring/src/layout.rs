//! The ring's memory layout: control block (header, tail, head, sync words,
//! each on its own 128-byte line), per-slot stamps (MPSC only), then slots.
//! Heap and shared-memory rings use the same structures; see `docs/ring.md`.

use crate::sync::{AtomicU32, AtomicU64, Bell};

/// `b"KVFRING1"` read as a little-endian u64.
#[cfg_attr(loom, allow(dead_code))] // only shared rings use it
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"KVFRING1");
/// Layout version written in the header; bump on any layout change.
pub const LAYOUT_VERSION: u32 = 1;
/// Cache-line padding unit: 128 bytes, because x86 prefetches lines in pairs.
pub(crate) const LINE: usize = 128;
/// Largest capacity a ring accepts (entries).
pub const MAX_CAPACITY: usize = 1 << 30;
/// Alignment of a shared mapping (page size); entries may not need more.
#[cfg_attr(loom, allow(dead_code))] // only shared rings use it
pub(crate) const PAGE: usize = 4096;

/// Which ring protocol a memory block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Kind {
    /// Single producer, single consumer (published tail index).
    Spsc = 1,
    /// Multi producer, single consumer (claimed tail, per-slot stamps).
    Mpsc = 2,
}

/// A value padded and aligned to its own 128-byte line pair.
#[repr(C, align(128))]
pub(crate) struct Line<X>(pub(crate) X);

/// Immutable description of the ring, written once by the creator.
/// Byte offsets (documented in `docs/ring.md`): magic 0, version 8, kind 12,
/// capacity 16, entry_size 24, entry_align 32, fingerprint 40,
/// stamps_offset 48, slots_offset 56, total_len 64.
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: u32,
    pub(crate) kind: u32,
    pub(crate) capacity: u64,
    pub(crate) entry_size: u64,
    pub(crate) entry_align: u64,
    pub(crate) fingerprint: u64,
    pub(crate) stamps_offset: u64,
    pub(crate) slots_offset: u64,
    pub(crate) total_len: u64,
}

/// Bit of [`SyncWords::producers`] set once the last producer detached.
pub(crate) const PRODUCERS_GONE: u32 = 1 << 31;

/// Rarely written words: doorbell, wakeup flag, close and attach state.
#[repr(C)]
pub(crate) struct SyncWords {
    /// Futex word the consumer sleeps on; bumped by a waking producer.
    pub(crate) bell: Bell,
    /// 1 while the consumer is (about to be) asleep on `bell`.
    pub(crate) need_wakeup: AtomicU32,
    /// Live producer count, plus [`PRODUCERS_GONE`] once it reached zero.
    pub(crate) producers: AtomicU32,
    /// 1 once the consumer dropped.
    pub(crate) consumer_gone: AtomicU32,
    /// 1 once an SPSC producer handle was taken (shared rings).
    pub(crate) producer_taken: AtomicU32,
    /// 1 once the consumer handle was taken (shared rings).
    pub(crate) consumer_taken: AtomicU32,
}

/// The control block at offset 0 of every ring.
#[repr(C)]
pub(crate) struct Control {
    pub(crate) header: Line<Header>,
    /// SPSC: next position the producer will publish (entries below it are
    /// readable). MPSC: next position a producer will claim.
    pub(crate) tail: Line<AtomicU64>,
    /// Next position the consumer will read; slots below it are free.
    pub(crate) head: Line<AtomicU64>,
    pub(crate) sync: Line<SyncWords>,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Control>() == 4 * LINE);

/// Sizes and offsets of one ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) capacity: u64,
    pub(crate) entry_size: u64,
    pub(crate) entry_align: u64,
    pub(crate) stamps_offset: u64,
    pub(crate) slots_offset: u64,
    pub(crate) total_len: u64,
}

fn round_up(x: u64, to: u64) -> Option<u64> {
    Some(x.checked_add(to - 1)? / to * to)
}

impl Geometry {
    /// Geometry for `capacity` (already a power of two) entries of `T`;
    /// `None` on arithmetic overflow.
    pub(crate) fn of<T>(capacity: u64, kind: Kind) -> Option<Self> {
        let entry_size = std::mem::size_of::<T>() as u64;
        let entry_align = std::mem::align_of::<T>() as u64;
        let stamps_offset = std::mem::size_of::<Control>() as u64;
        let stamps_len = match kind {
            Kind::Spsc => 0,
            Kind::Mpsc => capacity.checked_mul(8)?,
        };
        let slots_offset = round_up(
            stamps_offset.checked_add(stamps_len)?,
            entry_align.max(LINE as u64),
        )?;
        let total_len = slots_offset.checked_add(capacity.checked_mul(entry_size)?)?;
        Some(Self {
            capacity,
            entry_size,
            entry_align,
            stamps_offset,
            slots_offset,
            total_len,
        })
    }
}

/// Round a requested capacity up to a power of two (at least 1); `None` if
/// it exceeds [`MAX_CAPACITY`].
pub(crate) fn round_capacity(requested: usize) -> Option<u64> {
    if requested > MAX_CAPACITY {
        return None;
    }
    Some(requested.max(1).next_power_of_two() as u64)
}

/// FNV-1a 64 over the type's name, size and alignment. Two processes built
/// from the same source with the same compiler agree on it; a different entry
/// type is caught even when its size matches.
pub(crate) fn fingerprint<T>() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(std::any::type_name::<T>().as_bytes());
    eat(&(std::mem::size_of::<T>() as u64).to_le_bytes());
    eat(&(std::mem::align_of::<T>() as u64).to_le_bytes());
    h
}

impl Control {
    /// A fresh control block for `geom` (magic still 0: the creator stores
    /// it last).
    pub(crate) fn new(geom: &Geometry, kind: Kind, fingerprint: u64, producers: u32) -> Self {
        Self {
            header: Line(Header {
                magic: AtomicU64::new(0),
                version: LAYOUT_VERSION,
                kind: kind as u32,
                capacity: geom.capacity,
                entry_size: geom.entry_size,
                entry_align: geom.entry_align,
                fingerprint,
                stamps_offset: geom.stamps_offset,
                slots_offset: geom.slots_offset,
                total_len: geom.total_len,
            }),
            tail: Line(AtomicU64::new(0)),
            head: Line(AtomicU64::new(0)),
            sync: Line(SyncWords {
                bell: Bell::new(),
                need_wakeup: AtomicU32::new(0),
                producers: AtomicU32::new(producers),
                consumer_gone: AtomicU32::new(0),
                producer_taken: AtomicU32::new(0),
                consumer_taken: AtomicU32::new(0),
            }),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn header_offsets_match_docs() {
        let c = Control::new(
            &Geometry::of::<u64>(8, Kind::Spsc).unwrap(),
            Kind::Spsc,
            0,
            0,
        );
        let base = &c as *const Control as usize;
        let h = &c.header.0;
        assert_eq!(&h.magic as *const _ as usize - base, 0);
        assert_eq!(&h.version as *const _ as usize - base, 8);
        assert_eq!(&h.kind as *const _ as usize - base, 12);
        assert_eq!(&h.capacity as *const _ as usize - base, 16);
        assert_eq!(&h.entry_size as *const _ as usize - base, 24);
        assert_eq!(&h.entry_align as *const _ as usize - base, 32);
        assert_eq!(&h.fingerprint as *const _ as usize - base, 40);
        assert_eq!(&h.stamps_offset as *const _ as usize - base, 48);
        assert_eq!(&h.slots_offset as *const _ as usize - base, 56);
        assert_eq!(&h.total_len as *const _ as usize - base, 64);
        assert_eq!(&c.tail as *const _ as usize - base, 128);
        assert_eq!(&c.head as *const _ as usize - base, 256);
        assert_eq!(&c.sync as *const _ as usize - base, 384);
    }

    #[test]
    fn geometry_spsc_and_mpsc() {
        let s = Geometry::of::<u32>(16, Kind::Spsc).unwrap();
        assert_eq!(
            (s.stamps_offset, s.slots_offset, s.total_len),
            (512, 512, 512 + 64)
        );
        let m = Geometry::of::<u32>(16, Kind::Mpsc).unwrap();
        assert_eq!((m.slots_offset, m.total_len), (640, 640 + 64));
    }

    #[test]
    fn capacity_rounds_up() {
        assert_eq!(round_capacity(0), Some(1));
        assert_eq!(round_capacity(5), Some(8));
        assert_eq!(round_capacity(8), Some(8));
        assert_eq!(round_capacity(MAX_CAPACITY + 1), None);
    }

    #[test]
    fn fingerprints_differ_by_type() {
        assert_ne!(fingerprint::<u64>(), fingerprint::<i64>());
        assert_ne!(fingerprint::<u64>(), fingerprint::<[u32; 2]>());
        assert_eq!(fingerprint::<u64>(), fingerprint::<u64>());
    }
}
