//! Engine primitives the control plane is built from: the admission ledger, the
//! slot allocator, the staging buffer, the receive region, cancellation,
//! bounded recent maps, the eventfd wrapper and the sync shim for model checks.

pub mod cancel;
pub(crate) mod eventfd;
pub mod ledger;

/// Byte-bounded "recently seen" maps; internal (not a stable API).
#[doc(hidden)]
pub mod recent;
pub mod region;
pub mod slots;
pub mod staging;
pub(crate) mod stale;
pub(crate) mod sync;
