//! SPSC rings in a shared-memory file (memmap2).
//!
//! One process [`create`]s the file and takes one side, another [`open`]s it
//! and takes the other. The handle's [`SharedRing::producer`] and
//! [`SharedRing::consumer`] return the same [`Producer`]/[`Consumer`] types as
//! a heap ring, so code is generic over the backing. Each side can be taken
//! once per ring file, across all processes ([`ShmError::SideTaken`]).
//!
//! The file must be on a memory file system (tmpfs such as `/dev/shm`,
//! hugetlbfs, ramfs): [`create`] and [`open`] refuse any other with
//! [`ShmError::NotInMemory`].
//!
//! An anonymous ring ([`create_anonymous`]) has no path: it is a sealed
//! memfd whose descriptor ([`SharedRing::file`]) the creator passes to the
//! other process (`SCM_RIGHTS`), which maps it with [`from_file`] — the
//! same header checks as [`open`].

use std::ffi::CStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Consumer, Producer};
use crate::layout::Kind;
use crate::ring::Ring;
use crate::{Plain, ShmError};

/// A mapped SPSC ring file. Dropping it unmaps once no handle taken from it
/// is alive (handles keep the mapping).
pub struct SharedRing<T: Plain> {
    ring: Arc<Ring<T>>,
    path: PathBuf,
    /// The memfd of an anonymous ring ([`create_anonymous`]).
    file: Option<File>,
}

/// Create (or atomically replace) the ring file at `path` with `capacity`
/// entries (rounded up to a power of two), zero-filled, no side taken.
pub fn create<T: Plain>(
    path: impl AsRef<Path>,
    capacity: usize,
) -> Result<SharedRing<T>, ShmError> {
    let path = path.as_ref();
    let ring = crate::shm::create::<T>(path, capacity, Kind::Spsc)?;
    Ok(SharedRing {
        ring: Arc::new(ring),
        path: path.to_path_buf(),
        file: None,
    })
}

/// Open the SPSC ring file at `path`, checking magic, layout version, kind,
/// capacity, entry size and alignment, the type fingerprint of `T`, the
/// layout offsets and the file length. Never maps a ring it cannot use.
pub fn open<T: Plain>(path: impl AsRef<Path>) -> Result<SharedRing<T>, ShmError> {
    let path = path.as_ref();
    let ring = crate::shm::open::<T>(path, Kind::Spsc)?;
    Ok(SharedRing {
        ring: Arc::new(ring),
        path: path.to_path_buf(),
        file: None,
    })
}

/// Create an anonymous ring of `capacity` entries (rounded up to a power
/// of two): a memfd that no file-system path reaches (`name` shows only in
/// `/proc/<pid>/fd` links), sealed at its size so no holder can shrink or
/// grow it. Hand [`SharedRing::file`] to the other process; it maps the
/// ring with [`from_file`].
pub fn create_anonymous<T: Plain>(name: &CStr, capacity: usize) -> Result<SharedRing<T>, ShmError> {
    let (ring, file) = crate::shm::create_memfd::<T>(name, capacity, Kind::Spsc)?;
    Ok(SharedRing {
        ring: Arc::new(ring),
        path: crate::shm::memfd_path(name),
        file: Some(file),
    })
}

/// Map the SPSC ring in `file` (a read-write descriptor, e.g. one received
/// from the creator of an anonymous ring), with every check of [`open`];
/// `name` names it in errors and [`SharedRing::path`]. The mapping does not
/// need the descriptor: drop `file` once this returns.
pub fn from_file<T: Plain>(file: &File, name: impl AsRef<Path>) -> Result<SharedRing<T>, ShmError> {
    let path = name.as_ref();
    let ring = crate::shm::open_file::<T>(file, path, Kind::Spsc)?;
    Ok(SharedRing {
        ring: Arc::new(ring),
        path: path.to_path_buf(),
        file: None,
    })
}

impl<T: Plain> SharedRing<T> {
    /// Take the producer side (once per ring file, across processes).
    pub fn producer(&self) -> Result<Producer<T>, ShmError> {
        self.ring.attach_producer(true)?;
        Ok(Producer::attach(self.ring.clone()))
    }

    /// Take the consumer side (once per ring file, across processes).
    pub fn consumer(&self) -> Result<Consumer<T>, ShmError> {
        self.ring.attach_consumer()?;
        Ok(Consumer::attach(self.ring.clone()))
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.ring.capacity() as usize
    }

    /// The ring file (an anonymous ring: `memfd:<name>`, which opens nothing).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The memfd of a ring made by [`create_anonymous`] (`None` otherwise):
    /// the descriptor to pass to the other side.
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }
}

impl<T: Plain> std::fmt::Debug for SharedRing<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("spsc::SharedRing")
            .field("path", &self.path)
            .field("capacity", &self.ring.capacity())
            .finish()
    }
}
