//! A [`Request`] handle finds its request by slab key: once the request
//! ended and the table forgot it, its slot goes to a newer request, and the
//! old handle must reach nothing there (a typed error or a no-op).

use std::time::{Duration, Instant};

use crate::receiver::{Receiver, ReceiverConfig};

use super::{RequestSpec, RequestStatus, Sender, SenderConfig, StoreError, SUBMIT_RING};

const CHUNK: usize = 1024;

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// A receiver of 8 slots and a sender with `staging` slots, of [`CHUNK`].
fn pair(staging: usize) -> (Receiver, Sender) {
    let receiver = Receiver::start(ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        capacity_chunks: 8,
        chunk_bytes: CHUNK as u64,
        ..Default::default()
    })
    .expect("receiver");
    let sender = Sender::new(SenderConfig {
        chunk_bytes: CHUNK as u64,
        staging_slots: staging,
        ..Default::default()
    })
    .expect("sender");
    (receiver, sender)
}

#[test]
fn a_stale_handle_never_reaches_the_request_that_reuses_its_slot() {
    let (receiver, sender) = pair(4);
    // Forget every request as soon as it ends, so its slot is reused next.
    sender.shared.table.lock().terminal_memory = 0;

    let old = sender
        .begin(RequestSpec::new("old", receiver.endpoint(), 1))
        .expect("begins");
    old.store(&["old/0"], &[&[1u8; CHUNK][..]]).expect("stored");
    assert_eq!(old.wait(deadline()), RequestStatus::Completed);
    receiver.wait_ready("old", deadline()).expect("old ready");
    // The table forgot it at once (its slot is free for `new`); its name
    // goes at the end of ctrl's step, after the table lock is released.
    let end = deadline();
    while sender.status("old").is_some() {
        assert!(
            Instant::now() < end,
            "the name of the forgotten request stays"
        );
        std::thread::sleep(Duration::from_millis(1));
    }

    let new = sender
        .begin(RequestSpec::new("new", receiver.endpoint(), 2))
        .expect("begins");
    assert_eq!(
        old.h.key.index(),
        new.h.key.index(),
        "the new request took the old one's slot"
    );
    assert_ne!(old.h.key, new.h.key, "with another generation");

    // Everything the old handle can do reaches nothing.
    assert!(!old.cancel(), "cancelling the ended request is a no-op");
    assert_eq!(
        old.store(&["old/1"], &[&[2u8; CHUNK][..]]),
        Err(StoreError::RequestEnded(RequestStatus::Completed))
    );
    assert!(matches!(
        old.try_stage(1),
        Err(StoreError::RequestEnded(RequestStatus::Completed))
    ));
    assert!(matches!(
        old.stage(1, deadline()),
        Err(StoreError::RequestEnded(RequestStatus::Completed))
    ));
    assert_eq!(old.status(), RequestStatus::Completed);

    // The new request is untouched: nothing reserved, not cancelled.
    assert_eq!(new.status(), RequestStatus::InProgress);
    let mut batch = new.stage(2, deadline()).expect("staging");
    for (i, slot) in batch.slots_mut().enumerate() {
        slot.fill(10 + i as u8);
    }
    batch
        .submit(&["new/0", "new/1"], &[CHUNK as u32, CHUNK as u32])
        .expect("submitted");
    assert_eq!(new.wait(deadline()), RequestStatus::Completed);
    receiver.wait_ready("new", deadline()).expect("new ready");
    for (key, byte) in [("old/0", 1u8), ("new/0", 10), ("new/1", 11)] {
        let c = receiver.get(key).unwrap_or_else(|| panic!("{key} missing"));
        assert_eq!(c.bytes(), &[byte; CHUNK][..], "{key}'s bytes");
    }
    assert!(
        receiver.get("old/1").is_none(),
        "the stale store sent nothing"
    );
    assert_eq!(sender.close(deadline()), 0);
}

#[test]
fn a_full_submission_ring_makes_the_caller_wait_until_its_deadline_then_drains() {
    // Nothing listens there: once ctrl runs, every request fails at once
    // (the handshake's connect, or the Hello's answer timeout).
    let nowhere = "tcp://127.0.0.1:9";
    let sender = Sender::new(SenderConfig {
        chunk_bytes: CHUNK as u64,
        staging_slots: 4,
        staging_timeout: Duration::from_millis(200),
        hello_answer_timeout: Duration::from_millis(200),
        ..Default::default()
    })
    .map(std::sync::Arc::new)
    .expect("sender");
    let held = sender.shared.inbox.hold();
    // Every begin puts its admission message on the ring; ctrl takes none.
    let mut reqs = Vec::with_capacity(SUBMIT_RING);
    for i in 0..SUBMIT_RING {
        let spec = RequestSpec::new(format!("full-{i}"), nowhere, 1);
        reqs.push(sender.begin(spec).expect("room in the ring"));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let s = std::sync::Arc::clone(&sender);
    let waiter = std::thread::spawn(move || {
        let r = s.begin(RequestSpec::new("one-too-many", nowhere, 1));
        let _ = tx.send(r.map(|r| r.id().to_owned()));
    });
    let got = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a begin on a full submission ring hung past 30 s (its wait has no deadline)");
    assert_eq!(got, Err(StoreError::StagingTimeout));
    waiter.join().expect("no panic");
    assert_eq!(sender.status("one-too-many"), None, "not registered");
    drop(held);
    // ctrl drains the ring: every request reaches its (failed) end.
    for r in [&reqs[0], &reqs[SUBMIT_RING - 1]] {
        assert!(
            matches!(r.wait(deadline()), RequestStatus::Failed { .. }),
            "{} ended",
            r.id()
        );
    }
    drop(reqs);
    let sender = std::sync::Arc::try_unwrap(sender).expect("the waiter's clone is gone");
    assert_eq!(sender.close(deadline()), 0);
}

/// Two callers feed one request of 8 chunks: A reserved 4 and waits for
/// staging, B stores the last 4 meanwhile; then A gives its 4 back (its
/// wait timed out). No batch can take their place any more (after the
/// last), so the request must fail, not complete without them.
#[test]
fn a_batch_given_back_after_the_last_one_was_stored_fails_the_request() {
    let (receiver, sender) = pair(8);
    let req = sender
        .begin(RequestSpec::new("fed-twice", receiver.endpoint(), 8))
        .expect("begins");
    // A's reservation, as `store` makes it before its staging wait.
    assert_eq!(req.h.stored.reserve(4, 8, None), Ok(false));
    // B stores the last 4 chunks.
    let keys: Vec<String> = (4..8).map(|i| format!("fed-twice/{i}")).collect();
    let chunk = [7u8; CHUNK];
    req.store(&keys, &[&chunk[..]; 4])
        .expect("B's batch stored");
    // A's wait timed out: it gives its 4 chunks back.
    sender.shared.give_back(&req.h, 4, false);
    match req.wait(deadline()) {
        RequestStatus::Failed { code, .. } => {
            assert_eq!(code, crate::protocol::ErrorCode::InconsistentRequest)
        }
        other => panic!("the request ended {other:?}, not failed"),
    }
    assert!(
        receiver
            .wait_ready("fed-twice", Instant::now() + Duration::from_secs(2))
            .is_err(),
        "the decoder never sees the request as ready"
    );
    assert_eq!(sender.close(deadline()), 0);
}

/// A cancel that finds the submission ring full cannot send its key to
/// ctrl: it raises the attention-overflow flag instead (no wait), and ctrl,
/// once it drains the ring, finds the cancelled request by its life word.
/// The request is admitted and idle, so nothing else would ever make ctrl
/// look at it: without the flag it would stay in progress for good.
#[test]
fn a_cancel_on_a_full_submission_ring_still_reaches_ctrl() {
    let receiver = Receiver::start(ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        capacity_chunks: 8,
        chunk_bytes: CHUNK as u64,
        ..Default::default()
    })
    .expect("receiver");
    let sender = Sender::new(SenderConfig {
        chunk_bytes: CHUNK as u64,
        staging_slots: 4,
        hello_answer_timeout: Duration::from_millis(200),
        ..Default::default()
    })
    .expect("sender");
    let idle = sender
        .begin(RequestSpec::new("idle", receiver.endpoint(), 2))
        .expect("begins");
    let end = deadline();
    while !idle.is_admitted() {
        assert!(Instant::now() < end, "the request was never admitted");
        std::thread::sleep(Duration::from_millis(1));
    }
    let held = sender.shared.inbox.hold();
    // Fill the ring with admission messages of requests to nowhere (they
    // fail once ctrl runs again).
    let nowhere = "tcp://127.0.0.1:9";
    let fillers: Vec<_> = (0..SUBMIT_RING)
        .map(|i| {
            sender
                .begin(RequestSpec::new(format!("filler-{i}"), nowhere, 1))
                .expect("room in the ring")
        })
        .collect();
    assert!(idle.cancel(), "the cancel wins at once, ring full or not");
    assert!(
        sender
            .shared
            .attention_overflow
            .load(std::sync::atomic::Ordering::Acquire),
        "the key did not fit: the flag is up"
    );
    assert!(!sender.cancel_request("idle"), "cancelled once");
    drop(held);
    assert_eq!(idle.wait(deadline()), RequestStatus::Cancelled);
    assert_eq!(
        receiver.wait_ready("idle", deadline()),
        Err(crate::receiver::WaitError::Failed(
            crate::protocol::ErrorCode::Cancelled
        )),
        "the receiver was told (CancelNotif)"
    );
    for r in [&fillers[0], &fillers[SUBMIT_RING - 1]] {
        assert!(r.wait(deadline()).is_terminal(), "{} ended", r.id());
    }
    drop(fillers);
    assert_eq!(sender.close(deadline()), 0);
}
