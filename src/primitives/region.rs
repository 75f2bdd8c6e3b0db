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
//!
//! # A receive buffer the caller provides ([`RecvBuffer`])
//!
//! By default the receiver creates (and removes) its own `/dev/shm` file. A
//! decoder that wants chunks to land in memory it owns hands
//! [`Receiver::start_with_buffer`](crate::receiver::Receiver::start_with_buffer)
//! a [`RecvBuffer`]:
//!
//! - [`RecvBuffer::from_file`]: a file the caller created (a `memfd`, or a
//!   file under `/dev/shm`), at least `4096 + capacity_chunks * chunk_bytes`
//!   bytes. kvferry writes the header above into its first page and the
//!   slots start at byte 4096 (page-aligned), so the caller's own mapping of
//!   the file sees slot `i` at offset `4096 + i * chunk_bytes`. Same-host
//!   senders map it (the shm data plane) by the path announced in
//!   `HelloAck`: `/proc/<pid>/fd/<fd>`, which works for a memfd and for a
//!   regular file alike while the receiver keeps the descriptor open, and
//!   which a sender can open when it runs as the same user in the same pid
//!   namespace (the kernel's ptrace-read check). [`RecvBuffer::open`]
//!   announces the file's own path instead (a file the caller created under
//!   `/dev/shm`, reachable from other pid namespaces that share it). The
//!   file is never truncated or removed by kvferry. TCP and RDMA write into
//!   the same mapping.
//! - [`RecvBuffer::from_raw`] (unsafe): page-aligned memory at a pointer,
//!   at least `capacity_chunks * chunk_bytes` bytes; slot `i` starts at
//!   `ptr + i * chunk_bytes`. No file: there is no shm data plane, so the
//!   receiver needs `tcp_data` (TCP writes land in it) or an acceptor (RDMA
//!   registers its memory region over it), and announces that as its
//!   transport.
//!
//! A buffer that is misaligned ([`RegionError::Misaligned`]) or shorter than
//! the geometry needs ([`RegionError::TooSmall`]) is refused at start.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

mod stale;
pub use stale::remove_stale_buffers;

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
    /// A caller's buffer ([`RecvBuffer::from_raw`]) does not start on a page
    /// boundary (or is null).
    #[error("receive buffer at {addr:#x} is not aligned to the {align}-byte page")]
    Misaligned {
        /// Its address.
        addr: usize,
        /// The page size it must be a multiple of.
        align: usize,
    },
    /// A caller's buffer is shorter than the geometry needs.
    #[error("receive buffer holds {len} bytes, the geometry needs {needed}")]
    TooSmall {
        /// Its length (for a file: the file's size).
        len: u64,
        /// What `capacity_chunks * chunk_bytes` (plus the header page, for a
        /// file) needs.
        needed: u64,
    },
}

/// Memory a caller provides for a receiver's slots; see the module docs.
pub struct RecvBuffer(Source);

enum Source {
    /// A caller's file and the path senders open it by.
    File { file: File, path: PathBuf },
    /// Caller memory at a pointer (validity promised by `from_raw`'s caller).
    Memory { ptr: *mut u8, len: usize },
}

impl std::fmt::Debug for RecvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Source::File { path, .. } => f.debug_struct("RecvBuffer").field("path", path).finish(),
            Source::Memory { ptr, len } => f
                .debug_struct("RecvBuffer")
                .field("ptr", ptr)
                .field("len", len)
                .finish(),
        }
    }
}

// SAFETY: a `RecvBuffer` is only a description of memory; the `from_raw`
// contract makes the memory usable from any thread.
unsafe impl Send for RecvBuffer {}

impl RecvBuffer {
    /// A caller's file (a `memfd` or a `/dev/shm` file, opened read-write),
    /// announced to same-host senders as `/proc/<pid>/fd/<fd>`. The receiver
    /// keeps the descriptor open and never resizes or removes the file.
    pub fn from_file(file: File) -> Self {
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            file.as_raw_fd()
        ));
        Self(Source::File { file, path })
    }

    /// The caller's existing file at `path` (e.g. one it created under
    /// `/dev/shm`), opened read-write and announced by that path.
    pub fn open(path: &Path) -> Result<Self, RegionError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| RegionError::Io {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self(Source::File {
            file,
            path: path.to_owned(),
        }))
    }

    /// Caller memory at `ptr`, `len` bytes. Alignment and size are checked
    /// when the receiver starts ([`RegionError::Misaligned`],
    /// [`RegionError::TooSmall`]).
    ///
    /// # Safety
    /// `ptr..ptr + len` is one allocation of host memory that stays mapped,
    /// readable and writable until the [`Region`] built over it is dropped:
    /// that is, after the receiver and every `ChunkRef`, `RequestChunks` and
    /// `RequestHandle` it handed out are gone. While it lives nothing but the
    /// receiver writes it; the caller may read a slot's bytes through its own
    /// pointer only while it holds a borrow of that slot (`ChunkRef`,
    /// `RequestChunks`).
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        Self(Source::Memory { ptr, len })
    }
}

/// What backs a region's slots.
enum Backing {
    /// A mapped file; `remove` when kvferry created it (removed on drop).
    /// `file` stays open while the region lives: it keeps a caller's
    /// descriptor (its `/proc/<pid>/fd` path) and the creator's lock
    /// valid, and names the mapped file whatever its path holds later
    /// ([`Region::reopen_read_only`]).
    File {
        _map: MmapMut,
        path: PathBuf,
        remove: bool,
        file: File,
    },
    /// Caller memory ([`RecvBuffer::from_raw`]); never freed here.
    Caller,
}

/// A mapped receive buffer (creator or attacher), or a caller's memory.
pub struct Region {
    backing: Backing,
    /// Start of the slot area (inside the mapping, or the caller's pointer).
    data: *mut u8,
    chunk_bytes: u64,
    capacity_chunks: u64,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("path", &self.file_path())
            .field("chunk_bytes", &self.chunk_bytes)
            .field("capacity_chunks", &self.capacity_chunks)
            .finish()
    }
}

/// The host's page size (4096 if `sysconf` cannot say).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers; -1 means unknown.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Whether every page of `len` bytes at `p` (page-aligned, one live
/// mapping) is resident, by mincore(2); the tests' check that a buffer was
/// populated.
#[cfg(test)]
pub(crate) fn resident(p: *mut u8, len: usize) -> bool {
    let mut vec = vec![0u8; len.div_ceil(page_size())];
    // SAFETY: mincore never dereferences `p` (it reads the page tables of
    // the range; an unmapped one is ENOMEM, asserted below) and writes one
    // byte per page of `len` into `vec`, which has that many.
    let rc = unsafe { libc::mincore(p.cast(), len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().all(|&v| v & 1 == 1)
}

/// Writes the header of a `chunk_bytes` x `capacity_chunks` buffer.
fn write_header(map: &mut MmapMut, chunk_bytes: u64, capacity_chunks: u64) {
    map[0..8].copy_from_slice(&REGION_MAGIC);
    map[8..12].copy_from_slice(&REGION_VERSION.to_le_bytes());
    map[16..24].copy_from_slice(&chunk_bytes.to_le_bytes());
    map[24..32].copy_from_slice(&capacity_chunks.to_le_bytes());
    map[32..40].copy_from_slice(&DATA_OFFSET.to_le_bytes());
}

/// The start of the slot area of a file mapping (`DATA_OFFSET` in).
fn data_of(map: &MmapMut) -> *mut u8 {
    // SAFETY: every mapping built here is at least DATA_OFFSET + one slot
    // long (checked before mapping), so the offset stays inside it.
    unsafe { map.as_ptr().add(DATA_OFFSET as usize) as *mut u8 }
}

fn total_len(chunk_bytes: u64, capacity_chunks: u64) -> Option<u64> {
    chunk_bytes
        .checked_mul(capacity_chunks)?
        .checked_add(DATA_OFFSET)
}

/// The file length of a buffer of this geometry, or why it has none.
fn checked_len(chunk_bytes: u64, capacity_chunks: u64) -> Result<u64, RegionError> {
    if chunk_bytes == 0 || capacity_chunks == 0 {
        return Err(RegionError::Geometry(format!(
            "chunk_bytes ({chunk_bytes}) and capacity_chunks ({capacity_chunks}) must be positive"
        )));
    }
    total_len(chunk_bytes, capacity_chunks).ok_or_else(|| {
        RegionError::Geometry(format!(
            "{capacity_chunks} chunks of {chunk_bytes} bytes overflow"
        ))
    })
}

impl Region {
    /// Creates (or truncates) the buffer file at `path` and maps it. The file
    /// is removed again when the returned region is dropped.
    pub fn create(
        path: &Path,
        chunk_bytes: u64,
        capacity_chunks: u64,
    ) -> Result<Self, RegionError> {
        let len = checked_len(chunk_bytes, capacity_chunks)?;
        let io = |source| RegionError::Io {
            path: path.to_owned(),
            source,
        };
        let file = open_locked(path).map_err(io)?;
        file.set_len(len).map_err(io)?;
        // Populated (`MAP_POPULATE`): the pages are allocated and zeroed
        // here, at start-up, not by the first transfers' page faults (for a
        // 16 MiB buffer, 4096 faults in the copy engine's first pass).
        // SAFETY: the file was just created and sized by us; other processes
        // only map it after learning its path from our HelloAck, and they only
        // write into slots (never the header). Concurrent writes to slot bytes
        // are coordinated by the control plane, and we never form references
        // to slot memory that outlive a grant (see `slot_ptr`).
        let mut map = unsafe {
            MmapOptions::new()
                .len(len as usize)
                .populate()
                .map_mut(&file)
        }
        .map_err(io)?;
        write_header(&mut map, chunk_bytes, capacity_chunks);
        Ok(Self {
            data: data_of(&map),
            backing: Backing::File {
                _map: map,
                path: path.to_owned(),
                remove: true,
                // Holds the creator's lock (see `stale`) while the region lives.
                file,
            },
            chunk_bytes,
            capacity_chunks,
        })
    }

    /// A region over a caller's buffer (see the module docs): a file gets
    /// the header in its first page and slots after it; memory at a pointer
    /// holds slots only. Errors: [`RegionError::Geometry`],
    /// [`RegionError::Misaligned`], [`RegionError::TooSmall`],
    /// [`RegionError::Io`] (the file cannot be sized or mapped).
    pub fn from_buffer(
        buffer: RecvBuffer,
        chunk_bytes: u64,
        capacity_chunks: u64,
    ) -> Result<Self, RegionError> {
        let needed = checked_len(chunk_bytes, capacity_chunks)?;
        match buffer.0 {
            Source::File { file, path } => {
                let io = |source| RegionError::Io {
                    path: path.clone(),
                    source,
                };
                let len = file.metadata().map_err(io)?.len();
                if len < needed {
                    return Err(RegionError::TooSmall { len, needed });
                }
                let map_len = usize::try_from(needed).map_err(|_| {
                    RegionError::Geometry(format!("{needed} bytes do not fit this address space"))
                })?;
                // SAFETY: the caller handed us this file for the receiver's
                // use; we map its first `needed` bytes (the file holds at
                // least that many), write only the header here, and slot
                // bytes are touched only through raw pointers under
                // control-plane grants, as for a file we create.
                let mut map = unsafe { MmapOptions::new().len(map_len).populate().map_mut(&file) }
                    .map_err(io)?;
                write_header(&mut map, chunk_bytes, capacity_chunks);
                Ok(Self {
                    data: data_of(&map),
                    backing: Backing::File {
                        _map: map,
                        path,
                        remove: false,
                        file,
                    },
                    chunk_bytes,
                    capacity_chunks,
                })
            }
            Source::Memory { ptr, len } => {
                let align = page_size();
                let addr = ptr as usize;
                if ptr.is_null() || addr % align != 0 {
                    return Err(RegionError::Misaligned { addr, align });
                }
                let needed = needed - DATA_OFFSET;
                if (len as u64) < needed {
                    return Err(RegionError::TooSmall {
                        len: len as u64,
                        needed,
                    });
                }
                Ok(Self {
                    backing: Backing::Caller,
                    data: ptr,
                    chunk_bytes,
                    capacity_chunks,
                })
            }
        }
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
            data: data_of(&map),
            backing: Backing::File {
                _map: map,
                path: path.to_owned(),
                remove: false,
                file,
            },
            chunk_bytes,
            capacity_chunks,
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

    /// The file backing the region, as senders open it; empty for caller
    /// memory at a pointer ([`RecvBuffer::from_raw`]), which has none (see
    /// [`Region::file_path`]).
    pub fn path(&self) -> &Path {
        self.file_path().unwrap_or(Path::new(""))
    }

    /// The file backing the region, as senders open it; `None` for caller
    /// memory at a pointer ([`RecvBuffer::from_raw`]).
    pub fn file_path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::File { path, .. } => Some(path),
            Backing::Caller => None,
        }
    }

    /// A new read-only descriptor of the file mapped here, opened through
    /// this process's own descriptor of it (`/proc/self/fd/N`), so it is
    /// that very file whatever its path holds now (another process of the
    /// user may have replaced the name, with a FIFO or another file);
    /// `None` for caller memory at a pointer, which has no file.
    pub fn reopen_read_only(&self) -> Option<std::io::Result<File>> {
        match &self.backing {
            Backing::File { file, .. } => Some(File::open(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(file)
            ))),
            Backing::Caller => None,
        }
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
        self.data
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
        if let Backing::File {
            path, remove: true, ..
        } = &self.backing
        {
            // Best effort: the file may already be gone (operator cleanup).
            let _ = std::fs::remove_file(path);
        }
    }
}

// SAFETY: the mapping (or the caller's memory, under `RecvBuffer::from_raw`'s
// contract) is plain memory usable from any thread; all slot access goes
// through raw pointers whose exclusivity is arbitrated by the control plane,
// and the header is immutable after creation.
unsafe impl Sync for Region {}
// SAFETY: as for `Sync`: nothing in a region is tied to the thread that
// built it (`data` points into memory that outlives the region's owner).
unsafe impl Send for Region {}

/// Opens (creating or truncating) a buffer file for `Region::create` and
/// takes the creator's shared lock on it, which tells the stale-file sweep
/// ([`remove_stale_buffers`]) that a live receiver owns it. A sweep that
/// holds the file's exclusive lock at this instant is removing a dead
/// receiver's file at the same name (pid reuse): open again, up to 100
/// times 1 ms, and the name is a fresh file by then. On a file system
/// without `flock` the file stays unlocked: only the sweep's pid check
/// then protects it.
fn open_locked(path: &Path) -> std::io::Result<File> {
    let mut tries = 0;
    loop {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        match stale::lock_shared(&file) {
            Ok(()) => return Ok(file),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Err(e),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "cannot lock the buffer file");
                return Ok(file);
            }
        }
    }
}

static NEXT_REGION: AtomicU64 = AtomicU64::new(0);

/// A fresh default path for a buffer file: `/dev/shm/kvferry-<pid>-<n>.buf`
/// when `/dev/shm` exists, else the system temp dir. The first call of a
/// process first removes the files dead receivers left there
/// ([`remove_stale_buffers`]).
pub fn default_region_path() -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    // Relaxed: the counter only has to hand out distinct numbers.
    let n = NEXT_REGION.fetch_add(1, Ordering::Relaxed);
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_owned()
    } else {
        std::env::temp_dir()
    };
    SWEPT.call_once(|| {
        remove_stale_buffers(&dir);
    });
    dir.join(format!("kvferry-{}-{n}.buf", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_created_buffer_is_populated_before_any_transfer() {
        let path = default_region_path();
        let r = Region::create(&path, 64 << 10, 64).unwrap();
        let p = r.slot_ptr(0).unwrap();
        assert!(
            resident(p, 64 * (64 << 10)),
            "the slots would fault on the first transfers"
        );
    }

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

    /// A page-aligned, zeroed heap allocation of `len` bytes for tests.
    struct Pages(*mut u8, std::alloc::Layout);

    impl Pages {
        fn new(len: usize) -> Self {
            let layout = std::alloc::Layout::from_size_align(len, page_size()).unwrap();
            // SAFETY: `layout` has a non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            assert!(!p.is_null());
            Self(p, layout)
        }
    }

    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.0, self.1) };
        }
    }

    #[test]
    fn caller_memory_is_the_slot_area() {
        let mem = Pages::new(4 * 4096);
        // SAFETY: `mem` outlives the region (dropped after it, below) and
        // only the region's pointers touch it meanwhile.
        let r =
            Region::from_buffer(unsafe { RecvBuffer::from_raw(mem.0, 4 * 4096) }, 4096, 4).unwrap();
        assert_eq!(r.data_ptr(), mem.0, "slot 0 is the caller's first byte");
        assert_eq!(r.slot_ptr(3), Some(mem.0.wrapping_add(3 * 4096)));
        assert!(r.file_path().is_none(), "no file: no shm path");
        drop(r);
    }

    #[test]
    fn a_misaligned_or_short_caller_buffer_is_a_typed_error() {
        let mem = Pages::new(4 * 4096);
        let page = page_size();
        // SAFETY: `mem` outlives this attempt, which builds no region.
        let odd = unsafe { RecvBuffer::from_raw(mem.0.wrapping_add(64), 3 * 4096) };
        assert!(matches!(
            Region::from_buffer(odd, 4096, 2),
            Err(RegionError::Misaligned { align, .. }) if align == page
        ));
        // SAFETY: `mem` outlives this attempt, which builds no region.
        let null = unsafe { RecvBuffer::from_raw(std::ptr::null_mut(), 4096) };
        assert!(matches!(
            Region::from_buffer(null, 4096, 1),
            Err(RegionError::Misaligned { addr: 0, .. })
        ));
        // SAFETY: `mem` outlives this attempt, which builds no region.
        let short = unsafe { RecvBuffer::from_raw(mem.0, 4 * 4096) };
        assert!(matches!(
            Region::from_buffer(short, 4096, 5),
            Err(RegionError::TooSmall { len, needed }) if len == 4 * 4096 && needed == 5 * 4096
        ));
        // SAFETY: `mem` outlives this attempt, which builds no region.
        let zero = unsafe { RecvBuffer::from_raw(mem.0, 4 * 4096) };
        assert!(matches!(
            Region::from_buffer(zero, 0, 5),
            Err(RegionError::Geometry(_))
        ));
    }

    #[test]
    fn a_caller_file_gets_the_header_and_is_kept() {
        let path = default_region_path();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_len(DATA_OFFSET + 2 * 4096).unwrap();
        // Too small for three slots: refused, the file untouched.
        let short = RecvBuffer::from_file(file.try_clone().unwrap());
        assert!(matches!(
            Region::from_buffer(short, 4096, 3),
            Err(RegionError::TooSmall { needed, .. }) if needed == DATA_OFFSET + 3 * 4096
        ));
        let r = Region::from_buffer(RecvBuffer::from_file(file), 4096, 2).unwrap();
        let announced = r.file_path().unwrap().to_owned();
        assert!(
            announced.starts_with(format!("/proc/{}/fd/", std::process::id())),
            "{announced:?}"
        );
        // SAFETY: slot 1 is owned by this test.
        unsafe { std::ptr::write_bytes(r.slot_ptr(1).unwrap(), 0x5A, 4096) };
        // A sender opens it by the announced path and sees header and bytes.
        let o = Region::open(&announced, Some((4096, 2))).unwrap();
        // SAFETY: nothing writes slot 1 any more.
        let back = unsafe { std::slice::from_raw_parts(o.slot_ptr(1).unwrap(), 4096) };
        assert_eq!(back, &[0x5A; 4096][..]);
        drop(o);
        drop(r);
        // The caller's file stays, with the bytes at 4096 + slot * chunk.
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, DATA_OFFSET + 2 * 4096);
        assert_eq!(&bytes[..8], &REGION_MAGIC);
        assert!(bytes[DATA_OFFSET as usize + 4096..]
            .iter()
            .all(|&b| b == 0x5A));
        // By path: announced as given.
        let r = Region::from_buffer(RecvBuffer::open(&path).unwrap(), 4096, 2).unwrap();
        assert_eq!(r.file_path(), Some(path.as_path()));
        drop(r);
        assert!(path.exists(), "a caller's file is never removed");
        std::fs::remove_file(&path).unwrap();
    }
}
