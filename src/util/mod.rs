//! Plumbing: named threads and pinning, lingering before sleep, the ZMQ
//! context and reactor, the socket files daemons bind, rate-limited
//! logging.

pub(crate) mod linger;
pub(crate) mod log_budget;
pub(crate) mod socket_file;

/// Named, optionally pinned threads; internal (not a stable API).
#[doc(hidden)]
pub mod threads;

/// The process-wide ZMQ context and the socket plumbing; public only for
/// the integration tests' raw sockets.
#[doc(hidden)]
pub mod zmq_io;
