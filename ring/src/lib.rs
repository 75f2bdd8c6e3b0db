//! io_uring-style rings (placeholder, filled by issue 2).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
