//! MPSC cross-thread throughput (u64 items, capacity 1024) with 1 and 2
//! producer threads: kvferry-ring against crossbeam ArrayQueue and
//! crossbeam-channel bounded, in the same run.

mod common;

use std::sync::Arc;

use common::{config, many_to_one, CAP};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use kvferry_ring::mpsc;

fn producers(c: &mut Criterion, k: u64) {
    let mut g = c.benchmark_group(format!("mpsc_{k}p"));
    g.throughput(Throughput::Elements(1));
    g.bench_function("kvferry", |b| {
        b.iter_custom(|n| {
            let (p, c) = mpsc::channel::<u64>(CAP);
            many_to_one(n, k, p, c, |p, v| p.push(v).is_ok(), |c| c.pop())
        })
    });
    g.bench_function("crossbeam_array_queue", |b| {
        b.iter_custom(|n| {
            let q = Arc::new(ArrayQueue::<u64>::new(CAP));
            many_to_one(n, k, q.clone(), q, |q, v| q.push(v).is_ok(), |q| q.pop())
        })
    });
    g.bench_function("crossbeam_channel_bounded", |b| {
        b.iter_custom(|n| {
            let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
            many_to_one(n, k, s, r, |s, v| s.send(v).is_ok(), |r| r.try_recv().ok())
        })
    });
    g.finish();
}

fn one_producer(c: &mut Criterion) {
    producers(c, 1);
}

fn two_producers(c: &mut Criterion) {
    producers(c, 2);
}

criterion_group! { name = benches; config = config(); targets = one_producer, two_producers }
criterion_main!(benches);
