//! A session moving off its client's CPU. Where the scheduler runs a woken
//! thread on its waker's CPU (the project's VM does, nearly always), a
//! session woken by its client's doorbell shares that CPU with it, and
//! while the two keep handing work to each other every hand-off is a
//! context switch (3-4 µs per one-chunk round trip there, against 1.5-2 µs
//! side by side). [`sharing_cpu`](crate::util::linger::sharing_cpu) tells from
//! the session's own lingers when that is so; [`StepOff`] then moves the
//! session to another CPU of its set, once per busy spell.
//!
//! The move costs the wake-up of an idle CPU (50-65 µs measured on the
//! project's VM), which a short burst would not earn back; hence the
//! [`SHARED_AFTER`](crate::util::linger::SHARED_AFTER) hand-offs first, about
//! what the move costs in shared hand-offs (a rent-or-buy bound: a burst
//! pays at most about twice the cheaper choice). A session confined to
//! one CPU (`--cpus 0`) cannot move and stays; it asks the kernel again
//! only after [`RETRY_AFTER`] more shared spells, in case its set was
//! widened.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::threads::step_off_current_cpu;

/// Shared spells a session that could not move lets pass before it asks
/// the kernel again (two syscalls per ask).
pub(super) const RETRY_AFTER: u32 = 64;

/// One session's moves off its client's CPU.
#[derive(Debug, Default)]
pub(super) struct StepOff {
    /// Shared spells still to let pass after a refused move.
    skip: u32,
}

impl StepOff {
    /// A shared spell ended (the session's last hand-offs all ran on its
    /// client's CPU): moves the session off that CPU if its set allows,
    /// counting the move in `moved`.
    pub(super) fn shared_spell(&mut self, moved: &AtomicU64) {
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        if step_off_current_cpu() {
            // Relaxed: a statistic, read on its own.
            moved.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("attach: moved the session off its client's CPU");
        } else {
            self.skip = RETRY_AFTER;
        }
    }
}
