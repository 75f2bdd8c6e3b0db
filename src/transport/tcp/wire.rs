//! The data connection's wire format (all integers little-endian).
//!
//! ```text
//! sender → receiver, once:  Preamble   magic "KVFTCP\0\x01" | version u32 | flags u32 (0)
//!                                      | chunk_bytes u64 | capacity_chunks u64
//!                                      | secret [u8; 16]                            (48 bytes)
//! receiver → sender, once:  PreambleAck magic | status u32 | reserved u32           (16 bytes)
//! sender → receiver, per write: Header remote_offset u64 | len u64 | work_id u64     (24 bytes)
//!                                      followed by `len` payload bytes
//! receiver → sender, per write: Ack    work_id u64 | status u32 | reserved u32       (16 bytes)
//! ```
//!
//! Acks come back in the order the writes were sent. A non-zero preamble
//! status, or an ack with a non-zero status for a rejected write, is
//! followed by the receiver closing the connection.
//!
//! The secret binds the connection to one sender: the receiver issued it to
//! that sender in its `HelloAck` (the `secret` of the TCP descriptor, as
//! hex, over the control channel), and accepts a write only into slots it
//! granted to that sender (see `docs/security.md`, "Data plane").

/// Magic bytes opening a data connection.
pub const MAGIC: [u8; 8] = *b"KVFTCP\0\x01";
/// Version of this wire format (2: the preamble carries the secret).
pub const VERSION: u32 = 2;
/// Bytes of [`Preamble`].
pub const PREAMBLE_LEN: usize = 48;
/// Bytes of the data-connection secret.
pub const SECRET_LEN: usize = 16;
/// Bytes of the preamble answer.
pub const PREAMBLE_ACK_LEN: usize = 16;
/// Bytes of a write [`Header`].
pub const HEADER_LEN: usize = 24;
/// Bytes of an [`Ack`].
pub const ACK_LEN: usize = 16;

/// Preamble answer: accepted.
pub const PREAMBLE_OK: u32 = 0;
/// Preamble answer: bad magic or unknown version.
pub const PREAMBLE_BAD_VERSION: u32 = 1;
/// Preamble answer: the geometry the sender expects is not the buffer's.
pub const PREAMBLE_BAD_GEOMETRY: u32 = 2;
/// Preamble answer: the secret is not one this receiver issued (or it was
/// replaced by a later `Hello` of the same sender).
pub const PREAMBLE_UNAUTHENTICATED: u32 = 3;

/// The secret as it travels in the TCP descriptor: lowercase hex.
pub fn encode_secret(secret: &[u8; SECRET_LEN]) -> String {
    secret.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`encode_secret`]'s hex; `None` unless exactly
/// `2 * SECRET_LEN` hex digits.
pub fn decode_secret(hex: &str) -> Option<[u8; SECRET_LEN]> {
    let b = hex.as_bytes();
    if b.len() != 2 * SECRET_LEN {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; SECRET_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = digit(b[2 * i])? << 4 | digit(b[2 * i + 1])?;
    }
    Some(out)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// What a sender announces when it opens a data connection: the geometry
/// it learnt from `HelloAck`, which the receiver checks against its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    /// Wire format version ([`VERSION`]).
    pub version: u32,
    /// Bytes per slot.
    pub chunk_bytes: u64,
    /// Number of slots.
    pub capacity_chunks: u64,
    /// The secret from the receiver's `HelloAck` (all zero: none, refused).
    pub secret: [u8; SECRET_LEN],
}

impl Preamble {
    /// Encodes the preamble.
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.capacity_chunks.to_le_bytes());
        b[32..48].copy_from_slice(&self.secret);
        b
    }

    /// Decodes a preamble; `None` if the magic is wrong.
    pub fn decode(b: &[u8; PREAMBLE_LEN]) -> Option<Self> {
        if b[0..8] != MAGIC {
            return None;
        }
        Some(Self {
            version: u32_at(b, 8),
            chunk_bytes: u64_at(b, 16),
            capacity_chunks: u64_at(b, 24),
            secret: {
                let mut s = [0u8; SECRET_LEN];
                s.copy_from_slice(&b[32..48]);
                s
            },
        })
    }
}

/// Encodes the preamble answer with `status`.
pub fn encode_preamble_ack(status: u32) -> [u8; PREAMBLE_ACK_LEN] {
    let mut b = [0u8; PREAMBLE_ACK_LEN];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&status.to_le_bytes());
    b
}

/// Decodes a preamble answer: its status, or `None` if the magic is wrong.
pub fn decode_preamble_ack(b: &[u8; PREAMBLE_ACK_LEN]) -> Option<u32> {
    (b[0..8] == MAGIC).then(|| u32_at(b, 8))
}

/// The header in front of each write's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// Byte offset in the receiver's slot area.
    pub remote_offset: u64,
    /// Payload bytes that follow.
    pub len: u64,
    /// The sender's tag, echoed in the ack.
    pub work_id: u64,
}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.remote_offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.work_id.to_le_bytes());
        b
    }

    /// Decodes a header (any bytes are a header; the receiver validates it).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        Self {
            remote_offset: u64_at(b, 0),
            len: u64_at(b, 8),
            work_id: u64_at(b, 16),
        }
    }
}

/// The receiver's answer to one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ack {
    /// The write's `work_id`.
    pub work_id: u64,
    /// A [`crate::transport::CompletionStatus`] code (0 = landed).
    pub status: u32,
}

impl Ack {
    /// Encodes the ack.
    pub fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..8].copy_from_slice(&self.work_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.status.to_le_bytes());
        b
    }

    /// Decodes an ack from the first [`ACK_LEN`] bytes of `b`.
    pub fn decode(b: &[u8]) -> Option<Self> {
        (b.len() >= ACK_LEN).then(|| Self {
            work_id: u64_at(b, 0),
            status: u32_at(b, 8),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips() {
        let p = Preamble {
            version: VERSION,
            chunk_bytes: 4096,
            capacity_chunks: 7,
            secret: [0xA5; SECRET_LEN],
        };
        assert_eq!(Preamble::decode(&p.encode()), Some(p));
        let secret: [u8; SECRET_LEN] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(decode_secret(&encode_secret(&secret)), Some(secret));
        assert_eq!(
            decode_secret(&encode_secret(&secret).to_uppercase()),
            Some(secret)
        );
        assert_eq!(decode_secret("00"), None);
        assert_eq!(decode_secret(&"g".repeat(2 * SECRET_LEN)), None);
        let mut bad = p.encode();
        bad[0] = b'X';
        assert_eq!(Preamble::decode(&bad), None);
        assert_eq!(decode_preamble_ack(&encode_preamble_ack(2)), Some(2));
        assert_eq!(decode_preamble_ack(&[0; PREAMBLE_ACK_LEN]), None);
        let h = Header {
            remote_offset: 1 << 40,
            len: 3,
            work_id: u64::MAX,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        let a = Ack {
            work_id: 9,
            status: 1,
        };
        assert_eq!(Ack::decode(&a.encode()), Some(a));
        assert_eq!(Ack::decode(&[0; 3]), None);
    }
}
