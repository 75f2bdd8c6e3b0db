//! Lingering: watching a ring for a bounded moment before sleeping, on both
//! sides of an attachment (io_uring's SQPOLL idle time, in microseconds
//! rather than its second). A wake-up of a sleeping thread costs tens of µs
//! on the project's 2-vCPU VM, several times an attached round trip, so a
//! session that stays awake a little after handling work, and a client that
//! stays awake a little after submitting, skip both wake-ups while requests
//! keep coming. Bounded by [`LINGER`], so an idle engine sleeps.

use std::time::{Duration, Instant};

use kvferry_ring::{Backoff, Step};

/// How long a session or client watches its ring before it sleeps: longer
/// than the other side's turnaround in a tight loop (a few µs), far shorter
/// than anything a person or a poll interval would notice.
pub(super) const LINGER: Duration = Duration::from_micros(50);

/// Returns true as soon as `ready()` does, false once [`LINGER`] passed
/// without it. Backs off with [`Backoff`] (spin, then yield), then keeps
/// yielding (the core goes to whoever needs it) until the time is up.
pub(super) fn linger(mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut backoff = Backoff::new();
    loop {
        if ready() {
            return true;
        }
        if backoff.snooze() == Step::ShouldPark {
            if start.elapsed() >= LINGER {
                return false;
            }
            std::thread::yield_now();
        }
    }
}
