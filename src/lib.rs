//! kvferry: KV-cache chunk transfer for prefill/decode disaggregation.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
pub mod protocol;
pub mod region;
pub mod staging;
pub mod transport;
