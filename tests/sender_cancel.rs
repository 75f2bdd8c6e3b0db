//! Cancelling a request at every stage of its life on the sender: not yet
//! sent, parked for admission at the receiver, blocked in a staging wait,
//! and with writes in flight. After each: no staging slot or pending byte
//! leaked, the receiver back to zero, status `Cancelled` on both sides, no
//! ProxyNotif, and a second request that reuses the capacity reads back
//! exactly its own bytes (no late write of the cancelled one landed in it).

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common_sender::*;
use kvferry::protocol::ErrorCode;
use kvferry::proxy::ProxyListener;
use kvferry::receiver::{Receiver, WaitError};
use kvferry::sender::{RequestStatus, Sender, StoreError};
use kvferry::transport::{FaultConfig, TransportConfig};

/// A transport config whose completions are held `ms` milliseconds, so
/// writes stay in flight (and their staging slots held) that long.
fn delayed(ms: u64) -> TransportConfig {
    TransportConfig {
        fault: Some(FaultConfig {
            delay: Duration::from_millis(ms),
            ..FaultConfig::default()
        }),
        ..TransportConfig::default()
    }
}

/// Records, when `req` reaches a terminal status, that status and how many
/// staging slots the sender still held at that moment (the CancelNotif has
/// just been sent then: every write of the request must have completed, so
/// with no other request holding staging this must be 0).
fn watch_terminal(s: &Arc<Sender>, req: &'static str) -> Watched {
    let slot = Arc::new(Mutex::new(None));
    let (weak, out) = (Arc::downgrade(s), Arc::clone(&slot));
    s.set_callback(move |r, status| {
        if r == req {
            let held = weak.upgrade().map_or(usize::MAX, |s| s.staging_in_use());
            *out.lock().unwrap() = Some((status.clone(), held));
        }
    });
    slot
}

type Watched = Arc<Mutex<Option<(RequestStatus, usize)>>>;

/// What [`watch_terminal`] recorded (waits for the callback, which runs
/// just after the status becomes visible).
fn watched_value(w: &Watched, req: &str) -> (RequestStatus, usize) {
    wait_for(&format!("the terminal callback of {req}"), || {
        w.lock().unwrap().is_some()
    });
    let v = w.lock().unwrap().clone();
    v.expect("checked above")
}

/// A second request reusing the receiver's capacity completes and its
/// decoder reads exactly its bytes.
fn reuse_capacity(s: &Sender, r: &Receiver, proxy: &ProxyListener, req: &str, n: u64, total: u32) {
    store_request(s, r.endpoint(), req, n, total, 4).unwrap();
    assert_eq!(terminal(s, req), RequestStatus::Completed, "{req}");
    proxy
        .wait_ready(req, 1, deadline())
        .unwrap_or_else(|e| panic!("ProxyNotif of {req}: {e}"));
    consume(r, req, n, total).unwrap_or_else(|e| panic!("{e}"));
}

/// The common checks after a cancel.
fn after_cancel(s: &Sender, r: &Receiver, proxy: &ProxyListener, req: &str, total: u32) {
    assert_eq!(terminal(s, req), RequestStatus::Cancelled, "{req}");
    wait_sender_empty(s, &format!("after cancelling {req}"));
    let prefix = format!("req {req} ");
    assert!(
        !s.dump().iter().any(|l| l.starts_with(&prefix)),
        "{req} is no longer active: {:?}",
        s.dump()
    );
    assert_eq!(proxy.count(req), 0, "no ProxyNotif for the cancelled {req}");
    assert!(
        !s.cancel_request(req),
        "a second cancel of {req} is refused"
    );
    assert!(
        matches!(
            store_batch(s, r.endpoint(), req, 999, total, 0..1),
            Err(StoreError::RequestEnded(RequestStatus::Cancelled))
        ),
        "store after the cancel of {req} is refused"
    );
}

#[test]
fn cancel_before_the_first_batch_was_sent() {
    // An LMCache-style receiver (no Hello answer) takes one request at a
    // time, so a second request stays entirely in the sender's pending area
    // while the first is open.
    let proxy = proxy();
    let mut rc = receiver_cfg(8);
    rc.answer_hello = false;
    let r = Receiver::start(rc).unwrap();
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(8, Some(&proxy));
    cfg.hello_timeout = Duration::from_millis(100);
    cfg.static_peers = vec![(ep.clone(), remote_buffer(&r))];
    let s = sender(cfg);
    store_batch(&s, &ep, "c0-open", 1, 4, 0..2).unwrap();
    store_request(&s, &ep, "c0-x", 2, 4, 2).unwrap();
    assert!(s.pending_bytes() > 0, "x waits in the pending area");
    wait_for("the open request admitted at the receiver", || {
        r.stats().core.requests_total.get("admitted").copied() == Some(1)
    });
    assert!(s.cancel_request("c0-x"));
    after_cancel(&s, &r, &proxy, "c0-x", 4);
    // The receiver never heard of it.
    let st = r.stats();
    assert_eq!(
        st.core.requests_total.get("admitted").copied(),
        Some(1),
        "{st:?}"
    );
    assert_eq!(st.core.requests_total.get("parked"), None, "{st:?}");
    // The open request finishes; then the capacity is reused.
    store_batch(&s, &ep, "c0-open", 1, 4, 2..4).unwrap();
    assert_eq!(terminal(&s, "c0-open"), RequestStatus::Completed);
    proxy.wait_ready("c0-open", 1, deadline()).unwrap();
    read_and_release(&r, "c0-open", 1, 4).unwrap();
    reuse_capacity(&s, &r, &proxy, "c0-y", 3, 8);
    wait_receiver_empty(&r, "LMCache-mode cancel before sending");
}

#[test]
fn cancel_while_parked_for_admission_with_batches_in_the_pending_area() {
    let proxy = proxy();
    let r = receiver(8);
    let ep = r.endpoint().to_owned();
    let s = sender(sender_cfg(8, Some(&proxy)));
    // Fill the receiver: complete but not consumed.
    store_request(&s, &ep, "c1-fill", 1, 8, 4).unwrap();
    assert_eq!(terminal(&s, "c1-fill"), RequestStatus::Completed);
    // Three batches: the first is parked at the receiver, the others wait
    // in the sender's pending area.
    store_request(&s, &ep, "c1-x", 2, 6, 2).unwrap();
    wait_for("c1-x parked at the receiver", || {
        r.stats().core.parked_requests == 1
    });
    assert!(s.pending_bytes() > 0, "later batches in the pending area");
    assert_eq!(s.staging_in_use(), 0, "a parked request holds no staging");
    assert!(s.cancel_request("c1-x"));
    after_cancel(&s, &r, &proxy, "c1-x", 6);
    assert_eq!(
        r.wait_ready("c1-x", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled)),
        "the receiver reports the same terminal status"
    );
    wait_for("the receiver to drop the parked request", || {
        let st = r.stats();
        st.core.parked_requests == 0 && st.core.tracked_requests == 0 && st.reserved_chunks == 0
    });
    consume(&r, "c1-fill", 1, 8).unwrap();
    wait_receiver_empty(&r, "after the filler was consumed");
    reuse_capacity(&s, &r, &proxy, "c1-y", 3, 8);
    wait_receiver_empty(&r, "after the reuse");
}

#[test]
fn cancel_wakes_a_store_blocked_in_the_staging_wait() {
    let proxy = proxy();
    let r = receiver(16);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(4, Some(&proxy));
    // Writes stay in flight for 1 s, holding all 4 staging slots.
    cfg.transport_config = delayed(1000);
    let s = Arc::new(sender(cfg));
    let watched = watch_terminal(&s, "c2-x");
    store_batch(&s, &ep, "c2-x", 1, 8, 0..4).unwrap();
    wait_for(
        "c2-x's first batch staged and posted (4 staging slots)",
        || s.staging_in_use() == 4,
    );
    // The request is admitted, so the next batch waits for staging slots.
    let blocked = {
        let (s, ep) = (Arc::clone(&s), ep.clone());
        std::thread::spawn(move || store_batch(&s, &ep, "c2-x", 1, 8, 4..8))
    };
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !blocked.is_finished(),
        "the second store should be blocked in the staging wait"
    );
    assert!(s.cancel_request("c2-x"));
    assert_eq!(
        join_within("the store blocked in the staging wait", blocked),
        Err(StoreError::Cancelled)
    );
    after_cancel(&s, &r, &proxy, "c2-x", 8);
    assert_eq!(
        watched_value(&watched, "cancelled request"),
        (RequestStatus::Cancelled, 0),
        "cancel fenced: no write of c2-x in flight when it was reported"
    );
    assert_eq!(
        r.wait_ready("c2-x", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled))
    );
    wait_receiver_empty(&r, "after the staging-wait cancel");
    reuse_capacity(&s, &r, &proxy, "c2-y", 2, 4);
    wait_receiver_empty(&r, "after the reuse");
}

#[test]
fn staging_timeout_when_no_slot_frees_in_time() {
    let r = receiver(16);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(4, None);
    cfg.transport_config = delayed(1000);
    cfg.staging_timeout = Duration::from_millis(50);
    let s = sender(cfg);
    store_batch(&s, &ep, "st-x", 1, 8, 0..4).unwrap();
    wait_for("st-x's first batch staged and posted", || {
        s.staging_in_use() == 4
    });
    assert_eq!(
        store_batch(&s, &ep, "st-x", 1, 8, 4..8),
        Err(StoreError::StagingTimeout)
    );
    // The refused batch was not counted: storing it again completes the
    // request.
    store_batch(&s, &ep, "st-x", 1, 8, 4..8).unwrap_or_else(|e| {
        // A slow machine may time out again; then wait for the slots first.
        assert_eq!(e, StoreError::StagingTimeout);
        wait_for("st-x's first writes to complete", || {
            s.staging_in_use() == 0
        });
        store_batch(&s, &ep, "st-x", 1, 8, 4..8).unwrap();
    });
    assert_eq!(terminal(&s, "st-x"), RequestStatus::Completed);
    consume(&r, "st-x", 1, 8).unwrap();
    wait_sender_empty(&s, "after the staging timeout");
    wait_receiver_empty(&r, "after the staging timeout");
}

#[test]
fn cancel_with_writes_in_flight_is_fenced() {
    let proxy = proxy();
    let r = receiver(8);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(8, Some(&proxy));
    cfg.transport_config = delayed(300);
    let s = Arc::new(sender(cfg));
    let watched = watch_terminal(&s, "c3-x");
    store_request(&s, &ep, "c3-x", 1, 8, 4).unwrap();
    wait_for(
        "c3-x's writes posted (staging held by in-flight writes)",
        || s.staging_in_use() > 0,
    );
    assert!(s.cancel_request("c3-x"));
    after_cancel(&s, &r, &proxy, "c3-x", 8);
    assert_eq!(
        watched_value(&watched, "cancelled request"),
        (RequestStatus::Cancelled, 0),
        "CancelNotif only after every in-flight write of c3-x completed"
    );
    assert_eq!(
        r.wait_ready("c3-x", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled))
    );
    wait_receiver_empty(&r, "after the in-flight cancel");
    // Capacity 8: the next request gets the very slots c3-x was writing.
    reuse_capacity(&s, &r, &proxy, "c3-y", 2, 8);
    wait_receiver_empty(&r, "after the reuse");
}

/// Cancels racing ctrl's completion of one-chunk requests, from several
/// threads at once, through the handle (`Request::cancel`) and by id
/// (`Sender::cancel_request`), at delays spread around the moment the
/// request completes (learnt from the rounds before). Per request: at most one cancel returns true; if one
/// did, the request ends `Cancelled` (never `Completed`: the cancel won),
/// and if none did it ends `Completed` (a cancel that lost changed
/// nothing); it always ends (a cancel that won is never lost). Bounded:
/// 400 rounds, every wait with a deadline.
#[test]
fn a_cancel_racing_completion_wins_exactly_when_it_returns_true() {
    const ROUNDS: u64 = 400;
    const CANCELLERS: u64 = 3;
    let r = receiver(ROUNDS as usize);
    let ep = r.endpoint().to_owned();
    let s = Arc::new(sender(sender_cfg(8, None)));
    let (mut cancelled, mut completed) = (0, 0);
    // How long a request takes from its store to its end, learnt from the
    // completed rounds: the cancels aim around it (no assertion on time).
    let mut takes = Duration::from_millis(1);
    for round in 0..ROUNDS {
        let id = format!("race-{round}");
        let req = s
            .begin(kvferry::sender::RequestSpec::new(&id, &ep, 1))
            .unwrap();
        let mut bytes = Vec::new();
        payloads().fill(chunk_id(round, 0, 1), &mut bytes);
        let stored = std::time::Instant::now();
        req.store(&[key(&id, round, 0, 1)], &[&bytes[..]]).unwrap();
        let cancellers: Vec<_> = (0..CANCELLERS)
            .map(|j| {
                let (s, req, id) = (Arc::clone(&s), req.clone(), id.clone());
                // 70..130 % of the learnt time: just before, at and just
                // after the completion.
                let delay = takes.mul_f64(0.7 + 0.06 * ((round * 7 + j * 3) % 11) as f64);
                std::thread::spawn(move || {
                    while stored.elapsed() < delay {
                        std::thread::yield_now();
                    }
                    if j % 2 == 0 {
                        req.cancel()
                    } else {
                        s.cancel_request(&id)
                    }
                })
            })
            .collect();
        let status = req.wait(deadline());
        let took = stored.elapsed();
        let won = cancellers
            .into_iter()
            .map(|h| join_within("a cancelling thread", h))
            .filter(|&w| w)
            .count();
        if status == RequestStatus::Completed {
            takes = (takes * 3 + took) / 4;
        }
        assert!(
            status.is_terminal(),
            "{id} never ended (a cancel lost?), {won} cancels won; sender: {:?}",
            s.dump()
        );
        assert_eq!(s.status(&id), Some(status.clone()), "{id}: by id too");
        match won {
            0 => {
                assert_eq!(status, RequestStatus::Completed, "{id}: no cancel won");
                consume(&r, &id, round, 1).unwrap_or_else(|e| panic!("{e}"));
                completed += 1;
            }
            1 => {
                assert_eq!(status, RequestStatus::Cancelled, "{id}: a cancel won");
                cancelled += 1;
            }
            n => panic!("{id}: {n} cancels all returned true"),
        }
    }
    eprintln!(
        "{cancelled} cancelled, {completed} completed of {ROUNDS} (a request took {takes:?})"
    );
    wait_sender_empty(&s, "after the cancel races");
    wait_receiver_empty(&r, "after the cancel races");
}
