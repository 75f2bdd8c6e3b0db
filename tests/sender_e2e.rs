//! End-to-end sender tests: in-process senders, receivers and a proxy
//! listener over loopback TCP with the shm data plane. Every byte a decoder
//! reads is checked against what was stored; every wait has a deadline.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common_sender::*;
use kvferry::receiver::{Receiver, ReceiverConfig};
use kvferry::sender::RequestStatus;
use kvferry::transport::{FaultConfig, TransportConfig};

/// Chunks of request `n` in the 1P1D run: every count in 1..=16.
fn total_of(n: u64) -> u32 {
    1 + ((n * 7 + 3) % 16) as u32
}

/// Batch size used for request `n`: 1..=4.
fn batch_of(n: u64) -> u32 {
    1 + (n % 4) as u32
}

/// Decodes requests in the order their ProxyNotif arrives (as a request
/// router would route them), verifying every byte. Returns the consumed ids.
fn decode_by_notif(
    proxy: &kvferry::proxy::ProxyListener,
    receiver: &kvferry::receiver::Receiver,
    expected: usize,
    lookup: impl Fn(&str) -> (u64, u32),
) -> Vec<String> {
    let mut done = Vec::with_capacity(expected);
    while done.len() < expected {
        let n = proxy.next(deadline()).unwrap_or_else(|| {
            panic!(
                "decoder: no ProxyNotif within {WAIT:?} ({} of {expected} requests consumed)",
                done.len()
            )
        });
        let (request, total) = lookup(&n.req_id);
        consume(receiver, &n.req_id, request, total).unwrap_or_else(|e| panic!("{e}"));
        done.push(n.req_id);
    }
    done
}

#[test]
fn one_prefill_one_decode_200_requests_bytes_and_notifs_exact() {
    const REQUESTS: u64 = 200;
    let proxy = Arc::new(proxy());
    let receiver = Arc::new(receiver(64));
    let ep = receiver.endpoint().to_owned();
    let sender = Arc::new(sender(sender_cfg(32, Some(&proxy))));
    let name = |n: u64| format!("e2e-r{n}");

    let decoder = {
        let (proxy, receiver) = (Arc::clone(&proxy), Arc::clone(&receiver));
        std::thread::spawn(move || {
            decode_by_notif(&proxy, &receiver, REQUESTS as usize, |id| {
                let n: u64 = id.trim_start_matches("e2e-r").parse().expect("own id");
                (n, total_of(n))
            })
        })
    };
    // Two caller threads (like two inference workers), each storing its
    // half of the requests without waiting for them.
    let callers: Vec<_> = (0..2u64)
        .map(|c| {
            let (sender, ep) = (Arc::clone(&sender), ep.clone());
            std::thread::spawn(move || {
                for n in (c..REQUESTS).step_by(2) {
                    store_request(&sender, &ep, &name(n), n, total_of(n), batch_of(n))
                        .unwrap_or_else(|e| panic!("store of {} failed: {e}", name(n)));
                }
            })
        })
        .collect();
    for (i, c) in callers.into_iter().enumerate() {
        join_within(&format!("caller thread {i} storing its requests"), c);
    }
    let consumed = join_within("the decoder consuming all 200 requests", decoder);
    assert_eq!(consumed.len(), REQUESTS as usize);

    for n in 0..REQUESTS {
        assert_eq!(
            sender.wait(&name(n), deadline()),
            Some(RequestStatus::Completed),
            "status of {}",
            name(n)
        );
    }
    let sender = Arc::try_unwrap(sender).expect("only the test holds the sender");
    assert_eq!(sender.close(deadline()), 0, "nothing left to cancel");
    // The sender is closed (its threads joined): no ProxyNotif can follow.
    for n in 0..REQUESTS {
        assert_eq!(proxy.count(&name(n)), 1, "ProxyNotif count of {}", name(n));
    }
    assert_eq!(proxy.totals(), (REQUESTS, 0), "(ProxyNotifs, malformed)");
    wait_receiver_empty(&receiver, "after 200 consumed requests");
    let s = receiver.stats();
    assert_eq!(
        s.core.requests_total.get("completed").copied(),
        Some(REQUESTS)
    );
}

#[test]
fn two_prefill_one_decode_both_admitted_at_once() {
    let proxy = proxy();
    let receiver = receiver(20);
    let ep = receiver.endpoint().to_owned();
    let s1 = sender(sender_cfg(16, Some(&proxy)));
    let s2 = sender(sender_cfg(16, Some(&proxy)));
    // First halves only: neither request can finish, so both are tracked
    // (admitted) at the receiver at the same time.
    store_batch(&s1, &ep, "2p-a", 1, 10, 0..5).unwrap();
    store_batch(&s2, &ep, "2p-b", 2, 10, 0..5).unwrap();
    wait_for("both first batches admitted at the receiver", || {
        receiver
            .stats()
            .core
            .requests_total
            .get("admitted")
            .copied()
            == Some(2)
    });
    store_batch(&s1, &ep, "2p-a", 1, 10, 5..10).unwrap();
    store_batch(&s2, &ep, "2p-b", 2, 10, 5..10).unwrap();
    assert_eq!(terminal(&s1, "2p-a"), RequestStatus::Completed);
    assert_eq!(terminal(&s2, "2p-b"), RequestStatus::Completed);
    consume(&receiver, "2p-a", 1, 10).unwrap();
    consume(&receiver, "2p-b", 2, 10).unwrap();
    let st = receiver.stats();
    assert!(
        st.core.peak_admitted >= 2,
        "both requests admitted at once: {st:?}"
    );
    assert_eq!(
        st.core.requests_total.get("parked").copied().unwrap_or(0),
        0,
        "nothing parked with room for both: {st:?}"
    );
    proxy
        .wait_ready("2p-a", 1, deadline())
        .expect("ProxyNotif of 2p-a");
    proxy
        .wait_ready("2p-b", 1, deadline())
        .expect("ProxyNotif of 2p-b");
    wait_receiver_empty(&receiver, "after both requests were consumed");
}

/// The seed's deadlock example end to end: receiver capacity 10, two
/// 8-chunk requests from one sender whose batches are stored interleaved
/// (A, B, A, B, ...), with `staging` staging slots and batches of `batch`.
/// B cannot be admitted while A holds 8 of the 10 slots, so B must finish
/// only after the decoder consumed A, and neither may deadlock the sender.
fn seed_deadlock_example(staging: usize, batch: u32) {
    let receiver = Arc::new(receiver(10));
    let ep = receiver.endpoint().to_owned();
    let sender = Arc::new(sender(sender_cfg(staging, None)));
    let a_consumed = Arc::new(AtomicBool::new(false));
    let b_done_after_a: Arc<Mutex<Option<(RequestStatus, bool)>>> = Arc::new(Mutex::new(None));
    {
        let (flag, slot) = (Arc::clone(&a_consumed), Arc::clone(&b_done_after_a));
        sender.set_callback(move |req, status| {
            if req == "dl-b" {
                // SeqCst: read after B's terminal status was decided.
                *slot.lock().unwrap() = Some((status.clone(), flag.load(Ordering::SeqCst)));
            }
        });
    }
    let decoder = {
        let (receiver, flag) = (Arc::clone(&receiver), Arc::clone(&a_consumed));
        std::thread::spawn(move || {
            consume(&receiver, "dl-a", 1, 8).unwrap_or_else(|e| panic!("{e}"));
            // SeqCst: published after A's slots were released.
            flag.store(true, Ordering::SeqCst);
            consume(&receiver, "dl-b", 2, 8).unwrap_or_else(|e| panic!("{e}"));
        })
    };
    let caller = {
        let (sender, ep) = (Arc::clone(&sender), ep.clone());
        std::thread::spawn(move || {
            let mut next = 0;
            while next < 8 {
                let end = (next + batch).min(8);
                store_batch(&sender, &ep, "dl-a", 1, 8, next..end)
                    .unwrap_or_else(|e| panic!("store of A {next}..{end}: {e}"));
                store_batch(&sender, &ep, "dl-b", 2, 8, next..end)
                    .unwrap_or_else(|e| panic!("store of B {next}..{end}: {e}"));
                next = end;
            }
        })
    };
    join_within(
        &format!("the caller storing A and B interleaved (staging {staging}, batch {batch})"),
        caller,
    );
    let a = sender.wait("dl-a", deadline());
    assert_eq!(
        a,
        Some(RequestStatus::Completed),
        "A (staging {staging}, batch {batch}); B is {:?}; sender: {:?}; receiver: {:?}",
        sender.status("dl-b"),
        sender.dump(),
        receiver.stats()
    );
    assert_eq!(
        terminal(&sender, "dl-a"),
        RequestStatus::Completed,
        "A (staging {staging}, batch {batch})"
    );
    join_within(
        &format!("the decoder consuming A then B (staging {staging}, batch {batch})"),
        decoder,
    );
    assert_eq!(terminal(&sender, "dl-b"), RequestStatus::Completed);
    // The callback runs on the announcer thread after the status is
    // visible (at the end of ctrl's step): wait for it.
    wait_for("B's terminal callback", || {
        b_done_after_a.lock().unwrap().is_some()
    });
    let b = b_done_after_a.lock().unwrap().clone();
    assert_eq!(
        b,
        Some((RequestStatus::Completed, true)),
        "B completed, and only after A was consumed"
    );
    let st = receiver.stats();
    assert_eq!(st.core.peak_admitted, 1, "never both admitted: {st:?}");
    assert_eq!(
        st.core.requests_total.get("parked").copied(),
        Some(1),
        "B waited for admission: {st:?}"
    );
    wait_sender_empty(&sender, "after the deadlock example");
    wait_receiver_empty(&receiver, "after the deadlock example");
}

#[test]
fn seed_deadlock_example_staging_4_batches_of_4() {
    seed_deadlock_example(4, 4);
}

#[test]
fn seed_deadlock_example_staging_4_batches_of_2() {
    seed_deadlock_example(4, 2);
}

#[test]
fn seed_deadlock_example_staging_5_batches_of_5_as_in_the_seed() {
    // The seed's numbers: A allocates 5, B allocates 5, then 3 and 3.
    seed_deadlock_example(5, 5);
}

#[test]
fn reordered_completions_notify_once_and_only_after_all_writes() {
    let proxy = proxy();
    let receiver = receiver(48);
    let ep = receiver.endpoint().to_owned();
    let mut cfg = sender_cfg(8, Some(&proxy));
    cfg.transport_config = TransportConfig {
        fault: Some(FaultConfig {
            delay: Duration::from_millis(3),
            reorder: true,
            seed: 11,
            ..FaultConfig::default()
        }),
        ..TransportConfig::default()
    };
    let sender = Arc::new(sender(cfg));
    // At each ProxyNotif, how many staging slots the sender still holds.
    let (tx, rx) = crossbeam_channel::unbounded::<(String, usize)>();
    {
        let weak = Arc::downgrade(&sender);
        proxy.set_callback(move |n| {
            let held = weak.upgrade().map_or(usize::MAX, |s| s.staging_in_use());
            let _ = tx.send((n.req_id.clone(), held));
        });
    }
    // Phase 1: one request at a time, 12 chunks in 4 batches through 8
    // staging slots, so the ProxyNotif of the only request in flight must
    // find every staging slot free (each slot is freed by its completion).
    for n in 0..8u64 {
        let id = format!("ro-seq-{n}");
        store_request(&sender, &ep, &id, n, 12, 3).unwrap();
        let (got, held) = rx
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("no ProxyNotif for {id} within {WAIT:?}"));
        assert_eq!(got, id);
        assert_eq!(
            held, 0,
            "{id}: ProxyNotif while {held} staging slots (writes) were still held"
        );
        assert_eq!(terminal(&sender, &id), RequestStatus::Completed);
        consume(&receiver, &id, n, 12).unwrap();
    }
    // Phase 2: many requests at once from two threads, completions
    // reordered across requests.
    let ids: Arc<HashMap<String, (u64, u32)>> = Arc::new(
        (100..140u64)
            .map(|n| (format!("ro-par-{n}"), (n, total_of(n))))
            .collect(),
    );
    let callers: Vec<_> = (0..2u64)
        .map(|c| {
            let (sender, ep) = (Arc::clone(&sender), ep.clone());
            std::thread::spawn(move || {
                for n in (100 + c..140).step_by(2) {
                    let id = format!("ro-par-{n}");
                    store_request(&sender, &ep, &id, n, total_of(n), batch_of(n))
                        .unwrap_or_else(|e| panic!("store of {id}: {e}"));
                }
            })
        })
        .collect();
    let mut seen = 0;
    while seen < ids.len() {
        let (id, _) = rx.recv_timeout(WAIT).unwrap_or_else(|_| {
            panic!(
                "phase 2: only {seen} of {} ProxyNotifs within {WAIT:?}",
                ids.len()
            )
        });
        let (n, total) = ids[&id];
        consume(&receiver, &id, n, total).unwrap();
        seen += 1;
    }
    for (i, c) in callers.into_iter().enumerate() {
        join_within(&format!("phase-2 caller {i}"), c);
    }
    for id in ids.keys() {
        assert_eq!(terminal(&sender, id), RequestStatus::Completed, "{id}");
    }
    // Close the sender (joining its threads): no ProxyNotif can follow.
    let sender = Arc::try_unwrap(sender).expect("only the test holds the sender");
    assert_eq!(sender.close(deadline()), 0, "nothing left to cancel");
    for n in 0..8u64 {
        assert_eq!(
            proxy.count(&format!("ro-seq-{n}")),
            1,
            "ProxyNotifs of ro-seq-{n}"
        );
    }
    for id in ids.keys() {
        assert_eq!(proxy.count(id), 1, "ProxyNotifs of {id}");
    }
    assert_eq!(
        proxy.totals(),
        (48, 0),
        "8 + 40 requests, one ProxyNotif each"
    );
    wait_receiver_empty(&receiver, "after the reordered run");
}

#[test]
fn batches_stored_before_and_after_admission_do_not_deadlock_on_staging() {
    // Staging 4, batches of 4. Batches 1 and 2 are stored before the
    // receiver admits the request (pending area); batch 3 after it, so it
    // waits for staging in `store` and takes the slots batch 1's writes give
    // back. Batch 2 then needs staging that batch 3 holds: batch 3 must be
    // posted without waiting for batch 2, or neither ever moves.
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let mut cfg = sender_cfg(4, None);
    cfg.transport_config = TransportConfig {
        fault: Some(FaultConfig {
            delay: Duration::from_millis(200),
            ..FaultConfig::default()
        }),
        ..TransportConfig::default()
    };
    let sender = Arc::new(sender(cfg));
    store_batch(&sender, &ep, "mix", 1, 12, 0..4).unwrap();
    store_batch(&sender, &ep, "mix", 1, 12, 4..8).unwrap();
    wait_for(
        "batch 1 staged and its writes posted (4 staging slots)",
        || sender.staging_in_use() == 4,
    );
    let third = {
        let (sender, ep) = (Arc::clone(&sender), ep.clone());
        std::thread::spawn(move || store_batch(&sender, &ep, "mix", 1, 12, 8..12))
    };
    join_within("the store of batch 3 (waits for staging)", third).unwrap();
    let st = sender.wait("mix", deadline());
    assert_eq!(
        st,
        Some(RequestStatus::Completed),
        "sender: {:?}; staging slots in use {}",
        sender.dump(),
        sender.staging_in_use()
    );
    consume(&receiver, "mix", 1, 12).unwrap();
    wait_sender_empty(&sender, "after the mixed request");
    wait_receiver_empty(&receiver, "after the mixed request");
}

/// Stores `keys` (with the payload of chunk `ids[i]`) as one last batch of
/// a request of `keys.len()` chunks.
fn store_keys(s: &kvferry::sender::Sender, ep: &str, req_id: &str, keys: &[String], ids: &[u32]) {
    let spec = kvferry::sender::TransferSpec::new(req_id, ep, keys.len(), true);
    let bufs: Vec<Vec<u8>> = ids
        .iter()
        .map(|&i| {
            let mut b = Vec::new();
            payloads().fill(chunk_id(7_000, i, 16), &mut b);
            b
        })
        .collect();
    let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    s.store(&spec, keys, &chunks)
        .unwrap_or_else(|e| panic!("store of {req_id}: {e}"));
}

/// Issue 12: a shared prefix. The second request's reply lists a slot only
/// for the keys it must write (skipping the already-sent ones, LMCache's
/// shape); the sender maps them back to their keys, writes those alone
/// and completes. The dedup'd keys sit between written ones, so a sender
/// pairing slots with keys by position would write the wrong chunk.
#[test]
fn shared_prefix_dedup_writes_only_the_new_keys_to_the_right_slots() {
    let proxy = proxy();
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let s = sender(sender_cfg(16, Some(&proxy)));
    let k = |name: &str| format!("dedup-{name}");
    let a_keys = [k("p0"), k("p1"), k("a")];
    store_keys(&s, &ep, "dedup-a", &a_keys, &[0, 1, 2]);
    assert_eq!(terminal(&s, "dedup-a"), RequestStatus::Completed);
    receiver.wait_ready("dedup-a", deadline()).expect("A ready");
    // B: new, shared, new, shared.
    let b_keys = [k("b0"), k("p0"), k("b2"), k("p1")];
    store_keys(&s, &ep, "dedup-b", &b_keys, &[10, 0, 12, 1]);
    assert_eq!(terminal(&s, "dedup-b"), RequestStatus::Completed);
    receiver.wait_ready("dedup-b", deadline()).expect("B ready");
    let st = receiver.stats();
    assert_eq!(st.allocated_chunks, 5, "p0 and p1 are stored once: {st:?}");
    for (key, id) in [("b0", 10), ("b2", 12), ("a", 2), ("p0", 0), ("p1", 1)] {
        let c = receiver
            .get(&k(key))
            .unwrap_or_else(|| panic!("{key} held and ready"));
        assert!(
            payloads().verify(chunk_id(7_000, id, 16), c.bytes()),
            "{key} (slot {}) holds the bytes stored for it",
            c.slot()
        );
    }
    // p0 and p1 carry a second reference (B's pin).
    for key in ["p0", "p1"] {
        assert!(receiver.remove(&k(key)), "B's reference on {key}");
    }
    proxy
        .wait_ready("dedup-a", 1, deadline())
        .expect("A's ProxyNotif");
    proxy
        .wait_ready("dedup-b", 1, deadline())
        .expect("B's ProxyNotif");
    assert_eq!(s.close(deadline()), 0);
    assert_eq!(proxy.count("dedup-a"), 1);
    assert_eq!(proxy.count("dedup-b"), 1);
    wait_receiver_empty(&receiver, "after both dedup requests were consumed");
}

/// `ReceiverConfig::also_listen`: the one socket answers on every endpoint
/// it binds. An in-process sender over `inproc://` (what `kvferry node`
/// does) and a second one over the TCP `listen` endpoint both store
/// requests whose every byte the decoder reads back; a second receiver
/// cannot bind the same inproc name (the error names it).
#[test]
fn a_receiver_answers_on_its_inproc_endpoint_as_on_its_tcp_one() {
    let inproc = format!("inproc://{}", unique("also-listen"));
    let receiver = Receiver::start(ReceiverConfig {
        also_listen: vec![inproc.clone()],
        ..receiver_cfg(16)
    })
    .expect("receiver binds tcp and inproc");
    let tcp = receiver.endpoint().to_owned();
    assert!(
        tcp.starts_with("tcp://"),
        "endpoint() stays listen's: {tcp}"
    );
    let over_inproc = sender(sender_cfg(8, None));
    let over_tcp = sender(sender_cfg(8, None));
    for (n, (s, ep)) in [(&over_inproc, &inproc), (&over_tcp, &tcp)]
        .into_iter()
        .enumerate()
    {
        let req = format!("also-listen-{n}");
        store_request(s, ep, &req, n as u64, 5, 2)
            .unwrap_or_else(|e| panic!("store over {ep} failed: {e}"));
        consume(&receiver, &req, n as u64, 5).unwrap_or_else(|e| panic!("{e}"));
    }
    let err = Receiver::start(ReceiverConfig {
        also_listen: vec![inproc.clone()],
        ..receiver_cfg(4)
    })
    .expect_err("a second receiver cannot bind the same inproc endpoint");
    assert!(err.to_string().contains(&inproc), "error names it: {err}");
}
