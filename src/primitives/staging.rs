//! The sender's staging buffer: `slots` fixed-size slots in one contiguous,
//! page-aligned shared mapping that a transport reads writes from (the shm
//! copy engine copies out of it; the RDMA transport registers it as a memory
//! region).
//!
//! The mapping is made of *segments*, each a sealed memfd mapped at its
//! place in one reserved address range: without shares one segment holds
//! every slot; with `shares` ([`StagingBuffer::with_shares`]) segments
//! `0..shares` are the per-worker staging shares (equal, page-aligned slot
//! ranges) and one last segment holds the remaining slots, if any. An
//! attached prefill worker gets only its share's memfd (`SCM_RIGHTS`,
//! `docs/attach.md`), so its mapping cannot reach another share's bytes,
//! and a memfd sealed at the share's size cannot be mapped or grown past it.
//!
//! A share is revoked from its last holder by `StagingBuffer::renew_share`:
//! a fresh memfd mapped over the share's range (`MAP_FIXED`), so whatever
//! still maps the old memfd writes pages nobody reads. A transport that
//! registers the pages with a device (RDMA: one memory region per segment,
//! [`StagingBuffer::segments`]) deregisters the share's region before the
//! renewal and registers it again after (`sender/share.rs`), so the device
//! reads the fresh pages too.
//!
//! Which slot belongs to whom is decided by the sender's slot allocator, not
//! by this module: a caller writes only slots it allocated, and the transport
//! reads a slot only while a write posted from it is in flight (the slot is
//! freed after its completion was polled).

use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::sync::Arc;

/// Errors creating or using a [`StagingBuffer`].
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// Zero slots or zero-byte slots.
    #[error("staging buffer needs at least one slot of at least one byte (got {slots} slots of {slot_bytes} bytes)")]
    Empty {
        /// Requested slot count.
        slots: usize,
        /// Requested slot size.
        slot_bytes: u64,
    },
    /// `slots * slot_bytes` does not fit the address space.
    #[error("staging buffer of {slots} slots of {slot_bytes} bytes overflows the address space")]
    Overflow {
        /// Requested slot count.
        slots: usize,
        /// Requested slot size.
        slot_bytes: u64,
    },
    /// The anonymous mapping could not be created (out of memory, limits).
    #[error("mapping a staging buffer of {len} bytes failed: {source}")]
    Map {
        /// Requested length in bytes.
        len: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `shares` shares of a page-aligned slot count do not fit `slots`.
    #[error("{slots} staging slots cannot be split into {shares} shares of a multiple of {align} slots (the page-aligned unit for {slot_bytes}-byte slots)")]
    SharesTooSmall {
        /// Slot count.
        slots: usize,
        /// Shares asked for.
        shares: usize,
        /// Slots per page-aligned unit.
        align: usize,
        /// Slot size.
        slot_bytes: u64,
    },
    /// A slot index at or past the slot count.
    #[error("staging slot {slot} out of range (buffer has {slots} slots)")]
    SlotOutOfRange {
        /// The slot asked for.
        slot: u32,
        /// Number of slots.
        slots: usize,
    },
    /// `StagingBuffer::renew_share` of no share.
    #[error("staging share {share} cannot be renewed (no such share)")]
    NotRenewable {
        /// The share asked for.
        share: usize,
    },
    /// Data longer than a slot.
    #[error("{len} bytes do not fit a staging slot of {slot_bytes} bytes")]
    TooLong {
        /// Length of the data.
        len: usize,
        /// Slot size.
        slot_bytes: u64,
    },
}

/// The sender's registered staging memory: `slots` slots of `slot_bytes`
/// bytes each, slot `i` at byte offset `i * slot_bytes`, in one shared
/// page-aligned mapping of one or more memfd segments (zero-filled; see the
/// module docs). `Send + Sync`: share it as `Arc<StagingBuffer>` between the
/// caller threads that fill slots and the transport that reads them.
pub struct StagingBuffer {
    /// Owns the reserved address range; all access goes through `ptr`, so
    /// no Rust reference to the bytes ever exists.
    _map: Mapping,
    /// The memfds behind the mapping, in slot order.
    segments: Vec<Segment>,
    /// Segments `0..shares` are the staging shares.
    shares: usize,
    ptr: *mut u8,
    slots: usize,
    slot_bytes: u64,
    len: u64,
    /// Caller-registered host memory writes may also be read from:
    /// `regions[id - 1]` is region `id`'s `(start, length)`. Entries are
    /// added and removed by the sender (`Sender::register` / `deregister`),
    /// which removes one only while no write from it is in flight.
    regions: parking_lot::RwLock<Vec<Option<(*const u8, u64)>>>,
}

/// One memfd of the buffer: slots `first..first + slots`. The file is
/// replaced when a share is renewed; holders of the old one keep theirs.
struct Segment {
    file: parking_lot::Mutex<Arc<File>>,
    first: u32,
    slots: usize,
}

/// A reserved address range, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is the range `reserve` mapped and nothing
        // else unmapped; no reference into it outlives the buffer.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Where one staging share lives: slots `first_slot..first_slot + slots` of
/// the buffer, the whole of its memfd ([`StagingBuffer::share_file`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareLayout {
    /// The share's first slot in the staging buffer.
    pub first_slot: u32,
    /// Slots in the share.
    pub slots: usize,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Byte offset of the share in the staging buffer (`first_slot * slot_bytes`).
    pub offset: u64,
}

/// Most regions registered at once (bounds the lookup table).
pub const MAX_REGIONS: usize = 1024;

// SAFETY: the buffer is plain memory owned by the mapping (the region
// table's pointers name caller memory the sender's `register` contract keeps
// valid, and are only dereferenced by transports as below); `ptr` is only
// dereferenced by `write_slot` / `read_slot` (under `&mut self`), by the
// sender's staged batches and by transports, on byte ranges whose exclusive
// use is arbitrated by the slot allocator (see `slot_ptr`).
// Moving the handle to another thread moves nothing but the pointer.
unsafe impl Send for StagingBuffer {}
// SAFETY: as above; `&StagingBuffer` only hands out raw pointers, whose
// dereference is `unsafe` and governed by slot ownership.
unsafe impl Sync for StagingBuffer {}

impl std::fmt::Debug for StagingBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuffer")
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .field("shares", &self.shares)
            .finish()
    }
}

/// A fresh sealed memfd of `len` bytes mapped read-write at `at`
/// (`MAP_FIXED`, replacing whatever was mapped there); the memfd, for a
/// worker to map.
///
/// # Safety
/// `at..at + len` is page-aligned, lies inside a mapping the caller owns,
/// and nothing reads or writes it during the call (its old pages vanish).
unsafe fn map_fresh_segment(at: *mut u8, len: u64) -> std::io::Result<File> {
    let file = memfd(len)?;
    // Populated: the pages are allocated now, not by the first transfers'
    // page faults (see `Region::create`).
    // SAFETY: the caller's contract covers the range; the memfd is ours and
    // sealed at `len`, so the mapping never reaches past its end.
    let p = unsafe {
        libc::mmap(
            at.cast(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// A sealed memfd of `len` bytes.
fn memfd(len: u64) -> std::io::Result<File> {
    // SAFETY: the name is a NUL-terminated literal; memfd_create takes
    // no other pointer.
    let fd = unsafe {
        libc::memfd_create(
            c"kvferry-staging".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    // Sealed against resizing, so no process that can open it (an attached
    // worker) can shrink it under our mapping (SIGBUS) or grow it.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// The host's page size in bytes, as a `u64` for the length arithmetic
/// here (`region::page_size`).
fn page_size() -> u64 {
    super::region::page_size() as u64
}

/// Slots per page-aligned unit for `slot_bytes`-byte slots (a share holds a
/// multiple of it, so every segment starts on a page).
fn share_align(slot_bytes: u64) -> usize {
    let page = page_size();
    (page / gcd(page, slot_bytes.max(1))) as usize
}

/// The most shares `slots` slots of `slot_bytes` bytes can be split into
/// (0 if not even one page-aligned share fits).
pub fn max_shares(slots: usize, slot_bytes: u64) -> usize {
    slots / share_align(slot_bytes)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl StagingBuffer {
    /// Maps a zero-filled buffer of `slots * slot_bytes` bytes (one segment,
    /// no shares).
    pub fn new(slots: usize, slot_bytes: u64) -> Result<Self, StagingError> {
        Self::with_shares(slots, slot_bytes, 0)
    }

    /// Maps a zero-filled buffer of `slots * slot_bytes` bytes whose first
    /// slots form `shares` equal staging shares, each its own memfd (see the
    /// module docs): as many slots per share as fit `slots / shares`,
    /// rounded down to a whole number of pages; the remaining slots form
    /// one more segment. [`StagingError::SharesTooSmall`] if a share would
    /// be empty.
    pub fn with_shares(slots: usize, slot_bytes: u64, shares: usize) -> Result<Self, StagingError> {
        if slots == 0 || slot_bytes == 0 {
            return Err(StagingError::Empty { slots, slot_bytes });
        }
        let overflow = || StagingError::Overflow { slots, slot_bytes };
        let len = (slots as u64)
            .checked_mul(slot_bytes)
            .ok_or_else(overflow)?;
        // Slot indices are u32 in the API, and a mapping cannot exceed isize::MAX.
        if u32::try_from(slots).is_err() || len > isize::MAX as u64 - page_size() {
            return Err(overflow());
        }
        let map_err = |source| StagingError::Map { len, source };
        let mut sizes = Vec::with_capacity(shares + 1);
        if let Some(per_share) = slots.checked_div(shares) {
            let align = share_align(slot_bytes);
            let per = per_share / align * align;
            if per == 0 {
                return Err(StagingError::SharesTooSmall {
                    slots,
                    shares,
                    align,
                    slot_bytes,
                });
            }
            sizes.resize(shares, per);
        }
        let rest = slots - sizes.iter().sum::<usize>();
        if rest > 0 {
            sizes.push(rest);
        }
        let total = len.div_ceil(page_size()) * page_size();
        // SAFETY: a fresh anonymous PROT_NONE reservation; no pointer is
        // passed in. It only reserves addresses for the segments below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        let map = Mapping {
            ptr: base.cast(),
            len: total as usize,
        };
        let mut segments = Vec::with_capacity(sizes.len());
        let mut first = 0usize;
        for n in sizes {
            let seg_len = n as u64 * slot_bytes;
            let offset = first as u64 * slot_bytes;
            // SAFETY: `offset` is page-aligned (every segment but the last
            // is a whole number of pages) and `offset + seg_len <= len <=
            // total`, so the range lies inside our own reservation, which
            // nothing reads or writes yet; all access goes through `ptr`.
            let file = unsafe { map_fresh_segment(map.ptr.add(offset as usize), seg_len) }
                .map_err(map_err)?;
            segments.push(Segment {
                file: parking_lot::Mutex::new(Arc::new(file)),
                first: first as u32,
                slots: n,
            });
            first += n;
        }
        let ptr = map.ptr;
        Ok(Self {
            _map: map,
            segments,
            shares,
            ptr,
            slots,
            slot_bytes,
            len,
            regions: parking_lot::RwLock::new(Vec::new()),
        })
    }

    /// Number of staging shares (0: none).
    pub fn shares(&self) -> usize {
        self.shares
    }

    /// Pool sizes for the sender's slot allocator, in slot order: without
    /// shares one pool of every slot; with shares one per share, then the
    /// remaining slots (possibly none) as the default pool.
    pub fn pool_slots(&self) -> Vec<usize> {
        let mut pools: Vec<usize> = self.segments.iter().map(|s| s.slots).collect();
        if self.shares > 0 && pools.len() == self.shares {
            pools.push(0);
        }
        pools
    }

    /// Share `i`'s layout (`None` if `i >= shares()`).
    pub fn share(&self, i: usize) -> Option<ShareLayout> {
        let s = self.segments.get(i).filter(|_| i < self.shares)?;
        Some(ShareLayout {
            first_slot: s.first,
            slots: s.slots,
            slot_bytes: self.slot_bytes,
            offset: self.slot_offset(s.first),
        })
    }

    /// Share `i`'s memfd as mapped now (`None` if `i >= shares()`): exactly
    /// `slots * slot_bytes` long, sealed against resizing. The descriptor to
    /// hand to the share's holder; no path reaches it.
    pub fn share_file(&self, i: usize) -> Option<Arc<File>> {
        let s = self.segments.get(i).filter(|_| i < self.shares)?;
        Some(Arc::clone(&s.file.lock()))
    }

    /// The byte ranges of the buffer's segments, in slot order: the shares
    /// (`0..shares()`), then the remaining slots if any (without shares:
    /// one range, the whole buffer). Each is its own memfd; a transport
    /// that registers the pages with a device registers each segment on
    /// its own, so a share can be renewed without touching the others.
    pub fn segments(&self) -> Vec<Range<u64>> {
        self.segments
            .iter()
            .map(|s| {
                let start = self.slot_offset(s.first);
                start..start + s.slots as u64 * self.slot_bytes
            })
            .collect()
    }

    /// Revokes share `i` from everything that maps its memfd: maps a fresh,
    /// zero-filled, sealed memfd over the share's range (`MAP_FIXED`,
    /// which replaces the old pages in one step) and makes it the share's
    /// file. Whoever still maps the old memfd (a worker that left, or its
    /// forked child) writes pages this buffer no longer reads; they are
    /// freed when the last such mapping goes.
    /// [`StagingError::NotRenewable`] if `i` is no share;
    /// [`StagingError::Map`] if the new memfd or its mapping failed, after
    /// which the range may be unmapped: the share must not be used until a
    /// later renewal succeeds.
    ///
    /// # Safety
    /// The caller owns share `i`'s slots exclusively for the call: none is
    /// handed out by the allocator or read by a write in flight (the old
    /// pages vanish from this mapping), and no device still has the
    /// share's old pages registered (it would go on reading them).
    pub(crate) unsafe fn renew_share(&self, i: usize) -> Result<(), StagingError> {
        let refused = StagingError::NotRenewable { share: i };
        let s = self
            .segments
            .get(i)
            .filter(|_| i < self.shares)
            .ok_or(refused)?;
        let seg_len = s.slots as u64 * self.slot_bytes;
        let map_err = |source| StagingError::Map {
            len: seg_len,
            source,
        };
        let offset = self.slot_offset(s.first) as usize;
        // SAFETY: the share's range `offset..offset + seg_len` lies inside
        // our reservation and is page-aligned (as when it was first mapped
        // in `with_shares`); the caller guarantees nobody reads or writes it
        // meanwhile, so replacing its pages is unobservable but for the
        // zeroes. A failed MAP_FIXED may leave the range unmapped (ENOMEM,
        // the mapping count limit): harmless while the caller keeps the
        // share free, and it is handed out only after a renewal succeeded.
        let file = unsafe { map_fresh_segment(self.ptr.add(offset), seg_len) }.map_err(map_err)?;
        *s.file.lock() = Arc::new(file);
        Ok(())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// A path to map the first segment (`/proc/<pid>/fd/<memfd>`): without
    /// shares the whole buffer, slot `i` at offset `i * slot_bytes`; with
    /// shares, share 0 as mapped now (see [`share`](Self::share)). Other
    /// processes of this user can open it only while this process is
    /// dumpable (an attach daemon makes it non-dumpable; attached workers
    /// get their share's descriptor instead, [`share_file`](Self::share_file)).
    pub fn file_path(&self) -> PathBuf {
        let fd = self.segments[0].file.lock().as_raw_fd();
        PathBuf::from(format!("/proc/{}/fd/{fd}", std::process::id()))
    }

    /// Total bytes (`slots * slot_bytes`).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address of the buffer (page-aligned). Transports read from
    /// `as_ptr() + offset` for offsets of writes in flight; writing through
    /// it is only sound for bytes the writer owns exclusively.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Byte offset of `slot` (`slot * slot_bytes`; saturates, so an
    /// out-of-range slot yields an offset past the end that a transport's
    /// bounds check rejects).
    pub fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot).saturating_mul(self.slot_bytes)
    }

    fn check_slot(&self, slot: u32) -> Result<usize, StagingError> {
        if (slot as usize) < self.slots {
            Ok(self.slot_offset(slot) as usize)
        } else {
            Err(StagingError::SlotOutOfRange {
                slot,
                slots: self.slots,
            })
        }
    }

    /// Copies `data` to the start of `slot`.
    ///
    /// Takes `&mut self`: only a thread with the buffer to itself (before it
    /// is shared with a transport, or through `Arc::get_mut`) can write
    /// through this safe call, so it can never race with a transport reading
    /// the slot or another writer. While the buffer is shared, slots are
    /// written only through the sender's staged batches, whose owned slot
    /// sets the allocator hands to one owner at a time.
    ///
    /// Errors: [`StagingError::SlotOutOfRange`], [`StagingError::TooLong`].
    pub fn write_slot(&mut self, slot: u32, data: &[u8]) -> Result<(), StagingError> {
        let offset = self.check_slot(slot)?;
        if data.len() as u64 > self.slot_bytes {
            return Err(StagingError::TooLong {
                len: data.len(),
                slot_bytes: self.slot_bytes,
            });
        }
        // SAFETY: offset + data.len() <= (slot + 1) * slot_bytes <= len, so
        // the destination lies inside the mapping, which lives as long as
        // `self`; `data` is a Rust slice and cannot overlap the mapping
        // (`&mut self` excludes every other borrow of the buffer, and no
        // reference into the mapping outlives the call that made it). The
        // bytes are plain u8 (any value valid). `&mut self` means no other
        // thread can read or write the buffer meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len());
        }
        Ok(())
    }

    /// Start of `slot` for an owner of the slot (`None` if out of range).
    /// Dereferencing it is sound only for `slot_bytes` bytes, and only while
    /// the caller owns the slot (it holds the allocator's [`SlotSet`] with
    /// it and no write posted from it is in flight).
    ///
    /// [`SlotSet`]: crate::slots::SlotSet
    pub(crate) fn slot_ptr(&self, slot: u32) -> Option<*mut u8> {
        let offset = self.check_slot(slot).ok()?;
        // SAFETY: offset < len (check_slot), so the result stays inside the
        // mapping; computing the pointer dereferences nothing.
        Some(unsafe { self.ptr.add(offset) })
    }

    /// Copies the first `len` bytes of `slot` (at most `slot_bytes`) out;
    /// `None` if the slot does not exist. For tests and checks; `&mut self`
    /// for the same reason as [`write_slot`](Self::write_slot).
    pub fn read_slot(&mut self, slot: u32, len: usize) -> Option<Vec<u8>> {
        let offset = self.check_slot(slot).ok()?;
        let len = len.min(self.slot_bytes as usize);
        let mut out = vec![0u8; len];
        // SAFETY: offset + len <= (slot + 1) * slot_bytes <= self.len, inside
        // the mapping; `out` is a fresh allocation, so the ranges are
        // disjoint; `&mut self` excludes concurrent writers.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), len) };
        Some(out)
    }

    /// Adds `len` bytes at `start` as a local region writes may be read
    /// from; returns its id (never 0), or `None` if [`MAX_REGIONS`] are
    /// registered. The caller (the sender) guarantees the memory stays valid
    /// until [`remove_region`](Self::remove_region) and that nobody writes
    /// a range while a write from it is in flight.
    pub(crate) fn add_region(&self, start: *const u8, len: u64) -> Option<u32> {
        let mut r = self.regions.write();
        let idx = match r.iter().position(Option::is_none) {
            Some(i) => i,
            None if r.len() < MAX_REGIONS => {
                r.push(None);
                r.len() - 1
            }
            None => return None,
        };
        r[idx] = Some((start, len));
        Some(idx as u32 + 1)
    }

    /// Forgets region `id` (the sender calls it only when no write from it
    /// is in flight). Unknown ids are ignored.
    pub(crate) fn remove_region(&self, id: u32) {
        let mut r = self.regions.write();
        if let Some(e) = (id as usize).checked_sub(1).and_then(|i| r.get_mut(i)) {
            *e = None;
        }
    }

    /// Where a write reads `len` bytes at `offset` of local memory `region`
    /// (0: this staging buffer, else a registered region): `None` if the
    /// region is unknown or the range does not lie inside it (or its end
    /// does not fit `usize`). Dereferencing the pointer is the transport's
    /// `unsafe` step: valid while the write is in flight (the sender frees a
    /// staging slot, or lets a region be deregistered, only after the
    /// write's completion was polled).
    pub fn source(&self, region: u32, offset: u64, len: u64) -> Option<*const u8> {
        let (base, limit) = if region == 0 {
            (self.ptr.cast_const(), self.len)
        } else {
            let r = self.regions.read();
            (*r.get(region as usize - 1)?)?
        };
        let end = offset.checked_add(len)?;
        if end > limit || end > usize::MAX as u64 {
            return None;
        }
        // In bounds of a live allocation (checked above), so `wrapping_add`
        // lands where `add` would; computing it dereferences nothing.
        Some(base.wrapping_add(offset as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_bounds_checked_per_region() {
        let b = StagingBuffer::new(2, 64).unwrap();
        assert_eq!(
            b.source(0, 64, 64),
            Some(b.as_ptr().wrapping_add(64).cast_const())
        );
        assert_eq!(b.source(0, 65, 64), None);
        assert_eq!(b.source(0, u64::MAX, 2), None);
        let mem = [0u8; 32];
        let id = b.add_region(mem.as_ptr(), 32).unwrap();
        assert_eq!(id, 1);
        assert_eq!(b.source(id, 8, 24), Some(mem.as_ptr().wrapping_add(8)));
        assert_eq!(b.source(id, 8, 25), None);
        assert_eq!(b.source(id + 1, 0, 1), None, "unknown region");
        b.remove_region(id);
        assert_eq!(b.source(id, 0, 1), None, "removed region");
        assert_eq!(b.add_region(mem.as_ptr(), 32), Some(id), "ids are reused");
    }

    #[test]
    fn shares_are_page_aligned_memfds_of_exactly_their_slots() {
        use std::io::Read;
        let b = StagingBuffer::with_shares(10, 4096, 3).unwrap();
        assert_eq!((b.shares(), b.pool_slots()), (3, vec![3, 3, 3, 1]));
        let l = b.share(1).unwrap();
        assert_eq!((l.first_slot, l.slots, l.offset), (3, 3, 3 * 4096));
        let path = format!("/proc/self/fd/{}", b.share_file(1).unwrap().as_raw_fd());
        assert!(b.share(3).is_none(), "the rest is no share");
        // The buffer is contiguous for the transport, and the share's file
        // holds exactly its slots: slot 4 is the file's second slot.
        let p = b.slot_ptr(4).unwrap();
        // SAFETY: the buffer is owned by this test; nothing else touches slot 4.
        unsafe { std::ptr::write_bytes(p, 0xAB, 4096) };
        let mut f = std::fs::File::open(&path).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 3 * 4096);
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).unwrap();
        assert!(bytes[..4096].iter().all(|&x| x == 0));
        assert!(bytes[4096..8192].iter().all(|&x| x == 0xAB));
        assert!(b.source(0, 4 * 4096, 4096).is_some());
        // One range per memfd, in slot order, covering the buffer.
        assert_eq!(
            b.segments(),
            vec![
                0..3 * 4096,
                3 * 4096..6 * 4096,
                6 * 4096..9 * 4096,
                9 * 4096..10 * 4096
            ]
        );
        assert_eq!(StagingBuffer::new(3, 100).unwrap().segments(), vec![0..300]);
        // Sealed at its size: the share cannot be grown.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert!(w.set_len(4 * 4096).is_err());
    }

    #[test]
    fn segments_are_populated_before_any_transfer() {
        let b = StagingBuffer::with_shares(8, 64 << 10, 2).unwrap();
        // Slot 0 starts the buffer's one mapping of 8 slots.
        assert!(
            crate::primitives::region::resident(b.slot_ptr(0).unwrap(), 8 * (64 << 10)),
            "staging would fault on the first transfers"
        );
    }

    #[test]
    fn a_renewed_share_is_cut_off_from_the_old_memfd() {
        let b = StagingBuffer::with_shares(4, 4096, 2).unwrap();
        let old = b.share_file(1).unwrap();
        // A holder that keeps its mapping of the old memfd.
        // SAFETY: a fresh shared mapping of one page of the memfd; unmapped below.
        let held = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                old.as_raw_fd(),
                0,
            )
        };
        assert_ne!(held, libc::MAP_FAILED);
        // SAFETY: slot 2 (share 1) is owned by this test; `held` is one page.
        unsafe {
            std::ptr::write_bytes(held.cast::<u8>(), 0x11, 4096);
            assert_eq!(*b.slot_ptr(2).unwrap(), 0x11, "one memfd, one page");
            b.renew_share(1).unwrap();
            std::ptr::write_bytes(held.cast::<u8>(), 0x22, 4096);
            assert_eq!(*b.slot_ptr(2).unwrap(), 0, "fresh pages, not the old ones");
            *b.slot_ptr(2).unwrap() = 0x33;
            assert_eq!(
                *held.cast::<u8>(),
                0x22,
                "and the old holder sees nothing new"
            );
            libc::munmap(held, 4096);
        }
        assert_ne!(b.share_file(1).unwrap().as_raw_fd(), old.as_raw_fd());
        // SAFETY: as above.
        let rest = unsafe { b.renew_share(2) };
        assert!(
            matches!(rest, Err(StagingError::NotRenewable { share: 2 })),
            "the rest is no share"
        );
    }

    #[test]
    fn small_slots_share_in_page_multiples() {
        let b = StagingBuffer::with_shares(128, 64, 2).unwrap();
        assert_eq!(
            b.pool_slots(),
            vec![64, 64, 0],
            "64 slots of 64 B = one page"
        );
        assert!(matches!(
            StagingBuffer::with_shares(100, 64, 2),
            Err(StagingError::SharesTooSmall { align: 64, .. })
        ));
        let b = StagingBuffer::new(3, 100).unwrap();
        assert_eq!((b.shares(), b.pool_slots()), (0, vec![3]));
    }
}
