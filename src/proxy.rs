//! The proxy side: a [`ProxyListener`] that a request router embeds to learn
//! when a request's KV cache is in place at its decoder.
//!
//! Senders PUSH one `ProxyNotif` per request (per sender TP rank) to the
//! listener's bound PULL socket. Like LMCache's disaggregation proxy, the
//! listener counts notifications per `req_id`: with TP, a request is ready
//! once every rank's sender has reported, so callers say how many they expect.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tracing::{debug, warn};

use crate::protocol::{decode_with_limits, Limits, Message};
use crate::recent::RecentMap;
use crate::zmq_io::{readable, Reactor};

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

/// Charge of one kept notification.
fn notification_cost(n: &Notification) -> usize {
    n.req_id.len() + 64
}

/// One received notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The request.
    pub req_id: String,
    /// Notifications received for it so far (this one included).
    pub count: usize,
    /// When it arrived.
    pub at: Instant,
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
    /// The listener thread could not be started.
    #[error("cannot start the proxy listener thread: {0}")]
    Thread(#[from] std::io::Error),
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
    map: RecentMap<usize>,
    history: VecDeque<Notification>,
    /// Bytes charged for `history`.
    history_bytes: usize,
    /// Bound of `history_bytes`.
    max_history_bytes: usize,
    malformed: u64,
    total: u64,
    shut_down: bool,
}

struct Shared {
    counts: Mutex<Counts>,
    cv: Condvar,
    stop: AtomicBool,
    waker: Arc<mio::Waker>,
    callback: Mutex<Option<NotifCallback>>,
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
        // At most RECV_QUEUE frames wait per sender connection; past it ZMQ
        // stops reading that connection and the backlog stays on the
        // sender's side (kvferry senders never block on their PUSH).
        sock.set_rcvhwm(RECV_QUEUE).map_err(err)?;
        sock.bind(endpoint).map_err(err)?;
        let bound = match sock.get_last_endpoint() {
            Ok(Ok(e)) => e,
            _ => endpoint.to_owned(),
        };
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
                shut_down: false,
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            waker: reactor.waker(),
            callback: Mutex::new(None),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kvf-proxy".into())
                .spawn(move || listen(shared, sock, reactor))?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            endpoint: bound,
        })
    }

    /// The bound endpoint (actual port when `:0` was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sets a callback run on the listener thread for each notification.
    pub fn set_callback(&self, f: impl Fn(&Notification) + Send + Sync + 'static) {
        *self.shared.callback.lock() = Some(Box::new(f));
    }

    /// Notifications received so far for `req_id`.
    pub fn count(&self, req_id: &str) -> usize {
        self.shared
            .counts
            .lock()
            .map
            .get(req_id)
            .copied()
            .unwrap_or(0)
    }

    /// Total notifications received, and frames that were not a ProxyNotif.
    pub fn totals(&self) -> (u64, u64) {
        let c = self.shared.counts.lock();
        (c.total, c.malformed)
    }

    /// Waits until `expected_notifs` notifications for `req_id` arrived
    /// (one per sender TP rank) or `deadline` passes.
    pub fn wait_ready(
        &self,
        req_id: &str,
        expected_notifs: usize,
        deadline: Instant,
    ) -> Result<(), ProxyError> {
        let mut c = self.shared.counts.lock();
        loop {
            let got = c.map.get(req_id).copied().unwrap_or(0);
            if got >= expected_notifs {
                return Ok(());
            }
            if c.shut_down {
                return Err(ProxyError::ShutDown);
            }
            if self.shared.cv.wait_until(&mut c, deadline).timed_out() {
                let got = c.map.get(req_id).copied().unwrap_or(0);
                if got >= expected_notifs {
                    return Ok(());
                }
                return Err(ProxyError::Timeout {
                    req_id: req_id.to_owned(),
                    got,
                    expected: expected_notifs,
                });
            }
        }
    }

    /// Takes the next notification in arrival order, waiting until
    /// `deadline`. Notifications not taken are kept (up to a bound).
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
            let _ = t.join();
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
            let notif = match decode_with_limits(&frame, &limits) {
                Ok(Message::ProxyNotif(p)) => p,
                Ok(other) => {
                    debug!(?other, "non-ProxyNotif frame at the proxy ignored");
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
                c.total += 1;
                let count = {
                    let e = c.map.get_or_insert_with(&notif.req_id, || 0);
                    *e += 1;
                    *e
                };
                let n = Notification {
                    req_id: notif.req_id,
                    count,
                    at: Instant::now(),
                };
                c.history_bytes += notification_cost(&n);
                c.history.push_back(n.clone());
                while c.history_bytes > c.max_history_bytes {
                    c.pop_history();
                }
                n
            };
            shared.cv.notify_all();
            if let Some(cb) = shared.callback.lock().as_ref() {
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
