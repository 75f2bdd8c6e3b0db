//! The proxy side: a [`ProxyListener`] that a request router embeds to learn
//! when a request's KV cache is in place at its decoder.
//!
//! Senders PUSH one `ProxyNotif` per request (per sender TP rank) to the
//! listener's bound PULL socket. Like LMCache's disaggregation proxy, the
//! listener counts notifications per `req_id`: with TP, a request is ready
//! once every rank's sender has reported, so callers say how many they expect.
//!
//! A kvferry sender whose request fails (or is cancelled) pushes a
//! `ProxyFailed` instead (a kvferry extension, `docs/protocol.md`): the
//! listener records it and [`ProxyListener::wait_ready`] returns
//! [`ProxyError::Failed`] at once instead of waiting for its deadline.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tracing::{debug, warn};

use crate::protocol::{decode_with_limits, ErrorCode, Limits, Message};
use crate::recent::RecentMap;
use crate::util::socket_file::SocketFile;
use crate::zmq_io::{bind, readable, BindError, Bound, Reactor};

/// Default bytes of notification counts (request ids) the listener
/// remembers — 65,536 ids of 64 bytes, fewer longer ones — and, separately,
/// of notifications kept for [`ProxyListener::next`] until taken.
pub const MEMORY_BYTES: usize = 16 << 20;

/// Largest frame the listener accepts (`ZMQ_MAXMSGSIZE` of its PULL socket;
/// a larger frame drops the connection before it is buffered). A
/// `ProxyNotif` with the longest `req_id` (4 KiB) is under 4.2 KB.
pub const MAX_FRAME_BYTES: usize = 64 << 10;

/// Frames queued per sender connection before the listener reads them
/// (`ZMQ_RCVHWM`): at most this many times [`MAX_FRAME_BYTES`] per sender.
pub const RECV_QUEUE: i32 = 1024;

/// Longest `ProxyFailed.error` kept with a notification (longer ones are
/// cut at a character boundary).
pub const MAX_REASON_BYTES: usize = 256;

/// Charge of one kept notification.
fn notification_cost(n: &Notification) -> usize {
    n.req_id.len() + 64
}

/// The reason code a sender gave in its `ProxyFailed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCode {
    /// A code this version knows.
    Known(ErrorCode),
    /// A code this version does not know (a newer sender).
    Unknown,
}

impl FailureCode {
    fn parse(code: &str) -> Self {
        ErrorCode::parse(code).map_or(FailureCode::Unknown, FailureCode::Known)
    }
}

/// What a sender reported for a request that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Machine-readable reason.
    pub code: FailureCode,
    /// Human-readable reason (at most [`MAX_REASON_BYTES`]).
    pub reason: String,
}

/// One received notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The request.
    pub req_id: String,
    /// `ProxyNotif`s received for it so far (this one included, unless it
    /// is a failure).
    pub count: usize,
    /// When it arrived.
    pub at: Instant,
    /// `Some` for a `ProxyFailed`: the request will not become ready.
    pub failure: Option<Failure>,
}

/// What the listener remembers of one request (fixed size: the reason
/// string stays with the notification history only).
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    /// `ProxyNotif`s received.
    ready: usize,
    /// The first `ProxyFailed`'s code, if any.
    failed: Option<FailureCode>,
}

/// Errors of the proxy listener.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The socket could not be created or bound.
    #[error("cannot listen for ProxyNotif on {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
    /// The file of an `ipc://` endpoint is taken: a socket another process
    /// serves ([`std::io::ErrorKind::AddrInUse`]) or a file that is not a
    /// socket ([`std::io::ErrorKind::AlreadyExists`]). Both are left as
    /// they are; a socket nobody serves (a listener that died) is replaced.
    #[error("cannot listen for ProxyNotif on {endpoint}: {source}")]
    SocketFile {
        /// The endpoint.
        endpoint: String,
        /// Why the path is not free.
        #[source]
        source: std::io::Error,
    },
    /// The listener thread could not be started.
    #[error("cannot start the proxy listener thread: {0}")]
    Thread(#[from] std::io::Error),
    /// A sender reported the request failed (`ProxyFailed`): it will not
    /// become ready.
    #[error("request {req_id} failed at its sender ({})", match .code {
        FailureCode::Known(c) => c.as_str(),
        FailureCode::Unknown => "unknown code",
    })]
    Failed {
        /// The request.
        req_id: String,
        /// The sender's reason code.
        code: FailureCode,
    },
    /// `wait_ready` hit its deadline.
    #[error("request {req_id}: {got} of {expected} ProxyNotif before the deadline")]
    Timeout {
        /// The request.
        req_id: String,
        /// Notifications received.
        got: usize,
        /// Notifications expected.
        expected: usize,
    },
    /// The listener was shut down while waiting.
    #[error("proxy listener shut down")]
    ShutDown,
}

/// Callback invoked (on the listener thread) for each notification.
pub type NotifCallback = Box<dyn Fn(&Notification) + Send + Sync>;

struct Counts {
    /// Notifications per request, for the most recent requests.
    map: RecentMap<Seen>,
    history: VecDeque<Notification>,
    /// Bytes charged for `history`.
    history_bytes: usize,
    /// Bound of `history_bytes`.
    max_history_bytes: usize,
    malformed: u64,
    /// `ProxyNotif`s received.
    total: u64,
    /// `ProxyFailed`s received.
    failures: u64,
    shut_down: bool,
}

struct Shared {
    counts: Mutex<Counts>,
    cv: Condvar,
    stop: AtomicBool,
    waker: Arc<mio::Waker>,
    callback: Mutex<Option<NotifCallback>>,
    /// Run for each `ProxyFailed` (kept apart from `callback`, which has
    /// always meant "a rank is ready").
    failure_callback: Mutex<Option<NotifCallback>>,
}

/// A bound PULL socket collecting `ProxyNotif`s on its own thread.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvferry::{ProxyListener, Receiver, ReceiverConfig, RequestSpec, Sender, SenderConfig};
///
/// let proxy = ProxyListener::bind("tcp://127.0.0.1:0")?;
/// // Senders are configured with `proxy.endpoint()` as their `proxy`.
/// # let receiver = Receiver::start(ReceiverConfig {
/// #     listen: "tcp://127.0.0.1:0".into(),
/// #     capacity_chunks: 4,
/// #     chunk_bytes: 1024,
/// #     ..Default::default()
/// # })?;
/// # let sender = Sender::new(SenderConfig {
/// #     proxy: Some(proxy.endpoint().into()),
/// #     chunk_bytes: 1024,
/// #     staging_slots: 4,
/// #     ..Default::default()
/// # })?;
/// # let req = sender.begin(RequestSpec::new("req-9", receiver.endpoint(), 1))?;
/// # req.store(&["req-9/0"], &[&b"kv"[..]])?;
/// let deadline = Instant::now() + Duration::from_secs(20);
///
/// // A router with one sender per request (TP 1) waits for one notification.
/// proxy.wait_ready("req-9", 1, deadline)?;
/// // Or takes them in arrival order.
/// let n = proxy.next(deadline).expect("a notification");
/// assert_eq!((n.req_id.as_str(), n.count), ("req-9", 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ProxyListener {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    /// The file of an `ipc://` endpoint: removed after `Drop` joined the
    /// listener thread (which owns the socket).
    _socket_file: Option<SocketFile>,
}

impl std::fmt::Debug for ProxyListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyListener")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl ProxyListener {
    /// Binds `endpoint` (e.g. `tcp://127.0.0.1:7500`; port 0 picks one) and
    /// starts listening.
    pub fn bind(endpoint: &str) -> Result<Self, ProxyError> {
        Self::bind_with_memory(endpoint, MEMORY_BYTES)
    }

    /// [`ProxyListener::bind`] with `memory_bytes` as the bound of the
    /// notification counts and, separately, of the untaken notifications
    /// (default [`MEMORY_BYTES`] each): the oldest are forgotten past it.
    pub fn bind_with_memory(endpoint: &str, memory_bytes: usize) -> Result<Self, ProxyError> {
        let err = |source| ProxyError::Bind {
            endpoint: endpoint.to_owned(),
            source,
        };
        let sock = crate::zmq_io::context().socket(zmq::PULL).map_err(err)?;
        sock.set_linger(0).map_err(err)?;
        sock.set_maxmsgsize(MAX_FRAME_BYTES as i64).map_err(err)?;
        sock.set_handshake_ivl(crate::zmq_io::HANDSHAKE_TIMEOUT_MS)
            .map_err(err)?;
        // At most RECV_QUEUE frames wait per sender connection; past it ZMQ
        // stops reading that connection and the backlog stays on the
        // sender's side (kvferry senders never block on their PUSH).
        sock.set_rcvhwm(RECV_QUEUE).map_err(err)?;
        // An `ipc://` endpoint's file is removed when the listener is dropped.
        let Bound {
            endpoint: bound,
            file: socket_file,
        } = bind(&sock, endpoint).map_err(|e| match e {
            BindError::SocketFile(source) => ProxyError::SocketFile {
                endpoint: endpoint.to_owned(),
                source,
            },
            BindError::Zmq(source) => err(source),
        })?;
        let reactor = Reactor::new()?;
        reactor.register(&sock, 0)?;
        let shared = Arc::new(Shared {
            counts: Mutex::new(Counts {
                map: RecentMap::new(memory_bytes),
                history: VecDeque::new(),
                history_bytes: 0,
                max_history_bytes: memory_bytes,
                malformed: 0,
                total: 0,
                failures: 0,
                shut_down: false,
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            waker: reactor.waker(),
            callback: Mutex::new(None),
            failure_callback: Mutex::new(None),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            crate::threads::spawn_named("kvf-proxy", None, move || listen(shared, sock, reactor))?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            endpoint: bound,
            _socket_file: socket_file,
        })
    }

    /// The bound endpoint (actual port when `:0` was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sets a callback run on the listener thread for each `ProxyNotif`.
    pub fn set_callback(&self, f: impl Fn(&Notification) + Send + Sync + 'static) {
        *self.shared.callback.lock() = Some(Box::new(f));
    }

    /// Sets a callback run on the listener thread for each `ProxyFailed`
    /// (its [`Notification::failure`] is `Some`): the request will not
    /// become ready.
    pub fn set_failure_callback(&self, f: impl Fn(&Notification) + Send + Sync + 'static) {
        *self.shared.failure_callback.lock() = Some(Box::new(f));
    }

    /// `ProxyNotif`s received so far for `req_id`.
    pub fn count(&self, req_id: &str) -> usize {
        self.shared
            .counts
            .lock()
            .map
            .get(req_id)
            .map_or(0, |s| s.ready)
    }

    /// The code of the first `ProxyFailed` received for `req_id`, if any.
    pub fn failure(&self, req_id: &str) -> Option<FailureCode> {
        self.shared.counts.lock().map.get(req_id)?.failed
    }

    /// Total `ProxyNotif`s received, and frames that were neither a
    /// ProxyNotif nor a ProxyFailed.
    pub fn totals(&self) -> (u64, u64) {
        let c = self.shared.counts.lock();
        (c.total, c.malformed)
    }

    /// Total `ProxyFailed`s received.
    pub fn failures_total(&self) -> u64 {
        self.shared.counts.lock().failures
    }

    /// Waits until `expected_notifs` notifications for `req_id` arrived
    /// (one per sender TP rank), a sender reported it failed
    /// ([`ProxyError::Failed`], at once: one failed rank fails the
    /// request), or `deadline` passes ([`ProxyError::Timeout`]).
    pub fn wait_ready(
        &self,
        req_id: &str,
        expected_notifs: usize,
        deadline: Instant,
    ) -> Result<(), ProxyError> {
        let settled = |c: &Counts| -> Option<Result<(), ProxyError>> {
            let seen = c.map.get(req_id).copied().unwrap_or_default();
            match seen.failed {
                Some(code) => Some(Err(ProxyError::Failed {
                    req_id: req_id.to_owned(),
                    code,
                })),
                None if seen.ready >= expected_notifs => Some(Ok(())),
                None => None,
            }
        };
        let mut c = self.shared.counts.lock();
        loop {
            if let Some(r) = settled(&c) {
                return r;
            }
            if c.shut_down {
                return Err(ProxyError::ShutDown);
            }
            if self.shared.cv.wait_until(&mut c, deadline).timed_out() {
                if let Some(r) = settled(&c) {
                    return r;
                }
                let got = c.map.get(req_id).map_or(0, |s| s.ready);
                return Err(ProxyError::Timeout {
                    req_id: req_id.to_owned(),
                    got,
                    expected: expected_notifs,
                });
            }
        }
    }

    /// Takes the next `ProxyNotif` in arrival order, waiting until
    /// `deadline`. Notifications not taken are kept (up to a bound).
    /// Failures are not in this stream: see [`ProxyListener::failure`] and
    /// [`ProxyListener::set_failure_callback`].
    pub fn next(&self, deadline: Instant) -> Option<Notification> {
        let mut c = self.shared.counts.lock();
        loop {
            if let Some(n) = c.pop_history() {
                return Some(n);
            }
            if c.shut_down || self.shared.cv.wait_until(&mut c, deadline).timed_out() {
                return c.pop_history();
            }
        }
    }

    /// Stops the listener thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        // Release: pairs with the Acquire load in `listen`.
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = crate::threads::join_within(
                t,
                crate::threads::STOP_JOIN_DEADLINE,
                "proxy listener",
            );
        }
        self.shared.counts.lock().shut_down = true;
        self.shared.cv.notify_all();
    }
}

impl Drop for ProxyListener {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

impl Counts {
    fn pop_history(&mut self) -> Option<Notification> {
        let n = self.history.pop_front()?;
        self.history_bytes -= notification_cost(&n);
        Some(n)
    }
}

fn listen(shared: Arc<Shared>, sock: zmq::Socket, mut reactor: Reactor) {
    let limits = Limits {
        max_frame_bytes: MAX_FRAME_BYTES,
        ..Limits::default()
    };
    // Acquire: pairs with the Release store in `stop_and_join`.
    while !shared.stop.load(Ordering::Acquire) {
        while readable(&sock) {
            let frame = match sock.recv_bytes(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => break,
                Err(e) => {
                    warn!(error = %e, "proxy receive failed");
                    break;
                }
            };
            let (req_id, failure) = match decode_with_limits(&frame, &limits) {
                Ok(Message::ProxyNotif(p)) => (p.req_id, None),
                Ok(Message::ProxyFailed(p)) => {
                    let mut reason = p.error.unwrap_or_default();
                    if reason.len() > MAX_REASON_BYTES {
                        let mut cut = MAX_REASON_BYTES;
                        while !reason.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        reason.truncate(cut);
                    }
                    let code = FailureCode::parse(&p.code);
                    (p.req_id, Some(Failure { code, reason }))
                }
                Ok(other) => {
                    debug!(
                        ?other,
                        "frame at the proxy that is no ProxyNotif/ProxyFailed ignored"
                    );
                    shared.counts.lock().malformed += 1;
                    continue;
                }
                Err(e) => {
                    debug!(error = %e, "undecodable frame at the proxy ignored");
                    shared.counts.lock().malformed += 1;
                    continue;
                }
            };
            let n = {
                let mut c = shared.counts.lock();
                match failure {
                    Some(_) => c.failures += 1,
                    None => c.total += 1,
                }
                let count = {
                    let e = c.map.get_or_insert_with(&req_id, Seen::default);
                    match &failure {
                        // The first failure is kept.
                        Some(f) => {
                            e.failed.get_or_insert(f.code);
                        }
                        None => e.ready += 1,
                    }
                    e.ready
                };
                if let Some(f) = &failure {
                    debug!(req_id, code = ?f.code, reason = %f.reason, "ProxyFailed");
                }
                let n = Notification {
                    req_id,
                    count,
                    at: Instant::now(),
                    failure,
                };
                if n.failure.is_none() {
                    c.history_bytes += notification_cost(&n);
                    c.history.push_back(n.clone());
                    while c.history_bytes > c.max_history_bytes {
                        c.pop_history();
                    }
                }
                n
            };
            shared.cv.notify_all();
            let callback = match n.failure {
                None => &shared.callback,
                Some(_) => &shared.failure_callback,
            };
            if let Some(cb) = callback.lock().as_ref() {
                cb(&n);
            }
        }
        if readable(&sock) {
            continue;
        }
        if let Err(e) = reactor.wait(Some(Duration::from_secs(3600))) {
            warn!(error = %e, "proxy poll failed");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = reactor.deregister(&sock);
}
