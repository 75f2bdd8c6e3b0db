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

    /// The ring file.
    pub fn path(&self) -> &Path {
        &self.path
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
