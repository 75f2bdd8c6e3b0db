//! A non-blocking eventfd: the file descriptor an event loop polls for a
//! request's completion, on the sender (`sender::completion`) and the
//! receiver (`receiver::ready`) alike, and the RDMA poster's doorbell for
//! its sleeping CQ thread (`transport::rdma::peers`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// A non-blocking, close-on-exec eventfd that becomes readable when signalled.
///
/// It also keeps a flag, [`raised`](Self::raised), set by every
/// [`signal`](Self::signal) and reset by [`clear`](Self::clear), so the
/// thread that owns the fd can look for a signal without a syscall (the
/// attach sessions, busy or lingering, poll only now and then).
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
    raised: AtomicBool,
}

impl EventFd {
    /// A new eventfd with its counter at zero (not readable).
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            fd,
            raised: AtomicBool::new(false),
        })
    }

    /// Raises the flag, then adds one to the counter (readable from now
    /// on). A full counter (`EAGAIN`, after 2^64-2 signals nobody read) is
    /// already readable. Whatever the signaller wrote before this call is
    /// visible to a thread that then sees [`raised`](Self::raised) or
    /// clears the fd.
    pub fn signal(&self) {
        // Release: publishes the signaller's earlier writes (an outcome, a
        // queue entry) to whoever reads the flag with Acquire (`raised`,
        // the swap in `clear`).
        self.raised.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// True if [`signal`](Self::signal) was called since the last
    /// [`clear`](Self::clear) (or is under way: the fd may become readable
    /// a moment later). No syscall.
    pub fn raised(&self) -> bool {
        // Acquire: pairs with `signal`'s Release store, so the signaller's
        // earlier writes are visible once this reads true.
        self.raised.load(Ordering::Acquire)
    }

    /// Lowers the flag, then resets the counter to zero (not readable) and
    /// returns what it held (0 if it was not signalled). Call it before
    /// looking at what the signals announce: a signal after the look
    /// raises the flag and makes the fd readable anew.
    pub fn clear(&self) -> u64 {
        // AcqRel swap (not a plain store): a read-modify-write reads the
        // latest value, so every signal whose flag store it overwrites is
        // synchronized with (its writes are visible to the look that
        // follows); a later signal raises the flag again.
        self.raised.swap(false, Ordering::AcqRel);
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd
        // we own; EAGAIN (counter at zero) leaves `v` at 0.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        v
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_then_clear() {
        let fd = EventFd::new().unwrap();
        assert_eq!(fd.clear(), 0, "a new eventfd is not signalled");
        fd.signal();
        fd.signal();
        assert_eq!(fd.clear(), 2, "clear returns the signals it consumed");
        assert_eq!(fd.clear(), 0, "and leaves the counter at zero");
    }

    #[test]
    fn the_flag_follows_signal_and_clear() {
        let fd = EventFd::new().unwrap();
        assert!(!fd.raised(), "a new eventfd is not raised");
        fd.signal();
        assert!(fd.raised(), "a signal raises the flag");
        assert_eq!(fd.clear(), 1);
        assert!(!fd.raised(), "clear lowers it");
        fd.signal();
        assert!(fd.raised(), "the next signal raises it again");
    }
}
