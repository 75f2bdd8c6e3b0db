//! The sender's error types: what a caller can get back from
//! [`Sender::begin`](super::Sender::begin), the staging and submission calls
//! of a [`Request`](super::Request), and [`Sender::store`](super::Sender::store).

use super::RequestStatus;

/// Errors of [`Sender::begin`](super::Sender::begin),
/// [`Request::stage`](super::Request::stage), [`StagedBatch::submit`](super::StagedBatch::submit)
/// and the copying `store` calls. Every variant is something the caller did
/// or a state of the request; nothing here comes from a peer's bytes.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The request is not admitted yet and the pending area is full.
    #[error(
        "back-pressure: {needed} bytes do not fit in the pending area ({used} of {max} bytes used)"
    )]
    Backpressure {
        /// Bytes this batch needs.
        needed: usize,
        /// Bytes in use.
        used: usize,
        /// The bound.
        max: usize,
    },
    /// `req_id` is empty (the protocol reserves that for anonymous batches).
    #[error("req_id must not be empty")]
    EmptyReqId,
    /// `total_chunks` is zero.
    #[error("total_chunks must be positive")]
    ZeroTotalChunks,
    /// A request with this `req_id` is still in progress on this sender.
    #[error("request {req_id} is already in progress on this sender")]
    DuplicateRequest {
        /// The request.
        req_id: String,
    },
    /// The number of keys and of chunks (or lengths) differ.
    #[error("{keys} keys for {chunks} chunks")]
    KeyCountMismatch {
        /// Keys given.
        keys: usize,
        /// Chunks (or lengths) given.
        chunks: usize,
    },
    /// A batch would take the request past its `total_chunks`.
    #[error("request {req_id} would store {chunks} chunks, more than its total_chunks = {total}")]
    TooManyChunks {
        /// The request.
        req_id: String,
        /// Chunks stored with this batch.
        chunks: usize,
        /// The declared total.
        total: usize,
    },
    /// An empty batch that is not the request's last.
    #[error("only a last batch may be empty")]
    EmptyBatchNotLast,
    /// [`Sender::begin_declared`](super::Sender::begin_declared) with no
    /// chunk (use [`Sender::begin`](super::Sender::begin)).
    #[error("a declared batch needs at least one chunk")]
    EmptyDeclaredBatch,
    /// [`StagedBatch::submit_declared`](super::StagedBatch::submit_declared)
    /// on a request that declared no batch, or whose declared batch was
    /// submitted already.
    #[error("request {req_id} has no declared batch left to submit")]
    NoDeclaredBatch {
        /// The request.
        req_id: String,
    },
    /// More chunks in one batch than the sender has staging slots.
    #[error("a batch of {chunks} chunks can never fit in {slots} staging slots")]
    BatchTooLarge {
        /// Chunks in the batch.
        chunks: usize,
        /// Staging slots of this sender.
        slots: usize,
    },
    /// A `submit` names more chunks than the batch has slots.
    #[error("{chunks} chunks submitted from a batch of {slots} staging slots")]
    MoreChunksThanSlots {
        /// Chunks submitted.
        chunks: usize,
        /// Slots staged.
        slots: usize,
    },
    /// A chunk is larger than a staging slot or than one chunk of the
    /// request's geometry (its `shape` and `dtype`), whichever is less:
    /// the receiver holds no more than that of it.
    #[error(
        "chunk {index} is {len} bytes, more than the {max} bytes a chunk of the request holds"
    )]
    ChunkTooLarge {
        /// Position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// The bound: the slot size, or less for a smaller geometry.
        max: u64,
    },
    /// A chunk other than its batch's last is shorter than one chunk of
    /// the request's geometry. The receiver takes every chunk of a batch
    /// but the last as whole (LMCache's rule: only the last one carries a
    /// token count), so it would hand the decoder bytes nobody wrote.
    #[error(
        "chunk {index} is {len} bytes: every chunk of a batch but its last must be whole ({full} bytes)"
    )]
    ShortChunk {
        /// Position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// One whole chunk of the request.
        full: u64,
    },
    /// The last chunk of a batch of a one-dimensional geometry (`[tokens]`
    /// of `dtype`; the default byte shape too) is not the `tokens` tokens
    /// it was given, or (none given) not a whole number of tokens: the
    /// receiver reports it as `last_chunk_toks` tokens' bytes, so it would
    /// hand the decoder bytes nobody wrote, or cut it.
    #[error(
        "the last chunk is {len} bytes, not {} of {token_bytes}-byte tokens",
        tokens.map_or("a whole number".to_owned(), |t| t.to_string())
    )]
    LastChunkTokens {
        /// Its length.
        len: usize,
        /// The token count given (`set_last_chunk_toks`), if any.
        tokens: Option<i64>,
        /// Bytes per token: the shape's element size.
        token_bytes: u64,
    },
    /// A token count given for a batch's last chunk
    /// (`StagedBatch::set_last_chunk_toks`, `TransferSpec::last_chunk_toks`)
    /// outside `0..=u32::MAX`: the receiver refuses a negative one, and a
    /// decoder reads counts as 32 bits.
    #[error("a last chunk of {tokens} tokens: the count must be in 0..=4294967295")]
    TokensOutOfRange {
        /// The count given.
        tokens: i64,
    },
    /// A later `store` names another receiver than the request began with.
    #[error("request {req_id} goes to {begun}, not {given}")]
    ReceiverMismatch {
        /// The request.
        req_id: String,
        /// The receiver it began with.
        begun: String,
        /// The receiver this call names.
        given: String,
    },
    /// A later `store` declares another `total_chunks` than the request
    /// began with.
    #[error("request {req_id} declared total_chunks = {begun}, this batch says {given}")]
    TotalMismatch {
        /// The request.
        req_id: String,
        /// The total it began with.
        begun: usize,
        /// The total this call declares.
        given: usize,
    },
    /// The request's `fmt`, `shape` and `dtype` cannot be sent: a negative
    /// `fmt`, no chunk size, or a chunk larger than a staging slot.
    #[error("request geometry: {0}")]
    BadGeometry(super::ShapeError),
    /// A later `store` names another chunk format (`fmt`, `shape` or
    /// `dtype`) than the request began with: its AllocRequests carry the
    /// first, and its chunks are sized by it.
    #[error("request {req_id} began with {begun}, this batch says {given}")]
    GeometryMismatch {
        /// The request.
        req_id: String,
        /// The format it began with (the byte shape as `[slot_bytes]`).
        begun: String,
        /// The format this call names.
        given: String,
    },
    /// The request's last batch was already stored.
    #[error("request {req_id} already stored its last batch")]
    AfterLastBatch {
        /// The request.
        req_id: String,
    },
    /// [`Request::try_stage`](super::Request::try_stage) on a request the
    /// receiver has not admitted yet (staging is only for admitted requests).
    #[error("the request is not admitted yet")]
    NotAdmitted,
    /// [`Request::try_stage`](super::Request::try_stage): not enough staging
    /// slots free right now.
    #[error("no staging slots free right now")]
    NoStagingNow,
    /// [`Request::try_stage_in`](super::Request::try_stage_in) with a
    /// staging share of another sender.
    #[error("the staging share belongs to another sender")]
    ForeignShare,
    /// The request ended (completed, failed or cancelled).
    #[error("request already ended: {0:?}")]
    RequestEnded(RequestStatus),
    /// The request was cancelled while this call waited.
    #[error("request cancelled")]
    Cancelled,
    /// The receiver did not admit the request before the deadline.
    #[error("the request was not admitted before the deadline")]
    AdmissionTimeout,
    /// No staging slot freed up before the deadline.
    #[error("no staging slots within the staging timeout")]
    StagingTimeout,
    /// The sender is closing.
    #[error("sender is closed")]
    Closed,
    /// [`Request::write`](super::Request::write): chunk `index` names a
    /// region registered with another sender.
    #[error("chunk {index} names a region of another sender")]
    ForeignRegion {
        /// Position of the chunk in the batch.
        index: usize,
    },
    /// [`Request::write`](super::Request::write): chunk `index` names a
    /// region that was deregistered.
    #[error("chunk {index} names a deregistered region")]
    RegionNotRegistered {
        /// Position of the chunk in the batch.
        index: usize,
    },
    /// [`Request::write`](super::Request::write): chunk `index`'s range
    /// does not lie inside its region.
    #[error(
        "chunk {index}: {len} bytes at offset {offset} do not fit its region of {region_len} bytes"
    )]
    OutsideRegion {
        /// Position of the chunk in the batch.
        index: usize,
        /// The chunk's offset in the region.
        offset: u64,
        /// The chunk's length.
        len: u32,
        /// The region's length.
        region_len: usize,
    },
}

/// Errors starting a sender.
#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    /// Invalid configuration.
    #[error("invalid sender configuration: {0}")]
    Config(String),
    /// The data plane could not start.
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// A control-plane socket could not be created.
    #[error("sender socket: {0}")]
    Socket(String),
    /// A thread or poller could not be started.
    #[error("cannot start sender threads: {0}")]
    Thread(#[from] std::io::Error),
    /// The staging buffer could not be created.
    #[error("staging buffer: {0}")]
    Staging(String),
}

impl SenderError {
    /// A ZMQ failure as [`SenderError::Socket`] (kept out of the public
    /// signatures: no `zmq` type crosses the API).
    pub(crate) fn socket(e: zmq::Error) -> Self {
        SenderError::Socket(e.to_string())
    }
}
