//! Encoding and decoding of [`Message`]s: msgpack maps through rmp-serde.
//!
//! Decoding is four steps, each refusing with a typed [`ProtocolError`]:
//! 1. the frame size against `Limits::max_frame_bytes`, before reading a byte;
//! 2. a structural pass over the bytes (`scan.rs`): well-formed
//!    msgpack, one top-level map, no trailing bytes, declared lengths that fit
//!    the frame, depth and element-count limits, string field names without
//!    repeats, a known `"type"`, every required field present;
//! 3. serde (rmp-serde + the derived internally-tagged [`Message`]): value
//!    types, integer ranges of the Rust field types, UTF-8, unknown fields
//!    ignored, missing optional fields defaulted;
//! 4. [`validate`]: the content limits (key counts and lengths, `total_chunks`
//!    range, negative counts, index ranges, shape rank, descriptor sanity).

use serde::Serialize;

use super::messages::GID_LEN;
use super::{scan, AllocRequest, AllocResponse, Descriptor, Limits, Message, ProtocolError};

/// Encodes `msg` as a msgpack map: `"type"` first, then every field in
/// declaration order (defaults included), extension fields only when `Some`.
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(msg, &mut out);
    out
}

/// Appends the encoding of `msg` to `out` (see [`encode`]).
///
/// Infallible in practice: writing to a `Vec` cannot fail, every struct and
/// sequence has a known length, and every `Message` variant wraps a struct, as
/// serde's internally-tagged representation requires. Should rmp-serde ever
/// report an error anyway, `out` is restored to its previous length (the peer
/// then sees an empty frame and answers `bad_message`) rather than panicking.
pub fn encode_into(msg: &Message, out: &mut Vec<u8>) {
    let start = out.len();
    let mut ser = rmp_serde::Serializer::new(&mut *out).with_struct_map();
    if let Err(err) = msg.serialize(&mut ser) {
        tracing::debug!(%err, msg_type = msg.type_name(), "encoding failed; frame dropped");
        out.truncate(start);
    }
}

/// Decodes one frame with the default [`Limits`].
pub fn decode(frame: &[u8]) -> Result<Message, ProtocolError> {
    decode_with_limits(frame, &Limits::default())
}

/// Decodes one frame, enforcing `limits` (see the module docs for the order of checks).
pub fn decode_with_limits(frame: &[u8], limits: &Limits) -> Result<Message, ProtocolError> {
    if frame.len() > limits.max_frame_bytes {
        return Err(ProtocolError::FrameTooLarge {
            len: frame.len(),
            max: limits.max_frame_bytes,
        });
    }
    scan::scan(frame, limits)?;
    let mut de = rmp_serde::Deserializer::from_read_ref(frame);
    // The scan already bounded the depth; rmp-serde's own depth counter is a
    // second fence, with headroom because it counts levels differently.
    de.set_max_depth(limits.effective_max_depth() + 8);
    let msg: Message = serde::Deserialize::deserialize(&mut de)
        .map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    validate(&msg, limits)?;
    Ok(msg)
}

/// Checks a decoded message against the content limits. `decode_with_limits`
/// calls it; it is public so that a message built in code can be checked the same way.
///
/// Checked here: key lists (`keys`, `remote_indexes`, `already_sent_indexes`)
/// at most `max_keys` entries; each key and each identifier (`req_id`,
/// `sender_id`, `receiver_id`, `transport`, descriptor `path`/`addr`) at most
/// `max_key_bytes`; `total_chunks` in `0..=max_total_chunks`;
/// `last_chunk_toks >= 0`; `shape` at most `max_shape_dims` dimensions;
/// `remote_indexes >= -1`; `already_sent_indexes >= 0`; RDMA gid of 16 bytes.
/// Not checked here: shape dims > 0 and a known dtype
/// ([`AllocRequest::chunk_bytes`]), and anything that needs the receiver's
/// state (capacity, consistency across batches).
pub fn validate(msg: &Message, limits: &Limits) -> Result<(), ProtocolError> {
    match msg {
        Message::AllocRequest(m) => validate_alloc_request(m, limits),
        Message::AllocResponse(m) => validate_alloc_response(m, limits),
        Message::ProxyNotif(m) => check_id("req_id", &m.req_id, limits),
        Message::CancelNotif(m) => {
            check_id("req_id", &m.req_id, limits)?;
            check_keys("keys", &m.keys, limits)
        }
        Message::Hello(m) => {
            check_id("sender_id", &m.sender_id, limits)?;
            check_id("transport", &m.transport, limits)?;
            check_descriptor(&m.descriptor, limits)
        }
        Message::HelloAck(m) => {
            check_id("receiver_id", &m.receiver_id, limits)?;
            check_id("transport", &m.transport, limits)?;
            check_descriptor(&m.descriptor, limits)
        }
        Message::TransferDone(m) => check_id("req_id", &m.req_id, limits),
        Message::Heartbeat(m) => check_id("sender_id", &m.sender_id, limits),
        Message::ProxyFailed(m) => {
            check_id("req_id", &m.req_id, limits)?;
            check_id("code", &m.code, limits)
        }
    }
}

fn validate_alloc_request(m: &AllocRequest, limits: &Limits) -> Result<(), ProtocolError> {
    check_keys("keys", &m.keys, limits)?;
    check_id("req_id", &m.req_id, limits)?;
    if m.shape.len() > limits.max_shape_dims {
        return Err(ProtocolError::TooManyShapeDims {
            dims: m.shape.len(),
            max: limits.max_shape_dims,
        });
    }
    if !(0..=limits.max_total_chunks).contains(&m.total_chunks) {
        return Err(ProtocolError::TotalChunksOutOfRange {
            value: m.total_chunks,
            max: limits.max_total_chunks,
        });
    }
    if m.last_chunk_toks < 0 {
        return Err(ProtocolError::NegativeField {
            field: "last_chunk_toks",
            value: m.last_chunk_toks,
        });
    }
    Ok(())
}

fn validate_alloc_response(m: &AllocResponse, limits: &Limits) -> Result<(), ProtocolError> {
    check_indexes("remote_indexes", &m.remote_indexes, -1, limits)?;
    check_indexes("already_sent_indexes", &m.already_sent_indexes, 0, limits)
}

fn check_count(field: &'static str, count: usize, limits: &Limits) -> Result<(), ProtocolError> {
    if count > limits.max_keys {
        return Err(ProtocolError::TooManyKeys {
            field,
            count,
            max: limits.max_keys,
        });
    }
    Ok(())
}

fn check_keys(field: &'static str, keys: &[String], limits: &Limits) -> Result<(), ProtocolError> {
    check_count(field, keys.len(), limits)?;
    match keys.iter().position(|k| k.len() > limits.max_key_bytes) {
        Some(index) => Err(ProtocolError::KeyTooLong {
            field,
            index,
            len: keys[index].len(),
            max: limits.max_key_bytes,
        }),
        None => Ok(()),
    }
}

fn check_indexes(
    field: &'static str,
    indexes: &[i64],
    min: i64,
    limits: &Limits,
) -> Result<(), ProtocolError> {
    check_count(field, indexes.len(), limits)?;
    match indexes.iter().position(|&i| i < min) {
        Some(position) => Err(ProtocolError::IndexOutOfRange {
            field,
            position,
            value: indexes[position],
        }),
        None => Ok(()),
    }
}

fn check_id(field: &'static str, id: &str, limits: &Limits) -> Result<(), ProtocolError> {
    if id.len() > limits.max_key_bytes {
        return Err(ProtocolError::IdTooLong {
            field,
            len: id.len(),
            max: limits.max_key_bytes,
        });
    }
    Ok(())
}

fn check_descriptor(d: &Descriptor, limits: &Limits) -> Result<(), ProtocolError> {
    match d {
        Descriptor::None => Ok(()),
        Descriptor::Shm { path, .. } => check_id("descriptor.path", path, limits),
        Descriptor::Tcp { addr, secret } => {
            check_id("descriptor.addr", addr, limits)?;
            secret
                .as_deref()
                .map_or(Ok(()), |s| check_id("descriptor.secret", s, limits))
        }
        Descriptor::Rdma { gid, .. } if gid.len() != GID_LEN => Err(ProtocolError::BadDescriptor(
            format!("rdma gid is {} bytes, expected {GID_LEN}", gid.len()),
        )),
        Descriptor::Rdma { .. } => Ok(()),
    }
}
