//! The request-handle API of the sender: `Sender::begin` (admission at
//! once, with an AllocRequest that has no keys), staging filled in place
//! (`Request::stage` / `try_stage` → `StagedBatch::submit`), the copying
//! `Request::store`, and per-request completion (`status`, `wait`, the
//! eventfd, callbacks off the ctrl thread). Every byte a decoder reads is
//! checked; every wait has a deadline.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common_sender::*;
use kvferry::sender::{RequestSpec, RequestStatus, SenderConfig, StoreError};

/// Fills the staged slots with chunks `range` of `request` and submits them.
fn stage_and_submit(
    req: &kvferry::sender::Request,
    request: u64,
    total: u32,
    range: std::ops::Range<u32>,
) -> Result<(), StoreError> {
    let n = range.len();
    let mut batch = req.stage(n, deadline())?;
    let mut lens = Vec::with_capacity(n);
    let mut tmp = Vec::new();
    for (slot, i) in batch.slots_mut().zip(range.clone()) {
        payloads().fill(chunk_id(request, i, total), &mut tmp);
        slot[..tmp.len()].copy_from_slice(&tmp);
        lens.push(tmp.len() as u32);
    }
    let keys: Vec<String> = range.map(|i| key(req.id(), request, i, total)).collect();
    batch.submit(&keys, &lens)
}

/// Waits (bounded) for the completion eventfd to become readable.
fn fd_fires(fd: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack, count 1.
    let n = unsafe { libc::poll(&mut p, 1, WAIT.as_millis() as i32) };
    n == 1 && p.revents & libc::POLLIN != 0
}

#[test]
fn begin_is_admitted_at_once_by_an_allocrequest_without_keys() {
    let r = receiver(16);
    let s = sender(sender_cfg(8, None));
    let req = s
        .begin(RequestSpec::new("b-0", r.endpoint(), 4))
        .expect("begins");
    // No batch stored at all: the admission message alone admits it.
    wait_for("b-0 admitted", || req.is_admitted());
    let st = r.stats();
    assert_eq!(st.core.tracked_requests, 1, "the receiver tracks it");
    assert_eq!(st.allocated_chunks, 0, "admitted with no slot allocated");
    assert_eq!(st.reserved_chunks, 4, "its whole total is reserved");
    assert_eq!(req.status(), RequestStatus::InProgress);
    stage_and_submit(&req, 0, 4, 0..4).unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    consume(&r, "b-0", 0, 4).unwrap();
    wait_sender_empty(&s, "after b-0");
    wait_receiver_empty(&r, "after b-0");
}

#[test]
fn staged_in_place_batches_land_byte_exact_and_complete_the_request() {
    let r = receiver(32);
    let proxy = proxy();
    let s = sender(sender_cfg(8, Some(&proxy)));
    let req = s.begin(RequestSpec::new("ip-0", r.endpoint(), 10)).unwrap();
    let fd = req.completion_fd().expect("eventfd").as_raw_fd();
    stage_and_submit(&req, 7, 10, 0..4).unwrap();
    stage_and_submit(&req, 7, 10, 4..8).unwrap();
    assert_eq!(req.status(), RequestStatus::InProgress, "2 chunks missing");
    stage_and_submit(&req, 7, 10, 8..10).unwrap();
    assert!(fd_fires(fd), "the completion fd became readable");
    assert_eq!(req.status(), RequestStatus::Completed);
    assert_eq!(
        proxy.next(deadline()).map(|n| n.req_id),
        Some("ip-0".to_owned())
    );
    consume(&r, "ip-0", 7, 10).unwrap();
    // A fd asked for after the end is readable at once.
    let late = s.begin(RequestSpec::new("ip-1", r.endpoint(), 1)).unwrap();
    stage_and_submit(&late, 8, 1, 0..1).unwrap();
    assert_eq!(late.wait(deadline()), RequestStatus::Completed);
    assert!(fd_fires(late.completion_fd().unwrap().as_raw_fd()));
    consume(&r, "ip-1", 8, 1).unwrap();
    wait_sender_empty(&s, "after in-place batches");
    wait_receiver_empty(&r, "after in-place batches");
}

#[test]
fn staging_is_only_handed_to_admitted_requests() {
    let r = receiver(4);
    let s = sender(sender_cfg(8, None));
    // A filler takes the whole receive buffer, so the next request parks.
    let fill = s
        .begin(RequestSpec::new("a-fill", r.endpoint(), 4))
        .unwrap();
    stage_and_submit(&fill, 1, 4, 0..4).unwrap();
    assert_eq!(fill.wait(deadline()), RequestStatus::Completed);
    let parked = s
        .begin(RequestSpec::new("a-parked", r.endpoint(), 2))
        .unwrap();
    wait_for("a-parked parked", || r.stats().core.parked_requests == 1);
    assert_eq!(parked.try_stage(1).unwrap_err(), StoreError::NotAdmitted);
    assert_eq!(
        parked
            .stage(1, Instant::now() + Duration::from_millis(50))
            .unwrap_err(),
        StoreError::AdmissionTimeout
    );
    assert_eq!(s.staging_in_use(), 0, "no staging held while not admitted");
    // A stage() waiting for admission gets it once the filler is consumed.
    let waiter = {
        let parked = parked.clone();
        std::thread::spawn(move || stage_and_submit(&parked, 2, 2, 0..2))
    };
    consume(&r, "a-fill", 1, 4).unwrap();
    join_within("stage() waiting for admission", waiter).unwrap();
    assert_eq!(parked.wait(deadline()), RequestStatus::Completed);
    consume(&r, "a-parked", 2, 2).unwrap();
    wait_sender_empty(&s, "after the admission waits");
    wait_receiver_empty(&r, "after the admission waits");
}

#[test]
fn cancel_wakes_a_stage_waiting_for_admission() {
    let r = receiver(2);
    let s = sender(sender_cfg(4, None));
    let fill = s
        .begin(RequestSpec::new("w-fill", r.endpoint(), 2))
        .unwrap();
    stage_and_submit(&fill, 1, 2, 0..2).unwrap();
    assert_eq!(fill.wait(deadline()), RequestStatus::Completed);
    let parked = s
        .begin(RequestSpec::new("w-parked", r.endpoint(), 2))
        .unwrap();
    wait_for("w-parked parked", || r.stats().core.parked_requests == 1);
    let waiter = {
        let parked = parked.clone();
        std::thread::spawn(move || parked.stage(2, deadline()).map(|_| ()))
    };
    // Give it a moment to block (the outcome is the same if it did not yet).
    std::thread::sleep(Duration::from_millis(20));
    assert!(parked.cancel());
    let res = join_within("stage() after cancel", waiter);
    assert!(
        matches!(
            res,
            Err(StoreError::Cancelled | StoreError::RequestEnded(RequestStatus::Cancelled))
        ),
        "{res:?}"
    );
    assert_eq!(parked.wait(deadline()), RequestStatus::Cancelled);
    assert!(!parked.cancel(), "already ended");
    consume(&r, "w-fill", 1, 2).unwrap();
    wait_sender_empty(&s, "after the cancelled stage");
    wait_receiver_empty(&r, "after the cancelled stage");
}

/// A wait that the request's *failure* ends says so: `RequestEnded` with
/// the failure, never `Cancelled` (the cancel token wakes the waiters of
/// every abort, a failure's included). Here the receiver's admission
/// timeout fails a parked request while `stage()` and the copying `store`
/// wait for its admission.
#[test]
fn a_failure_ending_a_wait_is_reported_as_the_failure_not_a_cancel() {
    let r = kvferry::receiver::Receiver::start(kvferry::receiver::ReceiverConfig {
        admission_timeout: Duration::from_millis(300),
        ..receiver_cfg(2)
    })
    .expect("receiver starts");
    let s = sender(sender_cfg(4, None));
    let fill = s
        .begin(RequestSpec::new("f-fill", r.endpoint(), 2))
        .unwrap();
    stage_and_submit(&fill, 1, 2, 0..2).unwrap();
    assert_eq!(fill.wait(deadline()), RequestStatus::Completed);
    for round in 0..3 {
        let id = format!("f-parked-{round}");
        let parked = s.begin(RequestSpec::new(&id, r.endpoint(), 2)).unwrap();
        let stager = {
            let parked = parked.clone();
            std::thread::spawn(move || parked.stage(1, deadline()).map(|_| ()))
        };
        let storer = {
            let parked = parked.clone();
            let k = key(&id, 2, 0, 2);
            std::thread::spawn(move || {
                let mut b = Vec::new();
                payloads().fill(chunk_id(2, 0, 2), &mut b);
                parked.store(&[k], &[&b])
            })
        };
        let st = parked.wait(deadline());
        assert!(matches!(st, RequestStatus::Failed { .. }), "{id}: {st:?}");
        for (what, res) in [
            (
                "stage()",
                join_within("stage() of a failing request", stager),
            ),
            (
                "store()",
                join_within("store() of a failing request", storer),
            ),
        ] {
            assert!(
                matches!(
                    &res,
                    Ok(()) | Err(StoreError::RequestEnded(RequestStatus::Failed { .. }))
                ),
                "{id}: {what} ended by a failure: {res:?}"
            );
        }
    }
    consume(&r, "f-fill", 1, 2).unwrap();
    wait_sender_empty(&s, "after the failed waits");
    wait_receiver_empty(&r, "after the failed waits");
}

#[test]
fn staged_batches_give_their_slots_back_on_drop_short_submit_and_error() {
    let r = receiver(16);
    let s = sender(sender_cfg(8, None));
    let req = s.begin(RequestSpec::new("sb-0", r.endpoint(), 3)).unwrap();
    let b = req.stage(4, deadline()).unwrap();
    assert_eq!(
        (b.len(), b.slot_bytes(), s.staging_in_use()),
        (4, CHUNK as usize, 4)
    );
    drop(b);
    let mut b = req.stage(1, deadline()).unwrap();
    assert!(
        b.slot_mut(0).is_some() && b.slot_mut(1).is_none(),
        "one slot"
    );
    drop(b);
    assert_eq!(s.staging_in_use(), 0, "dropped unsubmitted: slots back");
    let err = |n: usize, keys: &[&str], lens: &[u32]| {
        let b = req.try_stage(n).expect("admitted, slots free");
        let e = b.submit(keys, lens).unwrap_err();
        assert_eq!(s.staging_in_use(), 0, "refused submit gave the slots back");
        e
    };
    assert_eq!(
        err(2, &["a"], &[1, 2]),
        StoreError::KeyCountMismatch { keys: 1, chunks: 2 }
    );
    assert_eq!(
        err(1, &["a", "b"], &[1, 1]),
        StoreError::MoreChunksThanSlots {
            chunks: 2,
            slots: 1
        }
    );
    assert_eq!(
        err(1, &["a"], &[CHUNK as u32 + 1]),
        StoreError::ChunkTooLarge {
            index: 0,
            len: CHUNK as usize + 1,
            max: CHUNK
        }
    );
    assert_eq!(
        err(0, &[], &[]),
        StoreError::EmptyBatchNotLast,
        "3 chunks still to come"
    );
    let full = CHUNK as u32;
    assert_eq!(
        err(2, &["a", "b"], &[1, 1]),
        StoreError::ShortChunk {
            index: 0,
            len: 1,
            full: CHUNK
        },
        "only a batch's last chunk may be short"
    );
    assert_eq!(
        err(4, &["a", "b", "c", "d"], &[full, full, full, 1]),
        StoreError::TooManyChunks {
            req_id: "sb-0".into(),
            chunks: 4,
            total: 3
        }
    );
    assert_eq!(
        req.try_stage(9).unwrap_err(),
        StoreError::BatchTooLarge {
            chunks: 9,
            slots: 8
        }
    );
    // Stage 4, submit 3: the fourth slot goes back at once.
    let mut b = req.stage(4, deadline()).unwrap();
    let mut lens = Vec::new();
    let mut tmp = Vec::new();
    for i in 0..3u32 {
        payloads().fill(chunk_id(5, i, 3), &mut tmp);
        b.slot_mut(i as usize).expect("staged 4")[..tmp.len()].copy_from_slice(&tmp);
        lens.push(tmp.len() as u32);
    }
    let keys: Vec<String> = (0..3).map(|i| key("sb-0", 5, i, 3)).collect();
    b.submit(&keys, &lens).unwrap();
    assert!(s.staging_in_use() <= 3, "the unused slot went back");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    assert_eq!(
        req.try_stage(1).unwrap_err(),
        StoreError::RequestEnded(RequestStatus::Completed)
    );
    consume(&r, "sb-0", 5, 3).unwrap();
    wait_sender_empty(&s, "after the staged-batch checks");
    wait_receiver_empty(&r, "after the staged-batch checks");
}

#[test]
fn begin_errors_are_typed() {
    let r = receiver(16);
    let s = sender(sender_cfg(4, None));
    let ep = r.endpoint();
    assert_eq!(
        s.begin(RequestSpec::new("", ep, 1)).unwrap_err(),
        StoreError::EmptyReqId
    );
    assert_eq!(
        s.begin(RequestSpec::new("e-0", ep, 0)).unwrap_err(),
        StoreError::ZeroTotalChunks
    );
    let req = s.begin(RequestSpec::new("e-1", ep, 1)).unwrap();
    assert_eq!(
        s.begin(RequestSpec::new("e-1", ep, 1)).unwrap_err(),
        StoreError::DuplicateRequest {
            req_id: "e-1".into()
        }
    );
    // The copying store of a handle; then the id is spent.
    let mut b = Vec::new();
    payloads().fill(chunk_id(3, 0, 1), &mut b);
    req.store(&[key("e-1", 3, 0, 1)], &[&b]).unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    assert_eq!(
        s.begin(RequestSpec::new("e-1", ep, 1)).unwrap_err(),
        StoreError::RequestEnded(RequestStatus::Completed)
    );
    consume(&r, "e-1", 3, 1).unwrap();
    wait_sender_empty(&s, "after begin errors");
}

#[test]
fn callbacks_run_off_the_ctrl_thread_in_completion_order() {
    let r = receiver(64);
    let s = sender(sender_cfg(8, None));
    let seen: Arc<Mutex<Vec<(String, RequestStatus, String)>>> = Arc::default();
    {
        let seen = Arc::clone(&seen);
        s.set_callback(move |req, status| {
            let thread = std::thread::current().name().unwrap_or("").to_owned();
            seen.lock()
                .unwrap()
                .push((req.to_owned(), status.clone(), thread));
        });
    }
    let reqs: Vec<_> = (0..4u64)
        .map(|n| {
            let req = s
                .begin(RequestSpec::new(format!("cb-{n}"), r.endpoint(), 2))
                .unwrap();
            stage_and_submit(&req, n, 2, 0..2).unwrap();
            req
        })
        .collect();
    for req in &reqs {
        assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    }
    wait_for("4 callbacks", || seen.lock().unwrap().len() == 4);
    for (req, status, thread) in seen.lock().unwrap().iter() {
        assert_eq!(status, &RequestStatus::Completed, "{req}");
        assert!(
            thread.starts_with("kvf-send-cb"),
            "callback for {req} ran on {thread:?}, not the announcer thread"
        );
    }
    for (n, req) in reqs.iter().enumerate() {
        consume(&r, req.id(), n as u64, 2).unwrap();
    }
    s.clear_callback();
    wait_sender_empty(&s, "after callbacks");
}

#[test]
fn many_caller_threads_submit_concurrently_and_every_byte_lands() {
    // Callers hand their batches to ctrl through the submission ring, each
    // request handle through its own end of it; several threads also feed
    // one request at once. Bounded: 8 threads x 6 requests x 8 chunks, plus
    // 4 threads x 8 chunks of one shared request, 4 KiB chunks.
    const THREADS: u64 = 8;
    const PER_THREAD: u64 = 6;
    const TOTAL: u32 = 8;
    const SHARED_TOTAL: u32 = 32;
    let r = Arc::new(receiver(128));
    let s = Arc::new(sender(sender_cfg(16, None)));
    let endpoint = r.endpoint().to_owned();
    let mut threads = Vec::new();
    for t in 0..THREADS {
        let (r, s, endpoint) = (Arc::clone(&r), Arc::clone(&s), endpoint.clone());
        threads.push(std::thread::spawn(move || {
            for j in 0..PER_THREAD {
                let request = t * PER_THREAD + j;
                let id = format!("mt-{request}");
                let req = s
                    .begin(RequestSpec::new(&id, endpoint.as_str(), TOTAL as usize))
                    .unwrap_or_else(|e| panic!("begin {id}: {e}"));
                for part in 0..TOTAL / 2 {
                    let range = part * 2..part * 2 + 2;
                    if request % 2 == 0 {
                        stage_and_submit(&req, request, TOTAL, range)
                    } else {
                        let keys: Vec<String> =
                            range.clone().map(|i| key(&id, request, i, TOTAL)).collect();
                        let bufs: Vec<Vec<u8>> = range
                            .map(|i| {
                                let mut b = Vec::new();
                                payloads().fill(chunk_id(request, i, TOTAL), &mut b);
                                b
                            })
                            .collect();
                        let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                        req.store(&keys, &chunks)
                    }
                    .unwrap_or_else(|e| panic!("batch {part} of {id}: {e}"));
                }
                assert_eq!(req.wait(deadline()), RequestStatus::Completed, "{id}");
                consume(&r, &id, request, TOTAL).unwrap_or_else(|e| panic!("{id}: {e}"));
            }
        }));
    }
    let shared_no = THREADS * PER_THREAD;
    let shared = s
        .begin(RequestSpec::new(
            "mt-shared",
            endpoint.as_str(),
            SHARED_TOTAL as usize,
        ))
        .unwrap();
    let mut feeders = Vec::new();
    for f in 0..4u32 {
        let req = shared.clone();
        feeders.push(std::thread::spawn(move || {
            for part in 0..4 {
                let start = f * 8 + part * 2;
                stage_and_submit(&req, shared_no, SHARED_TOTAL, start..start + 2)
                    .unwrap_or_else(|e| panic!("feeder {f} batch {part}: {e}"));
            }
        }));
    }
    for (i, h) in feeders.into_iter().enumerate() {
        join_within(&format!("feeder {i}"), h);
    }
    assert_eq!(shared.wait(deadline()), RequestStatus::Completed);
    consume(&r, "mt-shared", shared_no, SHARED_TOTAL).unwrap();
    for (i, h) in threads.into_iter().enumerate() {
        join_within(&format!("caller thread {i}"), h);
    }
    wait_sender_empty(&s, "after the concurrent callers");
    wait_receiver_empty(&r, "after the concurrent callers");
    let st = s.stats();
    assert_eq!(
        st.counter(kvferry::stats::Counter::Completed),
        THREADS * PER_THREAD + 1
    );
}

/// A chunk is whole unless it ends its batch, and never longer than one
/// chunk of the request's geometry: the receiver takes every chunk of a
/// batch but the last as whole, and sizes its slots by that geometry.
/// Here the sender's staging slots (2 × `CHUNK`) are larger than the
/// receiver's (`CHUNK`) and the request's geometry (`[CHUNK / 4]` of
/// `float32`) fills exactly one receive slot. Before the check a chunk of
/// a whole staging slot was written across two receive slots, over the
/// neighbouring request's chunk, and a short first chunk was delivered
/// whole, its tail the bytes of a request before it.
#[test]
fn a_chunk_is_whole_unless_last_and_never_longer_than_a_chunk_of_the_request() {
    let r = receiver(5);
    let s = sender(SenderConfig {
        chunk_bytes: 2 * CHUNK,
        ..sender_cfg(4, None)
    });
    let spec = |id: &str, n| RequestSpec {
        shape: vec![CHUNK as i64 / 4],
        dtype: "float32".into(),
        ..RequestSpec::new(id, r.endpoint(), n)
    };
    let whole = vec![0xAAu8; CHUNK as usize];
    let neighbour = s.begin(spec("nb-a", 3)).unwrap();
    neighbour
        .store(&["nb-a/0", "nb-a/1", "nb-a/2"], &[&whole[..]; 3])
        .unwrap();
    r.wait_ready("nb-a", deadline()).unwrap();
    let mut held: Vec<_> = (0..3)
        .map(|i| r.get(&format!("nb-a/{i}")).unwrap())
        .collect();
    // Its lowest slot read and given back: the next request's first
    // chunk goes there, below the neighbour's others.
    held.sort_by_key(|c| c.slot());
    drop(held.remove(0));

    let req = s.begin(spec("nb-b", 2)).unwrap();
    let long = vec![0x55u8; 2 * CHUNK as usize];
    let too_long = StoreError::ChunkTooLarge {
        index: 0,
        len: 2 * CHUNK as usize,
        max: CHUNK,
    };
    assert_eq!(req.store(&["nb-b/0"], &[&long[..]]), Err(too_long.clone()));
    let mut b = req.stage(1, deadline()).unwrap();
    b.slot_mut(0).unwrap().fill(0x55);
    assert_eq!(b.submit(&["nb-b/0"], &[2 * CHUNK as u32]), Err(too_long));
    let short = StoreError::ShortChunk {
        index: 0,
        len: 100,
        full: CHUNK,
    };
    let tail = [0x66u8; 100];
    assert_eq!(
        req.store(&["nb-b/0", "nb-b/1"], &[&tail[..], &tail[..]]),
        Err(short.clone())
    );
    let b = req.stage(2, deadline()).unwrap();
    assert_eq!(b.submit(&["nb-b/0", "nb-b/1"], &[100, 100]), Err(short));
    assert_eq!(
        s.staging_in_use(),
        0,
        "refused batches gave their slots back"
    );

    // Whole, then short last: lands, and the neighbour is intact.
    let first = vec![0x77u8; CHUNK as usize];
    req.store(&["nb-b/0", "nb-b/1"], &[&first[..], &tail[..]])
        .unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    r.wait_ready("nb-b", deadline()).unwrap();
    assert_eq!(r.get("nb-b/0").unwrap().bytes(), &first[..]);
    for c in &held {
        assert!(
            c.bytes() == &whole[..],
            "the neighbour's chunk in slot {} was written over",
            c.slot()
        );
    }
}

/// The last chunk of a one-dimensional geometry is a whole number of
/// tokens: the receiver makes it `last_chunk_toks` tokens' bytes. By
/// default the sender counts the tokens it holds (its bytes over the
/// element size); given a count, the chunk must be that many tokens.
/// Before, the default was the chunk's bytes whatever the dtype: a
/// 100-byte last chunk of `bfloat16` was reported as 100 tokens and 200
/// bytes, half of them bytes nobody wrote.
#[test]
fn a_last_chunk_is_its_token_count_of_a_one_dimensional_shape() {
    let r = receiver(8);
    let s = sender(sender_cfg(4, None));
    let bf16 = |id: &str| RequestSpec {
        shape: vec![CHUNK as i64 / 2],
        dtype: "bfloat16".into(),
        ..RequestSpec::new(id, r.endpoint(), 2)
    };
    let whole = vec![1u8; CHUNK as usize];
    let req = s.begin(bf16("tok-0")).unwrap();
    assert_eq!(
        req.store(&["tok-0/0", "tok-0/1"], &[&whole[..], &[2u8; 101][..]]),
        Err(StoreError::LastChunkTokens {
            len: 101,
            tokens: None,
            token_bytes: 2
        }),
        "half a token"
    );
    let mut b = req.stage(2, deadline()).unwrap();
    b.set_last_chunk_toks(60);
    assert_eq!(
        b.submit(&["tok-0/0", "tok-0/1"], &[CHUNK as u32, 100]),
        Err(StoreError::LastChunkTokens {
            len: 100,
            tokens: Some(60),
            token_bytes: 2
        }),
        "60 tokens are 120 bytes"
    );
    req.store(&["tok-0/0", "tok-0/1"], &[&whole[..], &[2u8; 100][..]])
        .unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    r.wait_ready("tok-0", deadline()).unwrap();
    let last = r.get("tok-0/1").unwrap();
    assert_eq!((last.len(), last.tokens()), (100, Some(50)));
    assert_eq!(last.bytes(), &[2u8; 100][..]);
    drop((last, r.get("tok-0/0")));
    // The byte shape: a token is a byte.
    let req = s.begin(RequestSpec::new("tok-1", r.endpoint(), 1)).unwrap();
    let mut b = req.stage(1, deadline()).unwrap();
    b.set_last_chunk_toks(CHUNK as i64);
    assert_eq!(
        b.submit(&["tok-1/0"], &[100]),
        Err(StoreError::LastChunkTokens {
            len: 100,
            tokens: Some(CHUNK as i64),
            token_bytes: 1
        })
    );
    assert!(req.cancel());
    wait_sender_empty(&s, "after the token checks");
    wait_receiver_empty(&r, "after the token checks");
}

/// A later `Sender::store` of a request names the geometry it began with:
/// the request's AllocRequests carry that one (fmt, shape, dtype), and its
/// chunks are checked against it. Before, a later batch was checked
/// against its own spec's geometry and sent under the request's: a
/// `bfloat16` request's last batch given as bytes passed with a 101-byte
/// chunk, which the receiver then cut to 50 tokens (100 bytes).
#[test]
fn a_later_store_names_the_geometry_its_request_began_with() {
    use kvferry::sender::TransferSpec;
    let r = receiver(8);
    let s = sender(sender_cfg(4, None));
    let bf16 = |is_last| TransferSpec {
        shape: vec![CHUNK as i64 / 2],
        dtype: "bfloat16".into(),
        ..TransferSpec::new("geo-0", r.endpoint(), 2, is_last)
    };
    let whole = vec![1u8; CHUNK as usize];
    s.store(&bf16(false), &["geo-0/0"], &[&whole[..]]).unwrap();
    let tail = [2u8; 101];
    let mismatch = |given: &str| StoreError::GeometryMismatch {
        req_id: "geo-0".into(),
        begun: format!("fmt 0, shape [{}], dtype bfloat16", CHUNK / 2),
        given: given.into(),
    };
    assert_eq!(
        s.store(
            &TransferSpec::new("geo-0", r.endpoint(), 2, true),
            &["geo-0/1"],
            &[&tail[..]]
        ),
        Err(mismatch(&format!("fmt 0, shape [{CHUNK}], dtype uint8"))),
        "the byte shape"
    );
    for (spec, given) in [
        (
            TransferSpec {
                fmt: 1,
                ..bf16(true)
            },
            format!("fmt 1, shape [{}], dtype bfloat16", CHUNK / 2),
        ),
        (
            TransferSpec {
                dtype: "float16".into(),
                ..bf16(true)
            },
            format!("fmt 0, shape [{}], dtype float16", CHUNK / 2),
        ),
        (
            TransferSpec {
                shape: vec![2, CHUNK as i64 / 4],
                ..bf16(true)
            },
            format!("fmt 0, shape [2, {}], dtype bfloat16", CHUNK / 4),
        ),
    ] {
        assert_eq!(
            s.store(&spec, &["geo-0/1"], &[&tail[..100]]),
            Err(mismatch(&given))
        );
    }
    // The request's own geometry: its tail is whole tokens.
    assert_eq!(
        s.store(&bf16(true), &["geo-0/1"], &[&tail[..]]),
        Err(StoreError::LastChunkTokens {
            len: 101,
            tokens: None,
            token_bytes: 2
        })
    );
    s.store(&bf16(true), &["geo-0/1"], &[&tail[..100]]).unwrap();
    assert_eq!(terminal(&s, "geo-0"), RequestStatus::Completed);
    r.wait_ready("geo-0", deadline()).unwrap();
    let last = r.get("geo-0/1").unwrap();
    assert_eq!((last.bytes(), last.tokens()), (&tail[..100], Some(50)));
    drop((last, r.get("geo-0/0")));
    wait_sender_empty(&s, "after the geometry checks");
    wait_receiver_empty(&r, "after the geometry checks");
}

/// A request larger than any receiver takes fails at once with the
/// receiver's reason, its count as given: a `total_chunks` past `i64`
/// goes on the wire saturated, where it once wrapped to -1.
#[test]
fn a_request_of_more_chunks_than_the_wire_holds_fails_saying_so() {
    let r = receiver(8);
    let s = sender(sender_cfg(4, None));
    let req = s
        .begin(RequestSpec::new("huge", r.endpoint(), usize::MAX))
        .unwrap();
    match req.wait(deadline()) {
        RequestStatus::Failed { reason, .. } => assert!(
            reason.contains(&i64::MAX.to_string()),
            "the reason names the count: {reason}"
        ),
        other => panic!("expected a failure, got {other:?}"),
    }
    wait_sender_empty(&s, "after the huge request");
    wait_receiver_empty(&r, "after the huge request");
}

/// A geometry the receiver can never take is refused at `begin`, before
/// anything is sent, with the same rule an attached worker's BEGIN meets:
/// a shape and dtype that make a chunk size, a chunk no larger than a
/// staging slot (the byte shape of a two-byte dtype is two slots), a
/// format code of at least 0. Before,
/// such a request was admitted and failed at its first batch, or (the
/// byte shape of `bfloat16` against a receiver of larger slots) sized its
/// last chunk twice what was written.
#[test]
fn a_geometry_no_receiver_takes_is_refused_at_begin() {
    use kvferry::protocol::ProtocolError;
    use kvferry::sender::{ShapeError, TransferSpec};
    let r = receiver(8);
    let s = sender(sender_cfg(4, None));
    let too_large = |bytes| ShapeError::TooLarge { bytes, max: CHUNK };
    for (i, (shape, dtype, error)) in [
        (
            vec![16],
            "int4",
            ShapeError::Chunk(ProtocolError::UnknownDtype("int4".into())),
        ),
        (
            vec![4, 0],
            "uint8",
            ShapeError::Chunk(ProtocolError::NonPositiveDim { index: 1, value: 0 }),
        ),
        (
            vec![i64::MAX, 4],
            "float32",
            ShapeError::Chunk(ProtocolError::ChunkBytesOverflow),
        ),
        (vec![CHUNK as i64 + 1], "uint8", too_large(CHUNK + 1)),
        (vec![], "bfloat16", too_large(2 * CHUNK)),
        (vec![16], "uint8", ShapeError::NegativeFmt(-1)),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("shape-{i}");
        let fmt = if matches!(error, ShapeError::NegativeFmt(_)) {
            -1
        } else {
            0
        };
        let spec = RequestSpec {
            fmt,
            shape: shape.clone(),
            dtype: dtype.into(),
            ..RequestSpec::new(&id, r.endpoint(), 2)
        };
        let want = Err(StoreError::BadGeometry(error));
        assert_eq!(s.begin(spec).map(|_| ()), want, "{shape:?} of {dtype}");
        let spec = TransferSpec {
            fmt,
            shape: shape.clone(),
            dtype: dtype.into(),
            ..TransferSpec::new(&id, r.endpoint(), 1, true)
        };
        assert_eq!(
            s.store(&spec, &[format!("{id}/0")], &[&[0u8; 16][..]]),
            want,
            "Sender::store, {shape:?} of {dtype}"
        );
        assert_eq!(s.status(&id), None, "{id}: nothing registered");
    }
    // The widest that fits: a whole slot of float32.
    let spec = RequestSpec {
        shape: vec![CHUNK as i64 / 4],
        dtype: "float32".into(),
        ..RequestSpec::new("shape-ok", r.endpoint(), 1)
    };
    let req = s.begin(spec).unwrap();
    req.store(&["shape-ok/0"], &[&[7u8; CHUNK as usize][..]])
        .unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    r.wait_ready("shape-ok", deadline()).unwrap();
    drop(r.get("shape-ok/0").unwrap());
    wait_sender_empty(&s, "after the geometry refusals");
    wait_receiver_empty(&r, "after the geometry refusals");
}

/// A last chunk's token count is one the wire and the decoder carry,
/// whatever the shape: in `0..=u32::MAX`. Before, a multi-dimensional
/// request (whose token axis the sender does not size) sent a negative
/// count, and its batch failed at the receiver as a bad message.
#[test]
fn a_token_count_outside_32_bits_is_refused_on_every_shape() {
    use kvferry::sender::TransferSpec;
    let r = receiver(8);
    let s = sender(sender_cfg(4, None));
    let spec = |id: &str| RequestSpec {
        shape: vec![2, 16, 32],
        dtype: "bfloat16".into(),
        ..RequestSpec::new(id, r.endpoint(), 1)
    };
    let req = s.begin(spec("toks-md")).unwrap();
    for tokens in [-1, i64::from(u32::MAX) + 1] {
        let mut b = req.stage(1, deadline()).unwrap();
        b.set_last_chunk_toks(tokens);
        assert_eq!(
            b.submit(&["toks-md/0"], &[100]),
            Err(StoreError::TokensOutOfRange { tokens })
        );
    }
    let mut b = req.stage(1, deadline()).unwrap();
    b.set_last_chunk_toks(i64::from(u32::MAX));
    b.submit(&["toks-md/0"], &[100]).unwrap();
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    r.wait_ready("toks-md", deadline()).unwrap();
    let c = r.get("toks-md/0").unwrap();
    assert_eq!(c.tokens(), Some(u32::MAX), "the count as given");
    drop(c);
    // The copying path of a one-dimensional request, and the legacy store.
    let t = TransferSpec {
        last_chunk_toks: Some(-3),
        ..TransferSpec::new("toks-1d", r.endpoint(), 1, true)
    };
    assert_eq!(
        s.store(&t, &["toks-1d/0"], &[&[1u8; 10][..]]),
        Err(StoreError::TokensOutOfRange { tokens: -3 })
    );
    assert_eq!(s.status("toks-1d"), None, "nothing registered");
    wait_sender_empty(&s, "after the token counts");
    wait_receiver_empty(&r, "after the token counts");
}
