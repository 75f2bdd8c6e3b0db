//! proptest: random push/pop/batch sequences against a `VecDeque` model, for
//! the SPSC and MPSC heap rings (single thread: this checks the index, wrap
//! and batch arithmetic; the threaded protocol is checked by loom).
#![cfg(not(loom))]

use std::collections::VecDeque;

use kvferry_ring::{mpsc, spsc};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Push(u32),
    PushSlice(Vec<u32>),
    Reserve(Vec<u32>),
    Pop,
    PopInto(usize),
    Peek,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        any::<u32>().prop_map(Op::Push),
        prop::collection::vec(any::<u32>(), 0..12).prop_map(Op::PushSlice),
        prop::collection::vec(any::<u32>(), 0..12).prop_map(Op::Reserve),
        Just(Op::Pop),
        (0usize..12).prop_map(Op::PopInto),
        Just(Op::Peek),
    ]
}

/// The operations both ring kinds provide, so one checker serves both.
trait Ring {
    fn push(&mut self, v: u32) -> Result<(), u32>;
    fn push_slice(&mut self, v: &[u32]) -> usize;
    fn reserve_fill(&mut self, v: &[u32]) -> bool;
    fn pop(&mut self) -> Option<u32>;
    fn pop_into(&mut self, out: &mut [u32]) -> usize;
    fn peek_all(&mut self) -> Vec<u32>;
    fn len(&self) -> (usize, usize);
}

macro_rules! impl_ring {
    ($m:ident) => {
        impl Ring for ($m::Producer<u32>, $m::Consumer<u32>) {
            fn push(&mut self, v: u32) -> Result<(), u32> {
                self.0.push(v)
            }
            fn push_slice(&mut self, v: &[u32]) -> usize {
                self.0.push_slice(v)
            }
            fn reserve_fill(&mut self, v: &[u32]) -> bool {
                match self.0.reserve(v.len()) {
                    Some(mut b) => {
                        let (a, z) = b.as_mut_slices();
                        let k = a.len();
                        a.copy_from_slice(&v[..k]);
                        z.copy_from_slice(&v[k..]);
                        b.commit();
                        true
                    }
                    None => false,
                }
            }
            fn pop(&mut self) -> Option<u32> {
                self.1.pop()
            }
            fn pop_into(&mut self, out: &mut [u32]) -> usize {
                self.1.pop_into(out)
            }
            fn peek_all(&mut self) -> Vec<u32> {
                let b = self.1.peek();
                let (a, z) = b.as_slices();
                let mut v = a.to_vec();
                v.extend_from_slice(z);
                assert_eq!(v, b.iter().collect::<Vec<_>>());
                v
            }
            fn len(&self) -> (usize, usize) {
                (self.0.len(), self.1.len())
            }
        }
    };
}
impl_ring!(spsc);
impl_ring!(mpsc);

fn check(ring: &mut impl Ring, cap: usize, ops: &[Op]) {
    let mut model: VecDeque<u32> = VecDeque::new();
    for op in ops {
        let free = cap - model.len();
        match op {
            Op::Push(v) => {
                let r = ring.push(*v);
                if free > 0 {
                    assert_eq!(r, Ok(()));
                    model.push_back(*v);
                } else {
                    assert_eq!(r, Err(*v));
                }
            }
            Op::PushSlice(v) => {
                let n = ring.push_slice(v);
                assert_eq!(n, v.len().min(free));
                model.extend(&v[..n]);
            }
            Op::Reserve(v) => {
                let ok = ring.reserve_fill(v);
                assert_eq!(ok, v.len() <= free);
                if ok {
                    model.extend(v);
                }
            }
            Op::Pop => assert_eq!(ring.pop(), model.pop_front()),
            Op::PopInto(k) => {
                let mut out = vec![0u32; *k];
                let n = ring.pop_into(&mut out);
                assert_eq!(n, (*k).min(model.len()));
                let want: Vec<u32> = model.drain(..n).collect();
                assert_eq!(&out[..n], &want[..]);
            }
            Op::Peek => {
                let got = ring.peek_all();
                assert_eq!(got, model.drain(..).collect::<Vec<_>>());
            }
        }
        assert_eq!(ring.len(), (model.len(), model.len()));
    }
}

proptest! {
    #[test]
    fn spsc_matches_vecdeque(cap in 1usize..17, ops in prop::collection::vec(op(), 0..200)) {
        let mut r = spsc::channel::<u32>(cap);
        let cap = r.0.capacity();
        check(&mut r, cap, &ops);
    }

    #[test]
    fn mpsc_matches_vecdeque(cap in 1usize..17, ops in prop::collection::vec(op(), 0..200)) {
        let mut r = mpsc::channel::<u32>(cap);
        let cap = r.0.capacity();
        check(&mut r, cap, &ops);
    }
}
