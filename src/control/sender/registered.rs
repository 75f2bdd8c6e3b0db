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
//!
//! On a transport that must know the memory first (rdma: a memory region
//! whose lkey the work requests carry, see
//! [`Poster::local_registry`](crate::transport::Poster::local_registry)),
//! registering registers it there too, and deregistering deregisters it
//! there once nothing is in flight.

use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::Shared;
use crate::transport::CompletionStatus;

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
    /// The transport could not register the memory (rdma: `ibv_reg_mr`
    /// failed, e.g. beyond the locked-memory limit `RLIMIT_MEMLOCK`);
    /// nothing was registered.
    #[error("the {transport} transport cannot register {len} bytes at {addr:#x}: {reason}")]
    Transport {
        /// The transport's name.
        transport: String,
        /// The address.
        addr: usize,
        /// The length.
        len: usize,
        /// What failed (the verbs call and its error).
        reason: String,
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
    /// Signalled when `in_flight` drops to 0 (for `retire_by`).
    idle: Condvar,
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
            idle: Condvar::new(),
        }
    }

    /// True if the region was registered with the sender of `shared`.
    pub(crate) fn belongs_to(&self, shared: &Arc<Shared>) -> bool {
        std::ptr::eq(self.owner.as_ptr(), Arc::as_ptr(shared))
    }

    /// Marks the region deregistered once nothing is in flight from it,
    /// waiting for that until `deadline` (`None`: not at all). Once marked,
    /// no new write can take it.
    pub(crate) fn retire_by(&self, deadline: Option<Instant>) -> Result<(), RegisterError> {
        let mut s = self.state.lock();
        if !s.registered {
            return Err(RegisterError::NotRegistered { id: self.id });
        }
        if let Some(deadline) = deadline {
            while s.in_flight > 0 && !self.idle.wait_until(&mut s, deadline).timed_out() {}
            if !s.registered {
                // Another caller deregistered it meanwhile.
                return Err(RegisterError::NotRegistered { id: self.id });
            }
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

/// Why a write from registered memory did not land (its
/// [`WriteHandle::outcome`]); the memory may be reused either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// The transport completed one of its writes with this status (rdma:
    /// the queue pair broke, e.g. the link went down or the receiver's
    /// queue pair was destroyed: `connection_lost`).
    #[error("the transport failed the write: {0}")]
    Failed(CompletionStatus),
    /// Some of its chunks were never written: its request ended (failed,
    /// cancelled, or the sender closed) before they were posted, or the
    /// transport refused them.
    #[error(
        "the write was not posted in full: its request ended first or the transport refused it"
    )]
    NotWritten,
}

/// Whether one write's memory is free again, and how it ended.
#[derive(Debug, Default)]
pub(crate) struct WriteDone {
    state: Mutex<DoneState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct DoneState {
    /// `Some` once the memory may be reused.
    outcome: Option<Result<(), WriteError>>,
}

/// Holds the in-flight count of a write's regions until every op of the
/// write completed (or was dropped unposted); then marks the write done
/// with its outcome.
#[derive(Debug)]
pub(crate) struct WriteLease {
    regions: Vec<Arc<RegionEntry>>,
    done: Arc<WriteDone>,
    progress: Mutex<Progress>,
}

/// What the ops of one write did so far.
#[derive(Debug, Default)]
struct Progress {
    /// Chunks handed to the transport (`None`: never posted).
    posted: Option<usize>,
    /// Chunks whose write completed `Ok`.
    landed: usize,
    /// The first failed completion's status.
    failed: Option<CompletionStatus>,
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
                    let mut s = r.state.lock();
                    s.in_flight -= 1;
                    if s.in_flight == 0 {
                        r.idle.notify_all();
                    }
                }
                return Err(i);
            }
            s.in_flight += 1;
        }
        Ok(Self {
            regions,
            done: Arc::default(),
            progress: Mutex::default(),
        })
    }

    /// The ctrl thread queued `chunks` chunks of this write for the
    /// transport (those the receiver did not already hold).
    pub(crate) fn posted(&self, chunks: usize) {
        *self.progress.lock().posted.get_or_insert(0) += chunks;
    }

    /// The completion of one op of this write, covering `chunks` chunks.
    pub(crate) fn record(&self, status: CompletionStatus, chunks: u32) {
        let mut p = self.progress.lock();
        if status == CompletionStatus::Ok {
            p.landed += chunks as usize;
        } else {
            p.failed.get_or_insert(status);
        }
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
        let p = self.progress.get_mut();
        let outcome = match (p.failed, p.posted) {
            (Some(status), _) => Err(WriteError::Failed(status)),
            // A write of no chunks names no region and has nothing to post.
            (None, _) if self.regions.is_empty() => Ok(()),
            (None, Some(posted)) if p.landed >= posted => Ok(()),
            (None, _) => Err(WriteError::NotWritten),
        };
        // The regions are released under the handle's lock (order: handle,
        // then region; nothing takes them the other way round), so whoever
        // sees the region idle (`deregister`) then sees the handle done,
        // and whoever sees the handle done sees the regions released.
        let mut d = self.done.state.lock();
        for r in &self.regions {
            let mut s = r.state.lock();
            s.in_flight -= 1;
            if s.in_flight == 0 {
                r.idle.notify_all();
            }
        }
        d.outcome = Some(outcome);
        drop(d);
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
        self.done.state.lock().outcome.is_some()
    }

    /// How the write ended, once [`is_done`](Self::is_done) (`None`
    /// before): `Ok` if every chunk it posted landed, else the typed
    /// [`WriteError`]. Never blocks.
    pub fn outcome(&self) -> Option<Result<(), WriteError>> {
        self.done.state.lock().outcome
    }

    /// Waits until [`is_done`](Self::is_done) or `deadline`; returns
    /// whether it is done.
    pub fn wait(&self, deadline: Instant) -> bool {
        let mut d = self.done.state.lock();
        while d.outcome.is_none() {
            if self.done.cv.wait_until(&mut d, deadline).timed_out() {
                return d.outcome.is_some();
            }
        }
        true
    }
}
