//! [`ProtocolError`]: every way a frame or a message can be refused.

use super::ErrorCode;

/// Why a frame could not be decoded, or why a decoded message's contents are unusable.
///
/// Decoding never panics and never allocates more than the [`Limits`](super::Limits)
/// allow; every refusal is one of these variants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The frame is larger than `Limits::max_frame_bytes` (checked before parsing).
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Frame length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame ends inside a msgpack value (or declares more elements than bytes remain).
    #[error("truncated frame: a value starting at byte {offset} runs past the end")]
    Truncated {
        /// Byte offset of the value that does not fit.
        offset: usize,
    },
    /// Bytes remain after the top-level map.
    #[error("{extra} trailing bytes after the message map")]
    TrailingBytes {
        /// How many bytes follow the map.
        extra: usize,
    },
    /// The byte 0xc1, which msgpack never uses, was found.
    #[error("invalid msgpack marker 0xc1 at byte {offset}")]
    InvalidMarker {
        /// Byte offset of the marker.
        offset: usize,
    },
    /// The top-level value is not a msgpack map.
    #[error("top-level value is a {found}, not a map")]
    NotAMap {
        /// Kind of msgpack value found instead ("array", "str", ...).
        found: &'static str,
    },
    /// Arrays/maps nest deeper than `Limits::max_depth`.
    #[error("nesting deeper than the limit of {max}")]
    TooDeep {
        /// The limit.
        max: usize,
    },
    /// The frame holds more msgpack values than `Limits::max_elements`.
    #[error("more than {max} msgpack values in one frame")]
    TooManyElements {
        /// The limit.
        max: usize,
    },
    /// A key of the message map (or of its descriptor map) is not a string.
    #[error("a field name is a {found}, not a string")]
    NonStringKey {
        /// Kind of msgpack value used as a key.
        found: &'static str,
    },
    /// A field name occurs twice in the message map.
    #[error("duplicate field `{0}`")]
    DuplicateField(String),
    /// The message map has no `"type"` field.
    #[error("message has no \"type\" field")]
    MissingType,
    /// The `"type"` field is not a (UTF-8) string.
    #[error("\"type\" field is a {found}, not a string")]
    TypeNotString {
        /// Kind of msgpack value found.
        found: &'static str,
    },
    /// The `"type"` names no message this version knows.
    #[error("unknown message type `{0}`")]
    UnknownType(String),
    /// A required field of the message is absent.
    #[error("{message_type} is missing required field `{field}`")]
    MissingField {
        /// The message type.
        message_type: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A field has the wrong msgpack type, an integer does not fit its field
    /// (e.g. a negative `seq`, or a `u64` beyond `i64` in `total_chunks`), a
    /// string is not UTF-8, or a descriptor `kind` is unknown. Carries the
    /// deserializer's message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A key list (or an index list) has more entries than `Limits::max_keys`.
    #[error("`{field}` has {count} entries, the limit is {max}")]
    TooManyKeys {
        /// The field.
        field: &'static str,
        /// Entries found.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A key is longer than `Limits::max_key_bytes`.
    #[error("`{field}[{index}]` is {len} bytes, the limit is {max}")]
    KeyTooLong {
        /// The field holding the key.
        field: &'static str,
        /// Position of the key in the list.
        index: usize,
        /// Key length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An identifier (`req_id`, `sender_id`, `receiver_id`) is longer than `Limits::max_key_bytes`.
    #[error("`{field}` is {len} bytes, the limit is {max}")]
    IdTooLong {
        /// The field.
        field: &'static str,
        /// Length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `total_chunks` is outside `0..=Limits::max_total_chunks`.
    #[error("total_chunks {value} is outside 0..={max}")]
    TotalChunksOutOfRange {
        /// The value received.
        value: i64,
        /// The limit.
        max: i64,
    },
    /// A count that must not be negative is (e.g. `last_chunk_toks`).
    #[error("`{field}` is negative ({value})")]
    NegativeField {
        /// The field.
        field: &'static str,
        /// The value received.
        value: i64,
    },
    /// An index list holds a value outside its range
    /// (`remote_indexes` must be >= -1, `already_sent_indexes` >= 0).
    #[error("`{field}[{position}]` = {value} is out of range")]
    IndexOutOfRange {
        /// The field.
        field: &'static str,
        /// Position in the list.
        position: usize,
        /// The value received.
        value: i64,
    },
    /// `AllocRequest.shape` has more than `Limits::max_shape_dims` dimensions.
    #[error("shape has {dims} dimensions, the limit is {max}")]
    TooManyShapeDims {
        /// Dimensions received.
        dims: usize,
        /// The limit.
        max: usize,
    },
    /// A transport descriptor is unusable (e.g. an RDMA gid that is not 16 bytes).
    #[error("bad transport descriptor: {0}")]
    BadDescriptor(String),
    /// `AllocRequest.dtype` is not a known dtype name ([`dtype_size`](super::dtype_size)).
    #[error("unknown dtype `{0}`")]
    UnknownDtype(String),
    /// `AllocRequest.shape` is empty.
    #[error("shape is empty")]
    EmptyShape,
    /// A dimension of `AllocRequest.shape` is zero or negative.
    #[error("shape[{index}] = {value} is not positive")]
    NonPositiveDim {
        /// Position of the dimension.
        index: usize,
        /// Its value.
        value: i64,
    },
    /// product(shape) * dtype size does not fit in a u64.
    #[error("chunk size overflows u64")]
    ChunkBytesOverflow,
}

impl ProtocolError {
    /// The [`ErrorCode`] a receiver puts in its reply when it refuses a message
    /// for this reason: [`ErrorCode::BadMessage`] for every variant (all of them
    /// describe the message itself, not the receiver's state).
    pub fn code(&self) -> ErrorCode {
        ErrorCode::BadMessage
    }
}
