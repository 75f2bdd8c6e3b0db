//! SPSC cross-thread throughput (u64 items, capacity 1024): kvferry-ring
//! against rtrb, crossbeam ArrayQueue, crossbeam-channel bounded and std
//! sync_channel, single items and batches of 32, in the same run.

mod common;

use std::sync::mpsc as stdmpsc;
use std::sync::Arc;

use common::{config, one_by_one, CAP};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use kvferry_ring::spsc;

fn single(c: &mut Criterion) {
    let mut g = c.benchmark_group("spsc_single");
    g.throughput(Throughput::Elements(1));
    g.bench_function("kvferry", |b| {
        b.iter_custom(|n| {
            let (p, c) = spsc::channel::<u64>(CAP);
            one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop())
        })
    });
    g.bench_function("rtrb", |b| {
        b.iter_custom(|n| {
            let (p, c) = rtrb::RingBuffer::<u64>::new(CAP);
            one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop().ok())
        })
    });
    g.bench_function("crossbeam_array_queue", |b| {
        b.iter_custom(|n| {
            let q = Arc::new(ArrayQueue::<u64>::new(CAP));
            one_by_one(n, q.clone(), q, |q, v| q.push(v).is_ok(), |q| q.pop())
        })
    });
    g.bench_function("crossbeam_channel_bounded", |b| {
        b.iter_custom(|n| {
            let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
            one_by_one(n, s, r, |s, v| s.send(v).is_ok(), |r| r.recv().ok())
        })
    });
    g.bench_function("std_sync_channel", |b| {
        b.iter_custom(|n| {
            let (s, r) = stdmpsc::sync_channel::<u64>(CAP);
            one_by_one(n, s, r, |s, v| s.send(v).is_ok(), |r| r.recv().ok())
        })
    });
    g.finish();
}

/// Batches of 32: one publish per batch on both sides.
fn batch32(c: &mut Criterion) {
    let mut g = c.benchmark_group("spsc_batch32");
    g.throughput(Throughput::Elements(1));
    g.bench_function("kvferry_push_slice_pop_into", |b| {
        b.iter_custom(|n| {
            let (mut p, mut c) = spsc::channel::<u64>(CAP);
            let n = n.div_ceil(32) * 32;
            let start = std::time::Instant::now();
            let h = std::thread::spawn(move || {
                let (mut got, mut round, mut buf) = (0u64, 0u32, [0u64; 32]);
                while got < n {
                    let k = c.pop_into(&mut buf) as u64;
                    if k == 0 {
                        common::backoff(&mut round);
                    } else {
                        got += k;
                        round = 0;
                    }
                }
            });
            let mut buf = [0u64; 32];
            let (mut sent, mut round) = (0u64, 0u32);
            while sent < n {
                for (i, s) in buf.iter_mut().enumerate() {
                    *s = sent + i as u64;
                }
                let mut off = 0;
                while off < 32 {
                    let k = p.push_slice(&buf[off..]);
                    if k == 0 {
                        common::backoff(&mut round);
                    } else {
                        round = 0;
                    }
                    off += k;
                }
                sent += 32;
            }
            h.join().unwrap();
            start.elapsed()
        })
    });
    g.bench_function("rtrb_single_item", |b| {
        b.iter_custom(|n| {
            let (p, c) = rtrb::RingBuffer::<u64>::new(CAP);
            one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop().ok())
        })
    });
    g.bench_function("rtrb_chunk32", |b| {
        b.iter_custom(|n| {
            let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(CAP);
            let n = n.div_ceil(32) * 32;
            let start = std::time::Instant::now();
            let h = std::thread::spawn(move || {
                let (mut got, mut round) = (0u64, 0u32);
                while got < n {
                    let k = c.slots().min(32);
                    if k == 0 {
                        common::backoff(&mut round);
                        continue;
                    }
                    if let Ok(ch) = c.read_chunk(k) {
                        got += ch.into_iter().count() as u64;
                        round = 0;
                    }
                }
            });
            let (mut sent, mut round) = (0u64, 0u32);
            while sent < n {
                match p.write_chunk_uninit(32) {
                    Ok(ch) => {
                        ch.fill_from_iter(sent..sent + 32);
                        sent += 32;
                        round = 0;
                    }
                    Err(_) => common::backoff(&mut round),
                }
            }
            h.join().unwrap();
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = single, batch32 }
criterion_main!(benches);
