//! The memory regions the sender's work requests read from: the
//! [`LocalRegistry`] of the rdma transport ([`LocalMrs`]).
//!
//! - **Staging: one MR per segment** of the staging buffer
//!   ([`StagingBuffer::segments`]: each staging share, then the remaining
//!   slots), registered when the transport starts. A share handed out
//!   again is renewed by the sender (a fresh memfd over its range, so a
//!   former holder's mapping — or a forked child's, or another process's
//!   that was passed the descriptor — no longer reaches the pages the
//!   sender reads): [`LocalRegistry::release_share`] deregisters the
//!   share's MR first (the NIC unpins the old pages and can no longer read
//!   them), [`LocalRegistry::register_share`] registers one over the fresh
//!   pages after. A write from a staging slot carries the lkey of its
//!   segment's MR.
//! - **Caller regions** ([`Sender::register`](crate::sender::Sender::register)):
//!   region `id` of a
//!   [`WriteOp::local_region`](crate::transport::WriteOp::local_region) is
//!   its own MR, and the work requests for it carry that MR's lkey and the
//!   caller's address: the NIC reads the caller's memory, kvferry copies
//!   nothing.
//!
//! Every MR has access 0 (local read only: the NIC reads it for RDMA
//! WRITEs). The poster reads the tables under the read lock for a whole
//! `post` ([`LocalMrs::view`]), so no MR a plan named goes away before its
//! work requests are posted.

use std::ops::Range;
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};

use crate::staging::{StagingBuffer, MAX_REGIONS};
use crate::transport::{LocalRegistry, TransportError};

use super::verbs::{Mr, Pd};

/// The MRs: staging segments and caller regions.
#[derive(Default)]
struct Tables {
    /// `staging[i]` is segment `i`'s MR (`None` while a share is renewed).
    staging: Vec<Option<Mr>>,
    /// `regions[id - 1]` is region `id`'s MR.
    regions: Vec<Option<Mr>>,
}

/// The transport's local memory regions (see the module docs).
pub(super) struct LocalMrs {
    pd: Arc<Pd>,
    staging: Arc<StagingBuffer>,
    /// The staging buffer's segments (fixed for its life), in order.
    segments: Vec<Range<u64>>,
    tables: RwLock<Tables>,
}

impl std::fmt::Debug for LocalMrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.tables.read();
        f.debug_struct("LocalMrs")
            .field("staging_segments", &t.staging.iter().flatten().count())
            .field("regions", &t.regions.iter().flatten().count())
            .finish()
    }
}

/// A read view of the tables for one `post` call (deregistration waits for
/// it, so no MR named by a plan goes away before its work requests are
/// posted).
pub(super) struct LocalView<'a> {
    mrs: &'a LocalMrs,
    tables: RwLockReadGuard<'a, Tables>,
}

/// Where one work request reads: the address and the lkey of its MR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Source {
    /// Start address of the bytes.
    pub(super) addr: u64,
    /// Local key of the MR holding them.
    pub(super) lkey: u32,
}

impl LocalView<'_> {
    /// Length of local memory `region`'s whole range for the plan's bounds
    /// check (0: the staging buffer; else a caller region with an MR).
    pub(super) fn len(&self, region: u32) -> Option<u64> {
        match region {
            0 => Some(self.mrs.staging.len()),
            id => self.region(id).map(|mr| mr.len),
        }
    }

    /// Where `len` bytes at `offset` of local memory `region` are read
    /// from: `None` if the range is not inside one registered MR (for
    /// staging: inside one segment whose MR is registered — a share being
    /// renewed has none, and has no op in flight either).
    pub(super) fn source(&self, region: u32, offset: u64, len: u64) -> Option<Source> {
        let end = offset.checked_add(len)?;
        let (mr, start) = if region == 0 {
            // The segment holding `offset`: the last one starting at or before it.
            let i = self
                .mrs
                .segments
                .partition_point(|s| s.start <= offset)
                .checked_sub(1)?;
            let seg = &self.mrs.segments[i];
            if end > seg.end {
                return None;
            }
            (self.tables.staging.get(i)?.as_ref()?, seg.start)
        } else {
            let mr = self.region(region)?;
            if end > mr.len {
                return None;
            }
            (mr, 0)
        };
        Some(Source {
            addr: mr.addr + (offset - start),
            lkey: mr.lkey(),
        })
    }

    fn region(&self, id: u32) -> Option<&Mr> {
        let i = (id as usize).checked_sub(1)?;
        self.tables.regions.get(i)?.as_ref()
    }
}

impl LocalMrs {
    /// Registers every segment of `staging` (one MR each) in `pd`.
    pub(super) fn new(pd: Arc<Pd>, staging: Arc<StagingBuffer>) -> Result<Self, TransportError> {
        let segments = staging.segments();
        let this = Self {
            pd,
            staging,
            tables: RwLock::new(Tables {
                staging: (0..segments.len()).map(|_| None).collect(),
                regions: Vec::new(),
            }),
            segments,
        };
        for i in 0..this.segments.len() {
            this.register_segment(i)?;
        }
        Ok(this)
    }

    /// The tables, read-locked.
    pub(super) fn view(&self) -> LocalView<'_> {
        LocalView {
            mrs: self,
            tables: self.tables.read(),
        }
    }

    /// Registers an MR over staging segment `i` as mapped now (replacing
    /// none: the caller released it first, or it never had one).
    fn register_segment(&self, i: usize) -> Result<(), TransportError> {
        let Some(seg) = self.segments.get(i) else {
            return Err(TransportError::Config(format!(
                "staging segment {i} out of range ({} segments)",
                self.segments.len()
            )));
        };
        let owner: Arc<dyn std::any::Any + Send + Sync> = self.staging.clone();
        let addr = self.staging.as_ptr().wrapping_add(seg.start as usize);
        // SAFETY: `seg` lies inside the staging buffer's reservation
        // (`segments()`), which stays mapped while `owner` (an Arc of the
        // buffer) lives, and the MR keeps `owner`. Access 0: the NIC only
        // reads it. A range a failed renewal left unmapped makes
        // `ibv_reg_mr` fail (EFAULT), never register foreign memory: the
        // reservation is the buffer's own.
        let mr = unsafe { Mr::register(self.pd.clone(), addr, seg.end - seg.start, 0, owner) }
            .map_err(with_memlock_hint)?;
        // `staging` has one entry per segment (made in `new`).
        let old = self
            .tables
            .write()
            .staging
            .get_mut(i)
            .and_then(|e| e.replace(mr));
        debug_assert!(old.is_none(), "segment {i} registered twice");
        Ok(())
    }
}

impl LocalRegistry for LocalMrs {
    /// Registers an MR over `start..start + len` with access 0 (the NIC
    /// only reads it, for RDMA WRITEs). `ibv_reg_mr` pins the pages, so a
    /// locked-memory limit (`RLIMIT_MEMLOCK`, `ulimit -l`) too small for
    /// them fails it: the error names the call, its errno and the limit.
    unsafe fn register(&self, id: u32, start: *const u8, len: u64) -> Result<(), TransportError> {
        let index = (id as usize)
            .checked_sub(1)
            .filter(|&i| i < MAX_REGIONS)
            .ok_or_else(|| TransportError::Config(format!("region id {id} out of range")))?;
        // SAFETY: the caller guarantees the memory stays allocated until
        // `deregister(id)`, which drops (deregisters) this MR; access 0
        // means the NIC never writes it. The MR owns nothing (`Arc<()>`):
        // the memory is the caller's.
        let mr = unsafe { Mr::register(self.pd.clone(), start.cast_mut(), len, 0, Arc::new(())) }
            .map_err(with_memlock_hint)?;
        let mut t = self.tables.write();
        if t.regions.len() <= index {
            t.regions.resize_with(index + 1, || None);
        }
        t.regions[index] = Some(mr);
        tracing::debug!(region = id, len, "rdma memory region over caller memory");
        Ok(())
    }

    /// Drops (deregisters) region `id`'s MR: `ibv_dereg_mr` returns only
    /// once the NIC can no longer access the memory.
    fn deregister(&self, id: u32) {
        let mr = {
            let mut t = self.tables.write();
            (id as usize)
                .checked_sub(1)
                .and_then(|i| t.regions.get_mut(i))
                .and_then(Option::take)
        };
        if mr.is_some() {
            tracing::debug!(region = id, "rdma memory region deregistered");
        }
    }

    /// Deregisters share `share`'s MR (outside the table lock, so posts
    /// for other segments wait only for the swap): when `ibv_dereg_mr`
    /// returns the NIC has unpinned the share's pages and cannot reach
    /// them. No work request names it (the caller's contract: no op from
    /// the share is in flight, and one is posted only from a slot the
    /// sender handed out).
    fn release_share(&self, share: usize) {
        if share >= self.staging.shares() {
            return;
        }
        let mr = self
            .tables
            .write()
            .staging
            .get_mut(share)
            .and_then(Option::take);
        if mr.is_some() {
            drop(mr);
            tracing::debug!(share, "rdma memory region of a staging share deregistered");
        }
    }

    /// Registers an MR over share `share`'s current (renewed) pages.
    fn register_share(&self, share: usize) -> Result<(), TransportError> {
        if share >= self.staging.shares() {
            return Err(TransportError::Config(format!(
                "no staging share {share} ({} shares)",
                self.staging.shares()
            )));
        }
        self.release_share(share);
        self.register_segment(share)?;
        tracing::debug!(share, "rdma memory region of a staging share registered");
        Ok(())
    }
}

/// Adds the locked-memory limit to an `ibv_reg_mr` failure (ENOMEM or
/// EPERM are what pinning beyond `RLIMIT_MEMLOCK` gives).
fn with_memlock_hint(e: TransportError) -> TransportError {
    let TransportError::Io(io) = &e else { return e };
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid `limit`.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0 {
        if limit.rlim_cur == libc::RLIM_INFINITY {
            "unlimited".to_owned()
        } else {
            format!("{} bytes", limit.rlim_cur)
        }
    } else {
        "unknown".to_owned()
    };
    TransportError::Io(std::io::Error::new(
        io.kind(),
        format!("{io}; the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) is {limit}"),
    ))
}
