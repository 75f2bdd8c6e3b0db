//! Attach from another process: decoder processes (in any language) talk to
//! a running receiver through a Unix socket (the lease and the submission
//! doorbell) and one pair of shared-memory SPSC rings each (`kvferry-ring`'s
//! `spsc::shared` files), and read chunk bytes in place from the receive
//! buffer mapped read-only. `docs/attach.md` specifies every byte.
//!
//! - [`DecoderDaemon`]: the receiver side (accept loop, one session thread
//!   per client), started by `kvferry receiver --attach PATH`.
//! - [`DecoderClient`]: the Rust client.
//! - [`layout`]: the `#[repr(C)]` entries and the hello.

mod client;
mod daemon;
pub mod layout;
mod poll;
mod session;

pub use client::{AttachError, ChunkDesc, DecoderClient, Delivery, Event};
pub use daemon::{AttachConfig, DecoderDaemon};
pub use layout::Refusal;
