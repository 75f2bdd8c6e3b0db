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
//! a forked child's, or that of any process it passed the descriptor to —
//! no longer reaches the pages the sender reads. A transport that
//! registered the share's pages with a device (RDMA: one memory region per
//! share) lets go of them first and registers the fresh ones after
//! ([`LocalRegistry::release_share`] / [`LocalRegistry::register_share`]),
//! so the device reads the fresh pages too.
//!
//! Why a renewal cannot pull pages from under a write: a share is renewed
//! only when none of its slots is in use (the `Draining` rule), and a slot
//! is freed only after the completion of the last write from it was
//! polled. On RDMA that completion means the NIC is done with the work
//! request (a signalled completion covers the unsignalled ones before it on
//! the queue pair; a flushed one comes after the NIC stopped), so no posted
//! work request names the share's memory region when it is deregistered,
//! and none can be posted meanwhile: only the share's holder stages from
//! it, and the share is off the free list, held by nobody, while renewed.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use super::Shared;
use crate::eventfd::EventFd;
use crate::staging::ShareLayout;
use crate::transport::LocalRegistry;

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
    /// Renewing the share (a fresh memfd) failed: out of memory or
    /// descriptors. The share stays free.
    #[error("renewing a staging share failed (out of memory or descriptors)")]
    Renew,
    /// The transport could not register the renewed share's pages (rdma:
    /// `ibv_reg_mr` failed, e.g. the locked-memory limit; the log says
    /// why). The share stays free and is renewed again at the next take.
    #[error("registering a renewed staging share with the transport failed (see the log; e.g. the locked-memory limit)")]
    Register,
}

/// A free share: its index and whether it was ever handed out (a fresh
/// share is still zero and untouched: not renewed).
struct Free {
    index: usize,
    used: bool,
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
            free: Mutex::new((0..n).map(|index| Free { index, used: false }).collect()),
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
/// it found short were freed; and, inside the crate, when a request made
/// to signal it ends (`Request::notify_end_on`).
pub struct StagingShare {
    pub(crate) shared: Arc<Shared>,
    pub(crate) index: usize,
    layout: ShareLayout,
    file: Arc<File>,
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
    /// Takes a free share whose slots are all free, revokes it from its
    /// last holder if it was handed out before (renewed, and re-registered
    /// with the transport's `registry` if it has one: see the module docs)
    /// and clears its eventfd.
    pub(crate) fn take(
        shared: &Arc<Shared>,
        registry: Option<&dyn LocalRegistry>,
    ) -> Result<Self, ShareError> {
        let staging = &shared.staging;
        let n = staging.shares();
        if n == 0 {
            return Err(ShareError::NoShares);
        }
        let mut free = shared.shares.free.lock();
        if free.is_empty() {
            return Err(ShareError::AllHeld { shares: n });
        }
        let Some(pos) = free
            .iter()
            .position(|f| shared.slots.in_use_in(f.index) == 0)
        else {
            return Err(ShareError::Draining);
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
        if taken.used {
            if let Err(e) = Self::renew(shared, registry, index) {
                // Still `used`: the next take renews it again before any
                // hand-out (its range may be unmapped, or unregistered,
                // meanwhile).
                give_back(taken);
                return Err(e);
            }
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
        })
    }

    /// Renews share `index` (held by nobody: just taken off the free list)
    /// between the transport's release of its pages and their registration
    /// again.
    fn renew(
        shared: &Shared,
        registry: Option<&dyn LocalRegistry>,
        index: usize,
    ) -> Result<(), ShareError> {
        let _span = tracing::debug_span!("renew_share", share = index).entered();
        // No write from the share is in flight (its pool has no slot in
        // use, checked by `take`), so no work request names its region.
        if let Some(r) = registry {
            r.release_share(index);
        }
        // SAFETY: the share is held by nobody, and only its holder
        // allocates from its pool, which has no slot in use: no batch owns
        // these slots and no write in flight reads them; the transport let
        // go of the old pages just above.
        if let Err(e) = unsafe { shared.staging.renew_share(index) } {
            tracing::warn!(share = index, error = %e, "cannot renew a staging share");
            return Err(ShareError::Renew);
        }
        if let Some(r) = registry {
            if let Err(e) = r.register_share(index) {
                tracing::warn!(share = index, error = %e, "cannot register a renewed staging share");
                return Err(ShareError::Register);
            }
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
        self.shared.shares.free.lock().push_back(Free {
            index: self.index,
            used: true,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileExt, MetadataExt};

    use super::*;
    use crate::protocol::Descriptor;
    use crate::sender::{Sender, SenderConfig};
    use crate::staging::StagingBuffer;
    use crate::transport::{
        PeerIndex, Poster, RemoteBuffer, Started, Transport, TransportError, WriteOp,
    };

    /// What the registry double saw: a share released or registered, with
    /// the inode of the share's memfd as mapped at that moment.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Seen {
        Released { share: usize, ino: u64 },
        Registered { share: usize, ino: u64 },
    }

    /// A registry that records what the sender asks of it, as a
    /// device-registering transport (rdma) would see it; `fail` makes the
    /// next `register_share` fail.
    #[derive(Default)]
    struct Double {
        staging: Mutex<Option<Arc<StagingBuffer>>>,
        seen: Mutex<Vec<Seen>>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Double {
        fn ino(&self, share: usize) -> u64 {
            let staging = self.staging.lock();
            let file = staging.as_ref().and_then(|s| s.share_file(share));
            file.map_or(0, |f| f.metadata().map_or(0, |m| m.ino()))
        }
        fn take_seen(&self) -> Vec<Seen> {
            std::mem::take(&mut self.seen.lock())
        }
    }

    impl LocalRegistry for Double {
        unsafe fn register(&self, _: u32, _: *const u8, _: u64) -> Result<(), TransportError> {
            Ok(())
        }
        fn deregister(&self, _: u32) {}
        fn release_share(&self, share: usize) {
            let ino = self.ino(share);
            self.seen.lock().push(Seen::Released { share, ino });
        }
        fn register_share(&self, share: usize) -> Result<(), TransportError> {
            // Relaxed: the flag is set and read by the test thread only.
            if self.fail.swap(false, std::sync::atomic::Ordering::Relaxed) {
                return Err(TransportError::Config("the double refuses".into()));
            }
            let ino = self.ino(share);
            self.seen.lock().push(Seen::Registered { share, ino });
            Ok(())
        }
    }

    /// The shm transport with [`Double`] as its poster's registry.
    struct Registering {
        inner: Box<dyn Transport>,
        registry: Arc<Double>,
    }

    struct RegisteringPoster {
        inner: Box<dyn Poster>,
        registry: Arc<Double>,
    }

    impl Transport for Registering {
        fn kind(&self) -> &'static str {
            self.inner.kind()
        }
        fn local_descriptor(&self) -> Descriptor {
            self.inner.local_descriptor()
        }
        fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
            *self.registry.staging.lock() = Some(Arc::clone(&local));
            let (inner, completions) = self.inner.start(local)?;
            let poster = RegisteringPoster {
                inner,
                registry: self.registry,
            };
            Ok((Box::new(poster), completions))
        }
    }

    impl Poster for RegisteringPoster {
        fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
            self.inner.connect(remote)
        }
        fn disconnect(&mut self, peer: PeerIndex) {
            self.inner.disconnect(peer)
        }
        fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
            self.inner.post(ops)
        }
        fn in_flight(&self) -> usize {
            self.inner.in_flight()
        }
        fn credits(&self) -> usize {
            self.inner.credits()
        }
        fn local_registry(&self) -> Option<Arc<dyn LocalRegistry>> {
            Some(self.registry.clone())
        }
    }

    fn sender(registry: &Arc<Double>) -> Sender {
        let cfg = SenderConfig {
            staging_slots: 4,
            chunk_bytes: 4096,
            staging_shares: 2,
            ..SenderConfig::default()
        };
        let inner = crate::transport::by_name(&cfg.transport, &cfg.transport_config).unwrap();
        let t = Registering {
            inner,
            registry: Arc::clone(registry),
        };
        Sender::with_transport(cfg, Box::new(t)).unwrap()
    }

    fn ino(f: &File) -> u64 {
        f.metadata().unwrap().ino()
    }

    #[test]
    fn a_used_share_handed_out_again_is_released_renewed_and_registered_again() {
        let reg = Arc::new(Double::default());
        let s = sender(&reg);
        let first = s.take_share().unwrap();
        let old = ino(first.file());
        assert!(reg.take_seen().is_empty(), "a fresh share is left as it is");
        first.file().write_all_at(&[0xAB; 16], 0).unwrap();
        let share = first.index();
        drop(first);
        // Oldest returned first: share 1 (never used) comes before share 0.
        let fresh = s.take_share().unwrap();
        assert_ne!(fresh.index(), share);
        assert!(reg.take_seen().is_empty(), "never used: nothing to renew");
        let again = s.take_share().unwrap();
        assert_eq!(again.index(), share);
        let new = ino(again.file());
        assert_ne!(new, old, "a fresh memfd for the next holder");
        // The device let go of the old pages before the renewal and was
        // given the new ones after it.
        assert_eq!(
            reg.take_seen(),
            vec![
                Seen::Released { share, ino: old },
                Seen::Registered { share, ino: new }
            ]
        );
        let mut b = [0xFF; 16];
        again.file().read_exact_at(&mut b, 0).unwrap();
        assert_eq!(
            b, [0; 16],
            "the next holder reads none of the last one's bytes"
        );
    }

    #[test]
    fn a_failed_registration_is_a_typed_error_and_the_share_stays_free() {
        let reg = Arc::new(Double::default());
        let s = sender(&reg);
        let (a, b) = (s.take_share().unwrap(), s.take_share().unwrap());
        let (share, old) = (a.index(), ino(a.file()));
        drop(a);
        reg.fail.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(s.take_share().unwrap_err(), ShareError::Register);
        assert_eq!(reg.take_seen(), vec![Seen::Released { share, ino: old }]);
        // Renewed, not registered: still free and still `used`, so the
        // next take renews and registers it again before the hand-out.
        let unregistered = reg.ino(share);
        assert_ne!(unregistered, old);
        let again = s.take_share().unwrap();
        assert_eq!(again.index(), share);
        let new = ino(again.file());
        assert_ne!(new, unregistered);
        assert_eq!(
            reg.take_seen(),
            vec![
                Seen::Released {
                    share,
                    ino: unregistered
                },
                Seen::Registered { share, ino: new }
            ]
        );
        drop(b);
    }
}
