//! Behaviour of the staging-slot allocator through the public API.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common/process.rs"]
mod process;

use std::collections::HashSet;
use std::thread;
use std::time::{Duration, Instant};

use kvferry::cancel::CancelToken;
use kvferry::slots::{AllocError, SlotAllocator, SlotSet};
use process::spawn_thread as spawn;

const HANG: Duration = Duration::from_secs(10);

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let end = Instant::now() + HANG;
    while !cond() {
        assert!(Instant::now() < end, "hung waiting for: {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn all_or_nothing_and_free_restores() {
    let a = SlotAllocator::new(100);
    assert_eq!(a.capacity(), 100);
    let s1 = a.try_alloc(60).unwrap();
    assert_eq!(s1.len(), 60);
    assert!(s1.as_slice().windows(2).all(|w| w[0] < w[1]), "sorted");
    assert!(a.try_alloc(41).is_none(), "all or nothing");
    assert_eq!(a.in_use(), 60, "a failed try_alloc takes nothing");
    let s2 = a.try_alloc(40).unwrap();
    let all: HashSet<u32> = s1.iter().chain(s2.iter()).collect();
    assert_eq!(all.len(), 100);
    assert!(all.iter().all(|&s| s < 100));
    assert!(a.snapshot().all());
    assert!(a.try_alloc(1).is_none());
    a.free(s1);
    assert_eq!(a.in_use(), 40);
    assert_eq!(a.snapshot().count_ones(), 40);
    a.free(s2);
    assert_eq!(a.in_use(), 0);
    assert!(a.snapshot().not_any());
    assert!(format!("{a:?}").contains("capacity: 100"));
}

#[test]
fn zero_and_too_large() {
    let a = SlotAllocator::new(16);
    assert_eq!(a.try_alloc(0), Some(SlotSet::default()));
    assert!(a.try_alloc(17).is_none());
    let e = a.alloc(17, None, &CancelToken::new()).unwrap_err();
    assert_eq!(
        e,
        AllocError::TooLarge {
            requested: 17,
            slots: 16
        }
    );
    assert!(e.to_string().contains("17") && e.to_string().contains("only 16"));
    assert_eq!(a.waiters(), 0);
    assert!(a.alloc(0, None, &CancelToken::new()).unwrap().is_empty());
}

#[test]
fn free_of_unused_slots_is_ignored_and_counted() {
    let a = SlotAllocator::new(10);
    let s = a.try_alloc(3).unwrap();
    let first = s.as_slice()[0];
    a.free_one(first);
    a.free_one(first); // double free
    a.free_one(10); // out of range
    a.free_one(u32::MAX);
    assert_eq!(a.bad_frees(), 3);
    assert_eq!(a.in_use(), 2);
    a.free(s); // includes `first` again
    assert_eq!(a.bad_frees(), 4);
    assert_eq!(a.in_use(), 0);
    // the count was not inflated: still only 10 slots to hand out
    let all = a.try_alloc(10).unwrap();
    assert!(a.try_alloc(1).is_none());
    a.free(all);
}

#[test]
fn blocked_alloc_waits_for_free_and_fifo_holds() {
    let a = SlotAllocator::new(8);
    let held = a.try_alloc(8).unwrap();
    let a2 = a.clone();
    let big = spawn("alloc(6)", move || {
        a2.alloc(6, Some(Instant::now() + HANG), &CancelToken::new())
    });
    wait_until("alloc(6) to queue", || a.waiters() == 1);
    let mut first4 = held;
    let rest = first4.split_off(4);
    a.free(first4);
    assert!(
        a.try_alloc(1).is_none(),
        "4 free but alloc(6) is queued first"
    );
    a.free(rest);
    let got = big.join().unwrap();
    assert_eq!(got.len(), 6);
    assert_eq!(a.in_use(), 6);
    a.free(got);
    assert_eq!(a.in_use(), 0);
}

#[test]
fn blocked_alloc_timeout_and_cancel() {
    let a = SlotAllocator::new(2);
    let held = a.try_alloc(2).unwrap();
    let e = a
        .alloc(
            1,
            Some(Instant::now() + Duration::from_millis(20)),
            &CancelToken::new(),
        )
        .unwrap_err();
    assert_eq!(e, AllocError::Timeout);
    assert!(e.to_string().contains("timed out"));
    let token = CancelToken::new();
    let (a2, t2) = (a.clone(), token.clone());
    let w = spawn("cancelled alloc", move || a2.alloc(2, None, &t2));
    wait_until("alloc(2) to queue", || a.waiters() == 1);
    token.cancel();
    let e = w.join().unwrap_err();
    assert_eq!(e, AllocError::Cancelled);
    assert!(e.to_string().contains("cancelled"));
    assert_eq!((a.waiters(), a.in_use()), (0, 2));
    a.free(held);
    assert_eq!(a.in_use(), 0);
}

#[test]
fn runs_of_a_fresh_allocation_are_contiguous() {
    let a = SlotAllocator::new(200);
    let s = a.try_alloc(16).unwrap();
    assert_eq!(s.len(), 16);
    // A run starts wherever a slot does not follow its predecessor.
    let runs = 1 + s.as_slice().windows(2).filter(|w| w[1] != w[0] + 1).count();
    assert!(
        runs <= 2,
        "a fresh bitmap hands out at most two runs: {:?}",
        s.as_slice()
    );
    a.free(s);
}

#[test]
fn threads_never_share_a_slot() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 2000;
    let a = SlotAllocator::new(130);
    let owners: std::sync::Arc<Vec<std::sync::atomic::AtomicUsize>> = std::sync::Arc::new(
        (0..130)
            .map(|_| std::sync::atomic::AtomicUsize::new(usize::MAX))
            .collect(),
    );
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, owners) = (a.clone(), owners.clone());
            spawn("slot stress thread", move || {
                for i in 0..ROUNDS {
                    let n = 1 + (i * 7 + t) % 40;
                    let s = a
                        .alloc(n, Some(Instant::now() + HANG), &CancelToken::new())
                        .expect("alloc");
                    assert_eq!(s.len(), n);
                    for slot in s.iter() {
                        let prev =
                            owners[slot as usize].swap(t, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(prev, usize::MAX, "slot {slot} handed out twice");
                    }
                    for slot in s.iter() {
                        owners[slot as usize]
                            .store(usize::MAX, std::sync::atomic::Ordering::SeqCst);
                    }
                    a.free(s);
                }
            })
        })
        .collect();
    for h in hs {
        h.join();
    }
    assert_eq!((a.in_use(), a.waiters(), a.bad_frees()), (0, 0, 0));
    assert!(a.snapshot().not_any());
}
