//! The TCP transport (many hosts, no RDMA): each write is framed onto one
//! data connection per receiver — a small header (slot offset, length, work
//! id) and the payload, read straight from the staging buffer — and the
//! receiver's data thread lands it in its buffer and acks it.
//!
//! One engine thread (`kvf-tcp-engine`) plays the NIC for every peer: it
//! owns the sockets (non-blocking, in one mio poll set), takes ops from a
//! submission ring filled by the [`Poster`](crate::transport::Poster) (ctrl
//! thread) and posts completions to a completion ring drained by the
//! [`Completions`](crate::transport::Completions) half (poll thread). So the
//! ctrl thread never blocks on a socket: a post is a ring push and a waker
//! write; only [`Poster::connect`](crate::transport::Poster::connect) waits,
//! bounded by the connect timeout, for the first connection to a receiver.
//!
//! Connection loss fails every op posted to that connection and not yet
//! acked with [`CompletionStatus::ConnectionLost`](crate::transport::CompletionStatus);
//! the next op posted to the peer opens a new connection. A connection the
//! engine itself gives up on (no progress, broken acks) completes its
//! written ops only once the receiver has closed it, so no byte of a
//! `ConnectionLost` write can land afterwards. See
//! `docs/transport.md` ("TCP") for the wire format and the fencing argument.
//!
//! The receiver's half lives in `crate::receiver` (the data listener that
//! [`ReceiverConfig::tcp_data`](crate::receiver::ReceiverConfig) enables).

mod completions;
mod engine;
mod link;
mod poster;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::protocol::Descriptor;
use crate::staging::StagingBuffer;

use super::config::MAX_RING_CAPACITY;
use super::{Started, Transport, TransportConfig, TransportError};

use completions::TcpCompletions;
use engine::{Engine, Shared};
use poster::TcpPoster;

/// Name of the engine thread.
pub const ENGINE_THREAD_NAME: &str = "kvf-tcp-engine";

/// Default bound on opening a data connection (TCP connect + preamble).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Default bound on a busy connection making no progress (no byte written,
/// no ack read) before it is declared lost.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The TCP transport, before [`Transport::start`].
#[derive(Debug, Clone)]
pub struct TcpTransport {
    ring_capacity: usize,
    pin_cpu: Option<usize>,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl TcpTransport {
    /// Validates `cfg` (ring capacity at least 1 and at most
    /// [`MAX_RING_CAPACITY`]); `cfg.fault` is ignored here (see
    /// [`super::by_name`]). Timeouts are [`DEFAULT_CONNECT_TIMEOUT`] and
    /// [`DEFAULT_IO_TIMEOUT`].
    pub fn new(cfg: &TransportConfig) -> Result<Self, TransportError> {
        if cfg.ring_capacity == 0 || cfg.ring_capacity > MAX_RING_CAPACITY {
            return Err(TransportError::Config(format!(
                "ring_capacity {} must be in 1..={}",
                cfg.ring_capacity, MAX_RING_CAPACITY
            )));
        }
        Ok(Self {
            ring_capacity: cfg.ring_capacity,
            pin_cpu: cfg.pin_cpu,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
        })
    }

    /// Sets the connect and I/O timeouts (both must be positive, else
    /// [`TransportError::Config`]).
    pub fn with_timeouts(
        mut self,
        connect: Duration,
        io: Duration,
    ) -> Result<Self, TransportError> {
        if connect.is_zero() || io.is_zero() {
            return Err(TransportError::Config(
                "tcp connect and io timeouts must be positive".into(),
            ));
        }
        self.connect_timeout = connect;
        self.io_timeout = io;
        Ok(self)
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn local_descriptor(&self) -> Descriptor {
        Descriptor::None
    }

    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
        let super::EngineRings {
            sq_tx,
            sq_rx,
            cq_tx,
            cq_rx,
            credits,
        } = super::EngineRings::new(self.ring_capacity)?;
        let poll = mio::Poll::new()?;
        let waker = Arc::new(mio::Waker::new(poll.registry(), engine::WAKE_TOKEN)?);
        let shared = Arc::new(Shared {
            cmds: Mutex::new(Vec::new()),
            returned: Default::default(),
        });
        let engine = Engine::new(
            poll,
            sq_rx,
            cq_tx,
            local,
            shared.clone(),
            self.connect_timeout,
            self.io_timeout,
        );
        let handle =
            crate::threads::spawn_named(ENGINE_THREAD_NAME, self.pin_cpu, move || engine.run())?;
        let poster = TcpPoster::new(
            sq_tx,
            shared.clone(),
            waker,
            credits,
            handle,
            self.connect_timeout,
            self.io_timeout,
        );
        let completions = TcpCompletions { cq: cq_rx, shared };
        Ok((Box::new(poster), Box::new(completions)))
    }
}
