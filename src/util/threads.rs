//! Spawning named engine threads, optionally pinned to a CPU.
//!
//! Pinning pitfall (see `research/rust-deps-and-rings.md`, item 10): a
//! spawned thread inherits its parent's affinity mask, and
//! `core_affinity::get_core_ids()` reports the *calling thread's* mask. If
//! the core list were queried after some thread had been pinned, it could
//! shrink to a single core and every "pinned" thread would land there. This
//! module therefore snapshots the allowed core list once, on first use
//! ([`allowed_cpus`](crate::threads::allowed_cpus)), and checks pin requests against that snapshot.
//! [`PinPlan::new`](crate::threads::PinPlan::new) and [`spawn_named`](crate::threads::spawn_named) both take the snapshot before they
//! pin anything, and kvferry never pins the thread that calls it, only the
//! threads it spawns, unless asked to with
//! [`confine_current`](crate::threads::confine_current) (which also takes
//! the snapshot first). A program that pins its own threads by other means
//! should call [`allowed_cpus`](crate::threads::allowed_cpus) first.
//!
//! A pin request for a CPU outside the snapshot (or one the kernel refuses)
//! is not an error for the thread: it logs a `tracing` warning and runs
//! unpinned.
//!
//! Stopping: every drop or stop path that waits for one of its threads
//! joins it with [`join_within`](crate::threads::join_within), never with a bare `JoinHandle::join`:
//! a thread stuck in a syscall or a peer's hands then costs the caller a
//! bounded wait and a warning naming it, not a hung process.

use std::io;
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a thread could not be pinned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PinError {
    /// The CPU id is not in the process's allowed core list.
    #[error("cpu {cpu} is not in the allowed core list {allowed:?}")]
    NotAllowed {
        /// The requested CPU id.
        cpu: usize,
        /// The allowed core list snapshot.
        allowed: Vec<usize>,
    },
    /// The kernel refused to set the affinity (sched_setaffinity failed).
    #[error("the kernel refused to pin the thread to cpu {cpu}")]
    Refused {
        /// The requested CPU id.
        cpu: usize,
    },
    /// [`confine_current`] was given no CPU.
    #[error("no cpu given")]
    Empty,
    /// The kernel refused [`confine_current`]'s set.
    #[error("the kernel refused to run the thread on cpus {cpus:?}")]
    RefusedSet {
        /// The requested CPU ids.
        cpus: Vec<usize>,
    },
}

/// Largest CPU id + 1 that a `cpu_set_t` can hold; `core_affinity` would
/// index out of bounds for larger ids, so they are rejected up front.
pub(crate) const CPU_SET_CAPACITY: usize = 1024;

static ALLOWED: OnceLock<Vec<usize>> = OnceLock::new();

/// The CPU ids this process may run on, as seen the first time this function
/// was called (see the module docs for why it is a snapshot). Empty if the
/// platform cannot report it, in which case every pin request runs unpinned.
pub fn allowed_cpus() -> &'static [usize] {
    ALLOWED.get_or_init(current_cpus)
}

/// Pin the calling thread to `cpu` after checking it against
/// [`allowed_cpus`].
pub fn pin_current(cpu: usize) -> Result<(), PinError> {
    pin_current_checked(cpu, allowed_cpus())
}

/// Checks `cpu` against [`allowed_cpus`] without pinning anything:
/// [`PinError::NotAllowed`] for one a pin would refuse.
pub fn check_allowed(cpu: usize) -> Result<(), PinError> {
    check_in(cpu, allowed_cpus())
}

fn check_in(cpu: usize, allowed: &[usize]) -> Result<(), PinError> {
    if cpu < CPU_SET_CAPACITY && allowed.contains(&cpu) {
        return Ok(());
    }
    Err(PinError::NotAllowed {
        cpu,
        allowed: allowed.to_vec(),
    })
}

fn pin_current_checked(cpu: usize, allowed: &[usize]) -> Result<(), PinError> {
    check_in(cpu, allowed)?;
    if core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        Ok(())
    } else {
        Err(PinError::Refused { cpu })
    }
}

/// Restricts the calling thread to the CPUs `cpus`, after checking each
/// against [`allowed_cpus`] (whose snapshot is taken first, so a thread
/// spawned later may still be pinned to an allowed CPU outside `cpus`).
/// Threads the caller spawns afterwards inherit the restriction; threads
/// already running keep theirs.
///
/// This is how a daemon keeps all its threads (and a library's, such as
/// ZMQ's I/O threads) off a CPU it gives one engine thread: confine the
/// main thread before anything is spawned, then pin that engine thread
/// there (`kvferry sender --cpus 0 --copy-cpu 1`, docs/attach.md). Unlike
/// [`spawn_named`]'s pins this fails rather than warns: the caller asked
/// for a placement of the whole process and should say it is not there.
///
/// Errors: [`PinError::Empty`] for no CPUs, [`PinError::NotAllowed`] for
/// the first CPU outside the allowed list, [`PinError::RefusedSet`] if the
/// kernel refuses.
pub fn confine_current(cpus: &[usize]) -> Result<(), PinError> {
    confine_current_checked(cpus, allowed_cpus())
}

fn confine_current_checked(cpus: &[usize], allowed: &[usize]) -> Result<(), PinError> {
    if cpus.is_empty() {
        return Err(PinError::Empty);
    }
    for &cpu in cpus {
        check_in(cpu, allowed)?;
    }
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside
    // it (every id is below CPU_SET_CAPACITY = CPU_SETSIZE, checked
    // above), and sched_setaffinity only reads `set` for the size passed.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(PinError::RefusedSet {
            cpus: cpus.to_vec(),
        })
    }
}

/// Moves the calling thread off the CPU it runs on, to another CPU of its
/// own affinity set, and leaves that set as it was: true if it moved.
/// False (nothing changed) if the set has no other CPU, as for a thread
/// pinned or confined to one, or if the kernel refuses.
///
/// The kernel migrates a thread whose set no longer holds its CPU before
/// `sched_setaffinity` returns, and does not move it back when the old set
/// is restored: the thread stays on the new CPU until the scheduler next
/// places it (a wake-up, the load balancer). An attach session uses this
/// when it finds itself sharing its client's CPU (`docs/attach.md`,
/// "Placing the threads").
pub(crate) fn step_off_current_cpu() -> bool {
    // SAFETY: sched_getcpu takes nothing and returns a CPU id or -1.
    let Ok(cpu) = usize::try_from(unsafe { libc::sched_getcpu() }) else {
        return false;
    };
    let Some(set) = take_out_of_current_set(cpu) else {
        return false;
    };
    // Restoring the set cannot fail where setting a subset of it did; if
    // it did, the thread keeps running on the others.
    // SAFETY: sched_setaffinity only reads `set` for the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    true
}

/// Takes `cpu` out of the calling thread's affinity set, keeping every
/// other CPU of it: true if it did. False (nothing changed) if `cpu` is not
/// in the set, if it is the set's only CPU (a thread placed there alone
/// stays), or if the kernel refuses. An attached client keeps the thread
/// that attaches off the CPU its daemon keeps for a copy engine
/// (`docs/attach.md`, "Placing the threads").
pub(crate) fn keep_current_off(cpu: usize) -> bool {
    take_out_of_current_set(cpu).is_some()
}

/// Sets the calling thread's affinity set to the one it has without `cpu`
/// and returns the set it had; `None` (nothing changed) if `cpu` is not
/// in it, is its only CPU, or the kernel refuses. The one mechanism of
/// [`step_off_current_cpu`] (which restores the set) and
/// [`keep_current_off`] (which keeps the new one).
fn take_out_of_current_set(cpu: usize) -> Option<libc::cpu_set_t> {
    if cpu >= CPU_SET_CAPACITY {
        return None;
    }
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity writes
    // at most `size_of::<cpu_set_t>()` bytes into it; CPU_ISSET, CPU_CLR and
    // CPU_COUNT stay inside it (`cpu` < CPU_SET_CAPACITY = CPU_SETSIZE);
    // sched_setaffinity only reads the set for the size passed.
    unsafe {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut set) != 0 || !libc::CPU_ISSET(cpu, &set) {
            return None;
        }
        let mut others = set;
        libc::CPU_CLR(cpu, &mut others);
        (libc::CPU_COUNT(&others) > 0 && libc::sched_setaffinity(0, size, &others) == 0)
            .then_some(set)
    }
}

/// The calling thread's affinity set, sorted, without repeats
/// (`core_affinity` reads the calling thread's; empty if the platform does
/// not say).
pub(crate) fn current_cpus() -> Vec<usize> {
    let mut ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Spawn a thread called `name`; if `pin` is `Some(cpu)` the thread pins
/// itself to `cpu` before running `f`.
///
/// A CPU that is not allowed (or that the kernel refuses) is logged as a
/// `tracing` warning and the thread runs unpinned; it never panics.
/// Errors: `InvalidInput` if `name` contains a NUL byte (std would panic),
/// or the OS error if the thread cannot be created.
pub fn spawn_named<F, T>(name: &str, pin: Option<usize>, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    if name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("thread name {name:?} contains a NUL byte"),
        ));
    }
    // Snapshot the allowed list in the parent, before the child pins itself.
    let allowed = allowed_cpus();
    let owned_name = name.to_owned();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            if let Some(cpu) = pin {
                match pin_current_checked(cpu, allowed) {
                    Ok(()) => tracing::debug!(thread = %owned_name, cpu, "pinned thread"),
                    Err(e) => tracing::warn!(
                        thread = %owned_name,
                        error = %e,
                        "cannot pin thread; running unpinned"
                    ),
                }
            }
            f()
        })
}

/// How long a drop or stop path waits for a thread it asked to stop, where
/// the owner has no better bound (a transport derives its own from its I/O
/// timeouts). kvferry's threads poll a stop signal and end within
/// milliseconds of it, so a thread still running after this is stuck.
pub const STOP_JOIN_DEADLINE: Duration = Duration::from_secs(5);

/// Longest nap between two checks of [`join_within`] once spinning and
/// yielding are exhausted.
const JOIN_MAX_NAP: Duration = Duration::from_millis(5);

/// Why [`join_within`] returned without the thread's value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JoinError {
    /// The thread was still running at the deadline; it was detached (it
    /// keeps running and its resources stay alive until it ends).
    #[error("thread {thread} did not finish within {waited:?}; detached")]
    TimedOut {
        /// What the caller called the thread.
        thread: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The thread panicked (its panic message was already printed).
    #[error("thread {thread} panicked")]
    Panicked {
        /// What the caller called the thread.
        thread: String,
    },
    /// The caller is the thread itself (e.g. a callback dropped the last
    /// owner of the engine): joining would deadlock, so it was detached.
    #[error("thread {thread} cannot join itself; detached")]
    OwnThread {
        /// What the caller called the thread.
        thread: String,
    },
}

/// Waits at most `limit` for the thread of `handle` (called `what` in logs
/// and errors) to finish and returns its value.
///
/// A `JoinHandle` cannot be joined with a timeout, so this waits for
/// [`JoinHandle::is_finished`] with the project's spin → yield backoff,
/// then naps of at most 5 ms until the deadline; an idle wait costs no
/// CPU to speak of. At the deadline it logs a warning naming the thread
/// and detaches it ([`JoinError::TimedOut`]); it never blocks past
/// `limit`. A panicked thread is [`JoinError::Panicked`] (logged at debug
/// level), a thread joining itself [`JoinError::OwnThread`].
///
/// Not for a thread that may still touch memory a caller owns: see
/// [`join_or_wait`].
pub fn join_within<T>(handle: JoinHandle<T>, limit: Duration, what: &str) -> Result<T, JoinError> {
    let handle = finished_within(handle, limit, what)?;
    if !handle.is_finished() {
        tracing::warn!(
            thread = what,
            os_name = handle.thread().name().unwrap_or("<unnamed>"),
            ?limit,
            "thread did not finish within its stop deadline; detaching it"
        );
        return Err(JoinError::TimedOut {
            thread: what.to_owned(),
            waited: limit,
        });
    }
    join_now(handle, what)
}

/// [`join_within`] for a thread that may still read or write memory its
/// owner's caller owns (registered sender memory, a receive buffer at a
/// pointer): detaching it would let it touch that memory after the drop
/// returned, which the `unsafe` contracts of
/// [`Sender::register`](crate::sender::Sender::register) and
/// [`RecvBuffer::from_raw`](crate::region::RecvBuffer::from_raw) promise
/// never happens. So at the deadline it logs an error naming the thread
/// and then waits for it without one: a hang that says what hung rather
/// than a use-after-free. Errors: [`JoinError::Panicked`],
/// [`JoinError::OwnThread`] (never `TimedOut`).
pub fn join_or_wait<T>(handle: JoinHandle<T>, limit: Duration, what: &str) -> Result<T, JoinError> {
    let handle = finished_within(handle, limit, what)?;
    if !handle.is_finished() {
        tracing::error!(
            thread = what,
            os_name = handle.thread().name().unwrap_or("<unnamed>"),
            ?limit,
            "thread did not finish within its stop deadline; it may still touch caller memory, so waiting for it"
        );
    }
    join_now(handle, what)
}

/// Waits up to `limit` for `handle`'s thread to finish (see
/// [`join_within`]); returns the handle either way, or `OwnThread`.
fn finished_within<T>(
    handle: JoinHandle<T>,
    limit: Duration,
    what: &str,
) -> Result<JoinHandle<T>, JoinError> {
    if handle.thread().id() == std::thread::current().id() {
        tracing::debug!(
            thread = what,
            "not joining the current thread; detaching it"
        );
        return Err(JoinError::OwnThread {
            thread: what.to_owned(),
        });
    }
    let end = Instant::now() + limit;
    let mut backoff = crate::sync::backoff();
    let mut nap = Duration::from_micros(50);
    while !handle.is_finished() {
        let now = Instant::now();
        if now >= end {
            break;
        }
        if backoff.snooze() == kvferry_ring::backoff::Step::ShouldPark {
            std::thread::park_timeout(nap.min(end - now));
            nap = (nap * 2).min(JOIN_MAX_NAP);
        }
    }
    Ok(handle)
}

fn join_now<T>(handle: JoinHandle<T>, what: &str) -> Result<T, JoinError> {
    handle.join().map_err(|_| {
        tracing::debug!(thread = what, "thread panicked");
        JoinError::Panicked {
            thread: what.to_owned(),
        }
    })
}

/// Hands out CPU ids from a configured list round-robin, one per thread
/// role, so that a config like `cpus = [0, 1]` spreads the engine's threads.
/// [`PinPlan::none`] (or an empty list) leaves every thread unpinned.
#[derive(Debug, Clone, Default)]
pub struct PinPlan {
    cpus: Vec<usize>,
    next: usize,
}

impl PinPlan {
    /// A plan over `cpus` (in the given order). Takes the allowed-core
    /// snapshot now, before anything is pinned; ids outside it are kept
    /// (they are reported when a thread tries to use them).
    pub fn new(cpus: Vec<usize>) -> Self {
        let allowed = allowed_cpus();
        for cpu in cpus.iter().filter(|c| !allowed.contains(c)) {
            tracing::debug!(
                cpu,
                ?allowed,
                "pin plan names a cpu outside the allowed set"
            );
        }
        Self { cpus, next: 0 }
    }

    /// A plan that never pins.
    pub fn none() -> Self {
        Self::default()
    }

    /// True if the plan never pins.
    pub fn is_empty(&self) -> bool {
        self.cpus.is_empty()
    }

    /// The configured CPU ids.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// The next CPU id, round-robin; `None` for an empty plan.
    #[allow(clippy::should_implement_trait)] // endless round-robin, not an Iterator
    pub fn next(&mut self) -> Option<usize> {
        if self.cpus.is_empty() {
            return None;
        }
        let cpu = self.cpus[self.next % self.cpus.len()];
        self.next = (self.next + 1) % self.cpus.len();
        Some(cpu)
    }

    /// [`PinPlan::next`] for the thread role `role`, logged at debug level.
    pub fn next_for(&mut self, role: &str) -> Option<usize> {
        let cpu = self.next();
        tracing::debug!(role, ?cpu, "pin plan assignment");
        cpu
    }

    /// Spawn `f` on a thread called `name`, pinned to the plan's next CPU.
    pub fn spawn<F, T>(&mut self, name: &str, f: F) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let cpu = self.next_for(name);
        spawn_named(name, cpu, f)
    }
}

/// Test helper: runs `f(a, b)` on a thread of its own confined to the first
/// two allowed CPUs `a` and `b` (so the test's changes to its affinity set
/// stay there), or says it skipped, `why`, with fewer than two. Fails if
/// `f` panics (its message is printed first) or runs past a minute.
#[cfg(test)]
pub(crate) fn on_two_cpus(why: &str, f: impl FnOnce(usize, usize) + Send + 'static) {
    let [a, b, ..] = *allowed_cpus() else {
        eprintln!("skipped: one CPU, {why}");
        return;
    };
    let t = std::thread::spawn(move || {
        confine_current(&[a, b]).unwrap();
        f(a, b)
    });
    if let Err(e) = join_within(t, Duration::from_secs(60), why) {
        panic!("the test on CPUs {a} and {b} ({why}): {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU the calling thread runs on.
    fn on_cpu() -> usize {
        // SAFETY: sched_getcpu takes nothing.
        usize::try_from(unsafe { libc::sched_getcpu() }).expect("sched_getcpu")
    }

    #[test]
    fn step_off_moves_the_thread_to_another_cpu_of_its_set_and_keeps_the_set() {
        on_two_cpus("nowhere to step to", |a, b| {
            confine_current(&[a]).unwrap();
            assert_eq!(on_cpu(), a);
            assert!(
                !step_off_current_cpu(),
                "a thread confined to one CPU cannot step off it"
            );
            assert_eq!((on_cpu(), current_cpus()), (a, vec![a]), "nothing changed");
            // Widening the set does not move a running thread.
            confine_current(&[a, b]).unwrap();
            assert_eq!(on_cpu(), a);
            assert!(step_off_current_cpu(), "CPU {b} is in its set");
            assert_eq!(on_cpu(), b, "moved to the other CPU of its set");
            assert_eq!(current_cpus(), vec![a, b], "its set is as it was");
        });
    }

    #[test]
    fn keep_current_off_takes_one_cpu_out_of_the_set_unless_it_is_the_only_one() {
        on_two_cpus("none to keep off", |a, b| {
            assert!(keep_current_off(b), "CPU {b} is in its set with {a}");
            assert_eq!(current_cpus(), vec![a], "only {b} taken out");
            assert!(!keep_current_off(b), "no longer in the set");
            assert!(
                !keep_current_off(a),
                "the set's only CPU stays: a thread placed there alone"
            );
            assert_eq!(current_cpus(), vec![a], "nothing changed");
            assert!(!keep_current_off(CPU_SET_CAPACITY), "past the set");
            assert!(!keep_current_off(usize::MAX), "past the set");
            assert_eq!(current_cpus(), vec![a], "nothing changed");
        });
    }

    #[test]
    fn allowed_cpus_is_nonempty_and_sorted() {
        let a = allowed_cpus();
        assert!(!a.is_empty(), "core list unavailable on this platform");
        assert!(a.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn spawn_named_names_the_thread_and_returns_value() {
        let h = spawn_named("kvf-test-name", None, || {
            std::thread::current().name().map(str::to_owned)
        })
        .unwrap();
        assert_eq!(h.join().unwrap().as_deref(), Some("kvf-test-name"));
    }

    #[test]
    fn spawn_named_pins_to_an_allowed_cpu() {
        let cpu = *allowed_cpus().last().unwrap();
        let mask = spawn_named("kvf-test-pin", Some(cpu), current_cpus)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(mask, vec![cpu]);
    }

    #[test]
    fn unavailable_cpu_runs_unpinned_without_panicking() {
        let parent = current_cpus();
        for cpu in [999, usize::MAX] {
            let mask = spawn_named("kvf-test-bad", Some(cpu), current_cpus)
                .unwrap()
                .join()
                .expect("thread with an unavailable cpu must not panic");
            assert_eq!(mask, parent, "cpu {cpu}");
        }
    }

    #[test]
    fn a_confined_thread_and_the_threads_it_spawns_run_on_its_cpus_and_may_still_pin_outside() {
        let all = allowed_cpus().to_vec();
        let first = all[0];
        // In a thread of its own: the test process's other threads keep
        // their masks.
        let (own, child, pinned) = std::thread::spawn(move || {
            confine_current(&[first]).unwrap();
            let child = std::thread::spawn(current_cpus).join().unwrap();
            // The last allowed CPU (another one, with two or more): the
            // snapshot still holds it, so a pin there works.
            let last = *all.last().unwrap();
            let pinned = spawn_named("kvf-test-out", Some(last), current_cpus)
                .unwrap()
                .join()
                .unwrap();
            (current_cpus(), child, (last, pinned))
        })
        .join()
        .unwrap();
        assert_eq!(own, vec![first]);
        assert_eq!(child, vec![first], "a thread spawned after inherits");
        assert_eq!(pinned.1, vec![pinned.0]);
    }

    #[test]
    fn confining_to_no_cpu_or_one_not_allowed_is_an_error_and_changes_nothing() {
        let before = current_cpus();
        let (empty, bad, after) = std::thread::spawn(|| {
            let empty = confine_current(&[]);
            let bad = confine_current(&[allowed_cpus()[0], 999]);
            (empty, bad, current_cpus())
        })
        .join()
        .unwrap();
        assert_eq!(empty, Err(PinError::Empty));
        assert_eq!(
            bad,
            Err(PinError::NotAllowed {
                cpu: 999,
                allowed: allowed_cpus().to_vec()
            })
        );
        assert_eq!(after, before);
    }

    #[test]
    fn join_within_returns_the_value_of_a_finished_thread() {
        let h = spawn_named("kvf-test-join", None, || 7).unwrap();
        assert_eq!(join_within(h, STOP_JOIN_DEADLINE, "kvf-test-join"), Ok(7));
    }

    #[test]
    fn join_within_times_out_on_a_thread_that_never_ends_and_names_it() {
        // The thread ends only when the test lets it (after the join gave
        // up), so the join cannot have seen it finish.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let h = spawn_named("kvf-test-stuck", None, move || {
            let _ = rx.recv();
        })
        .unwrap();
        let limit = Duration::from_millis(20);
        let e = join_within(h, limit, "kvf-test-stuck").unwrap_err();
        assert_eq!(
            e,
            JoinError::TimedOut {
                thread: "kvf-test-stuck".into(),
                waited: limit
            }
        );
        assert!(e.to_string().contains("kvf-test-stuck"), "{e}");
        drop(tx); // the detached thread ends
    }

    #[test]
    fn join_or_wait_waits_past_its_deadline_for_a_thread_that_ends_late() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let h = spawn_named("kvf-test-late", None, move || {
            let _ = rx.recv();
            9
        })
        .unwrap();
        // Released only after a while, so the zero deadline has passed
        // with the thread still blocked: join_within would detach it.
        let releaser = spawn_named("kvf-test-release", None, move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(tx);
        })
        .unwrap();
        assert_eq!(join_or_wait(h, Duration::ZERO, "kvf-test-late"), Ok(9));
        join_within(releaser, STOP_JOIN_DEADLINE, "kvf-test-release").unwrap();
    }

    #[test]
    fn join_within_reports_a_panic_and_refuses_to_join_itself() {
        let h = spawn_named("kvf-test-panic", None, || panic!("on purpose")).unwrap();
        assert_eq!(
            join_within(h, STOP_JOIN_DEADLINE, "kvf-test-panic"),
            Err(JoinError::Panicked {
                thread: "kvf-test-panic".into()
            })
        );
        // A thread handed its own handle (as a callback that drops the
        // last owner of an engine is) gets OwnThread, not a deadlock.
        let (htx, hrx) = std::sync::mpsc::channel::<JoinHandle<()>>();
        let (otx, orx) = std::sync::mpsc::channel();
        let h = spawn_named("kvf-test-self", None, move || {
            let me = hrx.recv().unwrap();
            let _ = otx.send(join_within(me, STOP_JOIN_DEADLINE, "kvf-test-self"));
        })
        .unwrap();
        htx.send(h).unwrap();
        assert_eq!(
            orx.recv_timeout(STOP_JOIN_DEADLINE)
                .expect("hung: a thread joining itself"),
            Err(JoinError::OwnThread {
                thread: "kvf-test-self".into()
            })
        );
    }

    #[test]
    fn nul_in_name_is_invalid_input() {
        let e = spawn_named("bad\0name", None, || ()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn pin_error_variants() {
        // NotAllowed: outside the allowed list (and beyond cpu_set_t).
        let e = pin_current_checked(5000, &[0]).unwrap_err();
        assert_eq!(
            e,
            PinError::NotAllowed {
                cpu: 5000,
                allowed: vec![0]
            }
        );
        assert!(e.to_string().contains("5000"));
        // Refused: the list claims cpu 1000 exists but the kernel has no such
        // cpu. Run it on a scratch thread so a surprise success cannot pin
        // the test harness thread.
        let r = std::thread::spawn(|| pin_current_checked(1000, &[1000]))
            .join()
            .unwrap();
        assert_eq!(r, Err(PinError::Refused { cpu: 1000 }));
        // The same for a set, and an empty one.
        let r = std::thread::spawn(|| confine_current_checked(&[1000], &[1000]))
            .join()
            .unwrap();
        assert_eq!(r, Err(PinError::RefusedSet { cpus: vec![1000] }));
        assert!(r.unwrap_err().to_string().contains("[1000]"));
        assert_eq!(PinError::Empty.to_string(), "no cpu given");
        // pin_current checks against the real snapshot.
        let r = std::thread::spawn(|| pin_current(usize::MAX))
            .join()
            .unwrap();
        assert!(matches!(r, Err(PinError::NotAllowed { .. })));
    }

    #[test]
    fn pin_plan_round_robin_and_none() {
        let mut p = PinPlan::new(vec![0, 1]);
        assert_eq!(
            (0..5).map(|_| p.next()).collect::<Vec<_>>(),
            [Some(0), Some(1), Some(0), Some(1), Some(0)]
        );
        assert_eq!(p.cpus(), &[0, 1]);
        let mut n = PinPlan::none();
        assert!(n.is_empty());
        assert_eq!(n.next(), None);
        assert_eq!(n.next_for("ctrl"), None);
        assert!(PinPlan::new(vec![]).next().is_none());
    }

    #[test]
    fn pin_plan_spawn_uses_next_cpu() {
        let cpu = allowed_cpus()[0];
        let mut p = PinPlan::new(vec![cpu]);
        let (name, mask) = p
            .spawn("kvf-test-plan", || {
                (
                    std::thread::current().name().map(str::to_owned),
                    current_cpus(),
                )
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(name.as_deref(), Some("kvf-test-plan"));
        assert_eq!(mask, vec![cpu]);
        let mut none = PinPlan::none();
        let mask = none
            .spawn("kvf-test-plan2", current_cpus)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(mask, current_cpus());
    }
}
