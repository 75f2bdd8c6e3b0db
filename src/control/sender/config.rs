//! The sender's public configuration and request types: [`SenderConfig`],
//! the [`TransferSpec`] of a copying [`Sender::store`](super::Sender::store)
//! and a request's [`RequestStatus`].

use std::time::Duration;

use crate::protocol::ErrorCode;
use crate::transport::{RemoteBuffer, TransportConfig};

use super::RequestSpec;

/// Sender configuration.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// This sender's id (DEALER identities are `"{sender_id}-to-{receiver}~{nonce}"`,
    /// the nonce random per process so an identity cannot be squatted).
    pub sender_id: String,
    /// The proxy's PULL endpoint for ProxyNotif (none: no notifications).
    pub proxy: Option<String>,
    /// Also push a `ProxyFailed` (kvferry extension) to the proxy when a
    /// request to a kvferry receiver (one that answered `Hello`) fails or is
    /// cancelled, so the router stops waiting for it (default `true`). Turn
    /// off for a proxy whose decoder stops at an unknown message type
    /// (docs/protocol.md, "ProxyFailed").
    pub proxy_failures: bool,
    /// Staging slots (each `chunk_bytes`); must hold the largest batch.
    pub staging_slots: usize,
    /// Bytes per staging slot: the largest chunk `store` accepts.
    pub chunk_bytes: u64,
    /// Bound of the pending area holding batches of not-yet-admitted
    /// requests (default 64 MiB).
    pub max_pending_bytes: usize,
    /// Data plane: `"shm"` (default), `"tcp"` or `"rdma"`.
    pub transport: String,
    /// Data-plane options (ring sizes, fault injection).
    pub transport_config: TransportConfig,
    /// How long to wait for a receiver's `HelloAck` before treating it as
    /// an LMCache receiver (one request at a time, no extensions). Applies
    /// only to receivers with a static descriptor in `static_peers` (a
    /// `HelloAck` that comes later still upgrades them to kvferry mode);
    /// any other receiver's `Hello` is waited for `hello_answer_timeout`.
    pub hello_timeout: Duration,
    /// How long a receiver *without* a static descriptor may take to answer
    /// `Hello` (a loaded kvferry receiver still registering memory answers
    /// late, and is connected by its late `HelloAck`) before the requests
    /// waiting for it fail `peer_unavailable`, saying that a static buffer
    /// is needed if it is an LMCache receiver; a request after
    /// `rehello_backoff` tries a new `Hello` (default 5 s).
    pub hello_answer_timeout: Duration,
    /// How long an AllocRequest may stay unanswered before its request
    /// fails (must exceed the receiver's admission timeout).
    pub reply_timeout: Duration,
    /// How long `store` may block waiting for staging slots.
    pub staging_timeout: Duration,
    /// Per-worker staging shares (0, the default: none). With `n > 0` the
    /// first slots of staging form `n` equal shares, each its own memfd and
    /// slot pool, handed out by [`Sender::take_share`] and staged from with
    /// [`Request::try_stage_in`] only (`docs/attach.md`); the other calls
    /// stage from the remaining slots. At most [`MAX_SHARES`].
    ///
    /// [`Sender::take_share`]: super::Sender::take_share
    /// [`Request::try_stage_in`]: super::Request::try_stage_in
    /// [`MAX_SHARES`]: super::MAX_SHARES
    pub staging_shares: usize,
    /// Interval of `Heartbeat`s renewing this sender's leases.
    pub heartbeat_interval: Duration,
    /// Least time between two `Hello`s to the same receiver when the sender
    /// re-handshakes after losing a `Hello`-negotiated data plane (rdma):
    /// a receiver that keeps refusing, or whose connection keeps breaking,
    /// gets at most one `Hello` per this period (default 1 s).
    pub rehello_backoff: Duration,
    /// Receive buffers of receivers that do not answer `Hello` (LMCache
    /// style), by endpoint.
    pub static_peers: Vec<(String, RemoteBuffer)>,
    /// Send `Hello` and use kvferry's extensions with receivers that answer.
    pub use_extensions: bool,
    /// CPUs for the ctrl and poll threads (round-robin; empty: unpinned).
    pub pin_cpus: Vec<usize>,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            sender_id: format!("sender-{}", std::process::id()),
            proxy: None,
            proxy_failures: true,
            staging_slots: 64,
            chunk_bytes: 256 * 1024,
            max_pending_bytes: 64 << 20,
            transport: "shm".into(),
            transport_config: TransportConfig::default(),
            hello_timeout: Duration::from_secs(1),
            hello_answer_timeout: Duration::from_secs(5),
            reply_timeout: Duration::from_secs(120),
            staging_timeout: Duration::from_secs(60),
            staging_shares: 0,
            heartbeat_interval: Duration::from_secs(5),
            rehello_backoff: Duration::from_secs(1),
            static_peers: Vec::new(),
            use_extensions: true,
            pin_cpus: Vec::new(),
        }
    }
}

/// What one `store` call transfers (like LMCache's `transfer_spec`).
#[derive(Debug, Clone, PartialEq)]
pub struct TransferSpec {
    /// The request.
    pub req_id: String,
    /// The receiver's ZMQ endpoint.
    pub receiver: String,
    /// Chunks in the whole request (same on every batch).
    pub total_chunks: usize,
    /// This batch ends the request.
    pub is_last: bool,
    /// KV memory format code, passed through.
    pub fmt: i64,
    /// Shape of one full chunk (empty: `[chunk_bytes]` of `uint8`).
    pub shape: Vec<i64>,
    /// Element type with `shape` (default `"uint8"`).
    pub dtype: String,
    /// Token count of the batch's last chunk (default: the tokens it
    /// holds, as `StagedBatch::set_last_chunk_toks` says).
    pub last_chunk_toks: Option<i64>,
}

impl TransferSpec {
    /// The per-request part of the spec.
    pub fn request(&self) -> RequestSpec {
        RequestSpec {
            req_id: self.req_id.clone(),
            receiver: self.receiver.clone(),
            total_chunks: self.total_chunks,
            fmt: self.fmt,
            shape: self.shape.clone(),
            dtype: self.dtype.clone(),
        }
    }

    /// A spec with byte-shaped chunks.
    pub fn new(
        req_id: impl Into<String>,
        receiver: impl Into<String>,
        total_chunks: usize,
        is_last: bool,
    ) -> Self {
        Self {
            req_id: req_id.into(),
            receiver: receiver.into(),
            total_chunks,
            is_last,
            fmt: 0,
            shape: Vec::new(),
            dtype: "uint8".into(),
            last_chunk_toks: None,
        }
    }
}

/// Terminal (or current) status of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestStatus {
    /// Still moving.
    InProgress,
    /// Every chunk written and the proxy notified.
    Completed,
    /// Cancelled by the caller; the receiver released everything.
    Cancelled,
    /// Failed; the receiver released everything.
    Failed {
        /// Machine-readable reason (the receiver's code, or the sender's).
        code: ErrorCode,
        /// Human-readable reason.
        reason: String,
    },
}

impl RequestStatus {
    /// True for every status but `InProgress`.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, RequestStatus::InProgress)
    }
}
