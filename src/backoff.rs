//! Bounded spin → yield → park backoff for threads that wait on a condition.
//!
//! A waiting thread calls [`Backoff::snooze`] each time its condition is not
//! yet true. The first few calls spin on the CPU with
//! [`std::hint::spin_loop`] (doubling the number of pause instructions each
//! time), the next few give the core away with [`std::thread::yield_now`],
//! and after that `snooze` returns [`Step::ShouldPark`]: the caller must then
//! block (futex wait, `thread::park`, `mio::Poll::poll`, …) until another
//! thread wakes it. `Backoff` never blocks on its own, so it never hides an
//! unbounded wait: the caller owns the parking and the wake-up protocol.
//!
//! The defaults are tuned for a 2-core machine: a short spin (31 pause
//! instructions in total, well under a microsecond to a few microseconds
//! depending on the CPU's pause latency) and three yields, so that a waiter
//! never holds a core the thread it waits for needs.

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

/// Default number of spin rounds; round `i` spins `2^i` times (1, 2, 4, 8, 16).
pub const DEFAULT_SPIN_ROUNDS: u32 = 5;
/// Default number of `yield_now` rounds after the spin rounds.
pub const DEFAULT_YIELD_ROUNDS: u32 = 3;
/// Spin rounds are capped at this value so that one round never exceeds
/// `2^MAX_SPIN_ROUNDS` pause instructions, whatever the caller asks for.
pub const MAX_SPIN_ROUNDS: u32 = 10;

/// The spin → yield → park discipline as a small state machine.
///
/// ```
/// use kvferry::backoff::{Backoff, Step};
/// use std::sync::atomic::{AtomicBool, Ordering};
///
/// let ready = AtomicBool::new(true);
/// let mut backoff = Backoff::new();
/// // SeqCst: example only.
/// while !ready.load(Ordering::SeqCst) {
///     if backoff.snooze() == Step::ShouldPark {
///         std::thread::park(); // the real code parks on its own wait queue
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
    /// the first `snooze` already returns [`Step::ShouldPark`].
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
    pub fn snooze(&mut self) -> Step {
        if self.step < self.spin_rounds {
            for _ in 0..(1u32 << self.step) {
                std::hint::spin_loop();
            }
            self.step += 1;
            Step::Spun
        } else if self.step < self.spin_rounds.saturating_add(self.yield_rounds) {
            std::thread::yield_now();
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

#[cfg(test)]
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
        let s = steps(&mut b, 12);
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
