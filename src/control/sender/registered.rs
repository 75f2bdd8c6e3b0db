//! Caller-registered host memory ([`MemoryRegion`], from
//! [`Sender::register`](super::Sender::register)) and the completion handle
//! of a write posted straight from it ([`WriteHandle`], from
//! [`Request::write`](super::Request::write)).
//!
//! A region counts the writes in flight from it; it can only be
//! deregistered while that count is 0, and a write holds its count (through
//! a [`WriteLease`] carried by the batch and then by each posted op) until
//! the transport's completion for its last op was polled. So the transport
//! never reads a region after it was deregistered.

use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::Shared;

/// Errors registering or deregistering memory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegisterError {
    /// A null address.
    #[error("cannot register memory at a null address")]
    Null,
    /// Zero bytes.
    #[error("cannot register an empty memory region")]
    Empty,
    /// The address is not page-aligned.
    #[error("memory at {addr:#x} is not aligned to the page size ({page} bytes)")]
    Unaligned {
        /// The address.
        addr: usize,
        /// The page size.
        page: usize,
    },
    /// `addr + len` overflows the address space.
    #[error("memory region of {len} bytes at {addr:#x} overflows the address space")]
    Overflow {
        /// The address.
        addr: usize,
        /// The length.
        len: usize,
    },
    /// As many regions as the sender can track are registered.
    #[error("too many registered regions (at most {max})")]
    TooMany {
        /// The bound.
        max: usize,
    },
    /// This sender's transport cannot write from registered memory.
    #[error("the {transport} transport does not support registered memory yet")]
    Unsupported {
        /// The transport's name.
        transport: String,
    },
    /// The region belongs to another sender.
    #[error("region {id} was registered with another sender")]
    ForeignRegion {
        /// The region's id.
        id: u32,
    },
    /// The region was already deregistered.
    #[error("region {id} is not registered")]
    NotRegistered {
        /// The region's id.
        id: u32,
    },
    /// Writes from the region are still in flight.
    #[error("region {id} still has {in_flight} writes in flight")]
    Busy {
        /// The region's id.
        id: u32,
        /// Writes (calls of `Request::write`) not completed yet.
        in_flight: usize,
    },
}

/// The system's page size (one definition, in `region`).
pub(crate) use crate::region::page_size;

/// What a region's handles and its writes share.
#[derive(Debug)]
pub(crate) struct RegionEntry {
    /// The id in the staging buffer's region table (and in `WriteOp`s).
    pub id: u32,
    pub len: usize,
    /// The sender it belongs to, compared by address only (the weak count
    /// keeps the allocation, so no later sender can reuse the address).
    owner: Weak<Shared>,
    state: Mutex<RegionState>,
}

#[derive(Debug)]
struct RegionState {
    registered: bool,
    in_flight: usize,
}

impl RegionEntry {
    pub(crate) fn new(id: u32, len: usize, owner: &Arc<Shared>) -> Self {
        Self {
            id,
            len,
            owner: Arc::downgrade(owner),
            state: Mutex::new(RegionState {
                registered: true,
                in_flight: 0,
            }),
        }
    }

    /// True if the region was registered with the sender of `shared`.
    pub(crate) fn belongs_to(&self, shared: &Arc<Shared>) -> bool {
        std::ptr::eq(self.owner.as_ptr(), Arc::as_ptr(shared))
    }

    /// Marks the region deregistered if nothing is in flight from it.
    pub(crate) fn retire(&self) -> Result<(), RegisterError> {
        let mut s = self.state.lock();
        if !s.registered {
            return Err(RegisterError::NotRegistered { id: self.id });
        }
        if s.in_flight > 0 {
            return Err(RegisterError::Busy {
                id: self.id,
                in_flight: s.in_flight,
            });
        }
        s.registered = false;
        Ok(())
    }
}

/// Host memory registered with a [`Sender`](super::Sender): the source of
/// [`Request::write`](super::Request::write)s. A cheap handle (clones name
/// the same region); dropping it does not deregister the memory (use
/// [`Sender::deregister`](super::Sender::deregister)).
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    pub(crate) entry: Arc<RegionEntry>,
}

impl MemoryRegion {
    /// The region's id (as in the transport's write ops).
    pub fn id(&self) -> u32 {
        self.entry.id
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.entry.len
    }

    /// Never true (empty regions are refused); for clippy's `len` rule.
    pub fn is_empty(&self) -> bool {
        self.entry.len == 0
    }
}

/// Whether one write's memory is free again.
#[derive(Debug, Default)]
pub(crate) struct WriteDone {
    done: Mutex<bool>,
    cv: Condvar,
}

/// Holds the in-flight count of a write's regions until every op of the
/// write completed (or was dropped unposted); then marks the write done.
#[derive(Debug)]
pub(crate) struct WriteLease {
    regions: Vec<Arc<RegionEntry>>,
    done: Arc<WriteDone>,
}

impl WriteLease {
    /// Counts one write in flight on each of `regions` (distinct), or names
    /// the index in `regions` of one that is no longer registered.
    pub(crate) fn acquire(regions: Vec<Arc<RegionEntry>>) -> Result<Self, usize> {
        for (i, r) in regions.iter().enumerate() {
            let mut s = r.state.lock();
            if !s.registered {
                drop(s);
                for r in &regions[..i] {
                    r.state.lock().in_flight -= 1;
                }
                return Err(i);
            }
            s.in_flight += 1;
        }
        Ok(Self {
            regions,
            done: Arc::default(),
        })
    }

    /// The caller's view of this write.
    pub(crate) fn handle(&self) -> WriteHandle {
        WriteHandle {
            done: Arc::clone(&self.done),
        }
    }
}

impl Drop for WriteLease {
    fn drop(&mut self) {
        for r in &self.regions {
            r.state.lock().in_flight -= 1;
        }
        *self.done.done.lock() = true;
        self.done.cv.notify_all();
    }
}

/// Says when the memory of one [`Request::write`](super::Request::write)
/// may be reused: once [`is_done`](Self::is_done), the transport no longer
/// reads it (the write landed, failed, or was dropped because its request
/// ended). Whether the bytes landed is the request's
/// [`status`](super::Request::status).
#[derive(Debug, Clone)]
pub struct WriteHandle {
    done: Arc<WriteDone>,
}

impl WriteHandle {
    /// True once the write's memory may be reused; never blocks.
    pub fn is_done(&self) -> bool {
        *self.done.done.lock()
    }

    /// Waits until [`is_done`](Self::is_done) or `deadline`; returns
    /// whether it is done.
    pub fn wait(&self, deadline: Instant) -> bool {
        let mut d = self.done.done.lock();
        while !*d {
            if self.done.cv.wait_until(&mut d, deadline).timed_out() {
                return *d;
            }
        }
        true
    }
}
