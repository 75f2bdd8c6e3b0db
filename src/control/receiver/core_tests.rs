//! Unit tests of the receiver core, message by message, with a fake clock.

use std::time::{Duration, Instant};

use super::core::{CoreConfig, Outcome, Output, ReceiverCore};
use crate::protocol::{
    AllocRequest, AllocResponse, CancelNotif, Descriptor, ErrorCode, Heartbeat, Hello, Message,
    TransferDone,
};

const P: &[u8] = b"peer-a";
const Q: &[u8] = b"peer-b";

fn cfg(capacity: usize) -> CoreConfig {
    CoreConfig {
        receiver_id: "r".into(),
        capacity_chunks: capacity,
        chunk_bytes: 1024,
        admission_timeout: Duration::from_secs(60),
        lease: Duration::from_secs(30),
        quarantine_grace: Duration::from_secs(10),
        transport: "shm".into(),
        descriptor: Descriptor::None,
        other_transports: Vec::new(),
        answer_hello: true,
        auto_consume: false,
        bounds: super::bounds::Bounds::default(),
        consume_grace: Duration::from_secs(1),
    }
}

fn batch(req: &str, keys: &[&str], total: i64, last: bool, seq: Option<u64>) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: keys.iter().map(|k| k.to_string()).collect(),
        fmt: 1,
        shape: vec![1024],
        dtype: "uint8".into(),
        last_chunk_toks: 1024,
        req_id: req.into(),
        is_last_batch: last,
        total_chunks: total,
        seq,
    })
}

fn replies(out: &mut Vec<Output>) -> Vec<(Vec<u8>, AllocResponse)> {
    let mut v = Vec::new();
    out.retain(|o| match o {
        Output::Send {
            peer,
            message: Message::AllocResponse(r),
        } => {
            v.push((peer.clone(), r.clone()));
            false
        }
        _ => true,
    });
    v
}

fn one_reply(out: &mut Vec<Output>) -> AllocResponse {
    let r = replies(out);
    assert_eq!(r.len(), 1, "expected exactly one reply, got {r:?}");
    r.into_iter()
        .next()
        .map(|(_, r)| r)
        .unwrap_or_else(|| unreachable!())
}

/// LMCache 0.5.6's sender checks on a reply to a batch of `n_keys` keys
/// (`PDBackendAsync._async_transfer_task`), written out independently of
/// `protocol::placement`: every `already_sent_indexes` entry in
/// `0..n_keys`, and `len(remote_indexes) == n_keys - len(set(already_sent))`.
#[track_caller]
fn assert_lmcache_accepts(n_keys: usize, r: &AllocResponse) {
    let already: std::collections::HashSet<i64> = r.already_sent_indexes.iter().copied().collect();
    assert!(
        already.iter().all(|&i| i >= 0 && (i as usize) < n_keys),
        "invalid already_sent_indexes for {n_keys} keys: {r:?}"
    );
    assert_eq!(
        r.remote_indexes.len(),
        n_keys - already.len(),
        "AllocResponse inconsistency for {n_keys} keys: {r:?}"
    );
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Consumes every key like a decoder.
fn consume(core: &mut ReceiverCore, ks: &[String], now: Instant, out: &mut Vec<Output>) {
    for k in ks {
        assert!(core.remove_key(k, now, out), "key {k} should be held");
    }
}

#[test]
fn seed_example_b_waits_for_a() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    let (a, b) = (keys("a", 8), keys("b", 8));
    c.handle(P, batch("A", &refs(&a[..4]), 8, false, None), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    c.handle(Q, batch("B", &refs(&b[..4]), 8, false, None), t0, &mut out);
    assert!(
        replies(&mut out).is_empty(),
        "B does not fit and must be parked, unanswered"
    );
    assert_eq!(c.stats().parked_requests, 1);
    c.handle(P, batch("A", &refs(&a[4..]), 8, true, None), t0, &mut out);
    assert!(
        !one_reply(&mut out).is_failure(),
        "A's later batch is never blocked by B"
    );
    assert!(out.iter().any(
        |o| matches!(o, Output::Finished { req_id, outcome: Outcome::Ready } if req_id == "A")
    ));
    out.clear();
    // A's chunks are still held until the decoder consumes them.
    assert!(replies(&mut out).is_empty());
    consume(&mut c, &a[..5], t0, &mut out);
    assert!(
        replies(&mut out).is_empty(),
        "2 free + 5 freed = 7 slots: B (8) still waits"
    );
    consume(&mut c, &a[5..6], t0, &mut out);
    let r = one_reply(&mut out);
    assert!(!r.is_failure(), "B admitted once A's slots are free");
    assert_eq!(r.remote_indexes.len(), 4);
    consume(&mut c, &a[6..], t0, &mut out);
    c.handle(Q, batch("B", &refs(&b[4..]), 8, true, None), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    consume(&mut c, &b, t0, &mut out);
    let l = c.ledger().stats();
    assert_eq!((l.committed, l.reserved, l.allocated), (0, 0, 0));
    assert_eq!(c.stats().slots_in_use, 0);
}

#[test]
fn zero_and_oversized_requests_are_refused_at_once() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, batch("Z", &["k"], 0, true, Some(7)), t0, &mut out);
    let r = one_reply(&mut out);
    assert_eq!(r.code.as_deref(), Some(ErrorCode::ZeroTotalChunks.as_str()));
    assert_eq!(r.remote_indexes, vec![-1]);
    assert_eq!(r.seq, Some(7), "seq is echoed on failures too");
    c.handle(P, batch("L", &["k1", "k2"], 5, false, None), t0, &mut out);
    let r = one_reply(&mut out);
    assert_eq!(r.code.as_deref(), Some(ErrorCode::BufferTooSmall.as_str()));
    assert_eq!(r.remote_indexes, vec![-1, -1]);
    assert!(r
        .error
        .as_deref()
        .is_some_and(|e| e.contains("buffer too small")));
    assert_eq!(c.ledger().stats().committed, 0);
    assert_eq!(c.stats().tracked_requests, 0);
}

#[test]
fn protocol_violation_rolls_back_everything() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["a0", "a1"], 3, false, None), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    c.handle(P, batch("A", &["a2", "a3"], 3, true, None), t0, &mut out);
    let r = one_reply(&mut out);
    assert_eq!(
        r.code.as_deref(),
        Some(ErrorCode::ProtocolViolation.as_str())
    );
    assert_eq!(r.remote_indexes, vec![-1, -1]);
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Finished {
            outcome: Outcome::Failed(ErrorCode::ProtocolViolation),
            ..
        }
    )));
    // LMCache peer (no Hello): granted slots are quarantined until the grace
    // passes, since writes into them may still land.
    let l = c.ledger().stats();
    assert_eq!(l.reserved, 0);
    assert_eq!(c.stats().quarantined_slots, 2);
    assert_eq!(c.stats().keys, 0);
    // Later batches of the failed request keep getting its error.
    c.handle(P, batch("A", &["a9"], 3, true, None), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::ProtocolViolation.as_str())
    );
    c.tick(t0 + Duration::from_secs(11), &mut out);
    assert_eq!(c.ledger().stats().committed, 0);
    assert_eq!(c.stats().slots_in_use, 0);
}

#[test]
fn changed_total_and_batch_after_last_are_errors() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["a0"], 3, false, Some(1)), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    c.handle(P, batch("A", &["a1"], 4, false, Some(2)), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::InconsistentRequest.as_str())
    );
    c.handle(
        P,
        Message::CancelNotif(CancelNotif {
            req_id: "A".into(),
            keys: vec![],
            seq: Some(3),
        }),
        t0,
        &mut out,
    );
    assert_eq!(one_reply(&mut out).remote_indexes, Vec::<i64>::new());
    assert_eq!(
        c.ledger().stats().committed,
        0,
        "CancelNotif is the fence that frees quarantined slots"
    );

    c.handle(P, batch("B", &["b0"], 1, true, Some(4)), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    c.handle(P, batch("B", &["b1"], 1, true, Some(5)), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::ProtocolViolation.as_str())
    );
}

fn hello() -> Message {
    Message::Hello(Hello {
        sender_id: "s1".into(),
        version: crate::protocol::PROTOCOL_VERSION,
        transport: "shm".into(),
        descriptor: Descriptor::None,
    })
}

#[test]
fn dedup_pins_and_reports_already_sent() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["x", "y"], 2, true, None), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, batch("B", &["y", "z"], 2, true, None), t0, &mut out);
    let rb = one_reply(&mut out);
    assert_eq!(rb.already_sent_indexes, vec![0]);
    // One slot per key to write, skipping the already-sent one (issue 12:
    // `[y's slot, z's slot]` made LMCache's sender abort the request).
    assert_lmcache_accepts(2, &rb);
    assert_eq!(rb.remote_indexes.len(), 1, "only z is written: {rb:?}");
    assert!(
        !ra.remote_indexes.contains(&rb.remote_indexes[0]),
        "z gets its own slot"
    );
    // y has two references: one remove keeps it, the second frees it.
    assert!(c.remove_key("y", t0, &mut out));
    assert!(c.is_ready("y"));
    assert!(c.remove_key("y", t0, &mut out));
    assert!(!c.is_ready("y"));
    assert!(c.remove_key("x", t0, &mut out));
    assert!(c.remove_key("z", t0, &mut out));
    assert!(!c.remove_key("z", t0, &mut out), "no reference left");
    assert_eq!(c.ledger().stats().committed, 0);
}

#[test]
fn dedup_counts_toward_total_chunks() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["x"], 1, true, None), t0, &mut out);
    one_reply(&mut out);
    c.handle(Q, batch("B", &["x"], 1, false, None), t0, &mut out);
    assert_eq!(one_reply(&mut out).already_sent_indexes, vec![0]);
    c.handle(Q, batch("B", &["w"], 1, true, None), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::ProtocolViolation.as_str())
    );
    // B's pin on x is dropped by the rollback; A's reference remains.
    assert!(c.remove_key("x", t0, &mut out));
    assert!(!c.remove_key("x", t0, &mut out));
}

fn done(req: &str) -> Message {
    Message::TransferDone(TransferDone {
        req_id: req.into(),
        seq: None,
    })
}

fn cancel(req: &str, seq: u64) -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: req.into(),
        keys: vec![],
        seq: Some(seq),
    })
}

/// Finding 2 of docs/model-check.md: a kvferry writer's key is not "already
/// sent" until its TransferDone; a request asking for it meanwhile writes
/// its own copy.
#[test]
fn dedup_only_against_written_keys() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    c.handle(Q, hello(), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["k", "a"], 2, true, Some(1)), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, batch("B", &["k", "b"], 2, true, Some(1)), t0, &mut out);
    let rb = one_reply(&mut out);
    assert!(
        rb.already_sent_indexes.is_empty(),
        "A is still writing k: B must write its own copy"
    );
    assert_ne!(rb.remote_indexes[0], ra.remote_indexes[0], "a fresh slot");
    assert_eq!(c.stats().keys, 4, "k has two copies");
    assert_eq!(c.ledger().stats().allocated, 4);
    c.handle(P, done("A"), t0, &mut out);
    // Now A's copy is written: a third request is told "already sent".
    c.handle(Q, batch("C", &["k"], 1, true, Some(2)), t0, &mut out);
    let rc = one_reply(&mut out);
    assert_eq!(rc.already_sent_indexes, vec![0]);
    assert_lmcache_accepts(1, &rc);
    assert!(rc.remote_indexes.is_empty(), "nothing to write: {rc:?}");
    // B's copy is not readable until B's TransferDone; A's is.
    let first = c.borrow("k").expect("A's copy is ready");
    assert_eq!(i64::from(first.slot), ra.remote_indexes[0]);
    let second = c.borrow("k").expect("A's copy has C's pin too");
    assert_eq!(second.gen, first.gen);
    assert!(c.borrow("k").is_none(), "B's copy is still being written");
    c.handle(Q, done("B"), t0, &mut out);
    let third = c.borrow("k").expect("B's copy is ready");
    assert_eq!(i64::from(third.slot), rb.remote_indexes[0]);
    for b in [first, second, third] {
        c.end_borrow("k", b.gen, t0, &mut out);
    }
    consume(&mut c, &["a".into(), "b".into()], t0, &mut out);
    assert_eq!(c.stats().keys, 0);
    assert_eq!(c.ledger().stats().committed, 0);
    assert_eq!(c.stats().slots_in_use, 0);
}

/// A batch of `keys` of request `req` whose last chunk is `toks` tokens of
/// `[512]` of `bfloat16` (1024-byte chunks).
fn bf16_batch(req: &str, keys: &[&str], total: i64, toks: i64) -> Message {
    Message::AllocRequest(AllocRequest {
        shape: vec![512],
        dtype: "bfloat16".into(),
        last_chunk_toks: toks,
        ..match batch(req, keys, total, true, None) {
            Message::AllocRequest(r) => r,
            _ => unreachable!(),
        }
    })
}

/// Dedup only against a copy of the same length: a request that asks for
/// a key as a chunk of another length than the written copy (here a whole
/// chunk, where the copy is a 50-token last chunk, and a 20-token one)
/// writes its own copy; its decoder reads the chunk as its own batch sized
/// it, so a pin would hand it bytes past the copy's or cut them. Before,
/// the pin matched on the key alone. The same for anonymous allocations.
#[test]
fn dedup_only_against_a_copy_of_the_same_length() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(10), t0);
    let mut out = Vec::new();
    // LMCache peers: ready at allocation.
    c.handle(P, bf16_batch("A", &["k"], 1, 50), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, bf16_batch("B", &["k", "x"], 2, 512), t0, &mut out);
    let rb = one_reply(&mut out);
    assert!(rb.already_sent_indexes.is_empty(), "whole, not 50 tokens");
    c.handle(Q, bf16_batch("C", &["k"], 1, 20), t0, &mut out);
    let rc = one_reply(&mut out);
    assert!(rc.already_sent_indexes.is_empty(), "20 tokens, not 50");
    c.handle(Q, bf16_batch("D", &["k"], 1, 50), t0, &mut out);
    let rd = one_reply(&mut out);
    assert_eq!(rd.already_sent_indexes, vec![0], "50 tokens: A's copy");
    assert_lmcache_accepts(1, &rd);
    // Anonymous: each key against the copy of its own length.
    c.handle(Q, bf16_batch("", &["k", "y"], 0, 20), t0, &mut out);
    let rn = one_reply(&mut out);
    assert_eq!(rn.already_sent_indexes, vec![0], "k whole: B's copy");
    c.handle(Q, bf16_batch("", &["k"], 0, 30), t0, &mut out);
    let rn2 = one_reply(&mut out);
    assert!(rn2.already_sent_indexes.is_empty(), "no 30-token copy");
    let slots: std::collections::HashSet<i64> = [&ra, &rb, &rc, &rn, &rn2]
        .iter()
        .flat_map(|r| r.remote_indexes.iter().copied())
        .collect();
    // k four times (50 and 20 tokens, whole, 30 tokens), x and y.
    assert_eq!(slots.len(), 6, "six copies, each in its own slot");
    assert_eq!(c.stats().slots_in_use, 6);
    // One anonymous batch naming a new key at two lengths: two copies,
    // both reserved (not a failed second slot).
    c.handle(Q, bf16_batch("", &["j", "j"], 0, 10), t0, &mut out);
    let rj = one_reply(&mut out);
    assert!(rj.already_sent_indexes.is_empty(), "{rj:?}");
    assert_eq!(rj.remote_indexes.len(), 2, "{rj:?}");
    assert!(rj.remote_indexes.iter().all(|&s| s >= 0), "{rj:?}");
    assert_eq!(c.stats().slots_in_use, 8);
}

/// Anonymous allocations follow the same rule.
#[test]
fn anonymous_batches_do_not_pin_a_key_being_written() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["k"], 1, true, Some(1)), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, batch("", &["k"], 0, false, None), t0, &mut out);
    let rn = one_reply(&mut out);
    assert!(rn.already_sent_indexes.is_empty());
    assert_ne!(rn.remote_indexes[0], ra.remote_indexes[0]);
    assert_eq!(c.ledger().stats().allocated, 2, "two copies, two slots");
    c.handle(P, done("A"), t0, &mut out);
    c.handle(Q, batch("", &["j", "k"], 0, false, None), t0, &mut out);
    let rd = one_reply(&mut out);
    assert_eq!(rd.already_sent_indexes, vec![1]);
    assert_lmcache_accepts(2, &rd);
    assert_eq!(rd.remote_indexes.len(), 1, "only j is written: {rd:?}");
}

/// Finding 3 of docs/model-check.md: a writer that aborts only releases its
/// own copy; the request that wrote the key concurrently keeps its slot.
#[test]
fn an_aborted_writer_frees_only_its_own_copy() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(6), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    c.handle(Q, hello(), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["k"], 3, false, Some(1)), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, batch("B", &["k", "b"], 3, false, Some(1)), t0, &mut out);
    let rb = one_reply(&mut out);
    assert!(rb.already_sent_indexes.is_empty());
    c.handle(P, cancel("A", 2), t0, &mut out);
    out.clear();
    assert_eq!(c.stats().slots_in_use, 2, "only A's copy went");
    // A's slot may be granted again; B's never, while B holds it.
    c.handle(Q, batch("B", &["b2"], 3, true, Some(2)), t0, &mut out);
    let rb2 = one_reply(&mut out);
    assert!(!rb.remote_indexes.contains(&rb2.remote_indexes[0]));
    assert_eq!(
        rb2.remote_indexes[0], ra.remote_indexes[0],
        "A's freed slot"
    );
    c.handle(Q, done("B"), t0, &mut out);
    let k = c.borrow("k").expect("B's copy is ready");
    assert_eq!(i64::from(k.slot), rb.remote_indexes[0]);
    c.end_borrow("k", k.gen, t0, &mut out);
    consume(&mut c, &["b".into(), "b2".into()], t0, &mut out);
    assert_eq!(c.stats().slots_in_use, 0);
    assert_eq!(c.ledger().stats().committed, 0);
}

/// An LMCache peer's keys are ready (pinnable) from allocation on, so a
/// failed LMCache writer's copy may be pinned: the slot stays until the
/// last reference goes, past the end of the writer's quarantine.
#[test]
fn a_failed_writer_never_frees_a_slot_another_request_holds() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(3), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["k"], 2, false, None), t0, &mut out);
    let ra = one_reply(&mut out);
    c.handle(Q, batch("B", &["k"], 1, true, None), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).already_sent_indexes,
        vec![0],
        "LMCache semantics: pinned at once"
    );
    // A breaks its total: rolled back, its granted slot quarantined.
    c.handle(P, batch("A", &["x", "y"], 2, true, None), t0, &mut out);
    out.clear();
    assert_eq!(c.stats().quarantined_slots, 1);
    assert!(c.borrow("k").is_none(), "A's bytes are not whole");
    c.tick(t0 + Duration::from_secs(11), &mut out);
    assert_eq!(c.stats().quarantined_slots, 0);
    assert_eq!(
        c.stats().slots_in_use,
        1,
        "B's pin still holds the slot after the quarantine"
    );
    // Every other slot can be granted, never k's.
    c.handle(P, batch("C", &["c0", "c1"], 2, true, None), t0, &mut out);
    let rc = one_reply(&mut out);
    assert!(!rc.is_failure());
    assert!(!rc.remote_indexes.contains(&ra.remote_indexes[0]));
    // B's decoder drops its reference: now the slot goes.
    assert!(c.remove_key("k", t0, &mut out));
    consume(&mut c, &["c0".into(), "c1".into()], t0, &mut out);
    assert_eq!(c.stats().slots_in_use, 0);
    assert_eq!(c.ledger().stats().committed, 0);
}

/// The quarantine itself still holds when the pin goes first.
#[test]
fn a_pin_released_early_does_not_end_the_quarantine() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(3), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["k"], 2, false, None), t0, &mut out);
    one_reply(&mut out);
    c.handle(Q, batch("B", &["k"], 1, true, None), t0, &mut out);
    one_reply(&mut out);
    c.handle(P, batch("A", &["x", "y"], 2, true, None), t0, &mut out);
    out.clear();
    assert!(c.remove_key("k", t0, &mut out), "B's reference");
    assert_eq!(c.stats().slots_in_use, 1, "quarantined until the grace");
    assert!(!c.remove_key("k", t0, &mut out), "no reference left");
    c.tick(t0 + Duration::from_secs(11), &mut out);
    assert_eq!(c.stats().slots_in_use, 0);
    assert_eq!(c.ledger().stats().committed, 0);
}

#[test]
fn cancel_of_a_parked_request_answers_its_batches() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(
        P,
        batch("A", &["a0", "a1", "a2"], 3, true, Some(1)),
        t0,
        &mut out,
    );
    one_reply(&mut out);
    c.handle(
        Q,
        batch("B", &["b0", "b1"], 2, false, Some(2)),
        t0,
        &mut out,
    );
    c.handle(Q, batch("B", &["b2"], 2, true, Some(3)), t0, &mut out);
    assert!(
        replies(&mut out).is_empty(),
        "both batches of B wait behind its admission"
    );
    c.handle(
        Q,
        Message::CancelNotif(CancelNotif {
            req_id: "B".into(),
            keys: vec![],
            seq: Some(4),
        }),
        t0,
        &mut out,
    );
    let r = replies(&mut out);
    assert_eq!(
        r.len(),
        3,
        "two parked batches answered with an error, plus the cancel"
    );
    assert_eq!(r[0].1.code.as_deref(), Some(ErrorCode::Cancelled.as_str()));
    assert_eq!(r[0].1.seq, Some(2));
    assert_eq!(r[1].1.seq, Some(3));
    assert!(r[2].1.remote_indexes.is_empty());
    assert_eq!(c.stats().parked_requests, 0);
}

#[test]
fn fifo_admission_does_not_starve_a_large_request() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, batch("S1", &["s1"], 1, true, None), t0, &mut out);
    one_reply(&mut out);
    c.handle(P, batch("BIG", &["g0"], 4, false, None), t0, &mut out);
    assert!(replies(&mut out).is_empty());
    c.handle(P, batch("S2", &["s2"], 1, true, None), t0, &mut out);
    assert!(
        replies(&mut out).is_empty(),
        "a small request does not jump the parked large one"
    );
    c.remove_key("s1", t0, &mut out);
    let r = replies(&mut out);
    assert_eq!(r.len(), 1, "BIG is admitted first");
    assert_eq!(r[0].1.remote_indexes.len(), 1);
}

#[test]
fn admission_timeout_answers_the_parked_batch() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(2), t0);
    let mut out = Vec::new();
    c.handle(P, batch("A", &["a0", "a1"], 2, true, None), t0, &mut out);
    one_reply(&mut out);
    c.handle(Q, batch("B", &["b0"], 2, false, Some(9)), t0, &mut out);
    assert!(c.next_deadline().is_some());
    c.tick(t0 + Duration::from_secs(61), &mut out);
    let r = one_reply(&mut out);
    assert_eq!(
        r.code.as_deref(),
        Some(ErrorCode::AdmissionTimeout.as_str())
    );
    assert_eq!(r.seq, Some(9));
}

#[test]
fn lease_expiry_rolls_back_and_heartbeats_renew() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(8), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    out.clear();
    c.handle(
        P,
        batch("A", &["a0", "a1"], 4, false, Some(1)),
        t0,
        &mut out,
    );
    one_reply(&mut out);
    assert_eq!(c.ledger().stats().committed, 4);
    // A heartbeat at 20 s renews the lease past 30 s.
    c.handle(
        P,
        Message::Heartbeat(Heartbeat {
            sender_id: "s1".into(),
        }),
        t0 + Duration::from_secs(20),
        &mut out,
    );
    c.tick(t0 + Duration::from_secs(35), &mut out);
    assert_eq!(
        c.stats().tracked_requests,
        1,
        "renewed lease has not expired"
    );
    c.tick(t0 + Duration::from_secs(60), &mut out);
    assert_eq!(c.stats().tracked_requests, 0, "lease expired");
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Finished {
            outcome: Outcome::Failed(ErrorCode::LeaseExpired),
            ..
        }
    )));
    assert_eq!(c.ledger().stats().reserved, 0);
    assert_eq!(
        c.stats().quarantined_slots,
        2,
        "granted slots wait for the fence"
    );
    c.tick(t0 + Duration::from_secs(120), &mut out);
    assert_eq!(c.ledger().stats().committed, 0);
}

#[test]
fn kvferry_peer_completes_on_transfer_done() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(8), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    assert!(out.iter().any(|o| matches!(o, Output::Send { message: Message::HelloAck(a), .. } if a.capacity_chunks == 8)));
    out.clear();
    c.handle(P, batch("A", &["a0"], 2, false, Some(1)), t0, &mut out);
    c.handle(P, batch("A", &[], 2, true, Some(2)), t0, &mut out);
    let r = replies(&mut out);
    assert_eq!(r.len(), 2, "an empty last batch is legal and answered");
    assert!(r[1].1.remote_indexes.is_empty() && !r[1].1.is_failure());
    assert!(!c.is_ready("a0"), "not ready before TransferDone");
    assert_eq!(
        c.ledger().stats().reserved,
        0,
        "the unused reservation went back with the last batch"
    );
    c.handle(
        P,
        Message::TransferDone(TransferDone {
            req_id: "A".into(),
            seq: None,
        }),
        t0,
        &mut out,
    );
    assert!(c.is_ready("a0"));
    assert!(out.iter().any(
        |o| matches!(o, Output::Finished { req_id, outcome: Outcome::Ready } if req_id == "A")
    ));
}

#[test]
fn anonymous_batches_allocate_without_tracking() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(2), t0);
    let mut out = Vec::new();
    c.handle(P, batch("", &["n0", "n1"], 0, false, None), t0, &mut out);
    let r = one_reply(&mut out);
    assert_eq!(r.remote_indexes.len(), 2);
    assert!(!r.is_failure());
    assert_eq!(c.stats().tracked_requests, 0);
    c.handle(P, batch("", &["n2"], 0, false, None), t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::AllocationFailed.as_str())
    );
    assert!(c.remove_key("n0", t0, &mut out));
    assert!(c.remove_key("n1", t0, &mut out));
    assert_eq!(c.ledger().stats().committed, 0);
}

#[test]
fn oversized_chunk_and_unknown_dtype_are_refused() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    let mut m = batch("A", &["a"], 1, true, None);
    if let Message::AllocRequest(r) = &mut m {
        r.shape = vec![4096];
    }
    c.handle(P, m, t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::ChunkTooLarge.as_str())
    );
    let mut m = batch("B", &["b"], 1, true, None);
    if let Message::AllocRequest(r) = &mut m {
        r.dtype = "no-such-type".into();
    }
    c.handle(P, m, t0, &mut out);
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::BadMessage.as_str())
    );
    assert_eq!(c.ledger().stats().committed, 0);
}

#[test]
fn fenced_cancel_from_a_kvferry_sender_frees_at_once() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    c.handle(
        P,
        batch("A", &["a0", "a1"], 4, false, Some(1)),
        t0,
        &mut out,
    );
    out.clear();
    c.handle(
        P,
        Message::CancelNotif(CancelNotif {
            req_id: "A".into(),
            keys: vec!["a0".into(), "a1".into()],
            seq: Some(2),
        }),
        t0,
        &mut out,
    );
    assert_eq!(one_reply(&mut out).seq, Some(2));
    assert_eq!(
        c.ledger().stats().committed,
        0,
        "a kvferry sender fences before it cancels"
    );
    assert_eq!(c.stats().quarantined_slots, 0);
}

#[test]
fn unexpected_message_types_get_an_error_reply() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(
        P,
        Message::AllocResponse(AllocResponse::ok(vec![], vec![], None)),
        t0,
        &mut out,
    );
    assert_eq!(
        one_reply(&mut out).code.as_deref(),
        Some(ErrorCode::BadMessage.as_str())
    );
    c.bad_frame(
        P,
        "garbage".into(),
        crate::protocol::ReplyHints::default(),
        &mut out,
    );
    assert_eq!(one_reply(&mut out).remote_indexes, vec![-1]);
}

#[test]
fn auto_consume_releases_on_transfer_done() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(
        CoreConfig {
            auto_consume: true,
            ..cfg(4)
        },
        t0,
    );
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    c.handle(
        P,
        batch("A", &["a0", "a1", "a2"], 3, true, Some(1)),
        t0,
        &mut out,
    );
    c.handle(Q, batch("B", &["b0", "b1"], 2, true, None), t0, &mut out);
    out.clear();
    assert_eq!(c.stats().parked_requests, 1);
    c.handle(
        P,
        Message::TransferDone(TransferDone {
            req_id: "A".into(),
            seq: None,
        }),
        t0,
        &mut out,
    );
    assert_eq!(c.stats().keys, 2, "A's chunks are gone, B's are allocated");
    assert_eq!(
        one_reply(&mut out).remote_indexes.len(),
        2,
        "B admitted by the release"
    );
}

/// Issue 12: an LMCache peer sends no TransferDone, so with `auto_consume`
/// its request counts as delivered `consume_grace` after its last batch
/// was answered; the request parked behind it is admitted then (before,
/// it waited for `admission_timeout`).
#[test]
fn auto_consume_releases_an_lmcache_request_after_the_grace() {
    let t0 = Instant::now();
    let grace = Duration::from_millis(200);
    let mut c = ReceiverCore::new(
        CoreConfig {
            auto_consume: true,
            consume_grace: grace,
            ..cfg(4)
        },
        t0,
    );
    let mut out = Vec::new();
    // P and Q never say Hello: LMCache senders.
    c.handle(P, batch("A", &["a0", "a1"], 3, false, None), t0, &mut out);
    let t1 = t0 + Duration::from_millis(50);
    c.handle(P, batch("A", &["a2"], 3, true, None), t1, &mut out);
    assert_eq!(replies(&mut out).len(), 2);
    assert!(out.contains(&Output::Finished {
        req_id: "A".into(),
        outcome: Outcome::Ready
    }));
    out.clear();
    c.handle(Q, batch("B", &["b0", "b1"], 2, true, None), t1, &mut out);
    assert!(replies(&mut out).is_empty(), "B parked behind A");
    assert_eq!(c.stats().parked_requests, 1);
    assert_eq!(c.next_deadline(), Some(t1 + grace), "the core wakes for A");
    // The grace counts from A's *last* reply.
    c.tick(t0 + grace, &mut out);
    assert!(replies(&mut out).is_empty(), "A's last batch was at t1");
    assert_eq!(c.stats().keys, 3);
    c.tick(t1 + grace, &mut out);
    assert_eq!(c.stats().keys, 2, "A's chunks are gone, B's are allocated");
    let rb = one_reply(&mut out);
    assert_eq!(rb.remote_indexes.len(), 2, "B admitted by the release");
    c.tick(t1 + grace * 3, &mut out);
    assert_eq!(c.stats().slots_in_use, 0, "B consumed after its own grace");
    assert_eq!(c.ledger().stats().committed, 0);
}

/// Anonymous batches get no TransferDone either: same rule. An LMCache
/// cancel after the last batch drops exactly the request's references, at
/// once, and the grace does not drop them a second time.
#[test]
fn auto_consume_grace_covers_anonymous_batches_and_late_cancels() {
    let t0 = Instant::now();
    let grace = Duration::from_millis(100);
    let mut c = ReceiverCore::new(
        CoreConfig {
            auto_consume: true,
            consume_grace: grace,
            ..cfg(4)
        },
        t0,
    );
    let mut out = Vec::new();
    c.handle(P, batch("", &["n0", "n1"], 0, false, None), t0, &mut out);
    assert_lmcache_accepts(2, &one_reply(&mut out));
    c.handle(Q, batch("A", &["n0", "a1"], 2, true, None), t0, &mut out);
    let ra = one_reply(&mut out);
    assert_eq!(ra.already_sent_indexes, vec![0], "n0 is ready at once");
    assert_lmcache_accepts(2, &ra);
    out.clear();
    assert_eq!(c.stats().slots_in_use, 3);
    // A's sender gives up after its last reply (e.g. its write failed).
    c.handle(
        Q,
        Message::CancelNotif(CancelNotif {
            req_id: "A".into(),
            keys: vec!["n0".into(), "a1".into()],
            seq: None,
        }),
        t0,
        &mut out,
    );
    assert_eq!(
        c.stats().slots_in_use,
        2,
        "a1 freed; n0 still held by the batch"
    );
    assert!(c.is_ready("n0"));
    c.tick(t0 + grace, &mut out);
    assert_eq!(c.stats().slots_in_use, 0, "the anonymous batch consumed");
    assert_eq!(c.ledger().stats().committed, 0);
    // Only the peers' state is left, pruned at the next lease scan.
    assert!(
        c.next_deadline().is_none_or(|d| d > t0 + grace),
        "nothing due now: {:?}",
        c.next_deadline()
    );
}

#[test]
fn hello_ack_answers_the_offer_the_sender_asked_for() {
    let t0 = Instant::now();
    let tcp = Descriptor::Tcp {
        addr: "127.0.0.1:9".into(),
        secret: None,
    };
    let mut c = ReceiverCore::new(
        CoreConfig {
            other_transports: vec![("tcp".into(), tcp.clone())],
            ..cfg(4)
        },
        t0,
    );
    let ask = |transport: &str| {
        Message::Hello(Hello {
            sender_id: "s1".into(),
            version: crate::protocol::PROTOCOL_VERSION,
            transport: transport.into(),
            descriptor: Descriptor::None,
        })
    };
    let ack = |c: &mut ReceiverCore, transport: &str| {
        let mut out = Vec::new();
        c.handle(P, ask(transport), t0, &mut out);
        match out.pop() {
            Some(Output::Send {
                message: Message::HelloAck(a),
                ..
            }) => (a.transport, a.descriptor),
            other => panic!("expected a HelloAck, got {other:?}"),
        }
    };
    // TCP: the offer plus a secret of this sender's own, new at each Hello.
    let secret_of = |d: Descriptor| match d {
        Descriptor::Tcp { addr, secret } => {
            assert_eq!(addr, "127.0.0.1:9");
            let s = secret.expect("a tcp HelloAck carries a secret");
            crate::transport::tcp::wire::decode_secret(&s).expect("hex secret")
        }
        other => panic!("expected a tcp descriptor, got {other:?}"),
    };
    let (name, d) = ack(&mut c, "tcp");
    assert_eq!(name, "tcp");
    let first = secret_of(d);
    assert!(c.data_token(&first).is_some());
    let second = secret_of(ack(&mut c, "tcp").1);
    assert_ne!(first, second);
    assert!(
        c.data_token(&first).is_none(),
        "a new Hello revokes the old secret"
    );
    assert!(c.data_token(&second).is_some());
    assert_eq!(ack(&mut c, "shm"), ("shm".to_owned(), Descriptor::None));
    assert!(
        c.data_token(&second).is_none(),
        "a non-tcp Hello needs no secret"
    );
    // Not offered: the default offer, whose name differs from the ask.
    assert_eq!(ack(&mut c, "rdma"), ("shm".to_owned(), Descriptor::None));
}

/// `with_control`: the same-host endpoint rides on the answers with the shm
/// data plane only (reaching its file is what puts the sender on this
/// host); a core without one offers nothing.
#[test]
fn hello_ack_offers_the_local_control_endpoint_with_shm_only() {
    let t0 = Instant::now();
    let tcp = Descriptor::Tcp {
        addr: "127.0.0.1:9".into(),
        secret: None,
    };
    let core = |control: Option<&str>| {
        ReceiverCore::new(
            CoreConfig {
                other_transports: vec![("tcp".into(), tcp.clone())],
                ..cfg(4)
            },
            t0,
        )
        .with_control(control.map(str::to_owned))
    };
    let control_of = |c: &mut ReceiverCore, transport: &str| {
        let mut out = Vec::new();
        let hello = Message::Hello(Hello {
            sender_id: "s1".into(),
            version: crate::protocol::PROTOCOL_VERSION,
            transport: transport.into(),
            descriptor: Descriptor::None,
        });
        c.handle(P, hello, t0, &mut out);
        match out.pop() {
            Some(Output::Send {
                message: Message::HelloAck(a),
                ..
            }) => (a.transport, a.control),
            other => panic!("expected a HelloAck, got {other:?}"),
        }
    };
    let ep = "ipc:///run/kvferry/r.ctl";
    let mut c = core(Some(ep));
    assert_eq!(control_of(&mut c, "shm"), ("shm".into(), Some(ep.into())));
    assert_eq!(control_of(&mut c, "tcp"), ("tcp".into(), None));
    assert_eq!(
        control_of(&mut c, "rdma"),
        ("shm".into(), Some(ep.into())),
        "the default shm offer carries it"
    );
    let mut plain = core(None);
    assert_eq!(control_of(&mut plain, "shm"), ("shm".into(), None));
}

/// A core offering tcp, and the token of sender `peer` after its Hello.
fn tcp_core(capacity: usize, t0: Instant, peers: &[&[u8]]) -> (ReceiverCore, Vec<u64>) {
    let mut c = ReceiverCore::new(
        CoreConfig {
            other_transports: vec![(
                "tcp".into(),
                Descriptor::Tcp {
                    addr: "127.0.0.1:9".into(),
                    secret: None,
                },
            )],
            ..cfg(capacity)
        },
        t0,
    );
    let mut tokens = Vec::new();
    for &p in peers {
        let mut out = Vec::new();
        c.handle(
            p,
            Message::Hello(Hello {
                sender_id: String::from_utf8_lossy(p).into_owned(),
                version: crate::protocol::PROTOCOL_VERSION,
                transport: "tcp".into(),
                descriptor: Descriptor::None,
            }),
            t0,
            &mut out,
        );
        let Some(Output::Send {
            message: Message::HelloAck(a),
            ..
        }) = out.pop()
        else {
            panic!("no HelloAck")
        };
        let Descriptor::Tcp {
            secret: Some(s), ..
        } = a.descriptor
        else {
            panic!("no secret")
        };
        let secret = crate::transport::tcp::wire::decode_secret(&s).unwrap();
        tokens.push(c.data_token(&secret).unwrap());
    }
    (c, tokens)
}

#[test]
fn tcp_grants_follow_the_request_from_grant_to_completion() {
    let t0 = Instant::now();
    let (mut c, tok) = tcp_core(4, t0, &[P, Q]);
    let g = std::sync::Arc::clone(c.grant_table());
    let mut out = Vec::new();
    c.handle(P, batch("a", &["k0", "k1"], 2, true, None), t0, &mut out);
    let slots = one_reply(&mut out).remote_indexes;
    let (s0, s1) = (slots[0] as u32, slots[1] as u32);
    assert!(g.is_granted_to(s0, tok[0]) && g.is_granted_to(s1, tok[0]));
    assert!(
        !g.is_granted_to(s0, tok[1]),
        "granted to its own sender only"
    );
    assert!(
        !g.is_granted_to(2, tok[0]),
        "free slots are granted to nobody"
    );
    c.handle(P, done("a"), t0, &mut out);
    assert!(
        !g.is_granted_to(s0, tok[0]) && !g.is_granted_to(s1, tok[0]),
        "a complete request's slots take no more writes"
    );
    // Consumed and regranted to Q: Q's grant, not P's.
    consume(&mut c, &keys("k", 2), t0, &mut out);
    c.handle(Q, batch("b", &["x"], 1, true, None), t0, &mut out);
    let s = one_reply(&mut out).remote_indexes[0] as u32;
    assert!(g.is_granted_to(s, tok[1]) && !g.is_granted_to(s, tok[0]));
}

#[test]
fn freeing_a_slot_mid_read_is_deferred_until_the_read_returns() {
    let t0 = Instant::now();
    let (mut c, tok) = tcp_core(1, t0, &[P]);
    let g = std::sync::Arc::clone(c.grant_table());
    let mut out = Vec::new();
    c.handle(P, batch("a", &["k0"], 1, true, None), t0, &mut out);
    let s = one_reply(&mut out).remote_indexes[0] as u32;
    // The data thread is inside a read into the slot...
    assert!(g.begin_write(s, tok[0]));
    // ... when the sender claims completion: refused, the request fails.
    c.handle(P, done("a"), t0, &mut out);
    assert!(
        out.iter().any(|o| matches!(
            o,
            Output::Finished {
                outcome: Outcome::Failed(ErrorCode::ProtocolViolation),
                ..
            }
        )),
        "{out:?}"
    );
    out.clear();
    // Its quarantine ends while the read still lands: the slot stays held.
    c.tick(t0 + Duration::from_secs(11), &mut out);
    assert_eq!(c.stats().slots_in_use, 1, "not freed under a landing read");
    // A second request cannot get it until the data thread hands it back.
    c.handle(P, batch("b", &["k1"], 1, true, None), t0, &mut out);
    assert!(replies(&mut out).is_empty(), "b waits for the slot");
    assert_eq!(
        g.end_write(s, tok[0]),
        super::grants::EndWrite::FreeDeferred
    );
    c.free_deferred(s, t0, &mut out);
    assert_eq!(one_reply(&mut out).remote_indexes, vec![i64::from(s)]);
    assert!(g.is_granted_to(s, tok[0]));
}

// ----- ownership (invariant 8) and bounds (invariant 9), issue 13 -----------

fn hello_as(sender_id: &str) -> Message {
    Message::Hello(Hello {
        sender_id: sender_id.into(),
        version: crate::protocol::PROTOCOL_VERSION,
        transport: "shm".into(),
        descriptor: Descriptor::None,
    })
}

fn heartbeat(sender_id: &str) -> Message {
    Message::Heartbeat(Heartbeat {
        sender_id: sender_id.into(),
    })
}

fn cancel_keys(req: &str, keys: &[&str]) -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: req.into(),
        keys: keys.iter().map(|k| k.to_string()).collect(),
        seq: Some(99),
    })
}

fn code_of(r: &AllocResponse) -> Option<&str> {
    r.code.as_deref()
}

fn not_owner_total(c: &ReceiverCore) -> u64 {
    c.stats()
        .errors_total
        .get("not_owner")
        .copied()
        .unwrap_or(0)
}

/// A stranger's cancel (with or without Hello) neither releases a live
/// request nor lets the owner's next batch be admitted as a new request:
/// it gets `not_owner`, counted.
#[test]
fn a_strangers_cancel_changes_nothing() {
    for stranger_hello in [false, true] {
        let t0 = Instant::now();
        let mut c = ReceiverCore::new(cfg(4), t0);
        let mut out = Vec::new();
        c.handle(P, hello_as("p"), t0, &mut out);
        if stranger_hello {
            c.handle(Q, hello_as("q"), t0, &mut out);
        }
        out.clear();
        c.handle(
            P,
            batch("A", &["a0", "a1"], 4, false, Some(1)),
            t0,
            &mut out,
        );
        let first = one_reply(&mut out);
        c.handle(Q, cancel("A", 7), t0, &mut out);
        let r = one_reply(&mut out);
        assert_eq!(code_of(&r), Some("not_owner"), "{r:?}");
        assert_eq!(r.seq, Some(7));
        assert_eq!(not_owner_total(&c), 1);
        assert_eq!(c.stats().tracked_requests, 1, "A still tracked");
        assert_eq!(c.ledger().stats().committed, 4, "A's reservation intact");
        // The owner's next batch continues A (not a new request): it gets
        // the two remaining chunks of A's reservation, distinct slots.
        c.handle(P, batch("A", &["a2", "a3"], 4, true, Some(2)), t0, &mut out);
        let second = one_reply(&mut out);
        assert!(!second.is_failure(), "{second:?}");
        let mut slots: Vec<i64> = first.remote_indexes.clone();
        slots.extend(&second.remote_indexes);
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 4, "no slot granted twice");
        assert_eq!(c.stats().requests_total.get("admitted"), Some(&1));
    }
}

/// A cancel for a made-up req_id listing another request's keys frees
/// nothing; the LMCache owner's own late cancel releases its references.
#[test]
fn a_cancel_releases_only_the_cancellers_own_references() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    // An LMCache peer (no Hello): tracking ends at the last batch.
    c.handle(P, batch("A", &["k0", "k1"], 2, true, None), t0, &mut out);
    one_reply(&mut out);
    assert_eq!(c.stats().slots_in_use, 2);
    c.handle(Q, cancel_keys("made-up", &["k0", "k1"]), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    assert_eq!(
        c.stats().slots_in_use,
        2,
        "a stranger's keys list frees nothing"
    );
    c.handle(Q, cancel_keys("A", &["k0", "k1"]), t0, &mut out);
    assert_eq!(code_of(&one_reply(&mut out)), Some("not_owner"));
    assert_eq!(c.stats().slots_in_use, 2);
    // The owner's cancel releases what its request held, whatever it lists.
    c.handle(P, cancel_keys("A", &["unrelated"]), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    assert_eq!(c.stats().slots_in_use, 0);
    assert_eq!(c.ledger().stats().committed, 0);
}

/// Only the owner's CancelNotif ends a failed request's quarantine.
#[test]
fn only_the_owner_ends_a_quarantine() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, hello_as("p"), t0, &mut out);
    c.handle(Q, hello_as("q"), t0, &mut out);
    out.clear();
    c.handle(
        P,
        batch("A", &["a0", "a1"], 2, false, Some(1)),
        t0,
        &mut out,
    );
    one_reply(&mut out);
    // A third chunk breaks total_chunks: rolled back, granted slots fenced.
    c.handle(P, batch("A", &["a2"], 2, true, Some(2)), t0, &mut out);
    assert_eq!(code_of(&one_reply(&mut out)), Some("protocol_violation"));
    assert_eq!(c.stats().quarantined_slots, 2);
    c.handle(Q, cancel("A", 3), t0, &mut out);
    assert_eq!(code_of(&one_reply(&mut out)), Some("not_owner"));
    assert_eq!(c.stats().quarantined_slots, 2, "a stranger is no fence");
    c.handle(P, cancel("A", 4), t0, &mut out);
    assert!(!one_reply(&mut out).is_failure());
    assert_eq!(c.stats().quarantined_slots, 0, "the owner's fence ends it");
    assert_eq!(c.ledger().stats().committed, 0);
}

/// Another peer's TransferDone completes nothing; it is counted.
#[test]
fn transfer_done_counts_only_from_the_owner() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, hello_as("p"), t0, &mut out);
    c.handle(Q, hello_as("q"), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["a0"], 1, true, Some(1)), t0, &mut out);
    one_reply(&mut out);
    c.handle(Q, done("A"), t0, &mut out);
    assert!(out.is_empty(), "no completion from a stranger: {out:?}");
    assert!(!c.is_ready("a0"));
    assert_eq!(c.stats().tracked_requests, 1);
    assert_eq!(not_owner_total(&c), 1);
    c.handle(P, done("A"), t0, &mut out);
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Finished { req_id, outcome: Outcome::Ready } if req_id == "A"
    )));
    assert!(c.is_ready("a0"));
}

/// Two peers reusing a req_id are two requests: the second peer's batch is
/// never granted slots inside the first's request, and its inconsistent
/// batch fails only itself.
#[test]
fn two_peers_reusing_a_req_id_are_two_requests() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(8), t0);
    let mut out = Vec::new();
    c.handle(
        P,
        batch("A", &["p0", "p1"], 4, false, Some(1)),
        t0,
        &mut out,
    );
    one_reply(&mut out);
    c.handle(
        Q,
        batch("A", &["q0", "q1"], 2, false, Some(1)),
        t0,
        &mut out,
    );
    assert!(!one_reply(&mut out).is_failure());
    assert_eq!(c.stats().tracked_requests, 2);
    assert_eq!(c.ledger().stats().committed, 6, "4 for P's A, 2 for Q's A");
    // Q changes total_chunks: only Q's request fails.
    c.handle(Q, batch("A", &["q2"], 3, true, Some(2)), t0, &mut out);
    assert_eq!(code_of(&one_reply(&mut out)), Some("inconsistent_request"));
    assert_eq!(c.stats().tracked_requests, 1);
    c.handle(P, batch("A", &["p2", "p3"], 4, true, Some(2)), t0, &mut out);
    let r = one_reply(&mut out);
    assert!(!r.is_failure(), "P's request is untouched: {r:?}");
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Finished { req_id, outcome: Outcome::Ready } if req_id == "A"
    )));
}

/// A Heartbeat renews only its own peer's requests (not those of the
/// sender it names), and costs O(1): a heartbeat naming another sender id
/// renews nothing and is counted.
#[test]
fn heartbeat_renews_only_its_own_peers_requests() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(8), t0);
    let mut out = Vec::new();
    c.handle(P, hello_as("p"), t0, &mut out);
    c.handle(Q, hello_as("q"), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["a0"], 2, false, Some(1)), t0, &mut out);
    c.handle(Q, batch("B", &["b0"], 2, false, Some(1)), t0, &mut out);
    out.clear();
    // Q keeps itself alive, and names P's sender id once.
    for s in [10, 20, 30, 40, 50] {
        c.handle(Q, heartbeat("q"), t0 + Duration::from_secs(s), &mut out);
    }
    c.handle(Q, heartbeat("p"), t0 + Duration::from_secs(25), &mut out);
    assert_eq!(not_owner_total(&c), 1);
    c.tick(t0 + Duration::from_secs(55), &mut out);
    let expired: Vec<&str> = out
        .iter()
        .filter_map(|o| match o {
            Output::Finished {
                req_id,
                outcome: Outcome::Failed(ErrorCode::LeaseExpired),
            } => Some(req_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(expired, vec!["A"], "P is dead, Q is alive");
    assert_eq!(c.stats().tracked_requests, 1);
}

/// A dead kvferry sender's parked requests expire with its liveness
/// instead of being admitted one after another after it died.
#[test]
fn a_kvferry_peers_liveness_covers_its_parked_requests() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(P, hello_as("p"), t0, &mut out);
    out.clear();
    c.handle(P, batch("A", &["a0"], 4, false, Some(1)), t0, &mut out);
    one_reply(&mut out);
    for i in 0..5 {
        let id = format!("W{i}");
        c.handle(
            P,
            batch(&id, &[&format!("w{i}")], 4, false, Some(2 + i)),
            t0,
            &mut out,
        );
    }
    assert_eq!(c.stats().parked_requests, 5);
    // Nothing from P for a lease: every request of P ends at once.
    c.tick(t0 + Duration::from_secs(31), &mut out);
    let s = c.stats();
    assert_eq!((s.tracked_requests, s.parked_requests), (0, 0), "{s:?}");
    assert_eq!(s.requests_total.get("lease_expired"), Some(&6));
    assert_eq!(
        s.requests_total.get("admitted"),
        Some(&1),
        "no parked one admitted"
    );
    // Only A's granted slot waits for the quarantine.
    assert_eq!(c.ledger().stats().committed, 1);
    c.tick(t0 + Duration::from_secs(45), &mut out);
    assert_eq!(c.ledger().stats().committed, 0);
}

fn small_bounds(capacity: usize, f: impl FnOnce(&mut super::bounds::Bounds)) -> CoreConfig {
    let mut c = cfg(capacity);
    f(&mut c.bounds);
    c
}

/// Parked requests and the batches queued behind them are bounded in
/// bytes: past the bound the peer is answered `overloaded` at once.
#[test]
fn parked_work_is_bounded_in_bytes() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(
        small_bounds(2, |b| {
            b.max_parked_bytes = 4096;
            b.max_peer_parked_bytes = 4096;
        }),
        t0,
    );
    let mut out = Vec::new();
    c.handle(P, batch("A", &["a0"], 2, false, None), t0, &mut out);
    one_reply(&mut out);
    let mut parked = 0;
    let mut overloaded = 0;
    for i in 0..100 {
        c.handle(
            Q,
            batch(&format!("W{i}"), &["w"], 2, false, None),
            t0,
            &mut out,
        );
        match replies(&mut out).as_slice() {
            [] => parked += 1,
            [(_, r)] => {
                assert_eq!(code_of(r), Some("overloaded"), "{r:?}");
                overloaded += 1;
            }
            more => panic!("one reply at most: {more:?}"),
        }
    }
    assert!(
        parked > 0 && overloaded > 0,
        "{parked} parked, {overloaded} refused"
    );
    assert!(c.stats().parked_bytes <= 4096, "{:?}", c.stats());
    // A batch that would push a parked request's backlog past the bound
    // rolls that request back; each of its queued batches is answered.
    let big: Vec<String> = keys("long-key-", 64);
    c.handle(Q, batch("W0", &refs(&big), 2, false, None), t0, &mut out);
    let r = replies(&mut out);
    assert_eq!(r.len(), 2, "the queued batch and this one: {r:?}");
    assert!(r.iter().all(|(_, r)| code_of(r) == Some("overloaded")));
    // Nothing is left once the rest time out.
    c.tick(t0 + Duration::from_secs(61), &mut out);
    let s = c.stats();
    assert_eq!((s.parked_requests, s.parked_bytes), (0, 0), "{s:?}");
}

/// Per-peer state is pruned when nothing of the peer is left and it was
/// silent for a lease; a pruned kvferry peer keeps kvferry semantics.
#[test]
fn peer_state_is_pruned_and_kvferry_semantics_survive() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    for i in 0..1000u32 {
        c.handle(&i.to_be_bytes(), hello_as(&format!("s{i}")), t0, &mut out);
    }
    c.handle(P, hello_as("p"), t0, &mut out);
    out.clear();
    assert_eq!(c.stats().peers, 1001);
    assert!(c.stats().peer_bytes > 0);
    assert!(c.next_deadline().is_some(), "pruning is scheduled");
    c.tick(t0 + Duration::from_secs(31), &mut out);
    let forgotten = out
        .iter()
        .filter(|o| matches!(o, Output::ForgetPeer { .. }))
        .count();
    assert_eq!(forgotten, 1001);
    let s = c.stats();
    assert_eq!((s.peers, s.peer_bytes), (0, 0), "{s:?}");
    assert_eq!(c.next_deadline(), None, "an idle core schedules nothing");
    // P comes back without a new Hello: its request still waits for
    // TransferDone (kvferry), not completing at its last batch.
    let t1 = t0 + Duration::from_secs(40);
    out.clear();
    c.handle(P, batch("A", &["a0"], 1, true, Some(1)), t1, &mut out);
    one_reply(&mut out);
    assert!(out.is_empty(), "not finished before TransferDone: {out:?}");
    c.handle(P, done("A"), t1, &mut out);
    assert!(c.is_ready("a0"));
}

/// Per-peer state has a byte bound. Peers holding nothing do not count
/// against newcomers: at the bound the least recently seen of them are
/// forgotten early (as pruning would a lease later), so 100 idle Hello'd
/// peers never lock a new one out. Only when the peers holding requests
/// fill the bound is a new peer's Hello or request answered `overloaded`;
/// known peers are served.
#[test]
fn per_peer_state_is_bounded_in_bytes() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(small_bounds(64, |b| b.max_peer_bytes = 2048), t0);
    let mut out = Vec::new();
    c.handle(P, hello_as("p"), t0, &mut out);
    assert!(matches!(
        out.pop(),
        Some(Output::Send {
            message: Message::HelloAck(_),
            ..
        })
    ));
    let acked = |out: &mut Vec<Output>| {
        out.iter().any(|o| {
            matches!(
                o,
                Output::Send {
                    message: Message::HelloAck(_),
                    ..
                }
            )
        })
    };
    let mut forgotten = 0;
    for i in 0..100u32 {
        let t = t0 + Duration::from_millis(u64::from(i) + 1);
        c.handle(&i.to_be_bytes(), hello_as("x"), t, &mut out);
        assert!(acked(&mut out), "idle peers lock peer {i} out: {out:?}");
        forgotten += out
            .iter()
            .filter(|o| matches!(o, Output::ForgetPeer { .. }))
            .count();
        out.clear();
        assert!(c.stats().peer_bytes <= 2048 + 256);
    }
    assert!(forgotten > 0, "the oldest idle peers were forgotten");
    // P (the least recently seen) was forgotten, and keeps kvferry
    // semantics: its request waits for TransferDone.
    let t1 = t0 + Duration::from_secs(1);
    c.handle(P, batch("A", &["a0"], 1, true, Some(1)), t1, &mut out);
    assert!(!one_reply(&mut out).is_failure(), "a known peer is served");
    assert!(out.is_empty(), "not finished before TransferDone: {out:?}");
    // Peers holding requests are never forgotten: they fill the bound and
    // then a new peer is refused.
    let mut refused = 0;
    for i in 1000..1100u32 {
        c.handle(
            &i.to_be_bytes(),
            batch("R", &["r"], 64, false, Some(1)),
            t1,
            &mut out,
        );
        for o in out.drain(..) {
            if let Output::Send {
                message: Message::AllocResponse(r),
                ..
            } = o
            {
                if code_of(&r) == Some("overloaded") {
                    refused += 1;
                }
            }
        }
    }
    assert!(refused > 0, "busy peers fill the bound");
    assert!(c.stats().peer_bytes <= 2048 + 256);
}

/// Anonymous allocations get a lifetime: unconsumed, their slots come back.
/// With anonymous allocations off they are refused.
#[test]
fn anonymous_allocations_expire_or_are_refused() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(cfg(4), t0);
    let mut out = Vec::new();
    c.handle(
        P,
        batch("", &["n0", "n1", "n2", "n3"], 0, false, None),
        t0,
        &mut out,
    );
    assert!(!one_reply(&mut out).is_failure());
    assert_eq!(c.stats().slots_in_use, 4);
    assert_eq!(c.stats().anonymous_allocations, 1);
    c.tick(t0 + Duration::from_secs(60), &mut out);
    assert_eq!(c.stats().slots_in_use, 4, "still within its lifetime");
    c.tick(t0 + Duration::from_secs(121), &mut out);
    let s = c.stats();
    assert_eq!(
        (s.slots_in_use, s.anonymous_allocations, s.record_bytes),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(c.ledger().stats().committed, 0);

    let mut c = ReceiverCore::new(small_bounds(4, |b| b.allow_anonymous = false), t0);
    c.handle(P, batch("", &["n0"], 0, false, None), t0, &mut out);
    assert_eq!(code_of(&one_reply(&mut out)), Some("protocol_violation"));
    assert_eq!(c.stats().slots_in_use, 0);
}

/// Tombstones that quarantine nothing are bounded in bytes; quarantining
/// ones are always kept.
#[test]
fn ended_request_records_are_bounded_in_bytes() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(small_bounds(4, |b| b.max_ended_bytes = 4096), t0);
    let mut out = Vec::new();
    for i in 0..1000 {
        let id = format!("{i:0>200}");
        c.handle(P, batch(&id, &["x"], 2, false, None), t0, &mut out);
        c.handle(P, cancel(&id, 1), t0, &mut out);
    }
    assert!(c.stats().record_bytes <= 4096, "{:?}", c.stats());
    c.tick(t0 + Duration::from_secs(11), &mut out);
    assert_eq!(c.stats().record_bytes, 0);
}

/// Complete requests waiting for `take` are bounded in bytes by a budget of
/// their own: past it a complete request is readable by key only (its
/// chunks stay), and the ended-record budget (anonymous allocations,
/// tombstones) is untouched.
#[test]
fn records_for_take_are_bounded_in_bytes_and_spare_the_ended_budget() {
    let t0 = Instant::now();
    let mut c = ReceiverCore::new(small_bounds(8, |b| b.max_ended_bytes = 600), t0);
    let mut out = Vec::new();
    c.handle(P, hello(), t0, &mut out);
    let mut taken = 0;
    for i in 0..8 {
        let req = format!("req-{i}");
        let key = format!("key-{i}");
        c.handle(P, batch(&req, &[&key], 1, true, Some(i + 1)), t0, &mut out);
        c.handle(P, done(&req), t0, &mut out);
        assert!(c.is_ready(&key), "{key} complete");
    }
    out.clear();
    assert_eq!(
        c.stats().record_bytes,
        0,
        "records for take are not ended records"
    );
    for i in 0..8 {
        match c.take(&format!("req-{i}")) {
            Ok(chunks) => {
                assert_eq!(chunks.len(), 1);
                assert_eq!(chunks[0].len, 1024);
                taken += 1;
                for ch in chunks {
                    c.end_borrow(&ch.key, ch.gen, t0, &mut out);
                }
            }
            Err(e) => {
                assert_eq!(e, super::core::TakeError::NotReady(format!("req-{i}")));
                assert!(
                    c.remove_key(&format!("key-{i}"), t0, &mut out),
                    "still held by key"
                );
            }
        }
    }
    assert!(
        (1..8).contains(&taken),
        "some were recorded, the bound refused the rest: {taken} of 8"
    );
    assert_eq!(c.stats().slots_in_use, 0, "everything consumed");
    // An anonymous allocation still fits the (untouched) ended budget.
    c.handle(P, batch("", &["anon"], 1, true, None), t0, &mut out);
    let r = one_reply(&mut out);
    assert!(!r.is_failure(), "anonymous allocation refused: {r:?}");
}
