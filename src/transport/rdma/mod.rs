//! The RDMA transport (cargo feature `rdma`, verbs through `ibverbs` /
//! `ibverbs-sys`): one RC queue pair per sender–receiver pair, a memory
//! region over each segment of the sender's staging buffer (each staging
//! share, re-registered when the share is renewed, and the rest), one over
//! each region the caller registered
//! ([`Poster::local_registry`](crate::transport::Poster::local_registry))
//! and one over the receiver's slot area, RDMA WRITE for the data, a signalled completion per chain (or per
//! [`RdmaConfig::signal_every`] requests), and a CQ-poll thread that feeds
//! the same [`Completions`](crate::transport::Completions) path as the other
//! transports. A queue pair error fails the in-flight writes of that queue
//! pair. See docs/rdma.md.
//!
//! Modules with one job each: [`info`] (the `Descriptor::Rdma` exchanged in
//! `Hello`/`HelloAck`), [`plan`] (which ops become which work requests,
//! signalling), [`inflight`] (mapping work completions back to ops),
//! [`qp_state`] (the INIT/RTR/RTS attributes), [`device`] (finding a
//! device), [`events`] (what an asynchronous event such as port down or
//! QP fatal does), `verbs` (owned wrappers over the raw verbs objects),
//! `regions` (the sender's MRs: staging segments and caller memory), `cq_thread`, `sender` and
//! `receiver`. The first six work without a
//! device and are unit-tested everywhere; the rest needs one.

mod config;
mod cq_thread;
pub mod device;
pub mod events;
pub mod inflight;
pub mod info;
mod peers;
pub mod plan;
pub mod qp_state;
mod receiver;
mod regions;
mod sender;
mod verbs;

pub use config::{RdmaConfig, ENV_DEVICE, ENV_GID_INDEX, ENV_PORT};
pub use device::probe;
pub use info::QpInfo;
pub use receiver::RdmaReceiverSide;
pub use sender::{RdmaCompletions, RdmaPoster, RdmaTransport, CQ_THREAD_NAME};
