//! The data plane: one [`Transport`] trait over shared memory (`shm`), TCP
//! and RDMA, in the shape of an RDMA NIC's queues.
//!
//! A transport is started once over the sender's [`StagingBuffer`] and splits
//! into two halves that live on different threads:
//!
//! - the [`Poster`] (the sender's `ctrl` thread) connects to receivers'
//!   buffers and posts [`WriteOp`]s without blocking;
//! - the [`Completions`] half (the sender's `poll` thread) waits for and
//!   collects one [`Completion`] per posted op.
//!
//! Credits: a poster accepts at most [`Poster::credits`] ops that have not
//! been returned by [`Completions::poll`] yet, which is the capacity of the
//! completion ring, so that ring can never overflow and the engine never
//! blocks on it. See `docs/transport.md`.

mod coalesce;
mod config;
mod credits;
mod error;
pub mod fault;
mod op;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
pub mod tcp;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use coalesce::coalesce;
pub use config::{TransportConfig, DEFAULT_RING_CAPACITY, MAX_RING_CAPACITY};
pub use error::TransportError;
pub use fault::{FaultConfig, FaultTransport};
pub use op::{Completion, CompletionStatus, PeerIndex, WriteOp};

use crate::protocol::Descriptor;
use crate::staging::StagingBuffer;

/// What a sender knows about a receiver's buffer (from `HelloAck`, or
/// configured statically for peers that do not answer `Hello`).
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteBuffer {
    /// How to reach the buffer.
    pub descriptor: Descriptor,
    /// Bytes per slot.
    pub chunk_bytes: u64,
    /// Number of slots.
    pub capacity_chunks: u64,
}

/// The two halves of a started transport: the posting half (for the
/// sender's ctrl thread) and the completion half (for its poll thread).
pub type Started = (Box<dyn Poster>, Box<dyn Completions>);

/// A data-plane transport before it is started.
pub trait Transport: Send {
    /// `"shm"`, `"tcp"` or `"rdma"`.
    fn kind(&self) -> &'static str;

    /// What the sender puts in its `Hello` (shm: [`Descriptor::None`]).
    fn local_descriptor(&self) -> Descriptor;

    /// Starts the data plane over `local`, the staging buffer writes are read
    /// from. Returns the posting half (owned by the sender's ctrl thread) and
    /// the completion half (owned by the sender's poll thread).
    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError>;
}

/// The posting half of a started transport. Dropping it closes the data
/// plane: ops already posted still complete, then [`Completions::poll`]
/// returns [`PollStatus::Closed`].
pub trait Poster: Send {
    /// Attaches to a receiver's buffer and returns the index to put in
    /// [`WriteOp::peer`]. Typed error if the descriptor is not this
    /// transport's kind or the buffer does not match the announced geometry.
    fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError>;

    /// Prepares this side of the data plane to one new receiver and returns
    /// the descriptor to send in its `Hello`. The sender's ctrl thread calls
    /// it once per receiver, keeps the result with that receiver, and hands
    /// it back to [`Poster::connect_prepared`] with the `HelloAck`.
    ///
    /// Default: [`Descriptor::None`] (shm and tcp need nothing per
    /// receiver). RDMA creates a queue pair for that receiver.
    fn prepare(&mut self) -> Result<Descriptor, TransportError> {
        Ok(Descriptor::None)
    }

    /// Connects the receiver that answered the `Hello` carrying `prepared`
    /// (what [`Poster::prepare`] returned) with `remote`, and returns the
    /// index to put in [`WriteOp::peer`].
    ///
    /// Default: [`Poster::connect`]`(remote)`.
    fn connect_prepared(
        &mut self,
        prepared: &Descriptor,
        remote: &RemoteBuffer,
    ) -> Result<PeerIndex, TransportError> {
        let _ = prepared;
        self.connect(remote)
    }

    /// Gives up what [`Poster::prepare`] set up for a receiver that will not
    /// be connected with it (its `Hello` went unanswered, was refused, or
    /// named another transport). Unknown descriptors are ignored.
    ///
    /// Default: nothing to release.
    fn discard_prepared(&mut self, prepared: &Descriptor) {
        let _ = prepared;
    }

    /// Forgets a peer. Ops posted to it afterwards complete with
    /// [`CompletionStatus::UnknownPeer`]; ops already in flight complete
    /// either normally or with `UnknownPeer`. Unknown indices are ignored.
    fn disconnect(&mut self, peer: PeerIndex);

    /// Posts writes without blocking; returns how many (a prefix of `ops`)
    /// were accepted. Fewer than all means the in-flight credit is used up:
    /// retry after completions were polled. [`TransportError::Closed`] if the
    /// data plane stopped.
    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError>;

    /// Ops posted and not yet returned by [`Completions::poll`].
    fn in_flight(&self) -> usize;

    /// The most ops that can be in flight at once (the completion ring's
    /// capacity).
    fn credits(&self) -> usize;

    /// How long dropping this poster waits for its engine to deliver what
    /// is in flight and exit before it reports the engine stuck (and then
    /// detaches it, or keeps waiting for an engine that may read caller
    /// memory: [`crate::threads::join_within`],
    /// [`crate::threads::join_or_wait`]); an owner that joins the thread
    /// dropping the poster waits at least this long.
    ///
    /// Default: [`crate::threads::STOP_JOIN_DEADLINE`].
    fn drop_deadline(&self) -> Duration {
        crate::threads::STOP_JOIN_DEADLINE
    }
    /// The registry through which caller memory must be announced before
    /// ops read from it ([`WriteOp::local_region`] other than 0), for a
    /// transport whose hardware needs that (rdma: a memory region, whose
    /// lkey the work requests use). `None` (the default): the transport
    /// reads registered memory directly through
    /// [`StagingBuffer::source`](crate::staging::StagingBuffer::source)
    /// (shm, tcp). The sender takes it once, before the poster moves to
    /// its ctrl thread, and calls it from caller threads.
    fn local_registry(&self) -> Option<Arc<dyn LocalRegistry>> {
        None
    }
}

/// Caller memory announced to a transport that must know it before writing
/// from it (see [`Poster::local_registry`]). Shared between the caller
/// threads that register and deregister and the poster that looks regions
/// up, so it is `Send + Sync`.
pub trait LocalRegistry: Send + Sync {
    /// Makes `len` bytes at `start` readable by ops naming local region
    /// `id` (a free id from the staging buffer's region table). A typed
    /// error if the transport cannot (rdma: `ibv_reg_mr` failed, e.g. the
    /// locked-memory limit); then nothing is registered.
    ///
    /// # Safety
    ///
    /// `start..start + len` is allocated host memory that stays allocated
    /// until [`deregister`](Self::deregister)`(id)` returned.
    unsafe fn register(&self, id: u32, start: *const u8, len: u64) -> Result<(), TransportError>;

    /// Forgets region `id` (unknown ids are ignored). The caller guarantees
    /// no op from it is in flight; once this returns the transport never
    /// reads the memory again.
    fn deregister(&self, id: u32);

    /// Lets go of staging share `share`'s pages (rdma: deregisters the
    /// share's memory region, which unpins them) before the sender renews
    /// the share (a fresh memfd mapped over its range,
    /// [`StagingBuffer::segments`](crate::staging::StagingBuffer::segments)
    /// `[share]`). The caller guarantees no op from the share is in flight;
    /// once this returns the device no longer reaches the old pages, and
    /// ops from the share fail (`OutOfBounds`) until
    /// [`register_share`](Self::register_share). Unknown shares and a share
    /// already released are ignored.
    fn release_share(&self, share: usize);

    /// Makes staging share `share`'s current pages readable again after a
    /// renewal (rdma: registers a memory region over them). A typed error
    /// if the transport cannot (rdma: `ibv_reg_mr` failed, e.g. the
    /// locked-memory limit); the share stays released then and must not be
    /// handed out.
    fn register_share(&self, share: usize) -> Result<(), TransportError>;
}

/// What [`Completions::poll`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollStatus {
    /// This many completions were appended (at least one unless `max` was 0).
    Ready(usize),
    /// The deadline passed with nothing to return.
    TimedOut,
    /// The poster is gone and every posted op was completed and returned.
    Closed,
}

/// The completion half of a started transport.
pub trait Completions: Send {
    /// Waits until at least one completion is available or `deadline` passes
    /// (`None` = no deadline), then appends up to `max` completions to `out`.
    /// Returns [`PollStatus::Closed`] once the [`Poster`] was dropped and every
    /// posted op has been completed and returned.
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus;
}

/// The common body of [`Completions::poll`] for transports whose engine
/// thread posts completions to an SPSC ring: wait on the ring's doorbell
/// until something is there (or closed, or `deadline`), move up to `max`
/// completions into `out`, and report how many went back to the poster's
/// credit through `returned`.
/// The two rings of a copy-engine transport (shm, tcp): submissions from the
/// poster to the engine, completions back. Credits (writes in flight) are
/// bounded by the completion ring, so every completion always has room.
pub(crate) struct EngineRings {
    /// The poster's end of the submission ring.
    pub sq_tx: kvferry_ring::spsc::Producer<WriteOp>,
    /// The engine's end of the submission ring.
    pub sq_rx: kvferry_ring::spsc::Consumer<WriteOp>,
    /// The engine's end of the completion ring.
    pub cq_tx: kvferry_ring::spsc::Producer<Completion>,
    /// The completion poller's end.
    pub cq_rx: kvferry_ring::spsc::Consumer<Completion>,
    /// Writes the poster may have in flight.
    pub credits: usize,
}

impl EngineRings {
    /// Both rings with `ring_capacity` entries (rounded up to a power of
    /// two); a capacity the ring crate refuses is a config error.
    pub(crate) fn new(ring_capacity: usize) -> Result<Self, TransportError> {
        let capacity_error = |e: kvferry_ring::CapacityError| TransportError::Config(e.to_string());
        let (sq_tx, sq_rx) =
            kvferry_ring::spsc::try_channel::<WriteOp>(ring_capacity).map_err(capacity_error)?;
        let (cq_tx, cq_rx) =
            kvferry_ring::spsc::try_channel::<Completion>(ring_capacity).map_err(capacity_error)?;
        let credits = cq_rx.capacity().min(sq_tx.capacity());
        Ok(Self {
            sq_tx,
            sq_rx,
            cq_tx,
            cq_rx,
            credits,
        })
    }
}

pub(crate) fn poll_completion_ring(
    cq: &mut kvferry_ring::spsc::Consumer<Completion>,
    out: &mut Vec<Completion>,
    max: usize,
    deadline: Option<Instant>,
    returned: impl FnOnce(usize),
) -> PollStatus {
    let max = max.min(cq.capacity());
    if max == 0 {
        return PollStatus::Ready(0);
    }
    loop {
        let start = out.len();
        out.resize(start + max, Completion::default());
        let n = cq.pop_into(&mut out[start..]);
        out.truncate(start + n);
        if n > 0 {
            returned(n);
            return PollStatus::Ready(n);
        }
        match cq.wait(deadline) {
            kvferry_ring::WaitStatus::Ready => {}
            kvferry_ring::WaitStatus::Closed => return PollStatus::Closed,
            kvferry_ring::WaitStatus::TimedOut => return PollStatus::TimedOut,
        }
    }
}

/// Builds a transport by name: `"shm"` → [`shm::ShmTransport`]; `"tcp"` →
/// [`tcp::TcpTransport`]; `"rdma"` → the RDMA transport with the `rdma`
/// feature (device from `KVFERRY_RDMA_*`, [`TransportError::NoDevice`] if
/// there is none), else [`TransportError::NotBuilt`]; anything else →
/// [`TransportError::UnknownTransport`]. Wrapped in a
/// [`FaultTransport`] when `cfg.fault` is set.
pub fn by_name(name: &str, cfg: &TransportConfig) -> Result<Box<dyn Transport>, TransportError> {
    let inner: Box<dyn Transport> = match name {
        "shm" => Box::new(shm::ShmTransport::new(cfg)?),
        "tcp" => Box::new(tcp::TcpTransport::new(cfg)?),
        #[cfg(feature = "rdma")]
        "rdma" => Box::new(rdma::RdmaTransport::new(rdma::RdmaConfig::from_env(cfg)?)?),
        #[cfg(not(feature = "rdma"))]
        "rdma" => {
            return Err(TransportError::NotBuilt {
                transport: "rdma",
                feature: "the `rdma` cargo feature",
            })
        }
        other => return Err(TransportError::UnknownTransport(other.to_owned())),
    };
    match &cfg.fault {
        Some(fault) => {
            fault.validate()?;
            Ok(Box::new(FaultTransport::new(inner, fault.clone())))
        }
        None => Ok(inner),
    }
}

/// The `kind` tag of a descriptor, for error messages.
pub(crate) fn descriptor_kind(d: &Descriptor) -> &'static str {
    match d {
        Descriptor::None => "none",
        Descriptor::Shm { .. } => "shm",
        Descriptor::Tcp { .. } => "tcp",
        Descriptor::Rdma { .. } => "rdma",
    }
}
