//! Errors of the reservation ledger.

/// Why an admission did not produce a [`Reservation`](super::Reservation).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AdmitError {
    /// The request needs more chunks than the whole buffer holds; it can
    /// never be admitted, so it is refused at once and never parked.
    #[error(
        "request needs {requested} chunks but the whole receive buffer holds only {capacity}; \
         it can never be admitted"
    )]
    TooLarge {
        /// Chunks the request asked for.
        requested: usize,
        /// The ledger's total capacity in chunks.
        capacity: usize,
    },
    /// The deadline passed before enough capacity was free for this request.
    #[error("timed out waiting for receive-buffer capacity")]
    Timeout,
    /// Not enough free capacity right now, or earlier requests are queued
    /// ahead (admission is first-come first-served).
    #[error(
        "not enough free receive-buffer capacity right now (or earlier requests are queued first)"
    )]
    WouldBlock,
}

/// A [`Reservation::allocate`](super::Reservation::allocate) asked for more
/// chunks than the reservation still holds (a caller bug; nothing changed).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[error("tried to allocate {requested} chunks from a reservation that has only {remaining} left")]
pub struct OverAllocate {
    /// Chunks the caller tried to allocate.
    pub requested: usize,
    /// Chunks the reservation still held.
    pub remaining: usize,
}
