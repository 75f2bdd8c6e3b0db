//! The one spin → yield → park policy of kvferry: every thread that waits
//! for a condition (a ring consumer, the admission and slot queues, the RDMA
//! completion poller, a producer facing a full ring) backs off with
//! [`Backoff`].
//!
//! The first calls to [`Backoff::snooze`] spin on the CPU with
//! [`std::hint::spin_loop`], doubling the number of pause instructions each
//! round; the next few give the core away with [`std::thread::yield_now`];
//! after that `snooze` returns [`Step::ShouldPark`] and the caller blocks on
//! its own wait queue (a futex, `thread::park_timeout`, `poll(2)`, …) with a
//! deadline, until another thread wakes it. `Backoff` never blocks on its
//! own, so it never hides an unbounded wait: the caller owns the parking and
//! the wake-up protocol.
//!
//! The defaults suit the 2-core target: 6 spin rounds (63 pause
//! instructions, a few microseconds at most) and 4 yields, so a waiter never
//! holds a core for long that the thread it waits for needs. Under
//! `--cfg loom` every step is a loom yield and the default limits are zero
//! (loom explores the parking path, where the interesting interleavings are).

use crate::sync;

/// What [`Backoff::snooze`] did, or what the caller must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The call spun on the CPU for a short while; re-check the condition.
    Spun,
    /// The call yielded the CPU to another thread; re-check the condition.
    Yielded,
    /// Spinning and yielding are exhausted: re-check the condition once more
    /// and then park until woken. Further calls keep returning `ShouldPark`
    /// (and do nothing) until [`Backoff::reset`].
    ShouldPark,
}

/// Default number of spin rounds; round `i` spins `2^i` times (1, 2, 4, .., 32).
pub const DEFAULT_SPIN_ROUNDS: u32 = if cfg!(loom) { 0 } else { 6 };
/// Default number of `yield_now` rounds after the spin rounds.
pub const DEFAULT_YIELD_ROUNDS: u32 = if cfg!(loom) { 0 } else { 4 };
/// Spin rounds are capped at this value so that one round never exceeds
/// `2^MAX_SPIN_ROUNDS` pause instructions, whatever the caller asks for.
pub const MAX_SPIN_ROUNDS: u32 = 10;

/// The spin → yield → park discipline as a small state machine.
///
/// ```
/// use kvferry_ring::backoff::{Backoff, Step};
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::time::Duration;
///
/// let ready = AtomicBool::new(true);
/// let mut backoff = Backoff::new();
/// // Acquire: pairs with the Release store of whoever sets the flag.
/// while !ready.load(Ordering::Acquire) {
///     if backoff.snooze() == Step::ShouldPark {
///         // The real code parks on its own wait queue, with a deadline.
///         std::thread::park_timeout(Duration::from_millis(1));
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    step: u32,
    spin_rounds: u32,
    yield_rounds: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// A backoff with the default limits ([`DEFAULT_SPIN_ROUNDS`],
    /// [`DEFAULT_YIELD_ROUNDS`]).
    pub const fn new() -> Self {
        Self::with_limits(DEFAULT_SPIN_ROUNDS, DEFAULT_YIELD_ROUNDS)
    }

    /// A backoff with `spin_rounds` spin rounds (capped at
    /// [`MAX_SPIN_ROUNDS`]) followed by `yield_rounds` yields. With both zero
    /// the first `snooze` already returns [`Step::ShouldPark`]. For model
    /// checkers, which must keep every wait short; production code uses
    /// [`Backoff::new`].
    pub const fn with_limits(spin_rounds: u32, yield_rounds: u32) -> Self {
        let spin_rounds = if spin_rounds > MAX_SPIN_ROUNDS {
            MAX_SPIN_ROUNDS
        } else {
            spin_rounds
        };
        Self {
            step: 0,
            spin_rounds,
            yield_rounds,
        }
    }

    /// Back off once: spin, yield, or report that the caller should park.
    #[inline]
    pub fn snooze(&mut self) -> Step {
        if self.step < self.spin_rounds {
            for _ in 0..(1u32 << self.step) {
                sync::spin_hint();
            }
            self.step += 1;
            Step::Spun
        } else if self.step < self.spin_rounds.saturating_add(self.yield_rounds) {
            sync::yield_now();
            self.step += 1;
            Step::Yielded
        } else {
            Step::ShouldPark
        }
    }

    /// True once spinning and yielding are exhausted (the next `snooze`
    /// returns [`Step::ShouldPark`]).
    pub fn is_exhausted(&self) -> bool {
        self.step >= self.spin_rounds.saturating_add(self.yield_rounds)
    }

    /// Start over with spinning; call after the condition became true or
    /// after waking from a park.
    pub fn reset(&mut self) {
        self.step = 0;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn steps(b: &mut Backoff, n: usize) -> Vec<Step> {
        (0..n).map(|_| b.snooze()).collect()
    }

    #[test]
    fn default_sequence_spins_then_yields_then_parks() {
        let mut b = Backoff::new();
        let s = steps(&mut b, 14);
        let spins = DEFAULT_SPIN_ROUNDS as usize;
        let yields = DEFAULT_YIELD_ROUNDS as usize;
        assert!(s[..spins].iter().all(|&x| x == Step::Spun), "{s:?}");
        assert!(
            s[spins..spins + yields].iter().all(|&x| x == Step::Yielded),
            "{s:?}"
        );
        assert!(
            s[spins + yields..].iter().all(|&x| x == Step::ShouldPark),
            "{s:?}"
        );
        assert!(b.is_exhausted());
    }

    #[test]
    fn reset_restarts_with_spinning() {
        let mut b = Backoff::new();
        while b.snooze() != Step::ShouldPark {}
        b.reset();
        assert!(!b.is_exhausted());
        assert_eq!(b.snooze(), Step::Spun);
    }

    #[test]
    fn zero_limits_park_at_once() {
        let mut b = Backoff::with_limits(0, 0);
        assert!(b.is_exhausted());
        assert_eq!(b.snooze(), Step::ShouldPark);
    }

    #[test]
    fn custom_limits_and_spin_cap() {
        let mut b = Backoff::with_limits(1, 2);
        assert_eq!(
            steps(&mut b, 4),
            [Step::Spun, Step::Yielded, Step::Yielded, Step::ShouldPark]
        );
        // A huge spin request is capped so that one round stays short.
        let mut big = Backoff::with_limits(u32::MAX, u32::MAX);
        let s = steps(&mut big, MAX_SPIN_ROUNDS as usize + 1);
        assert!(s[..MAX_SPIN_ROUNDS as usize]
            .iter()
            .all(|&x| x == Step::Spun));
        assert_eq!(s[MAX_SPIN_ROUNDS as usize], Step::Yielded);
    }

    /// A waiter that uses Backoff and parks is woken by the setter and
    /// observes the flag.
    #[test]
    fn waiter_parks_and_is_woken() {
        let flag = Arc::new(AtomicBool::new(false));
        let parked = Arc::new(AtomicBool::new(false));
        let (f2, p2) = (flag.clone(), parked.clone());
        let waiter = std::thread::spawn(move || {
            let mut b = Backoff::new();
            let deadline = Instant::now() + Duration::from_secs(10);
            // Acquire pairs with the Release store of the setter.
            while !f2.load(Ordering::Acquire) {
                if b.snooze() == Step::ShouldPark {
                    // Release: pairs with the Acquire load in the setter loop.
                    p2.store(true, Ordering::Release);
                    std::thread::park_timeout(Duration::from_millis(50));
                    assert!(Instant::now() < deadline, "waiter was never woken");
                    b.reset();
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        // Acquire pairs with the waiter's Release store.
        while !parked.load(Ordering::Acquire) {
            assert!(
                Instant::now() < deadline,
                "waiter never reached the park step"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Release: publishes the flag to the waiter's Acquire load.
        flag.store(true, Ordering::Release);
        waiter.thread().unpark();
        waiter.join().unwrap();
    }
}
