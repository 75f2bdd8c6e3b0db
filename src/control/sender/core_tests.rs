//! Unit tests of the sender core: each drives [`Progress`] directly, with
//! the engine's rules unless it says otherwise.

use super::*;
use crate::sender::RequestStatus;

type P = Progress<RequestStatus>;

const CAP: u64 = 8;

/// A receive buffer of [`CAP`] slots of 4096 bytes.
const REMOTE: RemoteSlots = RemoteSlots {
    capacity: CAP,
    bytes: 4096,
};

fn ok(remote: &[i64], already: &[i64]) -> AllocResponse {
    AllocResponse::ok(remote.to_vec(), already.to_vec(), None)
}

fn refused() -> AllocResponse {
    AllocResponse::failure(2, None, ErrorCode::AllocationFailed, "full")
}

/// A request with batches `ids` queued and the first one sent.
fn sent(ids: &[u64]) -> P {
    let mut p = P::default();
    p.queued.extend(ids);
    assert_eq!(p.next_to_send(), Some((ids[0], true)));
    p
}

/// An admitted request whose batches `ids` (2 chunks each) were answered
/// with writes and wait to be posted.
fn answered(ids: &[u64]) -> P {
    let mut p = sent(ids);
    while p.next_to_send().is_some() {}
    for (k, &id) in ids.iter().enumerate() {
        let s = 2 * k as i64;
        let r = p.on_reply(
            id,
            &[1; 2],
            k + 1 == ids.len(),
            REMOTE,
            &ok(&[s, s + 1], &[]),
        );
        assert!(matches!(r.step, ReplyStep::Write { .. }));
    }
    p
}

/// What the callers stored of the request `answered(ids)` builds.
fn all_stored(ids: &[u64]) -> Stored {
    Stored {
        chunks: 2 * ids.len(),
        last: true,
    }
}

#[test]
fn an_unadmitted_request_sends_only_its_first_batch() {
    let mut p = P::default();
    p.queued.extend([1, 2, 3]);
    let me = "r".to_owned();
    assert_eq!(p.sendable::<String>(Rules::KVFERRY, None, &me), 1);
    assert_eq!(p.next_to_send(), Some((1, true)));
    assert_eq!(p.awaiting_reply, 1);
    // The first is out: nothing more until admission.
    assert_eq!(p.sendable::<String>(Rules::KVFERRY, None, &me), 0);
    let r = p.on_reply(1, &[1; 0], false, REMOTE, &ok(&[], &[]));
    assert!(r.admitted);
    assert_eq!(p.state, Phase::Admitted);
    assert_eq!(p.sendable::<String>(Rules::KVFERRY, None, &me), 2);
    assert_eq!(p.next_to_send(), Some((2, false)));
}

#[test]
fn without_the_gate_every_queued_batch_is_sendable() {
    let mut p = P::default();
    p.queued.extend([1, 2, 3]);
    let rules = Rules {
        gate_unadmitted: false,
        ..Rules::KVFERRY
    };
    assert_eq!(p.sendable::<String>(rules, None, &"r".to_owned()), 3);
}

#[test]
fn a_one_request_receiver_serves_the_turn_holder_only() {
    let mut turn = Turn::<String>::default();
    let (a, b) = ("a".to_owned(), "b".to_owned());
    let mut pa = P::default();
    pa.queued.push_back(1);
    let mut pb = P::default();
    pb.queued.push_back(2);
    assert_eq!(pa.sendable(Rules::KVFERRY, Some(&mut turn), &a), 1);
    assert!(!turn.is_free(), "sending takes the turn");
    assert_eq!(pb.sendable(Rules::KVFERRY, Some(&mut turn), &b), 0);
    assert!(!turn.release("b"), "only the holder gives the turn back");
    assert!(turn.release("a"));
    assert_eq!(pb.sendable(Rules::KVFERRY, Some(&mut turn), &b), 1);
}

#[test]
fn a_refusal_aborts_a_live_request_and_releases_the_batch() {
    let mut p = sent(&[1]);
    let r = p.on_reply(1, &[1; 2], true, REMOTE, &refused());
    assert_eq!(r.step, ReplyStep::Abort);
    assert!(!r.admitted);
    assert_eq!(p.awaiting_reply, 0);
    assert!(matches!(
        p.state,
        Phase::Aborting(RequestStatus::Failed {
            code: ErrorCode::AllocationFailed,
            ..
        })
    ));
    // A second refusal for an aborting request only releases.
    let r = p.on_reply(2, &[1; 2], true, REMOTE, &refused());
    assert_eq!(r.step, ReplyStep::Release);
}

#[test]
fn a_reply_naming_a_slot_outside_the_buffer_is_a_bad_message() {
    let mut p = sent(&[1]);
    let r = p.on_reply(1, &[1; 2], true, REMOTE, &ok(&[0, CAP as i64], &[]));
    assert_eq!(r.step, ReplyStep::Abort);
    assert!(matches!(
        p.state,
        Phase::Aborting(RequestStatus::Failed {
            code: ErrorCode::BadMessage,
            ..
        })
    ));
    assert!(p.unstaged.is_empty());
}

#[test]
fn a_reply_to_an_aborting_request_releases_without_admitting() {
    let mut p = sent(&[1]);
    assert!(p.abort_with(RequestStatus::Cancelled));
    let r = p.on_reply(1, &[1; 2], true, REMOTE, &ok(&[0, 1], &[]));
    assert_eq!(r.step, ReplyStep::Release);
    assert!(!r.admitted);
    assert!(p.unstaged.is_empty());
    assert_eq!(p.state, Phase::Aborting(RequestStatus::Cancelled));
}

#[test]
fn dedup_chunks_count_as_completed_and_are_not_written() {
    let mut p = sent(&[1, 2]);
    let r = p.on_reply(1, &[1; 3], false, REMOTE, &ok(&[5], &[0, 2]));
    assert!(r.admitted);
    assert_eq!(
        r.step,
        ReplyStep::Write {
            remote: vec![-1, 5, -1],
            dedup: [0, 2].into_iter().collect(),
        }
    );
    assert_eq!(p.completed_chunks, 2);
    assert_eq!(p.unstaged, [1]);
    // Every chunk held already: nothing to write, the batch is delivered.
    p.next_to_send();
    let r = p.on_reply(2, &[1; 1], true, REMOTE, &ok(&[], &[0]));
    assert!(!r.admitted, "admission is reported once");
    assert_eq!(r.step, ReplyStep::AllHeld);
    assert!(p.last_replied);
    assert_eq!(p.completed_chunks, 3);
    assert_eq!(p.unstaged, [1]);
}

#[test]
fn a_batch_waiting_for_staging_does_not_hold_back_the_next() {
    let mut p = answered(&[1, 2, 3]);
    let mut tried = Vec::new();
    p.post_answered(Rules::KVFERRY, |id| {
        tried.push(id);
        (id != 1).then_some(2)
    });
    assert_eq!(tried, [1, 2, 3]);
    assert_eq!(p.unstaged, [1]);
    assert_eq!(p.in_flight_ops, 4);
}

#[test]
fn in_order_staging_stops_at_the_first_waiting_batch() {
    let mut p = answered(&[1, 2]);
    let rules = Rules {
        stage_in_order: true,
        ..Rules::KVFERRY
    };
    let mut tried = Vec::new();
    p.post_answered(rules, |id| {
        tried.push(id);
        (id != 1).then_some(1)
    });
    assert_eq!(tried, [1]);
    assert_eq!(p.unstaged, [1, 2]);
    assert_eq!(p.in_flight_ops, 0);
}

#[test]
fn complete_only_once_every_write_landed_and_the_last_batch_was_answered() {
    let mut p = answered(&[1, 2]);
    let all = all_stored(&[1, 2]);
    assert!(!p.is_complete(all), "batches not posted");
    p.post_answered(Rules::KVFERRY, |_| Some(1));
    assert!(!p.is_complete(all), "writes in flight");
    assert_eq!(
        p.write_done(2, true, || unreachable!()),
        WriteDone {
            aborted: false,
            attention: false
        }
    );
    assert!(!p.is_complete(all), "one write still in flight");
    assert_eq!(
        p.write_done(2, true, || unreachable!()),
        WriteDone {
            aborted: false,
            attention: true
        }
    );
    assert!(p.is_complete(all));
    assert!(
        !p.is_complete(Stored { last: false, ..all }),
        "last batch not stored"
    );
    assert!(
        !p.is_complete(Stored {
            chunks: all.chunks + 1,
            ..all
        }),
        "a reserved batch not arrived"
    );
    p.last_replied = false;
    assert!(!p.is_complete(all), "last batch unanswered");
}

#[test]
fn a_failed_write_aborts_the_request_once() {
    let mut p = answered(&[1, 2]);
    p.post_answered(Rules::KVFERRY, |_| Some(1));
    let fail = || RequestStatus::Failed {
        code: ErrorCode::WriteFailed,
        reason: "x".into(),
    };
    assert_eq!(
        p.write_done(2, false, fail),
        WriteDone {
            aborted: true,
            attention: true
        }
    );
    assert_eq!(p.completed_chunks, 0);
    assert_eq!(
        p.write_done(2, false, fail),
        WriteDone {
            aborted: false,
            attention: true
        },
        "already aborting"
    );
    assert!(matches!(p.state, Phase::Aborting(_)));
}

#[test]
fn an_abort_waits_for_in_flight_writes_then_fences_with_one_cancel() {
    let mut p = answered(&[1, 2, 3]);
    p.post_answered(Rules::KVFERRY, |id| (id == 1).then_some(1));
    p.queued.push_back(4);
    assert!(p.abort_with(RequestStatus::Cancelled));
    assert!(!p.abort_with(RequestStatus::Cancelled), "not live any more");
    let mut released = Vec::new();
    assert_eq!(p.abort_step(|id| released.push(id)), AbortStep::Wait);
    assert_eq!(released, [4, 2, 3], "unsent, then unposted batches");
    assert!(!p.cancel_sent, "no CancelNotif while a write is in flight");
    p.write_done(2, true, || unreachable!());
    assert_eq!(
        p.abort_step(|_| unreachable!()),
        AbortStep::Finish {
            cancel: true,
            status: RequestStatus::Cancelled
        }
    );
    assert!(p.cancel_sent);
    assert_eq!(p.abort_step(|_| unreachable!()), AbortStep::Wait, "once");
}

#[test]
fn an_abort_before_anything_was_sent_ends_without_a_cancel() {
    let mut p = P::default();
    p.queued.push_back(1);
    assert!(p.abort_with(RequestStatus::Cancelled));
    let mut released = Vec::new();
    assert_eq!(
        p.abort_step(|id| released.push(id)),
        AbortStep::Finish {
            cancel: false,
            status: RequestStatus::Cancelled
        }
    );
    assert_eq!(released, [1]);
    p.finish(RequestStatus::Cancelled);
    assert_eq!(p.abort_step(|_| unreachable!()), AbortStep::Wait);
    assert!(!p.state.live());
}

#[test]
fn an_in_order_receiver_gets_one_message_at_a_time_in_send_order() {
    let mut q = InOrder::<u32, &str, u8>::default();
    assert!(q.is_idle());
    assert!(q.send(1, 10, || unreachable!("sent at once, not stored")));
    assert!(!q.send(2, 11, || "two"), "waits behind the outstanding one");
    assert!(!q.send(3, 12, || "three"));
    assert_eq!((q.outstanding(), q.sent_at()), (Some(&1), Some(10)));
    assert_eq!(q.answered(20), (Some(1), Some("two")));
    // The next one counts as sent when it is let go, not when queued.
    assert_eq!((q.outstanding(), q.sent_at()), (Some(&2), Some(20)));
    assert_eq!(q.answered(21), (Some(2), Some("three")));
    assert_eq!(q.answered(22), (Some(3), None));
    assert!(q.is_idle());
    assert_eq!(
        q.answered(23),
        (None, None),
        "a stray reply answers nothing"
    );
}

#[test]
fn draining_an_in_order_queue_forgets_outstanding_then_waiting() {
    let mut q = InOrder::<u32, (), ()>::default();
    q.send(1, (), || ());
    q.send(2, (), || ());
    q.send(3, (), || ());
    assert_eq!(q.drain().collect::<Vec<_>>(), [1, 2, 3]);
    assert!(q.is_idle());
    assert!(q.send(4, (), || ()), "a fresh connection sends at once");
}

#[test]
fn reservations_stop_at_the_total_and_after_the_last_batch() {
    let s = Stored::default();
    let (s, last) = s.reserve(3, 8, None).unwrap();
    assert_eq!(
        (s, last),
        (
            Stored {
                chunks: 3,
                last: false
            },
            false
        )
    );
    assert_eq!(s.reserve(6, 8, None), Err(Refusal::TooMany { chunks: 9 }));
    assert_eq!(s.reserve(0, 8, None), Err(Refusal::EmptyNotLast));
    // The caller's claim ends it early (the copying `store`).
    let (early, last) = s.reserve(1, 8, Some(true)).unwrap();
    assert!(last && early.last);
    assert_eq!(early.reserve(1, 8, None), Err(Refusal::AfterLast));
    let (full, last) = s.reserve(5, 8, None).unwrap();
    assert_eq!(
        (full, last),
        (
            Stored {
                chunks: 8,
                last: true
            },
            true
        )
    );
    // Giving the last batch back reopens the request.
    assert_eq!(full.unreserve(5, true), s);
    assert_eq!(
        s.unreserve(1, false),
        Stored {
            chunks: 2,
            last: false
        }
    );
}
