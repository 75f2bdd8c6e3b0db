//! Shuttle model checks of the real slot allocator code.
//!
//! Run: `cargo test -p kvferry --features shuttle-model --test ledger_model --test slots_model`
#![cfg(feature = "shuttle-model")]

use std::sync::Arc;

use kvferry::cancel::CancelToken;
use kvferry::slots::{AllocError, SlotAllocator};
use shuttle::sync::atomic::{AtomicUsize, Ordering};
use shuttle::thread;

const ITER: usize = 2000;
const FREE: usize = usize::MAX;

fn check(name: &str, f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let g = Arc::clone(&f);
    shuttle::check_random(move || f(), ITER);
    shuttle::check_pct(move || g(), ITER, 3);
    eprintln!("{name}: {ITER} random + {ITER} PCT schedules ok");
}

fn owners(n: usize) -> Arc<Vec<AtomicUsize>> {
    Arc::new((0..n).map(|_| AtomicUsize::new(FREE)).collect())
}

/// Three threads alloc (blocking), use and free slots over two bitmap words
/// (66 slots, 64 + 2): no slot is handed out twice, sets are complete, no
/// lost wakeup, and everything is free at the end.
#[test]
fn blocking_alloc_free_never_double_hands_a_slot() {
    check("alloc_free", || {
        const SLOTS: usize = 66;
        let a = SlotAllocator::new(SLOTS);
        let own = owners(SLOTS);
        let sizes = [40usize, 30, 26];
        let hs: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                let (a, own) = (a.clone(), own.clone());
                thread::spawn(move || {
                    for _ in 0..2 {
                        let s = a.alloc(n, None, &CancelToken::new()).expect("alloc");
                        assert_eq!(s.len(), n, "all or nothing");
                        for slot in s.iter() {
                            let prev = own[slot as usize].swap(t, Ordering::SeqCst);
                            assert_eq!(prev, FREE, "slot {slot} handed out twice");
                        }
                        for slot in s.iter() {
                            own[slot as usize].store(FREE, Ordering::SeqCst);
                        }
                        a.free(s);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!((a.in_use(), a.waiters(), a.bad_frees()), (0, 0, 0));
        assert!(a.snapshot().not_any());
    });
}

/// try_alloc racing alloc and free on 4 slots: a failed try_alloc takes
/// nothing, a cancelled waiter leaves nothing behind.
#[test]
fn try_alloc_and_cancel_are_all_or_nothing() {
    check("try_alloc_cancel", || {
        let a = SlotAllocator::new(4);
        let own = owners(4);
        let held = a.try_alloc(2).unwrap();
        let token = CancelToken::new();
        let trier = {
            let (a, own) = (a.clone(), own.clone());
            thread::spawn(move || {
                if let Some(s) = a.try_alloc(3) {
                    assert_eq!(s.len(), 3);
                    for slot in s.iter() {
                        assert_eq!(own[slot as usize].swap(1, Ordering::SeqCst), FREE);
                    }
                    for slot in s.iter() {
                        own[slot as usize].store(FREE, Ordering::SeqCst);
                    }
                    a.free(s);
                }
            })
        };
        let cancelled = {
            let (a, t, own) = (a.clone(), token.clone(), own.clone());
            thread::spawn(move || match a.alloc(4, None, &t) {
                Ok(s) => {
                    for slot in s.iter() {
                        assert_eq!(own[slot as usize].swap(2, Ordering::SeqCst), FREE);
                    }
                    for slot in s.iter() {
                        own[slot as usize].store(FREE, Ordering::SeqCst);
                    }
                    a.free(s);
                }
                Err(e) => assert_eq!(e, AllocError::Cancelled),
            })
        };
        for slot in held.iter() {
            assert_eq!(own[slot as usize].swap(0, Ordering::SeqCst), FREE);
        }
        for slot in held.iter() {
            own[slot as usize].store(FREE, Ordering::SeqCst);
        }
        token.cancel();
        a.free(held);
        trier.join().unwrap();
        cancelled.join().unwrap();
        assert_eq!((a.in_use(), a.waiters()), (0, 0));
        assert!(a.snapshot().not_any());
    });
}
