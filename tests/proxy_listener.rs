//! `ProxyListener` black-box: PUSH sockets (one per sender TP rank) send
//! `ProxyNotif` frames to a listener bound on port 0.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::sync::mpsc;
use std::time::Instant;

use common::*;
use kvferry::protocol::{encode, Message, ProxyNotif};
use kvferry::proxy::{ProxyError, ProxyListener};

fn pusher(endpoint: &str) -> zmq::Socket {
    let s = kvferry::zmq_io::context()
        .socket(zmq::PUSH)
        .expect("push socket");
    s.set_linger(1000).expect("linger");
    s.connect(endpoint).expect("connect");
    s
}

fn notif(req_id: &str) -> Vec<u8> {
    encode(&Message::ProxyNotif(ProxyNotif {
        req_id: req_id.into(),
    }))
}

fn listener() -> ProxyListener {
    let l = ProxyListener::bind("tcp://127.0.0.1:0").expect("bind proxy listener");
    assert!(
        l.endpoint().starts_with("tcp://127.0.0.1:") && !l.endpoint().ends_with(":0"),
        "actual port reported: {}",
        l.endpoint()
    );
    l
}

#[test]
fn wait_ready_counts_one_notif_per_tp_rank() {
    let l = listener();
    let rank0 = pusher(l.endpoint());
    let rank1 = pusher(l.endpoint());
    rank0.send(notif("req-1"), 0).unwrap();
    l.wait_ready("req-1", 1, deadline())
        .expect("first rank's notif");
    // Only one of the two TP ranks reported: not ready yet.
    let err = l.wait_ready("req-1", 2, Instant::now()).unwrap_err();
    match &err {
        ProxyError::Timeout {
            req_id,
            got,
            expected,
        } => assert_eq!((req_id.as_str(), *got, *expected), ("req-1", 1, 2)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("req-1") && text.contains("1 of 2"),
        "timeout names got/expected: {text}"
    );
    rank1.send(notif("req-1"), 0).unwrap();
    l.wait_ready("req-1", 2, deadline())
        .expect("both TP ranks reported");
    assert_eq!(l.count("req-1"), 2);
    assert_eq!(l.count("never"), 0);
    assert_eq!(l.totals(), (2, 0));
}

#[test]
fn malformed_frames_are_counted_and_ignored() {
    let l = listener();
    let p = pusher(l.endpoint());
    p.send(&b"\xc1garbage"[..], 0).unwrap();
    p.send(&b""[..], 0).unwrap();
    // A well-formed message of another type is not a ProxyNotif either.
    p.send(encode(&alloc("x", &keys("x", 1), 1, true, None)), 0)
        .unwrap();
    p.send(notif("after-junk"), 0).unwrap();
    l.wait_ready("after-junk", 1, deadline())
        .expect("the notif after the junk");
    // One PUSH socket delivers in order: the junk was seen before it.
    assert_eq!(l.totals(), (1, 3));
    let n = l.next(deadline()).expect("one notification");
    assert_eq!(n.req_id, "after-junk");
    assert!(
        l.next(Instant::now()).is_none(),
        "junk is not a notification"
    );
}

#[test]
fn next_returns_notifications_in_arrival_order() {
    let l = listener();
    let p = pusher(l.endpoint());
    for id in ["a", "b", "a", "c"] {
        p.send(notif(id), 0).unwrap();
    }
    let got: Vec<(String, usize)> = (0..4)
        .map(|i| {
            let n = l
                .next(deadline())
                .unwrap_or_else(|| panic!("hung waiting for notification {i}"));
            (n.req_id, n.count)
        })
        .collect();
    assert_eq!(
        got,
        [
            ("a".to_string(), 1),
            ("b".to_string(), 1),
            ("a".to_string(), 2),
            ("c".to_string(), 1)
        ]
    );
    assert!(l.next(Instant::now()).is_none(), "all taken");
}

#[test]
fn callback_runs_for_each_notification() {
    let l = listener();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    l.set_callback(move |n| {
        let _ = tx
            .lock()
            .expect("callback channel")
            .send((n.req_id.clone(), n.count));
    });
    let p = pusher(l.endpoint());
    p.send(notif("cb"), 0).unwrap();
    p.send(notif("cb"), 0).unwrap();
    for want in 1..=2 {
        let got = rx
            .recv_timeout(HANG)
            .unwrap_or_else(|_| panic!("hung waiting for callback {want}"));
        assert_eq!(got, ("cb".to_string(), want));
    }
}

#[test]
fn bind_errors_name_the_endpoint() {
    let l = listener();
    match ProxyListener::bind(l.endpoint()) {
        Err(e @ ProxyError::Bind { .. }) => {
            assert!(e.to_string().contains(l.endpoint()), "{e}")
        }
        other => panic!("second bind on the same port: {other:?}"),
    }
    match ProxyListener::bind("bogus://nowhere") {
        Err(e @ ProxyError::Bind { .. }) => assert!(e.to_string().contains("bogus://nowhere")),
        other => panic!("bad endpoint: {other:?}"),
    }
    l.shutdown();
}

/// An `ipc://` endpoint's path: a regular file there, or a live listener's
/// socket, is `ProxyError::SocketFile` and stays as it was (libzmq alone
/// would unlink either); a dead listener's socket is taken over; the file
/// goes when the listener is dropped.
#[test]
fn an_ipc_endpoint_takes_only_a_free_path_or_a_dead_listeners_socket() {
    use std::io::ErrorKind;
    let dir = TempDir::new("kvferry-proxy-ipc");
    let notes = dir.join("notes");
    std::fs::write(&notes, b"keep me").unwrap();
    let refused = |endpoint: &str, kind: ErrorKind| match ProxyListener::bind(endpoint) {
        Err(ProxyError::SocketFile {
            endpoint: e,
            source,
        }) => {
            assert_eq!((e.as_str(), source.kind()), (endpoint, kind), "{source}")
        }
        other => panic!("{endpoint}: expected SocketFile ({kind:?}), got {other:?}"),
    };
    refused(
        &format!("ipc://{}", notes.display()),
        ErrorKind::AlreadyExists,
    );
    assert_eq!(std::fs::read(&notes).unwrap(), b"keep me");

    let sock = dir.join("proxy.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let endpoint = format!("ipc://{}", sock.display());
    let l = ProxyListener::bind(&endpoint).expect("a dead listener's socket is taken over");
    refused(&endpoint, ErrorKind::AddrInUse);
    let p = pusher(l.endpoint());
    p.send(notif("over-ipc"), 0).unwrap();
    wait_until("the ProxyNotif over ipc", || l.count("over-ipc") == 1);
    l.shutdown();
    assert!(!sock.exists(), "the ipc socket file outlived its listener");
}
