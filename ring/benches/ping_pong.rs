//! One-item ping-pong round trip between two threads (two rings, one item in
//! flight): kvferry-ring SPSC against rtrb, crossbeam-channel bounded(1) and
//! std sync_channel(1), in the same run.

mod common;

use std::sync::mpsc as stdmpsc;

use common::{config, ping_pong};
use criterion::{criterion_group, criterion_main, Criterion};
use kvferry_ring::spsc;

fn round_trip(c: &mut Criterion) {
    let mut g = c.benchmark_group("ping_pong");
    g.bench_function("kvferry", |b| {
        b.iter_custom(|n| {
            ping_pong(
                n,
                spsc::channel::<u64>(16),
                spsc::channel::<u64>(16),
                |p, v| p.push(v).is_ok(),
                |c| c.pop(),
                |p, v| p.push(v).is_ok(),
                |c| c.pop(),
            )
        })
    });
    g.bench_function("rtrb", |b| {
        b.iter_custom(|n| {
            ping_pong(
                n,
                rtrb::RingBuffer::<u64>::new(16),
                rtrb::RingBuffer::<u64>::new(16),
                |p, v| p.push(v).is_ok(),
                |c| c.pop().ok(),
                |p, v| p.push(v).is_ok(),
                |c| c.pop().ok(),
            )
        })
    });
    g.bench_function("crossbeam_channel_bounded", |b| {
        b.iter_custom(|n| {
            ping_pong(
                n,
                crossbeam_channel::bounded::<u64>(1),
                crossbeam_channel::bounded::<u64>(1),
                |s, v| s.send(v).is_ok(),
                |r| r.recv().ok(),
                |s, v| s.send(v).is_ok(),
                |r| r.recv().ok(),
            )
        })
    });
    g.bench_function("std_sync_channel", |b| {
        b.iter_custom(|n| {
            ping_pong(
                n,
                stdmpsc::sync_channel::<u64>(1),
                stdmpsc::sync_channel::<u64>(1),
                |s, v| s.send(v).is_ok(),
                |r| r.recv().ok(),
                |s, v| s.send(v).is_ok(),
                |r| r.recv().ok(),
            )
        })
    });
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = round_trip }
criterion_main!(benches);
