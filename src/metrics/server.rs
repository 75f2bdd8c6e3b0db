//! A tiny blocking HTTP endpoint serving `GET /metrics`.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use super::http::{
    close_gracefully, parse_head, read_head, write_response, RequestError, Status, Version,
};
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
    /// Total time a client gets to send its request head, and the write
    /// timeout for the response; slower clients get 408. Default 2 s.
    pub head_timeout: Duration,
    /// Connections served at the same time (one short-lived thread each);
    /// more are answered with 503 at once. Default 4.
    pub max_connections: usize,
    /// Name of the accept thread. Default `kvferry-metrics`.
    pub thread_name: String,
}

impl Default for MetricsServerConfig {
    fn default() -> Self {
        Self {
            max_head_bytes: 8 * 1024,
            head_timeout: Duration::from_secs(2),
            max_connections: 4,
            thread_name: "kvferry-metrics".to_owned(),
        }
    }
}

type Render = dyn Fn() -> String + Send + Sync + 'static;

struct Shared {
    stop: AtomicBool,
    active: AtomicUsize,
    config: MetricsServerConfig,
    render: Box<Render>,
}

/// Serves `GET /metrics` (and `HEAD`) with the text returned by a render
/// closure, for Prometheus to scrape.
///
/// One named accept thread blocks in `mio::Poll` on the listener and a
/// waker, so an idle server uses no CPU. Each accepted connection is served
/// on its own short-lived thread (at most
/// [`MetricsServerConfig::max_connections`] at once, further connections get
/// 503), so a client that connects and sends nothing delays nobody else; it
/// is cut off after [`MetricsServerConfig::head_timeout`]. Responses carry
/// `Connection: close`; no keep-alive. Status codes: 200 for `/metrics`
/// (query string ignored), 404 other paths, 405 other methods, 400 malformed
/// requests, 408 too slow, 431 head too large, 505 other HTTP versions, 500
/// if the render closure panics.
///
/// [`MetricsServer::shutdown`] (or drop) wakes and joins the accept thread;
/// connection threads still running finish on their own within their
/// timeouts.
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
            active: AtomicUsize::new(0),
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
                if thread.join().is_err() {
                    tracing::debug!("metrics accept thread panicked");
                }
            }
            // Without a wake-up the join could block forever: detach instead.
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

fn accept_loop(mut poll: Poll, listener: TcpListener, shared: Arc<Shared>) {
    let mut events = Events::with_capacity(8);
    loop {
        // No timeout: the thread sleeps until a connection or the waker.
        if let Err(e) = poll.poll(&mut events, None) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::debug!(error = %e, "metrics poll failed; stopping");
            return;
        }
        // Acquire: pairs with the Release store in `MetricsServer::stop`.
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if events.iter().any(|e| e.token() == LISTENER) {
            accept_pending(&listener, &shared);
        }
    }
}

/// Accept until the (edge-triggered) listener would block.
fn accept_pending(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        match listener.accept() {
            Ok((stream, peer)) => dispatch(stream, peer, shared),
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
}

/// Decrements the active-connection count when the connection ends.
struct ActiveGuard(Arc<Shared>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        // Relaxed: the count only caps concurrency; no data is published
        // through it and an off-by-one moment only changes a 503 decision.
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

fn dispatch(mut stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    // Relaxed: see ActiveGuard; only this thread increments.
    if shared.active.load(Ordering::Relaxed) >= shared.config.max_connections {
        tracing::debug!(%peer, "metrics server busy; answering 503");
        // Never block the accept thread: non-blocking I/O only. Discard what
        // the client already sent (bounded) so that closing sends FIN, not
        // RST, and the client gets to read the 503.
        if stream.set_nonblocking(true).is_ok() {
            let mut scratch = [0u8; 1024];
            for _ in 0..8 {
                match std::io::Read::read(&mut stream, &mut scratch) {
                    Ok(n) if n > 0 => {}
                    _ => break,
                }
            }
            let _ = write_response(
                &mut stream,
                Version::Http11,
                Status::Unavailable,
                "text/plain; charset=utf-8",
                "",
                b"busy\n",
                true,
            );
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
        return;
    }
    // Relaxed: see ActiveGuard.
    shared.active.fetch_add(1, Ordering::Relaxed);
    let guard = ActiveGuard(shared.clone());
    if let Err(e) = spawn_named("kvferry-metrics-conn", None, move || {
        let shared = guard.0.clone();
        serve_connection(stream, peer, &shared, guard);
    }) {
        // The closure (and with it the guard) was dropped: count restored.
        tracing::debug!(error = %e, %peer, "cannot spawn a metrics connection thread");
    }
}

/// Serves one request. `guard` is released as soon as the response is
/// written, before the close handshake: a client that reads the response to
/// its end and connects again must not find its old connection still counted
/// (that made sequential scrapes get 503 on a loaded machine).
fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared, guard: ActiveGuard) {
    let cfg = &shared.config;
    if stream.set_nonblocking(false).is_err()
        || stream
            .set_write_timeout(Some(cfg.head_timeout.max(Duration::from_millis(1))))
            .is_err()
    {
        return;
    }
    let result = read_head(&mut stream, cfg.max_head_bytes, cfg.head_timeout);
    let (version, status, body, extra, with_body): (Version, Status, Vec<u8>, &str, bool) =
        match &result {
            Ok((buf, end)) => match parse_head(&buf[..*end]) {
                Ok(head) => route(&head, shared),
                Err(e) => error_reply(&e),
            },
            Err(e) => error_reply(e),
        };
    if let Err(RequestError::Empty | RequestError::Io(_)) = &result {
        tracing::debug!(%peer, "metrics connection closed without a request");
        return;
    }
    tracing::debug!(%peer, status = status.line(), "metrics request");
    let content_type = if status == Status::Ok {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    let written = write_response(
        &mut stream,
        version,
        status,
        content_type,
        extra,
        &body,
        with_body,
    );
    drop(guard);
    if written.is_ok() {
        close_gracefully(
            &mut stream,
            64 * 1024,
            cfg.head_timeout.min(Duration::from_secs(1)),
        );
    }
}

type Reply = (Version, Status, Vec<u8>, &'static str, bool);

fn error_reply(e: &RequestError) -> Reply {
    let status = e.status().unwrap_or(Status::BadRequest);
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
