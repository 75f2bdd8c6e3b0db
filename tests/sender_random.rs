//! The in-process request API under random concurrent use, over shm and
//! TCP: several threads begin requests, stage them in parts, fill the
//! slots in place and submit them, drop batches unsubmitted and cancel at
//! every point of a request's life (before any batch, between batches,
//! with a batch held, after the last submit, racing the completion).
//! Every request that completes holds exactly its own bytes at the
//! receiver (each chunk carries its request and index), every cancel that
//! says it won ends its request cancelled, and both ends hold nothing
//! afterwards. `KVFERRY_FUZZ_SEED` picks another sequence. Every wait has
//! a deadline.

#[path = "common_sender/mod.rs"]
mod common_sender;
#[path = "common/process.rs"]
mod process;

use std::sync::Arc;

use common_sender::{
    chunk_id, consume, deadline, key, payloads, receiver_cfg, sender, sender_cfg, tcp_pair,
    wait_receiver_empty, wait_sender_empty, WAIT,
};
use kvferry::receiver::Receiver;
use kvferry::sender::{RequestSpec, RequestStatus, Sender};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Requests per thread.
const REQUESTS: u64 = 120;
/// Threads using the sender at once.
const THREADS: u64 = 3;

/// How the requests of one thread ended.
#[derive(Default, Debug)]
struct Ends {
    completed: u64,
    cancelled: u64,
    /// Cancels that lost to the completion (returned false).
    lost: u64,
}

/// When a request of [`random_requests`] is cancelled.
#[derive(Clone, Copy, Debug)]
enum CancelAt {
    /// Never.
    Never,
    /// Before staging the batch that starts at this chunk.
    Before(u32),
    /// With the batch starting at this chunk staged and filled, not
    /// submitted (dropped after the cancel).
    Holding(u32),
    /// After the last submit: racing the completion.
    AfterLast,
}

/// Thread `w`'s requests: each of 1-8 chunks, staged in batches of 1-4,
/// now and then a batch dropped unsubmitted (its slots go back and the
/// same chunks are staged again), cancelled at a random point or not.
fn random_requests(s: &Sender, r: &Receiver, w: u64) -> Ends {
    let mut rng = SmallRng::seed_from_u64(process::fuzz_seed() ^ (w << 32));
    let mut ends = Ends::default();
    for k in 0..REQUESTS {
        let number = w * 1_000_000 + k;
        let id = format!("rand-{number}");
        let total = rng.random_range(1..=8u32);
        let at = match rng.random_range(0..10) {
            0 => CancelAt::Before(rng.random_range(0..total)),
            1 => CancelAt::Holding(rng.random_range(0..total)),
            2 => CancelAt::AfterLast,
            _ => CancelAt::Never,
        };
        let req = s
            .begin(RequestSpec::new(&id, r.endpoint(), total as usize))
            .expect("begins");
        let mut next = 0;
        let mut cancel = None;
        while next < total {
            if matches!(at, CancelAt::Before(c) if c == next) {
                cancel = Some(req.cancel());
                break;
            }
            let n = rng.random_range(1..=(total - next).min(4));
            let mut batch = req
                .stage(n as usize, deadline())
                .unwrap_or_else(|e| panic!("thread {w}: {id}: staging {n} at chunk {next}: {e}"));
            let mut lens = Vec::with_capacity(n as usize);
            for (slot, i) in batch.slots_mut().zip(next..next + n) {
                let len = payloads().fill_slice(chunk_id(number, i, total), slot);
                lens.push(len as u32);
            }
            if matches!(at, CancelAt::Holding(c) if c == next) {
                cancel = Some(req.cancel());
                drop(batch);
                break;
            }
            if rng.random_bool(0.1) {
                // Filled and dropped: the slots go back, the chunks are
                // staged again.
                drop(batch);
                continue;
            }
            let keys: Vec<String> = (next..next + n)
                .map(|i| key(&id, number, i, total))
                .collect();
            batch
                .submit(&keys, &lens)
                .unwrap_or_else(|e| panic!("thread {w}: {id}: submit at chunk {next}: {e}"));
            next += n;
        }
        if matches!(at, CancelAt::AfterLast) {
            // Up to a few transfers' time later: before, during and
            // after the completion.
            let pause = std::time::Duration::from_micros(rng.random_range(0..3000));
            let t = std::time::Instant::now();
            while t.elapsed() < pause {
                std::hint::spin_loop();
            }
            cancel = Some(req.cancel());
        }
        let status = req.wait(deadline());
        match (status, cancel) {
            (RequestStatus::Completed, None | Some(false)) => {
                consume(r, &id, number, total).unwrap_or_else(|e| panic!("thread {w}: {e}"));
                ends.completed += 1;
                ends.lost += u64::from(cancel.is_some());
            }
            (RequestStatus::Cancelled, Some(true)) => ends.cancelled += 1,
            other => panic!("thread {w}: {id} ({at:?}) ended {other:?} (status, cancel won)"),
        }
    }
    ends
}

/// Runs [`THREADS`] threads of [`random_requests`] on one sender and one
/// receiver of 16 slots (three requests of 8 do not fit: admissions wait),
/// then checks that both ends hold nothing.
fn run(s: Sender, r: Receiver) {
    let (s, r) = (Arc::new(s), Arc::new(r));
    let ends = {
        let (s, r) = (Arc::clone(&s), Arc::clone(&r));
        process::on_threads(THREADS, "request thread", WAIT * 4, move |w| {
            random_requests(&s, &r, w)
        })
    };
    let completed: u64 = ends.iter().map(|e| e.completed).sum();
    let cancelled: u64 = ends.iter().map(|e| e.cancelled).sum();
    assert!(
        completed > 100 && cancelled > 10,
        "the steps did little: {ends:?}"
    );
    wait_sender_empty(&s, "after the random requests");
    wait_receiver_empty(&r, "after the random requests");
}

#[test]
fn random_concurrent_requests_over_shm_land_each_completed_one_byte_for_byte() {
    let r = Receiver::start(receiver_cfg(16)).expect("receiver starts");
    let s = sender(sender_cfg(8, None));
    run(s, r);
}

#[test]
fn random_concurrent_requests_over_tcp_land_each_completed_one_byte_for_byte() {
    let (r, s) = tcp_pair(16, 8);
    run(s, r);
}
