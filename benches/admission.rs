//! Admission primitives vs lock-based baselines, in the same run.
//!
//! `cargo bench --bench admission -- --warm-up-time 1 --measurement-time 2`
//!
//! - ledger try_admit(1)+release, uncontended: kvferry vs the seed's shape
//!   (`Mutex<u64>` + `Condvar`, notify_all on every release) and vs a tuned
//!   Mutex ledger that notifies only when someone waits;
//! - the same, two threads contending (capacity 64: counter contention;
//!   capacity 1: every admit waits for the other's release);
//! - slot alloc+free of 1 and 16 slots vs a `Mutex<Vec<u32>>` free list;
//! - park -> wake -> run latency of a blocked waiter vs a Condvar waiter.
//!
//! The blocking cases use `SlotAllocator::alloc`: the ledger itself only
//! admits without blocking (`try_admit`, `AdmissionQueue`), and the blocking
//! wait is the FIFO semaphore both share.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvferry::cancel::CancelToken;
use kvferry::ledger::Ledger;
use kvferry::slots::SlotAllocator;
use smallvec::SmallVec;

/// Baseline: the seed's ledger shape, a counter under a mutex and a condvar
/// that every release notifies (it cannot know whether anyone waits).
struct CondvarLedger {
    committed: Mutex<u64>,
    cv: Condvar,
    cap: u64,
}

impl CondvarLedger {
    fn new(cap: u64) -> Self {
        Self {
            committed: Mutex::new(0),
            cv: Condvar::new(),
            cap,
        }
    }
    fn try_admit(&self, n: u64) -> bool {
        let mut c = self.committed.lock().unwrap();
        if *c + n <= self.cap {
            *c += n;
            true
        } else {
            false
        }
    }
    fn admit(&self, n: u64) {
        let mut c = self.committed.lock().unwrap();
        while *c + n > self.cap {
            c = self.cv.wait(c).unwrap();
        }
        *c += n;
    }
    fn release(&self, n: u64) {
        *self.committed.lock().unwrap() -= n;
        self.cv.notify_all();
    }
}

/// Baseline: a tuned mutex ledger that counts waiters and notifies only when
/// there are some (no syscall on the uncontended path).
struct TunedMutexLedger {
    st: Mutex<(u64, u64)>, // committed, waiters
    cv: Condvar,
    cap: u64,
}

impl TunedMutexLedger {
    fn new(cap: u64) -> Self {
        Self {
            st: Mutex::new((0, 0)),
            cv: Condvar::new(),
            cap,
        }
    }
    fn try_admit(&self, n: u64) -> bool {
        let mut s = self.st.lock().unwrap();
        if s.1 == 0 && s.0 + n <= self.cap {
            s.0 += n;
            true
        } else {
            false
        }
    }
    fn admit(&self, n: u64) {
        let mut s = self.st.lock().unwrap();
        while s.0 + n > self.cap {
            s.1 += 1;
            s = self.cv.wait(s).unwrap();
            s.1 -= 1;
        }
        s.0 += n;
    }
    fn waiters(&self) -> u64 {
        self.st.lock().unwrap().1
    }
    fn release(&self, n: u64) {
        let mut s = self.st.lock().unwrap();
        s.0 -= n;
        let notify = s.1 > 0;
        drop(s);
        if notify {
            self.cv.notify_all();
        }
    }
}

/// Baseline: a mutex-protected free list of slot indices.
struct MutexFreeList {
    free: Mutex<Vec<u32>>,
}

impl MutexFreeList {
    fn new(n: u32) -> Self {
        Self {
            free: Mutex::new((0..n).rev().collect()),
        }
    }
    fn try_alloc(&self, n: usize) -> Option<SmallVec<[u32; 16]>> {
        let mut f = self.free.lock().unwrap();
        if f.len() < n {
            return None;
        }
        let at = f.len() - n;
        Some(f.drain(at..).collect())
    }
    fn free(&self, s: SmallVec<[u32; 16]>) {
        self.free.lock().unwrap().extend(s);
    }
}

fn ledger_uncontended(c: &mut Criterion) {
    let mut g = c.benchmark_group("ledger_uncontended_try_admit1_release");
    let l = Ledger::new(1024);
    g.bench_function("kvferry_ledger", |b| {
        b.iter(|| {
            let r = l.try_admit(black_box(1)).unwrap();
            black_box(r.release());
        })
    });
    let m = CondvarLedger::new(1024);
    g.bench_function("mutex_u64_condvar_notify_all", |b| {
        b.iter(|| {
            assert!(m.try_admit(black_box(1)));
            m.release(1);
        })
    });
    let t = TunedMutexLedger::new(1024);
    g.bench_function("tuned_mutex_condvar_notify_if_waiters", |b| {
        b.iter(|| {
            assert!(t.try_admit(black_box(1)));
            t.release(1);
        })
    });
    g.finish();
}

/// Runs `op` `iters` times on this thread and on one helper thread at once;
/// returns this thread's elapsed time.
fn two_threads(iters: u64, op: Arc<dyn Fn() + Send + Sync>) -> Duration {
    let go = Arc::new(AtomicBool::new(false));
    let helper = {
        let (op, go) = (op.clone(), go.clone());
        thread::spawn(move || {
            while !go.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            for _ in 0..iters {
                op();
            }
        })
    };
    go.store(true, Ordering::Release);
    let t0 = Instant::now();
    for _ in 0..iters {
        op();
    }
    let dt = t0.elapsed();
    helper.join().unwrap();
    dt
}

fn ledger_contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("ledger_2thread_admit1_release");
    for cap in [64u64, 1] {
        let a = SlotAllocator::new(cap as usize);
        g.bench_with_input(BenchmarkId::new("kvferry_fifo_alloc", cap), &cap, |b, _| {
            let a = a.clone();
            let token = CancelToken::new();
            let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                let s = a.alloc(1, None, &token).unwrap();
                a.free(black_box(s));
            });
            b.iter_custom(|iters| two_threads(iters, op.clone()))
        });
        let m = Arc::new(CondvarLedger::new(cap));
        g.bench_with_input(
            BenchmarkId::new("mutex_u64_condvar_notify_all", cap),
            &cap,
            |b, _| {
                let m = m.clone();
                let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                    m.admit(1);
                    m.release(1);
                });
                b.iter_custom(|iters| two_threads(iters, op.clone()))
            },
        );
        let t = Arc::new(TunedMutexLedger::new(cap));
        g.bench_with_input(
            BenchmarkId::new("tuned_mutex_condvar_notify_if_waiters", cap),
            &cap,
            |b, _| {
                let t = t.clone();
                let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                    t.admit(1);
                    t.release(1);
                });
                b.iter_custom(|iters| two_threads(iters, op.clone()))
            },
        );
    }
    g.finish();
}

fn slots(c: &mut Criterion) {
    let mut g = c.benchmark_group("slots_alloc_free");
    for n in [1usize, 16] {
        let a = SlotAllocator::new(1024);
        g.bench_with_input(BenchmarkId::new("kvferry_bitmap", n), &n, |b, &n| {
            b.iter(|| {
                let s = a.try_alloc(black_box(n)).unwrap();
                a.free(black_box(s));
            })
        });
        let f = MutexFreeList::new(1024);
        g.bench_with_input(BenchmarkId::new("mutex_vec_free_list", n), &n, |b, &n| {
            b.iter(|| {
                let s = f.try_alloc(black_box(n)).unwrap();
                f.free(black_box(s));
            })
        });
    }
    g.finish();
}

/// Nanoseconds since `base`, never 0 (0 means "not yet").
fn stamp(base: Instant) -> u64 {
    base.elapsed().as_nanos() as u64 + 1
}

fn wake_latency(c: &mut Criterion) {
    let mut g = c.benchmark_group("blocked_admit_release_to_running");
    g.sample_size(20);
    // kvferry: the helper blocks in alloc(1) while main holds the slot.
    g.bench_function("kvferry_fifo_alloc", |b| {
        b.iter_custom(|iters| {
            let l = SlotAllocator::new(1);
            let base = Instant::now();
            let woke = Arc::new(AtomicU64::new(0));
            let next = Arc::new(AtomicBool::new(false));
            let mut hold = Some(l.try_alloc(1).unwrap());
            let helper = {
                let (l, woke, next) = (l.clone(), woke.clone(), next.clone());
                thread::spawn(move || {
                    let token = CancelToken::new();
                    for _ in 0..iters {
                        let s = l.alloc(1, None, &token).unwrap();
                        woke.store(stamp(base), Ordering::Release);
                        l.free(s);
                        while !next.swap(false, Ordering::AcqRel) {
                            thread::yield_now();
                        }
                    }
                })
            };
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                while l.waiters() == 0 {
                    thread::yield_now();
                }
                // let the waiter get past its spin/yield phase into park
                thread::sleep(Duration::from_micros(200));
                let t0 = stamp(base);
                if let Some(s) = hold.take() {
                    l.free(s);
                }
                let t1 = loop {
                    let v = woke.swap(0, Ordering::AcqRel);
                    if v != 0 {
                        break v;
                    }
                    thread::yield_now();
                };
                total += Duration::from_nanos(t1.saturating_sub(t0));
                hold = loop {
                    if let Some(s) = l.try_alloc(1) {
                        break Some(s);
                    }
                    thread::yield_now();
                };
                next.store(true, Ordering::Release);
            }
            helper.join().unwrap();
            total
        })
    });
    g.bench_function("tuned_mutex_condvar", |b| {
        b.iter_custom(|iters| {
            let l = Arc::new(TunedMutexLedger::new(1));
            let base = Instant::now();
            let woke = Arc::new(AtomicU64::new(0));
            let next = Arc::new(AtomicBool::new(false));
            assert!(l.try_admit(1));
            let helper = {
                let (l, woke, next) = (l.clone(), woke.clone(), next.clone());
                thread::spawn(move || {
                    for _ in 0..iters {
                        l.admit(1);
                        woke.store(stamp(base), Ordering::Release);
                        l.release(1);
                        while !next.swap(false, Ordering::AcqRel) {
                            thread::yield_now();
                        }
                    }
                })
            };
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                while l.waiters() == 0 {
                    thread::yield_now();
                }
                thread::sleep(Duration::from_micros(200));
                let t0 = stamp(base);
                l.release(1);
                let t1 = loop {
                    let v = woke.swap(0, Ordering::AcqRel);
                    if v != 0 {
                        break v;
                    }
                    thread::yield_now();
                };
                total += Duration::from_nanos(t1.saturating_sub(t0));
                while !l.try_admit(1) {
                    thread::yield_now();
                }
                next.store(true, Ordering::Release);
            }
            helper.join().unwrap();
            total
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    ledger_uncontended,
    ledger_contended,
    slots,
    wake_latency
);
criterion_main!(benches);
