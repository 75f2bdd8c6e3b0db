//! kvferry: KV-cache chunk transfer for prefill/decode disaggregation.
//!
//! A prefill node's [`Sender`] moves a request's KV-cache chunks into a
//! decode node's [`Receiver`] — written in place into the receiver's buffer
//! over shared memory, TCP or RDMA — after the receiver *reserved* room for
//! the whole request, and tells the router's [`ProxyListener`] when the
//! request is in place.
//!
//! # The flow
//!
//! 1. The decoder starts a [`Receiver`] (a ZMQ endpoint and a receive
//!    buffer) and hands its [`Receiver::endpoint`] to the prefill side.
//! 2. The router binds a [`ProxyListener`]; senders notify it.
//! 3. The prefill node's [`Sender::begin`] opens a [`Request`] (admission
//!    starts at once); [`Request::stage`] hands out staging slots to fill in
//!    place, [`StagedBatch::submit`] sends them; [`Request::wait`] (or its
//!    [`Request::completion_fd`]) reports the terminal [`RequestStatus`].
//! 4. The decoder watches the request ([`Receiver::watch`]: a
//!    [`RequestHandle`] with a non-blocking status, a wait with a deadline
//!    and an fd for event loops), then [`Receiver::take`]s its chunks: a
//!    [`RequestChunks`] borrowed in place, in key order, with their lengths;
//!    dropping it releases the slots.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvferry::{ProxyListener, Receiver, ReceiverConfig, RequestSpec, RequestStatus};
//! use kvferry::{Sender, SenderConfig};
//!
//! let deadline = Instant::now() + Duration::from_secs(20);
//! let proxy = ProxyListener::bind("tcp://127.0.0.1:0")?;
//! let receiver = Receiver::start(ReceiverConfig {
//!     listen: "tcp://127.0.0.1:0".into(),
//!     capacity_chunks: 8,
//!     chunk_bytes: 4096,
//!     ..Default::default()
//! })?;
//! let sender = Sender::new(SenderConfig {
//!     proxy: Some(proxy.endpoint().to_owned()),
//!     chunk_bytes: 4096,
//!     staging_slots: 4,
//!     ..Default::default() // the shm data plane
//! })?;
//!
//! let req = sender.begin(RequestSpec::new("req-1", receiver.endpoint(), 1))?;
//! let mut batch = req.stage(1, deadline)?; // waits for the receiver's grant
//! batch.slots_mut().next().unwrap()[..5].copy_from_slice(b"hello");
//! batch.submit(&["req-1/0"], &[5])?; // the whole request: its last batch
//! assert_eq!(req.wait(deadline), RequestStatus::Completed);
//!
//! proxy.wait_ready("req-1", 1, deadline)?; // the router learns it is in place
//! receiver.watch("req-1")?.wait(deadline)?;
//! let chunks = receiver.take("req-1")?;
//! assert_eq!(chunks.get(0).unwrap().bytes(), b"hello");
//! # drop(chunks);
//! # sender.close(deadline);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Features
//!
//! - `cli` (default): the `kvferry` binary (its CLI, load runner and
//!   report) and the crates only it uses. Library users turn it off with
//!   `default-features = false`.
//! - `rdma`: the RDMA verbs data plane (`transport = "rdma"`).
//!
//! # Modules
//!
//! Control plane: [`sender`], [`receiver`], [`proxy`], [`protocol`]. Data
//! plane: [`transport`]. Observability: [`stats`], [`metrics`]. Engine
//! primitives, public for their own tests and benches: [`ledger`],
//! [`slots`], [`staging`], [`region`], [`cancel`].
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

/// The one spin → yield → park policy (it lives in the ring crate, which
/// depends on nothing else in kvferry).
pub(crate) use kvferry_ring::backoff;
// Files are grouped by layer under src/<group>/ (regroup.sh); the
// module paths stay flat: each module is re-exported here.
mod app;
mod control;
mod primitives;
mod telemetry;
mod util;
#[cfg(feature = "cli")]
pub use app::cli;
#[cfg(feature = "cli")]
pub use app::runner;
pub use control::attach;
pub use control::protocol;
pub use control::proxy;
pub use control::receiver;
pub use control::sender;
pub use primitives::cancel;
use primitives::eventfd;
pub use primitives::ledger;
#[doc(hidden)]
pub use primitives::recent;
pub use primitives::region;
pub use primitives::slots;
pub use primitives::staging;
use primitives::sync;
pub use telemetry::metrics;
pub use telemetry::stats;
pub(crate) use util::log_budget;
#[doc(hidden)]
pub use util::threads;
#[doc(hidden)]
pub use util::zmq_io;
pub mod transport;

// The types a user names, at the root.
pub use protocol::{Descriptor, ErrorCode, Limits};
pub use proxy::{NotifCallback, Notification, ProxyError, ProxyListener};
pub use receiver::{
    ChunkRef, ChunkView, Receiver, ReceiverConfig, ReceiverError, ReceiverStats, RequestChunks,
    RequestHandle, TakeError, WaitError,
};
pub use sender::{
    CompletionCallback, MemoryRegion, RegisterError, Request, RequestSpec, RequestStatus, Sender,
    SenderConfig, SenderError, StagedBatch, StoreError, WriteHandle,
};
pub use stats::StatsSnapshot;
pub use transport::{FaultConfig, RemoteBuffer, TransportConfig, TransportError};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
