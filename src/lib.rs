//! kvferry: KV-cache chunk transfer for prefill/decode disaggregation.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod backoff;
pub mod cli;
pub mod metrics;
pub mod proxy;
pub mod receiver;
pub mod region;
pub mod sender;
pub mod stats;
pub mod threads;
pub mod zmq_io;
