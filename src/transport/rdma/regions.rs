//! Memory regions over caller-registered host memory
//! ([`Sender::register`](crate::sender::Sender::register)): the
//! [`LocalRegistry`] of the rdma transport. Region `id` of a
//! [`WriteOp::local_region`](crate::transport::WriteOp::local_region) is
//! registered as its own MR (local read only), and the poster's work
//! requests for it carry that MR's lkey and the caller's address: the NIC
//! reads the caller's memory, kvferry copies nothing.

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};

use crate::staging::MAX_REGIONS;
use crate::transport::{LocalRegistry, TransportError};

use super::verbs::{Mr, Pd};

/// The MRs of the registered regions: `mrs[id - 1]` is region `id`'s.
pub(super) struct RegionMrs {
    pd: Arc<Pd>,
    mrs: RwLock<Vec<Option<Mr>>>,
}

impl std::fmt::Debug for RegionMrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.mrs.read().iter().flatten().count();
        f.debug_struct("RegionMrs").field("registered", &n).finish()
    }
}

/// A read view of the table for one `post` call (deregistration waits for
/// it, so no MR named by a plan goes away before its work requests are
/// posted).
pub(super) struct RegionView<'a>(RwLockReadGuard<'a, Vec<Option<Mr>>>);

impl RegionView<'_> {
    /// The MR of region `id` (not 0, the staging buffer).
    pub(super) fn get(&self, id: u32) -> Option<&Mr> {
        let i = (id as usize).checked_sub(1)?;
        self.0.get(i)?.as_ref()
    }
}

impl RegionMrs {
    pub(super) fn new(pd: Arc<Pd>) -> Self {
        Self {
            pd,
            mrs: RwLock::new(Vec::new()),
        }
    }

    /// The table, read-locked.
    pub(super) fn view(&self) -> RegionView<'_> {
        RegionView(self.mrs.read())
    }
}

impl LocalRegistry for RegionMrs {
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
        let mut mrs = self.mrs.write();
        if mrs.len() <= index {
            mrs.resize_with(index + 1, || None);
        }
        mrs[index] = Some(mr);
        tracing::debug!(region = id, len, "rdma memory region over caller memory");
        Ok(())
    }

    /// Drops (deregisters) region `id`'s MR: `ibv_dereg_mr` returns only
    /// once the NIC can no longer access the memory.
    fn deregister(&self, id: u32) {
        let mr = {
            let mut mrs = self.mrs.write();
            (id as usize)
                .checked_sub(1)
                .and_then(|i| mrs.get_mut(i))
                .and_then(Option::take)
        };
        if mr.is_some() {
            tracing::debug!(region = id, "rdma memory region deregistered");
        }
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
