//! Lingering: watching a ring for a bounded moment before sleeping
//! (io_uring's SQPOLL idle time, in microseconds rather than its second).
//! A wake-up of a sleeping thread costs tens of µs on the project's 2-vCPU
//! VMs (an idle vCPU's wake-up alone is 44 µs on the Intel VM of
//! 2026-12-07), several times an attached round trip. So on both sides of
//! an attachment a session that stays awake a little after handling work,
//! and a client that stays awake a little after submitting, skip both
//! wake-ups while requests keep coming ([`linger`]); and the shm copy
//! engine stays awake a little after its last copy, so the next request's
//! writes find it running ([`linger_within`]). Never longer than
//! [`LINGER_MAX`], so an idle engine sleeps.
//!
//! The spin before the first yield adapts per thread. When the two sides
//! run on different CPUs, spinning finds the other side's answer soonest.
//! When the scheduler keeps them on one CPU, spinning only delays the
//! other side, which needs that CPU to answer: there a waiter should yield
//! at once. A yield that returns only after [`gave_away_after`] gave the CPU to
//! another thread; if the condition then holds, that thread was most
//! likely the other side, and the thread spins one round less next time.
//! A yield that returns at once (nobody else wanted the CPU) earns a round
//! back, up to the project's default.
//!
//! The linger itself adapts too. A wake-up on a starved VM can take longer
//! than [`LINGER`] (70-90 µs measured, at 30 % steal): then, once one side
//! slept, each side sleeps before the other's answer arrives, and every
//! hand-off pays a wake-up from then on, a slow mode that a busy pair
//! never leaves by itself (traced: 165 µs per request, against 4 µs
//! before it fell in). A sleep that the other side ended soon after it
//! began (shorter than [`LINGER_MAX`]) means the thread gave up too
//! early: it lingers twice that sleep next time, up to [`LINGER_MAX`]. A
//! long sleep (the other side was idle) brings it back to [`LINGER`], so
//! an idle engine spends at most [`LINGER_MAX`] yielding per side before
//! it sleeps.
//!
//! The same first yield says where the other side runs. A run of
//! [`SHARED_AFTER`] hand-offs each answered only after this thread's yield
//! gave its CPU away means the two share it ([`sharing_cpu`]); a session
//! then moves off it (`control/attach/placement.rs`).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvferry_ring::backoff::DEFAULT_SPIN_ROUNDS;

/// How long a session or client keeps yielding before it sleeps, after its
/// spin: longer than the other side's turnaround in a tight loop (a few
/// µs), far shorter than anything a person or a poll interval would notice.
/// The least of the adapted linger (module docs).
pub(crate) const LINGER: Duration = Duration::from_micros(50);

/// The most a thread lingers, after sleeps that the other side ended
/// within this (module docs); also the sleep past which it lingers
/// [`LINGER`] again, and the shm copy engine's fixed linger. Twice the
/// slow wake-ups traced (70-90 µs) and a little more; 1 ms kept a prefill
/// session yielding through the gaps of the end-to-end bench, three times
/// its CPU, where this is 1.3-1.8 times.
pub(crate) const LINGER_MAX: Duration = Duration::from_micros(250);

/// The most [`gave_away_after`] takes: a yield that returns later than
/// this ran another thread in between on every machine measured (a bare
/// yield costs 0.2–1 µs there).
const GAVE_AWAY_MAX: Duration = Duration::from_micros(2);

/// The least [`gave_away_after`] takes, whatever a bare yield costs.
const GAVE_AWAY_MIN: Duration = Duration::from_nanos(500);

/// A `sched_yield` that returns later than this ran another thread in
/// between: three times a bare yield on this machine ([`bare_yield`]),
/// within [`GAVE_AWAY_MIN`] and [`GAVE_AWAY_MAX`]. One fixed 2 µs was not
/// enough everywhere: on an Intel VM a yield that hands the CPU to another
/// thread and gets it back takes 1.0–1.1 µs (a bare one 0.2 µs), so no
/// hand-off there ever read as shared.
pub(crate) fn gave_away_after() -> Duration {
    static AFTER: OnceLock<Duration> = OnceLock::new();
    *AFTER.get_or_init(|| gave_away_for(bare_yield()))
}

/// [`gave_away_after`] on a machine whose bare yield costs `bare`.
fn gave_away_for(bare: Duration) -> Duration {
    (bare * 3).clamp(GAVE_AWAY_MIN, GAVE_AWAY_MAX)
}

/// The fastest of 32 `sched_yield`s of the calling thread: what a bare
/// yield costs, if nothing else wanted the CPU during one of them at
/// least; else the cost of a hand-over and back, which leaves
/// [`gave_away_after`] at [`GAVE_AWAY_MAX`]. A daemon measures it as it
/// starts (`Daemon::start`), a client at its first linger.
fn bare_yield() -> Duration {
    (0..32)
        .map(|_| {
            let t = Instant::now();
            std::thread::yield_now();
            t.elapsed()
        })
        .min()
        .unwrap_or(GAVE_AWAY_MAX)
}

thread_local! {
    /// This thread's spin rounds before its first yield (see the module
    /// docs), between 0 and [`DEFAULT_SPIN_ROUNDS`].
    static SPIN_ROUNDS: Cell<u32> = const { Cell::new(DEFAULT_SPIN_ROUNDS) };
    /// This thread's linger, between [`LINGER`] and [`LINGER_MAX`].
    static LINGER_NOW: Cell<Duration> = const { Cell::new(LINGER) };
    /// Hand-offs in a row that this thread's CPU carried both ways: its
    /// first yield gave the CPU away and the answer was there after it.
    static SHARED_STREAK: Cell<u32> = const { Cell::new(0) };
}

/// Hand-offs in a row after which [`sharing_cpu`] says this thread shares
/// its CPU with the other side.
pub(crate) const SHARED_AFTER: u32 = 16;

/// True once the last [`SHARED_AFTER`] hand-offs of this thread's lingers
/// were each answered only after its yield gave the CPU away (the other
/// side most likely runs on this CPU); the count then starts again.
pub(crate) fn sharing_cpu() -> bool {
    let shared = SHARED_STREAK.get() >= SHARED_AFTER;
    if shared {
        SHARED_STREAK.set(0);
    }
    shared
}

/// Returns true as soon as `ready()` does, false once this thread's linger
/// ([`LINGER`] to [`LINGER_MAX`], see [`slept`]) of yielding passed
/// without it: [`linger_within`] this thread's adapted linger.
pub(crate) fn linger(ready: impl FnMut() -> bool) -> bool {
    linger_within(LINGER_NOW.get(), ready)
}

/// Returns true as soon as `ready()` does, false once `linger` of yielding
/// passed without it. Spins first (`2^rounds` pause instructions, this
/// thread's adapted number of rounds, checking after each: the other
/// side's answer is seen within one pause, where
/// [`Backoff`](kvferry_ring::Backoff)'s doubling rounds would check only
/// every 2, 4, … 32 of them), then yields the CPU between checks: on a CPU
/// of its own a yield returns at once, on a shared one it lets the others
/// run.
pub(crate) fn linger_within(linger: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let spin = SPIN_ROUNDS.get();
    for _ in 0..(1u32 << spin) {
        if ready() {
            // The other side answered while this thread held its CPU.
            SHARED_STREAK.set(0);
            return true;
        }
        std::hint::spin_loop();
    }
    // The first yield, timed: it alone adapts the spin.
    let start = Instant::now();
    std::thread::yield_now();
    if ready() {
        let gave_away = start.elapsed() >= gave_away_after();
        SPIN_ROUNDS.set(adapted(spin, gave_away));
        SHARED_STREAK.set(if gave_away {
            // Saturating: a client's thread never asks (only sessions move).
            SHARED_STREAK.get().saturating_add(1)
        } else {
            0
        });
        return true;
    }
    while start.elapsed() < linger {
        std::thread::yield_now();
        if ready() {
            return true;
        }
    }
    // About to sleep: the next wake-up places the thread anew.
    SHARED_STREAK.set(0);
    false
}

/// Spins (no yield) until `ready()`, for at most `d` and at most this
/// thread's adapted spin ([`linger`]'s: none once its yields were seen to
/// hand the CPU to the other side, which a spin would only keep waiting);
/// returns `ready()`'s last answer. For a wait far shorter than a yield's
/// round trip.
pub(crate) fn spin_for(d: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    for i in 0..(1u32 << SPIN_ROUNDS.get()) {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
        // The clock read once per 16 checks: a check is a load or two.
        if i % 16 == 15 && start.elapsed() >= d {
            return false;
        }
    }
    ready()
}

/// Tells this thread's linger how long the sleep that followed a failed
/// [`linger`] lasted, once it ended with work to do: the next linger is
/// [`after_sleep`] of it.
pub(crate) fn slept(slept: Duration) {
    LINGER_NOW.set(after_sleep(slept));
}

/// The linger after a sleep of `slept`: twice it (the other side answered
/// that soon after this thread gave up), within [`LINGER`] and
/// [`LINGER_MAX`]; [`LINGER`] after a sleep of [`LINGER_MAX`] or more (the
/// other side was idle).
fn after_sleep(slept: Duration) -> Duration {
    if slept >= LINGER_MAX {
        LINGER
    } else {
        (slept * 2).clamp(LINGER, LINGER_MAX)
    }
}

/// The spin rounds after a wait that first succeeded right after a yield:
/// one fewer if the yield gave the CPU away, one more (up to the default)
/// if it returned at once.
fn adapted(spin: u32, gave_away: bool) -> u32 {
    if gave_away {
        spin.saturating_sub(1)
    } else {
        (spin + 1).min(DEFAULT_SPIN_ROUNDS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wait` (a spin or a linger) given a condition that holds from its
    /// third check on: it must return true at that check.
    fn returns_at_the_first_true(wait: impl FnOnce(&mut dyn FnMut() -> bool) -> bool) {
        let mut checks = 0;
        assert!(wait(&mut || {
            checks += 1;
            checks == 3
        }));
        assert_eq!(checks, 3, "returned at the first true");
    }

    #[test]
    fn a_short_spin_returns_at_the_condition_or_after_its_rounds_or_time() {
        returns_at_the_first_true(|ready| spin_for(Duration::from_secs(5), ready));
        std::thread::spawn(|| {
            SPIN_ROUNDS.set(DEFAULT_SPIN_ROUNDS);
            let mut checks = 0u32;
            assert!(!spin_for(Duration::from_secs(5), || {
                checks += 1;
                false
            }));
            assert!(
                checks <= (1 << DEFAULT_SPIN_ROUNDS) + 1,
                "spun past its rounds"
            );
            SPIN_ROUNDS.set(0);
            checks = 0;
            assert!(!spin_for(Duration::from_secs(5), || {
                checks += 1;
                false
            }));
            assert!(checks <= 2, "a thread that learned not to spin spun");
            SPIN_ROUNDS.set(20);
            let t = Instant::now();
            assert!(!spin_for(Duration::from_micros(20), || false));
            assert!(t.elapsed() >= Duration::from_micros(20), "gave up early");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_linger_within_a_given_time_returns_at_the_condition_or_after_that_time() {
        returns_at_the_first_true(|ready| linger_within(Duration::from_secs(5), ready));
        let d = Duration::from_micros(300);
        let t = Instant::now();
        assert!(!linger_within(d, || false));
        assert!(t.elapsed() >= d, "gave up after {:?}", t.elapsed());
    }

    #[test]
    fn a_ready_condition_returns_at_once_and_an_idle_one_after_the_linger() {
        assert!(linger(|| true));
        let t = Instant::now();
        assert!(!linger(|| false));
        assert!(t.elapsed() >= LINGER, "gave up before LINGER");
    }

    #[test]
    fn a_sleep_the_other_side_ended_soon_lengthens_the_linger_and_a_long_one_resets_it() {
        let us = Duration::from_micros;
        assert_eq!(
            after_sleep(us(120)),
            us(240),
            "covers a sleep like this one"
        );
        assert_eq!(after_sleep(us(5)), LINGER, "never below LINGER");
        assert_eq!(after_sleep(us(200)), LINGER_MAX, "never above LINGER_MAX");
        assert_eq!(after_sleep(LINGER_MAX), LINGER, "the other side was idle");
        std::thread::spawn(move || {
            slept(us(100));
            let t = Instant::now();
            assert!(!linger(|| false));
            assert!(t.elapsed() >= us(200), "lingered {:?}", t.elapsed());
            slept(Duration::from_secs(1));
            assert_eq!(LINGER_NOW.get(), LINGER);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_spin_shrinks_when_yields_hand_the_cpu_over_and_grows_back() {
        let mut spin = DEFAULT_SPIN_ROUNDS;
        for _ in 0..DEFAULT_SPIN_ROUNDS + 2 {
            spin = adapted(spin, true);
        }
        assert_eq!(
            spin, 0,
            "yields that hand the CPU over: no spin, and no less"
        );
        for _ in 0..DEFAULT_SPIN_ROUNDS + 2 {
            spin = adapted(spin, false);
        }
        assert_eq!(
            spin, DEFAULT_SPIN_ROUNDS,
            "quick yields: back to the default, no more"
        );
    }

    /// Hands off with a thread on this thread's CPU: each linger's yield
    /// runs the other thread, which answers after 5 µs of work (so the
    /// yield returns past [`gave_away_after`] on any machine).
    #[test]
    fn hand_offs_answered_only_after_the_yield_gave_the_cpu_away_say_it_is_shared() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let cpu = *crate::threads::allowed_cpus().first().expect("a CPU");
        // Acquire/Release: each flag publishes only itself.
        let asked = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let other = {
            let (asked, answered, stop) = (asked.clone(), answered.clone(), stop.clone());
            std::thread::spawn(move || {
                crate::threads::confine_current(&[cpu]).unwrap();
                while !stop.load(Ordering::Acquire) {
                    if asked.swap(false, Ordering::AcqRel) {
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_micros(5) {
                            std::hint::spin_loop();
                        }
                        answered.store(true, Ordering::Release);
                    }
                    std::thread::yield_now();
                }
            })
        };
        let rounds = SHARED_AFTER * 20;
        let shared = std::thread::spawn(move || {
            crate::threads::confine_current(&[cpu]).unwrap();
            LINGER_NOW.set(LINGER_MAX);
            (0..rounds).any(|_| {
                answered.store(false, Ordering::Release);
                asked.store(true, Ordering::Release);
                // A linger that gives up (the other thread not run within
                // it) only starts the count again.
                linger(|| answered.load(Ordering::Acquire)) && sharing_cpu()
            })
        })
        .join()
        .unwrap();
        stop.store(true, Ordering::Release);
        other.join().unwrap();
        assert!(
            shared,
            "{rounds} hand-offs with a thread on the same CPU never reported as shared"
        );
    }

    #[test]
    fn the_gave_away_threshold_is_a_few_bare_yields_within_its_bounds() {
        let ns = Duration::from_nanos;
        // The Intel VM: a bare yield 0.19 µs, a hand-over and back 1.0 µs.
        assert_eq!(gave_away_for(ns(190)), ns(570));
        assert!(
            gave_away_for(ns(190)) < ns(1000),
            "a hand-over reads as one"
        );
        assert_eq!(
            gave_away_for(ns(50)),
            GAVE_AWAY_MIN,
            "never below the least"
        );
        assert_eq!(
            gave_away_for(ns(1500)),
            GAVE_AWAY_MAX,
            "never above the most"
        );
        let after = gave_away_after();
        assert!(
            (GAVE_AWAY_MIN..=GAVE_AWAY_MAX).contains(&after),
            "{after:?}"
        );
        assert_eq!(gave_away_after(), after, "measured once");
    }

    #[test]
    fn an_answer_during_the_spin_or_a_failed_linger_ends_the_shared_run() {
        std::thread::spawn(|| {
            SHARED_STREAK.set(SHARED_AFTER);
            assert!(linger(|| true));
            assert!(!sharing_cpu(), "answered during the spin: not shared");
            SHARED_STREAK.set(SHARED_AFTER);
            LINGER_NOW.set(Duration::from_micros(1));
            assert!(!linger(|| false));
            assert!(!sharing_cpu(), "about to sleep: the run starts again");
            SHARED_STREAK.set(SHARED_AFTER);
            assert!(sharing_cpu(), "a full run is shared");
            assert!(!sharing_cpu(), "and the count starts again");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_wait_found_during_the_spin_keeps_this_threads_spin() {
        std::thread::spawn(|| {
            SPIN_ROUNDS.set(2);
            let mut checks = 0;
            assert!(linger(|| {
                checks += 1;
                checks == 2
            }));
            assert_eq!(SPIN_ROUNDS.get(), 2);
        })
        .join()
        .unwrap();
    }
}
