//! ZeroMQ plumbing shared by the control threads: one process-wide context,
//! and a mio-based wait on a socket's `ZMQ_FD` plus a cross-thread waker.
//!
//! `ZMQ_FD` is edge-like: it signals when the socket's event state *changes*,
//! not while messages are pending. The loop that owns the socket must
//! therefore drain it until `ZMQ_EVENTS` shows no `POLLIN`, and re-check
//! `ZMQ_EVENTS` after every send, before it sleeps in [`Reactor::wait`](crate::zmq_io::Reactor::wait).
//! With that discipline no message is left unnoticed, and an idle thread
//! sleeps in `epoll_wait` using no CPU.

use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::util::socket_file::SocketFile;

/// The process-wide ZMQ context (one I/O thread), shared by every socket
/// kvferry opens so an in-process xPyD run does not start a context per role.
pub fn context() -> zmq::Context {
    static CTX: OnceLock<zmq::Context> = OnceLock::new();
    CTX.get_or_init(zmq::Context::new).clone()
}

/// `ZMQ_HANDSHAKE_IVL` of every bound socket that peers connect to (the
/// receiver's ROUTER, the proxy's PULL): a connection that has not
/// completed its ZMTP greeting within this is closed. libzmq's default is
/// 30 s, which let idle raw connections hold the process's descriptors
/// that long (docs/security.md); a real ZMQ peer greets in microseconds.
pub const HANDSHAKE_TIMEOUT_MS: i32 = 3_000;

/// Token of the waker in [`Reactor`] events.
pub const WAKE_TOKEN: Token = Token(usize::MAX);

/// An epoll set over ZMQ sockets' FDs and a [`Waker`].
#[derive(Debug)]
pub struct Reactor {
    poll: Poll,
    events: Events,
    waker: Arc<Waker>,
}

impl Reactor {
    /// A reactor with its waker registered.
    pub fn new() -> io::Result<Self> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKE_TOKEN)?);
        Ok(Self {
            poll,
            events: Events::with_capacity(16),
            waker,
        })
    }

    /// A handle other threads use to interrupt [`Reactor::wait`].
    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }

    /// Watches a ZMQ socket's notification FD under `token`.
    pub fn register(&self, sock: &zmq::Socket, token: usize) -> io::Result<()> {
        let fd: RawFd = sock.get_fd().map_err(io::Error::from)?;
        self.poll
            .registry()
            .register(&mut SourceFd(&fd), Token(token), Interest::READABLE)
    }

    /// Stops watching a socket (before it is closed).
    pub fn deregister(&self, sock: &zmq::Socket) -> io::Result<()> {
        let fd: RawFd = sock.get_fd().map_err(io::Error::from)?;
        self.poll.registry().deregister(&mut SourceFd(&fd))
    }

    /// Sleeps until a watched FD signals, the waker fires, or `timeout`
    /// passes (`None`: no timeout). Interrupted sleeps return early.
    pub fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// An endpoint [`bind`] bound.
#[derive(Debug)]
pub(crate) struct Bound {
    /// As bound: with the actual port when `:0` was asked for.
    pub(crate) endpoint: String,
    /// The file of an `ipc://` endpoint, removed when dropped: keep it
    /// until the socket is closed.
    pub(crate) file: Option<SocketFile>,
}

/// Why [`bind`] failed.
#[derive(Debug)]
pub(crate) enum BindError {
    /// An `ipc://` endpoint's path is taken ([`SocketFile::claim`]).
    SocketFile(io::Error),
    /// ZMQ refused the bind.
    Zmq(zmq::Error),
}

/// Binds `sock` to `endpoint`, the path of an `ipc://` one claimed first
/// ([`SocketFile::claim_endpoint`]): libzmq would unlink whatever is
/// there, a live daemon's socket or a file that is no socket at all.
pub(crate) fn bind(sock: &zmq::Socket, endpoint: &str) -> Result<Bound, BindError> {
    let claim = SocketFile::claim_endpoint(endpoint).map_err(BindError::SocketFile)?;
    sock.bind(endpoint).map_err(BindError::Zmq)?;
    let bound = match sock.get_last_endpoint() {
        Ok(Ok(e)) => e,
        _ => endpoint.to_owned(),
    };
    Ok(Bound {
        endpoint: bound,
        file: claim.map(|c| c.bound()),
    })
}

/// True if `sock` has a message ready to receive.
pub fn readable(sock: &zmq::Socket) -> bool {
    sock.get_events()
        .map(|e| e.contains(zmq::POLLIN))
        .unwrap_or(false)
}
