//! Typed errors of the ring crate.

use std::path::PathBuf;

/// Which end of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The producing end.
    Producer,
    /// The consuming end.
    Consumer,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Producer => "producer",
            Side::Consumer => "consumer",
        })
    }
}

/// A requested capacity was larger than [`crate::MAX_CAPACITY`], or the ring
/// would not fit in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("ring capacity {requested} is too large (max {max} entries)", max = crate::MAX_CAPACITY)]
pub struct CapacityError {
    /// The capacity that was asked for.
    pub requested: usize,
}

/// Why creating, opening or attaching to a shared-memory ring failed.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A file-system or mmap call failed.
    #[error("shared ring {path}: {source}")]
    Io {
        /// The ring file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The requested capacity is too large.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The entry type needs a larger alignment than a page.
    #[error("entry alignment {align} exceeds the page size (4096)")]
    AlignTooLarge {
        /// `align_of` the entry type.
        align: usize,
    },
    /// The ring file is not on a memory file system (tmpfs, hugetlbfs or
    /// ramfs). On a disk-backed file system the kernel writes the ring's
    /// pages back and write-protects them, so a later store into the ring
    /// faults into the file system (`page_mkwrite`: journal, writeback) and
    /// waits as long as the file system makes it; an MPSC producer blocked
    /// there between claiming a slot and publishing it stalls the consumer
    /// and, once the ring fills, every other producer.
    #[error(
        "shared ring {path} is on a disk-backed file system (statfs type {fs_type:#x}); \
         put ring files on tmpfs, e.g. /dev/shm"
    )]
    NotInMemory {
        /// The ring file.
        path: PathBuf,
        /// `statfs.f_type` of its file system.
        fs_type: u64,
    },
    /// The file is shorter than its header says it must be.
    #[error("shared ring file is truncated: {len} bytes, need {expected}")]
    Truncated {
        /// Actual file length.
        len: u64,
        /// Length required.
        expected: u64,
    },
    /// The file does not start with the ring magic.
    #[error("not a kvferry ring (magic {found:#018x})")]
    BadMagic {
        /// Magic found.
        found: u64,
    },
    /// The layout version differs from this build's.
    #[error("ring layout version {found}, this build reads {expected}")]
    VersionMismatch {
        /// Version found.
        found: u32,
        /// Version expected.
        expected: u32,
    },
    /// SPSC ring opened as MPSC or vice versa (1 = SPSC, 2 = MPSC).
    #[error("ring kind {found}, expected {expected} (1 = spsc, 2 = mpsc)")]
    KindMismatch {
        /// Kind found.
        found: u32,
        /// Kind expected.
        expected: u32,
    },
    /// The header's capacity is zero, not a power of two, or too large.
    #[error("invalid ring capacity {found} in header")]
    BadCapacity {
        /// Capacity found.
        found: u64,
    },
    /// The entry size differs from `size_of::<T>()`.
    #[error("entry size {found}, expected {expected}")]
    EntrySizeMismatch {
        /// Size found.
        found: u64,
        /// Size expected.
        expected: u64,
    },
    /// The entry alignment differs from `align_of::<T>()`.
    #[error("entry alignment {found}, expected {expected}")]
    EntryAlignMismatch {
        /// Alignment found.
        found: u64,
        /// Alignment expected.
        expected: u64,
    },
    /// The entry type's fingerprint differs (same size, different type).
    #[error("entry type fingerprint {found:#018x}, expected {expected:#018x}")]
    FingerprintMismatch {
        /// Fingerprint found.
        found: u64,
        /// Fingerprint expected.
        expected: u64,
    },
    /// A layout offset in the header disagrees with the computed layout.
    #[error("header field {field} is {found}, expected {expected}")]
    LayoutMismatch {
        /// Which header field.
        field: &'static str,
        /// Value found.
        found: u64,
        /// Value expected.
        expected: u64,
    },
    /// That side of the ring was already taken (by this or another process).
    #[error("the {0} side of this ring is already taken")]
    SideTaken(Side),
    /// The ring is closed: its producers are all gone, so no new one may attach.
    #[error("the ring is closed")]
    Closed,
}
