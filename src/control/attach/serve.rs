//! What every attach session shares, whatever its role: the rings and the
//! hello with the client's descriptors, the completion ring with its
//! bounded outbox, and the poll loop (socket doorbell and lease, daemon
//! stop, the role's descriptors).

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::{self, Consumer, Producer};
use kvferry_ring::Plain;

use super::daemon::{AttachConfig, DaemonShared};
use super::fds::send_with_fds;
use super::layout::{Hello, ATTACH_VERSION, HELLO_FDS, NO_CPU, STATUS_OK};
use super::placement::StepOff;
use super::poll::{poll, readable};
use crate::eventfd::EventFd;
use crate::util::linger::{linger, sharing_cpu, slept, spin_for};

/// How long the loop sleeps between retries while a session has work it
/// cannot do yet and no descriptor to wait on: a full completion ring (the
/// client frees room without telling). Everything else — submissions,
/// request ends, a prefill STAGE waiting for admission or free slots of
/// its share — wakes the loop through a descriptor, so an idle session
/// sleeps in `poll` without a timeout.
pub(super) const RETRY: Duration = Duration::from_millis(1);

/// How often a busy session polls at the least. While submissions or the
/// role's signals keep coming it learns of them without a syscall (the
/// ring's indices, [`Serve::signalled`]); only the lease (the socket) and
/// the daemon's stop need `poll(2)`, and they can wait this long.
pub(super) const BUSY_POLL: Duration = Duration::from_micros(200);

/// The daemon's sides of a session's rings.
pub(super) struct Rings<S: Plain, E: Plain> {
    pub(super) sq: Consumer<S>,
    pub(super) cq: Completions<E>,
}

/// Creates client `id`'s two rings as anonymous memfds (no name any other
/// process could open), fills the ring fields of `hello` (the role fills
/// the rest) and writes it on `sock` with the descriptors attached
/// (`SCM_RIGHTS`: submission ring, completion ring, `data`); `sock` is then
/// made non-blocking. The daemon keeps only its mappings: its copies of the
/// ring descriptors are closed when this returns, so the rings' pages go
/// when both sides unmapped them (a dead client's with the session).
pub(super) fn open_rings<S: Plain, E: Plain, R>(
    shared: &DaemonShared<R>,
    id: u32,
    sock: &UnixStream,
    mut hello: Hello,
    data: BorrowedFd<'_>,
) -> io::Result<Rings<S, E>> {
    let cfg: &AttachConfig = &shared.cfg;
    let ring_err = |e: kvferry_ring::ShmError| io::Error::other(e.to_string());
    let sq_ring = spsc::shared::create_anonymous::<S>(c"kvferry-attach-sq", cfg.sq_capacity)
        .map_err(ring_err)?;
    let cq_ring = spsc::shared::create_anonymous::<E>(c"kvferry-attach-cq", cfg.cq_capacity)
        .map_err(ring_err)?;
    let (Some(sq_file), Some(cq_file)) = (sq_ring.file(), cq_ring.file()) else {
        return Err(io::Error::other("an anonymous ring without its memfd"));
    };
    let sq = sq_ring.consumer().map_err(ring_err)?;
    let cq = cq_ring.producer().map_err(ring_err)?;
    hello.version = ATTACH_VERSION;
    hello.status = STATUS_OK;
    hello.client_id = id;
    hello.sq_entry = std::mem::size_of::<S>() as u32;
    hello.cq_entry = std::mem::size_of::<E>() as u32;
    hello.sq_capacity = sq_ring.capacity() as u32;
    hello.cq_capacity = cq_ring.capacity() as u32;
    hello.max_outstanding = cfg.max_outstanding as u32;
    hello.fds = HELLO_FDS;
    hello.engine_cpu = cfg
        .engine_cpu
        .and_then(|c| u32::try_from(c).ok())
        .unwrap_or(NO_CPU);
    send_with_fds(
        sock,
        &hello.encode(),
        &[sq_file.as_fd(), cq_file.as_fd(), data],
    )?;
    sock.set_nonblocking(true)?;
    Ok(Rings {
        sq,
        cq: Completions {
            ring: cq,
            outbox: VecDeque::new(),
        },
    })
}

/// The completion ring and the single events waiting for room on it. The
/// outbox is bounded by its users: they read no submissions while it holds
/// `sq capacity + max_outstanding` events.
pub(super) struct Completions<E: Plain> {
    pub(super) ring: Producer<E>,
    pub(super) outbox: VecDeque<E>,
}

impl<E: Plain> Completions<E> {
    /// Posts `ev` after everything already waiting.
    pub(super) fn send(&mut self, ev: E) {
        if !self.outbox.is_empty() {
            self.outbox.push_back(ev);
        } else if let Err(ev) = self.ring.push(ev) {
            self.outbox.push_back(ev);
        }
    }

    /// Moves waiting events to the ring while it has room.
    pub(super) fn flush(&mut self) {
        while let Some(ev) = self.outbox.pop_front() {
            if let Err(ev) = self.ring.push(ev) {
                self.outbox.push_front(ev);
                return;
            }
        }
    }

    /// Submissions to read now: at most `batch`, fewer while the outbox is
    /// long (`batch + max_outstanding` at most).
    pub(super) fn room(&self, batch: usize, max_outstanding: usize) -> usize {
        (batch + max_outstanding)
            .saturating_sub(self.outbox.len())
            .min(batch)
    }
}

/// A role's session, driven by [`serve`].
pub(super) trait Serve {
    /// Appends the descriptors whose readability wakes the session; true
    /// if it also needs a wake-up after [`RETRY`].
    fn interest(&mut self, fds: &mut Vec<libc::pollfd>) -> bool;
    /// True if one of the role's descriptors of [`interest`](Self::interest)
    /// has been signalled since the session last cleared it, known without
    /// a syscall (`EventFd::raised`).
    fn signalled(&self) -> bool;
    /// Handles a wake-up: submissions, the role's signals, and `fds` (those
    /// of `interest`, with their `revents`, all 0 when the loop did not
    /// poll: the role reads its signals with [`woken`]).
    fn wake(&mut self, fds: &[libc::pollfd]);
    /// The client's submission ring.
    fn submissions(&self) -> &dyn Doorbell;
    /// True while the session holds work it put off so as to answer its
    /// client sooner (see [`idle`](Self::idle)).
    fn deferred(&self) -> bool {
        false
    }
    /// Does the put-off work. The loop calls it when the client has left
    /// the session nothing to answer for [`DEFER_WAIT`], and before it
    /// sleeps or waits for room.
    fn idle(&mut self) {}
}

/// How long the loop waits for the client's next submission before it
/// does put-off work ([`Serve::idle`]): longer than a client takes between
/// two submissions of one step (a RELEASE, then the next SUBSCRIBE: about
/// 0.1 µs), short against the moment a released slot matters to anyone.
pub(super) const DEFER_WAIT: Duration = Duration::from_micros(2);

/// True if the role's eventfd `fd`, polled as `polled` (`None`: not in
/// this round's poll set), was signalled since the session last cleared
/// it. Both are looked at: the flag covers a round that did not poll; the
/// revents cover a signal whose flag a `clear` lowered between that
/// signal's flag store and its counter write, which leaves the fd readable
/// with the flag down (clearing it then keeps `poll` from returning for it
/// again and again).
pub(super) fn woken(fd: &EventFd, polled: Option<&libc::pollfd>) -> bool {
    fd.raised() || polled.is_some_and(|p| p.revents != 0)
}

/// The session's side of the submission doorbell (docs/attach.md,
/// "Doorbell"): the ring's own need-wakeup flag, with the socket in place
/// of the futex.
pub(super) trait Doorbell {
    /// True if submissions wait on the ring.
    fn pending(&self) -> bool;
    /// Publishes need-wakeup and re-checks; true if the session may sleep.
    fn arm(&self) -> bool;
    /// Awake again: clients need not ring.
    fn disarm(&self);
}

impl<S: Plain> Doorbell for Consumer<S> {
    fn pending(&self) -> bool {
        !self.is_empty()
    }
    fn arm(&self) -> bool {
        self.arm_wakeup()
    }
    fn disarm(&self) {
        self.disarm_wakeup()
    }
}

/// SQPOLL-style: after handling work, watches the submission ring and the
/// role's signals for a moment ([`linger`]) before sleeping, so a client
/// submitting in a loop finds the session awake and need not ring, and a
/// request that ends meanwhile is handled at once. Within `poll_idle` of
/// `worked` (the last time the session found work; io_uring's
/// `sq_thread_idle`, [`AttachConfig::poll_idle`]) a linger that found
/// nothing is followed by another instead of a sleep. Returns true if the
/// loop goes round again without sleeping (work is waiting, or the session
/// keeps polling); false once the client was asked to ring (need-wakeup
/// armed).
fn linger_on(session: &impl Serve, worked: &mut Instant, poll_idle: Duration) -> bool {
    if linger(|| submitted(session)) {
        *worked = Instant::now();
        return true;
    }
    worked.elapsed() < poll_idle || !session.submissions().arm()
}

/// True if the session has work: submissions, or one of its role's signals.
fn submitted(session: &impl Serve) -> bool {
    session.submissions().pending() || session.signalled()
}

/// Serves `session` until its socket closes (the lease) or `shared` stops.
pub(super) fn serve<R>(shared: &DaemonShared<R>, mut sock: UnixStream, session: &mut impl Serve) {
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(shared.cfg.max_outstanding + 2);
    let mut polled_at = Instant::now();
    // The last time the session found work (or was woken): its poll idle
    // counts from here.
    let mut worked = polled_at;
    let mut step_off = StepOff::default();
    loop {
        fds.clear();
        fds.push(readable(sock.as_raw_fd()));
        fds.push(readable(shared.stop.as_fd().as_raw_fd()));
        let retry = session.interest(&mut fds);
        if session.deferred() && (retry || !spin_for(DEFER_WAIT, || submitted(session))) {
            session.idle();
        }
        // With submissions waiting the poll only collects the other
        // descriptors' state (the lease, stop, the role's); otherwise the
        // client rings the socket when it submits.
        // A session with work it cannot do yet (a full completion ring)
        // reads few or no submissions: it does not linger, and wakes after
        // RETRY whatever the client rings (the flag then only saves bytes).
        let timeout = if retry {
            session.submissions().arm();
            Some(RETRY)
        } else if linger_on(session, &mut worked, shared.cfg.poll_idle) {
            if sharing_cpu() {
                step_off.shared_spell(&shared.stepped_off);
            }
            Some(Duration::ZERO)
        } else {
            None
        };
        if timeout == Some(Duration::ZERO) && polled_at.elapsed() < BUSY_POLL {
            // Busy, and polled a moment ago: the work is known without
            // poll(2) (need-wakeup was not armed; the revents are 0).
            session.wake(&fds[2..]);
            continue;
        }
        let asleep = Instant::now();
        let polled = poll(&mut fds, timeout);
        polled_at = Instant::now();
        if timeout.is_none() {
            // The sleep after a failed linger: it adapts the next one.
            slept(polled_at - asleep);
            worked = polled_at;
        }
        session.submissions().disarm();
        if let Err(e) = polled {
            tracing::warn!(error = %e, "attach: poll failed; detaching the client");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents != 0 && !drain_doorbell(&mut sock) {
            tracing::debug!("client gone (socket closed)");
            return;
        }
        session.wake(&fds[2..]);
    }
}

/// Reads and discards doorbell bytes; false once the client is gone (EOF,
/// error, hang-up).
fn drain_doorbell(sock: &mut UnixStream) -> bool {
    let mut buf = [0u8; 64];
    for _ in 0..4 {
        match sock.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use super::*;

    /// A session with no submissions whose role was (or was not) signalled.
    struct Quiet {
        signalled: bool,
        armed: Cell<bool>,
        /// Times it was armed (a disarm does not lower this).
        arms: Cell<u32>,
    }

    impl Quiet {
        fn new(signalled: bool) -> Self {
            Self {
                signalled,
                armed: Cell::new(false),
                arms: Cell::new(0),
            }
        }
    }

    impl Doorbell for Quiet {
        fn pending(&self) -> bool {
            false
        }
        fn arm(&self) -> bool {
            self.armed.set(true);
            self.arms.set(self.arms.get() + 1);
            true
        }
        fn disarm(&self) {
            self.armed.set(false);
        }
    }

    impl Serve for Quiet {
        fn signalled(&self) -> bool {
            self.signalled
        }
        fn interest(&mut self, _: &mut Vec<libc::pollfd>) -> bool {
            false
        }
        fn wake(&mut self, _: &[libc::pollfd]) {}
        fn submissions(&self) -> &dyn Doorbell {
            self
        }
    }

    #[test]
    fn lingering_stops_at_a_role_signal_without_asking_the_client_to_ring() {
        let s = Quiet::new(true);
        let mut worked = Instant::now() - Duration::from_secs(1);
        assert!(
            linger_on(&s, &mut worked, Duration::ZERO),
            "a signalled role is work to do at once"
        );
        assert!(!s.armed.get(), "and need-wakeup stays unarmed");
        assert!(
            worked.elapsed() < Duration::from_secs(1),
            "work found: the idle starts anew"
        );
    }

    #[test]
    fn with_nothing_to_do_lingering_ends_by_arming_need_wakeup() {
        let s = Quiet::new(false);
        let mut worked = Instant::now();
        assert!(
            !linger_on(&s, &mut worked, Duration::ZERO),
            "nothing to do: the session may sleep"
        );
        assert!(s.armed.get(), "once the client was asked to ring");
    }

    #[test]
    fn a_polling_session_asks_no_ring_until_its_poll_idle_passed() {
        let s = Quiet::new(false);
        let idle = Duration::from_secs(3600);
        let mut worked = Instant::now();
        assert!(
            linger_on(&s, &mut worked, idle),
            "within its poll idle a session that found nothing polls on"
        );
        assert!(!s.armed.get(), "without asking the client to ring");
        // (A second ago, not an hour: the clock may have started since.)
        let mut worked = Instant::now() - Duration::from_secs(1);
        assert!(
            !linger_on(&s, &mut worked, Duration::from_millis(500)),
            "once the poll idle passed since the last work, it may sleep"
        );
        assert!(s.armed.get(), "and asked the client to ring first");
    }

    /// A session whose client never stops submitting: `pending` is always
    /// true, so the loop never sleeps and takes the busy path every round.
    struct Busy {
        wakes: Arc<AtomicUsize>,
    }

    impl Doorbell for Busy {
        fn pending(&self) -> bool {
            true
        }
        fn arm(&self) -> bool {
            false
        }
        fn disarm(&self) {}
    }

    impl Serve for Busy {
        fn signalled(&self) -> bool {
            false
        }
        fn interest(&mut self, _: &mut Vec<libc::pollfd>) -> bool {
            false
        }
        fn wake(&mut self, _: &[libc::pollfd]) {
            // Relaxed: a count the test only reads.
            self.wakes.fetch_add(1, Ordering::Relaxed);
        }
        fn submissions(&self) -> &dyn Doorbell {
            self
        }
    }

    const WAIT: Duration = Duration::from_secs(20);

    /// Serves a [`Busy`] session on one end of a socket pair in a thread;
    /// returns the shared state, the client's end, the wake count and a
    /// channel that hears when `serve` returned.
    fn busy() -> (
        Arc<DaemonShared<()>>,
        UnixStream,
        Arc<AtomicUsize>,
        mpsc::Receiver<()>,
    ) {
        let shared = Arc::new(DaemonShared {
            role: (),
            cfg: AttachConfig::new("/nonexistent/busy.sock"),
            stop: EventFd::new().unwrap(),
            live: AtomicUsize::new(0),
            stepped_off: std::sync::atomic::AtomicU64::new(0),
        });
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let wakes = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel();
        let (s, w) = (Arc::clone(&shared), Arc::clone(&wakes));
        std::thread::spawn(move || {
            serve(&s, ours, &mut Busy { wakes: w });
            let _ = tx.send(());
        });
        // Relaxed: a count.
        let end = Instant::now() + WAIT;
        while wakes.load(Ordering::Relaxed) < 1000 {
            assert!(Instant::now() < end, "the busy session never woke");
            std::thread::yield_now();
        }
        (shared, theirs, wakes, rx)
    }

    /// Serves a [`Quiet`] session with an hour of poll idle (it never
    /// sleeps in this test's time) in a thread; returns the shared state,
    /// the client's end and a channel that hears when `serve` returned,
    /// with whether the session ever asked its client to ring.
    fn polling() -> (Arc<DaemonShared<()>>, UnixStream, mpsc::Receiver<bool>) {
        let shared = Arc::new(DaemonShared {
            role: (),
            cfg: AttachConfig {
                poll_idle: Duration::from_secs(3600),
                ..AttachConfig::new("/nonexistent/polling.sock")
            },
            stop: EventFd::new().unwrap(),
            live: AtomicUsize::new(0),
            stepped_off: std::sync::atomic::AtomicU64::new(0),
        });
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let (tx, rx) = mpsc::channel();
        let s = Arc::clone(&shared);
        std::thread::spawn(move || {
            let mut quiet = Quiet::new(false);
            serve(&s, ours, &mut quiet);
            let _ = tx.send(quiet.arms.get() > 0);
        });
        // Long enough for a session that would sleep to be asleep.
        std::thread::sleep(Duration::from_millis(20));
        (shared, theirs, rx)
    }

    #[test]
    fn a_polling_session_still_sees_the_daemon_stop() {
        let (shared, _client, ended) = polling();
        shared.stop.signal();
        let armed = ended.recv_timeout(WAIT).expect(
            "a session polling through its idle did not see the stop (it must poll(2) every BUSY_POLL)",
        );
        assert!(
            !armed,
            "the session slept: it did not poll through its idle"
        );
    }

    #[test]
    fn a_polling_session_still_sees_its_client_leave() {
        let (_shared, client, ended) = polling();
        drop(client);
        let armed = ended
            .recv_timeout(WAIT)
            .expect("a session polling through its idle did not see its socket close (the lease)");
        assert!(
            !armed,
            "the session slept: it did not poll through its idle"
        );
    }

    #[test]
    fn a_session_kept_busy_still_sees_the_daemon_stop() {
        let (shared, _client, _, ended) = busy();
        shared.stop.signal();
        assert!(
            ended.recv_timeout(WAIT).is_ok(),
            "a session that is never idle did not see the stop (it must poll every BUSY_POLL)"
        );
    }

    #[test]
    fn a_session_kept_busy_still_sees_its_client_leave() {
        let (_shared, client, _, ended) = busy();
        drop(client);
        assert!(
            ended.recv_timeout(WAIT).is_ok(),
            "a session that is never idle did not see its socket close (the lease)"
        );
    }
}
