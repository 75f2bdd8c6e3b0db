//! [`TransportConfig`]: the knobs every transport shares.

use super::fault::FaultConfig;

/// Default capacity of the submission and completion rings (= write credits).
pub const DEFAULT_RING_CAPACITY: usize = 1024;

/// Largest accepted ring capacity (the rings are preallocated: 1 Mi entries
/// of 40 bytes is 40 MiB).
pub const MAX_RING_CAPACITY: usize = 1 << 20;

/// Configuration shared by all transports.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Capacity of the submission and completion rings, rounded up to a power
    /// of two; also the number of writes that may be in flight (credits).
    /// Default [`DEFAULT_RING_CAPACITY`]; 0 or more than
    /// [`MAX_RING_CAPACITY`] is a configuration error.
    pub ring_capacity: usize,
    /// Pin the transport's engine thread to this CPU (best effort).
    pub pin_cpu: Option<usize>,
    /// Wrap the transport in the fault-injection wrapper.
    pub fault: Option<FaultConfig>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            ring_capacity: DEFAULT_RING_CAPACITY,
            pin_cpu: None,
            fault: None,
        }
    }
}
