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

/// MPSC: producer A holds a claim at the consumer's position while producer
/// B publishes the next one. B's notify takes the consumer's `need_wakeup`
/// flag and rings although the consumer cannot use B's entry yet; A's
/// commit must still wake the consumer. The consumer keeps a producer of its
/// own until it has both entries, so the close ring of the last producer's
/// drop cannot hide a lost wakeup (the other models end with that ring).
/// Before the fix (the consumer loaded the bell after arming the flag), a
/// ring from B between the arming and that load was counted in the value
/// the consumer slept on, and nothing woke it: loom reports a deadlock.
#[test]
fn mpsc_later_publish_does_not_swallow_the_wakeup() {
    model(|| {
        let (mut a, mut c) = mpsc::channel::<u32>(2);
        let mut b = a.clone();
        let keep = a.clone();
        let ta = thread::spawn(move || {
            let mut batch = a.reserve(1).unwrap();
            batch.set(0, 1).unwrap();
            batch.commit();
        });
        let tb = thread::spawn(move || {
            push_mpsc(&mut b, 2);
        });
        let mut got = Vec::new();
        while got.len() < 2 {
            assert_eq!(c.wait(None), WaitStatus::Ready);
            got.extend(c.peek().iter());
        }
        drop(keep);
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![1, 2]);
        ta.join().unwrap();
        tb.join().unwrap();
    });
}

/// SPSC form of the same swallow: the producer reads the flag of the
/// consumer's first arming (set while it waits for entry 1), is preempted
/// before its swap, and swaps only after the consumer took entry 1 and
/// armed again for entry 2. Its ring then belongs to an entry already
/// consumed; entry 2's notify must still wake the consumer. The producer
/// parks until the consumer has both entries, so no close ring can hide a
/// lost wakeup. Needs a preemption bound of 3.
#[test]
fn spsc_stale_swap_does_not_swallow_the_wakeup() {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(|| {
        use loom::sync::atomic::{AtomicBool, Ordering};
        use loom::sync::Arc;
        let (mut p, mut c) = spsc::channel::<u32>(2);
        let done = Arc::new(AtomicBool::new(false));
        let done_p = done.clone();
        let t = thread::spawn(move || {
            push_spsc(&mut p, 1);
            push_spsc(&mut p, 2);
            // Acquire: pairs with the consumer's Release store below.
            while !done_p.load(Ordering::Acquire) {
                thread::park();
            }
        });
        let mut got = Vec::new();
        while got.len() < 2 {
            assert_eq!(c.wait(None), WaitStatus::Ready);
            got.extend(c.pop());
        }
        // Release: the producer may drop its handle once it sees this.
        done.store(true, Ordering::Release);
        t.thread().unpark();
        assert_eq!(got, vec![1, 2]);
        t.join().unwrap();
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

/// The doorbell for a consumer that sleeps elsewhere (`poll(2)` on a
/// socket): it arms need-wakeup with `arm_wakeup` and sleeps only if that
/// re-check found the ring empty; the producer wakes it (writes the socket)
/// only if `take_wakeup` says so. Never both "asleep" and "not woken".
#[test]
fn armed_wakeup_is_never_lost() {
    model(|| {
        let (mut p, mut c) = spsc::channel::<u32>(1);
        let prod = thread::spawn(move || {
            p.push(5).unwrap();
            let woke = p.take_wakeup();
            (p, woke)
        });
        let slept = c.arm_wakeup();
        let (p, woke) = prod.join().unwrap();
        assert!(!slept || woke, "the consumer slept and nobody woke it");
        c.disarm_wakeup();
        assert_eq!(c.pop(), Some(5));
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

/// The doorbell handshake alone, in five variants, to show what loom can
/// and cannot prove about it. One producer publishes one entry; the
/// consumer waits for it with no deadline, so a lost wakeup is a loom
/// deadlock. The real code's handshake (`Ring::notify` / `Ring::wait_until`)
/// is [`Protocol::Fences`]; the models above check it in place.
mod handshake {
    use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    /// The need-wakeup bit the consumer sets in the published word.
    const WAITING: u64 = 1 << 63;

    #[derive(Clone, Copy, Debug)]
    enum Protocol {
        /// The flag is bit 63 of the published word; the consumer arms it
        /// with a CAS, the producer publishes with a swap. Correct by RMW
        /// atomicity on one word plus Release/Acquire, both of which loom
        /// models exactly; measured and dropped: one `lock xchg` per publish
        /// was about 2x slower than store + `mfence` on the project VM.
        Rmw,
        /// Broken: the producer reads the word, then stores (not one RMW),
        /// so a CAS between the two is overwritten unseen.
        RmwTorn,
        /// The ring's protocol: a separate flag word and a SeqCst fence on
        /// each side (store -> fence -> load, Dekker).
        Fences,
        /// Broken: as `Fences` without the producer's fence (a Release store
        /// followed by a load can be reordered).
        NoProducerFence,
        /// Correct in C++20 (a SeqCst store and a SeqCst load on the producer
        /// against the consumer's SeqCst fence), but loom treats SeqCst
        /// accesses as AcqRel, so it cannot prove it (a false alarm).
        SeqCstAccesses,
    }

    /// The futex model of `src/sync.rs`: `wait` sleeps only if the word
    /// still holds `expected`, checked under the lock `ring` takes too.
    struct Bell {
        word: AtomicU32,
        lock: Mutex<()>,
        cv: Condvar,
    }

    struct Shared {
        /// The published word (SPSC tail / MPSC stamp): 0 empty, 1 published.
        word: AtomicU64,
        /// The separate need-wakeup flag of the fence protocols.
        flag: AtomicU32,
        bell: Bell,
    }

    impl Bell {
        fn ring(&self) {
            self.word.fetch_add(1, Ordering::Release);
            let _g = self.lock.lock().unwrap();
            self.cv.notify_all();
        }

        fn wait(&self, expected: u32) {
            let g = self.lock.lock().unwrap();
            if self.word.load(Ordering::Relaxed) == expected {
                drop(self.cv.wait(g).unwrap());
            }
        }
    }

    fn publish(s: &Shared, p: Protocol) {
        match p {
            Protocol::Rmw => {
                if s.word.swap(1, Ordering::AcqRel) & WAITING != 0 {
                    s.bell.ring();
                }
            }
            Protocol::RmwTorn => {
                let old = s.word.load(Ordering::Acquire);
                s.word.store(1, Ordering::Release);
                if old & WAITING != 0 {
                    s.bell.ring();
                }
            }
            Protocol::Fences | Protocol::NoProducerFence | Protocol::SeqCstAccesses => {
                let flagged = if let Protocol::SeqCstAccesses = p {
                    s.word.store(1, Ordering::SeqCst);
                    s.flag.load(Ordering::SeqCst) != 0
                } else {
                    s.word.store(1, Ordering::Release);
                    if let Protocol::Fences = p {
                        fence(Ordering::SeqCst);
                    }
                    s.flag.load(Ordering::Relaxed) != 0
                };
                if flagged && s.flag.swap(0, Ordering::Relaxed) != 0 {
                    s.bell.ring();
                }
            }
        }
    }

    fn wait(s: &Shared, p: Protocol) {
        loop {
            let seen = match p {
                Protocol::Rmw | Protocol::RmwTorn => {
                    let seen = s.bell.word.load(Ordering::Acquire);
                    let cur = s.word.load(Ordering::Acquire);
                    if cur & !WAITING != 0 {
                        return;
                    }
                    if cur & WAITING == 0
                        && s.word
                            .compare_exchange(
                                cur,
                                cur | WAITING,
                                Ordering::Release,
                                Ordering::Acquire,
                            )
                            .is_err()
                    {
                        continue;
                    }
                    seen
                }
                Protocol::Fences | Protocol::NoProducerFence | Protocol::SeqCstAccesses => {
                    s.flag.store(1, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    let seen = s.bell.word.load(Ordering::Acquire);
                    if s.word.load(Ordering::Acquire) != 0 {
                        return;
                    }
                    seen
                }
            };
            s.bell.wait(seen);
        }
    }

    fn check(p: Protocol) {
        super::model(move || {
            let s = Arc::new(Shared {
                word: AtomicU64::new(0),
                flag: AtomicU32::new(0),
                bell: Bell {
                    word: AtomicU32::new(0),
                    lock: Mutex::new(()),
                    cv: Condvar::new(),
                },
            });
            let s2 = s.clone();
            let producer = thread::spawn(move || publish(&s2, p));
            wait(&s, p);
            producer.join().unwrap();
        });
    }

    #[test]
    fn rmw_on_the_published_word_loses_no_wakeup() {
        check(Protocol::Rmw);
    }

    #[test]
    #[should_panic(expected = "deadlock")]
    fn torn_rmw_loses_a_wakeup() {
        check(Protocol::RmwTorn);
    }

    #[test]
    fn fences_on_both_sides_lose_no_wakeup() {
        check(Protocol::Fences);
    }

    #[test]
    #[should_panic(expected = "deadlock")]
    fn release_store_without_fence_loses_a_wakeup() {
        check(Protocol::NoProducerFence);
    }

    /// Not a bug in the protocol: a limit of loom (SeqCst accesses are
    /// modelled as AcqRel). This is why the ring does not rely on SeqCst
    /// accesses: loom could not check it.
    #[test]
    #[should_panic(expected = "deadlock")]
    fn loom_cannot_prove_seqcst_accesses() {
        check(Protocol::SeqCstAccesses);
    }
}
