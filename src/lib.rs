//! kvferry: KV-cache chunk transfer for prefill/decode disaggregation.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

/// The one spin → yield → park policy (it lives in the ring crate, which
/// depends on nothing else in kvferry).
pub use kvferry_ring::backoff;
pub mod attach;
pub mod cancel;
pub mod cli;
mod eventfd;
pub mod ledger;
pub mod log_budget;
pub mod metrics;
pub mod protocol;
pub mod proxy;
pub mod receiver;
pub mod recent;
pub mod region;
pub mod runner;
pub mod sender;
pub mod slots;
pub mod staging;
pub mod stats;
mod sync;
pub mod threads;
pub mod transport;
pub mod zmq_io;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
