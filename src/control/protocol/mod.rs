//! The control-plane wire protocol: LMCache's PD messages plus kvferry's extensions.
//!
//! Every payload is one msgpack **map** with a `"type"` entry naming the
//! message, the encoding msgspec's tagged structs produce: the tag first, then
//! every field in declaration order, defaults included. kvferry's optional
//! fields (`seq`, `error`, `code`) are omitted when `None`, so a message
//! without extensions is byte-identical to LMCache's. Decoding accepts fields
//! in any order (`"type"` need not be first), any msgpack integer width,
//! ignores unknown fields and fills missing optional fields with defaults.
//! See `docs/protocol.md` and `/work/shared/PROTOCOL.md` for the full spec.
//!
//! # Sockets
//!
//! | message | from → to | socket (sender side → receiver side) |
//! | --- | --- | --- |
//! | `AllocRequest` | sender → receiver | DEALER → ROUTER (`[b"", payload]`) |
//! | `AllocResponse` | receiver → sender | ROUTER → DEALER (`[identity, b"", payload]`), one per AllocRequest / CancelNotif |
//! | `CancelNotif` | sender → receiver | DEALER → ROUTER; answered by an AllocResponse with `remote_indexes = []` |
//! | `Hello` / `HelloAck` | sender ↔ receiver | DEALER ↔ ROUTER (kvferry peers only) |
//! | `TransferDone`, `Heartbeat` | sender → receiver | DEALER → ROUTER (only after a successful Hello), no reply |
//! | `ProxyNotif` | sender → proxy | PUSH → PULL (one frame = payload) |
//!
//! # What is checked where
//!
//! | check | where | error |
//! | --- | --- | --- |
//! | frame size | [`decode_with_limits`], before parsing | [`ProtocolError::FrameTooLarge`] |
//! | well-formed msgpack, one map, nothing after it, lengths fit the frame | structural scan | `Truncated`, `TrailingBytes`, `InvalidMarker`, `NotAMap` |
//! | nesting depth, number of values | structural scan | `TooDeep`, `TooManyElements` |
//! | field names are strings, no repeats | structural scan | `NonStringKey`, `DuplicateField` |
//! | `"type"` present, a string, known | structural scan | `MissingType`, `TypeNotString`, `UnknownType` |
//! | required fields present | structural scan | `MissingField` |
//! | value types, integer fits the field (no negative `seq`, no u64 > i64::MAX in an i64 field), UTF-8, descriptor `kind` | serde | `Malformed` |
//! | key counts and lengths, id lengths | [`validate`] | `TooManyKeys`, `KeyTooLong`, `IdTooLong` |
//! | `total_chunks` in `0..=max_total_chunks`, `last_chunk_toks >= 0` | [`validate`] | `TotalChunksOutOfRange`, `NegativeField` |
//! | shape rank, index ranges, RDMA gid length | [`validate`] | `TooManyShapeDims`, `IndexOutOfRange`, `BadDescriptor` |
//! | dtype known, shape dims > 0, size fits u64 | [`AllocRequest::chunk_bytes`] (not at decode) | `UnknownDtype`, `EmptyShape`, `NonPositiveDim`, `ChunkBytesOverflow` |
//! | capacity, consistency across batches, known `req_id` | the receiver | an [`ErrorCode`] in the reply |
//!
//! A frame that fails to decode still gets a reply: [`peek_reply_hints`]
//! recovers its `seq` and key count, best effort, to shape the failure reply.

mod codec;
mod dtype;
mod error;
mod error_code;
mod limits;
mod messages;
mod placement;
mod scan;

pub use codec::{decode, decode_with_limits, encode, encode_into, validate};
pub use dtype::dtype_size;
pub use error::ProtocolError;
pub use error_code::ErrorCode;
pub use limits::Limits;
pub use messages::{
    chunk_bytes_of, AllocRequest, AllocResponse, CancelNotif, Descriptor, Heartbeat, Hello,
    HelloAck, Message, ProxyFailed, ProxyNotif, TransferDone, GID_LEN,
};
pub use placement::{placement, Placement, PlacementError};
pub use scan::{peek_reply_hints, ReplyHints};

/// Version of kvferry's protocol extensions, exchanged in `Hello`/`HelloAck`.
pub const PROTOCOL_VERSION: u32 = 1;
