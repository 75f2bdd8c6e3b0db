//! [`TransportError`]: everything that can go wrong setting up or driving a
//! transport (per-write failures are [`super::CompletionStatus`] codes instead).

use crate::region::RegionError;

/// Errors from building, starting, connecting or posting to a transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer's descriptor is for another transport than this one.
    #[error("the {transport} transport cannot use a `{descriptor}` descriptor")]
    Unsupported {
        /// This transport's kind.
        transport: &'static str,
        /// The descriptor's kind.
        descriptor: &'static str,
    },
    /// Mapping the peer's shared-memory buffer failed (missing file, bad
    /// header, geometry other than announced).
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The descriptor is of the right kind but inconsistent.
    #[error("bad transport descriptor: {0}")]
    BadDescriptor(String),
    /// The data plane stopped (its engine thread exited).
    #[error("the transport's data plane is closed")]
    Closed,
    /// An OS error (spawning the engine thread, sockets).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The transport exists but this build does not include it.
    #[error("the {transport} transport is not built into this binary (needs {feature})")]
    NotBuilt {
        /// The transport asked for.
        transport: &'static str,
        /// What the build lacks (a cargo feature or a pending module).
        feature: &'static str,
    },
    /// No usable device for the transport (e.g. no RDMA NIC).
    #[error("no device for the transport: {0}")]
    NoDevice(String),
    /// The transport name is not one of `shm`, `tcp`, `rdma`.
    #[error("unknown transport `{0}` (expected shm, tcp or rdma)")]
    UnknownTransport(String),
    /// A configuration value is out of range.
    #[error("invalid transport configuration: {0}")]
    Config(String),
}
