//! Staging shares ([`SenderConfig::staging_shares`](super::SenderConfig)):
//! the first slots of the staging buffer split into equal ranges, each its
//! own memfd and its own slot-allocator pool, handed to one owner at a time
//! (an attached prefill worker's session, `docs/attach.md`). Batches staged
//! with [`Request::try_stage_in`](super::Request::try_stage_in) take slots of
//! the share only, so a worker that maps only its share's memfd sees no
//! other worker's bytes.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
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
}

/// The sender's shares: which are free (oldest returned first, so a share
/// is reused as late as possible; with whether it was ever handed out, so
/// a fresh, still zero and untouched share is not written at all) and each
/// one's readiness eventfd.
pub(crate) struct ShareList {
    free: Mutex<VecDeque<(usize, bool)>>,
    ready: Vec<Arc<EventFd>>,
}

impl ShareList {
    /// `n` free shares with one new eventfd each.
    pub(crate) fn new(n: usize) -> std::io::Result<Self> {
        Ok(Self {
            free: Mutex::new((0..n).map(|i| (i, false)).collect()),
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
    pub(crate) ready: Arc<EventFd>,
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
    /// Takes a free share whose slots are all free, zeroes it if it was
    /// handed out before (nothing of its last owner's chunks stays
    /// readable) and clears its eventfd.
    pub(crate) fn take(shared: &Arc<Shared>) -> Result<Self, ShareError> {
        let n = shared.staging.shares();
        if n == 0 {
            return Err(ShareError::NoShares);
        }
        let mut free = shared.shares.free.lock();
        if free.is_empty() {
            return Err(ShareError::AllHeld { shares: n });
        }
        let pos = free
            .iter()
            .position(|&(i, _)| shared.slots.in_use_in(i) == 0)
            .ok_or(ShareError::Draining)?;
        let Some((index, used)) = free.remove(pos) else {
            return Err(ShareError::Draining);
        };
        drop(free);
        let (Some(layout), Some(ready)) = (shared.staging.share(index), shared.shares.ready(index))
        else {
            // Cannot happen: shares and eventfds are made together.
            shared.shares.free.lock().push_back((index, used));
            return Err(ShareError::NoShares);
        };
        if used {
            // SAFETY: the share is held by nobody (just taken off the free
            // list), and only its holder allocates from its pool, which has
            // no slot in use (checked above): no batch owns these slots and
            // no write in flight reads them.
            unsafe { shared.staging.zero_slots(layout.first_slot, layout.slots) };
        }
        ready.clear();
        Ok(Self {
            shared: Arc::clone(shared),
            index,
            layout,
            ready: Arc::clone(ready),
        })
    }

    /// The share's index (`0..staging_shares`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Where the share lives (first slot, slot count, offset, the memfd's path).
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
        self.shared.shares.free.lock().push_back((self.index, true));
    }
}
