//! The sender's staging buffer: `slots` fixed-size slots in one shared,
//! page-aligned memory mapping of a memfd (so an attached prefill worker
//! can map it too, `docs/attach.md`) that a transport reads writes from (the shm
//! copy engine copies out of it; the RDMA transport registers it as a memory
//! region).
//!
//! Which slot belongs to whom is decided by the sender's slot allocator, not
//! by this module: a caller writes only slots it allocated, and the transport
//! reads a slot only while a write posted from it is in flight (the slot is
//! freed after its completion was polled).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;

use memmap2::MmapMut;

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
    /// A slot index at or past the slot count.
    #[error("staging slot {slot} out of range (buffer has {slots} slots)")]
    SlotOutOfRange {
        /// The slot asked for.
        slot: u32,
        /// Number of slots.
        slots: usize,
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
/// page-aligned mapping of a memfd (zero-filled). `Send + Sync`: share it as
/// `Arc<StagingBuffer>` between the caller threads that fill slots and the
/// transport that reads them.
pub struct StagingBuffer {
    /// Owns the mapping; never dereferenced after construction (all access
    /// goes through `ptr`, so no Rust reference to the bytes ever exists).
    _map: MmapMut,
    /// The memfd behind the mapping (see [`file_path`](Self::file_path)).
    file: File,
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
            .finish()
    }
}

impl StagingBuffer {
    /// Maps a zero-filled buffer of `slots * slot_bytes` bytes.
    pub fn new(slots: usize, slot_bytes: u64) -> Result<Self, StagingError> {
        if slots == 0 || slot_bytes == 0 {
            return Err(StagingError::Empty { slots, slot_bytes });
        }
        let overflow = || StagingError::Overflow { slots, slot_bytes };
        let len = (slots as u64)
            .checked_mul(slot_bytes)
            .ok_or_else(overflow)?;
        // Slot indices are u32 in the API, and a mapping cannot exceed isize::MAX.
        if u32::try_from(slots).is_err() || len > isize::MAX as u64 {
            return Err(overflow());
        }
        let map_err = |source| StagingError::Map { len, source };
        // SAFETY: the name is a NUL-terminated literal; memfd_create takes
        // no other pointer.
        let fd = unsafe {
            libc::memfd_create(
                c"kvferry-staging".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).map_err(map_err)?;
        // Sealed against resizing, so no process that can open it (an
        // attached worker) can shrink it under our mapping (SIGBUS).
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own, with integer arguments.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        // SAFETY: the memfd is private to this process (and to attached
        // workers given its path, which write only slots handed to them);
        // its size is sealed. All access goes through `ptr`.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(map_err)?;
        let ptr = map.as_mut_ptr();
        Ok(Self {
            _map: map,
            file,
            ptr,
            slots,
            slot_bytes,
            len,
            regions: parking_lot::RwLock::new(Vec::new()),
        })
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// A path another process of this user can open to map the buffer
    /// (`/proc/<pid>/fd/<memfd>`): slot `i` at offset `i * slot_bytes`.
    pub fn file_path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.file.as_raw_fd()
        ))
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
}
