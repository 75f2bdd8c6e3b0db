//! Random operation sequences on the slot allocator, checked step by step
//! against a sequential model (a set of held slots per live SlotSet).
#![cfg(not(feature = "shuttle-model"))]

use std::collections::BTreeSet;

use kvferry::slots::{SlotAllocator, SlotSet};
use proptest::prelude::*;

const SLOTS: usize = 70; // two words, the second partly padding

#[derive(Debug, Clone)]
enum Op {
    TryAlloc(usize),
    Free(usize),
    FreeOne(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..=SLOTS + 2).prop_map(Op::TryAlloc),
        2 => (0..16usize).prop_map(Op::Free),
        1 => (0..(SLOTS as u32 + 3)).prop_map(Op::FreeOne),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn slots_match_sequential_model(ops in proptest::collection::vec(op(), 1..80)) {
        let a = SlotAllocator::new(SLOTS);
        let mut live: Vec<SlotSet> = Vec::new();
        // model: slots each live set still holds (free_one may shrink them)
        let mut held: Vec<BTreeSet<u32>> = Vec::new();
        let mut bad = 0usize;
        for op in ops {
            let in_use: usize = held.iter().map(|h| h.len()).sum();
            match op {
                Op::TryAlloc(n) => {
                    let got = a.try_alloc(n);
                    if n <= SLOTS - in_use {
                        let s = got.expect("fits");
                        prop_assert_eq!(s.len(), n);
                        let set: BTreeSet<u32> = s.iter().collect();
                        prop_assert_eq!(set.len(), n);
                        for h in &held {
                            prop_assert!(h.is_disjoint(&set), "slot handed out twice");
                        }
                        prop_assert!(set.iter().all(|&x| (x as usize) < SLOTS));
                        held.push(set);
                        live.push(s);
                    } else {
                        prop_assert!(got.is_none());
                    }
                }
                Op::Free(i) => {
                    if live.is_empty() { continue; }
                    let i = i % live.len();
                    let s = live.swap_remove(i);
                    let h = held.swap_remove(i);
                    prop_assert_eq!(s.len(), h.len());
                    a.free(s);
                }
                Op::FreeOne(x) => {
                    // A slot given back on its own leaves its set (a slot
                    // freed twice by its owner after reuse is undetectable,
                    // so a correct caller never does that).
                    match held.iter().position(|h| h.contains(&x)) {
                        Some(i) => {
                            held[i].remove(&x);
                            // The owner takes the slot out of its set and gives it back.
                            let one = live[i].remove(x).expect("the set holds it");
                            prop_assert_eq!(one.as_slice(), &[x][..]);
                            a.free(one);
                        }
                        None => {
                            bad += 1;
                            a.free_one(x);
                        }
                    }
                }
            }
            let in_use: usize = held.iter().map(|h| h.len()).sum();
            prop_assert_eq!(a.in_use(), in_use);
            prop_assert_eq!(a.bad_frees(), bad);
            let snap = a.snapshot();
            prop_assert_eq!(snap.len(), SLOTS);
            let want: BTreeSet<u32> = held.iter().flatten().copied().collect();
            let got: BTreeSet<u32> = snap.iter_ones().map(|i| i as u32).collect();
            prop_assert_eq!(got, want);
        }
    }
}
