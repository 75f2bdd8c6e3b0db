//! The receiver's TCP data plane: one thread (`kvf-recv-tcp`) accepts data
//! connections from senders and serves them with mio, landing each framed
//! write in the receive buffer and acking it (wire format in
//! [`crate::transport::tcp::wire`]). Idle, it sleeps in `epoll_wait`.
//!
//! Every peer is untrusted:
//!
//! - **Authentication.** A connection's preamble must carry a secret the
//!   receiver issued in a `HelloAck` ([`super::grants::DataKeys`]); it then
//!   acts for that sender's token. Anything else is answered
//!   `PREAMBLE_UNAUTHENTICATED` and closed.
//! - **Grants.** A write must lie inside the slot area and every slot it
//!   touches (`[i * chunk_bytes, (i + 1) * chunk_bytes)`, a run of slots for
//!   a coalesced write) must be granted to the connection's token and not
//!   yet complete ([`super::grants::GrantTable`]); the grant is checked again
//!   around every `read` into a slot, so a slot freed mid-write stops the
//!   write. A rejected write is answered with `OutOfBounds` and the
//!   connection is closed (the sender's other writes on it fail with
//!   `ConnectionLost`).
//! - **Budgets.** At most [`TcpDataLimits::max_unauthenticated`] connections
//!   may be *not serving a sender* — waiting for their preamble, or refused
//!   and saying goodbye; a newcomer evicts the oldest refused one, else the
//!   oldest waiting one, so a flood of idle or refused connections never
//!   locks a sender out. Anyone may say `Hello` and get a secret, so
//!   authenticated connections are not trusted ones either: they may fill
//!   the listener only up to the cap minus the unauthenticated budget (room
//!   is always left for a newcomer to present its secret), and one that
//!   authenticates beyond that displaces the longest-idle authenticated
//!   connection (no write under way; its sender reconnects at its next
//!   write), else is closed itself. A token may hold
//!   [`TcpDataLimits::max_per_sender`] connections (a newer one closes its
//!   oldest), and the listener holds at most
//!   [`TcpDataLimits::max_connections`], never more than half of
//!   `RLIMIT_NOFILE`, so the control plane and metrics keep descriptors.
//! - **Deadlines.** The preamble must arrive within
//!   [`TcpDataLimits::auth_timeout`]; once a write has started (a header
//!   byte arrived), it must be complete within
//!   [`TcpDataLimits::io_timeout`] plus its length at
//!   [`TcpDataLimits::min_rate`]; a rejected connection's goodbye is bounded
//!   by the auth timeout too. An authenticated connection between writes
//!   has no deadline (a sender keeps one per receiver).
//!
//! Payload bytes are read from the socket straight into the slot.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use crate::transport::tcp::wire::{
    encode_preamble_ack, Ack, Header, Preamble, HEADER_LEN, PREAMBLE_BAD_GEOMETRY,
    PREAMBLE_BAD_VERSION, PREAMBLE_LEN, PREAMBLE_OK, PREAMBLE_UNAUTHENTICATED, VERSION,
};
use crate::transport::CompletionStatus;

use super::grants::{EndWrite, GrantTable, Token as PeerToken};
use super::Shared;

/// Default of [`TcpDataLimits::max_connections`].
pub const MAX_DATA_CONNECTIONS: usize = 1024;

/// Bytes read from one connection before the others get a turn.
const TURN_BUDGET: u64 = 4 << 20;

/// Acks buffered for a sender that does not read them before reading
/// from it pauses (backpressure).
const OUT_LIMIT: usize = 64 * 1024;

/// Connections accepted per turn of the loop (the others' events get a
/// turn in between; the rest are accepted at the next turn).
const ACCEPT_BATCH: usize = 32;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// Limits of the TCP data listener (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpDataLimits {
    /// Time a new connection gets to present its preamble. Default 3 s.
    pub auth_timeout: Duration,
    /// Time a started write gets, beyond its length at `min_rate`.
    /// Default 30 s (the sender's own I/O timeout).
    pub io_timeout: Duration,
    /// Slowest rate a started write may average, bytes per second, beyond
    /// `io_timeout`. Default 1 MiB/s.
    pub min_rate: u64,
    /// Connections not serving a sender (waiting for their preamble, or
    /// refused and saying goodbye) at once; a new one evicts the oldest
    /// refused, else the oldest waiting one. Default 64.
    pub max_unauthenticated: usize,
    /// Connections one sender (token) may hold; a newer one closes its
    /// oldest. Default 4.
    pub max_per_sender: usize,
    /// Connections held at once (further capped at half the soft
    /// `RLIMIT_NOFILE`). Default 1024 (`MAX_DATA_CONNECTIONS`).
    pub max_connections: usize,
}

impl Default for TcpDataLimits {
    fn default() -> Self {
        Self {
            auth_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(30),
            min_rate: 1 << 20,
            max_unauthenticated: 64,
            max_per_sender: 4,
            max_connections: MAX_DATA_CONNECTIONS,
        }
    }
}

impl TcpDataLimits {
    /// Checks every limit is positive.
    pub(super) fn validate(&self) -> Result<(), String> {
        if self.auth_timeout.is_zero() || self.io_timeout.is_zero() {
            return Err("tcp data timeouts must be positive".into());
        }
        if self.min_rate == 0
            || self.max_unauthenticated == 0
            || self.max_per_sender == 0
            || self.max_connections == 0
        {
            return Err("tcp data rate and connection limits must be positive".into());
        }
        Ok(())
    }

    /// `max_connections`, capped at half the soft descriptor limit.
    fn connection_cap(&self) -> usize {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
        let nofile = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
            usize::try_from(rl.rlim_cur).unwrap_or(usize::MAX)
        } else {
            1024
        };
        self.max_connections.min((nofile / 2).max(1))
    }

    /// Connections that may serve senders at once: the cap less the room
    /// kept for newcomers presenting their secret (at most half the cap).
    fn serving_cap(&self) -> usize {
        let cap = self.connection_cap();
        cap - self.max_unauthenticated.min(cap / 2)
    }
}

/// Counters and gauges of the TCP data listener.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TcpDataStats {
    /// Connections open now.
    pub connections: usize,
    /// Of those, not serving a sender: waiting for their preamble, or
    /// refused and saying goodbye.
    pub unauthenticated: usize,
    /// Connections refused for a missing, wrong or revoked secret.
    pub rejected_unauthenticated: u64,
    /// Writes refused because a slot was not granted to the writer (or the
    /// range was outside the buffer, or the grant ended mid-write).
    pub rejected_not_granted: u64,
    /// Connections closed for missing a deadline.
    pub timed_out: u64,
    /// Connections closed to make room (oldest refused or unauthenticated,
    /// the longest-idle authenticated one, or a sender's oldest beyond its
    /// share), or refused at the cap.
    pub evicted: u64,
}

/// Requests to the data thread, and its counters.
#[derive(Debug, Default)]
struct Ctl {
    stop: AtomicBool,
    /// Bumped to ask the thread to close every connection.
    cut: AtomicU64,
    /// Connections open now.
    connections: AtomicUsize,
    unauthenticated: AtomicUsize,
    rejected_unauthenticated: AtomicU64,
    rejected_not_granted: AtomicU64,
    timed_out: AtomicU64,
    evicted: AtomicU64,
}

/// Relaxed: counters and gauges, read for metrics only.
fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The running data listener, owned by the [`super::Receiver`].
pub(super) struct TcpData {
    addr: SocketAddr,
    ctl: Arc<Ctl>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl TcpData {
    /// Binds the data listener (port 0 picks one).
    pub(super) fn bind(at: SocketAddr) -> std::io::Result<StdListener> {
        let l = StdListener::bind(at)?;
        l.set_nonblocking(true)?;
        Ok(l)
    }

    /// Starts the data thread on `listener`, landing writes in `shared`'s
    /// region where `grants` allow; `addr` is the address announced to
    /// senders.
    pub(super) fn start(
        listener: StdListener,
        addr: SocketAddr,
        shared: Arc<Shared>,
        grants: Arc<GrantTable>,
        limits: TcpDataLimits,
        name: String,
    ) -> std::io::Result<Self> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let ctl = Arc::new(Ctl::default());
        let thread = {
            let ctl = Arc::clone(&ctl);
            crate::threads::spawn_named(&name, None, move || {
                DataThread {
                    poll,
                    listener,
                    ctx: Ctx {
                        shared,
                        grants,
                        limits: limits.clone(),
                        ctl,
                    },
                    cap: limits.connection_cap(),
                    serving_cap: limits.serving_cap(),
                    conns: Vec::new(),
                    open: 0,
                    serving: 0,
                    ready: Vec::new(),
                    accept_more: false,
                }
                .run()
            })?
        };
        Ok(Self {
            addr,
            ctl,
            waker,
            thread: Some(thread),
        })
    }

    /// The announced address.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Data connections open now.
    pub(super) fn connections(&self) -> usize {
        // Relaxed: a gauge.
        self.ctl.connections.load(Ordering::Relaxed)
    }

    /// A snapshot of the counters.
    pub(super) fn stats(&self) -> TcpDataStats {
        // Relaxed: counters and gauges.
        let c = &self.ctl;
        TcpDataStats {
            connections: c.connections.load(Ordering::Relaxed),
            unauthenticated: c.unauthenticated.load(Ordering::Relaxed),
            rejected_unauthenticated: c.rejected_unauthenticated.load(Ordering::Relaxed),
            rejected_not_granted: c.rejected_not_granted.load(Ordering::Relaxed),
            timed_out: c.timed_out.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
        }
    }

    /// Asks the thread to close every data connection (asynchronous).
    pub(super) fn cut(&self) {
        // Relaxed: the waker's syscall orders it before the thread's wake-up,
        // and the thread only compares values.
        self.ctl.cut.fetch_add(1, Ordering::Relaxed);
        let _ = self.waker.wake();
    }

    /// Stops the thread and waits for it (connections close).
    pub(super) fn stop(&mut self) {
        // Release: pairs with the Acquire load in the thread's loop.
        self.ctl.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            // It writes into the receive buffer, which may be caller
            // memory (RecvBuffer::from_raw): never detached.
            let _ = crate::threads::join_or_wait(
                t,
                crate::threads::STOP_JOIN_DEADLINE,
                "receiver tcp data",
            );
        }
    }
}

impl Drop for TcpData {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading the preamble.
    Preamble,
    /// Reading a write header.
    Header,
    /// Landing `hdr.len` payload bytes, `done` so far.
    Payload { hdr: Header, done: u64 },
    /// Rejected: flush the answer, shut the write side, then discard what
    /// the sender still sends until it closes (so the answer is not lost to
    /// a reset), at most [`DISCARD_LIMIT`] bytes and the auth timeout.
    Closing { discarded: u64 },
}

/// Bytes discarded from a rejected connection before it is reset.
const DISCARD_LIMIT: u64 = 64 << 20;

struct Conn {
    stream: TcpStream,
    phase: Phase,
    buf: [u8; PREAMBLE_LEN],
    got: usize,
    /// Answers not yet sent.
    out: Vec<u8>,
    readable: bool,
    writable: bool,
    /// The sender this connection acts for; 0 until the preamble passed.
    token: PeerToken,
    /// Set when the preamble passed, until the thread applied the
    /// per-sender share.
    just_authenticated: bool,
    opened: Instant,
    /// When it authenticated or last completed a write (the longest-idle
    /// authenticated connection is displaced first).
    last_active: Instant,
    /// When the connection is closed unless it moves on (see the module docs).
    deadline: Option<Instant>,
}

impl Conn {
    /// Acting for a sender: authenticated and not refused since.
    fn serving(&self) -> bool {
        self.token != 0 && !matches!(self.phase, Phase::Closing { .. })
    }

    /// Serving a sender, between writes, with nothing unread or unsent.
    fn is_idle(&self) -> bool {
        self.serving()
            && self.phase == Phase::Header
            && self.got == 0
            && self.out.is_empty()
            && matches!(self.stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == ErrorKind::WouldBlock)
    }
}

enum Turn {
    /// Nothing more to do until the next event.
    Wait,
    /// Budget used up; more to do.
    More,
    /// Close the connection.
    Close,
}

/// What every turn needs besides the connection.
struct Ctx {
    shared: Arc<Shared>,
    grants: Arc<GrantTable>,
    limits: TcpDataLimits,
    ctl: Arc<Ctl>,
}

struct DataThread {
    poll: Poll,
    listener: TcpListener,
    ctx: Ctx,
    /// Most connections held at once.
    cap: usize,
    /// Most connections serving a sender at once: `cap` less the room kept
    /// for newcomers presenting their secret.
    serving_cap: usize,
    conns: Vec<Option<Conn>>,
    /// Connections in `conns`.
    open: usize,
    /// Of those, serving a sender ([`Conn::serving`]).
    serving: usize,
    /// Connections with work left after their last turn.
    ready: Vec<usize>,
    /// The listener may hold more connections than the last turn took.
    accept_more: bool,
}

impl DataThread {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        // Relaxed: compared only (see `TcpData::cut`).
        let mut seen_cut = self.ctx.ctl.cut.load(Ordering::Relaxed);
        let mut turn: Vec<usize> = Vec::new();
        tracing::debug!(cap = self.cap, "tcp data thread started");
        // Acquire: pairs with the Release store in `TcpData::stop`.
        while !self.ctx.ctl.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            let timeout = if !self.ready.is_empty() || self.accept_more {
                Some(Duration::ZERO)
            } else {
                self.next_deadline()
                    .map(|d| d.saturating_duration_since(now))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != ErrorKind::Interrupted {
                    tracing::debug!(error = %e, "tcp data poll failed; retrying");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            let cut = self.ctx.ctl.cut.load(Ordering::Relaxed);
            if cut != seen_cut {
                seen_cut = cut;
                self.close_all();
            }
            let now = Instant::now();
            turn.clear();
            turn.append(&mut self.ready);
            let mut accept = std::mem::take(&mut self.accept_more);
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => accept = true,
                    WAKER => {}
                    Token(t) => {
                        let i = t - FIRST_CONN;
                        if let Some(Some(c)) = self.conns.get_mut(i) {
                            c.readable |= ev.is_readable() || ev.is_read_closed() || ev.is_error();
                            c.writable |= ev.is_writable() || ev.is_write_closed();
                            turn.push(i);
                        }
                    }
                }
            }
            if accept {
                self.accept(now);
            }
            turn.sort_unstable();
            turn.dedup();
            for &i in &turn {
                self.serve_one(i, now);
            }
            self.expire(now);
        }
        self.close_all();
        tracing::debug!("tcp data thread stopped");
    }

    /// One turn of connection `i`, then the bookkeeping it calls for.
    fn serve_one(&mut self, i: usize, now: Instant) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        let was_serving = c.serving();
        let turn = serve(c, &self.ctx, now);
        let authenticated = std::mem::take(&mut c.just_authenticated).then_some(c.token);
        match (was_serving, c.serving()) {
            (false, true) => self.serving += 1,
            (true, false) => self.serving -= 1,
            _ => {}
        }
        self.publish_gauges();
        match turn {
            Turn::Wait => {}
            Turn::More => self.ready.push(i),
            Turn::Close => self.close(i),
        }
        if let Some(token) = authenticated {
            self.enforce_sender_share(token);
            if self.serving > self.serving_cap && self.conns[i].is_some() {
                self.displace_idle(i);
            }
        }
    }

    /// Publishes the connection gauges.
    fn publish_gauges(&self) {
        // Relaxed: gauges this thread alone writes.
        self.ctx.ctl.connections.store(self.open, Ordering::Relaxed);
        self.ctx
            .ctl
            .unauthenticated
            .store(self.open - self.serving, Ordering::Relaxed);
    }

    /// More connections serve senders than `serving_cap` after connection
    /// `newcomer` authenticated: closes the longest-idle other one (no
    /// write under way, nothing unread), else the newcomer.
    fn displace_idle(&mut self, newcomer: usize) {
        let idle = self
            .conns
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != newcomer)
            .filter_map(|(i, c)| {
                c.as_ref()
                    .filter(|c| c.is_idle())
                    .map(|c| (c.last_active, i))
            })
            .min()
            .map(|(_, i)| i);
        tracing::debug!(
            displaced = idle.is_some(),
            "tcp data connections serving senders at their cap; closing the longest-idle one"
        );
        bump(&self.ctx.ctl.evicted);
        self.close(idle.unwrap_or(newcomer));
    }

    /// The earliest connection deadline.
    fn next_deadline(&self) -> Option<Instant> {
        self.conns.iter().flatten().filter_map(|c| c.deadline).min()
    }

    /// Closes the connections past their deadline.
    fn expire(&mut self, now: Instant) {
        for i in 0..self.conns.len() {
            let late = self.conns[i]
                .as_ref()
                .and_then(|c| c.deadline)
                .is_some_and(|d| d <= now);
            if late {
                if let Some(c) = &self.conns[i] {
                    tracing::debug!(phase = ?c.phase, "tcp data connection missed its deadline; closing");
                }
                bump(&self.ctx.ctl.timed_out);
                self.close(i);
            }
        }
    }

    /// The oldest connection satisfying `pick`.
    fn oldest(&self, pick: impl Fn(&Conn) -> bool) -> Option<usize> {
        self.conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().filter(|c| pick(c)).map(|c| (c.opened, i)))
            .min()
            .map(|(_, i)| i)
    }

    /// A sender beyond its share of connections loses its oldest.
    fn enforce_sender_share(&mut self, token: PeerToken) {
        let held = self
            .conns
            .iter()
            .flatten()
            .filter(|c| c.token == token)
            .count();
        if held > self.ctx.limits.max_per_sender {
            if let Some(i) = self.oldest(|c| c.token == token) {
                tracing::debug!("a sender beyond its tcp data connections; closing its oldest");
                bump(&self.ctx.ctl.evicted);
                self.close(i);
            }
        }
    }

    fn accept(&mut self, now: Instant) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    // Served at once: a sender's preamble is usually there
                    // already, so it authenticates before later arrivals
                    // could evict it.
                    if let Some(i) = self.admit(stream, from, now) {
                        self.serve_one(i, now);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. EMFILE: try again at the next event.
                    tracing::debug!(error = %e, "accept failed");
                    return;
                }
            }
        }
        self.accept_more = true;
    }

    /// Makes room for and registers one accepted connection; returns its
    /// index.
    fn admit(&mut self, mut stream: TcpStream, from: SocketAddr, now: Instant) -> Option<usize> {
        let not_serving = self.open - self.serving;
        if not_serving >= self.ctx.limits.max_unauthenticated || self.open >= self.cap {
            // Refused connections first (their goodbye is a courtesy), then
            // those still waiting for their secret; never one serving a
            // sender.
            let refused = self.oldest(|c| matches!(c.phase, Phase::Closing { .. }));
            match refused.or_else(|| self.oldest(|c| c.phase == Phase::Preamble)) {
                Some(i) => {
                    tracing::debug!(%from, "tcp data connections not serving a sender at their budget; evicting the oldest");
                    bump(&self.ctx.ctl.evicted);
                    self.close(i);
                }
                None => {
                    tracing::debug!(%from, "too many tcp data connections; refused");
                    bump(&self.ctx.ctl.evicted);
                    return None;
                }
            }
        }
        let _ = stream.set_nodelay(true);
        let i = match self.conns.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() - 1
            }
        };
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(i + FIRST_CONN),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::debug!(error = %e, "cannot watch a tcp data connection");
            return None;
        }
        tracing::debug!(%from, "tcp data connection accepted");
        self.conns[i] = Some(Conn {
            stream,
            phase: Phase::Preamble,
            buf: [0; PREAMBLE_LEN],
            got: 0,
            out: Vec::new(),
            readable: true,
            writable: false,
            token: 0,
            just_authenticated: false,
            opened: now,
            last_active: now,
            deadline: Some(now + self.ctx.limits.auth_timeout),
        });
        self.open += 1;
        self.publish_gauges();
        Some(i)
    }

    fn close(&mut self, i: usize) {
        if let Some(mut c) = self.conns.get_mut(i).and_then(Option::take) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            self.open -= 1;
            if c.serving() {
                self.serving -= 1;
            }
            self.publish_gauges();
            tracing::debug!(phase = ?c.phase, "tcp data connection closed");
        }
    }

    fn close_all(&mut self) {
        for i in 0..self.conns.len() {
            self.close(i);
        }
        self.ready.clear();
    }
}

/// One turn of a connection: flush answers, read and land as much as the
/// socket and the turn budget allow.
fn serve(c: &mut Conn, ctx: &Ctx, now: Instant) -> Turn {
    let mut budget = TURN_BUDGET;
    loop {
        if !c.out.is_empty() && c.writable {
            match c.stream.write(&c.out) {
                Ok(0) => return Turn::Close,
                Ok(n) => {
                    c.out.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => c.writable = false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Turn::Close,
            }
            continue;
        }
        if let Phase::Closing { discarded } = c.phase {
            if !c.out.is_empty() {
                return Turn::Wait; // until writable
            }
            if discarded == 0 {
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
            }
            return discard(c, discarded);
        }
        if c.out.len() >= OUT_LIMIT || !c.readable {
            return Turn::Wait;
        }
        if budget == 0 {
            return Turn::More;
        }
        match step(c, ctx, now, &mut budget) {
            Ok(true) => {}
            Ok(false) => c.readable = false,
            Err(()) => return Turn::Close,
        }
    }
}

/// Reads and drops what a rejected sender still sends, until it closes.
fn discard(c: &mut Conn, mut discarded: u64) -> Turn {
    let mut sink = [0u8; 16 * 1024];
    loop {
        if discarded >= DISCARD_LIMIT {
            return Turn::Close;
        }
        match c.stream.read(&mut sink) {
            Ok(0) => return Turn::Close,
            Ok(n) => {
                // Never 0 again: the first turn shut the write side.
                discarded += n as u64;
                c.phase = Phase::Closing {
                    discarded: discarded.max(1),
                };
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                c.phase = Phase::Closing {
                    discarded: discarded.max(1),
                };
                return Turn::Wait;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Turn::Close,
        }
    }
}

/// Rejects the connection: `answer` is its last word, then it closes
/// (within the auth timeout).
fn reject(c: &mut Conn, ctx: &Ctx, now: Instant, answer: &[u8]) {
    c.out.extend_from_slice(answer);
    c.phase = Phase::Closing { discarded: 0 };
    c.deadline = Some(now + ctx.limits.auth_timeout);
}

/// Reads once in the current phase. `Ok(false)` = would block; `Err` = the
/// connection is finished (EOF or error).
fn step(c: &mut Conn, ctx: &Ctx, now: Instant, budget: &mut u64) -> Result<bool, ()> {
    match c.phase {
        Phase::Preamble | Phase::Header => {
            let want = if c.phase == Phase::Preamble {
                PREAMBLE_LEN
            } else {
                HEADER_LEN
            };
            let n = match c.stream.read(&mut c.buf[c.got..want]) {
                Ok(0) => return Err(()),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => return Ok(true),
                Err(_) => return Err(()),
            };
            if c.phase == Phase::Header && c.got == 0 {
                // A write starts: from here on it must keep moving.
                c.deadline = Some(now + ctx.limits.io_timeout);
            }
            c.got += n;
            if c.got < want {
                return Ok(true);
            }
            c.got = 0;
            if c.phase == Phase::Preamble {
                on_preamble(c, ctx, now);
            } else {
                let mut b = [0u8; HEADER_LEN];
                b.copy_from_slice(&c.buf[..HEADER_LEN]);
                on_header(c, Header::decode(&b), ctx, now);
            }
            Ok(true)
        }
        Phase::Payload { hdr, done } => {
            let chunk = ctx.shared.region.chunk_bytes();
            let dst_offset = hdr.remote_offset + done;
            // The slots this read can touch (at most READ_SLOTS) are claimed
            // busy around it, so the grants are held around exactly the
            // bytes it can land. `on_header` checked the range, so every
            // slot index fits in u32.
            let first = dst_offset / chunk;
            let run_end = (first + READ_SLOTS).saturating_mul(chunk);
            let want = (hdr.len - done)
                .min(*budget)
                .min(run_end - dst_offset)
                .min(isize::MAX as u64);
            let last = (dst_offset + want - 1) / chunk;
            let (first, last) = (first as u32, last as u32);
            if !claim(ctx, first, last, c.token, now) {
                tracing::debug!(
                    first,
                    last,
                    "tcp write's grant ended mid-write; rejected, closing"
                );
                bump(&ctx.ctl.rejected_not_granted);
                let a = ack_bytes(hdr.work_id, CompletionStatus::OutOfBounds);
                reject(c, ctx, now, &a);
                return Ok(true);
            }
            // SAFETY: `on_header` checked remote_offset + len <= data_len
            // without overflow, and done < len, so [dst_offset, dst_offset +
            // want) lies inside slots `first..=last` of the region, which
            // `shared` keeps mapped. `read` writes through the raw pointer;
            // no Rust reference to those bytes exists on this side. `claim`
            // succeeded: every one of those slots is granted to this
            // connection's sender, and none can be freed or handed to anyone
            // else until `release` below (see `super::grants`), so the bytes
            // land only in slots this sender holds.
            let r = unsafe {
                libc::read(
                    c.stream.as_raw_fd(),
                    ctx.shared.region.data_ptr().add(dst_offset as usize).cast(),
                    want as usize,
                )
            };
            let err = (r < 0).then(std::io::Error::last_os_error);
            release(ctx, first, last, c.token, now);
            if r == 0 {
                return Err(());
            }
            if let Some(e) = err {
                return match e.kind() {
                    ErrorKind::WouldBlock => Ok(false),
                    ErrorKind::Interrupted => Ok(true),
                    _ => Err(()),
                };
            }
            let n = r as u64;
            *budget = budget.saturating_sub(n);
            let done = done + n;
            if done == hdr.len {
                c.out
                    .extend_from_slice(&ack_bytes(hdr.work_id, CompletionStatus::Ok));
                c.phase = Phase::Header;
                c.deadline = None;
                c.last_active = now;
            } else {
                c.phase = Phase::Payload { hdr, done };
            }
            Ok(true)
        }
        Phase::Closing { .. } => Ok(false),
    }
}

/// Slots one payload `read` may span.
const READ_SLOTS: u64 = 64;

/// Claims slots `first..=last` for one read by `token`: all of them, or
/// none (false).
fn claim(ctx: &Ctx, first: u32, last: u32, token: PeerToken, now: Instant) -> bool {
    for s in first..=last {
        if !ctx.grants.begin_write(s, token) {
            if s > first {
                release(ctx, first, s - 1, token, now);
            }
            return false;
        }
    }
    true
}

/// Ends the claims of [`claim`]; hands back to the core the slots it freed
/// meanwhile (their free was deferred to us).
fn release(ctx: &Ctx, first: u32, last: u32, token: PeerToken, now: Instant) {
    let mut st = None;
    let mut out = Vec::new();
    for s in first..=last {
        if ctx.grants.end_write(s, token) == EndWrite::FreeDeferred {
            st.get_or_insert_with(|| ctx.shared.state.lock())
                .core
                .free_deferred(s, now, &mut out);
        }
    }
    if let Some(mut st) = st {
        ctx.shared.post(&mut st, out);
    }
}

fn ack_bytes(work_id: u64, status: CompletionStatus) -> [u8; crate::transport::tcp::wire::ACK_LEN] {
    Ack {
        work_id,
        status: status as u32,
    }
    .encode()
}

fn on_preamble(c: &mut Conn, ctx: &Ctx, now: Instant) {
    let region = &ctx.shared.region;
    let p = Preamble::decode(&c.buf);
    let status = match p {
        Some(p) if p.version != VERSION => PREAMBLE_BAD_VERSION,
        Some(p)
            if (p.chunk_bytes, p.capacity_chunks)
                != (region.chunk_bytes(), region.capacity_chunks()) =>
        {
            PREAMBLE_BAD_GEOMETRY
        }
        Some(p) => match ctx.shared.state.lock().core.data_token(&p.secret) {
            Some(token) => {
                c.token = token;
                PREAMBLE_OK
            }
            None => PREAMBLE_UNAUTHENTICATED,
        },
        None => PREAMBLE_BAD_VERSION,
    };
    if status == PREAMBLE_OK {
        c.out.extend_from_slice(&encode_preamble_ack(status));
        c.phase = Phase::Header;
        c.deadline = None;
        c.just_authenticated = true;
        c.last_active = now;
    } else {
        tracing::debug!(status, "tcp data preamble refused");
        bump(&ctx.ctl.rejected_unauthenticated);
        reject(c, ctx, now, &encode_preamble_ack(status));
    }
}

fn on_header(c: &mut Conn, hdr: Header, ctx: &Ctx, now: Instant) {
    let region = &ctx.shared.region;
    if !write_allowed(
        &hdr,
        region.chunk_bytes(),
        region.data_len(),
        &ctx.grants,
        c.token,
    ) {
        tracing::debug!(
            offset = hdr.remote_offset,
            len = hdr.len,
            work_id = hdr.work_id,
            "tcp write outside the slots granted to its sender; rejected, closing"
        );
        bump(&ctx.ctl.rejected_not_granted);
        reject(
            c,
            ctx,
            now,
            &ack_bytes(hdr.work_id, CompletionStatus::OutOfBounds),
        );
        return;
    }
    if hdr.len == 0 {
        c.out
            .extend_from_slice(&ack_bytes(hdr.work_id, CompletionStatus::Ok));
        c.phase = Phase::Header;
        c.deadline = None;
        c.last_active = now;
    } else {
        // The whole write within io_timeout plus its length at min_rate,
        // counted from its first header byte.
        let allowance = Duration::from_secs(hdr.len / ctx.limits.min_rate.max(1));
        c.deadline = c.deadline.map(|d| d + allowance);
        c.phase = Phase::Payload { hdr, done: 0 };
    }
}

/// The write rule of the module docs: inside the buffer, and every slot
/// touched granted to `token` now.
fn write_allowed(
    hdr: &Header,
    chunk_bytes: u64,
    data_len: u64,
    grants: &GrantTable,
    token: PeerToken,
) -> bool {
    let Some(end) = hdr.remote_offset.checked_add(hdr.len) else {
        return false;
    };
    if end > data_len {
        return false;
    }
    if hdr.len == 0 {
        return true;
    }
    let first = hdr.remote_offset / chunk_bytes;
    let last = (end - 1) / chunk_bytes;
    (first..=last).all(|s| u32::try_from(s).is_ok_and(|s| grants.is_granted_to(s, token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_rule_checks_range_and_every_slot_grant() {
        let g = GrantTable::new(4);
        g.grant(0, 1);
        g.grant(1, 1);
        g.grant(2, 2);
        let h = |off: u64, len: u64| Header {
            remote_offset: off,
            len,
            work_id: 1,
        };
        let ok = |hdr: Header| write_allowed(&hdr, 100, 400, &g, 1);
        assert!(ok(h(0, 100)));
        assert!(ok(h(50, 150))); // a coalesced run over slots 0 and 1
        assert!(!ok(h(150, 100))); // reaches into slot 2, another sender's
        assert!(!ok(h(200, 1))); // another sender's slot
        assert!(!ok(h(300, 1))); // ungranted slot
        assert!(!ok(h(390, 20))); // past the end
        assert!(!ok(h(u64::MAX, 2))); // overflow
        assert!(ok(h(400, 0))); // empty write at the end
        assert!(!ok(h(401, 0)));
        assert!(write_allowed(&h(200, 100), 100, 400, &g, 2));
        assert!(!write_allowed(&h(0, 1), 100, 400, &g, 0), "no token");
    }

    #[test]
    fn limits_validate_and_cap_at_half_the_descriptors() {
        assert!(TcpDataLimits::default().validate().is_ok());
        for bad in [
            TcpDataLimits {
                auth_timeout: Duration::ZERO,
                ..TcpDataLimits::default()
            },
            TcpDataLimits {
                max_unauthenticated: 0,
                ..TcpDataLimits::default()
            },
            TcpDataLimits {
                min_rate: 0,
                ..TcpDataLimits::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let huge = TcpDataLimits {
            max_connections: usize::MAX,
            ..TcpDataLimits::default()
        };
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) }, 0);
        assert_eq!(
            huge.connection_cap(),
            (usize::try_from(rl.rlim_cur).unwrap_or(usize::MAX) / 2).max(1)
        );
    }
}
