//! An attached worker's first batch declared at its BEGIN (attach version
//! 6, `docs/attach.md`, "Declared first batch"): the BEGIN's KEYs ride on
//! the admission AllocRequest, so the batch needs no AllocRequest of its
//! own. The Python and Rust clients through `kvferry node`, every byte
//! checked by a Python decoder; the wire as a raw ROUTER playing an
//! LMCache receiver sees it; hostile declarations are refused one by one
//! and change nothing; a worker SIGKILLed while holding its declared batch
//! leaves nothing held. Children are this test binary re-executed (role in
//! an env var). Every wait has a deadline.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common_sender/mod.rs"]
mod common_sender;
#[path = "common/process.rs"]
mod process;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common_sender::{
    deadline, expect_done, expect_refused, raw_receiver_daemon, receiver, sender, sender_cfg,
    staged, unique, wait_for, wait_receiver_empty, wait_sender_empty, CHUNK, WAIT,
};
use kvferry::attach::layout::{
    error_from_number, PrefillSubmit, EV_DONE, EV_FAILED, EV_REFUSED, EV_SLOT, EV_STAGED,
    NO_TOKENS, OP_CANCEL, OP_KEY, OP_STAGE,
};
use kvferry::attach::{
    AttachConfig, BeginGeometry, DeclaredBatch, PrefillClient, PrefillDaemon, Refusal, StagedSlots,
};
use kvferry::protocol::ErrorCode;
use kvferry::receiver::Receiver;
use kvferry::region::DATA_OFFSET;
use kvferry::sender::{Sender, SenderConfig};
use process::{node_command, python_client, python_pattern, rerun_alone, ChildProc, TempDir};

const ROLE: &str = "KVFERRY_DECLARED_ROLE";
const SOCK: &str = "KVFERRY_DECLARED_SOCK";
const REQ: &str = "KVFERRY_DECLARED_REQ";

/// A receiver of 16 slots, a sender of 8 staging slots in `shares` shares
/// and a prefill daemon over them (its socket in the returned directory).
fn daemon(shares: usize) -> (TempDir, Arc<Receiver>, Arc<Sender>, PrefillDaemon) {
    let dir = TempDir::new("kvferry-declared");
    let r = Arc::new(receiver(16));
    let s = Arc::new(sender(SenderConfig {
        staging_shares: shares,
        ..sender_cfg(8, None)
    }));
    let d = PrefillDaemon::start(
        Arc::clone(&s),
        vec![r.endpoint().to_owned()],
        AttachConfig::new(dir.sock()),
    )
    .expect("daemon starts");
    (dir, r, s, d)
}

/// The keys `req/000..` of `n` chunks (decoder_check.py's names).
fn keys_of(req: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{req}/{i:03}")).collect()
}

/// Fills slot `i` of `b` with `lens[i]` bytes of the Python pattern of
/// chunk `i` (what decoder_check.py verifies).
fn fill(c: &mut PrefillClient, b: &StagedSlots, lens: &[u32]) {
    for (i, &len) in lens.iter().enumerate() {
        let len = len as usize;
        c.slot_mut(b, i).expect("a held slot")[..len].copy_from_slice(&python_pattern(i, len));
    }
}

/// Begins `req` (`lens.len()` chunks, all in the declared batch) from the
/// Rust client, fills and submits it, and waits for DONE.
fn rust_declared(c: &mut PrefillClient, req: &str, lens: &[u32]) {
    let keys = keys_of(req, lens.len());
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let first = DeclaredBatch {
        keys: &keys,
        lens,
        last_chunk_toks: None,
    };
    let g = BeginGeometry::default();
    let tag = c
        .begin_declared(req, 0, lens.len() as u32, &g, &first)
        .expect("begins");
    let b = staged(c, "the declared batch");
    assert!(b.is_declared() && b.len() == lens.len(), "{b:?}");
    fill(c, &b, lens);
    c.submit_declared(b).expect("submitted");
    expect_done(c, tag, "the declared request's DONE");
}

#[test]
fn python_and_rust_workers_declare_their_first_batch_through_kvferry_node() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-declared");
    let mut node = ChildProc::spawn(&mut node_command(&dir, CHUNK, 32, 16, 2));
    let found = node.after_prefixes(&[
        "kvferry node decoder attach on ",
        "kvferry node prefill attach on ",
    ]);
    let (dsock, psock) = (found[0].clone(), found[1].clone());
    // A Python worker declares a 5-chunk batch (a short last chunk).
    let mut dec = python_client(
        "decoder_check.py",
        &[&dsock, "dcl-1", "5", "777", "release"],
    );
    dec.expect_line("ATTACH:subscribed");
    let mut pf = python_client(
        "prefill_check.py",
        &[&psock, "dcl-1", "5", "777", "declared"],
    );
    pf.expect_line("PREFILL:ok");
    pf.wait_success("python worker declaring its batch");
    dec.expect_line("ATTACH:ok");
    dec.wait_success("python decoder of the declared request");
    // With a chunk geometry and a token count: shape [CHUNK / 2] of bf16,
    // the last chunk of 100 tokens is 200 bytes at the receiver.
    let half = (CHUNK / 2).to_string();
    let mut dec = python_client(
        "decoder_check.py",
        &[&dsock, "dcl-2", "4", "200", "release", "100"],
    );
    dec.expect_line("ATTACH:subscribed");
    let mut pf = python_client(
        "prefill_check.py",
        &[
            &psock, "dcl-2", "4", "200", "3", &half, "bf16", "100", "declared",
        ],
    );
    pf.expect_line("PREFILL:ok");
    pf.wait_success("python worker declaring a geometry");
    dec.expect_line("ATTACH:ok");
    dec.wait_success("python decoder of the declared geometry request");
    // The Rust client, three requests in a row on one attachment.
    let mut c = PrefillClient::connect(&psock, WAIT).expect("rust worker attaches");
    for (k, n) in [3usize, 1, 6].into_iter().enumerate() {
        let req = format!("dcl-r{k}");
        let mut lens = vec![CHUNK as u32; n];
        lens[n - 1] = 100 + k as u32;
        let (ns, last) = (n.to_string(), lens[n - 1].to_string());
        let mut dec = python_client("decoder_check.py", &[&dsock, &req, &ns, &last, "release"]);
        dec.expect_line("ATTACH:subscribed");
        rust_declared(&mut c, &req, &lens);
        dec.expect_line("ATTACH:ok");
        dec.wait_success("python decoder of the rust worker's declared request");
    }
}

/// The wire: a raw ROUTER playing an LMCache receiver (no Hello, a static
/// buffer) gets one AllocRequest for a declared request, its admission,
/// carrying the declared keys with the request's geometry, total and
/// last-chunk tokens; its reply's slots are written and the request
/// completes with no second AllocRequest.
#[test]
fn a_declared_batch_rides_on_the_admission_alloc_request() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-declared");
    let raw = raw_receiver_daemon(&dir.sock());
    let mut a = PrefillClient::connect(raw.daemon.socket(), WAIT).unwrap();
    let shape = [CHUNK as i64 / 2];
    let g = BeginGeometry::new(3, &shape, "bfloat16").unwrap();
    let req = unique("dw");
    let keys = keys_of(&req, 3);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let lens = [CHUNK as u32, CHUNK as u32, 18];
    let first = DeclaredBatch {
        keys: &keys,
        lens: &lens,
        last_chunk_toks: Some(9),
    };
    let tag = a.begin_declared(&req, 0, 4, &g, &first).unwrap();
    let (id, m) = raw.recv_alloc("the admission");
    assert_eq!(m.keys, keys, "the admission carries the declared keys");
    assert_eq!(
        (
            &m.req_id[..],
            m.total_chunks,
            m.fmt,
            &m.shape[..],
            &m.dtype[..]
        ),
        (&req[..], 4, 3, &shape[..], "bfloat16")
    );
    assert_eq!((m.last_chunk_toks, m.is_last_batch), (9, false));
    raw.reply(&id, vec![5, 2, 7]);
    let b = staged(&mut a, "the declared batch");
    fill(&mut a, &b, &lens);
    a.submit_declared(b).unwrap();
    // The writes land in the reply's slots; the request waits for its
    // fourth chunk, with no AllocRequest for the declared batch.
    // Read through the buffer file (the slots' bytes as the data plane
    // left them; the receiver never heard of these slots).
    let at = |slot: u64, len: usize| {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len];
        let f = std::fs::File::open(raw.buffer.shm_path()).expect("the buffer file");
        f.read_exact_at(&mut b, DATA_OFFSET + slot * CHUNK)
            .expect("read");
        b
    };
    wait_for("the declared batch's writes in the reply's slots", || {
        (0..3).all(|i| at([5, 2, 7][i], lens[i] as usize) == python_pattern(i, lens[i] as usize))
    });
    assert!(
        raw.next_alloc(Duration::from_millis(300)).is_none(),
        "no second AllocRequest for the declared batch"
    );
    a.stage(tag, 1).unwrap();
    let b = staged(&mut a, "the last batch");
    fill(&mut a, &b, &[CHUNK as u32]);
    a.submit(b, &[&format!("{req}/003")], &[CHUNK as u32])
        .expect("submitted");
    let (id, m) = raw.recv_alloc("the last batch");
    assert_eq!((m.keys.len(), m.is_last_batch), (1, true));
    raw.reply(&id, vec![0]);
    expect_done(&mut a, tag, "DONE");
    drop(a);
    drop(raw.daemon);
    wait_sender_empty(&raw.sender, "after the raw receiver's request");
}

/// A hostile or confused worker's declarations are refused, each with
/// its code, by the session that keeps serving it; nothing is left held.
#[test]
fn hostile_declarations_are_refused_one_by_one_and_change_nothing() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (_dir, r, s, d) = daemon(2);
    let mut a = PrefillClient::connect(d.socket(), WAIT).unwrap();
    let share = a.hello().slots as u32;
    let g = BeginGeometry::default();
    let begin = |tag: u64, req: &str, total: u32, declared: u32, toks: u32| {
        let mut b = PrefillSubmit::begin(tag, 0, total, req, &g).unwrap();
        b.c = declared;
        b.len = toks;
        b
    };
    let key = |tag: u64, batch: u32, i: u32, len: u32| {
        PrefillSubmit::with_text(OP_KEY, tag, batch, i, len, &format!("hk-{tag}-{i}")).unwrap()
    };
    let full = CHUNK as u32;
    // Declaring more chunks than the worker's share holds.
    a.submit_raw(begin(100, "h-big", 64, share + 1, NO_TOKENS))
        .unwrap();
    expect_refused(
        &mut a,
        100,
        Refusal::TooManyChunks,
        "a declaration past the share",
    );
    // Tokens past the shape's largest dimension.
    a.submit_raw(begin(101, "h-toks", 2, 1, full + 1)).unwrap();
    expect_refused(
        &mut a,
        101,
        Refusal::BadTokens,
        "declared tokens past the shape",
    );
    // A STAGE before the KEYs: the declaration is dropped, the tag free.
    a.submit_raw(begin(102, "h-order", 2, 2, NO_TOKENS))
        .unwrap();
    a.submit_raw(PrefillSubmit::of(OP_STAGE, 102, 1, 2, 0))
        .unwrap();
    expect_refused(&mut a, 102, Refusal::BadBatch, "a STAGE before the KEYs");
    // KEYs naming two batch ids.
    a.submit_raw(begin(102, "h-order", 2, 2, NO_TOKENS))
        .unwrap();
    a.submit_raw(key(102, 1, 0, full)).unwrap();
    a.submit_raw(key(102, 2, 1, full)).unwrap();
    expect_refused(&mut a, 102, Refusal::BadBatch, "KEYs of two batches");
    // A KEY index past the declaration, and a length past a slot.
    a.submit_raw(begin(103, "h-index", 2, 1, NO_TOKENS))
        .unwrap();
    a.submit_raw(key(103, 1, 1, full)).unwrap();
    expect_refused(
        &mut a,
        103,
        Refusal::BadBatch,
        "a KEY index past the declaration",
    );
    a.submit_raw(begin(103, "h-index", 2, 1, NO_TOKENS))
        .unwrap();
    a.submit_raw(key(103, 1, 0, full + 1)).unwrap();
    expect_refused(&mut a, 103, Refusal::BadBatch, "a KEY longer than a slot");
    // A short chunk before the declaration's last: the sender refuses it
    // when the last KEY came (nothing was sent for it).
    a.submit_raw(begin(104, "h-short", 3, 2, NO_TOKENS))
        .unwrap();
    a.submit_raw(key(104, 1, 0, 10)).unwrap();
    a.submit_raw(key(104, 1, 1, full)).unwrap();
    expect_refused(&mut a, 104, Refusal::SenderRefused, "a short chunk first");
    // CANCEL while the KEYs are awaited: FAILED cancelled, as for a
    // begun request.
    a.submit_raw(begin(105, "h-cancel", 2, 2, NO_TOKENS))
        .unwrap();
    a.submit_raw(key(105, 1, 0, full)).unwrap();
    a.submit_raw(PrefillSubmit::of(OP_CANCEL, 105, 0, 0, 0))
        .unwrap();
    // Read raw: the client began no request of this tag.
    let ev = a
        .next_raw(deadline())
        .expect("the cancelled declaration's end");
    assert_eq!(
        (ev.kind, ev.tag, error_from_number(ev.code)),
        (EV_FAILED, 105, Some(ErrorCode::Cancelled)),
        "{ev:?}"
    );
    assert_eq!(s.active_requests(), 0, "nothing reached the sender");

    // A good declaration, then wrong uses of its batch (raw entries,
    // their answers read raw: the client would refuse a STAGED it did not
    // ask for).
    let raw = |a: &mut PrefillClient, what: &str| {
        a.next_raw(deadline())
            .unwrap_or_else(|e| panic!("no entry for {what}: {e}"))
    };
    let refused = |a: &mut PrefillClient, want: Refusal, what: &str| {
        let ev = raw(a, what);
        assert_eq!(
            (ev.kind, ev.tag, ev.code),
            (EV_REFUSED, 106, want as u32),
            "{what}: {ev:?}"
        );
    };
    let staged_raw = |a: &mut PrefillClient, what: &str| {
        let ev = raw(a, what);
        assert_eq!(
            (ev.kind, ev.tag, ev.a, ev.b),
            (EV_STAGED, 106, 7, 2),
            "{what}: {ev:?}"
        );
        for i in 0..2 {
            let ev = raw(a, what);
            assert_eq!((ev.kind, ev.b), (EV_SLOT, i), "{what}: {ev:?}");
        }
    };
    let stage = PrefillSubmit::of(OP_STAGE, 106, 7, 2, 0);
    a.submit_raw(begin(106, "h-good", 2, 2, NO_TOKENS)).unwrap();
    a.submit_raw(key(106, 7, 0, full)).unwrap();
    a.submit_raw(key(106, 7, 1, full)).unwrap();
    a.submit_raw(PrefillSubmit::of(OP_STAGE, 106, 7, 1, 0))
        .unwrap();
    refused(
        &mut a,
        Refusal::BadBatch,
        "the declared batch staged in part",
    );
    a.submit_raw(stage).unwrap();
    staged_raw(&mut a, "the declared batch");
    a.submit_raw(key(106, 7, 0, full)).unwrap();
    refused(&mut a, Refusal::BadBatch, "a KEY of the declared batch");
    a.submit_raw(PrefillSubmit::submit(106, 7, 1, None))
        .unwrap();
    refused(
        &mut a,
        Refusal::BadBatch,
        "the declared batch submitted in part",
    );
    wait_for("the refused batch's slots back", || s.staging_in_use() == 0);
    a.submit_raw(stage).unwrap();
    staged_raw(&mut a, "the declared batch again");
    a.submit_raw(PrefillSubmit::submit(106, 7, 2, Some(5)))
        .unwrap();
    refused(
        &mut a,
        Refusal::BadBatch,
        "tokens on the declared batch's SUBMIT",
    );
    a.submit_raw(stage).unwrap();
    staged_raw(&mut a, "the declared batch a third time");
    a.submit_raw(PrefillSubmit::submit(106, 7, 2, None))
        .unwrap();
    let ev = raw(&mut a, "DONE");
    assert_eq!((ev.kind, ev.tag), (EV_DONE, 106), "{ev:?}");
    a.submit_raw(PrefillSubmit::submit(106, 7, 2, None))
        .unwrap();
    let ev = raw(&mut a, "a SUBMIT after the end");
    assert_eq!(
        (ev.kind, ev.code),
        (EV_REFUSED, Refusal::UnknownTag as u32),
        "{ev:?}"
    );
    r.wait_ready("h-good", deadline()).expect("h-good ready");
    for i in 0..2 {
        assert!(r.remove(&format!("hk-106-{i}")), "chunk {i} of h-good held");
    }
    drop(a);
    wait_for("the session to end", || d.clients() == 0);
    wait_sender_empty(&s, "after the hostile worker left");
    wait_receiver_empty(&r, "after the hostile worker left");
}

/// The re-executed child: declare a request's batch, get its slots (the
/// receiver has allocated the batch's slots by then) and hang until
/// killed.
fn holder_main() {
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let req = std::env::var(REQ).unwrap();
    let mut c = PrefillClient::connect(&sock, WAIT).expect("child attaches");
    let keys = keys_of(&req, 3);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let lens = [CHUNK as u32; 3];
    let first = DeclaredBatch {
        keys: &keys,
        lens: &lens,
        last_chunk_toks: None,
    };
    c.begin_declared(&req, 0, 6, &BeginGeometry::default(), &first)
        .unwrap();
    let b = staged(&mut c, "the declared batch");
    fill(&mut c, &b, &lens);
    println!("HOLDING");
    std::thread::sleep(WAIT * 2);
    panic!("holder was not killed");
}

#[test]
fn sigkill_of_a_worker_holding_its_declared_batch_releases_everything() {
    if std::env::var(ROLE).is_ok() {
        return holder_main();
    }
    let (_dir, r, s, d) = daemon(1);
    let req = unique("dk");
    let mut w = ChildProc::spawn(
        rerun_alone("sigkill_of_a_worker_holding_its_declared_batch_releases_everything")
            .env(ROLE, "holder")
            .env(SOCK, d.socket())
            .env(REQ, &req),
    );
    w.expect_line("HOLDING");
    assert_eq!(s.staging_in_use(), 3, "the holder's declared batch");
    assert_eq!(
        r.stats().allocated_chunks,
        3,
        "the receiver allocated the declared slots with the admission"
    );
    w.child.kill().unwrap();
    let _ = w.child.wait();
    wait_for("the session to end", || d.clients() == 0);
    let st = s.wait(&req, deadline()).expect("the sender knows it");
    assert_eq!(st, kvferry::sender::RequestStatus::Cancelled, "{st:?}");
    wait_sender_empty(&s, "after the holder was killed");
    wait_receiver_empty(&r, "after the holder was killed");
}
