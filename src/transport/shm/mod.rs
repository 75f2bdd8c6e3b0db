//! The shared-memory transport (one host): the receiver's buffer is a file
//! the sender maps ([`crate::region::Region`]); a copy-engine thread
//! (`kvf-shm-copy`) plays the NIC, executing writes from a submission ring
//! and posting completions to a completion ring (both `kvferry-ring` SPSC
//! rings with futex doorbells, so an idle engine sleeps).

mod completions;
mod engine;
mod peers;
mod poster;

use std::collections::HashMap;
use std::sync::Arc;

use crate::protocol::Descriptor;
use crate::staging::StagingBuffer;

use super::config::MAX_RING_CAPACITY;
use super::{Started, Transport, TransportConfig, TransportError};

use super::credits::Returned;
use completions::ShmCompletions;
use engine::Engine;
use peers::PeerTable;
use poster::ShmPoster;

/// Name of the copy-engine thread.
pub const ENGINE_THREAD_NAME: &str = "kvf-shm-copy";

/// The shm transport, before [`Transport::start`].
#[derive(Debug, Clone)]
pub struct ShmTransport {
    ring_capacity: usize,
    pin_cpu: Option<usize>,
}

impl ShmTransport {
    /// Validates `cfg` (ring capacity at least 1 and at most
    /// [`MAX_RING_CAPACITY`]); `cfg.fault` is ignored here (see [`super::by_name`]).
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
        })
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> &'static str {
        "shm"
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
        let peers = Arc::new(PeerTable::default());
        let returned = Arc::new(Returned::default());
        let engine = Engine {
            sq: sq_rx,
            cq: cq_tx,
            local,
            peers: peers.clone(),
        };
        let handle =
            crate::threads::spawn_named(ENGINE_THREAD_NAME, self.pin_cpu, move || engine.run())?;
        let poster = ShmPoster {
            sq: Some(sq_tx),
            peers,
            by_path: HashMap::new(),
            posted: 0,
            returned: returned.clone(),
            credits,
            engine: Some(handle),
        };
        let completions = ShmCompletions {
            cq: cq_rx,
            returned,
        };
        Ok((Box::new(poster), Box::new(completions)))
    }
}
