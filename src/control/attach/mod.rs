//! Attach from another process: decoder processes (in any language) talk to
//! a running receiver through a Unix socket (the lease, the submission
//! doorbell, and the hand-off of every descriptor by `SCM_RIGHTS`) and one
//! pair of shared-memory SPSC rings each (`kvferry-ring`'s anonymous
//! `spsc::shared` memfds), and read chunk bytes in place from the receive
//! buffer mapped read-only. `docs/attach.md` specifies every byte.
//!
//! - [`DecoderDaemon`]: the receiver side (accept loop, one session thread
//!   per client), started by `kvferry receiver --attach PATH`.
//! - [`DecoderClient`]: the Rust client.
//! - [`PrefillDaemon`]: the sender side for prefill workers, started by
//!   `kvferry sender --attach PATH`; [`PrefillClient`]: its Rust client.
//! - [`layout`]: the `#[repr(C)]` entries and the hello.
//!
//! The sessions' and clients' maps (tags, subscribed `req_id`s) hash with
//! `foldhash`, not std's SipHash: every submission and every event looks
//! a tag up several times, where SipHash costs tens of ns a time. The keys
//! are a client's (untrusted), but each map is bounded (`max_outstanding`
//! per client, `max_clients` clients) and foldhash's seed is random per
//! process: keys that collide (guessed, or by chance) make a lookup at
//! worst linear in that bound.

mod affinity;
mod client;
mod daemon;
mod fds;
pub mod layout;
mod placement;
mod poll;
mod prefill;
mod prefill_client;
mod serve;
mod session;

pub use affinity::KEEP_AFFINITY_ENV;
pub use client::{AttachError, ChunkDesc, DecoderClient, Delivery, Event};
pub use daemon::AttachConfig;
pub use layout::{BeginGeometry, GeometryError, Refusal};
pub use prefill::PrefillDaemon;
pub use prefill_client::{DeclaredBatch, PrefillClient, PrefillEvent, StagedSlots, SubmitError};
pub use session::DecoderDaemon;
