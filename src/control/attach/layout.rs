//! The attach protocol's shared-memory and socket layouts: `#[repr(C)]`
//! ring entries and the hello, with their sizes and offsets asserted at
//! compile time. `docs/attach.md` specifies every byte for non-Rust clients.

use kvferry_ring::Plain;

use crate::protocol::{ErrorCode, ProtocolError};
use crate::sender::ShapeError;

/// Attach protocol version, carried in the hello; bumped on any change of
/// an entry layout, the hello or a code's meaning.
pub const ATTACH_VERSION: u32 = 6;
/// First 8 bytes of the hello.
pub const HELLO_MAGIC: [u8; 8] = *b"KVFATCH1";
/// Size of the hello message in bytes.
pub const HELLO_LEN: usize = 1024;
/// Descriptors an accepting hello carries (`SCM_RIGHTS`, in this order):
/// the submission ring, the completion ring, the data (the receive buffer
/// read-only for a decoder, the worker's staging share for prefill).
pub const HELLO_FDS: u32 = 3;
/// Longest `req_id` a submission carries inline.
pub const MAX_REQ_ID: usize = 112;
/// `DecoderEvent::tokens` of a chunk without a token count.
pub const NO_TOKENS: u32 = u32::MAX;

/// [`Hello::engine_cpu`] when the daemon keeps no CPU for a copy engine.
pub const NO_CPU: u32 = u32::MAX;

/// Role announced in the hello: a decoder attached to a receiver.
pub const ROLE_DECODER: u32 = 1;
/// Role announced in the hello: a prefill worker attached to a sender.
pub const ROLE_PREFILL: u32 = 2;
/// Longest text (key of a KEY; a BEGIN's req_id is at most
/// [`MAX_REQ_ID`]) a [`PrefillSubmit`] carries inline.
pub const MAX_TEXT: usize = 224;
/// Most dimensions of a BEGIN's chunk shape (the receiver's default
/// `Limits::max_shape_dims`).
pub const MAX_SHAPE_DIMS: usize = 8;
/// Longest dtype name a BEGIN carries, in bytes.
pub const MAX_DTYPE: usize = 32;
/// Where a BEGIN's [`BeginGeometry`] starts in [`PrefillSubmit::text`]
/// (after the req_id's [`MAX_REQ_ID`] bytes; entry offset 144).
pub const GEOMETRY_AT: usize = MAX_REQ_ID;
/// Bytes of a [`BeginGeometry`] in a BEGIN entry.
pub const GEOMETRY_LEN: usize = 112;
/// Element type of a BEGIN that leaves its dtype empty (the sender's
/// default, `RequestSpec::new`).
pub const DEFAULT_DTYPE: &str = "uint8";

/// Hello status: attached.
pub const STATUS_OK: u32 = 0;
/// Hello status: the daemon already serves its maximum of clients.
pub const STATUS_TOO_MANY_CLIENTS: u32 = 1;
/// Hello status: the peer's uid is not the daemon's.
pub const STATUS_WRONG_UID: u32 = 2;
/// Hello status: the daemon could not set the attachment up.
pub const STATUS_INTERNAL: u32 = 3;
/// Hello status (prefill): no staging share is free (every share is held,
/// or the free ones still have writes in flight from their last worker).
pub const STATUS_NO_SHARE: u32 = 4;

/// Submission op: subscribe to `req_id` under `tag`.
pub const OP_SUBSCRIBE: u32 = 1;
/// Submission op: release the request (or drop the subscription) of `tag`.
pub const OP_RELEASE: u32 = 2;
/// Submission op: wildcard subscription under `tag`: every request that
/// becomes ready and has no `req_id` subscription is delivered to a
/// wildcard subscriber (`docs/attach.md`, "Routing").
pub const OP_SUBSCRIBE_ALL: u32 = 3;
/// Tags with this bit are the daemon's (wildcard deliveries); a client's
/// own tags must not have it.
pub const DAEMON_TAG: u64 = 1 << 63;

/// Prefill op: begin request `text` to receiver index `a` with `b` chunks.
pub const OP_BEGIN: u32 = 1;
/// Prefill op: stage `b` slots for batch `a` of `tag`.
pub const OP_STAGE: u32 = 2;
/// Prefill op: chunk `b` of batch `a` is `len` bytes named `text`.
pub const OP_KEY: u32 = 3;
/// Prefill op: submit the first `b` chunks of batch `a`.
pub const OP_SUBMIT: u32 = 4;
/// Prefill op: cancel the request of `tag`.
pub const OP_CANCEL: u32 = 5;

/// Event kind: the request of `tag` is ready; `a` chunks follow.
pub const EV_READY: u32 = 1;
/// Event kind: one chunk of the READY request before it.
pub const EV_CHUNK: u32 = 2;
/// Event kind: the request failed; `code` is its [`ErrorCode`] number.
pub const EV_FAILED: u32 = 3;
/// Event kind: the submission of `tag` was refused; `code` says why.
pub const EV_REFUSED: u32 = 4;
/// Event kind (prefill): batch `a` of `tag` is staged; `b` SLOT entries follow.
pub const EV_STAGED: u32 = 5;
/// Event kind (prefill): slot `b` of the STAGED batch before it is staging
/// slot `a`.
pub const EV_SLOT: u32 = 6;
/// Event kind (prefill): the request of `tag` completed (every chunk
/// written, the proxy notified).
pub const EV_DONE: u32 = 7;
/// Event kind (decoder, wildcard deliveries): up to 16 bytes of the
/// `req_id` of the READY before it, in bytes 16..32; `code` says how many.
pub const EV_NAME: u32 = 8;
/// `req_id` bytes one [`EV_NAME`] entry carries.
pub const NAME_PART: usize = 16;

/// Why a submission was refused (`DecoderEvent::code` of a REFUSED event).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u32)]
pub enum Refusal {
    /// Unknown `op`.
    #[error("unknown op")]
    BadOp = 1,
    /// `req_id_len` above [`MAX_REQ_ID`], zero, or not UTF-8.
    #[error("bad req_id")]
    BadReqId = 2,
    /// The tag is already outstanding.
    #[error("tag already outstanding")]
    DuplicateTag = 3,
    /// The client's outstanding subscriptions reached the bound.
    #[error("too many outstanding subscriptions")]
    TooManyOutstanding = 4,
    /// Another subscription (of any client) holds this `req_id`.
    #[error("req_id already subscribed")]
    AlreadySubscribed = 5,
    /// RELEASE of a tag the client does not hold.
    #[error("unknown tag")]
    UnknownTag = 6,
    /// The request has more chunks than the completion ring carries.
    #[error("request too large for the completion ring")]
    TooManyChunks = 7,
    /// The receiver refused to hand the request out.
    #[error("the receiver refused the take")]
    TakeRefused = 8,
    /// BEGIN naming a receiver index the daemon does not have.
    #[error("unknown receiver index")]
    UnknownReceiver = 9,
    /// The sender refused the BEGIN, STAGE or SUBMIT (duplicate req_id,
    /// batch too large, keys missing, request ended).
    #[error("the sender refused the operation")]
    SenderRefused = 10,
    /// A KEY or SUBMIT naming a batch the client does not hold, or an
    /// index or length out of range, or a key not UTF-8.
    #[error("bad batch, index, length or key")]
    BadBatch = 11,
    /// A BEGIN whose chunk geometry ([`BeginGeometry`]) is out of range:
    /// more than [`MAX_SHAPE_DIMS`] dimensions, a dimension below 1, a
    /// dtype longer than [`MAX_DTYPE`], not UTF-8 or unknown, a negative
    /// `fmt`, or a chunk larger than the sender's `chunk_bytes`.
    #[error("bad chunk geometry (fmt, shape or dtype)")]
    BadGeometry = 12,
    /// A SUBMIT whose last chunk's token count is past the largest
    /// dimension of its request's shape. The batch goes back.
    #[error("last chunk's token count out of range")]
    BadTokens = 13,
}

impl Refusal {
    /// The refusal of wire code `code`, if known.
    pub fn from_code(code: u32) -> Option<Self> {
        use Refusal::*;
        [
            BadOp,
            BadReqId,
            DuplicateTag,
            TooManyOutstanding,
            AlreadySubscribed,
            UnknownTag,
            TooManyChunks,
            TakeRefused,
            UnknownReceiver,
            SenderRefused,
            BadBatch,
            BadGeometry,
            BadTokens,
        ]
        .into_iter()
        .find(|r| *r as u32 == code)
    }
}

/// Wire number of an [`ErrorCode`]: 1 + its index in [`ErrorCode::ALL`].
pub fn error_number(code: ErrorCode) -> u32 {
    ErrorCode::ALL
        .iter()
        .position(|c| *c == code)
        .map_or(0, |i| i as u32 + 1)
}

/// The [`ErrorCode`] of wire number `n`, if known.
pub fn error_from_number(n: u32) -> Option<ErrorCode> {
    let i = usize::try_from(n.checked_sub(1)?).ok()?;
    ErrorCode::ALL.get(i).copied()
}

/// A submission-ring entry (client → daemon), 128 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct DecoderSubmit {
    /// [`OP_SUBSCRIBE`] or [`OP_RELEASE`].
    pub op: u32,
    /// Bytes of `req_id` used.
    pub req_id_len: u32,
    /// The client's name for this request.
    pub tag: u64,
    /// The request id (SUBSCRIBE), UTF-8.
    pub req_id: [u8; MAX_REQ_ID],
}

// SAFETY: repr(C) struct of integers and a byte array, no padding (asserted
// below), no pointers: every bit pattern is a valid value.
unsafe impl Plain for DecoderSubmit {}

impl DecoderSubmit {
    /// A SUBSCRIBE; `None` if `req_id` is empty or longer than [`MAX_REQ_ID`].
    pub fn subscribe(tag: u64, req_id: &str) -> Option<Self> {
        let b = req_id.as_bytes();
        if b.is_empty() || b.len() > MAX_REQ_ID {
            return None;
        }
        let mut req = [0u8; MAX_REQ_ID];
        req[..b.len()].copy_from_slice(b);
        Some(Self {
            op: OP_SUBSCRIBE,
            req_id_len: b.len() as u32,
            tag,
            req_id: req,
        })
    }

    /// A RELEASE of `tag`.
    pub fn release(tag: u64) -> Self {
        Self {
            op: OP_RELEASE,
            req_id_len: 0,
            tag,
            req_id: [0; MAX_REQ_ID],
        }
    }

    /// The `req_id`, validated: `None` if the length is out of range or the
    /// bytes are not UTF-8.
    pub fn req_id(&self) -> Option<&str> {
        let len = usize::try_from(self.req_id_len).ok()?;
        if len == 0 || len > MAX_REQ_ID {
            return None;
        }
        std::str::from_utf8(&self.req_id[..len]).ok()
    }
}

/// A prefill submission-ring entry (worker → sender daemon), 256 bytes;
/// the meaning of `a`, `b`, `len` and `text` depends on `op`
/// (`docs/attach.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct PrefillSubmit {
    /// [`OP_BEGIN`], [`OP_STAGE`], [`OP_KEY`], [`OP_SUBMIT`] or [`OP_CANCEL`].
    pub op: u32,
    /// KEY: chunk length in bytes; BEGIN declaring a batch: its last
    /// chunk's token count ([`NO_TOKENS`] for the default).
    pub len: u32,
    /// The client's name for the request.
    pub tag: u64,
    /// BEGIN: receiver index; STAGE, KEY, SUBMIT: batch id.
    pub a: u32,
    /// BEGIN: total chunks; STAGE: slots; KEY: chunk index; SUBMIT: chunks.
    pub b: u32,
    /// SUBMIT: the token count of the batch's last chunk
    /// (`AllocRequest.last_chunk_toks`), [`NO_TOKENS`] for the default
    /// (the tokens the chunk holds: its bytes over the element size of a
    /// one-dimensional shape, its bytes otherwise); BEGIN: the chunks of
    /// its declared first batch, whose KEYs follow (0: none); otherwise 0.
    pub c: u32,
    /// Bytes of `text` used.
    pub text_len: u32,
    /// BEGIN: the req_id (at most [`MAX_REQ_ID`] bytes), then at
    /// [`GEOMETRY_AT`] the request's [`BeginGeometry`]; KEY: the chunk key
    /// (UTF-8).
    pub text: [u8; MAX_TEXT],
}

// SAFETY: repr(C) struct of integers and a byte array, no padding (asserted
// below), no pointers: every bit pattern is a valid value.
unsafe impl Plain for PrefillSubmit {}

impl PrefillSubmit {
    /// An entry of `op` for `tag` with `a`, `b`, `len` and no text.
    pub fn of(op: u32, tag: u64, a: u32, b: u32, len: u32) -> Self {
        Self {
            op,
            len,
            tag,
            a,
            b,
            c: 0,
            text_len: 0,
            text: [0; MAX_TEXT],
        }
    }

    /// [`of`](Self::of) with `text`; `None` if it is empty or longer than
    /// [`MAX_TEXT`].
    pub fn with_text(op: u32, tag: u64, a: u32, b: u32, len: u32, text: &str) -> Option<Self> {
        let t = text.as_bytes();
        if t.is_empty() || t.len() > MAX_TEXT {
            return None;
        }
        let mut s = Self::of(op, tag, a, b, len);
        s.text[..t.len()].copy_from_slice(t);
        s.text_len = t.len() as u32;
        Some(s)
    }

    /// The text, validated: `None` if the length is out of range or the
    /// bytes are not UTF-8.
    pub fn text(&self) -> Option<&str> {
        let len = usize::try_from(self.text_len).ok()?;
        if len == 0 || len > MAX_TEXT {
            return None;
        }
        std::str::from_utf8(&self.text[..len]).ok()
    }

    /// A BEGIN of `req_id` (1..=[`MAX_REQ_ID`] bytes, else `None`) to
    /// receiver index `receiver` with `total` chunks of `geometry`.
    pub fn begin(
        tag: u64,
        receiver: u32,
        total: u32,
        req_id: &str,
        geometry: &BeginGeometry,
    ) -> Option<Self> {
        if req_id.len() > MAX_REQ_ID {
            return None;
        }
        let mut s = Self::with_text(OP_BEGIN, tag, receiver, total, 0, req_id)?;
        s.text[GEOMETRY_AT..].copy_from_slice(&geometry.encode());
        Some(s)
    }

    /// A BEGIN's req_id, validated: `None` if its length is 0 or above
    /// [`MAX_REQ_ID`] or it is not UTF-8.
    pub fn begin_req_id(&self) -> Option<&str> {
        self.text().filter(|t| t.len() <= MAX_REQ_ID)
    }

    /// A BEGIN's geometry as it is in the entry (unchecked: see
    /// [`BeginGeometry::check`]).
    pub fn geometry(&self) -> BeginGeometry {
        let mut b = [0u8; GEOMETRY_LEN];
        b.copy_from_slice(&self.text[GEOMETRY_AT..]);
        BeginGeometry::decode(&b)
    }

    /// A SUBMIT of the first `chunks` chunks of batch `batch`, the last
    /// one of `last_chunk_toks` tokens (`None`: the default).
    pub fn submit(tag: u64, batch: u32, chunks: u32, last_chunk_toks: Option<u32>) -> Self {
        let mut s = Self::of(OP_SUBMIT, tag, batch, chunks, 0);
        s.c = last_chunk_toks.unwrap_or(NO_TOKENS);
        s
    }
}

/// The chunk geometry of a request, carried by its BEGIN (bytes 144..256
/// of the entry): `AllocRequest.fmt`, `shape` and `dtype` of every
/// AllocRequest of the request. All zero (`Default`): the sender's
/// defaults, shape `[chunk_bytes]` of [`DEFAULT_DTYPE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct BeginGeometry {
    /// KV memory format code, passed through (at least 0).
    pub fmt: i64,
    /// Shape of one full chunk; the first `ndims` are used.
    pub shape: [i64; MAX_SHAPE_DIMS],
    /// Dimensions used, `0..=MAX_SHAPE_DIMS`; 0: `[chunk_bytes]`.
    pub ndims: u32,
    /// Bytes of `dtype` used, `0..=MAX_DTYPE`; 0: [`DEFAULT_DTYPE`].
    pub dtype_len: u32,
    /// Element type name, e.g. `"bfloat16"` (see `protocol::dtype_size`).
    pub dtype: [u8; MAX_DTYPE],
}

/// Why a BEGIN's [`BeginGeometry`] was refused ([`Refusal::BadGeometry`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// `ndims` above [`MAX_SHAPE_DIMS`].
    #[error("{ndims} shape dimensions, at most {MAX_SHAPE_DIMS}")]
    TooManyDims {
        /// The entry's `ndims`.
        ndims: u32,
    },
    /// `dtype_len` above [`MAX_DTYPE`].
    #[error("dtype of {len} bytes, at most {MAX_DTYPE}")]
    DtypeTooLong {
        /// The entry's `dtype_len`.
        len: u32,
    },
    /// The dtype bytes are not UTF-8.
    #[error("dtype is not UTF-8")]
    DtypeNotUtf8,
    /// A negative `fmt`.
    #[error("negative fmt {0}")]
    NegativeFmt(i64),
    /// The shape and dtype do not make a chunk size (an unknown dtype, a
    /// dimension below 1, an overflow).
    #[error("{0}")]
    Chunk(ProtocolError),
    /// A full chunk larger than the sender's slots.
    #[error("a chunk of this shape is {bytes} bytes, larger than the {max}-byte slots")]
    TooLarge {
        /// Bytes of one full chunk.
        bytes: u64,
        /// The sender's `chunk_bytes`.
        max: u64,
    },
}

/// A [`BeginGeometry`] that passed [`BeginGeometry::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedGeometry<'a> {
    /// `fmt`, at least 0.
    pub fmt: i64,
    /// The shape (empty: the sender's default, `[chunk_bytes]`).
    pub shape: &'a [i64],
    /// The dtype name (the default filled in).
    pub dtype: &'a str,
    /// Most tokens a chunk can have: its shape's largest dimension (the
    /// token axis is one of them).
    pub max_tokens: u64,
}

impl BeginGeometry {
    /// A geometry of `fmt`, `shape` (at most [`MAX_SHAPE_DIMS`]; empty:
    /// the default) and `dtype` (at most [`MAX_DTYPE`] bytes; empty: the
    /// default); `None` past a bound.
    pub fn new(fmt: i64, shape: &[i64], dtype: &str) -> Option<Self> {
        if shape.len() > MAX_SHAPE_DIMS || dtype.len() > MAX_DTYPE {
            return None;
        }
        let mut g = Self {
            fmt,
            ndims: shape.len() as u32,
            dtype_len: dtype.len() as u32,
            ..Self::default()
        };
        g.shape[..shape.len()].copy_from_slice(shape);
        g.dtype[..dtype.len()].copy_from_slice(dtype.as_bytes());
        Some(g)
    }

    /// Checks every field against the bounds and a sender of `chunk_bytes`
    /// slots (a full chunk must fit one).
    pub fn check(&self, chunk_bytes: u64) -> Result<CheckedGeometry<'_>, GeometryError> {
        let ndims = self.ndims as usize;
        if ndims > MAX_SHAPE_DIMS {
            return Err(GeometryError::TooManyDims { ndims: self.ndims });
        }
        let len = self.dtype_len as usize;
        if len > MAX_DTYPE {
            return Err(GeometryError::DtypeTooLong {
                len: self.dtype_len,
            });
        }
        let dtype = match std::str::from_utf8(&self.dtype[..len]) {
            Ok("") => DEFAULT_DTYPE,
            Ok(d) => d,
            Err(_) => return Err(GeometryError::DtypeNotUtf8),
        };
        let shape = &self.shape[..ndims];
        let bytes = crate::sender::full_chunk(self.fmt, shape, dtype, chunk_bytes).map_err(
            |e| match e {
                ShapeError::NegativeFmt(f) => GeometryError::NegativeFmt(f),
                ShapeError::Chunk(e) => GeometryError::Chunk(e),
                ShapeError::TooLarge { bytes, max } => GeometryError::TooLarge { bytes, max },
            },
        )?;
        // Every dimension is at least 1 (checked by `full_chunk`); the
        // byte shape is `[chunk_bytes]`, whose bytes are its tokens.
        let max_tokens = shape.iter().map(|&d| d as u64).max().unwrap_or(bytes);
        Ok(CheckedGeometry {
            fmt: self.fmt,
            shape,
            dtype,
            max_tokens,
        })
    }

    /// The wire form ([`GEOMETRY_LEN`] bytes, little-endian, at the
    /// asserted field offsets).
    pub fn encode(&self) -> [u8; GEOMETRY_LEN] {
        use std::mem::offset_of;
        let mut b = [0u8; GEOMETRY_LEN];
        let fmt = offset_of!(Self, fmt);
        b[fmt..fmt + 8].copy_from_slice(&self.fmt.to_le_bytes());
        let shape = offset_of!(Self, shape);
        for (i, d) in self.shape.iter().enumerate() {
            b[shape + 8 * i..shape + 8 * i + 8].copy_from_slice(&d.to_le_bytes());
        }
        let ndims = offset_of!(Self, ndims);
        b[ndims..ndims + 4].copy_from_slice(&self.ndims.to_le_bytes());
        let dtype_len = offset_of!(Self, dtype_len);
        b[dtype_len..dtype_len + 4].copy_from_slice(&self.dtype_len.to_le_bytes());
        let dtype = offset_of!(Self, dtype);
        b[dtype..dtype + MAX_DTYPE].copy_from_slice(&self.dtype);
        b
    }

    /// Parses the wire form (unchecked).
    pub fn decode(b: &[u8; GEOMETRY_LEN]) -> Self {
        use std::mem::offset_of;
        let w8 = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            i64::from_le_bytes(w)
        };
        let w4 = |at: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[at..at + 4]);
            u32::from_le_bytes(w)
        };
        let mut g = Self {
            fmt: w8(offset_of!(Self, fmt)),
            ndims: w4(offset_of!(Self, ndims)),
            dtype_len: w4(offset_of!(Self, dtype_len)),
            ..Self::default()
        };
        let shape = offset_of!(Self, shape);
        for (i, d) in g.shape.iter_mut().enumerate() {
            *d = w8(shape + 8 * i);
        }
        let dtype = offset_of!(Self, dtype);
        g.dtype.copy_from_slice(&b[dtype..dtype + MAX_DTYPE]);
        g
    }
}

/// A completion-ring entry (daemon → client), 32 bytes, for both roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct DecoderEvent {
    /// [`EV_READY`], [`EV_CHUNK`], [`EV_FAILED`] or [`EV_REFUSED`].
    pub kind: u32,
    /// FAILED: [`error_number`]; REFUSED: a [`Refusal`] code.
    pub code: u32,
    /// The request's tag.
    pub tag: u64,
    /// READY: chunk count; CHUNK: slot index.
    pub a: u32,
    /// CHUNK: chunk index in key order.
    pub b: u32,
    /// CHUNK: length in bytes.
    pub len: u32,
    /// CHUNK: token count, or [`NO_TOKENS`].
    pub tokens: u32,
}

// SAFETY: repr(C) struct of integers without padding (asserted below), no
// pointers: every bit pattern is a valid value.
unsafe impl Plain for DecoderEvent {}

impl DecoderEvent {
    /// An event of `kind` for `tag` with `code`, other fields zero.
    pub fn of(kind: u32, tag: u64, code: u32) -> Self {
        Self {
            kind,
            code,
            tag,
            ..Self::default()
        }
    }
}

impl DecoderEvent {
    /// An [`EV_NAME`] entry of `tag` carrying `part` (at most
    /// [`NAME_PART`] bytes; more are cut).
    pub fn name_part(tag: u64, part: &[u8]) -> Self {
        let mut b = [0u8; NAME_PART];
        let n = part.len().min(NAME_PART);
        b[..n].copy_from_slice(&part[..n]);
        let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Self {
            kind: EV_NAME,
            code: n as u32,
            tag,
            a: w(0),
            b: w(4),
            len: w(8),
            tokens: w(12),
        }
    }

    /// The bytes of an [`EV_NAME`] entry (`code` of them, at most
    /// [`NAME_PART`]).
    pub fn name_bytes(&self) -> ([u8; NAME_PART], usize) {
        let mut b = [0u8; NAME_PART];
        for (i, w) in [self.a, self.b, self.len, self.tokens]
            .into_iter()
            .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        (b, (self.code as usize).min(NAME_PART))
    }
}

const _: () = {
    assert!(std::mem::size_of::<PrefillSubmit>() == 256);
    assert!(std::mem::offset_of!(PrefillSubmit, op) == 0);
    assert!(std::mem::offset_of!(PrefillSubmit, len) == 4);
    assert!(std::mem::offset_of!(PrefillSubmit, tag) == 8);
    assert!(std::mem::offset_of!(PrefillSubmit, a) == 16);
    assert!(std::mem::offset_of!(PrefillSubmit, b) == 20);
    assert!(std::mem::offset_of!(PrefillSubmit, c) == 24);
    assert!(std::mem::offset_of!(PrefillSubmit, text_len) == 28);
    assert!(std::mem::offset_of!(PrefillSubmit, text) == 32);
    assert!(std::mem::size_of::<BeginGeometry>() == GEOMETRY_LEN);
    assert!(GEOMETRY_AT + GEOMETRY_LEN == MAX_TEXT);
    assert!(std::mem::offset_of!(BeginGeometry, fmt) == 0);
    assert!(std::mem::offset_of!(BeginGeometry, shape) == 8);
    assert!(std::mem::offset_of!(BeginGeometry, ndims) == 72);
    assert!(std::mem::offset_of!(BeginGeometry, dtype_len) == 76);
    assert!(std::mem::offset_of!(BeginGeometry, dtype) == 80);
    assert!(std::mem::size_of::<DecoderSubmit>() == 128);
    assert!(std::mem::offset_of!(DecoderSubmit, op) == 0);
    assert!(std::mem::offset_of!(DecoderSubmit, req_id_len) == 4);
    assert!(std::mem::offset_of!(DecoderSubmit, tag) == 8);
    assert!(std::mem::offset_of!(DecoderSubmit, req_id) == 16);
    assert!(std::mem::size_of::<DecoderEvent>() == 32);
    assert!(std::mem::offset_of!(DecoderEvent, kind) == 0);
    assert!(std::mem::offset_of!(DecoderEvent, code) == 4);
    assert!(std::mem::offset_of!(DecoderEvent, tag) == 8);
    assert!(std::mem::offset_of!(DecoderEvent, a) == 16);
    assert!(std::mem::offset_of!(DecoderEvent, b) == 20);
    assert!(std::mem::offset_of!(DecoderEvent, len) == 24);
    assert!(std::mem::offset_of!(DecoderEvent, tokens) == 28);
};

/// The hello the daemon writes on a new connection (see `docs/attach.md`
/// for the byte offsets; [`Hello::encode`] and [`Hello::decode`] are the
/// one definition of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Attach protocol version.
    pub version: u32,
    /// [`ROLE_DECODER`].
    pub role: u32,
    /// [`STATUS_OK`] or a refusal status.
    pub status: u32,
    /// The daemon's number for this client.
    pub client_id: u32,
    /// Submission entry size in bytes.
    pub sq_entry: u32,
    /// Completion entry size in bytes.
    pub cq_entry: u32,
    /// Submission ring capacity.
    pub sq_capacity: u32,
    /// Completion ring capacity.
    pub cq_capacity: u32,
    /// Slots in the receive buffer.
    pub slots: u64,
    /// Bytes per slot.
    pub chunk_bytes: u64,
    /// Offset of slot 0 in the receive buffer file.
    pub data_offset: u64,
    /// Outstanding subscriptions (decoder) or requests plus batches
    /// (prefill) allowed.
    pub max_outstanding: u32,
    /// Prefill: receivers a BEGIN may name (indexes `0..receivers`);
    /// decoder: 0.
    pub receivers: u32,
    /// Descriptors attached to the hello ([`HELLO_FDS`] when it accepts,
    /// 0 with a refusal).
    pub fds: u32,
    /// The CPU the daemon keeps for a copy engine (a sender's or a node's
    /// own, `--copy-cpu`; or the one a receiver leaves to a sender's on
    /// its host, `--spare-cpu`), or [`NO_CPU`]. The clients keep the
    /// thread that attaches off it (docs/attach.md, "Placing the
    /// threads").
    pub engine_cpu: u32,
    /// Prefill: the share's index (`0..shares`); decoder: 0.
    pub share: u32,
    /// Prefill: staging shares the sender has; decoder: 0.
    pub shares: u32,
    /// Prefill: the share's first slot in the whole staging buffer
    /// (informational: SLOT entries index the share); decoder: 0.
    pub share_first_slot: u64,
}

/// Why a hello could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// Not a kvferry attach hello.
    #[error("bad hello magic")]
    BadMagic,
    /// A protocol version this build does not speak.
    #[error("attach protocol version {0}, expected {ATTACH_VERSION}")]
    Version(u32),
}

/// Offset of [`Hello::fds`], then [`Hello::engine_cpu`]; bytes after that
/// up to `OFF_SHARE` are reserved.
const OFF_FDS: usize = 72;
const OFF_ENGINE_CPU: usize = 76;
const OFF_SHARE: usize = 840;
const _: () = assert!(OFF_SHARE == 840 && OFF_SHARE + 16 <= HELLO_LEN);

fn u32_at(b: &[u8; HELLO_LEN], off: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8; HELLO_LEN], off: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(w)
}

impl Hello {
    /// A refusal hello with `status` (every other field zero).
    pub fn refusal(status: u32) -> Self {
        Self {
            version: ATTACH_VERSION,
            role: ROLE_DECODER,
            status,
            client_id: 0,
            sq_entry: 0,
            cq_entry: 0,
            sq_capacity: 0,
            cq_capacity: 0,
            slots: 0,
            chunk_bytes: 0,
            data_offset: 0,
            max_outstanding: 0,
            receivers: 0,
            fds: 0,
            engine_cpu: NO_CPU,
            share: 0,
            shares: 0,
            share_first_slot: 0,
        }
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC);
        for (off, v) in [
            (8, self.version),
            (12, self.role),
            (16, self.status),
            (20, self.client_id),
            (24, self.sq_entry),
            (28, self.cq_entry),
            (32, self.sq_capacity),
            (36, self.cq_capacity),
            (64, self.max_outstanding),
            (68, self.receivers),
            (OFF_FDS, self.fds),
            (OFF_ENGINE_CPU, self.engine_cpu),
            (OFF_SHARE, self.share),
            (OFF_SHARE + 4, self.shares),
        ] {
            b[off..off + 4].copy_from_slice(&v.to_le_bytes());
        }
        for (off, v) in [
            (40, self.slots),
            (48, self.chunk_bytes),
            (56, self.data_offset),
            (OFF_SHARE + 8, self.share_first_slot),
        ] {
            b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Parses and checks a hello (magic, version).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, HelloError> {
        if b[0..8] != HELLO_MAGIC {
            return Err(HelloError::BadMagic);
        }
        let version = u32_at(b, 8);
        if version != ATTACH_VERSION {
            return Err(HelloError::Version(version));
        }
        Ok(Self {
            version,
            role: u32_at(b, 12),
            status: u32_at(b, 16),
            client_id: u32_at(b, 20),
            sq_entry: u32_at(b, 24),
            cq_entry: u32_at(b, 28),
            sq_capacity: u32_at(b, 32),
            cq_capacity: u32_at(b, 36),
            slots: u64_at(b, 40),
            chunk_bytes: u64_at(b, 48),
            data_offset: u64_at(b, 56),
            max_outstanding: u32_at(b, 64),
            receivers: u32_at(b, 68),
            fds: u32_at(b, OFF_FDS),
            engine_cpu: u32_at(b, OFF_ENGINE_CPU),
            share: u32_at(b, OFF_SHARE),
            shares: u32_at(b, OFF_SHARE + 4),
            share_first_slot: u64_at(b, OFF_SHARE + 8),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_garbage() {
        let mut h = Hello::refusal(STATUS_OK);
        h.client_id = 7;
        h.slots = 16;
        h.chunk_bytes = 4096;
        h.fds = HELLO_FDS;
        h.share = 2;
        let b = h.encode();
        assert_eq!(&b[0..8], b"KVFATCH1");
        assert_eq!(u32_at(&b, 8), 6);
        assert_eq!(u32_at(&b, 20), 7);
        assert_eq!(u64_at(&b, 40), 16);
        assert_eq!(u32_at(&b, 72), 3);
        assert_eq!(u32_at(&b, 76), NO_CPU, "a refusal names no engine CPU");
        assert_eq!(u32_at(&b, 840), 2);
        assert!(b[80..840].iter().all(|&x| x == 0), "reserved");
        assert_eq!(Hello::decode(&b).unwrap(), h);
        h.engine_cpu = 1;
        let b = h.encode();
        assert_eq!(u32_at(&b, 76), 1);
        assert_eq!(Hello::decode(&b).unwrap(), h);
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(Hello::decode(&bad), Err(HelloError::BadMagic));
        let mut bad = b;
        bad[8] = 9;
        assert_eq!(Hello::decode(&bad), Err(HelloError::Version(9)));
    }

    #[test]
    fn submit_validates_req_id() {
        let s = DecoderSubmit::subscribe(3, "req-1").unwrap();
        assert_eq!(s.req_id(), Some("req-1"));
        assert!(DecoderSubmit::subscribe(3, "").is_none());
        assert!(DecoderSubmit::subscribe(3, &"a".repeat(MAX_REQ_ID + 1)).is_none());
        let mut bad = s;
        bad.req_id_len = MAX_REQ_ID as u32 + 1;
        assert_eq!(bad.req_id(), None);
        bad.req_id_len = 2;
        bad.req_id[0] = 0xff;
        assert_eq!(bad.req_id(), None);
        assert_eq!(DecoderSubmit::release(3).req_id(), None);
    }

    #[test]
    fn name_parts_round_trip() {
        let e = DecoderEvent::name_part(DAEMON_TAG | 5, b"req-0123456789ab");
        assert_eq!((e.kind, e.code, e.tag), (EV_NAME, 16, DAEMON_TAG | 5));
        assert_eq!(e.name_bytes(), (*b"req-0123456789ab", 16));
        let (b, n) = DecoderEvent::name_part(1, b"ab").name_bytes();
        assert_eq!(&b[..n], b"ab");
        let mut bad = e;
        bad.code = 99;
        assert_eq!(bad.name_bytes().1, NAME_PART);
    }

    #[test]
    fn error_numbers_round_trip() {
        for c in ErrorCode::ALL {
            assert_eq!(error_from_number(error_number(c)), Some(c));
        }
        assert_eq!(error_from_number(0), None);
        assert_eq!(error_from_number(999), None);
        for r in 1..=13 {
            assert_eq!(Refusal::from_code(r).map(|r| r as u32), Some(r));
        }
        assert_eq!(Refusal::from_code(14), None);
    }

    #[test]
    fn begin_carries_its_geometry_at_the_documented_offsets() {
        let g = BeginGeometry::new(3, &[2, 4, 16], "bfloat16").unwrap();
        let s = PrefillSubmit::begin(9, 1, 5, "req-1", &g).unwrap();
        let bytes: Vec<u8> = [
            &s.op.to_le_bytes()[..],
            &s.len.to_le_bytes(),
            &s.tag.to_le_bytes(),
            &s.a.to_le_bytes(),
            &s.b.to_le_bytes(),
            &s.c.to_le_bytes(),
            &s.text_len.to_le_bytes(),
            &s.text,
        ]
        .concat();
        let at = |off: usize, n: usize| &bytes[off..off + n];
        assert_eq!(at(0, 4), OP_BEGIN.to_le_bytes());
        assert_eq!(at(28, 4), 5u32.to_le_bytes());
        assert_eq!(at(32, 5), b"req-1");
        assert_eq!(at(144, 8), 3i64.to_le_bytes());
        assert_eq!(at(152, 8), 2i64.to_le_bytes());
        assert_eq!(at(168, 8), 16i64.to_le_bytes());
        assert_eq!(at(216, 4), 3u32.to_le_bytes());
        assert_eq!(at(220, 4), 8u32.to_le_bytes());
        assert_eq!(at(224, 8), b"bfloat16");
        assert_eq!(s.geometry(), g);
        assert_eq!(s.begin_req_id(), Some("req-1"));
        let c = g.check(4096).unwrap();
        assert_eq!(
            (c.fmt, c.shape, c.dtype, c.max_tokens),
            (3, &[2, 4, 16][..], "bfloat16", 16)
        );
        // Defaults: all zero.
        let zero = BeginGeometry::default();
        let d = zero.check(4096).unwrap();
        assert_eq!((d.shape, d.dtype, d.max_tokens), (&[][..], "uint8", 4096));
        assert!(PrefillSubmit::begin(1, 0, 1, &"r".repeat(MAX_REQ_ID + 1), &g).is_none());
        assert!(BeginGeometry::new(0, &[1; MAX_SHAPE_DIMS + 1], "").is_none());
        assert!(BeginGeometry::new(0, &[], &"x".repeat(MAX_DTYPE + 1)).is_none());
        let s = PrefillSubmit::submit(9, 2, 3, Some(7));
        assert_eq!((s.op, s.a, s.b, s.c), (OP_SUBMIT, 2, 3, 7));
        assert_eq!(PrefillSubmit::submit(9, 2, 3, None).c, NO_TOKENS);
    }

    #[test]
    fn every_out_of_range_geometry_is_a_typed_error() {
        let ok = BeginGeometry::new(1, &[2, 8], "bf16").unwrap();
        let mut g = ok;
        g.ndims = MAX_SHAPE_DIMS as u32 + 1;
        assert_eq!(g.check(4096), Err(GeometryError::TooManyDims { ndims: 9 }));
        g.ndims = u32::MAX;
        assert!(matches!(
            g.check(4096),
            Err(GeometryError::TooManyDims { .. })
        ));
        let mut g = ok;
        g.dtype_len = MAX_DTYPE as u32 + 1;
        assert_eq!(g.check(4096), Err(GeometryError::DtypeTooLong { len: 33 }));
        let mut g = ok;
        g.dtype[0] = 0xff;
        assert_eq!(g.check(4096), Err(GeometryError::DtypeNotUtf8));
        let g = BeginGeometry::new(0, &[2, 8], "bfloat17").unwrap();
        assert!(matches!(
            g.check(4096),
            Err(GeometryError::Chunk(ProtocolError::UnknownDtype(_)))
        ));
        let g = BeginGeometry::new(-1, &[2, 8], "bf16").unwrap();
        assert_eq!(g.check(4096), Err(GeometryError::NegativeFmt(-1)));
        let g = BeginGeometry::new(0, &[2, -8], "bf16").unwrap();
        assert!(matches!(
            g.check(4096),
            Err(GeometryError::Chunk(ProtocolError::NonPositiveDim { .. }))
        ));
        let g = BeginGeometry::new(0, &[i64::MAX, i64::MAX], "bf16").unwrap();
        assert_eq!(
            g.check(4096),
            Err(GeometryError::Chunk(ProtocolError::ChunkBytesOverflow))
        );
        let g = BeginGeometry::new(0, &[2, 2048], "bf16").unwrap();
        assert_eq!(
            g.check(4096),
            Err(GeometryError::TooLarge {
                bytes: 8192,
                max: 4096
            })
        );
        // The default shape with a 2-byte dtype is two slots' worth.
        let g = BeginGeometry::new(0, &[], "bf16").unwrap();
        assert!(matches!(g.check(4096), Err(GeometryError::TooLarge { .. })));
    }
}
