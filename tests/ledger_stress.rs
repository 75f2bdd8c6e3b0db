//! Bounded thread stress of the ledger: 8 threads with random admit sizes,
//! hold times, partial allocations, releases and timeouts (each thread waits
//! through its own AdmissionQueue), plus a control thread driving a shared
//! AdmissionQueue. At the end nothing is held and
//! nobody is left queued.
#![cfg(not(feature = "shuttle-model"))]

mod common_ledger;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use common_ledger::admit_blocking;
use kvferry::ledger::{AdmissionQueue, AdmitError, Ledger};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CAP: usize = 32;
const THREADS: usize = 8;
const OPS: usize = 3000;
const HANG: Duration = Duration::from_secs(20);

#[test]
fn eight_threads_random_admit_hold_release_timeout() {
    let l = Ledger::new(CAP);
    let (tx, rx) = mpsc::channel::<(&'static str, usize, usize)>();
    let max_seen = Arc::new(AtomicUsize::new(0));

    for t in 0..THREADS {
        let (l, tx, max_seen) = (l.clone(), tx.clone(), max_seen.clone());
        thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(0x5eed + t as u64);
            let (mut ok, mut failed) = (0, 0);
            for _ in 0..OPS {
                let n = rng.random_range(1..=CAP);
                let deadline = Instant::now() + Duration::from_millis(rng.random_range(1..20));
                let r = if rng.random_bool(0.3) {
                    l.try_admit(n)
                } else {
                    admit_blocking(&l, n, deadline)
                };
                match r {
                    Ok(mut res) => {
                        ok += 1;
                        max_seen.fetch_max(l.stats().committed, Ordering::Relaxed);
                        let k = rng.random_range(0..=n);
                        res.allocate(k).unwrap();
                        for _ in 0..rng.random_range(0..50) {
                            std::hint::spin_loop();
                        }
                        if rng.random_bool(0.1) {
                            thread::yield_now();
                        }
                        if rng.random_bool(0.5) {
                            assert_eq!(res.release(), n - k);
                        } else {
                            drop(res);
                        }
                        l.free(k);
                    }
                    Err(AdmitError::Timeout | AdmitError::WouldBlock) => failed += 1,
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            let _ = tx.send(("worker", ok, failed));
        });
    }
    // Control thread: parks requests in an AdmissionQueue and collects grants.
    {
        let (l, tx) = (l.clone(), tx.clone());
        thread::spawn(move || {
            let ctrl = thread::current();
            let mut q = AdmissionQueue::with_waker(move || ctrl.unpark());
            let mut rng = StdRng::seed_from_u64(7);
            let (mut granted, mut expired) = (0, 0);
            for key in 0..2000u32 {
                let n = rng.random_range(1..=CAP);
                let deadline = Instant::now() + Duration::from_millis(rng.random_range(1..10));
                match q.admit_or_park(&l, key, n, deadline) {
                    Ok(Some(r)) => {
                        granted += 1;
                        drop(r);
                    }
                    Ok(None) => {}
                    Err(AdmitError::Timeout) => expired += 1,
                    Err(e) => panic!("unexpected {e}"),
                }
                // drain: never block on admission, only park until woken
                // or the next deadline
                while !q.is_empty() {
                    for (_, r) in q.grant_ready(&l) {
                        granted += 1;
                        drop(r);
                    }
                    expired += q.expire(Instant::now()).len();
                    if let Some(d) = q.next_deadline() {
                        thread::park_timeout(d.saturating_duration_since(Instant::now()));
                    }
                }
            }
            let _ = tx.send(("ctrl", granted, expired));
        });
    }
    drop(tx);
    let mut workers = 0;
    for _ in 0..THREADS + 1 {
        let (who, ok, failed) = rx
            .recv_timeout(HANG)
            .expect("a stress thread hung (or panicked): see its output");
        eprintln!("{who}: {ok} admitted/granted, {failed} failed or expired");
        assert!(ok + failed > 0, "{who} did nothing");
        if who == "worker" {
            workers += 1;
            assert_eq!(ok + failed, OPS);
        }
    }
    assert_eq!(workers, THREADS);
    let s = l.stats();
    assert_eq!(
        (s.committed, s.reserved, s.allocated, s.waiters),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(max_seen.load(Ordering::Relaxed) <= CAP);
    assert_eq!(l.over_frees(), 0);
}
