//! The plain-data entries of the submission and completion rings: a write to
//! post ([`WriteOp`]) and its outcome ([`Completion`]).

use std::fmt;

use kvferry_ring::Plain;

/// Index of a connected peer, as returned by [`super::Poster::connect`].
pub type PeerIndex = u32;

/// One write: `len` bytes at `local_offset` of local memory `local_region`
/// (0: the staging buffer; else a region the caller registered, see
/// [`StagingBuffer::source`](crate::staging::StagingBuffer::source)) go to
/// `remote_offset` of peer `peer`'s receive buffer (offsets relative to the
/// start of the slot area: slot `i` at `i * chunk_bytes`). `work_id` is the
/// caller's tag, returned in the [`Completion`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WriteOp {
    /// Caller's tag, echoed in the completion.
    pub work_id: u64,
    /// Byte offset in the local memory `local_region`.
    pub local_offset: u64,
    /// Byte offset in the peer's slot area.
    pub remote_offset: u64,
    /// Bytes to write (0 is valid and writes nothing).
    pub len: u64,
    /// Target peer (from `connect`).
    pub peer: PeerIndex,
    /// Local memory the bytes are read from: 0 = the staging buffer, else a
    /// registered region's id. Also makes the struct free of padding.
    pub local_region: u32,
}

// SAFETY: repr(C) struct of u64/u32 fields with no padding
// (4 * 8 + 2 * 4 = 40 bytes, alignment 8, no implicit padding): every bit
// pattern is a valid value and it holds no pointer.
unsafe impl Plain for WriteOp {}

/// The outcome of one [`WriteOp`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Completion {
    /// The op's `work_id`.
    pub work_id: u64,
    /// 0 = ok, else a [`CompletionStatus`] code.
    pub status: u32,
    /// Explicit padding; always 0.
    pub _pad: u32,
}

// SAFETY: repr(C) struct of u64 + 2 * u32 = 16 bytes, alignment 8, no
// implicit padding; every bit pattern is valid and it holds no pointer.
unsafe impl Plain for Completion {}

impl Completion {
    /// A completion of `work_id` with `status`.
    pub fn new(work_id: u64, status: CompletionStatus) -> Self {
        Self {
            work_id,
            status: status as u32,
            _pad: 0,
        }
    }

    /// True if the write landed.
    pub fn ok(&self) -> bool {
        self.status == CompletionStatus::Ok as u32
    }

    /// The status; an unknown code reads as [`CompletionStatus::TransportError`].
    pub fn status(&self) -> CompletionStatus {
        CompletionStatus::from_u32(self.status).unwrap_or(CompletionStatus::TransportError)
    }
}

/// Why a write completed the way it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompletionStatus {
    /// The bytes landed.
    Ok = 0,
    /// The local or remote range lies outside its buffer; nothing was written.
    OutOfBounds = 1,
    /// `peer` is not connected; nothing was written.
    UnknownPeer = 2,
    /// Failed on purpose by the fault-injection wrapper; nothing was written.
    Injected = 3,
    /// The connection to the peer broke; the bytes may not have landed.
    ConnectionLost = 4,
    /// Any other transport failure.
    TransportError = 5,
}

impl CompletionStatus {
    /// Every status, in code order.
    pub const ALL: [CompletionStatus; 6] = [
        Self::Ok,
        Self::OutOfBounds,
        Self::UnknownPeer,
        Self::Injected,
        Self::ConnectionLost,
        Self::TransportError,
    ];

    /// The status with wire code `code`, if any.
    pub fn from_u32(code: u32) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// A short name (`"ok"`, `"out_of_bounds"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::OutOfBounds => "out_of_bounds",
            Self::UnknownPeer => "unknown_peer",
            Self::Injected => "injected",
            Self::ConnectionLost => "connection_lost",
            Self::TransportError => "transport_error",
        }
    }
}

impl fmt::Display for CompletionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(std::mem::size_of::<WriteOp>(), 40);
        assert_eq!(std::mem::size_of::<Completion>(), 16);
    }

    #[test]
    fn status_codes_roundtrip() {
        for s in CompletionStatus::ALL {
            assert_eq!(CompletionStatus::from_u32(s as u32), Some(s));
            assert_eq!(Completion::new(7, s).status(), s);
        }
        assert_eq!(CompletionStatus::from_u32(6), None);
        let odd = Completion {
            work_id: 1,
            status: 99,
            _pad: 0,
        };
        assert!(!odd.ok());
        assert_eq!(odd.status(), CompletionStatus::TransportError);
        assert_eq!(CompletionStatus::OutOfBounds.to_string(), "out_of_bounds");
    }
}
