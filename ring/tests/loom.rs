//! loom model tests: every interleaving (within a preemption bound) of the
//! ring protocols, with loom's atomics, cells and a Mutex/Condvar model of
//! the futex doorbell (see `src/sync.rs`).
//!
//! Run (own target dir, so the normal build cache survives):
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kvferry-ring --release --test loom`
#![cfg(loom)]

use kvferry_ring::{mpsc, spsc, WaitStatus};
use loom::thread;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b.check(f);
}

/// Push `v`, yielding while the ring is full.
fn push_spsc(p: &mut spsc::Producer<u32>, v: u32) {
    while p.push(v).is_err() {
        thread::yield_now();
    }
}

fn push_mpsc(p: &mut mpsc::Producer<u32>, v: u32) {
    while p.push(v).is_err() {
        thread::yield_now();
    }
}

/// SPSC through a 2-slot ring: 3 entries (one batch), consumer uses the
/// doorbell. No loss, no duplicate, FIFO, no lost wakeup (a lost wakeup
/// shows up as a loom deadlock), then Closed.
#[test]
fn spsc_no_loss_fifo_with_doorbell() {
    model(|| {
        let (mut p, mut c) = spsc::channel::<u32>(2);
        let prod = thread::spawn(move || {
            push_spsc(&mut p, 1);
            loop {
                if let Some(mut b) = p.reserve(2) {
                    b.set(0, 2).unwrap();
                    b.set(1, 3).unwrap();
                    b.commit();
                    break;
                }
                thread::yield_now();
            }
        });
        let mut got = Vec::new();
        loop {
            match c.wait(None) {
                WaitStatus::Ready => {
                    while let Some(v) = c.pop() {
                        got.push(v);
                    }
                }
                WaitStatus::Closed => break,
                WaitStatus::TimedOut => panic!("no deadline was given"),
            }
        }
        assert_eq!(got, vec![1, 2, 3]);
        prod.join().unwrap();
    });
}

/// SPSC peek/release and pop_into race against push_slice.
#[test]
fn spsc_batches() {
    model(|| {
        let (mut p, mut c) = spsc::channel::<u32>(2);
        let prod = thread::spawn(move || {
            let items = [1, 2, 3];
            let mut sent = 0;
            while sent < items.len() {
                let n = p.push_slice(&items[sent..]);
                if n == 0 {
                    thread::yield_now();
                }
                sent += n;
            }
        });
        let mut got = Vec::new();
        let mut buf = [0u32; 2];
        while got.len() < 3 {
            let b = c.peek();
            got.extend(b.iter());
            drop(b);
            let n = c.pop_into(&mut buf);
            got.extend_from_slice(&buf[..n]);
            if got.len() < 3 {
                thread::yield_now();
            }
        }
        assert_eq!(got, vec![1, 2, 3]);
        prod.join().unwrap();
    });
}

/// MPSC with 2 producers: nothing lost or duplicated, each producer's
/// entries in order, wakeups not lost, Closed at the end.
#[test]
fn mpsc_two_producers() {
    model(|| {
        let (mut p1, mut c) = mpsc::channel::<u32>(4);
        let mut p2 = p1.clone();
        let t1 = thread::spawn(move || {
            push_mpsc(&mut p1, 10);
            push_mpsc(&mut p1, 11);
        });
        let t2 = thread::spawn(move || {
            push_mpsc(&mut p2, 20);
        });
        let mut got = Vec::new();
        loop {
            match c.wait(None) {
                WaitStatus::Ready => {
                    while let Some(v) = c.pop() {
                        got.push(v);
                    }
                }
                WaitStatus::Closed => break,
                WaitStatus::TimedOut => panic!("no deadline was given"),
            }
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![10, 11, 20], "lost or duplicated: {got:?}");
        let p1_order: Vec<u32> = got.iter().copied().filter(|v| *v < 20).collect();
        assert_eq!(p1_order, vec![10, 11], "producer 1 out of order");
        t1.join().unwrap();
        t2.join().unwrap();
    });
}

/// MPSC through a 1-slot ring: the producer must wait for the consumer to
/// free the slot (slot reuse is ordered by the head Acquire/Release pair).
#[test]
fn mpsc_full_ring_reuse() {
    model(|| {
        let (mut p, mut c) = mpsc::channel::<u32>(1);
        let t = thread::spawn(move || {
            push_mpsc(&mut p, 1);
            push_mpsc(&mut p, 2);
        });
        let mut got = Vec::new();
        while c.wait(None) == WaitStatus::Ready {
            got.extend(c.pop());
        }
        assert_eq!(got, vec![1, 2]);
        t.join().unwrap();
    });
}

/// MPSC reserve/commit by one producer while another pushes.
#[test]
fn mpsc_reserve_vs_push() {
    model(|| {
        let (mut p1, mut c) = mpsc::channel::<u32>(4);
        let mut p2 = p1.clone();
        let t1 = thread::spawn(move || {
            let mut b = p1.reserve(2).unwrap();
            b.set(0, 1).unwrap();
            b.set(1, 2).unwrap();
            b.commit();
        });
        let t2 = thread::spawn(move || {
            push_mpsc(&mut p2, 3);
        });
        let mut got = Vec::new();
        while c.wait(None) == WaitStatus::Ready {
            let b = c.peek();
            got.extend(b.iter());
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![1, 2, 3]);
        let p1_order: Vec<u32> = got.iter().copied().filter(|v| *v < 3).collect();
        assert_eq!(p1_order, vec![1, 2]);
        t1.join().unwrap();
        t2.join().unwrap();
    });
}

/// The doorbell alone: one push against a consumer that goes straight to
/// the futex. A lost wakeup would deadlock (loom reports it).
#[test]
fn doorbell_no_lost_wakeup() {
    model(|| {
        let (mut p, c) = spsc::channel::<u32>(1);
        let prod = thread::spawn(move || {
            p.push(5).unwrap();
            // Keep the producer alive so only the push (not the close) can
            // wake the consumer.
            p
        });
        assert_eq!(c.wait(None), WaitStatus::Ready);
        let p = prod.join().unwrap();
        drop(p);
    });
}

/// Close alone wakes a waiting consumer.
#[test]
fn doorbell_close_wakes() {
    model(|| {
        let (p, c) = mpsc::channel::<u32>(1);
        let q = p.clone();
        let t = thread::spawn(move || drop(p));
        let u = thread::spawn(move || drop(q));
        assert_eq!(c.wait(None), WaitStatus::Closed);
        t.join().unwrap();
        u.join().unwrap();
    });
}
