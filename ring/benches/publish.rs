//! The doorbell's publish step in isolation, in two settings: `publish`, a
//! producer thread publishes 1..=n into one word (on its own 128-byte line)
//! while a consumer thread keeps reading it, as the ring's consumer reads
//! the tail (this includes the cache-line transfer, and needs two idle
//! cores to mean much); `publish_one_thread`, the same loop with no reader,
//! which isolates the cost of the instructions (store buffer drain) and is
//! robust on a loaded machine. Each compares the ring's AcqRel swap (the
//! chosen protocol) with the Release store + SeqCst fence + flag load it
//! replaced, a SeqCst store + SeqCst load, and a plain Release store (no
//! doorbell at all, what rtrb does), in the same run.

mod common;

use std::hint::black_box;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::config;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[repr(align(128))]
struct Line(AtomicU64);

struct Words {
    word: Line,
    /// The separate need-wakeup flag the fence protocol reads.
    flag: Line,
}

/// One publish of a value; true if it would ring the doorbell.
type Publish = fn(&Words, u64) -> bool;

/// The four publish variants, by name.
const VARIANTS: [(&str, Publish); 4] = [
    ("swap_acqrel", |w, v| {
        w.word.0.swap(v, Ordering::AcqRel) & (1 << 63) != 0
    }),
    ("release_store_seqcst_fence_load", |w, v| {
        w.word.0.store(v, Ordering::Release);
        fence(Ordering::SeqCst);
        w.flag.0.load(Ordering::Relaxed) != 0
    }),
    ("seqcst_store_seqcst_load", |w, v| {
        w.word.0.store(v, Ordering::SeqCst);
        w.flag.0.load(Ordering::SeqCst) != 0
    }),
    ("release_store_no_doorbell", |w, v| {
        w.word.0.store(v, Ordering::Release);
        false
    }),
];

/// Time `n` publishes with `publish` on this thread alone.
fn run_alone(n: u64, publish: Publish) -> Duration {
    let w = Words {
        word: Line(AtomicU64::new(0)),
        flag: Line(AtomicU64::new(0)),
    };
    let start = Instant::now();
    let mut woken = 0u64;
    for v in 1..=n {
        woken += u64::from(publish(black_box(&w), v));
    }
    let elapsed = start.elapsed();
    black_box(woken);
    elapsed
}

/// Time `n` publishes with `publish` against a reading consumer.
fn run(n: u64, publish: Publish) -> Duration {
    let w = Arc::new(Words {
        word: Line(AtomicU64::new(0)),
        flag: Line(AtomicU64::new(0)),
    });
    let r = w.clone();
    let reader = thread::spawn(move || {
        // Acquire: as the ring's consumer loads the tail.
        while r.word.0.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
    });
    let start = Instant::now();
    let mut woken = 0u64;
    for v in 1..=n {
        woken += u64::from(publish(&w, v));
    }
    let elapsed = start.elapsed();
    reader.join().unwrap();
    black_box(woken);
    elapsed
}

fn publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("publish");
    g.throughput(Throughput::Elements(1));
    for (name, f) in VARIANTS {
        g.bench_function(name, |b| b.iter_custom(|n| run(n, f)));
    }
    g.finish();
    let mut g = c.benchmark_group("publish_one_thread");
    g.throughput(Throughput::Elements(1));
    for (name, f) in VARIANTS {
        g.bench_function(name, |b| b.iter_custom(|n| run_alone(n, f)));
    }
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = publish }
criterion_main!(benches);
