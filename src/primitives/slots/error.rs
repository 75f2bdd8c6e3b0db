//! Errors of the slot allocator.

/// Why a blocking [`SlotAllocator::alloc`](super::SlotAllocator::alloc) failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// More slots were asked for than the allocator has in total; the
    /// request could never be served, so it fails at once.
    #[error("asked for {requested} staging slots but there are only {slots} in total")]
    TooLarge {
        /// Slots asked for.
        requested: usize,
        /// Total slots in the allocator.
        slots: usize,
    },
    /// The deadline passed before enough slots were free.
    #[error("timed out waiting for free staging slots")]
    Timeout,
    /// The caller's cancel token was cancelled while it waited.
    #[error("slot allocation was cancelled while waiting for free staging slots")]
    Cancelled,
}
