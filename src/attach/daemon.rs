//! The receiver side of decoder attach: a listening Unix socket, an accept
//! thread that checks each peer (uid, client bound) and starts one session
//! thread per client (`session.rs`).

use std::collections::HashSet;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::layout::{Hello, STATUS_INTERNAL, STATUS_TOO_MANY_CLIENTS, STATUS_WRONG_UID};
use super::poll::{own_uid, peer_uid, poll, readable};
use super::session::Session;
use crate::eventfd::EventFd;
use crate::receiver::Receiver;

/// Limits and paths of a [`DecoderDaemon`].
#[derive(Debug, Clone)]
pub struct AttachConfig {
    /// The Unix socket to bind; ring files go to `<socket>.d/`.
    pub socket: PathBuf,
    /// Live attachments at most (default 16).
    pub max_clients: usize,
    /// Subscriptions plus held requests per client at most (default 64).
    pub max_outstanding: usize,
    /// Submission ring entries (default 256, rounded up to a power of two).
    pub sq_capacity: usize,
    /// Completion ring entries (default 4096, a power of two); a request
    /// with more chunks than this minus one is refused.
    pub cq_capacity: usize,
}

impl AttachConfig {
    /// The defaults for `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            max_clients: 16,
            max_outstanding: 64,
            sq_capacity: 256,
            cq_capacity: 4096,
        }
    }

    /// The directory holding the ring files: `<socket>.d`.
    pub fn ring_dir(&self) -> PathBuf {
        let mut d = self.socket.as_os_str().to_owned();
        d.push(".d");
        PathBuf::from(d)
    }
}

/// State the accept thread and the sessions share.
pub(super) struct DaemonShared {
    pub(super) receiver: Arc<Receiver>,
    pub(super) cfg: AttachConfig,
    pub(super) dir: PathBuf,
    /// Set once by [`DecoderDaemon::drop`]; every thread polls it.
    pub(super) stop: EventFd,
    /// `req_id`s subscribed by any client (one subscriber per request),
    /// at most `max_clients * max_outstanding` entries.
    pub(super) subscribed: Mutex<HashSet<String>>,
    /// Live sessions.
    pub(super) live: AtomicUsize,
}

/// Serves attached decoder processes over a running [`Receiver`] (see
/// `docs/attach.md`). Dropping it stops accepting, ends every session
/// (releasing what their clients held) and removes the socket and ring
/// directory.
pub struct DecoderDaemon {
    shared: Arc<DaemonShared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DecoderDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecoderDaemon")
            .field("socket", &self.shared.cfg.socket)
            .field("clients", &self.clients())
            .finish()
    }
}

/// Removes a socket file nobody listens on (a previous daemon that died).
/// Anything else at `path` (a live socket, a regular file) is an error and
/// is left alone.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) if !m.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Ok(_) => {}
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} is served by a live daemon", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(path),
        Err(_) => Ok(()),
    }
}

impl DecoderDaemon {
    /// Binds `cfg.socket` (mode 0600), creates `<socket>.d/` (mode 0700) and
    /// starts the accept thread.
    pub fn start(receiver: Arc<Receiver>, cfg: AttachConfig) -> io::Result<Self> {
        if cfg.max_clients == 0 || cfg.max_outstanding == 0 || cfg.cq_capacity < 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "attach: max_clients, max_outstanding must be positive and cq_capacity at least 2",
            ));
        }
        remove_stale_socket(&cfg.socket)?;
        let dir = cfg.ring_dir();
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?
            }
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(&cfg.socket)?;
        // A peer connecting between bind and chmod is still checked by uid.
        fs::set_permissions(&cfg.socket, fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(DaemonShared {
            receiver,
            cfg,
            dir,
            stop: EventFd::new()?,
            subscribed: Mutex::new(HashSet::new()),
            live: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let accept =
            crate::threads::spawn_named("attach-accept", None, move || accept_loop(&s, &listener))?;
        Ok(Self {
            shared,
            accept: Some(accept),
        })
    }

    /// The socket clients connect to.
    pub fn socket(&self) -> &Path {
        &self.shared.cfg.socket
    }

    /// Requests subscribed (pending or held) over all clients.
    pub fn subscriptions(&self) -> usize {
        self.shared.subscribed.lock().len()
    }

    /// Live attachments.
    pub fn clients(&self) -> usize {
        // Relaxed: a statistic.
        self.shared.live.load(Ordering::Relaxed)
    }
}

impl Drop for DecoderDaemon {
    fn drop(&mut self) {
        self.shared.stop.signal();
        // Every thread polls the stop eventfd, so these joins end promptly.
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = fs::remove_file(&self.shared.cfg.socket);
        let _ = fs::remove_dir(&self.shared.dir);
    }
}

fn refuse(mut sock: UnixStream, status: u32) {
    if let Some(b) = Hello::refusal(status).encode() {
        let _ = sock.write_all(&b);
    }
}

fn accept_loop(shared: &Arc<DaemonShared>, listener: &UnixListener) {
    let mut sessions: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id: u32 = 0;
    loop {
        let mut fds = [
            readable(listener.as_raw_fd()),
            readable(shared.stop.as_fd().as_raw_fd()),
        ];
        if let Err(e) = poll(&mut fds, None) {
            tracing::warn!(error = %e, "attach: poll failed; accept loop ends");
            break;
        }
        if fds[1].revents != 0 {
            break;
        }
        sessions.retain(|t| !t.is_finished());
        // Bounded: at most a few accepts per wake-up, then poll again.
        for _ in 0..16 {
            let sock = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(error = %e, "attach: accept failed");
                    break;
                }
            };
            let _ = sock.set_nonblocking(false);
            let _ = sock.set_write_timeout(Some(Duration::from_secs(1)));
            match peer_uid(&sock) {
                Ok(uid) if uid == own_uid() => {}
                Ok(uid) => {
                    tracing::warn!(uid, "attach: refused a peer of another uid");
                    refuse(sock, STATUS_WRONG_UID);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "attach: SO_PEERCRED failed");
                    continue;
                }
            }
            // Relaxed: only this thread increments; sessions decrement.
            if shared.live.load(Ordering::Relaxed) >= shared.cfg.max_clients {
                refuse(sock, STATUS_TOO_MANY_CLIENTS);
                continue;
            }
            next_id = next_id.wrapping_add(1);
            let id = next_id;
            let session = match Session::open(Arc::clone(shared), id, &sock) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(client = id, error = %e, "attach: cannot set up rings");
                    refuse(sock, STATUS_INTERNAL);
                    continue;
                }
            };
            shared.live.fetch_add(1, Ordering::Relaxed);
            let s = Arc::clone(shared);
            match crate::threads::spawn_named(&format!("attach-{id}"), None, move || {
                session.run(sock);
                // Relaxed: a count; the session's effects are ordered by
                // the receiver's own locks.
                s.live.fetch_sub(1, Ordering::Relaxed);
            }) {
                Ok(t) => sessions.push(t),
                Err(e) => {
                    // The closure (and the session with it) was dropped.
                    shared.live.fetch_sub(1, Ordering::Relaxed);
                    tracing::warn!(client = id, error = %e, "attach: cannot spawn a session");
                }
            }
        }
    }
    for t in sessions {
        let _ = t.join();
    }
}
