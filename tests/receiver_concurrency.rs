//! Concurrency: 4 kvferry clients x 100 requests of random sizes (1..=12
//! chunks, batches of 1..=4, capacity 32) with ~10% random cancels (some
//! after a reply — fenced — some pipelined right behind a batch), a decoder
//! thread consuming every completed request, and a Prometheus scrape at the
//! end: nothing is left reserved, allocated, tracked, parked or quarantined,
//! and the metrics say so.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rand::{Rng, SeedableRng};

use common::*;
use kvferry::metrics::MetricsServer;
use kvferry::protocol::{AllocResponse, ErrorCode};
use kvferry::receiver::Receiver;

const CLIENTS: usize = 4;
const REQUESTS: usize = 100;
const CAPACITY: usize = 32;

#[derive(Debug, Default)]
struct Tally {
    completed: u64,
    cancelled: u64,
    /// Pipelined cancels whose batch was still parked (answered `cancelled`).
    cancelled_parked: u64,
}

/// Waits for the replies with the given seqs (any order).
fn replies_for(c: &Client, seqs: &[u64], what: &str) -> HashMap<u64, AllocResponse> {
    let mut got = HashMap::new();
    while got.len() < seqs.len() {
        let rep = c.recv_reply(deadline(), what);
        let seq = rep
            .seq
            .unwrap_or_else(|| panic!("{what}: reply without seq {rep:?}"));
        assert!(seqs.contains(&seq), "{what}: unexpected seq {seq}");
        assert!(
            got.insert(seq, rep).is_none(),
            "{what}: seq {seq} answered twice"
        );
    }
    got
}

fn run_client(r: &Receiver, id: usize, done: mpsc::Sender<(String, Vec<String>)>) -> Tally {
    let c = Client::connect(r.endpoint(), &format!("client-{id}"));
    let w = Writer::from_ack(&c.hello());
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + id as u64);
    let mut seq = 0u64;
    let mut tally = Tally::default();
    for j in 0..REQUESTS {
        let req = format!("c{id}-r{j}");
        let n = rng.random_range(1..=12usize);
        let ks = keys(&format!("{req}-"), n);
        let mut batches = Vec::new();
        let mut at = 0;
        while at < n {
            let b = rng.random_range(1..=4usize).min(n - at);
            batches.push(at..at + b);
            at += b;
        }
        // ~10% cancelled, at a random batch; half of those pipelined.
        let cancel_at = rng
            .random_bool(0.1)
            .then(|| (rng.random_range(0..batches.len()), rng.random_bool(0.5)));
        let mut ended = false;
        for (bi, range) in batches.iter().enumerate() {
            let last = bi + 1 == batches.len();
            seq += 1;
            let bseq = seq;
            c.send(&alloc(&req, &ks[range.clone()], n as i64, last, Some(bseq)));
            match cancel_at {
                Some((at, true)) if at == bi => {
                    seq += 1;
                    c.send(&cancel(&req, &ks[..range.end], Some(seq)));
                    let what = format!("{req}: batch {bi} + pipelined cancel");
                    let got = replies_for(&c, &[bseq, seq], &what);
                    let b = &got[&bseq];
                    if b.is_failure() {
                        assert_eq!(b.error_code(), Some(ErrorCode::Cancelled), "{what}: {b:?}");
                        tally.cancelled_parked += 1;
                    } else {
                        assert_eq!(b.remote_indexes.len(), range.len(), "{what}");
                    }
                    assert!(got[&seq].remote_indexes.is_empty(), "{what}");
                    ended = true;
                }
                _ => {
                    let what = format!("{req}: batch {bi}");
                    let rep = replies_for(&c, &[bseq], &what).remove(&bseq).unwrap();
                    let slots = assert_ok(&rep, range.len());
                    assert!(
                        rep.already_sent_indexes.is_empty(),
                        "{what}: keys are unique"
                    );
                    for (k, s) in ks[range.clone()].iter().zip(slots) {
                        w.write(s, &pattern(k));
                    }
                    if cancel_at == Some((bi, false)) {
                        // Fenced: the writes of every granted batch are done.
                        seq += 1;
                        c.send(&cancel(&req, &ks[..range.end], Some(seq)));
                        let got = replies_for(&c, &[seq], &format!("{req}: cancel"));
                        assert!(got[&seq].remote_indexes.is_empty());
                        ended = true;
                    }
                }
            }
            if ended {
                break;
            }
        }
        if ended {
            tally.cancelled += 1;
        } else {
            c.send(&transfer_done(&req));
            tally.completed += 1;
            done.send((req, ks)).expect("decoder alive");
        }
    }
    assert!(!c.has_pending(), "client {id}: stray reply");
    tally
}

#[test]
fn four_clients_random_sizes_and_cancels_leave_nothing_behind() {
    let mut cfg = config(CAPACITY);
    cfg.quarantine_grace = Duration::from_millis(50);
    let r = Arc::new(start(cfg));
    let metrics = {
        // Weak: a connection thread still finishing the scrape must not keep
        // the receiver (and its buffer file) alive past the test.
        let r = Arc::downgrade(&r);
        MetricsServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), move || {
            r.upgrade().map(|r| r.render_metrics()).unwrap_or_default()
        })
        .expect("metrics server")
    };
    let (tx, rx) = mpsc::channel::<(String, Vec<String>)>();
    let decoder = {
        let r = Arc::clone(&r);
        thread::spawn(move || {
            let mut consumed = 0u64;
            for (req, ks) in rx {
                r.wait_ready(&req, deadline())
                    .unwrap_or_else(|e| panic!("decoder: {req} not ready: {e}"));
                for k in &ks {
                    let chunk = r.get(k).unwrap_or_else(|| panic!("decoder: {k} readable"));
                    assert_eq!(&chunk.bytes()[..16], &pattern(k), "decoder: bytes of {k}");
                }
                consumed += 1;
            }
            consumed
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let r = Arc::clone(&r);
            let tx = tx.clone();
            thread::spawn(move || run_client(&r, id, tx))
        })
        .collect();
    drop(tx);
    let mut total = Tally::default();
    for (id, h) in clients.into_iter().enumerate() {
        let t = h
            .join()
            .unwrap_or_else(|_| panic!("client {id} failed (see its panic above)"));
        total.completed += t.completed;
        total.cancelled += t.cancelled;
        total.cancelled_parked += t.cancelled_parked;
    }
    let consumed = decoder.join().expect("decoder thread");
    assert_eq!(consumed, total.completed);
    assert_eq!(
        total.completed + total.cancelled,
        (CLIENTS * REQUESTS) as u64
    );
    assert!(total.cancelled > 0, "the seeds produce cancels");

    eprintln!(
        "tally {total:?}; receiver counters {:?}",
        r.stats().core.requests_total
    );
    wait_stats(&r, "receiver idle after every request", |s| {
        s.reserved_chunks == 0 && s.allocated_chunks == 0 && s.core.tracked_requests == 0
    });
    assert_idle(&r);
    let s = r.stats();
    let get = |m: &std::collections::BTreeMap<&str, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    assert_eq!(get(&s.core.requests_total, "completed"), total.completed);
    assert_eq!(get(&s.core.requests_total, "cancelled"), total.cancelled);
    assert_eq!(
        get(&s.core.errors_total, "cancelled"),
        total.cancelled_parked
    );
    assert_eq!(
        get(&s.core.requests_total, "admitted"),
        total.completed + total.cancelled - total.cancelled_parked
    );

    // One refused request so the error counter family has a sample.
    let c = Client::connect(r.endpoint(), "last");
    let rep = c.call(&alloc("zero", &keys("z", 1), 0, true, None), "zero total");
    assert_failure(&rep, ErrorCode::ZeroTotalChunks, 1);

    let body = scrape(metrics.local_addr());
    let m = |name: &str| {
        metric(&body, name).unwrap_or_else(|| panic!("metric {name} missing in:\n{body}"))
    };
    assert_eq!(m("kvferry_receiver_capacity_chunks"), CAPACITY as f64);
    assert_eq!(m("kvferry_receiver_reserved_chunks"), 0.0);
    assert_eq!(m("kvferry_receiver_allocated_chunks"), 0.0);
    assert_eq!(m("kvferry_receiver_parked_requests"), 0.0);
    assert_eq!(m("kvferry_receiver_tracked_requests"), 0.0);
    assert_eq!(m("kvferry_receiver_keys"), 0.0);
    assert_eq!(m("kvferry_receiver_quarantined_slots"), 0.0);
    assert_eq!(
        m("kvferry_receiver_requests_total{outcome=\"completed\"}"),
        total.completed as f64
    );
    assert_eq!(
        m("kvferry_receiver_requests_total{outcome=\"cancelled\"}"),
        total.cancelled as f64
    );
    assert_eq!(
        m("kvferry_receiver_errors_total{code=\"zero_total_chunks\"}"),
        1.0
    );
    assert_eq!(m("kvferry_receiver_bad_frames_total"), 0.0);
    let admitted = get(&s.core.requests_total, "admitted") as f64;
    assert_eq!(
        m("kvferry_receiver_admission_wait_us_bucket{le=\"+Inf\"}"),
        admitted
    );
    assert_eq!(m("kvferry_receiver_admission_wait_us_count"), admitted);
    assert!(body.contains("# TYPE kvferry_receiver_admission_wait_us histogram"));
    assert!(metric(&body, "kvferry_receiver_admission_wait_us_sum").is_some());
    metrics.shutdown();
    let shm = r.shm_path().to_owned();
    let r = Arc::try_unwrap(r).expect("the test holds the last reference");
    r.shutdown();
    assert!(!shm.exists(), "buffer file {} removed", shm.display());
}
