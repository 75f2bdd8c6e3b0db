//! A non-blocking eventfd: the file descriptor an event loop polls for a
//! request's completion, on the sender (`sender::completion`) and the
//! receiver (`receiver::ready`) alike, and the RDMA poster's doorbell for
//! its sleeping CQ thread (`transport::rdma::peers`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A non-blocking, close-on-exec eventfd that becomes readable when signalled.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd with its counter at zero (not readable).
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter (readable from now on). A full counter
    /// (`EAGAIN`, after 2^64-2 signals nobody read) is already readable.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        let _ = unsafe {
            libc::write(
                self.0.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Resets the counter to zero (not readable) and returns what it held
    /// (0 if it was not signalled).
    pub fn clear(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd
        // we own; EAGAIN (counter at zero) leaves `v` at 0.
        let _ = unsafe {
            libc::read(
                self.0.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        v
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
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
}
