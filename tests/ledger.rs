//! Behaviour of the reservation ledger and the admission queue through the
//! public API (single-threaded and small multi-threaded scenarios).
#![cfg(not(feature = "shuttle-model"))]

#[path = "common/process.rs"]
mod process;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvferry::ledger::{AdmissionQueue, AdmitError, Ledger, LedgerStats, OverAllocate};
use process::spawn_thread as spawn;

const HANG: Duration = Duration::from_secs(10);

#[test]
fn try_admit_allocate_release_and_stats() {
    let l = Ledger::new(10);
    assert_eq!(l.capacity(), 10);
    let mut r = l.try_admit(6).unwrap();
    assert_eq!(r.remaining(), 6);
    r.allocate(4).unwrap();
    assert_eq!(
        l.stats(),
        LedgerStats {
            capacity: 10,
            committed: 6,
            reserved: 2,
            allocated: 4,
            waiters: 0
        }
    );
    assert_eq!(
        r.allocate(3),
        Err(OverAllocate {
            requested: 3,
            remaining: 2
        })
    );
    assert_eq!(r.remaining(), 2, "a failed allocate changes nothing");
    assert_eq!(l.try_admit(5).unwrap_err(), AdmitError::WouldBlock);
    assert_eq!(r.release(), 2);
    assert_eq!(l.stats().committed, 4);
    l.free(4);
    assert_eq!(
        l.stats(),
        LedgerStats {
            capacity: 10,
            ..Default::default()
        }
    );
    assert!(format!("{l:?}").contains("capacity: 10"));
}

#[test]
fn dropping_a_reservation_releases_what_is_left() {
    let l = Ledger::new(8);
    {
        let mut r = l.try_admit(8).unwrap();
        r.allocate(3).unwrap();
        assert!(format!("{r:?}").contains("remaining: 5"));
        // error path: dropped without release
    }
    assert_eq!(l.stats().committed, 3);
    assert_eq!(l.stats().allocated, 3);
    l.free(3);
    assert_eq!(l.stats().committed, 0);
}

#[test]
fn too_large_is_refused_at_once_and_never_parked() {
    let l = Ledger::new(10);
    let e = l.try_admit(11).unwrap_err();
    assert_eq!(
        e,
        AdmitError::TooLarge {
            requested: 11,
            capacity: 10
        }
    );
    assert!(e.to_string().contains("needs 11 chunks") && e.to_string().contains("only 10"));
    assert_eq!(l.stats().waiters, 0);
    let mut q = AdmissionQueue::new();
    assert_eq!(
        q.admit_or_park(&l, 1u32, 11, Instant::now() + HANG)
            .unwrap_err(),
        AdmitError::TooLarge {
            requested: 11,
            capacity: 10
        }
    );
    assert!(q.is_empty());
}

#[test]
fn over_free_is_ignored_and_counted() {
    let l = Ledger::new(4);
    let mut r = l.try_admit(2).unwrap();
    r.allocate(2).unwrap();
    l.free(5);
    assert_eq!(l.over_frees(), 3);
    assert_eq!(l.stats().committed, 0);
    assert_eq!(l.stats().allocated, 0);
    // capacity not inflated beyond 4
    assert!(l.try_admit(4).is_ok());
}

#[test]
fn zero_chunks_admits_an_empty_reservation() {
    let l = Ledger::new(0);
    let r = l.try_admit(0).unwrap();
    assert_eq!(r.remaining(), 0);
    let mut q = AdmissionQueue::new();
    let r = q.admit_or_park(&l, (), 0, Instant::now() + HANG).unwrap();
    assert_eq!(r.map(|r| r.release()), Some(0));
    assert!(matches!(l.try_admit(1), Err(AdmitError::TooLarge { .. })));
}

#[test]
fn parked_admission_is_granted_when_capacity_is_freed_on_another_thread() {
    let l = Ledger::new(10);
    let mut a = l.try_admit(8).unwrap();
    a.allocate(8).unwrap();
    let me = thread::current();
    let mut q = AdmissionQueue::with_waker(move || me.unpark());
    assert!(q
        .admit_or_park(&l, "b", 8, Instant::now() + HANG)
        .unwrap()
        .is_none());
    assert_eq!(l.stats().waiters, 1);
    l.free(4);
    // 6 free, not enough for 8: still parked
    assert!(q.grant_ready(&l).is_empty());
    assert_eq!(l.stats().waiters, 1);
    let l2 = l.clone();
    spawn("free(4) on another thread", move || l2.free(4)).join();
    let end = Instant::now() + HANG;
    let got = loop {
        let mut g = q.grant_ready(&l);
        if let Some((k, r)) = g.pop() {
            break (k, r.release());
        }
        assert!(Instant::now() < end, "hung waiting for the grant");
        thread::park_timeout(Duration::from_millis(10));
    };
    assert_eq!(got, ("b", 8));
    assert_eq!(l.stats().committed, 0);
}

#[test]
fn fifo_large_request_is_not_starved_by_small_requests() {
    let l = Ledger::new(10);
    let held = l.try_admit(5).unwrap();
    let mut q = AdmissionQueue::new();
    let far = Instant::now() + HANG;
    assert!(q.admit_or_park(&l, "big", 10, far).unwrap().is_none());
    // 5 chunks are free but the big request is queued: no jumping.
    assert_eq!(l.try_admit(1).unwrap_err(), AdmitError::WouldBlock);
    assert!(q.admit_or_park(&l, "small", 1, far).unwrap().is_none());
    assert_eq!(l.stats().waiters, 2);
    drop(held);
    // the big one is granted first; the small one does not fit behind it
    let granted = q.grant_ready(&l);
    assert_eq!(granted.len(), 1);
    assert_eq!(granted[0].0, "big");
    assert_eq!(l.stats().waiters, 1);
    drop(granted);
    // the big one released, so the small one was granted behind it
    let granted = q.grant_ready(&l);
    assert_eq!(granted.len(), 1);
    assert_eq!(granted[0].0, "small");
    assert_eq!(l.stats().committed, 1);
}

#[test]
fn withdrawn_head_lets_smaller_waiters_behind_it_in() {
    let l = Ledger::new(4);
    let held = l.try_admit(3).unwrap();
    let mut q = AdmissionQueue::new();
    let far = Instant::now() + HANG;
    assert!(q.admit_or_park(&l, "big", 4, far).unwrap().is_none());
    assert!(q.admit_or_park(&l, "small", 1, far).unwrap().is_none());
    assert_eq!(l.stats().waiters, 2);
    // 1 chunk free: the small request fits but waits behind the big one
    assert!(q.grant_ready(&l).is_empty());
    assert!(q.remove(&"big"));
    let granted: Vec<_> = q
        .grant_ready(&l)
        .into_iter()
        .map(|(k, r)| (k, r.remaining()))
        .collect();
    assert_eq!(granted, vec![("small", 1)]);
    drop(held);
    assert_eq!(l.stats().committed, 0);
}

#[test]
fn admission_queue_parks_grants_in_fifo_order_and_wakes() {
    let l = Ledger::new(10);
    let wakes = Arc::new(AtomicUsize::new(0));
    let w2 = Arc::clone(&wakes);
    let mut q = AdmissionQueue::with_waker(move || {
        w2.fetch_add(1, Ordering::SeqCst);
    });
    let far = Instant::now() + HANG;
    let mut a = q
        .admit_or_park(&l, 1u64, 8, far)
        .unwrap()
        .expect("fits at once");
    assert_eq!(
        q.admit_or_park(&l, 2, 8, far)
            .unwrap()
            .map(|r| r.remaining()),
        None
    );
    assert_eq!(
        q.admit_or_park(&l, 3, 1, far)
            .unwrap()
            .map(|r| r.remaining()),
        None,
        "FIFO: 3 waits behind 2"
    );
    assert_eq!((q.len(), l.stats().waiters), (2, 2));
    assert_eq!(q.next_deadline(), Some(far));
    assert!(q.grant_ready(&l).is_empty());
    a.allocate(8).unwrap();
    drop(a);
    l.free(8); // decoder consumed A
    assert!(wakes.load(Ordering::SeqCst) >= 1, "waker called on grant");
    let got: Vec<(u64, usize)> = q
        .grant_ready(&l)
        .into_iter()
        .map(|(k, r)| (k, r.release()))
        .collect();
    assert_eq!(got, vec![(2, 8), (3, 1)]);
    assert!(q.is_empty());
    assert_eq!(l.stats().committed, 0);
}

#[test]
fn admission_queue_expire_remove_and_drop_leave_no_capacity_held() {
    let l = Ledger::new(4);
    let held = l.try_admit(4).unwrap();
    let mut q = AdmissionQueue::new();
    let now = Instant::now();
    let soon = now + Duration::from_millis(5);
    let later = now + HANG;
    assert!(q.admit_or_park(&l, "a", 2, soon).unwrap().is_none());
    assert!(q.admit_or_park(&l, "b", 2, later).unwrap().is_none());
    assert!(q.admit_or_park(&l, "c", 1, soon).unwrap().is_none());
    assert_eq!(q.next_deadline(), Some(soon));
    assert_eq!(q.expire(soon), vec!["a", "c"]);
    assert_eq!((q.len(), l.stats().waiters), (1, 1));
    assert!(!q.remove(&"zzz"));
    // Past deadline and no room: Timeout at once, nothing parked.
    assert_eq!(
        q.admit_or_park(&l, "d", 1, now).unwrap_err(),
        AdmitError::Timeout
    );
    drop(held);
    // "b" was granted by the release but not collected; remove gives it back.
    assert_eq!(l.stats().committed, 2);
    assert!(q.remove(&"b"));
    assert_eq!(
        l.stats(),
        LedgerStats {
            capacity: 4,
            ..Default::default()
        }
    );
    // Dropping the queue releases granted and withdraws parked entries.
    let held = l.try_admit(3).unwrap();
    assert!(q.admit_or_park(&l, "e", 2, later).unwrap().is_none());
    assert!(q.admit_or_park(&l, "f", 4, later).unwrap().is_none());
    drop(held); // grants e (2); f (4) does not fit behind it
    assert_eq!(l.stats().waiters, 1);
    drop(q);
    assert_eq!(
        l.stats(),
        LedgerStats {
            capacity: 4,
            ..Default::default()
        }
    );
}

#[test]
fn error_messages_are_readable() {
    assert!(AdmitError::WouldBlock
        .to_string()
        .contains("not enough free"));
    let o = OverAllocate {
        requested: 3,
        remaining: 1,
    };
    assert_eq!(
        o.to_string(),
        "tried to allocate 3 chunks from a reservation that has only 1 left"
    );
    let e: Box<dyn std::error::Error> = Box::new(AdmitError::Timeout);
    assert!(e.to_string().contains("timed out"));
}
