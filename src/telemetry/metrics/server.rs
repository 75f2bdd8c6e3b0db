//! A tiny blocking HTTP endpoint serving `GET /metrics`.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use super::http::{find_head_end, parse_head, response_bytes, RequestError, Status, Version};
use crate::threads::spawn_named;

/// Content type of the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);

/// Limits of a [`MetricsServer`]; the defaults suit a scrape endpoint.
#[derive(Debug, Clone)]
pub struct MetricsServerConfig {
    /// Largest accepted request head (request line + headers); larger heads
    /// are answered with 431. Default 8 KiB.
    pub max_head_bytes: usize,
    /// Total time a client gets to send its request head, and to read its
    /// response; slower clients get 408 (or are dropped). Default 2 s.
    pub head_timeout: Duration,
    /// Connections held at once, all served by the one server thread. At
    /// the cap, a new connection displaces the oldest one still sending its
    /// head (so slow clients cannot starve scrapes); only when every held
    /// connection is being answered does it get 503. Default 64.
    pub max_connections: usize,
    /// Name of the accept thread. Default `kvferry-metrics`.
    pub thread_name: String,
}

impl Default for MetricsServerConfig {
    fn default() -> Self {
        Self {
            max_head_bytes: 8 * 1024,
            head_timeout: Duration::from_secs(2),
            max_connections: 64,
            thread_name: "kvferry-metrics".to_owned(),
        }
    }
}

type Render = dyn Fn() -> String + Send + Sync + 'static;

struct Shared {
    stop: AtomicBool,
    config: MetricsServerConfig,
    render: Box<Render>,
}

/// Serves `GET /metrics` (and `HEAD`) with the text returned by a render
/// closure, for Prometheus to scrape.
///
/// One named thread serves everything: it blocks in `mio::Poll` on the
/// listener, a waker and its connections (all non-blocking), so an idle
/// server uses no CPU and the thread count never grows with clients. A
/// client that connects and sends nothing, or trickles its head, delays
/// nobody else: it is answered 408 after
/// [`MetricsServerConfig::head_timeout`], and displaced by a new
/// connection when [`MetricsServerConfig::max_connections`] are held.
/// Responses carry
/// `Connection: close`; no keep-alive. Status codes: 200 for `/metrics`
/// (query string ignored), 404 other paths, 405 other methods, 400 malformed
/// requests, 408 too slow, 431 head too large, 505 other HTTP versions, 500
/// if the render closure panics.
///
/// [`MetricsServer::shutdown`] (or drop) wakes and joins the thread, which
/// closes every connection.
pub struct MetricsServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("local_addr", &self.local_addr)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Listen on `addr` (port 0 picks a free port) with the default limits.
    /// Bind errors name the address.
    pub fn start(
        addr: SocketAddr,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> io::Result<Self> {
        Self::start_with(addr, MetricsServerConfig::default(), render)
    }

    /// Listen on `addr` with explicit limits.
    pub fn start_with(
        addr: SocketAddr,
        config: MetricsServerConfig,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let with_addr = |what: &str, e: io::Error| {
            io::Error::new(e.kind(), format!("metrics server: {what} {addr}: {e}"))
        };
        let listener = TcpListener::bind(addr).map_err(|e| with_addr("cannot listen on", e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| with_addr("no local address for", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| with_addr("cannot set non-blocking on", e))?;
        let poll = Poll::new().map_err(|e| with_addr("cannot create poller for", e))?;
        poll.registry()
            .register(
                &mut SourceFd(&listener.as_raw_fd()),
                LISTENER,
                Interest::READABLE,
            )
            .map_err(|e| with_addr("cannot register listener", e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER)
                .map_err(|e| with_addr("cannot create waker for", e))?,
        );
        let thread_name = config.thread_name.clone();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            config,
            render: Box::new(render),
        });
        let thread_shared = shared.clone();
        let thread = spawn_named(&thread_name, None, move || {
            accept_loop(poll, listener, thread_shared)
        })
        .map_err(|e| with_addr("cannot spawn the accept thread for", e))?;
        tracing::debug!(%local_addr, "metrics server listening");
        Ok(Self {
            local_addr,
            shared,
            waker,
            thread: Some(thread),
        })
    }

    /// The address the server listens on (with the real port if 0 was
    /// asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stop accepting and join the accept thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        // Release: pairs with the Acquire load in `accept_loop` after the
        // wake-up, so the thread sees the flag that caused it.
        self.shared.stop.store(true, Ordering::Release);
        match self.waker.wake() {
            Ok(()) => {
                let _ = crate::threads::join_within(
                    thread,
                    crate::threads::STOP_JOIN_DEADLINE,
                    "metrics accept",
                );
            }
            // Without a wake-up the thread would not see the flag: detach it.
            Err(e) => {
                tracing::debug!(error = %e, "cannot wake the metrics accept thread; detaching it")
            }
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One client connection of the event loop.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    phase: Phase,
    opened: Instant,
    /// Closed (as too slow) when this passes.
    deadline: Instant,
}

enum Phase {
    /// Reading the request head: `len` bytes of `buf` so far.
    Head { buf: Vec<u8>, len: usize },
    /// Writing the response, `at` bytes of `out` sent.
    Respond { out: Vec<u8>, at: usize },
    /// Response sent and write side shut: discarding what the client still
    /// sends (at most `left` bytes) until it closes, so closing does not
    /// reset the connection before the client read the response.
    Drain { left: usize },
}

/// What a turn decided.
enum Next {
    Wait,
    Close,
}

/// Bytes discarded from a client after its response.
const DRAIN_LIMIT: usize = 64 * 1024;

/// Longest the goodbye of a served connection may take.
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// Connections accepted per turn of the loop (edge-triggered: the rest are
/// taken at the next turn, after the others got theirs).
const ACCEPT_BATCH: usize = 32;

const FIRST_CONN: usize = 2;

struct Server {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    conns: Vec<Option<Conn>>,
    open: usize,
    accept_more: bool,
}

fn accept_loop(poll: Poll, listener: TcpListener, shared: Arc<Shared>) {
    Server {
        poll,
        listener,
        shared,
        conns: Vec::new(),
        open: 0,
        accept_more: false,
    }
    .run()
}

impl Server {
    fn run(mut self) {
        let mut events = Events::with_capacity(64);
        let mut turn = Vec::new();
        loop {
            // Sleeps until an event or the earliest connection deadline; an
            // idle server (no connection) sleeps without a timeout.
            let timeout = if self.accept_more {
                Some(Duration::ZERO)
            } else {
                self.conns
                    .iter()
                    .flatten()
                    .map(|c| c.deadline)
                    .min()
                    .map(|d| d.saturating_duration_since(Instant::now()))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::debug!(error = %e, "metrics poll failed; stopping");
                return;
            }
            // Acquire: pairs with the Release store in `MetricsServer::stop`.
            if self.shared.stop.load(Ordering::Acquire) {
                return;
            }
            turn.clear();
            let mut accept = std::mem::take(&mut self.accept_more);
            for e in events.iter() {
                match e.token() {
                    LISTENER => accept = true,
                    WAKER => {}
                    Token(t) => turn.push(t - FIRST_CONN),
                }
            }
            if accept {
                self.accept(&mut turn);
            }
            turn.sort_unstable();
            turn.dedup();
            for &i in &turn {
                self.serve(i);
            }
            self.expire();
        }
    }

    fn accept(&mut self, turn: &mut Vec<usize>) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if let Some(i) = self.admit(stream, peer) {
                        turn.push(i);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // E.g. out of file descriptors: wait for the next event
                    // rather than spin on the error.
                    tracing::debug!(error = %e, "metrics accept failed");
                    return;
                }
            }
        }
        self.accept_more = true;
    }

    /// Makes room for a new connection and registers it. At the cap, the
    /// oldest connection still sending its head (a slow or idle client) is
    /// dropped, else the oldest one saying goodbye; if every connection is
    /// being answered, the new one gets 503.
    fn admit(&mut self, stream: TcpStream, peer: SocketAddr) -> Option<usize> {
        if self.open >= self.shared.config.max_connections {
            let victim = self
                .oldest(|p| matches!(p, Phase::Head { .. }))
                .or_else(|| self.oldest(|p| matches!(p, Phase::Drain { .. })));
            match victim {
                Some(v) => {
                    tracing::debug!(%peer, "metrics connections at the cap; dropping the oldest slow one");
                    self.close(v);
                }
                None => {
                    busy(stream, peer);
                    return None;
                }
            }
        }
        if stream.set_nonblocking(true).is_err() {
            return None;
        }
        let i = match self.conns.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() - 1
            }
        };
        if let Err(e) = self.poll.registry().register(
            &mut SourceFd(&stream.as_raw_fd()),
            Token(i + FIRST_CONN),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::debug!(error = %e, "cannot watch a metrics connection");
            return None;
        }
        let now = Instant::now();
        self.conns[i] = Some(Conn {
            stream,
            peer,
            phase: Phase::Head {
                buf: vec![0; self.shared.config.max_head_bytes],
                len: 0,
            },
            opened: now,
            deadline: now + self.shared.config.head_timeout,
        });
        self.open += 1;
        Some(i)
    }

    fn oldest(&self, pick: impl Fn(&Phase) -> bool) -> Option<usize> {
        self.conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().filter(|c| pick(&c.phase)).map(|c| (c.opened, i)))
            .min()
            .map(|(_, i)| i)
    }

    fn close(&mut self, i: usize) {
        if let Some(c) = self.conns.get_mut(i).and_then(Option::take) {
            let _ = self
                .poll
                .registry()
                .deregister(&mut SourceFd(&c.stream.as_raw_fd()));
            self.open -= 1;
        }
    }

    /// Connections past their deadline: a client still sending its head
    /// gets 408; one not reading its response or not closing is dropped.
    fn expire(&mut self) {
        let now = Instant::now();
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_mut() else {
                continue;
            };
            if c.deadline > now {
                continue;
            }
            if matches!(c.phase, Phase::Head { .. }) {
                tracing::debug!(peer = %c.peer, "metrics client too slow; answering 408");
                respond(c, error_reply(&RequestError::Timeout), now, &self.shared);
                if let Next::Close = advance(c, &self.shared) {
                    self.close(i);
                }
            } else {
                self.close(i);
            }
        }
    }

    fn serve(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if let Next::Close = advance(c, &self.shared) {
            self.close(i);
        }
    }
}

/// Answers 503 without blocking and drops the connection.
fn busy(mut stream: TcpStream, peer: SocketAddr) {
    tracing::debug!(%peer, "metrics server busy answering others; 503");
    if stream.set_nonblocking(true).is_ok() {
        // Discard what the client already sent (bounded) so that closing
        // sends FIN, not RST, and the client gets to read the 503.
        let mut scratch = [0u8; 1024];
        for _ in 0..8 {
            match std::io::Read::read(&mut stream, &mut scratch) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let out = response_bytes(
            Version::Http11,
            Status::Unavailable,
            "text/plain; charset=utf-8",
            "",
            b"busy\n",
            true,
        );
        let _ = std::io::Write::write(&mut stream, &out);
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
}

/// Switches `c` to sending `reply`.
fn respond(c: &mut Conn, reply: Reply, now: Instant, shared: &Shared) {
    let (version, status, body, extra, with_body) = reply;
    let content_type = if status == Status::Ok {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    tracing::debug!(peer = %c.peer, status = status.line(), "metrics request");
    c.phase = Phase::Respond {
        out: response_bytes(version, status, content_type, extra, &body, with_body),
        at: 0,
    };
    c.deadline = now + shared.config.head_timeout.max(Duration::from_millis(1));
}

/// Moves a connection on as far as its socket allows.
fn advance(c: &mut Conn, shared: &Shared) -> Next {
    use std::io::{Read, Write};
    loop {
        match &mut c.phase {
            Phase::Head { buf, len } => {
                if let Some(end) = find_head_end(&buf[..*len]) {
                    let reply = match parse_head(&buf[..end]) {
                        Ok(head) => route(&head, shared),
                        Err(e) => error_reply(&e),
                    };
                    respond(c, reply, Instant::now(), shared);
                    continue;
                }
                if *len >= buf.len() {
                    let limit = buf.len();
                    respond(
                        c,
                        error_reply(&RequestError::HeadTooLarge { limit }),
                        Instant::now(),
                        shared,
                    );
                    continue;
                }
                match c.stream.read(&mut buf[*len..]) {
                    Ok(0) if *len == 0 => {
                        tracing::debug!(peer = %c.peer, "metrics connection closed without a request");
                        return Next::Close;
                    }
                    Ok(0) => {
                        respond(
                            c,
                            error_reply(&RequestError::Truncated),
                            Instant::now(),
                            shared,
                        );
                    }
                    Ok(n) => *len += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                }
            }
            Phase::Respond { out, at } => {
                if *at == out.len() {
                    let _ = c.stream.shutdown(std::net::Shutdown::Write);
                    c.phase = Phase::Drain { left: DRAIN_LIMIT };
                    c.deadline = Instant::now() + shared.config.head_timeout.min(DRAIN_TIME);
                    continue;
                }
                match c.stream.write(&out[*at..]) {
                    Ok(0) => return Next::Close,
                    Ok(n) => *at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                }
            }
            Phase::Drain { left } => {
                let mut scratch = [0u8; 1024];
                match c.stream.read(&mut scratch) {
                    Ok(0) => return Next::Close,
                    Ok(n) if n >= *left => return Next::Close,
                    Ok(n) => *left -= n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                }
            }
        }
    }
}

type Reply = (Version, Status, Vec<u8>, &'static str, bool);

fn error_reply(e: &RequestError) -> Reply {
    let status = e.status();
    (
        Version::Http11,
        status,
        format!("{e}\n").into_bytes(),
        "",
        true,
    )
}

fn route(head: &super::http::RequestHead<'_>, shared: &Shared) -> Reply {
    let is_head = head.method == "HEAD";
    if head.method != "GET" && !is_head {
        return (
            head.version,
            Status::MethodNotAllowed,
            b"method not allowed\n".to_vec(),
            "Allow: GET, HEAD\r\n",
            true,
        );
    }
    let path = head.target.split('?').next().unwrap_or("");
    if path != "/metrics" {
        return (
            head.version,
            Status::NotFound,
            b"not found; try /metrics\n".to_vec(),
            "",
            !is_head,
        );
    }
    match catch_unwind(AssertUnwindSafe(|| (shared.render)())) {
        Ok(text) => (head.version, Status::Ok, text.into_bytes(), "", !is_head),
        Err(_) => (
            head.version,
            Status::InternalError,
            b"metrics rendering failed\n".to_vec(),
            "",
            !is_head,
        ),
    }
}
