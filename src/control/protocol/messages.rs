//! The control-plane messages as serde types.
//!
//! Field order in each struct is the wire order (tag first, then fields as
//! declared): LMCache's fields first, exactly as LMCache declares them, then
//! kvferry's optional extensions, which are left out of the encoding when
//! `None` so that a message without extensions is byte-identical to what
//! LMCache's msgspec structs produce.

use serde::{Deserialize, Serialize};

use super::{dtype_size, ErrorCode, ProtocolError};

/// One control-plane message: a msgpack map whose `"type"` entry names the variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Message {
    /// Sender → receiver: allocate slots for one batch of chunks (LMCache).
    AllocRequest(AllocRequest),
    /// Receiver → sender: the reply to an AllocRequest or a CancelNotif (LMCache).
    AllocResponse(AllocResponse),
    /// Sender → proxy: every chunk of a request is in place (LMCache).
    ProxyNotif(ProxyNotif),
    /// Sender → receiver: the request was aborted; release its keys (LMCache).
    CancelNotif(CancelNotif),
    /// Sender → receiver: transport negotiation (kvferry).
    Hello(Hello),
    /// Receiver → sender: the answer to Hello (kvferry).
    HelloAck(HelloAck),
    /// Sender → receiver: every write of a request completed (kvferry).
    TransferDone(TransferDone),
    /// Sender → receiver: renews the leases of the sender's reservations (kvferry).
    Heartbeat(Heartbeat),
    /// Sender → proxy: a request failed; no ProxyNotif will follow (kvferry).
    ProxyFailed(ProxyFailed),
}

/// Message type names, as they appear in the `"type"` field.
pub(crate) const TYPE_NAMES: [&str; 9] = [
    "AllocRequest",
    "AllocResponse",
    "ProxyNotif",
    "CancelNotif",
    "Hello",
    "HelloAck",
    "TransferDone",
    "Heartbeat",
    "ProxyFailed",
];

/// The fields a frame of type `type_name` must carry (the rest have defaults).
/// Returns the interned type name too, for error messages; `None` for an unknown type.
pub(crate) fn required_fields(type_name: &str) -> Option<(&'static str, &'static [&'static str])> {
    let required: &'static [&'static str] = match type_name {
        "AllocRequest" => &["keys", "fmt", "shape", "dtype", "last_chunk_toks"],
        "AllocResponse" => &["remote_indexes"],
        "ProxyNotif" => &["req_id"],
        "CancelNotif" => &["req_id", "keys"],
        "Hello" => &["sender_id", "version", "transport", "descriptor"],
        "HelloAck" => &[
            "receiver_id",
            "version",
            "transport",
            "descriptor",
            "chunk_bytes",
            "capacity_chunks",
        ],
        "TransferDone" => &["req_id"],
        "Heartbeat" => &["sender_id"],
        "ProxyFailed" => &["req_id", "code"],
        _ => return None,
    };
    let name = TYPE_NAMES.iter().copied().find(|n| *n == type_name)?;
    Some((name, required))
}

impl Message {
    /// The `"type"` tag of this message.
    pub fn type_name(&self) -> &'static str {
        match self {
            Message::AllocRequest(_) => "AllocRequest",
            Message::AllocResponse(_) => "AllocResponse",
            Message::ProxyNotif(_) => "ProxyNotif",
            Message::CancelNotif(_) => "CancelNotif",
            Message::Hello(_) => "Hello",
            Message::HelloAck(_) => "HelloAck",
            Message::TransferDone(_) => "TransferDone",
            Message::Heartbeat(_) => "Heartbeat",
            Message::ProxyFailed(_) => "ProxyFailed",
        }
    }

    /// The kvferry correlation number, for the messages that carry one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            Message::AllocRequest(m) => m.seq,
            Message::AllocResponse(m) => m.seq,
            Message::CancelNotif(m) => m.seq,
            Message::TransferDone(m) => m.seq,
            Message::ProxyNotif(_)
            | Message::Hello(_)
            | Message::HelloAck(_)
            | Message::Heartbeat(_)
            | Message::ProxyFailed(_) => None,
        }
    }

    /// Whether this message is one of kvferry's extra types, which may only be
    /// sent to a peer that answered `Hello`.
    pub fn is_extension(&self) -> bool {
        matches!(
            self,
            Message::Hello(_)
                | Message::HelloAck(_)
                | Message::TransferDone(_)
                | Message::Heartbeat(_)
                | Message::ProxyFailed(_)
        )
    }
}

/// Sender → receiver: allocate receiver slots for one batch of chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocRequest {
    /// One opaque key per chunk of this batch (may be empty on a last batch).
    pub keys: Vec<String>,
    /// KV memory format code, passed through.
    pub fmt: i64,
    /// Shape of one full chunk.
    pub shape: Vec<i64>,
    /// Element type name, e.g. `"bfloat16"`; with `shape` gives a full chunk's bytes.
    pub dtype: String,
    /// Token count of the batch's last chunk (may be short).
    pub last_chunk_toks: i64,
    /// Request id; `""` = anonymous (no admission, no accounting).
    #[serde(default)]
    pub req_id: String,
    /// This batch ends the request.
    #[serde(default)]
    pub is_last_batch: bool,
    /// Chunks in the whole request, the same on every batch.
    #[serde(default)]
    pub total_chunks: i64,
    /// kvferry: per-sender correlation number, echoed in `AllocResponse.seq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

impl AllocRequest {
    /// Bytes of one full chunk: product(shape) x element size of `dtype`.
    ///
    /// Errors: [`ProtocolError::UnknownDtype`], [`ProtocolError::EmptyShape`],
    /// [`ProtocolError::NonPositiveDim`], [`ProtocolError::ChunkBytesOverflow`].
    /// (Decoding does not check these; the receiver calls this before it allocates.)
    pub fn chunk_bytes(&self) -> Result<u64, ProtocolError> {
        chunk_bytes_of(&self.shape, &self.dtype)
    }
}

/// Bytes of one full chunk of `shape` and `dtype` (see
/// [`AllocRequest::chunk_bytes`], same errors): the one definition, also
/// used where a request's geometry is checked before it is sent (attach).
pub fn chunk_bytes_of(shape: &[i64], dtype: &str) -> Result<u64, ProtocolError> {
    let elem = dtype_size(dtype).ok_or_else(|| ProtocolError::UnknownDtype(dtype.to_owned()))?;
    if shape.is_empty() {
        return Err(ProtocolError::EmptyShape);
    }
    let mut bytes = elem;
    for (index, &dim) in shape.iter().enumerate() {
        if dim <= 0 {
            return Err(ProtocolError::NonPositiveDim { index, value: dim });
        }
        // dim > 0, so the cast to u64 is lossless.
        bytes = bytes
            .checked_mul(dim as u64)
            .ok_or(ProtocolError::ChunkBytesOverflow)?;
    }
    Ok(bytes)
}

/// Receiver → sender: the reply to an AllocRequest (or, with no indexes, to a CancelNotif).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocResponse {
    /// Receiver slot index per chunk to write; -1 = failure.
    pub remote_indexes: Vec<i64>,
    /// Positions in the request's `keys` the receiver already holds: not written.
    #[serde(default)]
    pub already_sent_indexes: Vec<i64>,
    /// kvferry: the `seq` of the request this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// kvferry: human-readable reason, whenever the indexes are -1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// kvferry: machine-readable reason ([`ErrorCode::as_str`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

impl AllocResponse {
    /// A successful reply.
    pub fn ok(remote_indexes: Vec<i64>, already_sent_indexes: Vec<i64>, seq: Option<u64>) -> Self {
        AllocResponse {
            remote_indexes,
            already_sent_indexes,
            seq,
            error: None,
            code: None,
        }
    }

    /// LMCache failure shape: `remote_indexes = [-1] * max(n_keys, 1)`, plus error/code.
    pub fn failure(
        n_keys: usize,
        seq: Option<u64>,
        code: ErrorCode,
        error: impl Into<String>,
    ) -> Self {
        AllocResponse {
            remote_indexes: vec![-1; n_keys.max(1)],
            already_sent_indexes: Vec::new(),
            seq,
            error: Some(error.into()),
            code: Some(code.as_str().to_owned()),
        }
    }

    /// Whether this reply reports a failure: any index is -1 (LMCache's signal),
    /// or a kvferry peer set `error`/`code`.
    pub fn is_failure(&self) -> bool {
        self.remote_indexes.iter().any(|&i| i < 0) || self.error.is_some() || self.code.is_some()
    }

    /// The parsed `code`, if present and known to this version.
    pub fn error_code(&self) -> Option<ErrorCode> {
        self.code.as_deref().and_then(ErrorCode::parse)
    }
}

/// Sender → proxy: every chunk of `req_id` is in place at its receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyNotif {
    /// The finished request.
    pub req_id: String,
}

/// Sender → receiver: the request was aborted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelNotif {
    /// The aborted request.
    pub req_id: String,
    /// Keys the receiver should release.
    pub keys: Vec<String>,
    /// kvferry: correlation number, echoed in the reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Sender → receiver (kvferry): transport negotiation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's id.
    pub sender_id: String,
    /// The sender's [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
    pub version: u32,
    /// Transport name the sender wants (`"shm"`, `"tcp"`, `"rdma"`).
    pub transport: String,
    /// The sender's side of the transport.
    pub descriptor: Descriptor,
}

/// Receiver → sender (kvferry): the answer to `Hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    /// The receiver's id.
    pub receiver_id: String,
    /// The receiver's [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
    pub version: u32,
    /// The transport the receiver chose.
    pub transport: String,
    /// The receiver's side of the transport (where to write).
    pub descriptor: Descriptor,
    /// Bytes per receiver slot; slot `i` is at offset `i * chunk_bytes`.
    pub chunk_bytes: u64,
    /// Number of receiver slots.
    pub capacity_chunks: u64,
    /// Another endpoint of the same receiver socket, an absolute
    /// `ipc:///PATH`, offered with the shm data plane: a sender that reached
    /// the file can reach this socket too, and says `Hello` again there to
    /// keep its control messages off the loopback TCP stack
    /// (`docs/protocol.md`, "Local control"). `None` (the default, not
    /// encoded): no such endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<String>,
}

/// Sender → receiver (kvferry): every write of `req_id` completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferDone {
    /// The finished request.
    pub req_id: String,
    /// Correlation number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Sender → proxy (kvferry): `req_id` failed at this sender (or was
/// cancelled); it will send no `ProxyNotif` for it, so the router need not
/// wait for its timeout. An LMCache proxy that decodes strictly as
/// `ProxyNotif` refuses the unknown tag and keeps waiting, as before; one
/// that falls back to any map with a `req_id` stops waiting (and its decoder
/// recomputes). See `docs/protocol.md`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyFailed {
    /// The failed request.
    pub req_id: String,
    /// Machine-readable reason ([`ErrorCode::as_str`]).
    pub code: String,
    /// Human-readable reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Sender → receiver (kvferry): renews the leases of this sender's reservations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The sender whose leases to renew.
    pub sender_id: String,
}

/// Transport descriptor: a msgpack map tagged by `"kind"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Descriptor {
    /// No data transport (control plane only).
    None,
    /// Shared-memory file on the same host.
    Shm {
        /// Path of the file to map.
        path: String,
        /// Length of the region in bytes.
        len: u64,
    },
    /// TCP data connection.
    Tcp {
        /// `host:port` of the data listener.
        addr: String,
        /// kvferry: in a `HelloAck`, the secret (hex) the sender presents
        /// first on each data connection; it binds the connection to that
        /// sender. Left out when `None`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        secret: Option<String>,
    },
    /// RDMA RC queue pair and memory region.
    Rdma {
        /// Queue pair number.
        qp_num: u32,
        /// Local identifier (InfiniBand; 0 on RoCE).
        lid: u16,
        /// 16-byte GID (msgpack bin).
        #[serde(with = "serde_bytes")]
        gid: Vec<u8>,
        /// Remote key of the memory region.
        rkey: u32,
        /// Start address of the memory region.
        addr: u64,
        /// Length of the memory region in bytes.
        len: u64,
    },
}

/// Length of an RDMA GID in bytes.
pub const GID_LEN: usize = 16;

macro_rules! impl_from_for_message {
    ($($t:ident),*) => {$(
        impl From<$t> for Message {
            fn from(m: $t) -> Message {
                Message::$t(m)
            }
        }
    )*};
}
impl_from_for_message!(
    AllocRequest,
    AllocResponse,
    ProxyNotif,
    CancelNotif,
    Hello,
    HelloAck,
    TransferDone,
    Heartbeat
);

#[cfg(test)]
mod tests {
    use super::*;

    fn req(shape: Vec<i64>, dtype: &str) -> AllocRequest {
        AllocRequest {
            keys: vec![],
            fmt: 1,
            shape,
            dtype: dtype.into(),
            last_chunk_toks: 0,
            req_id: String::new(),
            is_last_batch: false,
            total_chunks: 0,
            seq: None,
        }
    }

    #[test]
    fn chunk_bytes_product() {
        assert_eq!(
            req(vec![2, 32, 256, 8, 128], "bfloat16").chunk_bytes(),
            Ok(2 * 32 * 256 * 8 * 128 * 2)
        );
        assert_eq!(req(vec![3], "torch.float32").chunk_bytes(), Ok(12));
    }

    #[test]
    fn chunk_bytes_errors() {
        assert_eq!(
            req(vec![2], "nope").chunk_bytes(),
            Err(ProtocolError::UnknownDtype("nope".into()))
        );
        assert_eq!(
            req(vec![], "bf16").chunk_bytes(),
            Err(ProtocolError::EmptyShape)
        );
        assert_eq!(
            req(vec![2, 0], "bf16").chunk_bytes(),
            Err(ProtocolError::NonPositiveDim { index: 1, value: 0 })
        );
        assert_eq!(
            req(vec![-4], "bf16").chunk_bytes(),
            Err(ProtocolError::NonPositiveDim {
                index: 0,
                value: -4
            })
        );
        assert_eq!(
            req(vec![i64::MAX, 2], "bf16").chunk_bytes(),
            Err(ProtocolError::ChunkBytesOverflow)
        );
        assert_eq!(
            req(vec![i64::MAX], "float64").chunk_bytes(),
            Err(ProtocolError::ChunkBytesOverflow)
        );
    }

    #[test]
    fn failure_shape() {
        let f = AllocResponse::failure(0, Some(7), ErrorCode::ZeroTotalChunks, "zero");
        assert_eq!(f.remote_indexes, vec![-1]);
        assert!(f.is_failure());
        assert_eq!(f.error_code(), Some(ErrorCode::ZeroTotalChunks));
        assert_eq!(f.seq, Some(7));
        let f = AllocResponse::failure(3, None, ErrorCode::BufferTooSmall, String::from("big"));
        assert_eq!(f.remote_indexes, vec![-1, -1, -1]);
        assert_eq!(f.code.as_deref(), Some("buffer_too_small"));
        assert_eq!(f.error.as_deref(), Some("big"));
        let ok = AllocResponse::ok(vec![0, 5], vec![1], Some(2));
        assert!(!ok.is_failure());
        assert_eq!(ok.error_code(), None);
        // An LMCache peer signals failure with -1 only.
        assert!(AllocResponse::ok(vec![3, -1], vec![], None).is_failure());
        // A CancelNotif reply (no indexes) is not a failure.
        assert!(!AllocResponse::ok(vec![], vec![], None).is_failure());
    }

    #[test]
    fn required_fields_cover_every_type() {
        for name in TYPE_NAMES {
            let (interned, _) = required_fields(name).expect(name);
            assert_eq!(interned, name);
        }
        assert!(required_fields("Nope").is_none());
    }

    #[test]
    fn message_helpers() {
        let m: Message = TransferDone {
            req_id: "r".into(),
            seq: Some(4),
        }
        .into();
        assert_eq!(m.type_name(), "TransferDone");
        assert_eq!(m.seq(), Some(4));
        assert!(m.is_extension());
        let m: Message = ProxyNotif { req_id: "r".into() }.into();
        assert_eq!(m.seq(), None);
        assert!(!m.is_extension());
    }
}
