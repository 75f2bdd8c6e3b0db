//! Admission, parking, cancel and lease paths of the receiver over the wire:
//! the seed's example, FIFO parking that blocks neither another sender nor
//! the same sender's admitted request, admission timeout, cancel of parked
//! and admitted requests, lease expiry, and fenced reuse of the slots of a
//! failed request (quarantine until the fence or `quarantine_grace`).
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::time::Duration;

use common::*;
use kvferry::protocol::ErrorCode;
use kvferry::receiver::{ReceiverConfig, WaitError};

/// Consumes `ks` like a decoder: borrow each key and drop the borrow.
fn consume(r: &kvferry::receiver::Receiver, ks: &[String]) {
    for k in ks {
        assert!(r.get(k).is_some(), "{k} should be readable");
    }
}

#[test]
fn seed_example_b_is_answered_only_after_a_is_done_and_freed() {
    // Buffer 10, A needs 8, B needs 8.
    let r = start(config(10));
    let a = Client::connect(r.endpoint(), "seed-a");
    let b = Client::connect(r.endpoint(), "seed-b");
    let wa = Writer::from_ack(&a.hello());
    b.hello();
    let ka = keys("a", 8);
    let sa1 = assert_ok(&a.call(&alloc("A", &ka[..4], 8, false, Some(1)), "A b1"), 4);
    b.send(&alloc("B", &keys("b", 4), 8, false, Some(1)));
    wait_stats(&r, "B parked", |s| s.core.parked_requests == 1);
    let sa2 = assert_ok(&a.call(&alloc("A", &ka[4..], 8, true, Some(2)), "A b2"), 4);
    for (k, s) in ka.iter().zip(sa1.iter().chain(&sa2)) {
        wa.write(*s, &pattern(k));
    }
    a.send(&transfer_done("A"));
    r.wait_ready("A", deadline()).expect("A ready");
    assert_eq!(r.stats().core.parked_requests, 1, "A done but not freed");
    assert!(!b.has_pending());
    // B fits once A holds at most 2 slots: after the 6th key is consumed.
    for (i, k) in ka.iter().enumerate() {
        {
            let chunk = r.get(k).unwrap_or_else(|| panic!("{k} readable"));
            assert_eq!(&chunk.bytes()[..16], &pattern(k));
        }
        let s = r.stats();
        if i < 5 {
            assert_eq!(s.core.parked_requests, 1, "after {} frees: {s:?}", i + 1);
            assert!(!b.has_pending(), "B answered after only {} frees", i + 1);
        } else if i == 5 {
            assert_eq!(s.core.parked_requests, 0, "B admitted: {s:?}");
            let rb = b.recv_reply(deadline(), "B's first batch after A was freed");
            assert_eq!(rb.seq, Some(1));
            assert_ok(&rb, 4);
        }
    }
    let rb2 = b.call(&alloc("B", &keys("c", 4), 8, true, Some(2)), "B b2");
    assert_ok(&rb2, 4);
    b.send(&transfer_done("B"));
    r.wait_ready("B", deadline()).expect("B ready");
    consume(&r, &keys("b", 4));
    consume(&r, &keys("c", 4));
    assert_idle(&r);
    // The admission wait of B was recorded next to A's (zero) wait.
    assert_eq!(r.admission_wait().count, 2);
}

#[test]
fn a_parked_request_does_not_block_another_sender() {
    let r = start(config(8));
    let a = Client::connect(r.endpoint(), "fifo-a");
    let b = Client::connect(r.endpoint(), "fifo-b");
    a.hello();
    b.hello();
    assert_ok(
        &b.call(&alloc("B1", &keys("b", 2), 4, false, Some(1)), "B1 b1"),
        2,
    );
    a.send(&alloc("A1", &keys("a", 2), 6, false, Some(1)));
    wait_stats(&r, "A1 parked", |s| s.core.parked_requests == 1);
    // B's admitted request proceeds while A1 waits.
    assert_ok(
        &b.call(&alloc("B1", &keys("c", 2), 4, true, Some(2)), "B1 b2"),
        2,
    );
    // A new request of B queues behind A1 (FIFO: no starvation of the big one).
    b.send(&alloc("B2", &keys("d", 1), 1, true, Some(3)));
    wait_stats(&r, "B2 parked behind A1", |s| s.core.parked_requests == 2);
    b.send(&transfer_done("B1"));
    r.wait_ready("B1", deadline()).expect("B1 ready");
    assert!(!a.has_pending() && !b.has_pending());
    consume(&r, &keys("b", 2));
    consume(&r, &keys("c", 2));
    // Both fit now and are granted in FIFO order.
    let ra = a.recv_reply(deadline(), "A1 after B1 was consumed");
    assert_eq!(ra.seq, Some(1));
    assert_ok(&ra, 2);
    let rb = b.recv_reply(deadline(), "B2 after A1");
    assert_eq!(rb.seq, Some(3));
    assert_ok(&rb, 1);
    assert_ok(
        &a.call(&alloc("A1", &keys("e", 4), 6, true, Some(2)), "A1 b2"),
        4,
    );
    a.send(&transfer_done("A1"));
    b.send(&transfer_done("B2"));
    r.wait_ready("A1", deadline()).expect("A1 ready");
    r.wait_ready("B2", deadline()).expect("B2 ready");
    consume(&r, &keys("a", 2));
    consume(&r, &keys("e", 4));
    consume(&r, &keys("d", 1));
    assert_idle(&r);
    let s = r.stats();
    assert_eq!(s.core.requests_total.get("parked"), Some(&2));
    assert_eq!(s.core.requests_total.get("admitted"), Some(&3));
    assert_eq!(s.core.requests_total.get("completed"), Some(&3));
}

#[test]
fn a_parked_request_does_not_block_the_same_senders_admitted_request() {
    let r = start(config(8));
    let c = Client::connect(r.endpoint(), "pipelined");
    c.hello();
    assert_ok(
        &c.call(&alloc("R1", &keys("x", 2), 6, false, Some(1)), "R1 b1"),
        2,
    );
    c.send(&alloc("R2", &keys("y", 2), 4, false, Some(2)));
    wait_stats(&r, "R2 parked", |s| s.core.parked_requests == 1);
    // With seq, the reply to R1's next batch overtakes R2's pending one.
    c.send(&alloc("R1", &keys("x2-", 4), 6, true, Some(3)));
    let rep = c.recv_reply(deadline(), "R1's second batch while R2 is parked");
    assert_eq!(rep.seq, Some(3), "R1's reply comes first");
    assert_ok(&rep, 4);
    c.send(&transfer_done("R1"));
    r.wait_ready("R1", deadline()).expect("R1 ready");
    consume(&r, &keys("x", 2));
    let rep = c.recv_reply(deadline(), "R2 after R1 was consumed");
    assert_eq!(rep.seq, Some(2));
    assert_ok(&rep, 2);
    consume(&r, &keys("x2-", 4));
    assert_ok(
        &c.call(&alloc("R2", &keys("y2-", 2), 4, true, Some(4)), "R2 b2"),
        2,
    );
    c.send(&transfer_done("R2"));
    r.wait_ready("R2", deadline()).expect("R2 ready");
    consume(&r, &keys("y", 2));
    consume(&r, &keys("y2-", 2));
    assert_idle(&r);
}

#[test]
fn parked_request_times_out() {
    let mut cfg = config(4);
    cfg.admission_timeout = Duration::from_millis(100);
    let r = start(cfg);
    let a = Client::connect(r.endpoint(), "holder");
    let b = Client::connect(r.endpoint(), "waiter");
    assert_ok(
        &a.call(&alloc("H", &keys("h", 1), 4, false, None), "holder"),
        1,
    );
    // Two pipelined batches of a request that cannot fit while H holds the buffer.
    b.send(&alloc("W", &keys("w", 1), 2, false, Some(1)));
    b.send(&alloc("W", &keys("v", 1), 2, true, Some(2)));
    let r1 = b.recv_reply(deadline(), "W's first batch to time out");
    let r2 = b.recv_reply(deadline(), "W's second batch to time out");
    assert_failure(&r1, ErrorCode::AdmissionTimeout, 1);
    assert_failure(&r2, ErrorCode::AdmissionTimeout, 1);
    assert_eq!((r1.seq, r2.seq), (Some(1), Some(2)), "answered in order");
    assert_eq!(
        r.wait_ready("W", deadline()),
        Err(WaitError::Failed(ErrorCode::AdmissionTimeout))
    );
    // A later batch of the timed-out request gets the same error.
    let late = b.call(&alloc("W", &keys("u", 1), 2, true, Some(3)), "W late");
    assert_failure(&late, ErrorCode::AdmissionTimeout, 1);
    let s = r.stats();
    assert_eq!(s.core.parked_requests, 0);
    assert_eq!(s.reserved_chunks, 3, "H's reservation is untouched");
    assert_eq!(s.core.requests_total.get("admission_timeout"), Some(&1));
    assert_eq!(s.core.errors_total.get("admission_timeout"), Some(&3));
    assert_ok(
        &a.call(&alloc("H", &keys("i", 3), 4, true, None), "holder b2"),
        3,
    );
    consume(&r, &keys("h", 1));
    consume(&r, &keys("i", 3));
    assert_idle(&r);
}

#[test]
fn cancel_answers_the_parked_batches() {
    let r = start(config(4));
    let a = Client::connect(r.endpoint(), "holder");
    let b = Client::connect(r.endpoint(), "cancelled");
    assert_ok(
        &a.call(&alloc("H", &keys("h", 4), 4, true, None), "holder"),
        4,
    );
    b.send(&alloc("C", &keys("c", 1), 2, false, Some(1)));
    b.send(&alloc("C", &keys("d", 1), 2, true, Some(2)));
    wait_stats(&r, "C parked", |s| s.core.parked_requests == 1);
    b.send(&cancel("C", &[], Some(3)));
    let r1 = b.recv_reply(deadline(), "C's first parked batch");
    let r2 = b.recv_reply(deadline(), "C's second parked batch");
    let r3 = b.recv_reply(deadline(), "the cancel's reply");
    assert_failure(&r1, ErrorCode::Cancelled, 1);
    assert_failure(&r2, ErrorCode::Cancelled, 1);
    assert_eq!((r1.seq, r2.seq), (Some(1), Some(2)));
    assert!(r3.remote_indexes.is_empty() && !r3.is_failure(), "{r3:?}");
    assert_eq!(r3.seq, Some(3));
    assert_eq!(
        r.wait_ready("C", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled))
    );
    consume(&r, &keys("h", 4));
    assert_idle(&r);
    assert_eq!(r.stats().core.requests_total.get("cancelled"), Some(&1));
    assert_eq!(r.stats().core.errors_total.get("cancelled"), Some(&2));
}

#[test]
fn kvferry_cancel_of_an_admitted_request_frees_at_once() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "kv");
    c.hello();
    assert_ok(
        &c.call(&alloc("K", &keys("k", 2), 4, false, None), "K b1"),
        2,
    );
    let ack = c.call(&cancel("K", &keys("k", 2), Some(7)), "K cancel");
    assert!(ack.remote_indexes.is_empty() && !ack.is_failure());
    assert_eq!(ack.seq, Some(7));
    // A kvferry sender cancels only after its writes completed: no quarantine.
    assert_idle(&r);
    assert_eq!(
        r.wait_ready("K", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled))
    );
    assert!(r.get("k0").is_none());
}

#[test]
fn lmcache_cancel_quarantines_granted_slots_until_the_grace() {
    let mut cfg = config(4);
    cfg.quarantine_grace = Duration::from_millis(150);
    let r = start(cfg);
    let c = Client::connect(r.endpoint(), "lmcache");
    assert_ok(
        &c.call(&alloc("L", &keys("l", 2), 4, false, None), "L b1"),
        2,
    );
    let ack = c.call(&cancel("L", &keys("l", 2), None), "L cancel");
    assert!(ack.remote_indexes.is_empty() && !ack.is_failure());
    // An LMCache sender promises no fence: its writes may still land.
    let s = r.stats();
    assert_eq!(s.reserved_chunks, 0, "{s:?}");
    assert_eq!(s.core.keys, 0, "{s:?}");
    assert_eq!(s.core.quarantined_slots, 2, "{s:?}");
    assert_eq!(s.allocated_chunks, 2, "{s:?}");
    // The quarantined slots are not handed to the next request: it parks...
    c.send(&alloc("M", &keys("m", 1), 4, true, Some(1)));
    wait_stats(&r, "M parked behind the quarantine", |s| {
        s.core.parked_requests == 1
    });
    // ...and is admitted once the grace passes.
    let rep = c.recv_reply(deadline(), "M after the quarantine grace");
    assert_ok(&rep, 1);
    let s = r.stats();
    assert_eq!(s.core.quarantined_slots, 0, "{s:?}");
    consume(&r, &keys("m", 1));
    assert_idle(&r);
}

#[test]
fn lease_expiry_rolls_back_and_fences() {
    let mut cfg = config(4);
    cfg.lease = Duration::from_millis(100);
    let r = start(cfg);
    let c = Client::connect(r.endpoint(), "silent");
    c.hello();
    assert_ok(
        &c.call(&alloc("S", &keys("s", 2), 4, false, Some(1)), "S b1"),
        2,
    );
    // The sender goes silent: no batch, heartbeat or TransferDone.
    assert_eq!(
        r.wait_ready("S", deadline()),
        Err(WaitError::Failed(ErrorCode::LeaseExpired))
    );
    let s = r.stats();
    assert_eq!(s.reserved_chunks, 0, "reservation released: {s:?}");
    assert_eq!(s.core.tracked_requests, 0);
    assert_eq!(
        s.core.quarantined_slots, 2,
        "granted slots fenced (grace 60 s): {s:?}"
    );
    assert_eq!(s.core.requests_total.get("lease_expired"), Some(&1));
    // Later batches of the expired request get lease_expired.
    let late = c.call(&alloc("S", &keys("t", 2), 4, true, Some(2)), "S late");
    assert_failure(&late, ErrorCode::LeaseExpired, 2);
    assert_eq!(late.seq, Some(2));
    // The sender's fence returns the slots.
    c.call(&cancel("S", &[], None), "S fence");
    assert_idle(&r);
}

#[test]
fn lease_expiry_capacity_returns_after_the_quarantine_grace() {
    let mut cfg = config(4);
    cfg.lease = Duration::from_millis(100);
    cfg.quarantine_grace = Duration::from_millis(100);
    let r = start(cfg);
    let c = Client::connect(r.endpoint(), "dead-lmcache");
    assert_ok(
        &c.call(&alloc("D", &keys("d", 3), 4, false, None), "D b1"),
        3,
    );
    assert_eq!(
        r.wait_ready("D", deadline()),
        Err(WaitError::Failed(ErrorCode::LeaseExpired))
    );
    // No fence ever comes: the grace alone gives the capacity back.
    wait_stats(&r, "quarantine released after the grace", |s| {
        s.allocated_chunks == 0 && s.core.quarantined_slots == 0
    });
    assert_idle(&r);
    // The whole buffer is usable again.
    assert_ok(&c.call(&alloc("E", &keys("e", 4), 4, true, None), "E"), 4);
    consume(&r, &keys("e", 4));
    assert_idle(&r);
}

/// Issue 12: `--consume` with LMCache senders (no Hello, so no
/// TransferDone). Two senders alternate requests that each take most of
/// the buffer, so every other request parks behind the previous one; each
/// is admitted once its predecessor's grace has passed, and none ends in
/// `admission_timeout` — although that timeout is far shorter than the run.
#[test]
fn consume_with_lmcache_senders_never_times_out() {
    const ROUNDS: usize = 20;
    let r = start(ReceiverConfig {
        auto_consume: true,
        consume_grace: Duration::from_millis(20),
        admission_timeout: Duration::from_secs(5),
        ..config(4)
    });
    let senders = [
        Client::connect(r.endpoint(), "lmc-consume-a"),
        Client::connect(r.endpoint(), "lmc-consume-b"),
    ];
    for round in 0..ROUNDS {
        // Both first batches go out before either is answered: the second
        // one parks (3 + 3 > 4).
        let ids = [format!("c{round}-a"), format!("c{round}-b")];
        for (s, id) in senders.iter().zip(&ids) {
            s.send(&alloc(id, &keys(&format!("{id}-"), 3), 3, true, None));
        }
        for (s, id) in senders.iter().zip(&ids) {
            let rep = s.recv_reply(deadline(), &format!("{id}'s only batch"));
            assert_lmcache_accepts(3, &rep);
            assert_ok(&rep, 3);
        }
    }
    let s = r.stats();
    assert_eq!(
        s.core.requests_total.get("completed").copied(),
        Some(2 * ROUNDS as u64),
        "{s:?}"
    );
    assert!(
        s.core.requests_total.get("parked").copied().unwrap_or(0) >= ROUNDS as u64,
        "the second request of each round parked: {s:?}"
    );
    assert_eq!(s.core.requests_total.get("admission_timeout"), None);
    wait_stats(&r, "the last requests consumed", |s| {
        s.allocated_chunks == 0
    });
    assert_idle(&r);
}
