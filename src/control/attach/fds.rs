//! Descriptors over the attach socket (`SCM_RIGHTS`): the daemon sends the
//! hello with the client's descriptors attached (docs/attach.md,
//! "Handshake"), the client receives exactly that many and closes any
//! extra one. Nothing an attachment needs has a name another process could
//! open.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Descriptors a hello carries at most (the client accepts up to this many
/// in its control buffer and closes every one past what the role expects).
pub(crate) const MAX_FDS: usize = 8;

/// Control-message buffer for [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 128]);

fn cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Writes all of `bytes` on `sock` (blocking), the first part in one
/// `sendmsg` carrying `fds` (none: a plain write; at most 28, what one
/// control buffer holds, else `InvalidInput`).
pub(crate) fn send_with_fds(
    sock: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let mut cbuf = CmsgBuf([0; 128]);
    if cmsg_space(fds.len()) > cbuf.0.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let space = cmsg_space(fds.len());
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` writable, aligned bytes, so
        // CMSG_FIRSTHDR returns a header inside them, and CMSG_DATA of it
        // has room for `fds.len()` descriptors (CMSG_SPACE above).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * std::mem::size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    let sent = loop {
        // SAFETY: `msg` points at `iov` (over `bytes`) and `cbuf`, both
        // alive for the call; the descriptors are open (borrowed).
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    io::Write::write_all(&mut &*sock, &bytes[sent..])
}

/// What [`recv_with_fds`] read.
pub(crate) struct Received {
    /// Bytes read into the buffer (all of it unless the peer closed first).
    pub(crate) len: usize,
    /// The descriptors that came with the bytes (close-on-exec), at most
    /// `want`: the others were closed.
    pub(crate) fds: Vec<OwnedFd>,
    /// Descriptors that came past `want` (closed), or that the kernel
    /// dropped because they did not fit (`MSG_CTRUNC`: counted as 1).
    pub(crate) extra: usize,
}

/// Fills `buf` from `sock` (blocking, the socket's read timeout applies),
/// keeping the descriptors attached to any part of it: at most `want`, the
/// rest closed at once.
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    want: usize,
) -> io::Result<Received> {
    let mut out = Received {
        len: 0,
        fds: Vec::with_capacity(want),
        extra: 0,
    };
    while out.len < buf.len() {
        let mut cbuf = CmsgBuf([0; 128]);
        let mut iov = libc::iovec {
            iov_base: buf[out.len..].as_mut_ptr().cast(),
            iov_len: buf.len() - out.len,
        };
        // SAFETY: an all-zero msghdr is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(MAX_FDS).min(cbuf.0.len()) as _;
        // SAFETY: `msg` points at `iov` (the unread tail of `buf`) and
        // `cbuf`, both alive and writable for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            out.extra += 1;
        }
        // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with
        // well-formed control messages; CMSG_FIRSTHDR/NXTHDR stay inside
        // them, and an SCM_RIGHTS payload is `cmsg_len - CMSG_LEN(0)` bytes
        // of descriptors now owned by this process.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    for i in 0..bytes / std::mem::size_of::<RawFd>() {
                        let fd = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                        if out.fds.len() < want {
                            out.fds.push(fd);
                        } else {
                            out.extra += 1; // dropped: closed
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 {
            break;
        }
        out.len += n as usize;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use super::*;
    use crate::attach::layout::{
        DecoderEvent, DecoderSubmit, Hello, HELLO_FDS, ROLE_DECODER, STATUS_OK,
    };
    use crate::attach::{AttachError, DecoderClient};

    /// A fake daemon on a fresh socket: accepts one client and sends an
    /// accepting hello with `fds` copies of a descriptor attached (split in
    /// two sends when `split`, the descriptors on the first).
    fn fake_daemon(fds: usize, split: bool) -> (std::path::PathBuf, std::thread::JoinHandle<()>) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        // Relaxed: a unique number.
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvferry-fds-{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut h = Hello::refusal(STATUS_OK);
            h.role = ROLE_DECODER;
            h.sq_entry = std::mem::size_of::<DecoderSubmit>() as u32;
            h.cq_entry = std::mem::size_of::<DecoderEvent>() as u32;
            h.fds = HELLO_FDS;
            let b = h.encode();
            let f = File::open("/dev/null").unwrap();
            let all: Vec<BorrowedFd<'_>> = (0..fds).map(|_| f.as_fd()).collect();
            let cut = if split { 100 } else { b.len() };
            send_with_fds(&s, &b[..cut], &all).unwrap();
            if split {
                send_with_fds(&s, &b[cut..], &[]).unwrap();
            }
            // Keep the socket until the client has read (it closes first).
            let _ = io::Read::read(&mut &s, &mut [0u8; 1]);
        });
        (path, t)
    }

    fn attach(fds: usize, split: bool) -> AttachError {
        let (path, t) = fake_daemon(fds, split);
        let e = DecoderClient::connect(&path, Duration::from_secs(10))
            .expect_err("no client from a wrong hand-off");
        t.join().unwrap();
        let _ = std::fs::remove_file(&path);
        e
    }

    #[test]
    fn a_hello_without_exactly_its_descriptors_is_a_typed_error() {
        for (fds, split, got, extra) in [
            (0, false, 0, 0),
            (2, false, 2, 0),
            (2, true, 2, 0),
            (4, false, 3, 1),
            (MAX_FDS + 4, true, 3, 9),
        ] {
            match attach(fds, split) {
                AttachError::Descriptors {
                    expected: HELLO_FDS,
                    got: g,
                    extra: x,
                } => assert!(
                    g == got && (x == extra || (fds > MAX_FDS && x > 0)),
                    "{fds} sent: got {g} + {x}"
                ),
                other => panic!("{fds} descriptors sent: {other}"),
            }
        }
    }

    #[test]
    fn descriptors_past_the_wanted_count_are_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        // The pipe's read end sees EOF only once every copy of its write
        // end is closed: ours, and the two received past the wanted one.
        let mut p = [0 as RawFd; 2];
        // SAFETY: pipe2 fills two descriptors, owned below.
        let made = unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(made, 0);
        // SAFETY: fresh descriptors nobody else owns.
        let (r, w) = unsafe { (File::from_raw_fd(p[0]), File::from_raw_fd(p[1])) };
        send_with_fds(&a, b"hello", &[f.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        drop(w);
        let mut buf = [0u8; 5];
        let got = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert_eq!((got.len, got.fds.len(), got.extra), (5, 1, 2));
        assert_eq!(&buf, b"hello");
        let n = io::Read::read(&mut &r, &mut [0u8; 1]);
        assert_eq!(n.ok(), Some(0), "EOF: the extra descriptors were closed");
    }
}
