//! `poll(2)` on a few descriptors with a timeout, and the peer of a Unix
//! socket: the two syscalls the attach daemon needs beyond std.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Polls `fds` for `events` each; `None` waits without a timeout. Fills
/// `revents` and returns how many have events (0 on timeout or `EINTR`).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = timeout.map_or(-1, |d| {
        // Round up so a sub-millisecond timeout still sleeps.
        i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
    });
    // SAFETY: `fds` is a live, exclusively borrowed slice of pollfd for the
    // whole call, and its length is passed with it.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

/// A pollfd asking for readability of `fd`.
pub(crate) fn readable(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// The peer of an attach socket at `connect` time (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer {
    /// Its uid.
    pub(crate) uid: u32,
}

/// The process at the other end of `sock` (`SO_PEERCRED`).
pub(crate) fn peer(sock: &UnixStream) -> io::Result<Peer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals; the kernel writes at most
    // `len` bytes into `cred` and updates `len`.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Peer { uid: cred.uid })
}

/// This process's effective uid.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}
