//! Random operation sequences on the ledger and an admission queue, checked
//! step by step against a sequential model.
#![cfg(not(feature = "shuttle-model"))]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvferry::ledger::{AdmissionQueue, AdmitError, Ledger, LedgerStats, Reservation};
use proptest::prelude::*;

const CAP: usize = 10;

#[derive(Debug, Clone)]
enum Op {
    TryAdmit(usize),
    Allocate(usize, usize),
    Release(usize),
    Free(usize),
    Park(usize),
    Remove(usize),
    Expire,
    GrantReady,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..=CAP + 2).prop_map(Op::TryAdmit),
        (0..8usize, 0..6usize).prop_map(|(i, k)| Op::Allocate(i, k)),
        (0..8usize).prop_map(Op::Release),
        (0..8usize).prop_map(Op::Free),
        (0..=CAP + 1).prop_map(Op::Park),
        (0..8usize).prop_map(Op::Remove),
        Just(Op::Expire),
        Just(Op::GrantReady),
    ]
}

/// The sequential model: counts, live reservations, and the FIFO queue of
/// parked entries split into waiting and granted-but-uncollected.
#[derive(Default)]
struct Model {
    committed: usize,
    allocated: usize,
    over_frees: usize,
    reservations: Vec<usize>,
    waiting: VecDeque<(u32, usize, bool)>, // key, n, expires
    granted: VecDeque<(u32, usize)>,
}

impl Model {
    fn grant(&mut self) {
        while let Some(&(k, n, _)) = self.waiting.front() {
            if self.committed + n > CAP {
                break;
            }
            self.committed += n;
            self.waiting.pop_front();
            self.granted.push_back((k, n));
        }
    }
    fn release(&mut self, n: usize) {
        self.committed -= n;
        self.grant();
    }
    fn stats(&self) -> LedgerStats {
        LedgerStats {
            capacity: CAP,
            committed: self.committed,
            reserved: self.committed - self.allocated,
            allocated: self.allocated,
            waiters: self.waiting.len(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ledger_matches_sequential_model(ops in proptest::collection::vec(op(), 1..60)) {
        let l = Ledger::new(CAP);
        let mut q: AdmissionQueue<u32> = AdmissionQueue::new();
        let mut m = Model::default();
        let mut live: Vec<Reservation> = Vec::new();
        let mut next_key = 0u32;
        let now = Instant::now();
        // Entries parked with `soon` go at the next Expire (called with
        // `soon` as "now"); `later` ones never expire in the test.
        let soon = now + Duration::from_secs(3600);
        let later = now + Duration::from_secs(7200);
        for op in ops {
            match op {
                Op::TryAdmit(n) => {
                    let got = l.try_admit(n);
                    let want = if n > CAP {
                        Err(AdmitError::TooLarge { requested: n, capacity: CAP })
                    } else if n == 0 {
                        Ok(())
                    } else if !m.waiting.is_empty() || m.committed + n > CAP {
                        Err(AdmitError::WouldBlock)
                    } else {
                        Ok(())
                    };
                    match (got, want) {
                        (Ok(r), Ok(())) => {
                            m.committed += n;
                            m.reservations.push(n);
                            live.push(r);
                        }
                        (Err(e), Err(w)) => prop_assert_eq!(e, w),
                        (g, w) => prop_assert!(false, "try_admit({}) gave {:?}, model {:?}", n, g.map(|r| r.remaining()), w),
                    }
                }
                Op::Allocate(i, k) => {
                    if live.is_empty() { continue; }
                    let i = i % live.len();
                    let got = live[i].allocate(k);
                    if k <= m.reservations[i] {
                        prop_assert!(got.is_ok());
                        m.reservations[i] -= k;
                        m.allocated += k;
                    } else {
                        prop_assert!(got.is_err());
                    }
                    prop_assert_eq!(live[i].remaining(), m.reservations[i]);
                }
                Op::Release(i) => {
                    if live.is_empty() { continue; }
                    let i = i % live.len();
                    let r = live.swap_remove(i);
                    let n = m.reservations.swap_remove(i);
                    if i % 2 == 0 { prop_assert_eq!(r.release(), n); } else { drop(r); }
                    m.release(n);
                }
                Op::Free(k) => {
                    l.free(k);
                    let freed = k.min(m.allocated);
                    m.over_frees += k - freed;
                    m.allocated -= freed;
                    m.release(freed);
                }
                Op::Park(n) => {
                    let key = next_key;
                    next_key += 1;
                    let expires = key % 3 == 0;
                    let got = q.admit_or_park(&l, key, n, if expires { soon } else { later });
                    let parked_any = !m.waiting.is_empty() || !m.granted.is_empty();
                    if n > CAP {
                        prop_assert_eq!(got.unwrap_err(), AdmitError::TooLarge { requested: n, capacity: CAP });
                    } else if !parked_any && (n == 0 || m.committed + n <= CAP) {
                        let r = got.unwrap().expect("admitted at once");
                        m.committed += n;
                        m.reservations.push(n);
                        live.push(r);
                    } else {
                        prop_assert!(got.unwrap().is_none());
                        m.waiting.push_back((key, n, expires));
                        m.grant();
                    }
                }
                Op::Remove(i) => {
                    let total = m.granted.len() + m.waiting.len();
                    if total == 0 { prop_assert!(!q.remove(&u32::MAX)); continue; }
                    let i = i % total;
                    let key = if i < m.granted.len() {
                        let (k, n) = m.granted.remove(i).unwrap();
                        m.release(n);
                        k
                    } else {
                        let (k, _, _) = m.waiting.remove(i - m.granted.len()).unwrap();
                        m.grant();
                        k
                    };
                    prop_assert!(q.remove(&key));
                }
                Op::Expire => {
                    let got = q.expire(soon);
                    let want: Vec<u32> = m.waiting.iter().filter(|e| e.2).map(|e| e.0).collect();
                    m.waiting.retain(|e| !e.2);
                    m.grant();
                    prop_assert_eq!(got, want);
                }
                Op::GrantReady => {
                    let got = q.grant_ready(&l);
                    let want: Vec<(u32, usize)> = m.granted.drain(..).collect();
                    prop_assert_eq!(got.len(), want.len());
                    for ((k, r), (wk, wn)) in got.into_iter().zip(want) {
                        prop_assert_eq!((k, r.remaining()), (wk, wn));
                        m.reservations.push(wn);
                        live.push(r);
                    }
                }
            }
            prop_assert_eq!(l.stats(), m.stats());
            prop_assert_eq!(l.over_frees(), m.over_frees);
            prop_assert_eq!(q.len(), m.waiting.len() + m.granted.len());
            prop_assert!(l.stats().committed <= CAP);
        }
        drop(live);
        drop(q);
        let s = l.stats();
        prop_assert_eq!((s.committed - s.allocated, s.waiters), (0, 0));
    }
}
