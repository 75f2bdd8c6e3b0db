//! The daemon side of attach, for every role: a listening Unix socket, an
//! accept thread that checks each peer (uid, client bound) and starts one
//! session thread per client (the role's: `session.rs` for decoders,
//! `prefill.rs` for prefill workers).

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::layout::{Hello, STATUS_INTERNAL, STATUS_TOO_MANY_CLIENTS, STATUS_WRONG_UID};
use super::poll::{own_uid, peer, poll, readable, Peer};
use super::serve::{serve, Serve};
use crate::eventfd::EventFd;
use crate::util::socket_file::SocketFile;

/// Limits and paths of an attach daemon ([`DecoderDaemon`](super::DecoderDaemon),
/// [`PrefillDaemon`](super::PrefillDaemon)).
#[derive(Debug, Clone)]
pub struct AttachConfig {
    /// The Unix socket to bind.
    pub socket: PathBuf,
    /// Keep the process dumpable (default false). Starting a daemon makes
    /// the whole process non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`), so no
    /// other process of its user can open `/proc/<pid>/fd/*` (each
    /// worker's staging share, every client's rings), read its memory or
    /// ptrace it; the cost is no core dumps and no debugger attach without
    /// root. True keeps both, for debugging, and gives that isolation up.
    pub keep_dumpable: bool,
    /// Live attachments at most (default 16).
    pub max_clients: usize,
    /// Per client at most (default 64): subscriptions plus held requests
    /// (decoder); requests, and staged batches (prefill).
    pub max_outstanding: usize,
    /// Submission ring entries (default 256, rounded up to a power of two).
    pub sq_capacity: usize,
    /// Completion ring entries (default 4096, a power of two); a request
    /// with more chunks than this minus one is refused.
    pub cq_capacity: usize,
    /// How long a session keeps polling its client's ring after its last
    /// work before it sleeps (default zero: only the adaptive linger of
    /// 50–250 µs). io_uring's `sq_thread_idle`: a client that submits
    /// within this of the session's last work finds it awake and never
    /// pays a doorbell wake-up (tens of µs on a VM), at the cost of a CPU
    /// the session keeps busy yielding (`sched_yield` between checks, so
    /// other threads on that CPU still run) for up to this long after each
    /// burst. An idle session still sleeps once it has passed. The lease
    /// and the daemon's stop are seen within 200 µs meanwhile, as for a
    /// busy session. docs/attach.md, "Polling sessions".
    pub poll_idle: Duration,
    /// The CPU this daemon keeps for a copy engine (default none): its own
    /// engine's (`--copy-cpu`) or, for a receiver, the one it leaves to a
    /// sender's engine on its host (`--spare-cpu`). The hello names it,
    /// and the clients keep the thread that attaches off it, unless that
    /// thread may run on no other CPU or `KVFERRY_ATTACH_KEEP_AFFINITY`
    /// is set (docs/attach.md, "Placing the threads"). The library's
    /// daemons place nothing themselves: set it where the process pins its
    /// engine (`TransportConfig::pin_cpu`).
    pub engine_cpu: Option<usize>,
}

impl AttachConfig {
    /// The defaults for `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            keep_dumpable: false,
            max_clients: 16,
            max_outstanding: 64,
            sq_capacity: 256,
            cq_capacity: 4096,
            poll_idle: Duration::ZERO,
            engine_cpu: None,
        }
    }
}

/// The error a [`Role::open`] returns to refuse the client with a hello
/// `status` of its own (any other error refuses with `STATUS_INTERNAL`).
#[derive(Debug, thiserror::Error)]
#[error("attach refused with status {0}")]
pub(super) struct OpenRefused(pub(super) u32);

/// What a role adds to the daemon: its state and its session.
pub(super) trait Role: Send + Sync + Sized + 'static {
    /// The role's name in logs and spans (`decoder`, `prefill`).
    const NAME: &'static str;
    /// One client's session: served by [`serve`] until the client leaves
    /// or the daemon stops; dropping it gives back everything it held.
    type Session: Serve + Send + 'static;
    /// Sets client `id` (the process `peer`) up: rings, hello and
    /// descriptors on `sock`.
    fn open(
        shared: &Arc<DaemonShared<Self>>,
        id: u32,
        peer: Peer,
        sock: &UnixStream,
    ) -> io::Result<Self::Session>;
}

/// State the accept thread and the sessions share.
pub(super) struct DaemonShared<R> {
    pub(super) role: R,
    pub(super) cfg: AttachConfig,
    /// Set once by [`Daemon::drop`]; every thread polls it.
    pub(super) stop: EventFd,
    /// Live sessions.
    pub(super) live: AtomicUsize,
    /// Times a session moved off its client's CPU (`placement.rs`).
    pub(super) stepped_off: AtomicU64,
}

/// A running attach daemon of role `R`. Dropping it stops accepting, ends
/// every session (giving back what their clients held) and removes the
/// socket.
pub(super) struct Daemon<R: Role> {
    pub(super) shared: Arc<DaemonShared<R>>,
    accept: Option<JoinHandle<()>>,
    /// The socket's file: removed when this is dropped, after `Drop`
    /// joined the accept thread (which owns the listener).
    _file: SocketFile,
}

impl<R: Role> std::fmt::Debug for Daemon<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachDaemon")
            .field("socket", &self.shared.cfg.socket)
            .field("clients", &self.clients())
            .finish()
    }
}

impl<R: Role> Daemon<R> {
    /// Makes the process non-dumpable (unless `cfg.keep_dumpable`), binds
    /// `cfg.socket` (mode 0600) and starts the accept thread.
    pub(super) fn start(role: R, cfg: AttachConfig) -> io::Result<Self> {
        if cfg.max_clients == 0 || cfg.max_outstanding == 0 || cfg.cq_capacity < 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "attach: max_clients, max_outstanding must be positive and cq_capacity at least 2",
            ));
        }
        if !cfg.keep_dumpable {
            non_dumpable()?;
        }
        // Measured now, before any client keeps a CPU of the daemon busy.
        crate::util::linger::gave_away_after();
        let claim = SocketFile::claim(&cfg.socket)?;
        let listener = UnixListener::bind(&cfg.socket)?;
        let file = claim.bound();
        // A peer connecting between bind and chmod is still checked by uid.
        fs::set_permissions(&cfg.socket, fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(DaemonShared {
            role,
            cfg,
            stop: EventFd::new()?,
            live: AtomicUsize::new(0),
            stepped_off: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let accept =
            crate::threads::spawn_named("attach-accept", None, move || accept_loop(&s, &listener))?;
        Ok(Self {
            shared,
            accept: Some(accept),
            _file: file,
        })
    }

    /// The socket clients connect to.
    pub(super) fn socket(&self) -> &Path {
        &self.shared.cfg.socket
    }

    /// Live attachments.
    pub(super) fn clients(&self) -> usize {
        // Relaxed: a statistic.
        self.shared.live.load(Ordering::Relaxed)
    }

    /// Times a session moved off its client's CPU.
    pub(super) fn stepped_off(&self) -> u64 {
        // Relaxed: a statistic.
        self.shared.stepped_off.load(Ordering::Relaxed)
    }
}

impl<R: Role> Drop for Daemon<R> {
    fn drop(&mut self) {
        self.shared.stop.signal();
        // Every thread polls the stop eventfd, so these joins end promptly;
        // the accept thread joins the sessions (one shared deadline) first.
        if let Some(t) = self.accept.take() {
            let _ = crate::threads::join_within(
                t,
                crate::threads::STOP_JOIN_DEADLINE * 2,
                "attach accept",
            );
        }
    }
}

/// `prctl(PR_SET_DUMPABLE, 0)`: from now on `/proc/<pid>/{fd,mem,maps,...}`
/// of this process are open to root only, no process of the same user can
/// ptrace it, and it dumps no core. Undone only by an `execve`.
fn non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One attachment counted in [`DaemonShared::live`] (against
/// `max_clients`) for as long as it lives: counted when taken, given back
/// when dropped, whichever way its session ends (a panic in it included)
/// or if it never starts.
struct Place<R>(Arc<DaemonShared<R>>);

impl<R> Place<R> {
    fn take(shared: &Arc<DaemonShared<R>>) -> Self {
        // Relaxed: a count; only the accept thread raises it, and what a
        // session did is ordered by the engine's own locks, not by it.
        shared.live.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(shared))
    }
}

impl<R> Drop for Place<R> {
    fn drop(&mut self) {
        // Relaxed: as in `take`.
        self.0.live.fetch_sub(1, Ordering::Relaxed);
    }
}

fn refuse(mut sock: UnixStream, status: u32) {
    let _ = sock.write_all(&Hello::refusal(status).encode());
}

fn accept_loop<R: Role>(shared: &Arc<DaemonShared<R>>, listener: &UnixListener) {
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
            let peer = match peer(&sock) {
                Ok(p) if p.uid == own_uid() => p,
                Ok(Peer { uid, .. }) => {
                    tracing::warn!(uid, "attach: refused a peer of another uid");
                    refuse(sock, STATUS_WRONG_UID);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "attach: SO_PEERCRED failed");
                    continue;
                }
            };
            // Relaxed: only this thread increments; sessions decrement.
            if shared.live.load(Ordering::Relaxed) >= shared.cfg.max_clients {
                refuse(sock, STATUS_TOO_MANY_CLIENTS);
                continue;
            }
            next_id = next_id.wrapping_add(1);
            let id = next_id;
            // Counted before `open`, which answers the client's hello: a
            // client told it is attached is always among `clients()` (a
            // count taken after the hello could read 0 for a client that
            // already attached and detached).
            let place = Place::take(shared);
            let session = match R::open(shared, id, peer, &sock) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(client = id, error = %e, "attach: cannot set up the client");
                    let status = e.get_ref().and_then(|e| e.downcast_ref::<OpenRefused>());
                    refuse(sock, status.map_or(STATUS_INTERNAL, |r| r.0));
                    continue;
                }
            };
            let s = Arc::clone(shared);
            match crate::threads::spawn_named(&format!("attach-{id}"), None, move || {
                // Dropped last: the place is given back once the session
                // has given back what its client held, however it ends.
                let _place = place;
                let mut session = session;
                let span = tracing::debug_span!("attach_session", role = R::NAME, client = id);
                let _enter = span.enter();
                tracing::debug!("attached");
                serve(&s, sock, &mut session);
                drop(session); // gives back what the client held
            }) {
                Ok(t) => sessions.push(t),
                Err(e) => {
                    // The closure was dropped, and the session and its
                    // place with it.
                    tracing::warn!(client = id, error = %e, "attach: cannot spawn a session");
                }
            }
        }
    }
    let end = std::time::Instant::now() + crate::threads::STOP_JOIN_DEADLINE;
    for t in sessions {
        let left = end.saturating_duration_since(std::time::Instant::now());
        let _ = crate::threads::join_within(t, left, "attach session");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session that panics (a bug) still gives its place back: a daemon
    /// at `max_clients` would otherwise refuse every client from then on.
    #[test]
    fn a_place_is_given_back_when_its_session_panics_or_never_starts() {
        let shared = Arc::new(DaemonShared {
            role: (),
            cfg: AttachConfig::new("/nonexistent/place.sock"),
            stop: EventFd::new().unwrap(),
            live: AtomicUsize::new(0),
            stepped_off: AtomicU64::new(0),
        });
        // Relaxed (all): a count, read after the thread was joined.
        let place = Place::take(&shared);
        assert_eq!(shared.live.load(Ordering::Relaxed), 1);
        let session = std::thread::spawn(move || {
            let _place = place;
            panic!("a session's bug");
        });
        assert!(session.join().is_err(), "the session panicked");
        assert_eq!(
            shared.live.load(Ordering::Relaxed),
            0,
            "the panicked session's place was not given back"
        );
        drop(Place::take(&shared));
        assert_eq!(shared.live.load(Ordering::Relaxed), 0);
    }
}
