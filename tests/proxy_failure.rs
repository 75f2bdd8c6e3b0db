//! `ProxyFailed` (kvferry extension): a sender whose request fails or is
//! cancelled tells the proxy, and `ProxyListener::wait_ready` returns a typed
//! failure at once instead of waiting for its deadline. The LMCache side
//! (a msgspec proxy decoder is not broken by the new type) is
//! tests/lmcache/suite.py `proxy_failed_vs_lmcache_proxy_decoders`.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::time::Instant;

use common_sender::{
    deadline, proxy, receiver, sender, sender_cfg, store_batch, terminal, unique, wait_for,
};
use kvferry::protocol::{decode, encode, ErrorCode, Message, ProxyFailed, ProxyNotif};
use kvferry::proxy::{FailureCode, ProxyError, ProxyListener, MAX_REASON_BYTES};
use kvferry::sender::RequestStatus;

fn pusher(endpoint: &str) -> zmq::Socket {
    let s = kvferry::zmq_io::context()
        .socket(zmq::PUSH)
        .expect("push socket");
    s.set_linger(1000).expect("linger");
    s.connect(endpoint).expect("connect");
    s
}

fn failed(req_id: &str, code: &str, error: Option<&str>) -> Vec<u8> {
    encode(&Message::ProxyFailed(ProxyFailed {
        req_id: req_id.into(),
        code: code.into(),
        error: error.map(str::to_owned),
    }))
}

/// The golden frame in docs/protocol.md ("ProxyFailed").
#[test]
fn golden_frame() {
    let bytes = failed("r1", "cancelled", None);
    let mut want = vec![0x83, 0xa4];
    want.extend_from_slice(b"type");
    want.push(0xab);
    want.extend_from_slice(b"ProxyFailed");
    want.push(0xa6);
    want.extend_from_slice(b"req_id");
    want.push(0xa2);
    want.extend_from_slice(b"r1");
    want.push(0xa4);
    want.extend_from_slice(b"code");
    want.push(0xa9);
    want.extend_from_slice(b"cancelled");
    assert_eq!(bytes, want);
    assert!(matches!(decode(&want), Ok(Message::ProxyFailed(p)) if p.error.is_none()));
    // The reason, when present, follows as `error`.
    let with = failed("r1", "cancelled", Some("x"));
    assert_eq!(&with[..1], &[0x84]);
    assert!(with.ends_with(&[0xa5, b'e', b'r', b'r', b'o', b'r', 0xa1, b'x']));
}

#[test]
fn a_proxy_failed_frame_fails_wait_ready_with_its_code() {
    let l = ProxyListener::bind("tcp://127.0.0.1:0").unwrap();
    let rank0 = pusher(l.endpoint());
    let rank1 = pusher(l.endpoint());
    // Rank 0 is ready, rank 1 failed: the request fails (with TP every rank
    // must be ready).
    rank0
        .send(
            encode(&Message::ProxyNotif(ProxyNotif {
                req_id: "tp".into(),
            })),
            0,
        )
        .unwrap();
    rank1
        .send(failed("tp", "write_failed", Some("link down")), 0)
        .unwrap();
    let far = Instant::now() + std::time::Duration::from_secs(120);
    match l.wait_ready("tp", 2, far) {
        Err(ProxyError::Failed { req_id, code }) => {
            assert_eq!(req_id, "tp");
            assert_eq!(code, FailureCode::Known(ErrorCode::WriteFailed));
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    // The ProxyNotif (from the other socket, maybe later) is still counted.
    wait_for("rank 0's ProxyNotif", || l.count("tp") == 1);
    // An unknown code (a newer sender) still fails the request, typed.
    let long = "é".repeat(MAX_REASON_BYTES);
    rank0
        .send(failed("new", "some_future_code", Some(&long)), 0)
        .unwrap();
    assert!(matches!(
        l.wait_ready("new", 1, far),
        Err(ProxyError::Failed {
            code: FailureCode::Unknown,
            ..
        })
    ));
    // The failure callback gets the (bounded) reason; the ProxyNotif
    // stream (`next`, `set_callback`) carries only the ready rank.
    let n = l.next(Instant::now()).expect("rank 0's ProxyNotif");
    assert_eq!((n.req_id.as_str(), n.failure.is_none()), ("tp", true));
    assert!(
        l.next(Instant::now()).is_none(),
        "no failure in the ready stream"
    );
    let (tx, rx) = std::sync::mpsc::channel();
    l.set_failure_callback(move |n| {
        let _ = tx.send(n.clone());
    });
    rank0
        .send(failed("later", "cancelled", Some(&long)), 0)
        .unwrap();
    // A callback set while the listener thread is still handing out an
    // earlier failure ("new": its count lands before its callback runs) may
    // see that one first; "later" must come.
    let n = loop {
        let n = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("failure callback ran for \"later\"");
        if n.req_id != "new" {
            break n;
        }
    };
    let f = n.failure.expect("a failure");
    assert_eq!(
        (n.req_id.as_str(), f.code),
        ("later", FailureCode::Known(ErrorCode::Cancelled))
    );
    assert!(
        f.reason.len() <= MAX_REASON_BYTES
            && f.reason.len() > MAX_REASON_BYTES - 4
            && f.reason.chars().all(|c| c == 'é'),
        "cut at a character boundary: {} bytes",
        f.reason.len()
    );
    assert_eq!(
        l.totals(),
        (1, 0),
        "failures are not ProxyNotifs, nor malformed"
    );
    assert_eq!(l.failures_total(), 3);
}

/// End to end: a request the receiver refuses (more chunks than its whole
/// buffer) reaches the proxy as a failure; the wait ends by it, not by the
/// deadline (120 s: a regression shows as a Timeout, not as a slow pass).
#[test]
fn a_failed_request_reaches_the_proxy_as_a_failure() {
    let px = proxy();
    let r = receiver(4);
    let s = sender(sender_cfg(4, Some(&px)));
    let req = unique("too-large");
    let _ = store_batch(&s, r.endpoint(), &req, 1, 16, 0..2);
    match terminal(&s, &req) {
        RequestStatus::Failed { code, .. } => assert_eq!(code, ErrorCode::BufferTooSmall),
        other => panic!("expected the request to fail, got {other:?}"),
    }
    let far = Instant::now() + std::time::Duration::from_secs(120);
    match px.wait_ready(&req, 1, far) {
        Err(ProxyError::Failed { code, .. }) => {
            assert_eq!(code, FailureCode::Known(ErrorCode::BufferTooSmall))
        }
        other => panic!("expected ProxyError::Failed, got {other:?}"),
    }
    // A request that completes sends its ProxyNotif, and no failure.
    let ok = unique("fits");
    store_batch(&s, r.endpoint(), &ok, 2, 2, 0..2).unwrap();
    assert_eq!(terminal(&s, &ok), RequestStatus::Completed);
    px.wait_ready(&ok, 1, deadline()).unwrap();
    assert_eq!(px.failure(&ok), None);
}
