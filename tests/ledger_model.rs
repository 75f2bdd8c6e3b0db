//! Shuttle model checks of the real ledger code (its atomics, mutex and
//! park/unpark come from shuttle through `kvferry`'s sync shim).
//!
//! Run (about 20 s warm on the 2-vCPU VM, ~5 s of it recompiling kvferry):
//! `cargo test -p kvferry --features shuttle-model --test ledger_model --test slots_model`
//!
//! A lost wakeup shows up as a shuttle deadlock (every thread parked). The
//! ledger never blocks: a thread that waits for admission parks its request
//! in an `AdmissionQueue` whose waker unparks it (`admit_blocking`), as a
//! library user would.
#![cfg(feature = "shuttle-model")]

use std::sync::Arc;

use kvferry::ledger::{AdmissionQueue, Ledger, Reservation};
use shuttle::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use shuttle::thread;

const ITER: usize = 3000;

fn check(name: &str, f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let g = Arc::clone(&f);
    shuttle::check_random(move || f(), ITER);
    shuttle::check_pct(move || g(), ITER, 3);
    eprintln!("{name}: {ITER} random + {ITER} PCT schedules ok");
}

fn assert_invariant(l: &Ledger) {
    let s = l.stats();
    assert!(
        s.committed <= s.capacity,
        "committed {} > capacity {}",
        s.committed,
        s.capacity
    );
}

/// Admits `n` chunks, parking this thread until the grant (no deadline: a
/// lost wakeup is a shuttle deadlock).
fn admit_blocking(l: &Ledger, n: usize) -> Reservation {
    let me = thread::current();
    let mut q = AdmissionQueue::with_waker(move || me.unpark());
    if let Some(r) = q.admit_or_park(l, (), n, far()).expect("admit") {
        return r;
    }
    loop {
        if let Some((_, r)) = q.grant_ready(l).pop() {
            return r;
        }
        thread::park();
    }
}

/// Parks a request for `n` chunks and withdraws it again (a cancelled
/// request): granted in between or not, it leaves no trace.
fn park_then_withdraw(l: &Ledger, n: usize) {
    let mut q = AdmissionQueue::new();
    match q.admit_or_park(l, 0u8, n, far()) {
        Ok(Some(r)) => drop(r),
        Ok(None) => {
            assert!(q.remove(&0), "the parked entry is there until removed");
        }
        Err(e) => panic!("unexpected {e}"),
    }
}

/// Three threads admit, allocate, free, release and withdraw on a ledger
/// of 3: committed never exceeds capacity, nobody is left parked (no lost
/// wakeup), and at the end nothing is held and nothing is queued.
#[test]
fn admit_free_withdraw_keeps_the_invariant_and_loses_no_wakeup() {
    check("admit_free_withdraw", || {
        let l = Ledger::new(3);
        let allocator = {
            let l = l.clone();
            thread::spawn(move || {
                let mut r = admit_blocking(&l, 2);
                assert_invariant(&l);
                r.allocate(1).expect("allocate within reservation");
                r.allocate(1).expect("allocate within reservation");
                drop(r);
                assert_invariant(&l);
                l.free(2);
            })
        };
        let releaser = {
            let l = l.clone();
            thread::spawn(move || {
                let r = admit_blocking(&l, 2);
                assert_invariant(&l);
                assert_eq!(r.release(), 2);
            })
        };
        let withdrawn = {
            let l = l.clone();
            thread::spawn(move || {
                park_then_withdraw(&l, 3);
                assert_invariant(&l);
            })
        };
        allocator.join().unwrap();
        releaser.join().unwrap();
        withdrawn.join().unwrap();
        let s = l.stats();
        assert_eq!((s.committed, s.allocated, s.waiters), (0, 0, 0), "{s:?}");
    });
}

/// A releaser racing threads that are about to park: they are always
/// granted (the Dekker pair on `committed`/`waiters`).
#[test]
fn release_racing_a_new_waiter_never_loses_the_wakeup() {
    check("release_vs_enqueue", || {
        let l = Ledger::new(2);
        let held = l.try_admit(2).unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let l = l.clone();
                thread::spawn(move || drop(admit_blocking(&l, 1)))
            })
            .collect();
        drop(held);
        for w in waiters {
            w.join().unwrap();
        }
        assert_eq!(l.stats().committed, 0);
        assert_eq!(l.stats().waiters, 0);
    });
}

/// FIFO: with a large request queued first, a small one behind it is not
/// granted even though it would fit; both are granted once the large fits.
#[test]
fn fifo_among_waiters() {
    check("fifo", || {
        let l = Ledger::new(4);
        let three = l.try_admit(3).unwrap();
        let one = l.try_admit(1).unwrap();
        let small_done = Arc::new(AtomicBool::new(false));
        let big = {
            let l = l.clone();
            thread::spawn(move || drop(admit_blocking(&l, 3)))
        };
        while l.stats().waiters < 1 {
            thread::yield_now();
        }
        let small = {
            let (l, d) = (l.clone(), small_done.clone());
            thread::spawn(move || {
                let r = admit_blocking(&l, 1);
                d.store(true, Ordering::SeqCst);
                drop(r);
            })
        };
        while l.stats().waiters < 2 {
            thread::yield_now();
        }
        drop(one); // 1 free: the small request would fit, but is behind
        assert!(
            !small_done.load(Ordering::SeqCst),
            "small request jumped the queue"
        );
        assert_eq!(l.stats().waiters, 2);
        assert_eq!(l.stats().committed, 3);
        drop(three);
        big.join().unwrap();
        small.join().unwrap();
        assert_eq!(l.stats().committed, 0);
    });
}

/// A withdrawn request at the head leaves no trace: the waiter behind it is
/// granted and the counts return to zero.
#[test]
fn withdrawn_head_leaves_no_trace() {
    check("withdrawn_head", || {
        let l = Ledger::new(2);
        let held = l.try_admit(1).unwrap();
        let head = {
            let l = l.clone();
            thread::spawn(move || park_then_withdraw(&l, 2))
        };
        let tail = {
            let l = l.clone();
            thread::spawn(move || drop(admit_blocking(&l, 1)))
        };
        head.join().unwrap();
        drop(held);
        tail.join().unwrap();
        let s = l.stats();
        assert_eq!((s.committed, s.waiters), (0, 0), "{s:?}");
    });
}

/// The control thread's non-blocking queue: capacity freed on another thread
/// is handed to the parked entry and the waker gets the control thread to
/// collect it (no lost wakeup on the waker path either).
#[test]
fn admission_queue_waker_gets_the_grant_collected() {
    check("admission_queue", || {
        let l = Ledger::new(2);
        let held = l.try_admit(2).unwrap();
        let ctrl = thread::current();
        let wakes = Arc::new(AtomicUsize::new(0));
        let w2 = wakes.clone();
        let mut q = AdmissionQueue::with_waker(move || {
            w2.fetch_add(1, Ordering::SeqCst);
            ctrl.unpark();
        });
        let freer = thread::spawn(move || drop(held));
        let first = q.admit_or_park(&l, 7u8, 2, far()).unwrap();
        let r = match first {
            Some(r) => r,
            None => loop {
                let mut g = q.grant_ready(&l);
                if let Some((k, r)) = g.pop() {
                    assert_eq!(k, 7);
                    break r;
                }
                thread::park();
            },
        };
        assert_eq!(r.remaining(), 2);
        drop(r);
        freer.join().unwrap();
        assert!(q.is_empty());
        assert_eq!(l.stats().committed, 0);
        assert_eq!(l.stats().waiters, 0);
    });
}

fn far() -> std::time::Instant {
    std::time::Instant::now() + std::time::Duration::from_secs(3600)
}
