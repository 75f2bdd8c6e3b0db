//! A blocking admission for tests that need one thread per request, built
//! the way a library user would build it from the ledger's non-blocking
//! API: park the request in an [`AdmissionQueue`] whose waker unparks this
//! thread, then collect the grant. The ledger itself never blocks.
#![allow(dead_code)] // each test file uses its own subset

use std::thread;
use std::time::Instant;

use kvferry::ledger::{AdmissionQueue, AdmitError, Ledger, Reservation};

/// Admits `n` chunks of `ledger` in FIFO order, waiting until they are
/// granted or `deadline` passes (`AdmitError::Timeout`).
pub fn admit_blocking(
    ledger: &Ledger,
    n: usize,
    deadline: Instant,
) -> Result<Reservation, AdmitError> {
    let me = thread::current();
    let mut q = AdmissionQueue::with_waker(move || me.unpark());
    if let Some(r) = q.admit_or_park(ledger, (), n, deadline)? {
        return Ok(r);
    }
    loop {
        if let Some((_, r)) = q.grant_ready(ledger).pop() {
            return Ok(r);
        }
        let now = Instant::now();
        if !q.expire(now).is_empty() {
            return Err(AdmitError::Timeout);
        }
        // A grant between the check above and here unparks us at once.
        thread::park_timeout(deadline.saturating_duration_since(now));
    }
}
