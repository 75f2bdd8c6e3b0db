//! Sender behaviour under faults and misuse: injected write failures,
//! LMCache-style receivers (no `Hello` answer) with and without a static
//! buffer descriptor, back-pressure of the pending area, every validation
//! error of `store`, and `close` with requests in flight.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common_sender::*;
use kvferry::protocol::ErrorCode;
use kvferry::receiver::{Receiver, WaitError};
use kvferry::sender::{RequestStatus, Sender, SenderError, StoreError, TransferSpec};
use kvferry::transport::{FaultConfig, TransportConfig, TransportError};

fn faulty(fault: FaultConfig) -> TransportConfig {
    TransportConfig {
        fault: Some(fault),
        ..TransportConfig::default()
    }
}

fn failed_code(st: &RequestStatus) -> Option<ErrorCode> {
    match st {
        RequestStatus::Failed { code, .. } => Some(*code),
        _ => None,
    }
}

#[test]
fn injected_write_failures_fail_only_their_request() {
    let proxy = proxy();
    let r = receiver(64);
    let ep = r.endpoint().to_owned();
    // s1: exactly its first write fails; s2: every write fails; s3: clean.
    let mut c1 = sender_cfg(8, Some(&proxy));
    c1.transport_config = faulty(FaultConfig {
        fail_work_ids: vec![1],
        seed: 1,
        ..FaultConfig::default()
    });
    let mut c2 = sender_cfg(8, Some(&proxy));
    c2.transport_config = faulty(FaultConfig {
        fail_rate: 1.0,
        seed: 2,
        ..FaultConfig::default()
    });
    let (s1, s2, s3) = (sender(c1), sender(c2), sender(sender_cfg(8, Some(&proxy))));

    // One batch each: a failed write aborts the request at once, so a later
    // batch is refused with StoreError::RequestEnded (the failure).
    store_request(&s1, &ep, "wf-1a", 1, 8, 8).unwrap();
    store_request(&s2, &ep, "wf-2a", 2, 8, 8).unwrap();
    store_request(&s3, &ep, "wf-3a", 3, 8, 4).unwrap();
    for (s, req) in [(&s1, "wf-1a"), (&s2, "wf-2a")] {
        let st = terminal(s, req);
        assert_eq!(
            failed_code(&st),
            Some(ErrorCode::WriteFailed),
            "{req}: {st:?}"
        );
        assert!(
            matches!(&st, RequestStatus::Failed { reason, .. } if reason.contains("write failed")),
            "{req}: the reason says why: {st:?}"
        );
        assert!(
            matches!(r.wait_ready(req, deadline()), Err(WaitError::Failed(_))),
            "the receiver ended {req} without data"
        );
    }
    // The clean sender's request, and s1's next request (later work ids),
    // are unaffected.
    store_request(&s1, &ep, "wf-1b", 4, 8, 4).unwrap();
    for (s, req, n) in [(&s3, "wf-3a", 3), (&s1, "wf-1b", 4)] {
        assert_eq!(terminal(s, req), RequestStatus::Completed, "{req}");
        proxy.wait_ready(req, 1, deadline()).unwrap();
        consume(&r, req, n, 8).unwrap_or_else(|e| panic!("{e}"));
    }
    for s in [&s1, &s2, &s3] {
        wait_sender_empty(s, "after the write failures");
    }
    wait_receiver_empty(&r, "after the write failures");
    assert_eq!(
        proxy.count("wf-1a"),
        0,
        "no ProxyNotif for a failed request"
    );
    assert_eq!(
        proxy.count("wf-2a"),
        0,
        "no ProxyNotif for a failed request"
    );
    assert_eq!(proxy.totals(), (2, 0));
}

/// An LMCache-style receiver: ignores `Hello`.
fn lmcache_receiver(capacity: usize) -> Receiver {
    let mut rc = receiver_cfg(capacity);
    rc.answer_hello = false;
    Receiver::start(rc).unwrap()
}

#[test]
fn lmcache_receiver_with_a_static_peer_works_one_request_at_a_time() {
    let proxy = proxy();
    let r = lmcache_receiver(32);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(8, Some(&proxy));
    cfg.hello_timeout = Duration::from_millis(100);
    cfg.static_peers = vec![(ep.clone(), remote_buffer(&r))];
    let s = sender(cfg);
    let reqs: Vec<(String, u64)> = (0..6u64).map(|n| (format!("lm-{n}"), n)).collect();
    // All stored at once; the sender serialises them for this receiver.
    for (id, n) in &reqs {
        store_request(&s, &ep, id, *n, 6, 2).unwrap();
    }
    for _ in 0..reqs.len() {
        // An LMCache decoder reads once the proxy says the writes are done.
        let notif = proxy
            .next(deadline())
            .unwrap_or_else(|| panic!("no ProxyNotif within {WAIT:?}; sender: {:?}", s.dump()));
        let n: u64 = notif.req_id.trim_start_matches("lm-").parse().unwrap();
        consume(&r, &notif.req_id, n, 6).unwrap_or_else(|e| panic!("{e}"));
    }
    for (id, _) in &reqs {
        assert_eq!(terminal(&s, id), RequestStatus::Completed, "{id}");
        assert_eq!(proxy.count(id), 1, "ProxyNotifs of {id}");
    }
    let st = r.stats();
    assert_eq!(st.core.peak_admitted, 1, "one request at a time: {st:?}");
    assert_eq!(
        st.core.requests_total.get("completed").copied(),
        Some(reqs.len() as u64),
        "{st:?}"
    );
    wait_sender_empty(&s, "after the LMCache-mode run");
    wait_receiver_empty(&r, "after the LMCache-mode run");
}

#[test]
fn lmcache_receiver_without_a_static_peer_fails_with_peer_unavailable() {
    let r = lmcache_receiver(16);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(8, None);
    cfg.hello_timeout = Duration::from_millis(100);
    // Without a static descriptor there is no LMCache fallback: the Hello is
    // waited for (a late HelloAck still connects) up to hello_answer_timeout.
    cfg.hello_answer_timeout = Duration::from_millis(500);
    let s = sender(cfg);
    store_request(&s, &ep, "np-1", 1, 4, 2).unwrap();
    store_request(&s, &ep, "np-2", 2, 4, 4).unwrap();
    for req in ["np-1", "np-2"] {
        let st = terminal(&s, req);
        assert_eq!(
            failed_code(&st),
            Some(ErrorCode::PeerUnavailable),
            "{req}: {st:?}"
        );
        let RequestStatus::Failed { reason, .. } = &st else {
            unreachable!()
        };
        assert!(
            reason.contains("did not answer Hello") && reason.contains(&ep),
            "{req}: a clear reason naming the receiver: {reason}"
        );
    }
    wait_sender_empty(&s, "after PeerUnavailable");
    let st = r.stats();
    assert_eq!(st.core.requests_total.get("admitted"), None, "{st:?}");
    wait_receiver_empty(&r, "after PeerUnavailable");
}

#[test]
fn backpressure_is_immediate_when_the_pending_area_is_full() {
    let r = receiver(4);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(4, None);
    cfg.max_pending_bytes = 2 * CHUNK as usize;
    let s = Arc::new(sender(cfg));
    // Fill the receiver (complete, not consumed; from another sender): the
    // next request parks.
    let filler = sender(sender_cfg(4, None));
    store_request(&filler, &ep, "bp-fill", 1, 4, 4).unwrap();
    assert_eq!(terminal(&filler, "bp-fill"), RequestStatus::Completed);
    store_batch(&s, &ep, "bp-x", 2, 4, 0..2).unwrap();
    wait_for("bp-x parked at the receiver", || {
        r.stats().core.parked_requests == 1
    });
    assert_eq!(s.pending_bytes(), 2 * CHUNK as usize);
    let refused = {
        let (s, ep) = (Arc::clone(&s), ep.clone());
        std::thread::spawn(move || store_batch(&s, &ep, "bp-x", 2, 4, 2..4))
    };
    let err = join_within("a store into a full pending area (must not block)", refused)
        .expect_err("the pending area is full");
    match err {
        StoreError::Backpressure { needed, used, max } => {
            assert!(needed > 0 && needed <= 2 * CHUNK as usize, "{err}");
            assert_eq!(
                (used, max),
                (2 * CHUNK as usize, 2 * CHUNK as usize),
                "{err}"
            );
        }
        other => panic!("expected Backpressure, got {other:?}"),
    }
    assert!(s.stats().counter(kvferry::stats::Counter::Backpressure) >= 1);
    // Once the decoder frees the receiver, the request proceeds and the
    // refused batch can be stored again.
    consume(&r, "bp-fill", 1, 4).unwrap();
    wait_for("bp-x admitted and its first batch staged", || {
        s.pending_bytes() == 0
    });
    store_batch(&s, &ep, "bp-x", 2, 4, 2..4).unwrap();
    assert_eq!(terminal(&s, "bp-x"), RequestStatus::Completed);
    consume(&r, "bp-x", 2, 4).unwrap();
    wait_sender_empty(&s, "after back-pressure");
    wait_receiver_empty(&r, "after back-pressure");
}

#[test]
fn store_validation_errors() {
    let r = receiver(16);
    let ep = r.endpoint().to_owned();
    let s = sender(sender_cfg(4, None));
    let full_buf = vec![1u8; CHUNK as usize];
    let big_buf = vec![2u8; CHUNK as usize + 1];
    let (full, big): (&[u8], &[u8]) = (&full_buf, &big_buf);
    let spec = |id: &str, total: usize, last: bool| TransferSpec::new(id, ep.as_str(), total, last);
    let refused = |res: Result<(), StoreError>, want: StoreError, what: &str| {
        assert_eq!(res, Err(want), "{what}");
    };

    refused(
        s.store(&spec("", 1, true), &["k"], &[full]),
        StoreError::EmptyReqId,
        "empty req_id",
    );
    refused(
        s.store(&spec("v-0", 0, true), &["k"], &[full]),
        StoreError::ZeroTotalChunks,
        "total_chunks 0",
    );
    let res = s.store(&spec("v-1", 2, true), &["a"], &[full, full]);
    assert!(
        res.as_ref()
            .is_err_and(|e| e.to_string().contains("1 keys for 2 chunks")),
        "{res:?}"
    );
    refused(
        res,
        StoreError::KeyCountMismatch { keys: 1, chunks: 2 },
        "keys/chunks length mismatch",
    );
    refused(
        s.store(&spec("v-1", 2, false), &[] as &[&str], &[]),
        StoreError::EmptyBatchNotLast,
        "empty batch that is not the last",
    );
    refused(
        s.store(
            &spec("v-1", 8, false),
            &["a", "b", "c", "d", "e"],
            &[full; 5],
        ),
        StoreError::BatchTooLarge {
            chunks: 5,
            slots: 4,
        },
        "batch larger than staging",
    );
    assert_eq!(
        s.store(&spec("v-1", 2, true), &["a", "b"], &[full, big]),
        Err(StoreError::ChunkTooLarge {
            index: 1,
            len: CHUNK as usize + 1,
            max: CHUNK
        })
    );
    let res = s.store(&spec("v-1", 2, true), &["a", "b", "c"], &[full, full, full]);
    assert!(
        res.as_ref()
            .is_err_and(|e| e.to_string().contains("more than its total_chunks")),
        "{res:?}"
    );
    refused(
        res,
        StoreError::TooManyChunks {
            req_id: "v-1".into(),
            chunks: 3,
            total: 2,
        },
        "more chunks than total_chunks",
    );
    // Rejected stores left no trace: the request is unknown.
    assert_eq!(s.status("v-1"), None);

    // A request that cannot finish yet (its receiver is parked behind a
    // filler) to check rules about later batches.
    store_request(&s, &ep, "v-fill", 1, 16, 4).unwrap();
    assert_eq!(terminal(&s, "v-fill"), RequestStatus::Completed);
    store_batch(&s, &ep, "v-2", 2, 2, 0..2).unwrap();
    wait_for("v-2 parked", || r.stats().core.parked_requests == 1);
    let res = store_batch(&s, &ep, "v-2", 2, 2, 0..1);
    assert!(
        res.as_ref()
            .is_err_and(|e| e.to_string().contains("already stored its last batch")),
        "{res:?}"
    );
    refused(
        res,
        StoreError::AfterLastBatch {
            req_id: "v-2".into(),
        },
        "store after the last batch",
    );
    refused(
        s.store(&spec("v-3", 4, false), &["x"], &[full])
            .and_then(|()| {
                s.store(
                    &TransferSpec::new("v-3", "tcp://127.0.0.1:9", 4, true),
                    &["y"],
                    &[full],
                )
            }),
        StoreError::ReceiverMismatch {
            req_id: "v-3".into(),
            begun: ep.clone(),
            given: "tcp://127.0.0.1:9".into(),
        },
        "same request, another receiver",
    );
    refused(
        s.store(&spec("v-3", 5, false), &["y"], &[full]),
        StoreError::TotalMismatch {
            req_id: "v-3".into(),
            begun: 4,
            given: 5,
        },
        "same request, another total_chunks",
    );
    // Cancelled: later stores are refused with the terminal status.
    assert!(s.cancel_request("v-3"));
    assert_eq!(terminal(&s, "v-3"), RequestStatus::Cancelled);
    assert_eq!(
        s.store(&spec("v-3", 4, true), &["z"], &[full]),
        Err(StoreError::RequestEnded(RequestStatus::Cancelled))
    );
    // Completed: likewise.
    consume(&r, "v-fill", 1, 16).unwrap();
    assert_eq!(terminal(&s, "v-2"), RequestStatus::Completed);
    assert_eq!(
        store_batch(&s, &ep, "v-2", 2, 2, 0..1),
        Err(StoreError::RequestEnded(RequestStatus::Completed))
    );
    consume(&r, "v-2", 2, 2).unwrap();
    // Unknown requests.
    assert!(!s.cancel_request("nope"));
    assert_eq!(s.status("nope"), None);
    assert_eq!(s.wait("nope", deadline()), None);
    wait_sender_empty(&s, "after the validation checks");
    wait_receiver_empty(&r, "after the validation checks");
}

#[test]
fn sender_configuration_errors() {
    let bad = |cfg: kvferry::sender::SenderConfig| Sender::new(cfg).expect_err("refused");
    let mut c = sender_cfg(4, None);
    c.staging_slots = 0;
    assert!(matches!(bad(c), SenderError::Config(_)));
    let mut c = sender_cfg(4, None);
    c.chunk_bytes = 0;
    assert!(matches!(bad(c), SenderError::Config(_)));
    let mut c = sender_cfg(4, None);
    c.transport = "carrier-pigeon".into();
    assert!(matches!(
        bad(c),
        SenderError::Transport(TransportError::UnknownTransport(_))
    ));
    let mut c = sender_cfg(4, None);
    c.transport_config = faulty(FaultConfig {
        fail_rate: 2.0,
        ..FaultConfig::default()
    });
    assert!(matches!(
        bad(c),
        SenderError::Transport(TransportError::Config(_))
    ));
}

#[test]
fn close_with_requests_in_flight_returns_and_cancels_the_unfinished() {
    let proxy = proxy();
    let r = receiver(32);
    let ep = r.endpoint().to_owned();
    let mut cfg = sender_cfg(8, Some(&proxy));
    cfg.transport_config = faulty(FaultConfig {
        delay: Duration::from_millis(100),
        ..FaultConfig::default()
    });
    let s = sender(cfg);
    // Complete requests with writes in flight, and one whose last batch
    // never comes.
    for n in 0..3u64 {
        store_request(&s, &ep, &format!("cl-{n}"), n, 8, 4).unwrap();
    }
    store_batch(&s, &ep, "cl-open", 9, 8, 0..4).unwrap();
    let closer = std::thread::spawn(move || s.close(Instant::now() + Duration::from_millis(800)));
    let cancelled = join_within("Sender::close with requests in flight", closer);
    assert_eq!(cancelled, 1, "only the unfinished request is cancelled");
    for n in 0..3u64 {
        let id = format!("cl-{n}");
        proxy.wait_ready(&id, 1, deadline()).unwrap();
        consume(&r, &id, n, 8).unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        r.wait_ready("cl-open", deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled)),
        "the receiver released the unfinished request"
    );
    assert_eq!(proxy.count("cl-open"), 0);
    wait_receiver_empty(&r, "after close");
}
