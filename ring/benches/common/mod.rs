//! Shared bench harness: cross-thread transfers timed with `iter_custom`, so
//! every queue (ours and the baselines) runs the same loop shape.
#![allow(dead_code)]

use std::thread;
use std::time::{Duration, Instant};

use criterion::Criterion;

/// Ring capacity used by every throughput bench.
pub const CAP: usize = 1024;

/// Short runs: the machine is a shared, noisy 2-vCPU VM.
pub fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
}

/// Bounded backoff for a side that found the queue full/empty: spin a
/// little, then yield (benches never sleep, so they measure the queue).
#[inline]
pub fn backoff(round: &mut u32) {
    *round += 1;
    if *round < 64 {
        std::hint::spin_loop();
    } else {
        thread::yield_now();
    }
}

/// Send `iters` items `0..iters` from this thread to a consumer thread, one
/// at a time; returns the elapsed time until the consumer got them all.
pub fn one_by_one<S, R>(
    iters: u64,
    mut tx: S,
    mut rx: R,
    send: fn(&mut S, u64) -> bool,
    recv: fn(&mut R) -> Option<u64>,
) -> Duration
where
    S: Send + 'static,
    R: Send + 'static,
{
    let start = Instant::now();
    let h = thread::spawn(move || {
        let (mut got, mut round, mut sum) = (0u64, 0u32, 0u64);
        while got < iters {
            match recv(&mut rx) {
                Some(v) => {
                    sum = sum.wrapping_add(v);
                    got += 1;
                    round = 0;
                }
                None => backoff(&mut round),
            }
        }
        sum
    });
    let mut round = 0;
    for i in 0..iters {
        while !send(&mut tx, i) {
            backoff(&mut round);
        }
        round = 0;
    }
    let sum = h.join().unwrap();
    let elapsed = start.elapsed();
    assert_eq!(sum, iters.wrapping_mul(iters.wrapping_sub(1)) / 2);
    drop(tx);
    elapsed
}

/// Like [`one_by_one`], with `producers` sender threads each sending
/// `iters / producers` items (the main thread only waits).
pub fn many_to_one<S, R>(
    iters: u64,
    producers: u64,
    tx: S,
    mut rx: R,
    send: fn(&mut S, u64) -> bool,
    recv: fn(&mut R) -> Option<u64>,
) -> Duration
where
    S: Send + Clone + 'static,
    R: Send + 'static,
{
    let per = (iters / producers).max(1);
    let total = per * producers;
    let start = Instant::now();
    let mut hs = Vec::new();
    for _ in 0..producers {
        let mut tx = tx.clone();
        hs.push(thread::spawn(move || {
            let mut round = 0;
            for i in 0..per {
                while !send(&mut tx, i) {
                    backoff(&mut round);
                }
                round = 0;
            }
        }));
    }
    drop(tx);
    let (mut got, mut round) = (0u64, 0u32);
    while got < total {
        match recv(&mut rx) {
            Some(_) => {
                got += 1;
                round = 0;
            }
            None => backoff(&mut round),
        }
    }
    let elapsed = start.elapsed();
    for h in hs {
        h.join().unwrap();
    }
    // Report per requested item so ratios compare like with like.
    elapsed.mul_f64(iters as f64 / total as f64)
}

/// One item in flight: this thread sends on `a`, an echo thread sends it
/// back on `b`. Returns elapsed time for `iters` round trips.
pub fn ping_pong<S1, R1, S2, R2>(
    iters: u64,
    (mut a_tx, a_rx): (S1, R1),
    (b_tx, mut b_rx): (S2, R2),
    send1: fn(&mut S1, u64) -> bool,
    recv1: fn(&mut R1) -> Option<u64>,
    send2: fn(&mut S2, u64) -> bool,
    recv2: fn(&mut R2) -> Option<u64>,
) -> Duration
where
    R1: Send + 'static,
    S2: Send + 'static,
{
    let h = thread::spawn(move || {
        let (mut a_rx, mut b_tx) = (a_rx, b_tx);
        let mut round = 0;
        for _ in 0..iters {
            let v = loop {
                if let Some(v) = recv1(&mut a_rx) {
                    break v;
                }
                backoff(&mut round);
            };
            round = 0;
            while !send2(&mut b_tx, v) {
                backoff(&mut round);
            }
        }
    });
    let start = Instant::now();
    let mut round = 0;
    for i in 0..iters {
        while !send1(&mut a_tx, i) {
            backoff(&mut round);
        }
        let v = loop {
            if let Some(v) = recv2(&mut b_rx) {
                break v;
            }
            backoff(&mut round);
        };
        round = 0;
        assert_eq!(v, i);
    }
    let elapsed = start.elapsed();
    h.join().unwrap();
    elapsed
}

/// Send `iters` items in batches of up to 32 from one thread per sender in
/// `txs` (each `iters / txs.len()` items) to this thread, which receives
/// in batches of up to 32. `send` returns how many items of the slice it
/// took, `recv` how many it wrote into the buffer (0: full / empty).
pub fn batched<S, R>(
    iters: u64,
    txs: Vec<S>,
    mut rx: R,
    send: fn(&mut S, &[u64]) -> usize,
    recv: fn(&mut R, &mut [u64]) -> usize,
) -> Duration
where
    S: Send + 'static,
    R: Send + 'static,
{
    let producers = txs.len() as u64;
    let per = iters.div_ceil(producers).div_ceil(32) * 32;
    let total = per * producers;
    let start = Instant::now();
    let mut hs = Vec::new();
    for mut tx in txs {
        hs.push(thread::spawn(move || {
            let (mut sent, mut round, mut buf) = (0u64, 0u32, [0u64; 32]);
            while sent < per {
                for (i, s) in buf.iter_mut().enumerate() {
                    *s = sent + i as u64;
                }
                let mut off = 0;
                while off < 32 {
                    let k = send(&mut tx, &buf[off..]);
                    if k == 0 {
                        backoff(&mut round);
                    } else {
                        round = 0;
                    }
                    off += k;
                }
                sent += 32;
            }
        }));
    }
    let (mut got, mut round, mut buf) = (0u64, 0u32, [0u64; 32]);
    while got < total {
        let k = recv(&mut rx, &mut buf) as u64;
        if k == 0 {
            backoff(&mut round);
        } else {
            got += k;
            round = 0;
        }
    }
    let elapsed = start.elapsed();
    for h in hs {
        h.join().unwrap();
    }
    elapsed.mul_f64(iters as f64 / total as f64)
}
