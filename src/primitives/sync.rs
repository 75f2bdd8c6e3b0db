//! Synchronisation shim: std primitives normally, shuttle's under the
//! `shuttle-model` feature.
//!
//! The ledger, the slot allocator and the cancel token take every atomic,
//! mutex and park/unpark call from here, so the model tests in
//! `tests/ledger_model.rs` and `tests/slots_model.rs` check the *real* code
//! with shuttle's scheduler-controlled primitives (a lost wakeup shows up as a
//! shuttle deadlock, since shuttle treats `park_timeout` as `park`).
//!
//! The feature is for model checking only: with it on, these types only work
//! inside `shuttle::check_*`, so never enable it in a normal build or for the
//! rest of the test suite (see docs/admission.md for the exact command).

#[cfg(not(feature = "shuttle-model"))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicUsize},
    Mutex, MutexGuard,
};
#[cfg(not(feature = "shuttle-model"))]
pub(crate) use std::thread::{current as current_thread, park, park_timeout, yield_now, Thread};

#[cfg(feature = "shuttle-model")]
pub(crate) use shuttle::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicUsize},
    Mutex, MutexGuard,
};
#[cfg(feature = "shuttle-model")]
pub(crate) use shuttle::thread::{
    current as current_thread, park, park_timeout, yield_now, Thread,
};

pub(crate) use std::sync::atomic::Ordering;
pub(crate) use std::sync::Arc;

/// The project's one spin → yield → park policy ([`kvferry_ring::Backoff`]).
/// Under shuttle, one spin and one yield round: every re-check of the
/// condition is a scheduling point there, and the model explores the parking
/// path, where a lost wakeup would show.
pub(crate) fn backoff() -> kvferry_ring::Backoff {
    if cfg!(feature = "shuttle-model") {
        kvferry_ring::Backoff::with_limits(1, 1)
    } else {
        kvferry_ring::Backoff::new()
    }
}

/// Locks `m`, recovering from poisoning: the critical sections in this crate
/// never panic half-way through an update, so the data is consistent even if
/// some unrelated panic poisoned the lock.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
