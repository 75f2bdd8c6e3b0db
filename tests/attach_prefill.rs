//! Prefill attach (`docs/attach.md`): a worker process attached to a
//! sender daemon fills staging slots in place and submits them with their
//! keys; the receiver holds every byte it wrote. A worker killed with
//! SIGKILL mid-request gets its requests cancelled and its staging back
//! (sender and receiver end holding nothing). Hostile submissions are
//! refused and change nothing. Children are this test binary re-executed
//! (role in an env var). Every wait has a deadline.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common_sender/mod.rs"]
mod common_sender;
#[path = "common/process.rs"]
mod process;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common_sender::{
    deadline, expect_done, expect_refused, key, next, raw_receiver_daemon, receiver, sender,
    sender_cfg, staged, unique, wait_for, wait_receiver_empty, wait_sender_empty, CHUNK, WAIT,
};
use kvferry::attach::layout::{
    PrefillSubmit, MAX_REQ_ID, MAX_SHAPE_DIMS, OP_KEY, OP_SUBMIT, STATUS_NO_SHARE,
};
use kvferry::attach::{
    AttachConfig, AttachError, BeginGeometry, PrefillClient, PrefillDaemon, PrefillEvent, Refusal,
    StagedSlots,
};
use kvferry::protocol::ErrorCode;
use kvferry::receiver::Receiver;
use kvferry::sender::{Sender, SenderConfig};
use process::{
    python_client, python_pattern, rerun_alone, status_and_stderr, thread_faults, ChildProc,
    TempDir,
};

const ROLE: &str = "KVFERRY_PREFILL_ROLE";
const SOCK: &str = "KVFERRY_PREFILL_SOCK";
const REQ: &str = "KVFERRY_PREFILL_REQ";
const COUNT: &str = "KVFERRY_PREFILL_COUNT";
/// Request number used in the keys (kvferry key format).
const REQUEST: u64 = 7;

/// Chunk `i` of `n` of `req_id`: full [`CHUNK`] bytes but the last (half a
/// chunk); content depends on the request and the index.
fn chunk(req_id: &str, i: usize, n: usize) -> Vec<u8> {
    let len = if i + 1 == n {
        CHUNK as usize / 2 + 3
    } else {
        CHUNK as usize
    };
    let seed = req_id
        .bytes()
        .fold((i as u32).wrapping_mul(2_654_435_761), |a, b| {
            a.rotate_left(5) ^ u32::from(b)
        });
    (0..len)
        .map(|j| (seed.wrapping_add(j as u32).wrapping_mul(0x9e37_79b9) >> 24) as u8)
        .collect()
}

struct Setup {
    r: Arc<Receiver>,
    s: Arc<Sender>,
    d: PrefillDaemon,
    _dir: TempDir,
}

/// A receiver, a sender of `staging` slots in `shares` staging shares, and
/// a prefill daemon over them.
fn setup(staging: usize, shares: usize) -> Setup {
    let dir = TempDir::new("kvferry-prefill");
    let r = Arc::new(receiver(64));
    let s = Arc::new(sender(SenderConfig {
        staging_shares: shares,
        ..sender_cfg(staging, None)
    }));
    let d = PrefillDaemon::start(
        Arc::clone(&s),
        vec![r.endpoint().to_owned()],
        AttachConfig::new(dir.sock()),
    )
    .expect("daemon starts");
    Setup { r, s, d, _dir: dir }
}

/// Fills `b` with chunks `first..first + b.len()` of `req_id` (of `n`);
/// returns their keys and lengths.
fn fill(
    c: &mut PrefillClient,
    b: &StagedSlots,
    req_id: &str,
    first: usize,
    n: usize,
) -> (Vec<String>, Vec<u32>) {
    let mut keys = Vec::new();
    let mut lens = Vec::new();
    for j in 0..b.len() {
        let i = first + j;
        let data = chunk(req_id, i, n);
        c.slot_mut(b, j).expect("held slot")[..data.len()].copy_from_slice(&data);
        keys.push(key(req_id, REQUEST, i as u32, n as u32));
        lens.push(data.len() as u32);
    }
    (keys, lens)
}

/// [`fill`]s `b` and submits it.
fn fill_and_submit(c: &mut PrefillClient, b: StagedSlots, req_id: &str, first: usize, n: usize) {
    let (keys, lens) = fill(c, &b, req_id, first, n);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.submit(b, &keys, &lens).expect("submitted");
}

/// The re-executed child: attach, write the request in two batches and
/// wait for DONE ("worker"), or submit one batch, stage another and hang
/// until killed ("holder").
fn child_main(role: &str) {
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let req = std::env::var(REQ).unwrap();
    let n: usize = std::env::var(COUNT).unwrap().parse().unwrap();
    let mut c = PrefillClient::connect(&sock, WAIT).expect("child attaches");
    let tag = c.begin(&req, 0, n as u32).unwrap();
    let half = n / 2;
    c.stage(tag, half as u32).unwrap();
    let b = staged(&mut c, "first batch");
    fill_and_submit(&mut c, b, &req, 0, n);
    c.stage(tag, (n - half) as u32).unwrap();
    let b = staged(&mut c, "second batch");
    if role == "holder" {
        println!("HOLDING");
        thread::sleep(WAIT * 2);
        panic!("holder was not killed");
    }
    fill_and_submit(&mut c, b, &req, half, n);
    match next(&mut c, "DONE") {
        PrefillEvent::Done { tag: t } => assert_eq!(t, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    println!("WORKER DONE");
}

/// The re-executed test binary as a worker child (killed on drop).
fn worker_child(test: &str, role: &str, sock: &Path, req: &str, n: usize) -> ChildProc {
    ChildProc::spawn(
        rerun_alone(test)
            .env(ROLE, role)
            .env(SOCK, sock)
            .env(REQ, req)
            .env(COUNT, n.to_string()),
    )
}

/// Checks every byte of `req_id` at the receiver, then releases it.
fn verify_at_receiver(r: &Receiver, req_id: &str, n: usize) {
    r.wait_ready(req_id, deadline())
        .unwrap_or_else(|e| panic!("{req_id} never ready at the receiver: {e}"));
    let mut held = Vec::new();
    for i in 0..n {
        let k = key(req_id, REQUEST, i as u32, n as u32);
        let c = r.get(&k).unwrap_or_else(|| panic!("key {k} not held"));
        assert!(
            c.bytes() == chunk(req_id, i, n).as_slice(),
            "chunk {i} of {req_id} differs at the receiver"
        );
        held.push(c);
    }
}

#[test]
fn a_worker_process_fills_staging_in_place_and_the_receiver_holds_every_byte() {
    if let Ok(role) = std::env::var(ROLE) {
        return child_main(&role);
    }
    let t = setup(16, 1);
    let req = unique("pf");
    let n = 10;
    let mut w = worker_child(
        "a_worker_process_fills_staging_in_place_and_the_receiver_holds_every_byte",
        "worker",
        t.d.socket(),
        &req,
        n,
    );
    verify_at_receiver(&t.r, &req, n);
    w.expect_line("WORKER DONE");
    w.wait_success("worker");
    wait_sender_empty(&t.s, "after the worker's request");
    wait_for("the session to end", || t.d.clients() == 0);
    wait_receiver_empty(&t.r, "after the decoder released the request");
}

#[test]
fn sigkill_of_a_worker_mid_request_cancels_it_and_returns_its_staging() {
    if let Ok(role) = std::env::var(ROLE) {
        return child_main(&role);
    }
    let t = setup(16, 1);
    let req = unique("pk");
    let n = 8;
    let mut w = worker_child(
        "sigkill_of_a_worker_mid_request_cancels_it_and_returns_its_staging",
        "holder",
        t.d.socket(),
        &req,
        n,
    );
    w.expect_line("HOLDING");
    // It holds half the request's slots staged and unsubmitted.
    assert!(t.s.staging_in_use() > 0, "the holder's batch holds staging");
    w.child.kill().unwrap();
    let _ = w.child.wait();
    wait_for("the session to end", || t.d.clients() == 0);
    let st =
        t.s.wait(&req, deadline())
            .expect("sender knows the request");
    assert!(
        st.is_terminal() && !matches!(st, kvferry::sender::RequestStatus::Completed),
        "the killed worker's request ends cancelled, not {st:?}"
    );
    wait_sender_empty(&t.s, "after the worker was killed");
    assert_eq!(t.s.active_requests(), 0);
    wait_receiver_empty(&t.r, "after the worker was killed");
}

#[test]
fn hostile_submissions_are_refused_and_change_nothing() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let mut b = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("ph");
    let n = 4;
    let ta = a.begin(&req, 0, n as u32).unwrap();
    // Its STAGED proves the BEGIN was served (sessions run on their own
    // threads).
    a.stage(ta, n as u32).unwrap();
    let batch = staged(&mut a, "a's batch");
    // Same req_id from another worker: the sender refuses the duplicate.
    let tb = b.begin(&req, 0, n as u32).unwrap();
    match next(&mut b, "duplicate BEGIN") {
        PrefillEvent::Refused { tag, reason } => {
            assert_eq!((tag, reason), (tb, Some(Refusal::SenderRefused)))
        }
        other => panic!("expected REFUSED, got {other:?}"),
    }
    // Unknown receiver index; STAGE/SUBMIT/CANCEL of a tag b does not own.
    let tx = b.begin("other", 5, 1).unwrap();
    let refused = |c: &mut PrefillClient, want: Refusal, what: &str| match next(c, what) {
        PrefillEvent::Refused { reason, .. } => assert_eq!(reason, Some(want), "{what}"),
        other => panic!("{what}: expected REFUSED, got {other:?}"),
    };
    refused(&mut b, Refusal::UnknownReceiver, "receiver index 5");
    let _ = tx;
    b.submit_raw(PrefillSubmit::of(OP_SUBMIT, ta, 1, 1, 0))
        .unwrap();
    refused(&mut b, Refusal::UnknownTag, "SUBMIT of a's tag");
    b.submit_raw(PrefillSubmit::of(99, ta, 0, 0, 0)).unwrap();
    refused(&mut b, Refusal::BadOp, "unknown op");
    // a's request is untouched: a bad KEY is refused, then it completes.
    a.submit_raw(PrefillSubmit::with_text(OP_KEY, ta, 12345, 0, 10, "k").unwrap())
        .unwrap();
    refused(&mut a, Refusal::BadBatch, "KEY of a batch not held");
    // Too large a STAGE for the staging buffer: the sender refuses it.
    a.stage(ta, 1000).unwrap();
    refused(
        &mut a,
        Refusal::SenderRefused,
        "STAGE past the staging buffer",
    );
    fill_and_submit(&mut a, batch, &req, 0, n);
    match next(&mut a, "a's DONE") {
        PrefillEvent::Done { tag } => assert_eq!(tag, ta),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, n);
    wait_sender_empty(&t.s, "after the hostile test");
}

#[test]
fn a_cancel_reports_failed_cancelled_and_frees_the_batch() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("pc");
    let tag = a.begin(&req, 0, 4).unwrap();
    a.stage(tag, 2).unwrap();
    let _b = staged(&mut a, "batch");
    assert_eq!(t.s.staging_in_use(), 2);
    a.cancel(tag).unwrap();
    match next(&mut a, "FAILED") {
        PrefillEvent::Failed { tag: t2, code } => {
            assert_eq!((t2, code), (tag, Some(ErrorCode::Cancelled)))
        }
        other => panic!("expected FAILED, got {other:?}"),
    }
    wait_sender_empty(&t.s, "after the cancel");
    wait_receiver_empty(&t.r, "after the cancel");
}

/// A session hears of all its requests' ends through the share's one
/// eventfd: requests submitted back to back (so several end within one of
/// the session's wake-ups) and one cancelled before it staged each end
/// once, DONE or FAILED under their own tag, with every byte at the
/// receiver and every staging slot back.
#[test]
fn requests_ending_together_are_each_reported_once() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    const N: usize = 6;
    let t = setup(32, 1);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let ids: Vec<String> = (0..N).map(|_| unique("together")).collect();
    let tags: Vec<u64> = ids.iter().map(|id| c.begin(id, 0, 2).unwrap()).collect();
    for &tag in &tags[..N - 1] {
        c.stage(tag, 2).unwrap();
    }
    let mut held = HashMap::new();
    for _ in 0..N - 1 {
        let b = staged(&mut c, "a batch");
        held.insert(b.tag(), b);
    }
    c.cancel(tags[N - 1]).unwrap();
    for (id, tag) in ids.iter().zip(&tags).take(N - 1) {
        let b = held.remove(tag).expect("staged");
        fill_and_submit(&mut c, b, id, 0, 2);
    }
    let mut left: HashSet<u64> = tags.iter().copied().collect();
    while !left.is_empty() {
        match next(&mut c, &format!("the {} left: {left:?}", left.len())) {
            PrefillEvent::Done { tag } => {
                assert_ne!(tag, tags[N - 1], "the cancelled request completed");
                assert!(left.remove(&tag), "a second end for {tag}");
            }
            PrefillEvent::Failed { tag, code } => {
                assert_eq!((tag, code), (tags[N - 1], Some(ErrorCode::Cancelled)));
                assert!(left.remove(&tag), "a second end for {tag}");
            }
            other => panic!("expected DONE or FAILED, got {other:?}"),
        }
    }
    for id in &ids[..N - 1] {
        verify_at_receiver(&t.r, id, 2);
    }
    wait_sender_empty(&t.s, "after every request ended");
}

/// Fills `b` with `lens[i]` bytes of chunk `i` of `req_id` and submits it
/// with keys `req_id/i` (and `toks` for its last chunk, if given).
fn fill_keyed(
    c: &mut PrefillClient,
    mut b: StagedSlots,
    req_id: &str,
    lens: &[usize],
    toks: Option<u32>,
) {
    for (i, &len) in lens.iter().enumerate() {
        c.slot_mut(&b, i).expect("held slot")[..len].copy_from_slice(&python_pattern(i, len));
    }
    if let Some(t) = toks {
        b.set_last_chunk_toks(t);
    }
    let keys: Vec<String> = (0..lens.len()).map(|i| format!("{req_id}/{i}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let lens: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    c.submit(b, &keys, &lens).expect("submitted");
}

/// What an in-process caller sets with `RequestSpec { fmt, shape, dtype }`
/// and `StagedBatch::set_last_chunk_toks`, an attached worker sets too:
/// the kvferry receiver sizes the last chunk from the shape, dtype and
/// token count (a one-dimensional shape: `full / tokens * toks` bytes) and
/// its holder sees the token count; a worker that sets nothing gets the
/// defaults (the last chunk's byte length as its token count).
#[test]
fn an_attached_workers_geometry_and_token_count_reach_the_receiver() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    // [CHUNK / 2] elements of 2 bytes: a full chunk is CHUNK bytes, and a
    // last chunk of 50 tokens is 100 bytes.
    let g = BeginGeometry::new(2, &[CHUNK as i64 / 2], "bf16").unwrap();
    let req = unique("pg");
    let tag = a.begin_with(&req, 0, 3, &g).unwrap();
    a.stage(tag, 3).unwrap();
    let b = staged(&mut a, "the batch");
    let lens = [CHUNK as usize, CHUNK as usize, 100];
    fill_keyed(&mut a, b, &req, &lens, Some(50));
    expect_done(&mut a, tag, "DONE");
    t.r.wait_ready(&req, deadline())
        .expect("ready at the receiver");
    for (i, &len) in lens.iter().enumerate() {
        let c = t.r.get(&format!("{req}/{i}")).expect("held");
        assert_eq!(
            c.len(),
            len,
            "chunk {i}'s length, from shape, dtype and tokens"
        );
        assert!(
            c.bytes() == python_pattern(i, len).as_slice(),
            "chunk {i}'s bytes"
        );
        let want = (i == 2).then_some(50);
        assert_eq!(c.tokens(), want, "chunk {i}'s token count");
    }
    // The defaults: shape [CHUNK] of uint8, tokens = the last length.
    let req2 = unique("pg");
    let tag = a.begin(&req2, 0, 1).unwrap();
    a.stage(tag, 1).unwrap();
    let b = staged(&mut a, "the default batch");
    fill_keyed(&mut a, b, &req2, &[777], None);
    expect_done(&mut a, tag, "default DONE");
    t.r.wait_ready(&req2, deadline()).expect("ready");
    let c = t.r.get(&format!("{req2}/0")).expect("held");
    assert_eq!((c.len(), c.tokens()), (777, Some(777)));
}

/// The AllocRequests an attached worker's requests cause carry its fmt,
/// shape and dtype (admission and batch) and its last chunk's token count,
/// as a raw ROUTER playing an LMCache receiver (no Hello, a static buffer)
/// decodes them; the defaults are those of `RequestSpec::new`.
#[test]
fn the_alloc_requests_of_an_attached_worker_carry_its_fmt_shape_dtype_and_tokens() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-prefill");
    let raw = raw_receiver_daemon(&dir.sock());
    let mut a = PrefillClient::connect(raw.daemon.socket(), WAIT).unwrap();
    let shape = [2i64, 16, CHUNK as i64 / 64];
    let g = BeginGeometry::new(5, &shape, "bfloat16").unwrap();
    let req = unique("pw");
    let tag = a.begin_with(&req, 0, 2, &g).unwrap();
    let (id, m) = raw.recv_alloc("the admission");
    assert!(m.keys.is_empty(), "an admission message: {m:?}");
    assert_eq!(
        (m.fmt, &m.shape[..], &m.dtype[..]),
        (5, &shape[..], "bfloat16")
    );
    assert_eq!((&m.req_id[..], m.total_chunks), (&req[..], 2));
    raw.reply(&id, Vec::new());
    a.stage(tag, 2).unwrap();
    let b = staged(&mut a, "the batch");
    fill_keyed(&mut a, b, &req, &[CHUNK as usize, 1000], Some(9));
    let (id, m) = raw.recv_alloc("the batch");
    assert_eq!(m.keys, [format!("{req}/0"), format!("{req}/1")]);
    assert_eq!(
        (m.fmt, &m.shape[..], &m.dtype[..]),
        (5, &shape[..], "bfloat16")
    );
    assert_eq!((m.last_chunk_toks, m.is_last_batch), (9, true));
    raw.reply(&id, vec![0, 1]);
    expect_done(&mut a, tag, "DONE");
    // Nothing set: RequestSpec::new's geometry, tokens = the byte length.
    let req = unique("pw");
    let tag = a.begin(&req, 0, 1).unwrap();
    let (id, m) = raw.recv_alloc("the default admission");
    assert_eq!(
        (m.fmt, &m.shape[..], &m.dtype[..]),
        (0, &[CHUNK as i64][..], "uint8")
    );
    raw.reply(&id, Vec::new());
    a.stage(tag, 1).unwrap();
    let b = staged(&mut a, "the default batch");
    fill_keyed(&mut a, b, &req, &[300], None);
    let (id, m) = raw.recv_alloc("the default batch");
    assert_eq!((m.last_chunk_toks, m.is_last_batch), (300, true));
    raw.reply(&id, vec![2]);
    expect_done(&mut a, tag, "default DONE");
    drop(a);
    drop(raw.daemon);
    wait_sender_empty(&raw.sender, "after the raw receiver's requests");
}

/// A hostile worker's geometry and token counts out of range are refused
/// with their typed code, one by one, by the session that keeps serving
/// it; a refused SUBMIT gives its batch back; another worker's request,
/// staged meanwhile, completes untouched.
#[test]
fn out_of_range_geometry_and_token_counts_are_refused_and_the_daemon_keeps_serving() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut victim = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let mut h = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let vreq = unique("pv");
    let vg = BeginGeometry::new(1, &[CHUNK as i64 / 4], "float32").unwrap();
    let vtag = victim.begin_with(&vreq, 0, 2, &vg).unwrap();
    victim.stage(vtag, 2).unwrap();
    let vb = staged(&mut victim, "the victim's batch");
    let ok = BeginGeometry::new(1, &[2, 8], "bf16").unwrap();
    let bad: Vec<(&str, BeginGeometry)> = vec![
        (
            "9 dims",
            BeginGeometry {
                ndims: MAX_SHAPE_DIMS as u32 + 1,
                ..ok
            },
        ),
        (
            "u32::MAX dims",
            BeginGeometry {
                ndims: u32::MAX,
                ..ok
            },
        ),
        ("dtype not UTF-8", {
            let mut g = ok;
            g.dtype[..2].copy_from_slice(&[0xff, 0xfe]);
            g.dtype_len = 2;
            g
        }),
        (
            "dtype_len 200",
            BeginGeometry {
                dtype_len: 200,
                ..ok
            },
        ),
        (
            "unknown dtype",
            BeginGeometry::new(1, &[2, 8], "bfloat17").unwrap(),
        ),
        (
            "negative dim",
            BeginGeometry::new(1, &[2, -8], "bf16").unwrap(),
        ),
        ("zero dim", BeginGeometry::new(1, &[0], "bf16").unwrap()),
        (
            "overflow",
            BeginGeometry::new(1, &[i64::MAX, i64::MAX], "bf16").unwrap(),
        ),
        (
            "larger than a slot",
            BeginGeometry::new(1, &[2, CHUNK as i64], "bf16").unwrap(),
        ),
        (
            "default shape of bf16",
            BeginGeometry::new(1, &[], "bf16").unwrap(),
        ),
        (
            "negative fmt",
            BeginGeometry::new(-1, &[2, 8], "bf16").unwrap(),
        ),
    ];
    for (i, (what, g)) in bad.iter().enumerate() {
        let tag = 1000 + i as u64;
        let s = PrefillSubmit::begin(tag, 0, 1, &format!("bad-{i}"), g).unwrap();
        h.submit_raw(s).unwrap();
        expect_refused(&mut h, tag, Refusal::BadGeometry, what);
    }
    // A req_id past MAX_REQ_ID (a KEY's text may be that long, a BEGIN's not).
    let mut s = PrefillSubmit::begin(2000, 0, 1, "r", &ok).unwrap();
    s.text[..MAX_REQ_ID + 1].fill(b'r');
    s.text_len = MAX_REQ_ID as u32 + 1;
    h.submit_raw(s).unwrap();
    expect_refused(&mut h, 2000, Refusal::BadReqId, "a 113-byte req_id");
    assert!(
        t.s.status("bad-0").is_none() && t.s.active_requests() == 1,
        "no refused BEGIN reached the sender"
    );
    // A valid request; a SUBMIT whose token count is past the shape's
    // largest dimension (8) is refused and its batch goes back.
    let req = unique("pt");
    let tag = h.begin_with(&req, 0, 1, &ok).unwrap();
    h.stage(tag, 1).unwrap();
    let b = staged(&mut h, "the hostile worker's batch");
    assert_eq!(t.s.staging_in_use(), 3);
    fill_keyed(&mut h, b, &req, &[32], Some(9));
    expect_refused(
        &mut h,
        tag,
        Refusal::BadTokens,
        "9 tokens of a [2, 8] chunk",
    );
    wait_for("the refused batch's slot to come back", || {
        t.s.staging_in_use() == 2
    });
    h.stage(tag, 1).unwrap();
    let b = staged(&mut h, "the batch again");
    fill_keyed(&mut h, b, &req, &[32], Some(8));
    expect_done(&mut h, tag, "the hostile worker's valid request");
    t.r.wait_ready(&req, deadline())
        .expect("ready at the receiver");
    let c = t.r.get(&format!("{req}/0")).expect("held");
    assert_eq!((c.len(), c.tokens()), (32, Some(8)));
    drop(c);
    // The victim: untouched, completes.
    fill_keyed(&mut victim, vb, &vreq, &[CHUNK as usize, 40], Some(10));
    expect_done(&mut victim, vtag, "the victim's DONE");
    t.r.wait_ready(&vreq, deadline())
        .expect("ready at the receiver");
    let c = t.r.get(&format!("{vreq}/1")).expect("held");
    assert_eq!((c.len(), c.tokens()), (40, Some(10)));
    assert!(c.bytes() == python_pattern(1, 40).as_slice());
}

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

/// Starts the kvferry binary with `args`; waits for its `announce` line
/// (and returns the rest of it) and its "attach on" line.
fn spawn_binary(args: &[&str], role: &str, announce: &str) -> (ChildProc, String) {
    spawn_binary_with(args, role, announce, Stdio::inherit())
}

/// [`spawn_binary`] with the child's stderr going to `stderr`.
fn spawn_binary_with(
    args: &[&str],
    role: &str,
    announce: &str,
    stderr: Stdio,
) -> (ChildProc, String) {
    let mut p = ChildProc::spawn(
        Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stderr(stderr),
    );
    let attach = format!("kvferry {role} attach on ");
    let found = p.after_prefixes(&[announce, &attach]).remove(0);
    (p, found)
}

/// `kvferry receiver` (8 slots of [`CHUNK`] bytes, buffer at `shm`)
/// serving attached decoders on `sock`; returns it with its endpoint.
fn spawn_attach_receiver(sock: &Path, shm: &Path) -> (ChildProc, String) {
    spawn_attach_receiver_with(sock, shm, Stdio::inherit())
}

/// [`spawn_attach_receiver`] with the receiver's stderr going to `stderr`.
fn spawn_attach_receiver_with(sock: &Path, shm: &Path, stderr: Stdio) -> (ChildProc, String) {
    spawn_binary_with(
        &[
            "receiver",
            "--listen",
            "tcp://127.0.0.1:0",
            "--capacity-chunks",
            "8",
            "--chunk-bytes",
            &CHUNK.to_string(),
            "--attach",
            sock.to_str().unwrap(),
            "--shm-path",
            shm.to_str().unwrap(),
        ],
        "receiver",
        "kvferry receiver listening on ",
        stderr,
    )
}

/// A worker process that scribbles on its own rings' indices
/// (`clients/python/ring_abuse_check.py prefill`, as the decoder's test in
/// `attach_decoder.rs`) harms only itself: its session reads no
/// submission and writes no completion past them, answers every CANCEL
/// once the indices are sane, and never panics; with one attachment
/// allowed, the next worker writes a request that a Python decoder
/// verifies byte for byte.
#[test]
fn a_worker_scribbling_on_its_ring_indices_harms_only_itself() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-prefill");
    let rsock = dir.0.join("recv.sock");
    let ssock = dir.0.join("send.sock");
    let shm = dir.0.join("buf");
    let chunk = CHUNK.to_string();
    let (_recv, endpoint) = spawn_attach_receiver(&rsock, &shm);
    let log_path = dir.0.join("sender.stderr");
    let log = std::fs::File::create(&log_path).expect("the sender's stderr file");
    let mut send = ChildProc::spawn(
        Command::new(BIN)
            .args(["sender", "--connect", &endpoint, "--chunk-bytes", &chunk])
            .args(["--staging-slots", "8", "--attach-max-clients", "1"])
            .arg("--attach")
            .arg(&ssock)
            .stdin(Stdio::null())
            .stderr(Stdio::from(log)),
    );
    send.expect_line("kvferry sender attach on ");
    let sender_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let (rs, ss) = (rsock.to_str().unwrap(), ssock.to_str().unwrap());
    let mut abuser = python_client("ring_abuse_check.py", &["prefill", ss]);
    abuser.expect_line("ATTACH:ok");
    abuser.wait_success("the worker scribbling on its ring indices");
    let pid = send.child.id();
    wait_for("the scribbling worker's session to end", || {
        process::attach_sessions(pid) == 0
    });
    // Its place is back: the one attachment allowed goes to the next one.
    let mut dec = python_client(
        "decoder_check.py",
        &[rs, "after-scribbling", "2", "77", "release"],
    );
    dec.expect_line("ATTACH:subscribed");
    let mut pf = python_client("prefill_check.py", &[ss, "after-scribbling", "2", "77"]);
    pf.expect_line("PREFILL:ok");
    pf.wait_success("the worker attached after the scribbling one");
    dec.expect_line("ATTACH:ok");
    dec.wait_success("the decoder of its request");
    assert!(
        send.child
            .try_wait()
            .expect("the sender's status")
            .is_none(),
        "the sender exited:\n{}",
        sender_log()
    );
    process::assert_no_panic_logged(&log_path, "the sender");
}

#[test]
fn python_and_rust_prefill_workers_feed_a_python_decoder_through_both_binaries() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-prefill");
    let rsock = dir.0.join("recv.sock");
    let ssock = dir.0.join("send.sock");
    let shm = dir.0.join("buf");
    let chunk = CHUNK.to_string();
    let (_recv, endpoint) = spawn_attach_receiver(&rsock, &shm);
    let (_send, _) = spawn_binary(
        &[
            "sender",
            "--connect",
            &endpoint,
            "--chunk-bytes",
            &chunk,
            "--staging-slots",
            "16",
            "--attach-shares",
            "2",
            "--attach",
            ssock.to_str().unwrap(),
        ],
        "sender",
        "kvferry sender attach on ",
    );
    let rs = rsock.to_str().unwrap();
    let ss = ssock.to_str().unwrap();
    // A Python prefill worker writes; a Python decoder reads every byte.
    let mut dec = python_client("decoder_check.py", &[rs, "pyp-1", "5", "777", "release"]);
    dec.expect_line("ATTACH:subscribed");
    let mut pf = python_client("prefill_check.py", &[ss, "pyp-1", "5", "777"]);
    pf.expect_line("PREFILL:ok");
    pf.wait_success("python prefill worker");
    dec.expect_line("ATTACH:ok");
    dec.wait_success("python decoder");
    // The Rust client writes the same pattern; the Python decoder checks it.
    let mut dec = python_client("decoder_check.py", &[rs, "pyp-2", "3", "100", "release"]);
    dec.expect_line("ATTACH:subscribed");
    let mut c = PrefillClient::connect(&ssock, WAIT).expect("rust worker attaches");
    assert_eq!(c.hello().receivers, 1);
    let tag = c.begin("pyp-2", 0, 3).unwrap();
    c.stage(tag, 3).unwrap();
    let b = staged(&mut c, "rust worker's batch");
    let mut lens = Vec::new();
    for i in 0..3 {
        let len = if i == 2 { 100 } else { CHUNK as usize };
        c.slot_mut(&b, i).unwrap()[..len].copy_from_slice(&python_pattern(i, len));
        lens.push(len as u32);
    }
    let keys: Vec<String> = (0..3).map(|i| format!("pyp-2/{i:03}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.submit(b, &keys, &lens).unwrap();
    match next(&mut c, "rust worker's DONE") {
        PrefillEvent::Done { tag: t } => assert_eq!(t, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    dec.expect_line("ATTACH:ok");
    dec.wait_success("python decoder of the rust worker's request");
    // A chunk geometry and a token count: shape [CHUNK / 2] of bf16, so
    // the receiver sizes the last chunk of 100 tokens 200 bytes, and the
    // Python decoder sees its 100 tokens (the Python worker first checks
    // that a bad dtype and a token count past the shape are refused).
    let half = (CHUNK / 2).to_string();
    let mut dec = python_client(
        "decoder_check.py",
        &[rs, "pyp-3", "4", "200", "release", "100"],
    );
    dec.expect_line("ATTACH:subscribed");
    let mut pf = python_client(
        "prefill_check.py",
        &[ss, "pyp-3", "4", "200", "3", &half, "bf16", "100"],
    );
    pf.expect_line("PREFILL:ok");
    pf.wait_success("python prefill worker with a geometry");
    dec.expect_line("ATTACH:ok");
    dec.wait_success("python decoder of the geometry request");
}

/// `kvferry sender --attach` generates no load: each load option, on the
/// command line or as a `--config` key, is refused at start with a message
/// naming it (exit code 2, no socket bound), never ignored; the options
/// and keys it uses start it.
#[test]
fn kvferry_sender_attach_refuses_every_option_it_does_not_use() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-prefill");
    let sock = dir.0.join("send.sock");
    let base = [
        "sender",
        "--connect",
        "tcp://127.0.0.1:9",
        "--attach",
        sock.to_str().unwrap(),
    ];
    let refused = |extra: &[&str], names: &str| {
        // Without the refusal it would serve until killed: bounded.
        let (st, err) = status_and_stderr(
            Command::new(BIN).args(base).args(extra),
            &format!("kvferry sender --attach {extra:?}"),
        );
        assert_eq!(st.code(), Some(2), "{extra:?} is refused: {err}");
        assert!(err.contains(names), "the message names {names}: {err}");
        assert!(!sock.exists(), "{extra:?}: refused before binding");
    };
    for (opt, value) in [
        ("--prefillers", Some("2")),
        ("--decoders", Some("2")),
        ("--requests", Some("5")),
        ("--chunks", Some("1..4")),
        ("--batch", Some("2")),
        ("--capacity-chunks", Some("8")),
        ("--concurrency", Some("2")),
        ("--abort-rate", Some("0.5")),
        ("--fail-rate", Some("0.1")),
        ("--seed", Some("3")),
        ("--stall-timeout", Some("5")),
        ("--copy-store", None),
        ("--key-format", Some("lmcache")),
        ("--json", None),
        ("--quiet", None),
    ] {
        let mut extra = vec![opt];
        extra.extend(value);
        refused(&extra, opt);
    }
    refused(&["--requests", "5", "--json"], "--requests, --json");
    let cfg = dir.0.join("load.toml");
    std::fs::write(&cfg, "chunk_bytes = 4096\nrequests = 10\nseed = 4\n").unwrap();
    let c = cfg.to_str().unwrap();
    refused(&["--config", c], "requests (in");
    refused(&["--config", c], "seed (in");
    // What it uses: these keys and options start it.
    std::fs::write(
        &cfg,
        "chunk_bytes = 4096\nstaging_slots = 8\ntransport = \"shm\"\nmax_pending_bytes = 65536\n",
    )
    .unwrap();
    let (_d, _) = spawn_binary(
        &[
            &base[..],
            &["--config", c, "--sender-id", "s", "--attach-shares", "2"],
        ]
        .concat(),
        "sender",
        "kvferry sender attach on ",
    );
}

#[test]
fn a_batch_held_when_its_request_fails_stays_the_workers_until_it_acknowledges() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("pe");
    let tag = a.begin(&req, 0, 4).unwrap();
    a.stage(tag, 3).unwrap();
    let b = staged(&mut a, "batch");
    // The request ends behind the worker's back (here: cancelled in the
    // sender's process) while the worker may still be writing its slots.
    assert!(t.s.cancel_request(&req));
    let st = t.s.wait(&req, deadline()).expect("sender knows it");
    assert!(st.is_terminal(), "cancel ends the request, not {st:?}");
    assert_eq!(
        t.s.staging_in_use(),
        3,
        "the slots stay the worker's until it has seen the end"
    );
    match next(&mut a, "FAILED") {
        PrefillEvent::Failed { tag: t2, code } => {
            assert_eq!((t2, code), (tag, Some(ErrorCode::Cancelled)))
        }
        other => panic!("expected FAILED, got {other:?}"),
    }
    assert!(a.slot_mut(&b, 0).is_none(), "no writes after the end");
    // The client acknowledged with CANCEL: now the slots go back.
    wait_sender_empty(&t.s, "after the acknowledgement");
}

#[test]
fn a_worker_cannot_resize_the_staging_buffer_under_the_sender() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(4, 1);
    let c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let f = c.share_file();
    let len = f.metadata().unwrap().len();
    assert_eq!(len, 4 * CHUNK, "its share is the whole buffer here");
    assert!(
        f.set_len(0).is_err(),
        "shrinking is sealed (SIGBUS in the sender otherwise)"
    );
    assert!(f.set_len(len * 2).is_err(), "growing is sealed");
    assert_eq!(f.metadata().unwrap().len(), len);
}

/// The re-executed child of the share test: maps its share's file one
/// chunk past its end and writes every byte of that mapping (0xEE). Its
/// own slots take it; the first byte past its share must fault (SIGBUS:
/// past the end of the share's memfd), so it never reaches the bytes of
/// another worker, which a mapping of the whole staging buffer would.
fn intruder_main() {
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let c = PrefillClient::connect(&sock, WAIT).expect("intruder attaches");
    let h = c.hello();
    let f = c.share_file();
    let size = f.metadata().unwrap().len() as usize;
    println!(
        "SHARE {} OF {} SIZE {size} SLOTS {}",
        h.share, h.shares, h.slots
    );
    let mut all_zero = true;
    let len = size + CHUNK as usize;
    // SAFETY: a fresh shared mapping of a file this process opened; it is
    // only touched through `p` below, and a fault ends the process.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of the share");
    let p = p.cast::<u8>();
    for i in 0..size {
        // SAFETY: inside the file, inside the mapping.
        all_zero &= unsafe { p.add(i).read_volatile() } == 0;
    }
    println!("ZEROED {all_zero}");
    for i in 0..len {
        // SAFETY: inside the mapping; past the file's end the kernel raises
        // SIGBUS, which is what the parent checks for.
        unsafe { p.add(i).write_volatile(0xEE) };
    }
    println!("WROTE PAST ITS SHARE");
}

#[test]
fn a_worker_maps_only_its_share_and_faults_past_it_leaving_another_workers_bytes_intact() {
    if std::env::var(ROLE).is_ok() {
        return intruder_main();
    }
    use std::os::unix::process::ExitStatusExt;
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    assert_eq!((a.hello().shares, a.hello().slots), (2, 4));
    let req = unique("ps");
    let n = 4;
    let tag = a.begin(&req, 0, n as u32).unwrap();
    a.stage(tag, n as u32).unwrap();
    let b = staged(&mut a, "a's batch");
    // Fill a's whole share, then let the intruder loose before submitting.
    let mut keys = Vec::new();
    let mut lens = Vec::new();
    for i in 0..n {
        let data = chunk(&req, i, n);
        a.slot_mut(&b, i).unwrap()[..data.len()].copy_from_slice(&data);
        keys.push(key(&req, REQUEST, i as u32, n as u32));
        lens.push(data.len() as u32);
    }
    let mut w = worker_child(
        "a_worker_maps_only_its_share_and_faults_past_it_leaving_another_workers_bytes_intact",
        "intruder",
        t.d.socket(),
        "unused",
        0,
    );
    let other = 1 - a.hello().share;
    w.expect_line(&format!("SHARE {other} OF 2 SIZE {} SLOTS 4", 4 * CHUNK));
    w.expect_line("ZEROED true");
    let end = deadline();
    let st = loop {
        if let Some(st) = w.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < end, "the intruder hung");
        thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        st.signal(),
        Some(libc::SIGBUS),
        "a write past the worker's share faults ({st})"
    );
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    a.submit(b, &keys, &lens).unwrap();
    match next(&mut a, "a's DONE") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    // Byte for byte what a wrote: the intruder never reached a's slots.
    verify_at_receiver(&t.r, &req, n);
    wait_for("the intruder's session to end", || t.d.clients() == 1);
    wait_sender_empty(&t.s, "after the share test");
}

#[test]
fn a_worker_past_the_free_shares_is_refused_until_one_comes_back() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let b = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    assert_ne!(a.hello().share, b.hello().share, "one share each");
    match PrefillClient::connect(t.d.socket(), WAIT) {
        Err(AttachError::Refused(s)) => assert_eq!(s, STATUS_NO_SHARE),
        other => panic!("a third worker must be refused for want of a share: {other:?}"),
    }
    let freed = b.hello().share;
    drop(b);
    wait_for("b's session to end", || t.d.clients() == 1);
    let c = PrefillClient::connect(t.d.socket(), WAIT).expect("b's share came back");
    assert_eq!(c.hello().share, freed);
}

/// Voluntary context switches (wake-ups) and CPU ticks (utime + stime)
/// of thread `tid` of this process.
fn thread_counts(tid: &str) -> (u64, u64) {
    let base = format!("/proc/self/task/{tid}");
    let status = std::fs::read_to_string(format!("{base}/status")).unwrap();
    let wakeups = status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap();
    let stat = std::fs::read_to_string(format!("{base}/stat")).unwrap();
    // Fields after the ")" of the name: state is field 3, utime 14, stime 15.
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks = rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap();
    (wakeups, ticks)
}

/// The only attach session thread of this process (`attach-<id>`).
fn session_thread() -> String {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap() {
        let tid = e.unwrap().file_name().into_string().unwrap();
        let comm =
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
        let comm = comm.trim();
        if comm.starts_with("attach-") && comm != "attach-accept" {
            found.push(tid);
        }
    }
    assert_eq!(found.len(), 1, "one session thread: {found:?}");
    found.remove(0)
}

/// The re-executed child of the idle test (alone in its process, so its
/// session thread is the only one): a STAGE waiting for its full share
/// sleeps without waking; freeing the share wakes it.
fn idle_main() {
    let t = setup(8, 2);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("pi");
    let n = 5;
    let tag = a.begin(&req, 0, n as u32).unwrap();
    a.stage(tag, 4).unwrap();
    let b = staged(&mut a, "the whole share");
    // Nothing free in the share: this STAGE waits.
    a.stage(tag, 1).unwrap();
    let tid = session_thread();
    thread::sleep(Duration::from_millis(300));
    let (w0, t0) = thread_counts(&tid);
    thread::sleep(Duration::from_secs(2));
    let (w1, t1) = thread_counts(&tid);
    println!("IDLE wakeups {} ticks {}", w1 - w0, t1 - t0);
    // A 1 ms retry timer would wake it ~2000 times here.
    assert!(w1 - w0 <= 5, "the waiting session woke {} times", w1 - w0);
    assert!(t1 - t0 <= 1, "the waiting session used {} ticks", t1 - t0);
    // Submitting frees the share once written: the waiting STAGE is served.
    fill_and_submit(&mut a, b, &req, 0, n);
    let b = staged(&mut a, "the STAGE that waited for free slots");
    fill_and_submit(&mut a, b, &req, 4, n);
    match next(&mut a, "DONE") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, n);
    println!("IDLE OK");
}

#[test]
fn a_stage_waiting_for_its_share_sleeps_without_waking_until_slots_are_freed() {
    if std::env::var(ROLE).is_ok() {
        return idle_main();
    }
    let mut w = worker_child(
        "a_stage_waiting_for_its_share_sleeps_without_waking_until_slots_are_freed",
        "idle",
        Path::new("/unused"),
        "unused",
        0,
    );
    println!("{}", w.expect_line("IDLE wakeups"));
    w.expect_line("IDLE OK");
    w.wait_success("the idle check");
}

#[test]
fn sender_shares_are_exclusive_and_in_process_staging_never_takes_a_share_slot() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    use kvferry::sender::{RequestSpec, ShareError, StoreError};
    // 11 slots in 2 shares: slots 0..5 and 5..10; slot 10 is in-process.
    let t = setup(11, 2);
    let plain = sender(sender_cfg(2, None));
    assert_eq!(plain.take_share().unwrap_err(), ShareError::NoShares);
    let s0 = t.s.take_share().unwrap();
    let s1 = t.s.take_share().unwrap();
    assert_eq!(
        t.s.take_share().unwrap_err(),
        ShareError::AllHeld { shares: 2 }
    );
    let (l0, l1) = (s0.layout().clone(), s1.layout().clone());
    assert_eq!(
        (l0.first_slot, l0.slots, l1.first_slot, l1.slots),
        (0, 5, 5, 5)
    );
    let req =
        t.s.begin(RequestSpec::new(unique("pq"), t.r.endpoint(), 7))
            .unwrap();
    wait_for("admission", || req.is_admitted());
    let b0 = req.try_stage_in(&s0, 5).expect("s0's five slots");
    assert_eq!(b0.slot_indexes(), &[0, 1, 2, 3, 4]);
    assert!(matches!(
        req.try_stage_in(&s0, 1),
        Err(StoreError::NoStagingNow)
    ));
    assert!(matches!(
        req.try_stage_in(&s0, 6),
        Err(StoreError::BatchTooLarge {
            chunks: 6,
            slots: 5
        })
    ));
    let inproc = req.try_stage(1).expect("the in-process slot");
    assert_eq!(inproc.slot_indexes(), &[10], "never a share's slot");
    assert!(matches!(req.try_stage(1), Err(StoreError::NoStagingNow)));
    let mut b1 = req.try_stage_in(&s1, 1).unwrap();
    assert_eq!(b1.slot_indexes(), &[5]);
    b1.slot_mut(0).unwrap().fill(0xAB);
    let share_bytes = |f: &std::fs::File| {
        let mut b = vec![0u8; l1.slots * CHUNK as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 0).unwrap();
        b
    };
    let old = s1.file().try_clone().unwrap();
    assert_eq!(
        share_bytes(&old)[0],
        0xAB,
        "the share file is the share's slots"
    );
    let other = plain
        .begin(RequestSpec::new("x", t.r.endpoint(), 1))
        .unwrap();
    assert!(matches!(
        other.try_stage_in(&s0, 1),
        Err(StoreError::ForeignShare)
    ));
    drop((b0, b1, inproc));
    assert_eq!(t.s.staging_in_use(), 0);
    let freed = s1.index();
    drop(s1);
    let again = t.s.take_share().unwrap();
    assert_eq!(again.index(), freed, "given back");
    assert!(
        share_bytes(again.file()).iter().all(|&b| b == 0),
        "a share handed out again is renewed: nothing of its last owner stays"
    );
    std::os::unix::fs::FileExt::write_all_at(&old, &[0xCD], 0).unwrap();
    assert_eq!(
        share_bytes(again.file())[0],
        0,
        "and its last owner's memfd no longer reaches the share"
    );
    req.cancel();
    other.cancel();
}

/// The re-executed child of the revocation tests: attaches, maps its
/// share's memfd a second time, detaches (the socket closes, the client's
/// own mapping goes) and stays alive with that mapping. On each stdin line
/// `WRITE` it writes 0xEE over the whole mapping and answers `WROTE`;
/// stdin closed: it exits.
fn lingerer_main() {
    use std::io::BufRead;
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let c = PrefillClient::connect(&sock, WAIT).expect("lingerer attaches");
    let f = c.share_file().try_clone().unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a fresh shared mapping of the share memfd this process was
    // given, written only through `p` below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of the share");
    println!("SHARE {}", c.hello().share);
    drop(c);
    println!("DETACHED");
    for line in std::io::stdin().lock().lines() {
        if line.unwrap().trim() == "WRITE" {
            // SAFETY: `p` maps `len` bytes of the memfd, alive until exit.
            unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0xEE, len) };
            println!("WROTE");
        }
    }
}

fn lingerer_child(test: &str, sock: &Path) -> ChildProc {
    ChildProc::spawn(
        rerun_alone(test)
            .env(ROLE, "lingerer")
            .env(SOCK, sock)
            .stdin(Stdio::piped()),
    )
}

fn tell(child: &mut ChildProc, line: &str) {
    use std::io::Write;
    let stdin = child.child.stdin.as_mut().expect("piped stdin");
    writeln!(stdin, "{line}").unwrap();
    stdin.flush().unwrap();
}

#[test]
fn a_detached_worker_still_writing_its_old_share_changes_nothing_the_next_worker_submits() {
    if let Ok(role) = std::env::var(ROLE) {
        assert_eq!(role, "lingerer");
        return lingerer_main();
    }
    let t = setup(4, 1);
    let mut old = lingerer_child(
        "a_detached_worker_still_writing_its_old_share_changes_nothing_the_next_worker_submits",
        t.d.socket(),
    );
    let share = old.expect_line("SHARE");
    old.expect_line("DETACHED");
    wait_for("the lingerer's session to end", || t.d.clients() == 0);
    // The next worker gets the same (only) share, while the old holder is
    // alive and still maps it.
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).expect("the next worker attaches");
    assert!(
        share.ends_with(&format!("SHARE {}", c.hello().share)),
        "the same share: {share}"
    );
    let req = unique("prv");
    let n = 4;
    let tag = c.begin(&req, 0, n as u32).unwrap();
    c.stage(tag, n as u32).unwrap();
    let b = staged(&mut c, "the batch");
    let (mut keys, mut lens) = (Vec::new(), Vec::new());
    for i in 0..n {
        let data = chunk(&req, i, n);
        c.slot_mut(&b, i).expect("held slot")[..data.len()].copy_from_slice(&data);
        keys.push(key(&req, REQUEST, i as u32, n as u32));
        lens.push(data.len() as u32);
    }
    // Filled; now the old holder writes every byte of its old mapping.
    tell(&mut old, "WRITE");
    old.expect_line("WROTE");
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.submit(b, &keys, &lens).expect("submitted");
    match next(&mut c, "DONE") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, n);
    drop(old.child.stdin.take());
    old.wait_success("the lingerer");
}

/// The re-executed hostile child: a process of the daemon's user with the
/// daemon's capabilities that tries to reach the daemon's share memfds
/// through `/proc` and looks for ring files by name.
fn hostile_main() {
    let ids = std::env::var(REQ).unwrap();
    let (pid, tid) = ids.split_once('/').unwrap();
    let fds = std::env::var(COUNT).unwrap();
    // Capabilities are per thread: as root only the host's test thread
    // shed CAP_SYS_PTRACE, so its /proc/<pid>/task/<tid> is the path the
    // check is about (the same descriptors and memory as /proc/<pid>).
    for dir in [format!("/proc/{pid}"), format!("/proc/{pid}/task/{tid}")] {
        for fd in fds.split(',') {
            let path = format!("{dir}/fd/{fd}");
            let e = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect_err("the daemon's share memfd is out of reach");
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied,
                "{path}: {e}"
            );
            println!("{path}: {e}");
        }
        let e = std::fs::File::open(format!("{dir}/mem")).expect_err("no memory access");
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::PermissionDenied,
            "{dir}/mem: {e}"
        );
    }
    // Nothing of the daemon's has a name in /dev/shm but the receiver's
    // buffer file (the shm data plane opens it by path) and the local
    // control socket next to it (a socket, for same-host senders).
    let tag = format!("-{pid}-");
    assert!(
        !std::path::Path::new(&format!("/dev/shm/kvferry-attach-{pid}-0")).exists(),
        "no ring directory"
    );
    for entry in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.contains(&tag) {
            assert!(
                name.ends_with(".buf") || name.ends_with(".buf.ctl"),
                "/dev/shm/{name} is reachable by name"
            );
        }
    }
    println!("HOSTILE REFUSED");
}

/// As root: drops `CAP_SYS_PTRACE` (which bypasses every check of
/// [`hostile_main`]) from this thread's bounding, effective and permitted
/// sets, so that it and the children it executes have the same
/// capabilities and the same uid: what stands between them is only the
/// daemon's non-dumpable flag. A no-op for other users (no capabilities).
fn drop_cap_sys_ptrace() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_PTRACE: u32 = 19;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    // SAFETY: prctl with integer arguments.
    let in_bounding_set = unsafe {
        libc::prctl(
            libc::PR_CAPBSET_READ,
            CAP_SYS_PTRACE as libc::c_ulong,
            0,
            0,
            0,
        )
    } == 1;
    // A root without CAP_SYS_PTRACE in its bounding set (a container's
    // default) cannot hand it to its children: nothing to drop there.
    if in_bounding_set {
        // SAFETY: prctl with integer arguments.
        assert_eq!(
            unsafe {
                libc::prctl(
                    libc::PR_CAPBSET_DROP,
                    CAP_SYS_PTRACE as libc::c_ulong,
                    0,
                    0,
                    0,
                )
            },
            0,
            "PR_CAPBSET_DROP (root needs CAP_SETPCAP to shed CAP_SYS_PTRACE for this test): {}",
            std::io::Error::last_os_error()
        );
    }
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget writes two Data structs for the v3 header.
    assert_eq!(
        unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) },
        0
    );
    d[0].effective &= !(1 << CAP_SYS_PTRACE);
    d[0].permitted &= !(1 << CAP_SYS_PTRACE);
    // SAFETY: capset reads the header and two Data structs.
    assert_eq!(
        unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) },
        0,
        "capset: {}",
        std::io::Error::last_os_error()
    );
}

const HOSTILE_TEST: &str = "a_same_uid_process_cannot_open_the_daemons_shares_nor_find_its_rings";

/// The re-executed daemon host of the hostile test: its own process, so
/// that it can shed `CAP_SYS_PTRACE` like its hostile child.
fn hostile_host_main() {
    drop_cap_sys_ptrace();
    let t = setup(4, 1);
    let c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    // The daemon's share memfds (and this in-process client's descriptor
    // of its share): this process reaches them through its own /proc.
    let share_fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:kvferry-staging"))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!share_fds.is_empty(), "the daemon holds its share memfds");
    let mut h = ChildProc::spawn(
        rerun_alone(HOSTILE_TEST)
            .env(ROLE, "hostile")
            // SAFETY: gettid has no preconditions.
            .env(
                REQ,
                format!("{}/{}", std::process::id(), unsafe { libc::gettid() }),
            )
            .env(COUNT, share_fds.join(",")),
    );
    h.expect_line("HOSTILE REFUSED");
    h.wait_success("the hostile process");
    drop(c);
    println!("HOST DONE");
}

#[test]
fn a_same_uid_process_cannot_open_the_daemons_shares_nor_find_its_rings() {
    match std::env::var(ROLE).as_deref() {
        Ok("hostile") => return hostile_main(),
        Ok("hostile-host") => return hostile_host_main(),
        Ok(_) => return,
        Err(_) => {}
    }
    let mut host = ChildProc::spawn(rerun_alone(HOSTILE_TEST).env(ROLE, "hostile-host"));
    host.expect_line("HOST DONE");
    host.wait_success("the daemon host");
}

/// The re-executed child of the fork test: attaches, gets one staged slot,
/// forks; the forked child reads the slot through the same pointer (its
/// exit status is the byte, or it dies of the fault). Prints how it ended.
fn forker_main() {
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let mut c = PrefillClient::connect(&sock, WAIT).expect("forker attaches");
    let tag = c.begin(&unique("pfk"), 0, 1).unwrap();
    c.stage(tag, 1).unwrap();
    let b = staged(&mut c, "the forker's slot");
    let slot = c.slot_mut(&b, 0).expect("held slot");
    slot[0] = 7;
    let p = slot.as_ptr();
    // SAFETY: the child only reads one byte and `_exit`s (no allocation,
    // no lock: async-signal-safe after fork in a threaded process).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: `p` was a valid mapping in the parent; in the child it is
        // mapped only if the share was inherited (else the read faults,
        // which is what is tested).
        let v = unsafe { p.read_volatile() };
        // SAFETY: _exit takes an integer and ends the process.
        unsafe { libc::_exit(i32::from(v)) };
    }
    assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
    let mut st = 0;
    // SAFETY: waits for the child just forked; `st` is a live local.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    if libc::WIFSIGNALED(st) {
        println!("FORKED CHILD signal {}", libc::WTERMSIG(st));
    } else {
        println!("FORKED CHILD exit {}", libc::WEXITSTATUS(st));
    }
    c.cancel(tag).unwrap();
}

#[test]
fn a_forked_child_of_a_worker_does_not_inherit_its_share() {
    if let Ok(role) = std::env::var(ROLE) {
        assert_eq!(role, "forker");
        return forker_main();
    }
    let t = setup(4, 1);
    let mut w = ChildProc::spawn(
        rerun_alone("a_forked_child_of_a_worker_does_not_inherit_its_share")
            .env(ROLE, "forker")
            .env(SOCK, t.d.socket()),
    );
    let line = w.expect_line("FORKED CHILD");
    assert!(
        line.ends_with(&format!("signal {}", libc::SIGSEGV)),
        "the forked child must fault on the share (MADV_DONTFORK): {line}"
    );
    w.wait_success("the forker");
    wait_for("the forker's session to end", || t.d.clients() == 0);
    wait_sender_empty(&t.s, "after the forker");
}

/// A worker's staging share is mapped with its page tables filled
/// (docs/attach.md, "Mapping"): filling every slot of a fresh attachment's
/// share takes no page fault (without it: one per 4 KiB page written,
/// several µs each on a VM).
#[test]
fn a_fresh_worker_fills_its_whole_share_without_a_page_fault() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    const SLOTS: usize = 48;
    let t = setup(SLOTS, 1);
    let mut a = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    // Warm up the code paths, the heap and the stack with a one-chunk
    // request of a slot the request below then writes again.
    let warm = unique("warm");
    let tag = a.begin(&warm, 0, 1).unwrap();
    a.stage(tag, 1).unwrap();
    let b = staged(&mut a, "the warm-up batch");
    fill_and_submit(&mut a, b, &warm, 0, 1);
    expect_done(&mut a, tag, "the warm-up request");
    verify_at_receiver(&t.r, &warm, 1);
    wait_sender_empty(&t.s, "after the warm-up");
    let req = unique("full");
    let tag = a.begin(&req, 0, SLOTS as u32).unwrap();
    a.stage(tag, SLOTS as u32).unwrap();
    let b = staged(&mut a, "the whole share");
    assert_eq!(b.len(), SLOTS);
    let data = vec![0x5au8; CHUNK as usize];
    let before = thread_faults(0);
    for j in 0..SLOTS {
        a.slot_mut(&b, j).expect("held slot").copy_from_slice(&data);
    }
    let faults = thread_faults(0) - before;
    a.cancel(tag).unwrap();
    match next(&mut a, "FAILED") {
        PrefillEvent::Failed { tag: t2, .. } => assert_eq!(t2, tag),
        other => panic!("expected FAILED, got {other:?}"),
    }
    wait_sender_empty(&t.s, "after the cancel");
    assert!(
        faults <= 2,
        "filling {SLOTS} slots of a fresh share took {faults} page faults (its page tables \
         should be filled at attach)"
    );
}

/// A STAGED posted before the daemon read the worker's CANCEL (the
/// daemon gives the batch back on the CANCEL): the Rust client skips it
/// and returns the request's FAILED, so no slot the worker no longer owns
/// is handed out for writing; it used to return the batch, writable,
/// while the sender already counted its slots free.
#[test]
fn a_batch_staged_across_a_cancel_is_skipped_not_handed_out() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let tag = c.begin(&unique("crossed"), 0, 4).unwrap();
    c.stage(tag, 2).unwrap();
    wait_for("the batch staged", || t.s.staging_in_use() == 2);
    // Long enough for the session to have posted the STAGED.
    thread::sleep(Duration::from_millis(100));
    c.cancel(tag).unwrap();
    match next(&mut c, "after the cancel") {
        PrefillEvent::Failed { tag: t2, code } => {
            assert_eq!((t2, code), (tag, Some(ErrorCode::Cancelled)))
        }
        other => panic!("expected FAILED cancelled (the crossed STAGED skipped), got {other:?}"),
    }
    wait_sender_empty(&t.s, "after the crossed cancel");
}

/// A submit that cannot go out gives its batch back, still held and as
/// filled: a key out of range (nothing pushed), and a submission ring that
/// stays full past the worker's wait (the worker left its events unread,
/// so the session stopped reading; some KEYs may have gone out). Once the
/// worker reads its events, the same batch submitted again lands byte for
/// byte. Before, the batch was consumed by the failed call and its slots
/// stayed held until the request ended.
#[test]
fn a_submit_that_cannot_go_out_gives_the_batch_back_to_submit_again() {
    use kvferry::attach::SubmitError;
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("given-back");
    let tag = c.begin(&req, 0, 2).unwrap();
    c.stage(tag, 2).unwrap();
    let b = staged(&mut c, "the batch");
    let (keys, lens) = fill(&mut c, &b, &req, 0, 2);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let back = |r: Result<(), SubmitError>, what: &str| match r {
        Err(SubmitError {
            batch: Some(b),
            error,
        }) => (b, error),
        other => panic!("{what}: expected the batch back, got {other:?}"),
    };
    // A key too long for the entry: refused before anything is pushed.
    let long = "k".repeat(kvferry::attach::layout::MAX_TEXT + 1);
    let (b, e) = back(c.submit(b, &[keys[0], &long], &lens), "a key too long");
    assert!(matches!(e, AttachError::Protocol(_)), "{e}");
    assert!(c.slot_mut(&b, 0).is_some(), "the batch is still held");

    // The completion ring full of answers the worker does not read, then
    // the submission ring full behind it.
    let bad = PrefillSubmit::of(999, tag, 0, 0, 0);
    let end = deadline();
    let mut full_since = None;
    while full_since.is_none_or(|at: Instant| at.elapsed() < Duration::from_millis(100)) {
        assert!(
            Instant::now() < end,
            "the submission ring never stayed full"
        );
        match c.submit_raw(bad) {
            Ok(()) => full_since = None,
            Err(AttachError::Full) => {
                full_since.get_or_insert_with(Instant::now);
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("flooding the ring: {e}"),
        }
    }
    c.set_full_wait(Duration::from_millis(200));
    let (b, e) = back(c.submit(b, &keys, &lens), "a full ring");
    assert!(matches!(e, AttachError::Full), "{e}");
    assert_eq!(t.s.staging_in_use(), 2, "the slots stay the worker's");

    // Read the answers (the session reads the ring again), then retry.
    let mut refused = 0;
    loop {
        match c.next_event(Instant::now() + Duration::from_millis(200)) {
            Ok(PrefillEvent::Refused { reason, .. }) => {
                assert_eq!(reason, Some(Refusal::BadOp));
                refused += 1;
            }
            Ok(other) => panic!("expected only refusals, got {other:?}"),
            Err(AttachError::Timeout) => break,
            Err(e) => panic!("reading the refusals: {e}"),
        }
    }
    assert!(
        refused > c.hello().sq_capacity as usize,
        "only {refused} refusals"
    );
    c.submit(b, &keys, &lens)
        .expect("the batch given back submits");
    match next(&mut c, "DONE of the retried batch") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, 2);
    drop(c);
    wait_sender_empty(&t.s, "after the retried batch");
}

/// A worker whose daemon went away is told so: every call fails with
/// `Closed`, none with `Full` (a closed ring refuses pushes as a full one
/// does; the client used to report it full, which says "retry") and a
/// submit does not wait out its full-ring wait.
#[test]
fn a_worker_whose_daemon_is_gone_gets_closed_not_full() {
    use kvferry::attach::SubmitError;
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("orphan");
    let tag = c.begin(&req, 0, 2).unwrap();
    c.stage(tag, 1).unwrap();
    let b = staged(&mut c, "the batch");
    drop(t.d);
    let closed = |e: &AttachError| matches!(e, AttachError::Closed);
    let e = c
        .next_event(deadline())
        .expect_err("no event from a daemon gone");
    assert!(closed(&e), "next_event: {e}");
    let e = c.stage(tag, 1).expect_err("a stage to a daemon gone");
    assert!(closed(&e), "stage: {e}");
    let e = c
        .begin(&unique("orphan"), 0, 1)
        .expect_err("a begin to a daemon gone");
    assert!(closed(&e), "begin: {e}");
    let key = key(&req, REQUEST, 0, 2);
    let started = Instant::now();
    match c.submit(b, &[&key], &[1]) {
        Err(SubmitError {
            error: AttachError::Closed,
            batch: Some(_),
        }) => {}
        other => panic!("submit: expected Closed with the batch back, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the submit waited out its full-ring wait"
    );
    let e = c.cancel(tag).expect_err("a cancel to a daemon gone");
    assert!(closed(&e), "cancel: {e}");
}

/// The Python worker skips a STAGED that crossed its CANCEL too
/// (`clients/python/cancel_check.py`: it cancels once the STAGED is on the
/// ring, unread); it used to return it, its slot numbers free for another
/// batch of the same worker.
#[test]
fn the_python_worker_skips_a_batch_staged_across_its_cancel() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let code = kvferry::attach::layout::error_number(ErrorCode::Cancelled).to_string();
    let sock = t.d.socket().to_str().unwrap().to_owned();
    let mut py = python_client("cancel_check.py", &[&sock, &unique("py-crossed"), &code]);
    py.expect_line("PREFILL:ok");
    py.wait_success("the python worker whose STAGED crossed its cancel");
    wait_sender_empty(&t.s, "after the python worker's crossed cancel");
}

/// A worker that mixes valid steps, chosen at random on its own live
/// state (BEGINs of pooled req_ids with totals from 0 to `u32::MAX` to
/// receiver 0 or an unknown one, STAGEs of 0 to 1000 slots, its held
/// batches filled and submitted with 0 to all their keys, CANCELs), with
/// raw entries the session must refuse or take in its stride (KEYs of
/// random batches, indexes, lengths and bytes, invalid UTF-8 and
/// over-long texts included; SUBMITs of wrong counts and token numbers;
/// STAGEs past the completion ring; CANCELs and BEGINs no client would
/// send; unknown ops), 3000 steps, draining its events as it goes. The
/// Rust client's own checks of every event pass (the daemon never sends
/// what it must not), no session thread panics, and once the worker
/// detaches the sender holds nothing and a well-behaved worker's request
/// lands byte for byte. `KVFERRY_FUZZ_SEED` picks another sequence.
#[test]
fn random_steps_of_a_worker_never_break_its_session() {
    use kvferry::attach::layout::{MAX_TEXT, OP_BEGIN, OP_CANCEL, OP_STAGE};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let panics_before = process::attach_session_panics();
    let t = setup(16, 2);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let mut rng = SmallRng::seed_from_u64(process::fuzz_seed());
    let prefix = unique("fz");
    let mut tags: Vec<u64> = Vec::new();
    let mut held: Vec<StagedSlots> = Vec::new();
    let (mut done, mut failed, mut refused, mut declared) = (0, 0, 0, 0);
    let pick = |rng: &mut SmallRng, v: &[u32]| v[rng.random_range(0..v.len())];
    for step in 0..3000 {
        let tag = if !tags.is_empty() && rng.random_bool(0.8) {
            tags[rng.random_range(0..tags.len())]
        } else {
            rng.random_range(0..1 << 20)
        };
        let sent = match rng.random_range(0..12) {
            0 | 1 => {
                // Now and then the req_id of an earlier BEGIN.
                let req = format!("{prefix}-{}", rng.random_range(0..step / 4 + 2));
                let receiver = pick(&mut rng, &[0, 0, 0, 0, 0, 1, u32::MAX]);
                let total = pick(&mut rng, &[1, 1, 2, 2, 3, 0, 64, u32::MAX]);
                if rng.random_bool(0.3) {
                    // A declared first batch: counts and lengths that fit
                    // or not (past the total, the share, a short chunk).
                    let n = pick(&mut rng, &[1, 1, 2, 3, 9]) as usize;
                    let keys: Vec<String> = (0..n).map(|i| format!("{req}/d{i}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let lens: Vec<u32> = (0..n)
                        .map(|_| pick(&mut rng, &[CHUNK as u32, CHUNK as u32, CHUNK as u32, 100]))
                        .collect();
                    let first = kvferry::attach::DeclaredBatch {
                        keys: &keys,
                        lens: &lens,
                        last_chunk_toks: None,
                    };
                    let g = BeginGeometry::default();
                    c.begin_declared(&req, receiver, total, &g, &first)
                        .map(|t| tags.push(t))
                } else {
                    c.begin(&req, receiver, total).map(|t| tags.push(t))
                }
            }
            4 | 5 if held.iter().any(StagedSlots::is_declared) && rng.random_bool(0.7) => {
                let i = held.iter().position(StagedSlots::is_declared).unwrap_or(0);
                declared += 1;
                c.submit_declared(held.swap_remove(i))
                    .map_err(AttachError::from)
            }
            2 | 3 => c.stage(tag, pick(&mut rng, &[1, 1, 1, 2, 3, 0, 9, 1000])),
            4 | 5 if !held.is_empty() => {
                let b = held.swap_remove(rng.random_range(0..held.len()));
                let n = if rng.random_bool(0.8) {
                    b.len()
                } else {
                    rng.random_range(0..=b.len())
                };
                let keys: Vec<String> = (0..n).map(|i| format!("{prefix}/{step}/{i}")).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let lens: Vec<u32> = (0..n)
                    .map(|_| {
                        pick(
                            &mut rng,
                            &[1, 100, CHUNK as u32, CHUNK as u32, 0, CHUNK as u32 + 1],
                        )
                    })
                    .collect();
                c.submit(b, &keys, &lens).map_err(AttachError::from)
            }
            6 => c.cancel(tag),
            _ => {
                let batch = rng.random_range(0..1 << 16);
                let mut s = match rng.random_range(0..6) {
                    0 => PrefillSubmit::of(
                        OP_KEY,
                        tag,
                        batch,
                        pick(&mut rng, &[0, 1, 8, u32::MAX]),
                        pick(&mut rng, &[0, 1, CHUNK as u32, u32::MAX]),
                    ),
                    1 => PrefillSubmit::submit(
                        tag,
                        batch,
                        pick(&mut rng, &[0, 1, 9, u32::MAX]),
                        Some(pick(&mut rng, &[0, 1, u32::MAX - 1])),
                    ),
                    // Past the completion ring: refused, never staged.
                    2 => PrefillSubmit::of(OP_STAGE, tag, batch, u32::MAX, 0),
                    // A CANCEL or a BEGIN of a tag the client never used.
                    3 => PrefillSubmit::of(OP_CANCEL, (1 << 40) + u64::from(batch), 0, 0, 0),
                    4 => PrefillSubmit::of(OP_BEGIN, tag, 0, 1, 0),
                    _ => PrefillSubmit::of(rng.random_range(6..1000), tag, batch, 0, 0),
                };
                s.text_len = pick(
                    &mut rng,
                    &[0, 1, 16, MAX_TEXT as u32, MAX_TEXT as u32 + 1, u32::MAX],
                );
                rng.fill(&mut s.text[..]);
                if s.op == OP_BEGIN {
                    // Never a BEGIN the session could take: the tag is
                    // the client's own or ... an unknown receiver.
                    s.a = u32::MAX;
                }
                c.submit_raw(s)
            }
        };
        let _ = sent; // An API call the client itself refused: fine.
                      // Drain what has come.
        loop {
            match c.next_event(Instant::now()) {
                Ok(PrefillEvent::Staged(b)) => held.push(b),
                Ok(PrefillEvent::Done { .. }) => done += 1,
                Ok(PrefillEvent::Failed { .. }) => failed += 1,
                Ok(PrefillEvent::Refused { .. }) => refused += 1,
                Err(AttachError::Timeout) => break,
                Err(e) => panic!("step {step}: the client's check of an event failed: {e}"),
            }
        }
    }
    assert!(
        refused > 0 && done + failed > 0,
        "the steps did little: {done} done, {failed} failed, {refused} refused, {declared} declared batches submitted"
    );
    drop(held);
    drop(c);
    wait_for("the fuzzing worker's session to end", || t.d.clients() == 0);
    wait_sender_empty(&t.s, "after the fuzzing worker");
    assert_eq!(
        process::attach_session_panics(),
        panics_before,
        "a session thread panicked"
    );
    // A well-behaved worker is served as before.
    let mut w = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("after-fz");
    let tag = w.begin(&req, 0, 3).unwrap();
    w.stage(tag, 3).unwrap();
    let b = staged(&mut w, "the next worker's batch");
    fill_and_submit(&mut w, b, &req, 0, 3);
    match next(&mut w, "the next worker's DONE") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, 3);
}

/// One worker's request in [`random_worker`]: its id, its chunk count,
/// chunks asked for and chunks written so far, and whether it cancelled.
struct Live {
    req: String,
    n: usize,
    asked: usize,
    written: usize,
    cancelled: bool,
}

/// What [`random_worker`] saw end: requests landed (checked byte for
/// byte), failed after its own CANCEL, and ended DONE despite a CANCEL
/// that crossed the end.
#[derive(Default, Debug)]
struct Ends {
    done: usize,
    cancelled: usize,
    done_despite_cancel: usize,
}

impl Ends {
    fn ended(&self) -> usize {
        self.done + self.cancelled + self.done_despite_cancel
    }
}

/// Cancels live request `tag` of a [`random_worker`], forgetting its held
/// batches as the client does.
fn cancel_live(c: &mut PrefillClient, tag: u64, l: &mut Live, held: &mut Vec<StagedSlots>) {
    c.cancel(tag).expect("cancel");
    l.cancelled = true;
    held.retain(|b| b.tag() != tag);
}

/// Worker `w` of [`concurrent_random_workers_land_every_done_request_byte_for_byte`]:
/// random valid steps (BEGIN, STAGE of part of what is left, fill and
/// SUBMIT of a held batch, now or steps later, CANCEL at any point), every
/// slot written with its chunk's own bytes; each DONE request is checked
/// at the receiver byte for byte and released. Ends once `requests` have
/// ended and every request it began has.
fn random_worker(r: &Receiver, sock: &Path, w: u64, requests: usize) -> Ends {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(process::fuzz_seed() ^ (w << 32));
    let mut c = PrefillClient::connect(sock, WAIT).expect("worker attaches");
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut held: Vec<StagedSlots> = Vec::new();
    let mut ends = Ends::default();
    // Requests that ended DONE after this worker cancelled them.
    let mut crossed = HashSet::new();
    let mut step = 0;
    let end = deadline();
    while ends.ended() < requests || !live.is_empty() {
        assert!(
            Instant::now() < end,
            "worker {w}: requests never ended: {}",
            live.len()
        );
        let winding_down = ends.ended() >= requests;
        step += 1;
        let tags: Vec<u64> = live.keys().copied().collect();
        let pick = |rng: &mut SmallRng| tags[rng.random_range(0..tags.len())];
        match rng.random_range(0..10) {
            0 | 1 if !winding_down && live.len() < 3 => {
                let req = unique(&format!("rw{w}"));
                let n = rng.random_range(1..=6);
                let tag = c.begin(&req, 0, n as u32).expect("begin");
                live.insert(
                    tag,
                    Live {
                        req,
                        n,
                        asked: 0,
                        written: 0,
                        cancelled: false,
                    },
                );
            }
            2..=4 if !tags.is_empty() => {
                let tag = pick(&mut rng);
                let l = live.get_mut(&tag).unwrap();
                if !l.cancelled && l.asked < l.n {
                    let k = rng.random_range(1..=(l.n - l.asked).min(4));
                    c.stage(tag, k as u32).expect("stage");
                    l.asked += k;
                    if rng.random_bool(0.1) {
                        // Right behind it: its STAGED is likely posted
                        // before the daemon reads the CANCEL.
                        cancel_live(&mut c, tag, l, &mut held);
                    }
                }
            }
            // Submit a held batch, or (winding down) all of them.
            5..=7 if !held.is_empty() => {
                let b = held.swap_remove(rng.random_range(0..held.len()));
                let l = live
                    .get_mut(&b.tag())
                    .expect("a held batch's request is live");
                let first = l.written;
                l.written += b.len();
                fill_and_submit(&mut c, b, &l.req, first, l.n);
            }
            8 if !tags.is_empty() && rng.random_bool(if winding_down { 0.05 } else { 0.3 }) => {
                let tag = pick(&mut rng);
                let l = live.get_mut(&tag).unwrap();
                if !l.cancelled {
                    cancel_live(&mut c, tag, l, &mut held);
                }
            }
            _ if winding_down => {
                // Ask for what is left, then wait for events.
                for (&tag, l) in live
                    .iter_mut()
                    .filter(|(_, l)| !l.cancelled && l.asked < l.n)
                {
                    c.stage(tag, (l.n - l.asked).min(4) as u32).expect("stage");
                    l.asked += (l.n - l.asked).min(4);
                }
            }
            _ => {}
        }
        // What has come (waiting a little when nothing is held, so that
        // the steps keep pace with the daemon under any load).
        let mut wait = if held.is_empty() {
            Instant::now() + Duration::from_millis(2)
        } else {
            Instant::now()
        };
        loop {
            let ev = match c.next_event(wait) {
                Ok(ev) => ev,
                Err(AttachError::Timeout) => break,
                Err(e) => panic!("worker {w}, step {step}: {e}"),
            };
            wait = Instant::now();
            match ev {
                PrefillEvent::Staged(b) => {
                    assert!(
                        !live[&b.tag()].cancelled,
                        "worker {w}: a cancelled request's batch staged"
                    );
                    held.push(b);
                }
                PrefillEvent::Done { tag } => {
                    let l = live.remove(&tag).expect("DONE of a live request");
                    assert_eq!(
                        l.written, l.n,
                        "worker {w}: DONE before every chunk was written"
                    );
                    verify_at_receiver(r, &l.req, l.n);
                    if l.cancelled {
                        // Its CANCEL comes back refused: the tag had ended.
                        crossed.insert(tag);
                        ends.done_despite_cancel += 1;
                    } else {
                        ends.done += 1;
                    }
                }
                PrefillEvent::Failed { tag, code } => {
                    let l = live.remove(&tag).expect("FAILED of a live request");
                    assert!(
                        l.cancelled && code == Some(ErrorCode::Cancelled),
                        "worker {w}: request {} failed by itself: {code:?}",
                        l.req
                    );
                    held.retain(|b| b.tag() != tag);
                    ends.cancelled += 1;
                }
                PrefillEvent::Refused { tag, reason } => assert!(
                    reason == Some(Refusal::UnknownTag) && crossed.remove(&tag),
                    "worker {w}: a valid step of tag {tag} was refused: {reason:?}"
                ),
            }
        }
    }
    ends
}

/// Three workers attached to one sender daemon, four staging slots each,
/// take random valid steps at once: requests begun, staged in parts,
/// filled and submitted out of step with each other, cancelled at every
/// point of their life. Slots pass from batch to batch, request to request
/// and (through the daemon) worker to worker all the time; every request
/// that ends DONE holds exactly its own bytes at the receiver, every
/// cancelled one ends FAILED(Cancelled) (or DONE, if the CANCEL crossed its
/// end) and nothing is left held anywhere.
#[test]
fn concurrent_random_workers_land_every_done_request_byte_for_byte() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let panics_before = process::attach_session_panics();
    let t = setup(12, 3);
    let (r, sock) = (Arc::clone(&t.r), t.d.socket().to_owned());
    let ends = process::on_threads(3, "random worker", WAIT * 4, move |w| {
        random_worker(&r, &sock, w, 60)
    });
    let done: usize = ends.iter().map(|e| e.done + e.done_despite_cancel).sum();
    let cancelled: usize = ends.iter().map(|e| e.cancelled).sum();
    assert!(done > 20 && cancelled > 5, "the steps did little: {ends:?}");
    wait_for("the workers' sessions to end", || t.d.clients() == 0);
    wait_sender_empty(&t.s, "after the random workers");
    wait_receiver_empty(&t.r, "after the random workers");
    assert_eq!(
        process::attach_session_panics(),
        panics_before,
        "a session thread panicked"
    );
}

/// The Python worker's random steps against the real binaries
/// (`clients/python/prefill_fuzz.py`: BEGINs, partial STAGEs, fills and
/// SUBMITs now or later, CANCELs at every point, some right behind a
/// STAGE), writing into `kvferry sender --attach`, which writes into
/// `kvferry receiver --attach`; a Python decoder in the same process
/// checks every request that ends DONE byte for byte (the bytes depend on
/// the request and the chunk, so a slot written for another is caught).
/// Neither binary panics. `KVFERRY_FUZZ_SEED` picks another sequence.
#[test]
fn random_steps_of_the_python_worker_against_the_binaries() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-prefill");
    let (rsock, ssock) = (dir.0.join("recv.sock"), dir.0.join("send.sock"));
    let (recv_log, send_log) = (dir.0.join("receiver.stderr"), dir.0.join("sender.stderr"));
    let log = |p: &Path| Stdio::from(std::fs::File::create(p).expect("a stderr file"));
    let (recv, endpoint) = spawn_attach_receiver_with(&rsock, &dir.0.join("buf"), log(&recv_log));
    let mut send = ChildProc::spawn(
        Command::new(BIN)
            .args([
                "sender",
                "--connect",
                &endpoint,
                "--chunk-bytes",
                &CHUNK.to_string(),
            ])
            .args(["--staging-slots", "8", "--attach-max-clients", "1"])
            .arg("--attach")
            .arg(&ssock)
            .stdin(Stdio::null())
            .stderr(log(&send_log)),
    );
    send.expect_line("kvferry sender attach on ");
    let code = kvferry::attach::layout::error_number(ErrorCode::Cancelled).to_string();
    let seed = process::fuzz_seed().to_string();
    let mut py = python_client(
        "prefill_fuzz.py",
        &[
            ssock.to_str().unwrap(),
            rsock.to_str().unwrap(),
            &unique("pyfz"),
            "60",
            &seed,
            &code,
        ],
    );
    let line = py.expect_line("FUZZ:ok");
    py.wait_success("the python worker's random steps");
    let declared = line
        .rsplit("declared=")
        .next()
        .and_then(|n| n.trim().parse::<u32>().ok());
    assert!(
        declared.is_some_and(|n| n > 0),
        "some requests declared their first batch: {line}"
    );
    drop((send, recv));
    process::assert_no_panic_logged(&send_log, "the sender");
    process::assert_no_panic_logged(&recv_log, "the receiver");
}

/// An attached worker's batch whose first chunk is short is refused
/// (`SenderRefused`, the sender's `ShortChunk`) and its slots come back:
/// the receiver would report that chunk whole, its tail bytes nobody
/// wrote. The same request then lands with its first chunk whole.
#[test]
fn a_batch_with_a_short_chunk_before_its_last_is_refused() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let t = setup(8, 2);
    let mut c = PrefillClient::connect(t.d.socket(), WAIT).unwrap();
    let req = unique("short-first");
    let tag = c.begin(&req, 0, 2).unwrap();
    c.stage(tag, 2).unwrap();
    let b = staged(&mut c, "the batch");
    let keys = [key(&req, REQUEST, 0, 2), key(&req, REQUEST, 1, 2)];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.submit(b, &keys, &[100, 100]).expect("submitted");
    match next(&mut c, "the refusal") {
        PrefillEvent::Refused { tag: t2, reason } => {
            assert_eq!((t2, reason), (tag, Some(Refusal::SenderRefused)))
        }
        other => panic!("expected REFUSED, got {other:?}"),
    }
    wait_for("the refused batch's slots back", || {
        t.s.staging_in_use() == 0
    });
    c.stage(tag, 2).unwrap();
    let b = staged(&mut c, "the batch again");
    fill_and_submit(&mut c, b, &req, 0, 2);
    match next(&mut c, "DONE") {
        PrefillEvent::Done { tag: t2 } => assert_eq!(t2, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
    verify_at_receiver(&t.r, &req, 2);
}

/// A STAGE the sender refuses is answered even when, in the same pass of
/// the session's pending STAGEs, a later one finds no room on the
/// completion ring. The session used to collect the refusals and drop
/// them with the early return at the full ring: that worker never heard
/// of its STAGE. The sleeps only let the session reach each state (a slow
/// machine may miss the full-ring pass, and then the test proves less,
/// never fails wrongly).
#[test]
fn a_refused_stage_is_answered_even_when_the_completion_ring_is_full() {
    use kvferry::attach::layout::OP_STAGE;
    let dir = TempDir::new("kvferry-prefill");
    let r = Arc::new(receiver(64));
    // 8 staging slots in 2 shares: 4 slots per worker.
    let s = Arc::new(sender(SenderConfig {
        staging_shares: 2,
        ..sender_cfg(8, None)
    }));
    let d = PrefillDaemon::start(
        Arc::clone(&s),
        vec![r.endpoint().to_owned()],
        AttachConfig {
            cq_capacity: 8,
            ..AttachConfig::new(dir.sock())
        },
    )
    .expect("daemon starts");
    let mut c = PrefillClient::connect(d.socket(), WAIT).unwrap();
    assert_eq!(c.hello().slots, 4);
    let tag = c.begin(&unique("lost-refusal"), 0, 8).unwrap();
    // Admitted: one slot staged and held (3 of the share's 4 free).
    c.stage(tag, 1).unwrap();
    match c.next_event(deadline()).unwrap() {
        PrefillEvent::Staged(_) => {}
        other => panic!("expected STAGED, got {other:?}"),
    }
    // 9 unknown ops: 8 REFUSED fill the 8-entry completion ring, the 9th
    // waits in the session's outbox.
    for _ in 0..9 {
        c.submit_raw(PrefillSubmit::of(99, 7, 0, 0, 0)).unwrap();
    }
    thread::sleep(Duration::from_millis(300));
    // Queued behind the outbox: a STAGE of 5 slots (past the share's 4,
    // refused by the sender), then one of 3 (which the share has).
    c.submit_raw(PrefillSubmit::of(OP_STAGE, tag, 1002, 5, 0))
        .unwrap();
    c.stage(tag, 3).unwrap();
    thread::sleep(Duration::from_millis(300));
    // Room for 3 entries only: the session's next retry moves its waiting
    // REFUSED over, then meets the refused STAGE and the one that needs 4
    // entries, in one pass.
    let (mut bad_ops, mut refused_stage, mut staged) = (0, 0, 0);
    for _ in 0..3 {
        match c.next_event(deadline()).unwrap() {
            PrefillEvent::Refused {
                reason: Some(Refusal::BadOp),
                ..
            } => bad_ops += 1,
            other => panic!("expected REFUSED (bad op), got {other:?}"),
        }
    }
    thread::sleep(Duration::from_millis(300));
    let end = deadline();
    while (bad_ops, refused_stage, staged) != (9, 1, 1) {
        let what = format!(
            "every answer (bad ops {bad_ops} of 9, refused STAGE {refused_stage} of 1, \
             STAGED {staged} of 1): a refusal dropped at the full ring?"
        );
        match c.next_event(end).unwrap_or_else(|e| panic!("{what}: {e}")) {
            PrefillEvent::Refused {
                tag: t,
                reason: Some(Refusal::SenderRefused),
            } if t == tag => refused_stage += 1,
            PrefillEvent::Refused {
                reason: Some(Refusal::BadOp),
                ..
            } => bad_ops += 1,
            PrefillEvent::Staged(b) => {
                assert_eq!(b.len(), 3, "the STAGE of 3");
                staged += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
