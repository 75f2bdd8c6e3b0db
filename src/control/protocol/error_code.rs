//! Machine-readable failure reasons carried in `AllocResponse.code`.
//!
//! The wire form is a snake_case string (`"buffer_too_small"`, ...). Unknown
//! strings from a newer peer are not an error: [`ErrorCode::parse`] returns
//! `None` and the human-readable `error` text still explains the failure.

use std::fmt;

/// Machine-readable failure reasons carried in `AllocResponse.code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request's `total_chunks` exceeds the receiver's whole buffer.
    BufferTooSmall,
    /// Cumulative chunks above `total_chunks`, or another rule of the
    /// protocol was broken (e.g. a batch after the last batch).
    ProtocolViolation,
    /// The request waited for admission longer than the receiver allows.
    AdmissionTimeout,
    /// A request with a `req_id` declared `total_chunks == 0`.
    ZeroTotalChunks,
    /// The frame could not be decoded or broke a decode limit.
    BadMessage,
    /// The request was cancelled (CancelNotif) while this batch was pending.
    Cancelled,
    /// The request's reservation lease expired without progress.
    LeaseExpired,
    /// One chunk (shape x dtype) is larger than the receiver's slot size.
    ChunkTooLarge,
    /// A batch disagrees with earlier batches of the same request
    /// (e.g. a different `total_chunks`, shape or dtype).
    InconsistentRequest,
    /// Slots could not be allocated although the request was admitted.
    AllocationFailed,
    /// The message names a `req_id` the receiver does not track.
    UnknownRequest,
    /// The receiver is shutting down and takes no new work.
    ShuttingDown,
    /// Sender side: a data-plane write of the request failed.
    WriteFailed,
    /// The receiver could not be reached or set up (sender side), or it
    /// could not set up the per-sender data plane a `Hello` asked for (a
    /// receiver's answer to that `Hello`).
    PeerUnavailable,
    /// Sender side: the receiver did not answer in time.
    ReplyTimeout,
    /// The message names a request that belongs to another peer: it
    /// changed nothing (requests are keyed by peer and `req_id`).
    NotOwner,
    /// A bound on what peers may make the receiver hold (parked requests,
    /// batches queued behind them, per-peer state) is reached: refused at
    /// once, nothing was kept. Retry later.
    Overloaded,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::BufferTooSmall,
        ErrorCode::ProtocolViolation,
        ErrorCode::AdmissionTimeout,
        ErrorCode::ZeroTotalChunks,
        ErrorCode::BadMessage,
        ErrorCode::Cancelled,
        ErrorCode::LeaseExpired,
        ErrorCode::ChunkTooLarge,
        ErrorCode::InconsistentRequest,
        ErrorCode::AllocationFailed,
        ErrorCode::UnknownRequest,
        ErrorCode::ShuttingDown,
        ErrorCode::WriteFailed,
        ErrorCode::PeerUnavailable,
        ErrorCode::ReplyTimeout,
        ErrorCode::NotOwner,
        ErrorCode::Overloaded,
    ];

    /// The wire string (snake_case) of this code.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BufferTooSmall => "buffer_too_small",
            ErrorCode::ProtocolViolation => "protocol_violation",
            ErrorCode::AdmissionTimeout => "admission_timeout",
            ErrorCode::ZeroTotalChunks => "zero_total_chunks",
            ErrorCode::BadMessage => "bad_message",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::LeaseExpired => "lease_expired",
            ErrorCode::ChunkTooLarge => "chunk_too_large",
            ErrorCode::InconsistentRequest => "inconsistent_request",
            ErrorCode::AllocationFailed => "allocation_failed",
            ErrorCode::UnknownRequest => "unknown_request",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::WriteFailed => "write_failed",
            ErrorCode::PeerUnavailable => "peer_unavailable",
            ErrorCode::ReplyTimeout => "reply_timeout",
            ErrorCode::NotOwner => "not_owner",
            ErrorCode::Overloaded => "overloaded",
        }
    }

    /// Parses a wire string; `None` for a code this version does not know.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_code() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
            assert_eq!(c.to_string(), c.as_str());
        }
        let mut names: Vec<_> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            ErrorCode::ALL.len(),
            "wire strings must be distinct"
        );
    }

    #[test]
    fn parse_rejects_unknown_and_case_variants() {
        assert_eq!(ErrorCode::parse(""), None);
        assert_eq!(ErrorCode::parse("BufferTooSmall"), None);
        assert_eq!(ErrorCode::parse("buffer_too_small "), None);
        assert_eq!(ErrorCode::parse("some_future_code"), None);
        assert_eq!(
            ErrorCode::parse("lease_expired"),
            Some(ErrorCode::LeaseExpired)
        );
    }
}
