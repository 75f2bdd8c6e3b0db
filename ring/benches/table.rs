//! The ring benchmark table (issue 16): the publish cost of kvferry-ring's
//! SPSC and MPSC rings, single push/pop and batched publish, against rtrb
//! (no doorbell) and crossbeam-channel's bounded channel (a blocking
//! hand-off, like the ring's doorbell), all in one process.
//!
//! Not criterion: on a shared, noisy VM the variants must run interleaved
//! (round r runs every variant once, in turn), so load changes hit all of
//! them alike. Each cell is the median over the rounds of ns per item; the
//! ratio is baseline time / kvferry time (> 1: kvferry is faster).
//!
//! `cargo bench -p kvferry-ring --bench table` (env `TABLE_ITEMS`, default
//! 1,000,000 items per run, and `TABLE_ROUNDS`, default 9). Prints a
//! markdown table.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{batched, many_to_one, one_by_one, CAP};
use kvferry_ring::{mpsc, spsc};

type Run = Box<dyn Fn(u64) -> Duration>;

/// One row: kvferry, then the rtrb and crossbeam-channel baselines (None
/// where the baseline has no such operation).
struct Row {
    name: &'static str,
    kvferry: Run,
    rtrb: Option<(&'static str, Run)>,
    channel: (&'static str, Run),
}

fn rtrb_send_chunk(p: &mut rtrb::Producer<u64>, items: &[u64]) -> usize {
    let k = p.slots().min(items.len());
    if k == 0 {
        return 0;
    }
    match p.write_chunk_uninit(k) {
        Ok(ch) => ch.fill_from_iter(items[..k].iter().copied()),
        Err(_) => 0,
    }
}

fn rtrb_recv_chunk(c: &mut rtrb::Consumer<u64>, out: &mut [u64]) -> usize {
    let k = c.slots().min(out.len());
    match c.read_chunk(k) {
        Ok(ch) if k > 0 => {
            for (o, v) in out.iter_mut().zip(ch) {
                *o = v;
            }
            k
        }
        _ => 0,
    }
}

/// crossbeam-channel has no batch call: a "batch" is items sent one by one.
fn chan_send_each(s: &mut crossbeam_channel::Sender<u64>, items: &[u64]) -> usize {
    items.iter().take_while(|v| s.try_send(**v).is_ok()).count()
}

fn chan_recv_each(r: &mut crossbeam_channel::Receiver<u64>, out: &mut [u64]) -> usize {
    let mut n = 0;
    while n < out.len() {
        match r.try_recv() {
            Ok(v) => out[n] = v,
            Err(_) => break,
        }
        n += 1;
    }
    n
}

fn rows() -> Vec<Row> {
    let chan_single: Run = Box::new(|n| {
        let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
        one_by_one(n, s, r, |s, v| s.try_send(v).is_ok(), |r| r.try_recv().ok())
    });
    let chan_batch = |k: usize| -> Run {
        Box::new(move |n| {
            let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
            batched(n, vec![s; k], r, chan_send_each, chan_recv_each)
        })
    };
    let chan_2p: Run = Box::new(|n| {
        let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
        many_to_one(
            n,
            2,
            s,
            r,
            |s, v| s.try_send(v).is_ok(),
            |r| r.try_recv().ok(),
        )
    });
    let rtrb_single = || -> Run {
        Box::new(|n| {
            let (p, c) = rtrb::RingBuffer::<u64>::new(CAP);
            one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop().ok())
        })
    };
    let rtrb_chunks = || -> Run {
        Box::new(|n| {
            let (p, c) = rtrb::RingBuffer::<u64>::new(CAP);
            batched(n, vec![p], c, rtrb_send_chunk, rtrb_recv_chunk)
        })
    };
    vec![
        Row {
            name: "SPSC single push/pop",
            kvferry: Box::new(|n| {
                let (p, c) = spsc::channel::<u64>(CAP);
                one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop())
            }),
            rtrb: Some(("push/pop", rtrb_single())),
            channel: ("try_send/try_recv", chan_single),
        },
        Row {
            name: "SPSC batch of 32 (push_slice/pop_into)",
            kvferry: Box::new(|n| {
                let (p, c) = spsc::channel::<u64>(CAP);
                batched(
                    n,
                    vec![p],
                    c,
                    |p, items| p.push_slice(items),
                    |c, out| c.pop_into(out),
                )
            }),
            rtrb: Some(("chunks of 32", rtrb_chunks())),
            channel: ("32 single sends", chan_batch(1)),
        },
        Row {
            name: "MPSC 1 producer, single push/pop",
            kvferry: Box::new(|n| {
                let (p, c) = mpsc::channel::<u64>(CAP);
                one_by_one(n, p, c, |p, v| p.push(v).is_ok(), |c| c.pop())
            }),
            rtrb: Some(("SPSC push/pop", rtrb_single())),
            channel: ("try_send/try_recv", {
                Box::new(|n| {
                    let (s, r) = crossbeam_channel::bounded::<u64>(CAP);
                    one_by_one(n, s, r, |s, v| s.try_send(v).is_ok(), |r| r.try_recv().ok())
                })
            }),
        },
        Row {
            name: "MPSC 1 producer, batch of 32 (push_slice/pop_into)",
            kvferry: Box::new(|n| {
                let (p, c) = mpsc::channel::<u64>(CAP);
                batched(
                    n,
                    vec![p],
                    c,
                    |p, items| p.push_slice(items),
                    |c, out| c.pop_into(out),
                )
            }),
            rtrb: Some(("SPSC chunks of 32", rtrb_chunks())),
            channel: ("32 single sends", chan_batch(1)),
        },
        Row {
            name: "MPSC 2 producers, single push",
            kvferry: Box::new(|n| {
                let (p, c) = mpsc::channel::<u64>(CAP);
                many_to_one(n, 2, p, c, |p, v| p.push(v).is_ok(), |c| c.pop())
            }),
            rtrb: None,
            channel: ("try_send/try_recv", chan_2p),
        },
        Row {
            name: "MPSC 2 producers, batch of 32",
            kvferry: Box::new(|n| {
                let (p, c) = mpsc::channel::<u64>(CAP);
                batched(
                    n,
                    vec![p.clone(), p],
                    c,
                    |p, items| p.push_slice(items),
                    |c, out| c.pop_into(out),
                )
            }),
            rtrb: None,
            channel: ("32 single sends", chan_batch(2)),
        },
    ]
}

/// One thread, no transfer: push `CAP` items one by one (or in batches of
/// 32), then pop them, until `iters` items went through. Measures what a
/// publish and a release cost in instructions (the doorbell's fence, the
/// stamp stores) without the cache-line transfer and the scheduling that
/// dominate a cross-thread run on a loaded machine.
fn fill_drain<S, R>(
    iters: u64,
    tx: &mut S,
    rx: &mut R,
    send: fn(&mut S, &[u64]) -> usize,
    recv: fn(&mut R, &mut [u64]) -> usize,
    batch: usize,
) -> Duration {
    let mut buf = [0u64; 32];
    let mut out = [0u64; 32];
    let (mut done, mut sum) = (0u64, 0u64);
    let start = Instant::now();
    while done < iters {
        let mut pushed = 0;
        while pushed < CAP {
            for (i, b) in buf[..batch].iter_mut().enumerate() {
                *b = (pushed + i) as u64;
            }
            let k = send(tx, &buf[..batch]);
            assert_eq!(k, batch, "fill_drain: queue refused an item");
            pushed += k;
        }
        let mut popped = 0;
        while popped < CAP {
            let k = recv(rx, &mut out[..batch]);
            assert_eq!(k, batch, "fill_drain: queue lost an item");
            sum = sum.wrapping_add(out[..k].iter().sum::<u64>());
            popped += k;
        }
        done += CAP as u64;
    }
    let elapsed = start.elapsed();
    black_box(sum);
    elapsed.mul_f64(iters as f64 / done as f64)
}

/// The same-thread rows: single push/pop and batches of 32.
fn alone_rows() -> Vec<Row> {
    fn row(name: &'static str, batch: usize, mpsc_ring: bool) -> Row {
        let kvferry: Run = if mpsc_ring {
            Box::new(move |n| {
                let (mut p, mut c) = mpsc::channel::<u64>(CAP);
                if batch == 1 {
                    fill_drain(
                        n,
                        &mut p,
                        &mut c,
                        |p, v| usize::from(p.push(v[0]).is_ok()),
                        |c, o| pop_one(c.pop(), o),
                        1,
                    )
                } else {
                    fill_drain(
                        n,
                        &mut p,
                        &mut c,
                        |p, v| p.push_slice(v),
                        |c, o| c.pop_into(o),
                        batch,
                    )
                }
            })
        } else {
            Box::new(move |n| {
                let (mut p, mut c) = spsc::channel::<u64>(CAP);
                if batch == 1 {
                    fill_drain(
                        n,
                        &mut p,
                        &mut c,
                        |p, v| usize::from(p.push(v[0]).is_ok()),
                        |c, o| pop_one(c.pop(), o),
                        1,
                    )
                } else {
                    fill_drain(
                        n,
                        &mut p,
                        &mut c,
                        |p, v| p.push_slice(v),
                        |c, o| c.pop_into(o),
                        batch,
                    )
                }
            })
        };
        let rtrb: Run = Box::new(move |n| {
            let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(CAP);
            if batch == 1 {
                fill_drain(
                    n,
                    &mut p,
                    &mut c,
                    |p, v| usize::from(p.push(v[0]).is_ok()),
                    |c, o| pop_one(c.pop().ok(), o),
                    1,
                )
            } else {
                fill_drain(n, &mut p, &mut c, rtrb_send_chunk, rtrb_recv_chunk, batch)
            }
        });
        let channel: Run = Box::new(move |n| {
            let (mut s, mut r) = crossbeam_channel::bounded::<u64>(CAP);
            fill_drain(n, &mut s, &mut r, chan_send_each, chan_recv_each, batch)
        });
        let rtrb_what = match (batch, mpsc_ring) {
            (1, false) => "push/pop",
            (1, true) => "SPSC push/pop",
            (_, false) => "chunks of 32",
            (_, true) => "SPSC chunks of 32",
        };
        let chan_what = if batch == 1 {
            "try_send/try_recv"
        } else {
            "32 single sends"
        };
        Row {
            name,
            kvferry,
            rtrb: Some((rtrb_what, rtrb)),
            channel: (chan_what, channel),
        }
    }
    vec![
        row("SPSC single push/pop", 1, false),
        row("SPSC batch of 32", 32, false),
        row("MPSC single push/pop", 1, true),
        row("MPSC batch of 32", 32, true),
    ]
}

fn pop_one(v: Option<u64>, out: &mut [u64]) -> usize {
    match v {
        Some(v) => {
            out[0] = v;
            1
        }
        None => 0,
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every row `rounds` times, interleaved, and prints the table.
fn table(title: &str, rows: &[Row], items: u64, rounds: u64) {
    // samples[row][0 kvferry | 1 rtrb | 2 channel] = ns/item per round.
    let mut samples = vec![[Vec::new(), Vec::new(), Vec::new()]; rows.len()];
    let ns = |d: Duration| d.as_secs_f64() * 1e9 / items as f64;
    for _ in 0..rounds {
        for (row, s) in rows.iter().zip(samples.iter_mut()) {
            s[0].push(ns((row.kvferry)(items)));
            if let Some((_, f)) = &row.rtrb {
                s[1].push(ns(f(items)));
            }
            s[2].push(ns((row.channel.1)(items)));
        }
    }
    println!("{title}: {items} u64 items per run, capacity {CAP}, median of {rounds} interleaved rounds, ns/item; ratio = baseline / kvferry");
    println!();
    println!("| operation | kvferry-ring | rtrb | ratio | crossbeam-channel bounded | ratio |");
    println!("|---|---|---|---|---|---|");
    for (row, s) in rows.iter().zip(samples) {
        let [k, r, c] = s.map(|v| (!v.is_empty()).then(|| median(v)));
        let k = k.unwrap_or(f64::NAN);
        let rtrb = match (&row.rtrb, r) {
            (Some((what, _)), Some(r)) => format!("{r:.1} ({what}) | {:.2}×", r / k),
            _ => "— | —".to_string(),
        };
        let c = c.unwrap_or(f64::NAN);
        println!(
            "| {} | {k:.1} | {rtrb} | {c:.1} ({}) | {:.2}× |",
            row.name,
            row.channel.0,
            c / k
        );
    }
    println!();
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run
    // passes nothing: then run one tiny round so the target is exercised.
    let benching = std::env::args().any(|a| a == "--bench");
    let items = if benching {
        env("TABLE_ITEMS", 1_000_000)
    } else {
        1000
    };
    let rounds = if benching {
        env("TABLE_ROUNDS", 9).max(1)
    } else {
        1
    };
    table("cross-thread", &rows(), items, rounds);
    table(
        "one thread (fill, then drain)",
        &alone_rows(),
        items,
        rounds,
    );
}
