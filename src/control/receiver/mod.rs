//! The receiver (decode side): admission, slot allocation, key registration
//! and the decoder-facing API.
//!
//! [`Receiver::start`] creates the receive buffer (a shared-memory file a
//! same-host sender maps), binds a ZMQ ROUTER and starts the `ctrl` thread,
//! which owns the socket and feeds every message to the [`core`] state
//! machine. Decoder threads embedding the crate watch a request
//! ([`Receiver::watch`]: status, wait, eventfd) and take its chunks whole
//! ([`Receiver::take`]), or use the simple path ([`Receiver::wait_ready`],
//! [`Receiver::get`], [`Receiver::remove`]); those take the same lock as
//! the ctrl thread for a few hundred nanoseconds and hand any reply they cause
//! (a parked request granted because a slot was freed) to the ctrl thread
//! through an outbox and its waker.

mod acceptor;
pub mod bounds;
mod chunks;
/// The I/O-free state machine; public only for the model check in tests/model.
#[doc(hidden)]
pub mod core;
mod ctrl;
mod grants;
pub mod keys;
mod metrics;
mod owned;
mod ready;
mod tcp_data;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::protocol::{Descriptor, ErrorCode, Limits};
use crate::recent::RecentMap;
use crate::region::{default_region_path, Region, RegionError};
use crate::util::socket_file::SocketFile;
use crate::zmq_io::BindError;

use self::bounds::Bounds;
use self::core::{CoreConfig, Outcome, Output, ReceiverCore};

pub use self::core::{CoreStats, TakeError};
pub use crate::region::RecvBuffer;
pub use acceptor::{AcceptorFactory, HelloAcceptor};
pub use chunks::{ChunkView, RequestChunks};
pub use ready::{ReadyFeed, RequestHandle, RequestStatus};
pub use tcp_data::{TcpDataLimits, TcpDataStats};

/// Receiver configuration.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// ZMQ endpoint to bind, e.g. `tcp://127.0.0.1:7400` (port 0 picks one;
    /// see [`Receiver::endpoint`]).
    pub listen: String,
    /// More ZMQ endpoints the same socket binds (default none): e.g. an
    /// `inproc://` one for a sender in this process (`kvferry node`), next
    /// to a `tcp://` one for remote senders. [`Receiver::endpoint`] is
    /// still `listen`'s.
    pub also_listen: Vec<String>,
    /// Identity announced to kvferry senders.
    pub receiver_id: String,
    /// Slots in the receive buffer.
    pub capacity_chunks: usize,
    /// Bytes per slot (the largest chunk accepted), below 4 GiB.
    pub chunk_bytes: u64,
    /// How long a request may wait for admission (default 60 s).
    pub admission_timeout: Duration,
    /// Lease of an admitted request without progress (default 30 s).
    pub lease: Duration,
    /// Quarantine of slots whose writes may still land (default 10 s).
    pub quarantine_grace: Duration,
    /// Where to create the buffer file (default under `/dev/shm`); unused
    /// with a caller's buffer ([`Receiver::start_with_buffer`]).
    pub shm_path: Option<PathBuf>,
    /// Decoder limits for incoming frames.
    pub limits: Limits,
    /// Pin the ctrl thread to this CPU.
    pub pin_cpu: Option<usize>,
    /// Answer `Hello` (default `true`); `false` emulates an LMCache
    /// receiver, for tests and mixed deployments.
    pub answer_hello: bool,
    /// Release each request's chunks as soon as it is complete (a decoder
    /// that only counts; for load tests). Default `false`. Complete means
    /// its `TransferDone` arrived (kvferry senders), or `consume_grace`
    /// passed since its last batch was answered (LMCache senders and
    /// anonymous batches, which send no `TransferDone`).
    pub auto_consume: bool,
    /// With `auto_consume`: the grace after which an allocation without
    /// `TransferDone` counts as delivered (default 1 s; see
    /// `docs/protocol.md`, "Consuming without TransferDone").
    pub consume_grace: Duration,
    /// Also offer the TCP data plane: bind its listener here (port 0 picks
    /// one; see [`Receiver::tcp_data_addr`]). Default `None`: shm only.
    pub tcp_data: Option<SocketAddr>,
    /// The IP announced to senders for the TCP data plane, when it differs
    /// from the bound one (required when `tcp_data` binds a wildcard
    /// address such as `0.0.0.0`).
    pub tcp_data_advertise: Option<IpAddr>,
    /// Budgets and deadlines of the TCP data listener (see `docs/security.md`).
    pub tcp_data_limits: TcpDataLimits,
    /// Also offer a data plane set up per sender during `Hello` (RDMA:
    /// `AcceptorFactory::rdma` with the `rdma` feature). Built over the
    /// receive buffer at start; a failure (e.g. no RDMA device) fails
    /// [`Receiver::start`] with [`ReceiverError::Transport`]. Default `None`.
    pub acceptor: Option<AcceptorFactory>,
    /// Bounds in bytes on what peers can make the control plane hold
    /// (parked requests, records, per-peer state, anonymous allocations).
    pub bounds: Bounds,
    /// Incoming frames queued per peer connection, at most (the ROUTER's
    /// ZMQ receive high-water mark; default 64): past it ZMQ stops reading
    /// that connection — backpressure on that peer only, nothing is lost —
    /// so a peer's unread frames hold at most this many times
    /// `limits.max_frame_bytes`.
    pub recv_queue_per_peer: i32,
    /// Replies queued per peer connection, at most (the ROUTER's ZMQ send
    /// high-water mark; default 1024, well above one round of the ctrl
    /// loop, so a peer that reads is never affected). Past it — the peer
    /// does not read its replies — further replies to it are dropped and
    /// counted (`kvferry_receiver_replies_dropped_total`); nothing blocks,
    /// and its requests end by their lease or admission timeout.
    pub reply_queue_per_peer: i32,
    /// Release a complete request's chunks that the decoder neither took
    /// ([`Receiver::take`]) nor read by key this long after its
    /// `TransferDone` (counted in `requests_total["unconsumed_expired"]`,
    /// logged). Default `None`: kept until consumed.
    pub unconsumed_expiry: Option<Duration>,
    /// Offer kvferry senders on this host a Unix socket for their control
    /// messages (default `false`; `kvferry receiver` turns it on). With
    /// the shm data plane the `HelloAck` names an absolute `ipc://`
    /// endpoint of this receiver's socket: the first of `listen` and
    /// `also_listen`, or else, with this set, `ipc://{buffer file}.ctl`,
    /// bound at start (a path that cannot be bound is logged and skipped)
    /// and removed when the receiver is dropped. A kvferry sender that
    /// opened the buffer file then says `Hello` again on that socket and
    /// keeps its control messages off the loopback TCP stack
    /// (`docs/protocol.md`, "Local control").
    pub local_control: bool,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            listen: "tcp://127.0.0.1:0".into(),
            also_listen: Vec::new(),
            receiver_id: format!("receiver-{}", std::process::id()),
            capacity_chunks: 256,
            chunk_bytes: 256 * 1024,
            admission_timeout: Duration::from_secs(60),
            lease: Duration::from_secs(30),
            quarantine_grace: Duration::from_secs(10),
            shm_path: None,
            limits: Limits::default(),
            pin_cpu: None,
            answer_hello: true,
            auto_consume: false,
            consume_grace: Duration::from_secs(1),
            tcp_data: None,
            tcp_data_advertise: None,
            tcp_data_limits: TcpDataLimits::default(),
            acceptor: None,
            bounds: Bounds::default(),
            recv_queue_per_peer: 64,
            reply_queue_per_peer: 1024,
            unconsumed_expiry: None,
            local_control: false,
        }
    }
}

/// Errors starting a receiver.
#[derive(Debug, thiserror::Error)]
pub enum ReceiverError {
    /// Invalid configuration.
    #[error("invalid receiver configuration: {0}")]
    Config(String),
    /// The receive buffer could not be created.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The ZMQ socket could not be created or bound.
    #[error("cannot listen on {endpoint}: {source}")]
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
    /// they are; a socket nobody serves (a receiver that died) is replaced.
    #[error("cannot listen on {endpoint}: {source}")]
    SocketFile {
        /// The endpoint.
        endpoint: String,
        /// Why the path is not free.
        #[source]
        source: std::io::Error,
    },
    /// The ctrl thread or its poller could not be started.
    #[error("cannot start the receiver's control thread: {0}")]
    Thread(#[from] std::io::Error),
    /// The TCP data listener could not be bound or started.
    #[error("cannot serve the tcp data plane on {addr}: {source}")]
    TcpData {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The per-sender data plane ([`ReceiverConfig::acceptor`]) could not be
    /// set up, e.g. there is no RDMA device.
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
}

/// Why [`Receiver::wait_ready`] returned without the request being ready.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WaitError {
    /// The deadline passed first.
    #[error("request not ready before the deadline")]
    Timeout,
    /// The request failed or was cancelled.
    #[error("request ended without its data: {}", .0.as_str())]
    Failed(ErrorCode),
    /// The receiver is shutting down.
    #[error("receiver shut down")]
    ShutDown,
}

/// A snapshot of the receiver's accounting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Slots in the buffer.
    pub capacity_chunks: usize,
    /// Chunks reserved by admitted requests but not yet allocated.
    pub reserved_chunks: usize,
    /// Slots allocated (written, being written, quarantined or awaiting the
    /// decoder).
    pub allocated_chunks: usize,
    /// Core counters and gauges.
    pub core: CoreStats,
    /// Messages that could not be decoded.
    pub bad_frames: u64,
    /// Replies dropped: the peer's reply queue was full (it does not read
    /// its replies) or the peer was gone.
    pub replies_dropped: u64,
}

/// Bytes of finished request ids (and outcomes) `wait_ready` remembers:
/// 65,536 ids of 64 bytes, fewer longer ones.
const FINISHED_MEMORY_BYTES: usize = 16 << 20;

/// `ZMQ_MAXMSGSIZE` for a socket whose frames are decoded with `limits`:
/// the frame limit itself (the decoder would refuse anything larger).
pub(crate) fn max_msg_size(limits: &Limits) -> i64 {
    i64::try_from(limits.max_frame_bytes).unwrap_or(i64::MAX)
}

/// State behind the receiver's one lock.
#[derive(Debug)]
pub(crate) struct State {
    core: ReceiverCore,
    /// Outcomes of finished requests, for `wait_ready` (first outcome wins).
    finished: RecentMap<Outcome>,
    /// Decoder handles waiting for requests to end.
    watchers: ready::Watchers,
    /// Replies produced outside the ctrl thread, for it to send.
    outbox: Vec<Output>,
    admission_wait_us: hdrhistogram::Histogram<u64>,
    bad_frames: u64,
    /// Replies dropped because the peer's reply queue was full (it does not
    /// read) or the peer was gone.
    replies_dropped: u64,
    shut_down: bool,
}

impl State {
    /// Moves `Finished` outputs into the finished log; returns whether any
    /// arrived. `Send` outputs stay in `out`.
    fn absorb(&mut self, out: &mut Vec<Output>) -> bool {
        let mut any = false;
        out.retain(|o| match o {
            Output::Finished { req_id, outcome } => {
                self.finished.get_or_insert_with(req_id, || *outcome);
                self.watchers.finished(req_id, *outcome);
                any = true;
                false
            }
            Output::Send { .. } | Output::ForgetPeer { .. } => true,
        });
        for w in self.core.take_admission_waits() {
            let _ = self
                .admission_wait_us
                .record(w.as_micros().min(u128::from(u64::MAX)) as u64);
        }
        any
    }
}

pub(crate) struct Shared {
    state: Mutex<State>,
    finished_cv: Condvar,
    /// Shared with the RDMA memory region registered over it, if any.
    region: Arc<Region>,
    waker: Arc<mio::Waker>,
    stop: AtomicBool,
}

/// A running receiver. Dropping it stops the ctrl thread and removes the
/// buffer file it created (once every [`ChunkRef`] is gone; a caller's
/// [`RecvBuffer`] is left alone).
///
/// One per decode process: it admits requests against its buffer (whole
/// requests, in arrival order), grants slots and tells the decoder when a
/// request's chunks are in place.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvferry::receiver::RequestStatus as Ready;
/// use kvferry::{Receiver, ReceiverConfig};
///
/// let receiver = Receiver::start(ReceiverConfig {
///     listen: "tcp://127.0.0.1:0".into(), // port 0: any free port
///     capacity_chunks: 16,
///     chunk_bytes: 4096,
///     ..Default::default()
/// })?;
/// let endpoint = receiver.endpoint(); // hand this to the prefill side
/// # let sender = kvferry::Sender::new(kvferry::SenderConfig { chunk_bytes: 4096, ..Default::default() })?;
/// # let req = sender.begin(kvferry::RequestSpec::new("req-3", endpoint, 2))?;
/// # req.store(&["req-3/0", "req-3/1"], &[&[1u8; 4096][..], &[2u8; 7][..]])?;
///
/// // From an event loop: poll `ready.as_fd()`, then read the status.
/// let ready = receiver.watch("req-3")?;
/// ready.wait(Instant::now() + Duration::from_secs(20))?;
/// assert_eq!(ready.status(), Ready::Ready);
///
/// // The chunks, in key order, borrowed in place with their exact lengths.
/// let chunks = receiver.take("req-3")?;
/// let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
/// assert_eq!(lens, [4096, 7]);
/// drop(chunks); // releases both slots
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Receiver {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// `listen`'s bound endpoint.
    endpoint: String,
    /// `also_listen`'s, in order.
    also_endpoints: Vec<String>,
    /// The endpoint offered to same-host senders ([`ReceiverConfig::local_control`]).
    control: Option<String>,
    tcp: Option<tcp_data::TcpData>,
    /// The files of its `ipc://` endpoints: removed after `Drop` joined the
    /// ctrl thread (which owns the socket).
    _socket_files: Vec<SocketFile>,
}

/// True for an endpoint a sender on this host can reach whatever its
/// working directory: `ipc://` with an absolute path.
fn is_local_control(endpoint: &str) -> bool {
    endpoint.starts_with("ipc:///")
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("endpoint", &self.endpoint)
            .field("also_endpoints", &self.also_endpoints)
            .field("control", &self.control)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// Creates the buffer, binds the socket and starts the ctrl thread. When
    /// this returns, the receiver accepts messages.
    pub fn start(cfg: ReceiverConfig) -> Result<Self, ReceiverError> {
        Self::start_over(cfg, None)
    }

    /// [`Receiver::start`] over memory the caller provides: chunks land in
    /// `buffer` (see [`RecvBuffer`] and `docs/receiver.md`). A file buffer
    /// is offered to same-host senders as the shm data plane (and to tcp and
    /// rdma); memory at a pointer has no shm path, so `cfg` must offer
    /// `tcp_data` or an `acceptor`, and the first of those is announced as
    /// the receiver's transport.
    ///
    /// Errors as [`Receiver::start`], and [`ReceiverError::Region`] with
    /// [`RegionError::Misaligned`] or [`RegionError::TooSmall`] for a buffer
    /// that does not fit `capacity_chunks * chunk_bytes`;
    /// [`ReceiverError::Config`] for pointer memory without tcp or an
    /// acceptor.
    pub fn start_with_buffer(
        cfg: ReceiverConfig,
        buffer: RecvBuffer,
    ) -> Result<Self, ReceiverError> {
        Self::start_over(cfg, Some(buffer))
    }

    fn start_over(cfg: ReceiverConfig, buffer: Option<RecvBuffer>) -> Result<Self, ReceiverError> {
        if cfg.capacity_chunks == 0 || cfg.capacity_chunks > u32::MAX as usize {
            return Err(ReceiverError::Config(format!(
                "capacity_chunks must be in 1..={}, got {}",
                u32::MAX,
                cfg.capacity_chunks
            )));
        }
        // A chunk's length is 32 bits wherever it travels (the sender's
        // `lens`, the TCP data plane's header, the attach rings' CHUNK).
        if cfg.chunk_bytes == 0 || cfg.chunk_bytes > u64::from(u32::MAX) {
            return Err(ReceiverError::Config(format!(
                "chunk_bytes must be in 1..={}, got {}",
                u32::MAX,
                cfg.chunk_bytes
            )));
        }
        cfg.tcp_data_limits
            .validate()
            .map_err(ReceiverError::Config)?;
        let tcp_listener = match cfg.tcp_data {
            Some(at) => {
                let tcp_error = |source| ReceiverError::TcpData { addr: at, source };
                let l = tcp_data::TcpData::bind(at).map_err(tcp_error)?;
                let bound = l.local_addr().map_err(tcp_error)?;
                let ip = cfg.tcp_data_advertise.unwrap_or(bound.ip());
                if ip.is_unspecified() {
                    return Err(ReceiverError::Config(format!(
                        "tcp_data binds the wildcard address {bound}: set tcp_data_advertise to the IP senders should use"
                    )));
                }
                Some((l, SocketAddr::new(ip, bound.port())))
            }
            None => None,
        };
        let region = Arc::new(match buffer {
            Some(b) => Region::from_buffer(b, cfg.chunk_bytes, cfg.capacity_chunks as u64)?,
            None => {
                let path = cfg.shm_path.clone().unwrap_or_else(default_region_path);
                Region::create(&path, cfg.chunk_bytes, cfg.capacity_chunks as u64)?
            }
        });
        let acceptor = match &cfg.acceptor {
            Some(f) => Some(f.build(Arc::clone(&region))?),
            None => None,
        };
        let mut offers: Vec<(String, Descriptor)> = tcp_listener
            .iter()
            .map(|(_, addr)| {
                (
                    "tcp".to_owned(),
                    Descriptor::Tcp {
                        addr: addr.to_string(),
                        // Issued per sender at Hello.
                        secret: None,
                    },
                )
            })
            .collect();
        // The transport a Hello that asks for none of the offers is answered
        // with: shm over a file; without one, tcp, else the acceptor's.
        let (transport, descriptor) = match (region.file_path(), &acceptor) {
            (Some(path), _) => (
                "shm".to_owned(),
                Descriptor::Shm {
                    path: path.to_string_lossy().into_owned(),
                    len: region.data_len(),
                },
            ),
            (None, _) if !offers.is_empty() => offers.remove(0),
            (None, Some(a)) => (a.kind().to_owned(), Descriptor::None),
            (None, None) => {
                return Err(ReceiverError::Config(
                    "a receive buffer without a file has no shm data plane: offer tcp_data or an acceptor".into(),
                ))
            }
        };
        let sock = crate::zmq_io::context()
            .socket(zmq::ROUTER)
            .map_err(|source| ReceiverError::Bind {
                endpoint: cfg.listen.clone(),
                source,
            })?;
        let bind = |source| ReceiverError::Bind {
            endpoint: cfg.listen.clone(),
            source,
        };
        sock.set_linger(0).map_err(bind)?;
        // Incoming: no frame larger than the decoder accepts is ever
        // buffered (ZMQ drops the connection of a peer that sends one).
        sock.set_maxmsgsize(max_msg_size(&cfg.limits))
            .map_err(bind)?;
        sock.set_handshake_ivl(crate::zmq_io::HANDSHAKE_TIMEOUT_MS)
            .map_err(bind)?;
        sock.set_rcvhwm(cfg.recv_queue_per_peer.max(1))
            .map_err(bind)?;
        // Outgoing: a bounded queue per peer; with ROUTER_MANDATORY a full
        // queue is EAGAIN on a non-blocking send (counted, dropped) instead
        // of a silent drop, and never blocks the ctrl thread.
        sock.set_sndhwm(cfg.reply_queue_per_peer.max(1))
            .map_err(bind)?;
        sock.set_router_mandatory(true).map_err(bind)?;
        // Each endpoint as bound; the files of `ipc://` ones are removed
        // when the receiver is dropped.
        let mut socket_files = Vec::new();
        let mut bind_one = |listen: &String| match crate::zmq_io::bind(&sock, listen) {
            Ok(b) => {
                socket_files.extend(b.file);
                Ok(b.endpoint)
            }
            Err(BindError::SocketFile(source)) => Err(ReceiverError::SocketFile {
                endpoint: listen.clone(),
                source,
            }),
            Err(BindError::Zmq(source)) => Err(ReceiverError::Bind {
                endpoint: listen.clone(),
                source,
            }),
        };
        let endpoint = bind_one(&cfg.listen)?;
        let also_endpoints = cfg
            .also_listen
            .iter()
            .map(&mut bind_one)
            .collect::<Result<Vec<_>, _>>()?;
        let control = match std::iter::once(&endpoint)
            .chain(&also_endpoints)
            .find(|e| is_local_control(e))
        {
            Some(e) => Some(e.clone()),
            None => match region.file_path() {
                Some(file) if cfg.local_control && transport == "shm" => {
                    let ep = format!("ipc://{}.ctl", file.display());
                    bind_one(&ep)
                        .inspect_err(|e| {
                            tracing::warn!(error = %e, "no local control socket for same-host senders")
                        })
                        .ok()
                        .filter(|e| is_local_control(e))
                }
                _ => None,
            },
        };
        let reactor = crate::zmq_io::Reactor::new()?;
        reactor.register(&sock, ctrl::SOCKET_TOKEN)?;
        let now = Instant::now();
        let mut core = ReceiverCore::new(
            CoreConfig {
                receiver_id: cfg.receiver_id.clone(),
                capacity_chunks: cfg.capacity_chunks,
                chunk_bytes: cfg.chunk_bytes,
                admission_timeout: cfg.admission_timeout,
                lease: cfg.lease,
                quarantine_grace: cfg.quarantine_grace,
                transport,
                descriptor,
                other_transports: offers,
                answer_hello: cfg.answer_hello,
                auto_consume: cfg.auto_consume,
                bounds: cfg.bounds.clone(),
                consume_grace: cfg.consume_grace,
            },
            now,
        );
        if let Some(a) = acceptor {
            core = core.with_acceptor(a);
        }
        core = core.with_control(control.clone());
        core = core.with_unconsumed_lifetime(cfg.unconsumed_expiry);
        let admission_wait_us = hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3)
            .map_err(|e| ReceiverError::Config(format!("histogram: {e}")))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core,
                finished: RecentMap::new(FINISHED_MEMORY_BYTES),
                watchers: ready::Watchers::default(),
                outbox: Vec::new(),
                admission_wait_us,
                bad_frames: 0,
                replies_dropped: 0,
                shut_down: false,
            }),
            finished_cv: Condvar::new(),
            region,
            waker: reactor.waker(),
            stop: AtomicBool::new(false),
        });
        let tcp = match tcp_listener {
            Some((listener, addr)) => {
                let grants = Arc::clone(shared.state.lock().core.grant_table());
                let name = format!("kvf-recv-tcp-{}", cfg.receiver_id);
                Some(
                    tcp_data::TcpData::start(
                        listener,
                        addr,
                        Arc::clone(&shared),
                        grants,
                        cfg.tcp_data_limits.clone(),
                        name,
                    )
                    .map_err(|source| ReceiverError::TcpData { addr, source })?,
                )
            }
            None => None,
        };
        let thread = {
            let shared = Arc::clone(&shared);
            let limits = cfg.limits.clone();
            let name = format!("kvf-recv-ctrl-{}", cfg.receiver_id);
            crate::threads::spawn_named(&name, cfg.pin_cpu, move || {
                ctrl::run(shared, sock, reactor, limits)
            })?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            endpoint,
            also_endpoints,
            control,
            tcp,
            _socket_files: socket_files,
        })
    }

    /// The address of the TCP data listener announced to senders (with the
    /// actual port when port 0 was asked for); `None` without `tcp_data`.
    pub fn tcp_data_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().map(|t| t.addr())
    }

    /// TCP data connections open now (0 without `tcp_data`).
    pub fn tcp_data_connections(&self) -> usize {
        self.tcp.as_ref().map_or(0, |t| t.connections())
    }

    /// Counters and gauges of the TCP data listener (all zero without
    /// `tcp_data`).
    pub fn tcp_data_stats(&self) -> TcpDataStats {
        self.tcp.as_ref().map(|t| t.stats()).unwrap_or_default()
    }

    /// Closes every TCP data connection at once, as a network failure
    /// would (asynchronous: the data thread does it at its next wake-up).
    /// The senders' writes in flight on them fail with `ConnectionLost`
    /// and their requests abort; the senders reconnect for new writes. For
    /// fault tests and operators.
    pub fn cut_tcp_data_connections(&self) {
        if let Some(t) = &self.tcp {
            t.cut();
        }
    }

    /// The bound endpoint (with the actual port when `:0` was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The `ipc://` endpoint a shm `HelloAck` offers kvferry senders on
    /// this host for their control messages ([`ReceiverConfig::local_control`]),
    /// if any.
    pub fn control_endpoint(&self) -> Option<&str> {
        self.control.as_deref()
    }

    /// The endpoints bound for [`ReceiverConfig::also_listen`], in its
    /// order (with the actual port when `:0` was asked for).
    pub fn also_endpoints(&self) -> &[String] {
        &self.also_endpoints
    }

    /// The shared-memory file holding the receive buffer, as senders open
    /// it; empty for caller memory at a pointer ([`RecvBuffer::from_raw`]),
    /// which has none.
    pub fn shm_path(&self) -> &Path {
        self.shared.region.path()
    }

    /// The receive buffer.
    pub fn region(&self) -> &Region {
        &self.shared.region
    }

    /// A handle on `req_id`'s readiness: a status that never blocks, a wait
    /// with a deadline, and an fd for event loops (see [`RequestHandle`];
    /// it may be made before the request exists). Errors: the eventfd could
    /// not be created.
    pub fn watch(&self, req_id: &str) -> std::io::Result<RequestHandle> {
        RequestHandle::new(&self.shared, req_id)
    }

    /// Like [`watch`](Self::watch), but the handle signals `fd`, which many
    /// handles may share, instead of an eventfd of its own (and its
    /// [`AsFd`](std::os::fd::AsFd) is `fd`): one descriptor for an event
    /// loop watching many requests, and no eventfd made and closed per
    /// request (the attach daemon's decoder sessions). Whoever polls `fd`
    /// clears it, then reads each handle's status: the outcome is set
    /// before the signal, and an end signalled after the clear leaves `fd`
    /// readable.
    pub(crate) fn watch_signalling(
        &self,
        req_id: &str,
        fd: &Arc<crate::eventfd::EventFd>,
    ) -> RequestHandle {
        RequestHandle::signalling(&self.shared, req_id, Arc::clone(fd))
    }

    /// A [`ReadyFeed`] of the ids of requests that become ready from now
    /// on, at most `max` waiting. Errors: the eventfd could not be created.
    pub fn ready_feed(&self, max: usize) -> std::io::Result<ReadyFeed> {
        ReadyFeed::new(&self.shared, max)
    }

    /// Borrows every chunk of the complete request `req_id` in place, in
    /// key order, with exact lengths and token counts; dropping the
    /// [`RequestChunks`] releases them all. A request is taken once, and
    /// only after its `TransferDone` (so its bytes are whole).
    ///
    /// Errors: [`TakeError::NotReady`] (in flight, failed, already taken,
    /// expired, an LMCache request — read those by key —, or
    /// `auto_consume`), [`TakeError::Ambiguous`] (several peers completed a
    /// request of that id), [`TakeError::Consumed`] (a chunk was read or
    /// removed by key already).
    pub fn take(&self, req_id: &str) -> Result<RequestChunks, TakeError> {
        let chunks = self.shared.state.lock().core.take(req_id)?;
        Ok(RequestChunks::new(
            Arc::clone(&self.shared),
            req_id.to_owned(),
            chunks,
        ))
    }

    /// The simple path: waits until `req_id` is complete (its sender's
    /// `TransferDone`, or the last batch of an LMCache sender, whose
    /// completion only the proxy learns) or failed, or `deadline` passes.
    /// Event loops use [`Receiver::watch`] instead.
    pub fn wait_ready(&self, req_id: &str, deadline: Instant) -> Result<(), WaitError> {
        let mut st = self.shared.state.lock();
        loop {
            match st.finished.get(req_id) {
                Some(Outcome::Ready) => return Ok(()),
                Some(Outcome::Failed(code)) => return Err(WaitError::Failed(*code)),
                None => {}
            }
            if st.shut_down {
                return Err(WaitError::ShutDown);
            }
            if self
                .shared
                .finished_cv
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                return match st.finished.get(req_id) {
                    Some(Outcome::Ready) => Ok(()),
                    Some(Outcome::Failed(code)) => Err(WaitError::Failed(*code)),
                    None => Err(WaitError::Timeout),
                };
            }
        }
    }

    /// The simple path: borrows the bytes of a ready key (requests are
    /// taken whole with [`Receiver::take`]). Each borrow claims one of the key's
    /// references; dropping the [`ChunkRef`] releases it (like `remove`), and
    /// the slot is freed with the last reference. `None` if the key is not
    /// held, not yet written, or every reference is already borrowed. When
    /// two requests wrote the same key concurrently it has two copies (same
    /// bytes, separate slots); the oldest written copy with an unclaimed
    /// reference is borrowed.
    pub fn get(&self, key: &str) -> Option<ChunkRef> {
        let b = self.shared.state.lock().core.borrow(key)?;
        Some(ChunkRef {
            shared: Arc::clone(&self.shared),
            key: key.to_owned(),
            gen: b.gen,
            slot: b.slot,
            len: b.len,
            tokens: b.tokens,
        })
    }

    /// Drops one (unborrowed) reference of `key` (of the copy [`Receiver::get`]
    /// would read when it has one). Returns false if the key is not held or
    /// all its references are borrowed.
    pub fn remove(&self, key: &str) -> bool {
        let mut st = self.shared.state.lock();
        let mut out = Vec::new();
        let removed = st.core.remove_key(key, Instant::now(), &mut out);
        self.shared.post(&mut st, out);
        removed
    }

    /// A snapshot of the accounting.
    pub fn stats(&self) -> ReceiverStats {
        let st = self.shared.state.lock();
        let l = st.core.ledger().stats();
        ReceiverStats {
            capacity_chunks: l.capacity,
            reserved_chunks: l.reserved,
            allocated_chunks: l.allocated,
            core: st.core.stats(),
            bad_frames: st.bad_frames,
            replies_dropped: st.replies_dropped,
        }
    }

    /// How long requests waited for admission, from their first batch to
    /// the grant: count, median, p99, largest and mean, in microseconds.
    pub fn admission_wait(&self) -> crate::stats::LatencySummary {
        crate::stats::LatencySummary::of(&self.shared.state.lock().admission_wait_us)
    }

    /// A copy of the admission-wait histogram (microseconds), for the
    /// metrics endpoint's buckets.
    pub(crate) fn admission_wait_histogram(&self) -> hdrhistogram::Histogram<u64> {
        self.shared.state.lock().admission_wait_us.clone()
    }

    /// Stops the ctrl thread and waits for it.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        // Release: pairs with the Acquire load in the ctrl loop, so the
        // thread that sees `stop` also sees everything done before it.
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ =
                crate::threads::join_within(t, crate::threads::STOP_JOIN_DEADLINE, "receiver ctrl");
        }
        if let Some(mut tcp) = self.tcp.take() {
            tcp.stop();
        }
        let mut st = self.shared.state.lock();
        st.shut_down = true;
        st.watchers.shut_down();
        drop(st);
        self.shared.finished_cv.notify_all();
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

impl Shared {
    /// The first `len` bytes of `slot` (at most a slot; empty if the slot
    /// does not exist).
    ///
    /// # Safety
    /// The caller holds a borrow of a ready copy in `slot` (its writer
    /// completed and no grant lets anyone write it while a reference is
    /// held) for as long as the returned slice lives.
    unsafe fn slot_bytes(&self, slot: u32, len: u64) -> &[u8] {
        let len = len.min(self.region.chunk_bytes()) as usize;
        match self.region.slot_ptr(slot) {
            // SAFETY: the slot exists (ptr is Some) and `len` is at most its
            // size; the caller's borrow keeps it from being freed, reused or
            // written while the slice lives.
            Some(ptr) => unsafe { std::slice::from_raw_parts(ptr, len) },
            None => &[],
        }
    }

    /// Takes outputs produced outside the ctrl thread: records finished
    /// requests and queues replies for the ctrl thread, waking it.
    fn post(&self, st: &mut State, mut out: Vec<Output>) {
        if st.absorb(&mut out) {
            self.finished_cv.notify_all();
        }
        if !out.is_empty() {
            st.outbox.append(&mut out);
            let _ = self.waker.wake();
        }
    }
}

/// A borrowed chunk in the receive buffer. Dropping it releases the
/// reference it claimed.
pub struct ChunkRef {
    shared: Arc<Shared>,
    key: String,
    /// Generation of the copy borrowed (a key may have several copies).
    gen: u64,
    slot: u32,
    /// The chunk's length in bytes.
    len: u64,
    tokens: Option<u32>,
}

impl std::fmt::Debug for ChunkRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkRef")
            .field("key", &self.key)
            .field("slot", &self.slot)
            .finish()
    }
}

impl ChunkRef {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The slot index in the receive buffer.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Token count if this was a batch's (possibly short) last chunk.
    pub fn tokens(&self) -> Option<u32> {
        self.tokens
    }

    /// The chunk's bytes: exactly its length (see [`ChunkRef::len`]).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: this borrow holds a reference of a ready copy in
        // `self.slot` (`KeyTable::borrow`) until `self` drops, which
        // outlives the slice.
        unsafe { self.shared.slot_bytes(self.slot, self.len) }
    }

    /// The chunk's length in bytes: what its batch declared (a full chunk
    /// of its shape, or a one-dimensional shape's short last chunk of
    /// `last_chunk_toks`).
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    /// True for a zero-length chunk.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for ChunkRef {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        let mut out = Vec::new();
        st.core
            .end_borrow(&self.key, self.gen, Instant::now(), &mut out);
        self.shared.post(&mut st, out);
    }
}

#[cfg(test)]
mod acceptor_tests;
#[cfg(test)]
mod core_tests;
