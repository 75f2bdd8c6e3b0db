//! Staging shares ([`SenderConfig::staging_shares`](super::SenderConfig)):
//! the first slots of the staging buffer split into equal ranges, each its
//! own memfd and its own slot-allocator pool, handed to one owner at a time
//! (an attached prefill worker's session, `docs/attach.md`). Batches staged
//! with [`Request::try_stage_in`](super::Request::try_stage_in) take slots of
//! the share only, so a worker that maps only its share's memfd sees no
//! other worker's bytes.
//!
//! Revocation: a share is never writable by two holders. When a share that
//! was handed out before is taken again, it is renewed
//! ([`StagingBuffer::renew_share`](crate::staging::StagingBuffer::renew_share):
//! a fresh memfd mapped over its range), so the last holder's mapping — or
//! a forked child's — no longer reaches the pages the sender reads. Where
//! a transport pinned the buffer (RDMA) the pages cannot change: the share
//! is instead quarantined until its last holder process has exited
//! ([`StagingShare::set_holder`], a pidfd polled at hand-out), then zeroed.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use super::Shared;
use crate::eventfd::EventFd;
use crate::staging::ShareLayout;

/// Most shares one sender may have (each is a memfd, an eventfd and a pool).
pub const MAX_SHARES: usize = 1024;

/// Why [`Sender::take_share`](super::Sender::take_share) gave no share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShareError {
    /// The sender was configured without shares (`staging_shares == 0`).
    #[error("the sender has no staging shares (staging_shares = 0)")]
    NoShares,
    /// Every share is held.
    #[error("all {shares} staging shares are held")]
    AllHeld {
        /// Shares the sender has.
        shares: usize,
    },
    /// Shares are free but each still has slots in use by writes posted
    /// before its last owner left (they come back when those complete).
    #[error("the free staging shares still have writes in flight from their last owner")]
    Draining,
    /// Shares are free, but the buffer is pinned (RDMA) and each one's last
    /// holder process is still alive, so it could still write the pages.
    #[error("the free staging shares are quarantined: their last holders are still alive")]
    HolderAlive,
    /// Renewing the share (a fresh memfd) failed: out of memory or
    /// descriptors. The share stays free.
    #[error("renewing a staging share failed (out of memory or descriptors)")]
    Renew,
}

/// A free share: its index, whether it was ever handed out (a fresh share
/// is still zero and untouched: neither renewed nor zeroed), and for a
/// pinned buffer its last holder's pidfd (quarantine until it exits).
struct Free {
    index: usize,
    used: bool,
    holder: Option<OwnedFd>,
}

/// True once the process of `pidfd` has exited (a pidfd polls readable
/// then; its memory, mappings included, is gone before that).
fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents != 0
}

/// A pidfd for process `pid` (`pidfd_open`, Linux 5.3).
fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    if pid <= 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "no pid for the share's holder (another pid namespace?)",
        ));
    }
    // SAFETY: the syscall takes two integers and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The sender's shares: which are free (oldest returned first, so a share
/// is reused as late as possible) and each one's readiness eventfd.
pub(crate) struct ShareList {
    free: Mutex<VecDeque<Free>>,
    ready: Vec<Arc<EventFd>>,
}

impl ShareList {
    /// `n` free shares with one new eventfd each.
    pub(crate) fn new(n: usize) -> std::io::Result<Self> {
        Ok(Self {
            free: Mutex::new(
                (0..n)
                    .map(|index| Free {
                        index,
                        used: false,
                        holder: None,
                    })
                    .collect(),
            ),
            ready: (0..n)
                .map(|_| EventFd::new().map(Arc::new))
                .collect::<std::io::Result<_>>()?,
        })
    }

    /// Share `i`'s readiness eventfd (the slot pool's free signal).
    pub(crate) fn ready(&self, i: usize) -> Option<&Arc<EventFd>> {
        self.ready.get(i)
    }
}

/// One staging share, held by one owner until dropped (then it goes back
/// to the sender). See the module docs.
///
/// Its [`ready_fd`](Self::ready_fd) becomes readable when something a
/// [`try_stage_in`](super::Request::try_stage_in) of it waited for changed:
/// the request it found not admitted was admitted, or slots of the share
/// it found short were freed.
pub struct StagingShare {
    pub(crate) shared: Arc<Shared>,
    pub(crate) index: usize,
    layout: ShareLayout,
    file: Arc<File>,
    pub(crate) ready: Arc<EventFd>,
    /// The holder process, for a pinned buffer's quarantine.
    holder: Option<OwnedFd>,
}

impl std::fmt::Debug for StagingShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingShare")
            .field("index", &self.index)
            .field("layout", &self.layout)
            .finish()
    }
}

impl StagingShare {
    /// Takes a free share whose slots are all free (and, for a pinned
    /// buffer, whose last holder exited), revokes it from its last holder
    /// if it was handed out before (renewed, or zeroed where pinned: see
    /// the module docs) and clears its eventfd.
    pub(crate) fn take(shared: &Arc<Shared>) -> Result<Self, ShareError> {
        let staging = &shared.staging;
        let n = staging.shares();
        if n == 0 {
            return Err(ShareError::NoShares);
        }
        let pinned = staging.is_pinned();
        let mut free = shared.shares.free.lock();
        if free.is_empty() {
            return Err(ShareError::AllHeld { shares: n });
        }
        let drained = |f: &Free| shared.slots.in_use_in(f.index) == 0;
        let released = |f: &Free| !pinned || f.holder.as_ref().is_none_or(exited);
        let Some(pos) = free.iter().position(|f| drained(f) && released(f)) else {
            return Err(if free.iter().any(drained) {
                ShareError::HolderAlive
            } else {
                ShareError::Draining
            });
        };
        let Some(taken) = free.remove(pos) else {
            return Err(ShareError::Draining);
        };
        drop(free);
        let index = taken.index;
        let give_back = |taken: Free| shared.shares.free.lock().push_back(taken);
        let (Some(layout), Some(ready)) = (staging.share(index), shared.shares.ready(index)) else {
            // Cannot happen: shares and eventfds are made together.
            give_back(taken);
            return Err(ShareError::NoShares);
        };
        if taken.used && !pinned {
            // SAFETY: the share is held by nobody (just taken off the free
            // list), and only its holder allocates from its pool, which has
            // no slot in use (checked above): no batch owns these slots and
            // no write in flight reads them.
            if let Err(e) = unsafe { staging.renew_share(index) } {
                tracing::warn!(share = index, error = %e, "cannot renew a staging share");
                // Still `used`: the next take renews it again before any
                // hand-out (its range may be unmapped meanwhile).
                give_back(taken);
                return Err(ShareError::Renew);
            }
        } else if taken.used {
            // SAFETY: as above; and the last holder process has exited, so
            // nothing else maps the share's memfd writable (but a child it
            // forked: docs/attach.md, "Trust").
            unsafe { staging.zero_slots(layout.first_slot, layout.slots) };
        }
        let Some(file) = staging.share_file(index) else {
            give_back(taken);
            return Err(ShareError::NoShares);
        };
        ready.clear();
        Ok(Self {
            shared: Arc::clone(shared),
            index,
            layout,
            file,
            ready: Arc::clone(ready),
            holder: None,
        })
    }

    /// Names the process that maps the share (an attached worker, by its
    /// pid from `SO_PEERCRED`). Needed only where the staging buffer is
    /// pinned (RDMA): once given back the share is then not handed out
    /// again until that process has exited. Elsewhere a no-op (the share
    /// is renewed at the next hand-out instead). Errors: no pidfd for
    /// `pid` (pid 0, another pid namespace, an old kernel) on a pinned
    /// buffer — the caller must not hand the share out then.
    pub fn set_holder(&mut self, pid: i32) -> std::io::Result<()> {
        if self.shared.staging.is_pinned() {
            // A pid reused between the peer's connect and this call names
            // a process that has nothing to do with the share: the
            // quarantine then lasts longer than needed, never shorter
            // (the worker itself, having exited, maps nothing).
            self.holder = Some(pidfd_open(pid)?);
        }
        Ok(())
    }

    /// The share's memfd (exactly `slots * slot_bytes` long, sealed against
    /// resizing): the descriptor to pass to the holder. No path reaches it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The share's index (`0..staging_shares`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Where the share lives (first slot, slot count, slot size, offset).
    pub fn layout(&self) -> &ShareLayout {
        &self.layout
    }

    /// The readiness eventfd (see the type docs). Non-blocking; call
    /// [`clear_ready`](Self::clear_ready) before retrying.
    pub fn ready_fd(&self) -> BorrowedFd<'_> {
        self.ready.as_fd()
    }

    /// Resets the readiness eventfd (to call before the retries it woke).
    pub fn clear_ready(&self) {
        self.ready.clear();
    }
}

impl Drop for StagingShare {
    fn drop(&mut self) {
        let holder = self.holder.take();
        self.shared.shares.free.lock().push_back(Free {
            index: self.index,
            used: true,
            holder,
        });
    }
}
