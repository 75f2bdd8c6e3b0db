//! The receive buffer: `capacity_chunks` fixed-size slots in a shared-memory
//! file, so a sender on the same host can map it and write chunks in place.
//!
//! Layout of the file (all integers little-endian):
//!
//! ```text
//! offset 0     magic  b"KVFBUF\0\x01"                    8 bytes
//! offset 8     layout version (u32) | reserved (u32)     8 bytes
//! offset 16    chunk_bytes (u64)                         8 bytes
//! offset 24    capacity_chunks (u64)                     8 bytes
//! offset 32    data_offset (u64) = 4096                  8 bytes
//! offset 4096  slot 0 | slot 1 | ... | slot capacity-1   chunk_bytes each
//! ```
//!
//! The header is written once by the creator and only read afterwards; the
//! slots are plain bytes. Who may write which slot at which time is decided by
//! the control plane (a sender writes only the slots an `AllocResponse`
//! granted it), never by this module.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

/// Magic bytes at the start of every kvferry buffer file.
pub const REGION_MAGIC: [u8; 8] = *b"KVFBUF\0\x01";
/// Layout version of the buffer file header.
pub const REGION_VERSION: u32 = 1;
/// Byte offset of slot 0 (one page, so slots are page-aligned when
/// `chunk_bytes` is a multiple of the page size).
pub const DATA_OFFSET: u64 = 4096;

/// Errors creating or attaching a buffer region.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The file could not be created, opened, sized or mapped.
    #[error("buffer file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter than its header says, or than a header.
    #[error("buffer file {path} is truncated: {len} bytes, expected at least {expected}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The length the header implies.
        expected: u64,
    },
    /// The header is not a kvferry buffer header of this version.
    #[error("buffer file {path} has a bad header: {reason}")]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The header does not match what the peer announced.
    #[error("buffer file {path} does not match the announced geometry: {reason}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// Zero or overflowing sizes.
    #[error("invalid buffer geometry: {0}")]
    Geometry(String),
}

/// A mapped receive buffer (creator or attacher).
pub struct Region {
    map: MmapMut,
    path: PathBuf,
    chunk_bytes: u64,
    capacity_chunks: u64,
    owner: bool,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("path", &self.path)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("capacity_chunks", &self.capacity_chunks)
            .field("owner", &self.owner)
            .finish()
    }
}

fn total_len(chunk_bytes: u64, capacity_chunks: u64) -> Option<u64> {
    chunk_bytes
        .checked_mul(capacity_chunks)?
        .checked_add(DATA_OFFSET)
}

impl Region {
    /// Creates (or truncates) the buffer file at `path` and maps it. The file
    /// is removed again when the returned region is dropped.
    pub fn create(
        path: &Path,
        chunk_bytes: u64,
        capacity_chunks: u64,
    ) -> Result<Self, RegionError> {
        if chunk_bytes == 0 || capacity_chunks == 0 {
            return Err(RegionError::Geometry(format!(
                "chunk_bytes ({chunk_bytes}) and capacity_chunks ({capacity_chunks}) must be positive"
            )));
        }
        let len = total_len(chunk_bytes, capacity_chunks).ok_or_else(|| {
            RegionError::Geometry(format!(
                "{capacity_chunks} chunks of {chunk_bytes} bytes overflow"
            ))
        })?;
        let io = |source| RegionError::Io {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io)?;
        file.set_len(len).map_err(io)?;
        // SAFETY: the file was just created and sized by us; other processes
        // only map it after learning its path from our HelloAck, and they only
        // write into slots (never the header). Concurrent writes to slot bytes
        // are coordinated by the control plane, and we never form references
        // to slot memory that outlive a grant (see `slot_ptr`).
        let mut map = unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }.map_err(io)?;
        map[0..8].copy_from_slice(&REGION_MAGIC);
        map[8..12].copy_from_slice(&REGION_VERSION.to_le_bytes());
        map[16..24].copy_from_slice(&chunk_bytes.to_le_bytes());
        map[24..32].copy_from_slice(&capacity_chunks.to_le_bytes());
        map[32..40].copy_from_slice(&DATA_OFFSET.to_le_bytes());
        Ok(Self {
            map,
            path: path.to_owned(),
            chunk_bytes,
            capacity_chunks,
            owner: true,
        })
    }

    /// Maps an existing buffer file created by [`Region::create`] (possibly in
    /// another process), checking its header and size. If `expect` is given
    /// as `(chunk_bytes, capacity_chunks)`, the header must match it.
    pub fn open(path: &Path, expect: Option<(u64, u64)>) -> Result<Self, RegionError> {
        let io = |source| RegionError::Io {
            path: path.to_owned(),
            source,
        };
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < DATA_OFFSET {
            return Err(RegionError::Truncated {
                path: path.to_owned(),
                len,
                expected: DATA_OFFSET,
            });
        }
        // SAFETY: as in `create`: the header is read-only after creation and
        // slot bytes are only touched through raw pointers under control-plane
        // grants. A concurrent truncation by a hostile process could SIGBUS us;
        // the file lives in a directory the operator controls (docs/operations.md).
        let map = unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }.map_err(io)?;
        let bad = |reason: String| RegionError::BadHeader {
            path: path.to_owned(),
            reason,
        };
        if map[0..8] != REGION_MAGIC {
            return Err(bad("wrong magic (not a kvferry buffer file)".into()));
        }
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&map[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let version = word(8) as u32;
        if version != REGION_VERSION {
            return Err(bad(format!(
                "layout version {version}, this build reads {REGION_VERSION}"
            )));
        }
        let (chunk_bytes, capacity_chunks, data_offset) = (word(16), word(24), word(32));
        if data_offset != DATA_OFFSET {
            return Err(bad(format!(
                "data offset {data_offset}, expected {DATA_OFFSET}"
            )));
        }
        if chunk_bytes == 0 || capacity_chunks == 0 {
            return Err(bad("zero chunk size or capacity".into()));
        }
        let expected = total_len(chunk_bytes, capacity_chunks)
            .ok_or_else(|| bad("geometry overflows".into()))?;
        if len < expected {
            return Err(RegionError::Truncated {
                path: path.to_owned(),
                len,
                expected,
            });
        }
        if let Some((cb, cap)) = expect {
            if (cb, cap) != (chunk_bytes, capacity_chunks) {
                return Err(RegionError::Mismatch {
                    path: path.to_owned(),
                    reason: format!(
                        "file has {capacity_chunks} slots of {chunk_bytes} bytes, peer announced {cap} of {cb}"
                    ),
                });
            }
        }
        Ok(Self {
            map,
            path: path.to_owned(),
            chunk_bytes,
            capacity_chunks,
            owner: false,
        })
    }

    /// Bytes per slot.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Number of slots.
    pub fn capacity_chunks(&self) -> u64 {
        self.capacity_chunks
    }

    /// The file backing the region.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Total bytes of the slot area.
    pub fn data_len(&self) -> u64 {
        self.chunk_bytes * self.capacity_chunks
    }

    /// Base pointer of the slot area. Slot `i` starts at `i * chunk_bytes`.
    ///
    /// Writing through it is only sound for byte ranges the caller owns
    /// exclusively (a slot granted to its request and not yet released).
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET < map.len() (checked at create/open), so the
        // offset stays inside the mapping.
        unsafe { self.map.as_ptr().add(DATA_OFFSET as usize) as *mut u8 }
    }

    /// Returns `Some(ptr)` to the start of `slot` if it exists.
    pub fn slot_ptr(&self, slot: u32) -> Option<*mut u8> {
        if u64::from(slot) >= self.capacity_chunks {
            return None;
        }
        // SAFETY: slot < capacity, so slot * chunk_bytes + chunk_bytes <=
        // data_len and the pointer stays inside the mapping.
        Some(unsafe {
            self.data_ptr()
                .add((u64::from(slot) * self.chunk_bytes) as usize)
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owner {
            // Best effort: the file may already be gone (operator cleanup).
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

// SAFETY: the mapping is plain shared memory; all slot access goes through raw
// pointers whose exclusivity is arbitrated by the control plane, and the
// header is immutable after creation.
unsafe impl Sync for Region {}

static NEXT_REGION: AtomicU64 = AtomicU64::new(0);

/// A fresh default path for a buffer file: `/dev/shm/kvferry-<pid>-<n>.buf`
/// when `/dev/shm` exists, else the system temp dir.
pub fn default_region_path() -> PathBuf {
    // Relaxed: the counter only has to hand out distinct numbers.
    let n = NEXT_REGION.fetch_add(1, Ordering::Relaxed);
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_owned()
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("kvferry-{}-{n}.buf", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_roundtrip_and_checks() {
        let path = default_region_path();
        let r = Region::create(&path, 4096, 8).unwrap();
        let p = r.slot_ptr(3).unwrap();
        // SAFETY: slot 3 is owned by this test.
        unsafe { std::ptr::write_bytes(p, 0xAB, 4096) };
        let o = Region::open(&path, Some((4096, 8))).unwrap();
        let q = o.slot_ptr(3).unwrap();
        // SAFETY: slot 3 of the second mapping; nothing writes it any more.
        let back = unsafe { std::slice::from_raw_parts(q, 4096) };
        assert_eq!(back, &[0xAB; 4096][..], "the two mappings share the bytes");
        assert!(o.slot_ptr(8).is_none());
        assert!(matches!(
            Region::open(&path, Some((4096, 9))),
            Err(RegionError::Mismatch { .. })
        ));
        drop(o);
        drop(r);
        assert!(!path.exists(), "creator removes the file");
        assert!(matches!(
            Region::open(&path, None),
            Err(RegionError::Io { .. })
        ));
    }

    #[test]
    fn bad_files_are_typed_errors() {
        let path = default_region_path();
        std::fs::write(&path, b"short").unwrap();
        assert!(matches!(
            Region::open(&path, None),
            Err(RegionError::Truncated { .. })
        ));
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        assert!(matches!(
            Region::open(&path, None),
            Err(RegionError::BadHeader { .. })
        ));
        // A valid header that claims more slots than the file holds.
        let mut bytes = vec![0u8; 8192];
        bytes[0..8].copy_from_slice(&REGION_MAGIC);
        bytes[8..12].copy_from_slice(&REGION_VERSION.to_le_bytes());
        bytes[16..24].copy_from_slice(&4096u64.to_le_bytes());
        bytes[24..32].copy_from_slice(&100u64.to_le_bytes());
        bytes[32..40].copy_from_slice(&DATA_OFFSET.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            Region::open(&path, None),
            Err(RegionError::Truncated { .. })
        ));
        bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            Region::open(&path, None),
            Err(RegionError::BadHeader { .. })
        ));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            Region::create(&path, 0, 4),
            Err(RegionError::Geometry(_))
        ));
        assert!(matches!(
            Region::create(&path, u64::MAX, 4),
            Err(RegionError::Geometry(_))
        ));
    }
}
