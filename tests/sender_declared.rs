//! A request's first batch declared at begin (`Sender::begin_declared`):
//! the admission AllocRequest carries its keys, so the batch needs no
//! AllocRequest of its own, and its bytes follow with
//! `StagedBatch::submit_declared`. Every byte is checked at a real
//! receiver, over shm and over TCP; the AllocRequests sent are counted by
//! the sender's `pending` stage (one sample per AllocRequest).

#[path = "common_sender/mod.rs"]
mod common;

use common::*;
use kvferry::receiver::Receiver;
use kvferry::sender::{Request, RequestSpec, RequestStatus, Sender, StoreError};

/// The keys of chunks `range` of request number `request` of `total`.
fn keys(req_id: &str, request: u64, range: std::ops::Range<u32>, total: u32) -> Vec<String> {
    range.map(|i| key(req_id, request, i, total)).collect()
}

/// The lengths of chunks `range` of request number `request` of `total`
/// (whole, but for a request's last chunk).
fn lens(request: u64, range: std::ops::Range<u32>, total: u32) -> Vec<u32> {
    range
        .map(|i| payloads().len_of(chunk_id(request, i, total)) as u32)
        .collect()
}

/// Stages `slots` slots of `req` and fills slot `k` with chunk
/// `range.start + k` of request number `request` (as many as `range`).
fn staged(
    req: &Request,
    request: u64,
    range: std::ops::Range<u32>,
    total: u32,
    slots: usize,
) -> kvferry::sender::StagedBatch {
    let mut batch = req.stage(slots, deadline()).expect("staged");
    for (slot, i) in batch.slots_mut().zip(range) {
        payloads().fill_slice(chunk_id(request, i, total), slot);
    }
    batch
}

/// AllocRequests the sender sent so far.
fn alloc_requests(s: &Sender) -> u64 {
    s.stats().stages.pending.count
}

/// Requests of 5 chunks, the first 3 declared, the last 2 (the last one
/// short) submitted as a plain batch; and requests of 4 chunks, all
/// declared.
fn run(receiver: &Receiver, s: &Sender) {
    let ep = receiver.endpoint().to_owned();
    for request in 0..6u64 {
        let id = unique("declared");
        let (total, declared) = if request % 2 == 0 { (5, 3) } else { (4, 4) };
        let before = alloc_requests(s);
        let spec = RequestSpec::new(id.clone(), ep.clone(), total as usize);
        let first = lens(request, 0..declared, total);
        let req = s
            .begin_declared(spec, &keys(&id, request, 0..declared, total), &first, None)
            .expect("begins");
        staged(&req, request, 0..declared, total, declared as usize)
            .submit_declared()
            .expect("the declared batch goes");
        if declared < total {
            staged(&req, request, declared..total, total, 2)
                .submit(
                    &keys(&id, request, declared..total, total),
                    &lens(request, declared..total, total),
                )
                .expect("the second batch goes");
        }
        assert_eq!(req.wait(deadline()), RequestStatus::Completed, "{id}");
        let sent = alloc_requests(s) - before;
        let batches = if declared < total { 2 } else { 1 };
        assert_eq!(
            sent, batches,
            "{id}: one AllocRequest per batch, the declared one being the admission"
        );
        consume(receiver, &id, request, total).expect("every byte");
    }
    wait_sender_empty(s, "after the declared requests");
    wait_receiver_empty(receiver, "after the declared requests were consumed");
}

#[test]
fn a_declared_batch_goes_with_the_admission_over_shm() {
    let receiver = receiver(16);
    let s = sender(sender_cfg(8, None));
    run(&receiver, &s);
    // A plain request for comparison: two AllocRequests for one batch.
    let id = unique("plain");
    let before = alloc_requests(&s);
    let req = s
        .begin(RequestSpec::new(id.clone(), receiver.endpoint(), 1))
        .expect("begins");
    staged(&req, 99, 0..1, 1, 1)
        .submit(&keys(&id, 99, 0..1, 1), &lens(99, 0..1, 1))
        .expect("submitted");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    assert_eq!(alloc_requests(&s) - before, 2, "admission, then the batch");
    consume(&receiver, &id, 99, 1).expect("every byte");
}

#[test]
fn a_declared_batch_goes_with_the_admission_over_tcp() {
    let (receiver, s) = tcp_pair(16, 8);
    run(&receiver, &s);
}

/// The receiver holds two of the declared keys already (another request
/// stored them): its reply names slots for the other two only, and the
/// declared batch's bytes for those two land in the right slots.
#[test]
fn declared_keys_the_receiver_holds_are_not_written() {
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let s = sender(sender_cfg(8, None));
    let k = |name: &str| format!("decl-dedup-{name}");
    let spec = kvferry::sender::TransferSpec::new("decl-dedup-a", &ep, 2, true);
    let mut p = (Vec::new(), Vec::new());
    payloads().fill(chunk_id(8_000, 0, 16), &mut p.0);
    payloads().fill(chunk_id(8_000, 1, 16), &mut p.1);
    s.store(&spec, &[k("p0"), k("p1")], &[&p.0, &p.1])
        .expect("A stored");
    assert_eq!(terminal(&s, "decl-dedup-a"), RequestStatus::Completed);
    receiver.wait_ready("decl-dedup-a", deadline()).expect("A");

    // B: new, shared, new, shared (whole chunks: not a request's last).
    let b_keys = [k("b0"), k("p0"), k("b2"), k("p1")];
    let full = [CHUNK as u32; 4];
    let req = s
        .begin_declared(
            RequestSpec::new("decl-dedup-b", &ep, 4),
            &b_keys,
            &full,
            None,
        )
        .expect("B begins");
    let mut batch = req.stage(4, deadline()).expect("staged");
    for (slot, id) in batch.slots_mut().zip([10, 0, 12, 1]) {
        payloads().fill_slice(chunk_id(8_000, id, 16), slot);
    }
    batch.submit_declared().expect("B's bytes");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    receiver.wait_ready("decl-dedup-b", deadline()).expect("B");
    assert_eq!(receiver.stats().allocated_chunks, 4, "p0, p1 stored once");
    for (name, id) in [("b0", 10), ("b2", 12), ("p0", 0), ("p1", 1)] {
        let c = receiver.get(&k(name)).expect("held");
        assert!(
            payloads().verify(chunk_id(8_000, id, 16), c.bytes()),
            "{name} (slot {}) holds its own bytes",
            c.slot()
        );
    }
    // Each read above released one reference; p0 and p1 carry B's too.
    for name in ["p0", "p1"] {
        assert!(receiver.remove(&k(name)), "B's reference on {name}");
    }
    wait_sender_empty(&s, "after B");
    wait_receiver_empty(&receiver, "after both requests were consumed");
}

/// Every refusal is typed and registers nothing: the same id begins
/// afterwards.
#[test]
fn a_bad_declaration_is_refused_and_registers_nothing() {
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let s = sender(sender_cfg(4, None));
    let spec = |total| RequestSpec::new("decl-bad", &ep, total);
    let full = CHUNK as u32;
    let none: [&str; 0] = [];
    let cases: Vec<(Result<Request, StoreError>, &str)> = vec![
        (
            s.begin_declared(spec(2), &none, &[], None),
            "EmptyDeclaredBatch",
        ),
        (
            s.begin_declared(spec(2), &["a"], &[full, full], None),
            "KeyCountMismatch",
        ),
        (
            s.begin_declared(spec(1), &["a", "b"], &[full, full], None),
            "TooManyChunks",
        ),
        (
            s.begin_declared(spec(9), &["a", "b", "c", "d", "e"], &[full; 5], None),
            "BatchTooLarge",
        ),
        (
            s.begin_declared(spec(3), &["a", "b"], &[10, full], None),
            "ShortChunk",
        ),
        (
            s.begin_declared(spec(3), &["a"], &[full + 1], None),
            "ChunkTooLarge",
        ),
        (
            s.begin_declared(spec(3), &["a"], &[100], Some(99)),
            "LastChunkTokens",
        ),
        (
            s.begin_declared(spec(3), &["a"], &[100], Some(-1)),
            "TokensOutOfRange",
        ),
        (
            s.begin_declared(spec(0), &["a"], &[full], None),
            "ZeroTotalChunks",
        ),
    ];
    for (got, want) in cases {
        let e = got.expect_err(want);
        assert!(format!("{e:?}").starts_with(want), "{want}: got {e:?}");
    }
    assert_eq!(s.active_requests(), 0, "nothing registered");
    // The id is free, and a declaration with tokens given goes.
    let req = s
        .begin_declared(spec(1), &["decl-bad/0"], &[100], Some(100))
        .expect("begins");
    staged(&req, 5, 0..0, 1, 1).submit_declared().expect("goes");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    assert!(receiver.remove("decl-bad/0"));
}

/// `submit_declared` on a request without a declaration, twice, or from a
/// batch with too few slots: typed errors, slots back, and the
/// declaration stays open after the short batch.
#[test]
fn submit_declared_refuses_what_was_not_declared() {
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let s = sender(sender_cfg(8, None));

    let plain = s
        .begin(RequestSpec::new("decl-none", &ep, 1))
        .expect("begins");
    let e = staged(&plain, 1, 0..1, 1, 1)
        .submit_declared()
        .expect_err("nothing declared");
    assert!(matches!(e, StoreError::NoDeclaredBatch { .. }), "{e:?}");
    assert_eq!(s.staging_in_use(), 0, "the slots went back");
    assert!(plain.cancel());

    let req = s
        .begin_declared(
            RequestSpec::new("decl-twice", &ep, 3),
            &keys("decl-twice", 2, 0..2, 3),
            &lens(2, 0..2, 3),
            None,
        )
        .expect("begins");
    let e = staged(&req, 2, 0..1, 3, 1)
        .submit_declared()
        .expect_err("one slot for two chunks");
    assert!(
        matches!(
            e,
            StoreError::MoreChunksThanSlots {
                chunks: 2,
                slots: 1
            }
        ),
        "{e:?}"
    );
    assert_eq!(s.staging_in_use(), 0, "the slots went back");
    // Still open: three slots, the third goes back.
    staged(&req, 2, 0..2, 3, 3)
        .submit_declared()
        .expect("the declared batch goes");
    let e = staged(&req, 2, 2..3, 3, 1)
        .submit_declared()
        .expect_err("submitted already");
    assert!(matches!(e, StoreError::NoDeclaredBatch { .. }), "{e:?}");
    staged(&req, 2, 2..3, 3, 1)
        .submit(&keys("decl-twice", 2, 2..3, 3), &lens(2, 2..3, 3))
        .expect("the last batch");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    consume(&receiver, "decl-twice", 2, 3).expect("every byte");
    wait_sender_empty(&s, "after the refusals");
}

/// Cancelled while its declared batch's receiver slots are allocated and
/// its bytes not yet submitted: the fenced abort releases them at the
/// receiver, and a late submit is refused with its slots back.
#[test]
fn a_declared_request_cancelled_before_its_bytes_releases_everything() {
    let receiver = receiver(16);
    let ep = receiver.endpoint().to_owned();
    let s = sender(sender_cfg(8, None));
    let full = CHUNK as u32;
    let req = s
        .begin_declared(
            RequestSpec::new("decl-cancel", &ep, 4),
            &keys("decl-cancel", 3, 0..3, 4),
            &[full; 3],
            None,
        )
        .expect("begins");
    let batch = staged(&req, 3, 0..3, 4, 3);
    wait_for("the receiver to allocate the declared slots", || {
        receiver.stats().allocated_chunks == 3
    });
    assert!(req.cancel(), "live");
    let st = req.wait(deadline());
    assert_eq!(st, RequestStatus::Cancelled, "{st:?}");
    let e = batch.submit_declared().expect_err("cancelled");
    assert!(
        matches!(e, StoreError::RequestEnded(_) | StoreError::Cancelled),
        "{e:?}"
    );
    wait_sender_empty(&s, "after the cancel");
    wait_receiver_empty(&receiver, "after the cancel");
}
