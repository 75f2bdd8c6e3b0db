//! The decoder-side API of the receiver, driven by a real `Sender` in the
//! same process: per-request readiness handles (status, wait, eventfd),
//! `take` (a request's chunks in key order, borrowed in place, with exact
//! lengths; dropping them frees the capacity), the expiry of unconsumed
//! chunks, and each `TakeError`. Every wait has a deadline.

#[path = "common_sender/mod.rs"]
mod common_sender;

#[path = "common/mod.rs"]
mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common_sender::{
    deadline, receiver, receiver_cfg, sender, sender_cfg, wait_for, wait_receiver_empty,
    wait_sender_empty, CHUNK, WAIT,
};
use kvferry::protocol::ErrorCode;
use kvferry::receiver::{Receiver, RequestStatus, TakeError, WaitError};
use kvferry::sender::{Sender, TransferSpec};

/// Chunk `i` of `req_id`: full [`CHUNK`] bytes except the last one, which
/// is `last_len` bytes; its content names the request and the index.
fn chunk(req_id: &str, i: usize, n: usize, last_len: usize) -> Vec<u8> {
    let len = if i + 1 == n { last_len } else { CHUNK as usize };
    let seed = req_id.bytes().fold(i as u8, |a, b| a.wrapping_mul(31) ^ b);
    (0..len).map(|j| seed.wrapping_add(j as u8)).collect()
}

fn key(req_id: &str, i: usize) -> String {
    format!("{req_id}/k{i:03}")
}

/// Stores `n` chunks of `req_id` in batches of `batch` (the last chunk of
/// every batch but the final one is full; the request's last is short).
fn store(s: &Sender, r: &Receiver, req_id: &str, n: usize, batch: usize, last_len: usize) {
    let mut next = 0;
    while next < n {
        let end = (next + batch).min(n);
        let spec = TransferSpec::new(req_id, r.endpoint(), n, end == n);
        let keys: Vec<String> = (next..end).map(|i| key(req_id, i)).collect();
        let bufs: Vec<Vec<u8>> = (next..end).map(|i| chunk(req_id, i, n, last_len)).collect();
        let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        s.store(&spec, &keys, &chunks).expect("stored");
        next = end;
    }
}

/// Polls `fd` for readability for at most `timeout`.
fn readable(fd: i32, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack, count 1.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    n == 1 && p.revents & libc::POLLIN != 0
}

fn expired(r: &Receiver) -> u64 {
    r.stats()
        .core
        .requests_total
        .get("unconsumed_expired")
        .copied()
        .unwrap_or(0)
}

#[test]
fn take_hands_out_exact_bytes_in_key_order_and_drop_frees_everything() {
    let r = receiver(16);
    let s = sender(sender_cfg(8, None));
    let n = 7;
    let last_len = 1000;
    let h = r.watch("t-0").expect("eventfd");
    let fd = h.as_raw_fd();
    assert_eq!(h.status(), RequestStatus::Pending);
    assert!(
        !readable(fd, Duration::ZERO),
        "not readable before anything was sent"
    );
    assert_eq!(
        r.take("t-0").unwrap_err(),
        TakeError::NotReady("t-0".into()),
        "nothing to take before the request is complete"
    );
    store(&s, &r, "t-0", n, 3, last_len);
    assert!(
        readable(fd, WAIT),
        "the readiness fd fires when the request is ready"
    );
    assert_eq!(h.status(), RequestStatus::Ready);
    assert_eq!(h.wait(deadline()), Ok(()));

    let chunks = r.take("t-0").expect("complete request is taken");
    assert_eq!(chunks.req_id(), "t-0");
    assert_eq!(chunks.len(), n);
    assert_eq!(
        chunks.total_bytes(),
        (n as u64 - 1) * CHUNK + last_len as u64
    );
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.key(), key("t-0", i), "key order");
        let want = chunk("t-0", i, n, last_len);
        assert_eq!(c.len(), want.len(), "chunk {i}'s exact length");
        assert!(c.bytes() == want.as_slice(), "chunk {i}'s bytes");
        let last_of_batch = i % 3 == 2 || i + 1 == n;
        assert_eq!(
            c.tokens().is_some(),
            last_of_batch,
            "token count on batch ends"
        );
    }
    assert_eq!(
        chunks.get(n - 1).map(|c| c.tokens()),
        Some(Some(last_len as u32))
    );
    // Zero copy: the view points into the receive buffer.
    let c0 = chunks.get(0).unwrap();
    let base = r.region().slot_ptr(c0.slot()).unwrap() as *const u8;
    assert_eq!(c0.bytes().as_ptr(), base, "borrowed in place");

    assert_eq!(r.stats().allocated_chunks, n, "held while taken");
    assert_eq!(
        r.take("t-0").unwrap_err(),
        TakeError::NotReady("t-0".into()),
        "a request is taken once"
    );
    drop(chunks);
    let st = r.stats();
    assert_eq!(
        (
            st.allocated_chunks,
            st.reserved_chunks,
            st.core.slots_in_use
        ),
        (0, 0, 0),
        "dropping the chunks gives every slot back at once"
    );
    wait_sender_empty(&s, "after t-0");
    wait_receiver_empty(&r, "after t-0");
}

#[test]
fn get_exposes_the_chunk_length_not_the_slot() {
    let r = receiver(8);
    let s = sender(sender_cfg(8, None));
    store(&s, &r, "g-0", 2, 2, 77);
    r.wait_ready("g-0", deadline()).unwrap();
    let full = r.get(&key("g-0", 0)).expect("ready");
    let short = r.get(&key("g-0", 1)).expect("ready");
    assert_eq!(full.len(), CHUNK as usize);
    assert_eq!(short.len(), 77, "the short last chunk, not the whole slot");
    assert!(short.bytes() == chunk("g-0", 1, 2, 77).as_slice());
    drop((full, short));
    wait_receiver_empty(&r, "after g-0");
}

#[test]
fn the_fd_fires_on_failure_and_the_status_says_why() {
    let r = receiver(8);
    let s = sender(sender_cfg(8, None));
    let h = r.watch("f-0").expect("eventfd");
    let req = s
        .begin(kvferry::sender::RequestSpec::new("f-0", r.endpoint(), 4))
        .expect("begins");
    wait_for("f-0 admitted", || req.is_admitted());
    assert!(s.cancel_request("f-0"));
    assert!(
        readable(h.as_raw_fd(), WAIT),
        "the fd fires on failure, no timeout"
    );
    assert_eq!(h.status(), RequestStatus::Failed(ErrorCode::Cancelled));
    assert_eq!(
        h.wait(deadline()),
        Err(WaitError::Failed(ErrorCode::Cancelled))
    );
    assert_eq!(
        r.take("f-0").unwrap_err(),
        TakeError::NotReady("f-0".into())
    );
    // A handle made after the end is readable at once.
    let late = r.watch("f-0").unwrap();
    assert!(readable(late.as_raw_fd(), Duration::ZERO));
    assert_eq!(late.status(), RequestStatus::Failed(ErrorCode::Cancelled));
    wait_receiver_empty(&r, "after f-0");
}

#[test]
fn a_handle_times_out_and_reports_shutdown() {
    let r = receiver(4);
    let h = r.watch("never").unwrap();
    assert_eq!(
        h.wait(Instant::now() + Duration::from_millis(20)),
        Err(WaitError::Timeout)
    );
    drop(r);
    assert!(
        readable(h.as_raw_fd(), Duration::ZERO),
        "shutdown wakes the fd"
    );
    assert_eq!(h.status(), RequestStatus::ShutDown);
    assert_eq!(h.wait(deadline()), Err(WaitError::ShutDown));
}

#[test]
fn unconsumed_chunks_expire_and_are_counted() {
    let r = Receiver::start(kvferry::receiver::ReceiverConfig {
        unconsumed_expiry: Some(Duration::from_millis(100)),
        ..receiver_cfg(8)
    })
    .expect("receiver starts");
    let s = sender(sender_cfg(8, None));
    store(&s, &r, "e-0", 4, 4, 10);
    r.wait_ready("e-0", deadline()).unwrap();
    assert_eq!(expired(&r), 0);
    // Nobody takes it: its slots come back by themselves.
    wait_receiver_empty(&r, "unconsumed chunks expiring");
    assert_eq!(expired(&r), 1, "the expiry is counted");
    assert_eq!(
        r.take("e-0").unwrap_err(),
        TakeError::NotReady("e-0".into())
    );
    // One taken before the expiry stays until dropped.
    store(&s, &r, "e-1", 2, 2, 10);
    r.wait_ready("e-1", deadline()).unwrap();
    let taken = r.take("e-1").expect("taken in time");
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(r.stats().allocated_chunks, 2, "taken chunks never expire");
    assert!(taken.get(1).unwrap().bytes() == chunk("e-1", 1, 2, 10).as_slice());
    drop(taken);
    assert_eq!(expired(&r), 1);
    wait_receiver_empty(&r, "after e-1");
}

#[test]
fn without_expiry_unconsumed_chunks_stay() {
    let r = receiver(8);
    let s = sender(sender_cfg(8, None));
    store(&s, &r, "k-0", 2, 2, 10);
    r.wait_ready("k-0", deadline()).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(
        r.stats().allocated_chunks,
        2,
        "default: kept until consumed"
    );
    assert_eq!(r.take("k-0").unwrap().len(), 2);
    wait_receiver_empty(&r, "after k-0");
}

#[test]
fn take_after_a_chunk_was_read_by_key_is_consumed() {
    let r = receiver(8);
    let s = sender(sender_cfg(8, None));
    store(&s, &r, "c-0", 3, 3, 10);
    r.wait_ready("c-0", deadline()).unwrap();
    assert!(r.remove(&key("c-0", 1)));
    assert_eq!(
        r.take("c-0").unwrap_err(),
        TakeError::Consumed {
            req_id: "c-0".into(),
            key: key("c-0", 1)
        }
    );
    // Nothing was claimed: the rest is still readable by key.
    for i in [0, 2] {
        assert!(r.remove(&key("c-0", i)), "chunk {i} still held");
    }
    wait_receiver_empty(&r, "after c-0");
}

#[test]
fn two_peers_completing_the_same_req_id_are_ambiguous() {
    use common::{alloc, assert_ok, keys, transfer_done, Client};
    let r = receiver(8);
    for name in ["peer-a", "peer-b"] {
        let c = Client::connect(r.endpoint(), name);
        c.hello();
        let ks = keys(&format!("{name}/"), 2);
        let reply = c.call(&alloc("dup", &ks, 2, true, Some(1)), "alloc");
        assert_ok(&reply, 2);
        c.send(&transfer_done("dup"));
        wait_for("TransferDone handled", || {
            r.stats().core.tracked_requests == 0
        });
    }
    assert_eq!(r.wait_ready("dup", deadline()), Ok(()));
    assert_eq!(
        r.take("dup").unwrap_err(),
        TakeError::Ambiguous {
            req_id: "dup".into(),
            peers: 2
        }
    );
    for name in ["peer-a", "peer-b"] {
        for k in keys(&format!("{name}/"), 2) {
            assert!(r.remove(&k), "{k} is still readable by key");
        }
    }
    wait_receiver_empty(&r, "after dup");
}
