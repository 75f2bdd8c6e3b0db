//! Decoder attach (`docs/attach.md`): decoder processes attached to a
//! receiver through the Unix socket and shared-memory rings read every byte
//! in place; a decoder killed with SIGKILL while holding a request gives its
//! slots back; hostile submissions change nothing; the bounds and the uid
//! check refuse. Children are this test binary re-executed (role in an env
//! var) or the real `kvferry receiver` binary. Every wait has a deadline.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common_sender/mod.rs"]
mod common_sender;
#[path = "common/process.rs"]
mod process;

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common_sender::{deadline, receiver, sender, sender_cfg, unique, wait_for, CHUNK, WAIT};
use kvferry::attach::layout::{DecoderSubmit, DAEMON_TAG, STATUS_TOO_MANY_CLIENTS};
use kvferry::attach::{AttachConfig, AttachError, DecoderClient, DecoderDaemon, Event, Refusal};
use kvferry::protocol::ErrorCode;
use kvferry::receiver::Receiver;
use kvferry::sender::{RequestSpec, Sender, TransferSpec};
use process::{
    attach_session_states, rerun_alone, sigterm, thread_faults, wait_exit, ChildProc, TempDir,
};

const ROLE: &str = "KVFERRY_ATTACH_ROLE";
const SOCK: &str = "KVFERRY_ATTACH_SOCK";
const REQ: &str = "KVFERRY_ATTACH_REQ";
const COUNT: &str = "KVFERRY_ATTACH_COUNT";
const LAST: &str = "KVFERRY_ATTACH_LAST";
const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

/// Chunk `i` of `n` of `req_id`: full [`CHUNK`] bytes but the last, which
/// is `last` bytes; the content depends on the request, the index and the
/// position, so a chunk read from the wrong slot or offset is caught.
fn chunk(req_id: &str, i: usize, n: usize, last: usize) -> Vec<u8> {
    let len = if i + 1 == n { last } else { CHUNK as usize };
    let seed = req_id
        .bytes()
        .fold((i as u32).wrapping_mul(2_654_435_761), |a, b| {
            a.rotate_left(5) ^ u32::from(b)
        });
    (0..len)
        .map(|j| (seed.wrapping_add(j as u32).wrapping_mul(0x9e37_79b9) >> 24) as u8)
        .collect()
}

fn store(s: &Sender, endpoint: &str, req_id: &str, n: usize, last: usize) {
    let spec = TransferSpec::new(req_id, endpoint, n, true);
    let keys: Vec<String> = (0..n).map(|i| format!("{req_id}/{i:03}")).collect();
    let bufs: Vec<Vec<u8>> = (0..n).map(|i| chunk(req_id, i, n, last)).collect();
    let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    s.store(&spec, &keys, &chunks).expect("stored");
}

fn daemon(r: &Arc<Receiver>, sock: &Path, tweak: impl FnOnce(&mut AttachConfig)) -> DecoderDaemon {
    let mut cfg = AttachConfig::new(sock);
    tweak(&mut cfg);
    DecoderDaemon::start(Arc::clone(r), cfg).expect("daemon starts")
}

fn connect(sock: &Path) -> DecoderClient {
    DecoderClient::connect(sock, WAIT).expect("attaches")
}

fn next(c: &mut DecoderClient, what: &str) -> Event {
    c.next_event(deadline())
        .unwrap_or_else(|e| panic!("no event for {what}: {e}"))
}

/// Reads and checks every byte of a delivered request.
fn verify(c: &DecoderClient, d: &kvferry::attach::Delivery, n: usize, last: usize) {
    assert_eq!(d.chunks().len(), n, "chunk count of {}", d.req_id());
    for i in 0..n {
        let bytes = c.chunk(d, i).expect("chunk in range");
        assert!(
            bytes == chunk(d.req_id(), i, n, last).as_slice(),
            "chunk {i} of {} differs",
            d.req_id()
        );
    }
    assert_eq!(d.chunks()[n - 1].len as usize, last);
    assert!(c.chunk(d, n).is_none());
}

/// The re-executed child: attach, subscribe, read and check the request,
/// then release it and exit ("decoder") or hold it until killed ("holder").
fn child_main(role: &str) {
    let sock = PathBuf::from(std::env::var(SOCK).unwrap());
    let req = std::env::var(REQ).unwrap();
    let n: usize = std::env::var(COUNT).unwrap().parse().unwrap();
    let last: usize = std::env::var(LAST).unwrap().parse().unwrap();
    let mut c = connect(&sock);
    let tag = c.subscribe(&req).expect("subscribes");
    println!("ATTACH:subscribed");
    match next(&mut c, "the child's request") {
        Event::Ready(d) => {
            assert_eq!(d.tag(), tag);
            verify(&c, &d, n, last);
            if role == "holder" {
                println!("ATTACH:holding");
                // Bounded: the parent kills us long before this.
                thread::sleep(WAIT * 2);
                panic!("holder was not killed");
            }
            c.release(d).expect("released");
            println!("ATTACH:ok");
        }
        other => panic!("expected READY, got {other:?}"),
    }
}

/// The re-executed test binary as a decoder child (killed on drop).
fn decoder_child(
    test: &str,
    role: &str,
    sock: &Path,
    req: &str,
    n: usize,
    last: usize,
) -> ChildProc {
    ChildProc::spawn(
        rerun_alone(test)
            .env(ROLE, role)
            .env(SOCK, sock)
            .env(REQ, req)
            .env(COUNT, n.to_string())
            .env(LAST, last.to_string()),
    )
}

fn allocated(r: &Receiver) -> usize {
    r.stats().allocated_chunks
}

#[test]
fn a_decoder_process_reads_every_byte_in_place_and_its_release_frees_the_slots() {
    if let Ok(role) = std::env::var(ROLE) {
        return child_main(&role);
    }
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    let mut child = decoder_child(
        "a_decoder_process_reads_every_byte_in_place_and_its_release_frees_the_slots",
        "decoder",
        &dir.sock(),
        "dec-1",
        5,
        1000,
    );
    child.expect_line("ATTACH:subscribed");
    store(&s, r.endpoint(), "dec-1", 5, 1000);
    child.expect_line("ATTACH:ok");
    child.wait_success("decoder child");
    wait_for("the released slots back in the receiver", || {
        allocated(&r) == 0
    });
    wait_for("the session to end", || d.clients() == 0);
}

#[test]
fn sigkill_of_a_decoder_holding_a_request_releases_its_chunks() {
    if let Ok(role) = std::env::var(ROLE) {
        return child_main(&role);
    }
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(8));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    let mut child = decoder_child(
        "sigkill_of_a_decoder_holding_a_request_releases_its_chunks",
        "holder",
        &dir.sock(),
        "held-1",
        6,
        CHUNK as usize,
    );
    child.expect_line("ATTACH:subscribed");
    store(&s, r.endpoint(), "held-1", 6, CHUNK as usize);
    child.expect_line("ATTACH:holding");
    assert_eq!(allocated(&r), 6, "the holder's chunks stay allocated");
    assert_eq!(d.clients(), 1);
    child.sigkill();
    wait_for("the killed decoder's chunks to be released", || {
        allocated(&r) == 0
    });
    wait_for("the session to end", || d.clients() == 0);
    // The whole buffer is usable again: a request of every slot passes.
    let mut c = connect(&dir.sock());
    c.subscribe("after-kill").unwrap();
    store(&s, r.endpoint(), "after-kill", 8, 7);
    match next(&mut c, "after-kill") {
        Event::Ready(del) => {
            verify(&c, &del, 8, 7);
            c.release(del).unwrap();
        }
        other => panic!("expected READY, got {other:?}"),
    }
    wait_for("after-kill released", || allocated(&r) == 0);
}

#[test]
fn hostile_submissions_are_refused_and_change_nothing() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |c| c.max_outstanding = 2);
    let s = sender(sender_cfg(8, None));
    let mut a = connect(&dir.sock());
    let mut b = connect(&dir.sock());
    let ta = a.subscribe("owned-by-a").unwrap();
    // The sessions run on their own threads: let A's subscription land first.
    wait_for("A's subscription", || d.subscriptions() == 1);
    // B subscribes to A's request: refused.
    let tb = b.subscribe("owned-by-a").unwrap();
    match next(&mut b, "B's duplicate subscription") {
        Event::Refused {
            tag,
            reason: Some(Refusal::AlreadySubscribed),
            ..
        } => assert_eq!(tag, tb),
        other => panic!("expected AlreadySubscribed, got {other:?}"),
    }
    // B releases A's tag (a tag B does not hold): refused, A unaffected.
    b.submit_raw(DecoderSubmit::release(ta)).unwrap();
    match next(&mut b, "B's release of A's tag") {
        Event::Refused {
            tag,
            reason: Some(Refusal::UnknownTag),
            ..
        } => assert_eq!(tag, ta),
        other => panic!("expected UnknownTag, got {other:?}"),
    }
    // Garbage ops and req_ids.
    let mut bad = DecoderSubmit::subscribe(900, "x").unwrap();
    bad.op = 77;
    b.submit_raw(bad).unwrap();
    let mut bad_len = DecoderSubmit::subscribe(901, "y").unwrap();
    bad_len.req_id_len = 10_000;
    b.submit_raw(bad_len).unwrap();
    let mut bad_utf8 = DecoderSubmit::subscribe(902, "zz").unwrap();
    bad_utf8.req_id[0] = 0xff;
    b.submit_raw(bad_utf8).unwrap();
    for (want_tag, want) in [
        (900, Refusal::BadOp),
        (901, Refusal::BadReqId),
        (902, Refusal::BadReqId),
    ] {
        match next(&mut b, "a garbage submission") {
            Event::Refused { tag, reason, .. } => {
                assert_eq!((tag, reason), (want_tag, Some(want)))
            }
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
    // Duplicate tag, then the outstanding bound (2).
    b.submit_raw(DecoderSubmit::subscribe(5, "b-1").unwrap())
        .unwrap();
    b.submit_raw(DecoderSubmit::subscribe(5, "b-2").unwrap())
        .unwrap();
    b.submit_raw(DecoderSubmit::subscribe(6, "b-3").unwrap())
        .unwrap();
    b.submit_raw(DecoderSubmit::subscribe(7, "b-4").unwrap())
        .unwrap();
    for (want_tag, want) in [(5, Refusal::DuplicateTag), (7, Refusal::TooManyOutstanding)] {
        match next(&mut b, "a bounded submission") {
            Event::Refused { tag, reason, .. } => {
                assert_eq!((tag, reason), (want_tag, Some(want)))
            }
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
    // A still gets its request, whole.
    store(&s, r.endpoint(), "owned-by-a", 3, 17);
    match next(&mut a, "A's request") {
        Event::Ready(d) => {
            assert_eq!(d.tag(), ta);
            verify(&a, &d, 3, 17);
            // A delivery is only readable through its own client.
            assert!(b.chunk(&d, 0).is_none());
            a.release(d).unwrap();
        }
        other => panic!("expected READY, got {other:?}"),
    }
    wait_for("A's release", || allocated(&r) == 0);
}

#[test]
fn a_failed_request_is_reported_with_its_code() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(8));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    let mut c = connect(&dir.sock());
    let tag = c.subscribe("fails").unwrap();
    let req = s
        .begin(RequestSpec::new("fails", r.endpoint(), 4))
        .expect("begins");
    wait_for("admitted", || req.is_admitted());
    assert!(s.cancel_request("fails"));
    match next(&mut c, "the failure") {
        Event::Failed {
            tag: t,
            req_id,
            code,
        } => {
            assert_eq!((t, req_id.as_str()), (tag, "fails"));
            assert_eq!(code, Some(ErrorCode::Cancelled));
        }
        other => panic!("expected FAILED, got {other:?}"),
    }
    // The tag is free again: the request id can be subscribed anew.
    c.subscribe("fails").unwrap();
}

/// A session watches all its waiting subscriptions through one eventfd:
/// requests subscribed before they exist, ending together and one of them
/// failing, each reach the client once with their own tag —
/// none is missed because another ended in the same wake-up, none is
/// delivered under another's tag. One subscribed after it completed is
/// taken at once.
#[test]
fn many_waiting_subscriptions_ending_together_are_each_delivered_once() {
    const N: usize = 6;
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(16, None));
    let mut c = connect(&dir.sock());
    let ids: Vec<String> = (0..N).map(|i| format!("waits-{i}")).collect();
    let mut want: HashMap<u64, String> = ids
        .iter()
        .map(|id| (c.subscribe(id).unwrap(), id.clone()))
        .collect();
    // The last one fails; the others complete, newest first.
    let failing = s
        .begin(RequestSpec::new(&ids[N - 1], r.endpoint(), 2))
        .expect("begins");
    wait_for("admitted", || failing.is_admitted());
    assert!(s.cancel_request(&ids[N - 1]));
    // All at once, so several end within one of the session's wake-ups.
    thread::scope(|sc| {
        for id in ids[..N - 1].iter().rev() {
            let (s, ep) = (&s, r.endpoint());
            sc.spawn(move || store(s, ep, id, 2, 100));
        }
    });
    store(&s, r.endpoint(), "done-before", 1, 7);
    r.wait_ready("done-before", deadline()).expect("ready");
    want.insert(c.subscribe("done-before").unwrap(), "done-before".into());
    while !want.is_empty() {
        match next(&mut c, &format!("the {} left: {want:?}", want.len())) {
            Event::Ready(d) => {
                let id = want.remove(&d.tag()).expect("a tag still expected");
                assert_eq!(d.req_id(), id);
                let n = if id == "done-before" { 1 } else { 2 };
                verify(&c, &d, n, if n == 1 { 7 } else { 100 });
                c.release(d).unwrap();
            }
            Event::Failed { tag, req_id, code } => {
                assert_eq!(want.remove(&tag).as_deref(), Some(ids[N - 1].as_str()));
                assert_eq!(req_id, ids[N - 1]);
                assert_eq!(code, Some(ErrorCode::Cancelled));
            }
            other => panic!("expected READY or FAILED, got {other:?}"),
        }
    }
    wait_for("every slot back", || allocated(&r) == 0);
}

/// A session returns released slots after answering what the client
/// submitted behind the RELEASE (docs/attach.md, "Submission"); a client
/// that submits nothing more still gets them returned at once, not at its
/// next SUBSCRIBE or detach.
#[test]
fn a_release_returns_the_slots_while_the_client_stays_attached_and_quiet() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    store(&s, r.endpoint(), "quiet-1", 3, 100);
    r.wait_ready("quiet-1", deadline()).expect("ready");
    let mut c = connect(&dir.sock());
    c.subscribe("quiet-1").unwrap();
    let Event::Ready(delivery) = next(&mut c, "READY for quiet-1") else {
        panic!("expected READY for quiet-1");
    };
    verify(&c, &delivery, 3, 100);
    assert_eq!(allocated(&r), 3, "held for the client");
    c.release(delivery).unwrap();
    wait_for(
        "the released slots and subscription back, the client quiet",
        || allocated(&r) == 0 && d.subscriptions() == 0,
    );
    assert_eq!(d.clients(), 1, "the client is still attached");
}

/// A decoder whose daemon went away is told so: its calls fail with
/// `Closed`, not `Full` (which says "retry"; a closed ring refuses pushes
/// as a full one does).
#[test]
fn a_decoder_whose_daemon_is_gone_gets_closed_not_full() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |_| {});
    let mut c = connect(&dir.sock());
    let tag = c.subscribe("orphan-1").unwrap();
    drop(d);
    let closed = |e: &AttachError| matches!(e, AttachError::Closed);
    let e = c
        .next_event(deadline())
        .expect_err("no event from a daemon gone");
    assert!(closed(&e), "next_event: {e}");
    let e = c
        .subscribe("orphan-2")
        .expect_err("a subscribe to a daemon gone");
    assert!(closed(&e), "subscribe: {e}");
    let e = c
        .unsubscribe(tag)
        .expect_err("an unsubscribe to a daemon gone");
    assert!(closed(&e), "unsubscribe: {e}");
}

/// The session returns a released subscription late, but never so late
/// that the client's own next SUBSCRIBE of the same `req_id` is refused.
#[test]
fn a_req_id_released_and_subscribed_again_at_once_is_not_refused() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    let mut c = connect(&dir.sock());
    let first = c.subscribe("again-1").unwrap();
    c.unsubscribe(first).unwrap();
    let second = c.subscribe("again-1").unwrap();
    // The session answers in ring order: once the probe's REFUSED is here
    // it has handled all three, and the request is written only then (one
    // complete before the session read the first SUBSCRIBE would be taken
    // for it and consumed unseen by the UNSUBSCRIBE, as documented).
    let probe = 1 << 40;
    c.submit_raw(DecoderSubmit::release(probe)).unwrap();
    match next(&mut c, "the probe's REFUSED") {
        Event::Refused { tag, .. } if tag == probe => {}
        other => panic!("expected only the probe's REFUSED, got {other:?}"),
    }
    store(&s, r.endpoint(), "again-1", 2, 10);
    match next(&mut c, "READY for the second subscription") {
        Event::Ready(d) => {
            assert_eq!(d.tag(), second);
            verify(&c, &d, 2, 10);
            c.release(d).unwrap();
        }
        other => panic!("expected READY for the second subscription, got {other:?}"),
    }
    wait_for("the slots back", || allocated(&r) == 0);
}

/// Complete requests subscribed while the completion ring is full wait in
/// the session and are delivered oldest first as the client makes room;
/// one the client unsubscribes meanwhile is never delivered, and its
/// slots come back.
#[test]
fn deliveries_waiting_for_ring_room_go_out_oldest_first_and_a_released_one_never() {
    const N: usize = 8;
    const DROPPED: usize = 5;
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    // Room for two one-chunk deliveries (READY + CHUNK each).
    let _d = daemon(&r, &dir.sock(), |cfg| cfg.cq_capacity = 4);
    let s = sender(sender_cfg(16, None));
    let ids: Vec<String> = (0..N).map(|i| format!("queued-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        store(&s, r.endpoint(), id, 1, i + 1);
        r.wait_ready(id, deadline()).expect("ready");
    }
    let mut c = connect(&dir.sock());
    let tags: Vec<u64> = ids.iter().map(|id| c.subscribe(id).unwrap()).collect();
    // Nothing read yet: the first two are on the ring, the rest wait in
    // the session (each taken, so its slot is held).
    c.unsubscribe(tags[DROPPED]).unwrap();
    let mut got = Vec::new();
    while got.len() < N - 1 {
        match next(&mut c, &format!("delivery {} of {}", got.len() + 1, N - 1)) {
            Event::Ready(d) => {
                let i = tags.iter().position(|t| *t == d.tag()).expect("our tag");
                verify(&c, &d, 1, i + 1);
                got.push(i);
                c.release(d).unwrap();
            }
            other => panic!("expected READY, got {other:?}"),
        }
    }
    let want: Vec<usize> = (0..N).filter(|i| *i != DROPPED).collect();
    assert_eq!(
        got, want,
        "delivered in the order taken, the released one not at all"
    );
    fence(&mut c);
    wait_for("every slot back, the unsubscribed one's too", || {
        allocated(&r) == 0
    });
}

#[test]
fn past_max_clients_a_new_attachment_is_refused() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let d = daemon(&r, &dir.sock(), |c| c.max_clients = 1);
    let first = connect(&dir.sock());
    wait_for("the first session", || d.clients() == 1);
    match DecoderClient::connect(dir.sock(), WAIT) {
        Err(AttachError::Refused(s)) => assert_eq!(s, STATUS_TOO_MANY_CLIENTS),
        other => panic!("expected a refusal, got {other:?}"),
    }
    drop(first);
    wait_for("the first session to end", || d.clients() == 0);
    let _again = connect(&dir.sock());
}

/// A library daemon's `AttachConfig::engine_cpu` reaches the hello, and a
/// client keeps the thread that attached off that CPU, but only once the
/// attach succeeded: a refused one, from a thread that may still run on
/// that CPU, leaves the thread's CPUs as they were.
#[test]
fn only_a_successful_attach_keeps_its_thread_off_the_engine_cpu() {
    let cpus = kvferry::threads::allowed_cpus().to_vec();
    let [.., last] = cpus[..] else {
        unreachable!("a process runs on some CPU")
    };
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let d = daemon(&r, &dir.sock(), |c| {
        c.max_clients = 1;
        c.engine_cpu = Some(last);
    });
    let sock = dir.sock();
    // Each attach on a thread of its own, spawned from this one (every CPU).
    let first = thread::scope(|s| {
        s.spawn(|| {
            let before = process::thread_cpus();
            let first = connect(&sock);
            assert_eq!(first.hello().engine_cpu, last as u32);
            if cpus.len() > 1 {
                assert_eq!(first.kept_off_cpu(), Some(last));
                assert_ne!(
                    process::thread_cpus(),
                    before,
                    "{last} taken out of {before:?}"
                );
            } else {
                assert_eq!(first.kept_off_cpu(), None, "its only CPU stays");
                assert_eq!(process::thread_cpus(), before);
            }
            first
        })
        .join()
        .unwrap()
    });
    wait_for("the first session", || d.clients() == 1);
    thread::scope(|s| {
        s.spawn(|| {
            let before = process::thread_cpus();
            assert!(before.contains(&last), "{before:?}");
            match DecoderClient::connect(&sock, WAIT) {
                Err(AttachError::Refused(st)) => assert_eq!(st, STATUS_TOO_MANY_CLIENTS),
                other => panic!("expected a refusal, got {other:?}"),
            }
            assert_eq!(
                process::thread_cpus(),
                before,
                "a refused attach changed the thread's CPUs"
            );
        })
        .join()
        .unwrap();
    });
    drop(first);
}

/// Runs python3 as uid 65534 (nobody) to connect to `sock`; returns what it
/// printed: "EACCES" or the hello status.
fn connect_as_nobody(sock: &Path) -> String {
    let script = "import socket,struct,sys\n\
s=socket.socket(socket.AF_UNIX)\n\
try:\n  s.connect(sys.argv[1])\n\
except PermissionError:\n  print('EACCES'); sys.exit(0)\n\
b=b''\n\
while len(b)<1024:\n  d=s.recv(1024-len(b))\n  if not d: break\n  b+=d\n\
print('status', struct.unpack_from('<I', b, 16)[0] if len(b)>=20 else 'none')\n";
    use std::os::unix::process::CommandExt;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(sock)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 runs");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn another_user_cannot_attach() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "another_user_cannot_attach: needs root to run a second uid; checked the modes only"
        );
    }
    let dir = TempDir::new("kvferry-attach");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = Arc::new(receiver(4));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir.sock()), 0o600);
    // SAFETY: as above.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    assert_eq!(connect_as_nobody(&dir.sock()), "EACCES");
    // Past the file mode (opened up here on purpose), SO_PEERCRED refuses.
    std::fs::set_permissions(dir.sock(), std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(connect_as_nobody(&dir.sock()), "status 2");
}

/// Starts `kvferry receiver --attach SOCK`; returns it with its endpoint.
fn spawn_receiver_binary(sock: &Path, shm: &Path) -> (ChildProc, String) {
    spawn_receiver_binary_with(sock, shm, &[], Stdio::inherit())
}

/// [`spawn_receiver_binary`] with more options and its stderr sent to
/// `stderr`.
fn spawn_receiver_binary_with(
    sock: &Path,
    shm: &Path,
    extra: &[&str],
    stderr: Stdio,
) -> (ChildProc, String) {
    // Killed on drop, so a failing test leaves no daemon behind.
    let mut p = ChildProc::spawn(
        Command::new(BIN)
            .args(["receiver", "--listen", "tcp://127.0.0.1:0"])
            .args([
                "--capacity-chunks",
                "4",
                "--chunk-bytes",
                &CHUNK.to_string(),
            ])
            .arg("--attach")
            .arg(sock)
            .arg("--shm-path")
            .arg(shm)
            .args(extra)
            .stdin(Stdio::null())
            .stderr(stderr),
    );
    let endpoint = p
        .after_prefixes(&[
            "kvferry receiver listening on ",
            "kvferry receiver attach on ",
        ])
        .remove(0);
    (p, endpoint)
}

#[test]
fn the_receiver_binary_serves_attached_decoders_and_survives_a_killed_one() {
    if let Ok(role) = std::env::var(ROLE) {
        return child_main(&role);
    }
    let dir = TempDir::new("kvferry-attach");
    let shm = dir.0.join("buf");
    let (mut recv, endpoint) = spawn_receiver_binary(&dir.sock(), &shm);
    let s = sender(sender_cfg(8, None));
    // A holder process takes the whole buffer (4 slots), then dies.
    let mut holder = decoder_child(
        "the_receiver_binary_serves_attached_decoders_and_survives_a_killed_one",
        "holder",
        &dir.sock(),
        "bin-held",
        4,
        CHUNK as usize,
    );
    holder.expect_line("ATTACH:subscribed");
    store(&s, &endpoint, "bin-held", 4, CHUNK as usize);
    holder.expect_line("ATTACH:holding");
    holder.sigkill();
    // Only if the dead holder's slots came back can a second 4-chunk
    // request be admitted and delivered.
    let mut c = connect(&dir.sock());
    c.subscribe("bin-next").unwrap();
    store(&s, &endpoint, "bin-next", 4, 99);
    match next(&mut c, "bin-next") {
        Event::Ready(d) => {
            verify(&c, &d, 4, 99);
            c.release(d).unwrap();
        }
        other => panic!("expected READY, got {other:?}"),
    }
    drop(c);
    sigterm(&recv.child);
    let st = wait_exit(&mut recv.child, "kvferry receiver after SIGTERM");
    assert!(st.success(), "receiver exit {st}");
    assert!(!dir.sock().exists(), "the socket is removed at exit");
}

/// `--attach-poll-idle-us` reaches the sessions: well after its client's
/// last round trip (and past any linger), the session of a receiver
/// started with a long poll idle is still polling (running or runnable,
/// `R`, at every look), where one started without it sleeps (`S`).
#[test]
fn the_receiver_binarys_sessions_poll_through_their_attach_poll_idle() {
    for (extra, polls) in [
        (&[][..], false),
        (&["--attach-poll-idle-us", "10000000"][..], true),
    ] {
        let dir = TempDir::new("kvferry-attach");
        let shm = dir.0.join("buf");
        let (recv, _) = spawn_receiver_binary_with(&dir.sock(), &shm, extra, Stdio::inherit());
        let mut c = connect(&dir.sock());
        refused_round_trips(&mut c, 4);
        // Far past the longest linger (250 µs).
        thread::sleep(Duration::from_millis(50));
        let states: Vec<Vec<char>> = (0..10)
            .map(|_| {
                thread::sleep(Duration::from_millis(5));
                attach_session_states(recv.child.id())
            })
            .collect();
        let want = if polls { 'R' } else { 'S' };
        assert!(
            states.iter().all(|s| s == &[want]),
            "with {extra:?} the one session's state should read {want} at every look: {states:?}"
        );
    }
}

/// The pattern `clients/python/decoder_check.py` checks: byte `j` of chunk
/// `i` is `(i * 31 + j) & 0xff`.
fn store_for_python(s: &Sender, endpoint: &str, req_id: &str, n: usize, last: usize) {
    let spec = TransferSpec::new(req_id, endpoint, n, true);
    let keys: Vec<String> = (0..n).map(|i| format!("{req_id}/{i:03}")).collect();
    let bufs: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            let len = if i + 1 == n { last } else { CHUNK as usize };
            (0..len).map(|j| ((i * 31 + j) & 0xff) as u8).collect()
        })
        .collect();
    let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    s.store(&spec, &keys, &chunks).expect("stored");
}

fn python_decoder(sock: &Path, req: &str, n: usize, last: usize, mode: &str) -> ChildProc {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    ChildProc::spawn(
        Command::new("python3")
            .arg(dir.join("decoder_check.py"))
            .arg(sock)
            .args([req, &n.to_string(), &last.to_string(), mode])
            .env("PYTHONPATH", &dir),
    )
}

#[test]
fn the_python_client_reads_every_byte_from_the_receiver_binary_and_a_killed_one_releases() {
    let dir = TempDir::new("kvferry-attach");
    let shm = dir.0.join("buf");
    let (mut recv, endpoint) = spawn_receiver_binary(&dir.sock(), &shm);
    let s = sender(sender_cfg(8, None));
    let mut py = python_decoder(&dir.sock(), "py-1", 3, 123, "release");
    py.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-1", 3, 123);
    py.expect_line("ATTACH:ok");
    py.wait_success("python decoder");
    // A Python holder takes all 4 slots and is SIGKILLed; a second request
    // of 4 chunks is delivered only if its slots came back.
    let mut holder = python_decoder(&dir.sock(), "py-held", 4, 10, "hold");
    holder.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-held", 4, 10);
    holder.expect_line("ATTACH:holding");
    holder.sigkill();
    let mut py2 = python_decoder(&dir.sock(), "py-2", 4, CHUNK as usize, "release");
    py2.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-2", 4, CHUNK as usize);
    py2.expect_line("ATTACH:ok");
    py2.wait_success("python decoder after the kill");
    // A Python wildcard subscriber gets a request nobody subscribed to,
    // with its req_id.
    let mut wild = python_decoder(&dir.sock(), "*", 2, 55, "release");
    wild.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-wild", 2, 55);
    wild.expect_line("ATTACH:got py-wild");
    wild.expect_line("ATTACH:ok");
    wild.wait_success("python wildcard decoder");
    recv.sigkill();
}

/// A decoder process that scribbles on its own rings' indices
/// (`clients/python/ring_abuse_check.py`: a submission tail behind the
/// session's head or more than a ring ahead, a completion head ahead of
/// the session's tail or more than a ring behind) harms only itself: its
/// session reads no submission and writes no completion past them, serves
/// it again, losing no answer, once they are sane, and never panics (a
/// debug build did, on the completion ring's free-room arithmetic). With
/// one attachment allowed, a decoder attaching after it left is served.
#[test]
fn a_decoder_scribbling_on_its_ring_indices_harms_only_itself() {
    let dir = TempDir::new("kvferry-attach");
    let shm = dir.0.join("buf");
    let log_path = dir.0.join("receiver.stderr");
    let log = std::fs::File::create(&log_path).expect("the receiver's stderr file");
    let (mut recv, endpoint) = spawn_receiver_binary_with(
        &dir.sock(),
        &shm,
        &["--attach-max-clients", "1"],
        Stdio::from(log),
    );
    let receiver_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let sock = dir.sock();
    let mut abuser =
        process::python_client("ring_abuse_check.py", &["decoder", sock.to_str().unwrap()]);
    abuser.expect_line("ATTACH:ok");
    abuser.wait_success("the decoder scribbling on its ring indices");
    let pid = recv.child.id();
    wait_for("the scribbling decoder's session to end", || {
        process::attach_sessions(pid) == 0
    });
    // Its place is back: the one attachment allowed goes to the next one.
    let s = sender(sender_cfg(8, None));
    let mut py = python_decoder(&dir.sock(), "after-scribbling", 2, 77, "release");
    py.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "after-scribbling", 2, 77);
    py.expect_line("ATTACH:ok");
    py.wait_success("the decoder attached after the scribbling one");
    assert!(
        recv.child
            .try_wait()
            .expect("the receiver's status")
            .is_none(),
        "the receiver exited:\n{}",
        receiver_log()
    );
    process::assert_no_panic_logged(&log_path, "the receiver");
}

#[test]
fn the_daemon_replaces_a_stale_socket_but_never_a_live_one_or_a_file() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    // A regular file at the path: refused, left alone.
    std::fs::write(dir.sock(), b"precious").unwrap();
    assert!(DecoderDaemon::start(Arc::clone(&r), AttachConfig::new(dir.sock())).is_err());
    assert_eq!(std::fs::read(dir.sock()).unwrap(), b"precious");
    std::fs::remove_file(dir.sock()).unwrap();
    // A stale socket (nobody listens): replaced.
    drop(std::os::unix::net::UnixListener::bind(dir.sock()).unwrap());
    let d = daemon(&r, &dir.sock(), |_| {});
    // A live daemon's socket: refused, and the live one still serves.
    assert!(DecoderDaemon::start(Arc::clone(&r), AttachConfig::new(dir.sock())).is_err());
    let _c = connect(&dir.sock());
    wait_for("the live daemon's session", || d.clients() == 1);
}

/// Waits until `c`'s earlier submissions are handled: the daemon handles
/// them in order, so once a RELEASE of an unknown tag is refused they are.
fn fence(c: &mut DecoderClient) {
    c.submit_raw(DecoderSubmit::release(0xFEED)).unwrap();
    match next(c, "the fence") {
        Event::Refused {
            tag: 0xFEED,
            reason: Some(Refusal::UnknownTag),
            ..
        } => {}
        other => panic!("expected the fence's refusal, got {other:?}"),
    }
}

#[test]
fn wildcard_subscribers_share_the_requests_no_req_id_subscription_claims() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |c| c.max_outstanding = 2);
    let s = sender(sender_cfg(8, None));
    let mut exp = connect(&dir.sock());
    let mut wilds = [connect(&dir.sock()), connect(&dir.sock())];
    let te = exp.subscribe("exp-1").unwrap();
    let mut wtags = Vec::new();
    for w in &mut wilds {
        wtags.push(w.subscribe_all().unwrap());
        // One wildcard per client.
        assert!(w.subscribe_all().is_err());
        fence(w);
    }
    wait_for("the req_id subscription", || d.subscriptions() == 1);
    store(&s, r.endpoint(), "exp-1", 2, 10);
    for id in ["w-1", "w-2", "w-3"] {
        store(&s, r.endpoint(), id, 1, 20);
    }
    // The req_id subscription wins over the wildcards.
    match next(&mut exp, "exp-1") {
        Event::Ready(del) => {
            assert_eq!(del.tag(), te);
            verify(&exp, &del, 2, 10);
            exp.release(del).unwrap();
        }
        other => panic!("expected READY for exp-1, got {other:?}"),
    }
    // The other three go to the wildcards, each to exactly one.
    let mut got: Vec<(usize, kvferry::attach::Delivery)> = Vec::new();
    let end = deadline();
    while got.len() < 3 {
        assert!(
            Instant::now() < end,
            "wildcard deliveries: only {}",
            got.len()
        );
        for (i, w) in wilds.iter_mut().enumerate() {
            match w.next_event(Instant::now() + Duration::from_millis(20)) {
                Ok(Event::Ready(del)) => {
                    assert_ne!(del.tag() & DAEMON_TAG, 0, "a daemon tag");
                    verify(w, &del, 1, 20);
                    got.push((i, del));
                }
                Err(AttachError::Timeout) => {}
                other => panic!("expected a wildcard READY, got {other:?}"),
            }
        }
    }
    let mut ids: Vec<&str> = got.iter().map(|(_, d)| d.req_id()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["w-1", "w-2", "w-3"]);
    // A req_id subscription to a request a wildcard holds is refused.
    exp.subscribe(got[0].1.req_id()).unwrap();
    match next(&mut exp, "a subscription to a delivered request") {
        Event::Refused {
            reason: Some(Refusal::AlreadySubscribed),
            ..
        } => {}
        other => panic!("expected AlreadySubscribed, got {other:?}"),
    }
    for (i, del) in got {
        wilds[i].release(del).unwrap();
    }
    wait_for("the wildcard deliveries released", || allocated(&r) == 0);
    // With no wildcard left (one unsubscribed, one client gone), a request
    // nobody subscribed to stays in the receiver for in-process consumers.
    let [mut w0, w1] = wilds;
    w0.unsubscribe(wtags[0]).unwrap();
    fence(&mut w0);
    drop(w1);
    wait_for("the second wildcard's session to end", || d.clients() == 2);
    store(&s, r.endpoint(), "orphan", 1, 30);
    r.wait_ready("orphan", deadline()).expect("orphan ready");
    let chunks = r.take("orphan").expect("nobody took the orphan");
    assert_eq!(chunks.len(), 1);
    assert!(matches!(
        w0.next_event(Instant::now() + Duration::from_millis(50)),
        Err(AttachError::Timeout)
    ));
}

#[test]
fn the_ready_feed_is_bounded_and_lists_ready_requests_in_order() {
    let r = receiver(8);
    let s = sender(sender_cfg(8, None));
    let feed = r.ready_feed(2).unwrap();
    for id in ["f-1", "f-2", "f-3"] {
        store(&s, r.endpoint(), id, 1, 5);
        r.wait_ready(id, deadline()).unwrap();
    }
    assert_eq!(feed.pop().as_deref(), Some("f-1"));
    assert_eq!(feed.pop().as_deref(), Some("f-2"));
    assert_eq!(feed.pop(), None, "the third did not fit");
    assert_eq!(feed.dropped(), 1);
    // Not taken by the feed: still there by id.
    assert_eq!(r.take("f-3").unwrap().len(), 1);
}

/// The submission doorbell never loses a wake-up (docs/attach.md,
/// "Doorbell"): the session lingers a few µs after handling work, then
/// arms need-wakeup and sleeps in poll(2), and the client writes the socket
/// byte only if it saw the flag. Submissions spaced from none to 2 ms apart
/// land in every phase of that (lingering, arming, asleep); each must be
/// answered (a RELEASE of an unknown tag: REFUSED). A lost wake-up leaves a
/// submission unread and `next` fails at its deadline naming it.
#[test]
fn submissions_after_the_session_went_to_sleep_are_always_served() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let mut c = connect(&dir.sock());
    for i in 0..13 * 30u64 {
        // 0, 1, 2, 4, .. 1024 µs and 2 ms, then again: a fixed pattern.
        let pause = match i % 13 {
            0 => 0,
            12 => 2000,
            k => 1 << (k - 1),
        };
        thread::sleep(Duration::from_micros(pause));
        let tag = 10_000 + i;
        c.submit_raw(DecoderSubmit::release(tag)).unwrap();
        match next(
            &mut c,
            &format!("submission {i} after {pause} µs (a lost wake-up?)"),
        ) {
            Event::Refused {
                tag: t,
                reason: Some(Refusal::UnknownTag),
                ..
            } => assert_eq!(t, tag),
            other => panic!("expected UnknownTag for {tag}, got {other:?}"),
        }
    }
}

/// The same for the Python client, which fences through libc
/// (`clients/python/wake_check.py`): it writes the socket byte only when
/// the session armed need-wakeup, and its completion wait runs with the
/// futex backstop off, so a wake-up lost on either ring hangs the script
/// and it fails at its deadline naming the submission. Then its wait's
/// linger: adapted as the Rust clients' is, and bounded (a wait answered
/// 0.3 s later sleeps after it, spending little CPU).
#[test]
fn the_python_client_loses_no_wake_up_on_either_ring() {
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let mut child = ChildProc::spawn(
        Command::new("python3")
            .arg(py.join("wake_check.py"))
            .arg(dir.sock())
            .env("PYTHONPATH", &py),
    );
    child.expect_line("WAKE OK");
    child.wait_success("clients/python/wake_check.py");
}

#[test]
fn the_python_client_refuses_a_hello_without_exactly_its_descriptors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let mut py = ChildProc::spawn(
        Command::new("python3")
            .arg(dir.join("handoff_check.py"))
            .env("PYTHONPATH", &dir),
    );
    py.expect_line("HANDOFF OK");
    py.wait_success("clients/python/handoff_check.py");
}

/// The thread of session `id` (named `attach-<id>`) in this process, once
/// it runs.
fn session_tid(id: u32) -> libc::pid_t {
    let name = format!("attach-{id}");
    let mut found = None;
    wait_for(&format!("session thread {name}"), || {
        found = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(Result::ok)
            .find(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name)
            })
            .and_then(|t| t.file_name().to_str()?.parse().ok());
        found.is_some()
    });
    found.unwrap()
}

/// Lets thread `tid` run on `cpus` only.
fn run_on(tid: libc::pid_t, cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET stays inside it
    // (allowed CPUs are below CPU_SETSIZE); sched_setaffinity reads it.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    assert!(ok, "sched_setaffinity({tid}, {cpus:?})");
}

/// The CPU thread `tid` last ran on (`/proc/self/task/<tid>/stat`, field 39).
fn last_cpu(tid: libc::pid_t) -> usize {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    // After the command name's closing parenthesis: field 3 on.
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(36).unwrap().parse().unwrap()
}

/// `n` hand-offs each way: a RELEASE of an unknown tag, answered REFUSED.
fn refused_round_trips(c: &mut DecoderClient, n: u64) {
    for i in 0..n {
        let tag = 50_000 + i;
        c.submit_raw(DecoderSubmit::release(tag)).unwrap();
        match next(c, &format!("the refusal of round trip {i}")) {
            Event::Refused { tag: t, .. } => assert_eq!(t, tag),
            other => panic!("expected REFUSED for {tag}, got {other:?}"),
        }
    }
}

/// A session that hands work back and forth with its client on the
/// client's CPU moves to another CPU of its set (docs/attach.md, "Placing
/// the threads"); one confined to that CPU stays. Run in a child process
/// of its own, where the session threads are this test's only ones.
#[test]
fn a_session_sharing_its_clients_cpu_moves_off_it_unless_confined_there() {
    const TEST: &str = "a_session_sharing_its_clients_cpu_moves_off_it_unless_confined_there";
    if std::env::var(ROLE).is_err() {
        let mut child = ChildProc::spawn(rerun_alone(TEST).env(ROLE, "step-off"));
        child.expect_line("ATTACH:done");
        child.wait_success("the step-off child");
        return;
    }
    let [a, b, ..] = kvferry::threads::allowed_cpus() else {
        println!("skipped: one CPU, nowhere to move to. ATTACH:done");
        return;
    };
    let (a, b) = (*a, *b);
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let d = daemon(&r, &dir.sock(), |_| {});
    // The client: this thread, on CPU a.
    kvferry::threads::pin_current(a).unwrap();

    let mut confined = connect(&dir.sock());
    let s1 = session_tid(confined.hello().client_id);
    run_on(s1, &[a]);
    refused_round_trips(&mut confined, 400);
    assert_eq!(d.stepped_off(), 0, "a session confined to one CPU moved");
    assert_eq!(last_cpu(s1), a);
    drop(confined);

    // Up to five tries: on a loaded machine the load balancer may move the
    // session before it sees it shares the CPU (then it has nothing to do).
    // A fresh session each time: one whose shared spell ended while it was
    // confined below waits out RETRY_AFTER spells before it asks again.
    let moved = (0..5).any(|_| {
        let mut free = connect(&dir.sock());
        let s2 = session_tid(free.hello().client_id);
        // On the client's CPU and awake (lingering after these: fewer
        // hand-offs than a shared spell), then free.
        run_on(s2, &[a]);
        refused_round_trips(&mut free, 4);
        let before = d.stepped_off();
        run_on(s2, &[a, b]);
        refused_round_trips(&mut free, 400);
        // A move is counted only when the kernel took the session off the
        // CPU it ran on, its client's (where it stays until its next
        // wake-up places it: not asserted, a loaded scheduler may put it
        // back).
        d.stepped_off() > before
    });
    assert!(
        moved,
        "five times 400 round trips on its client's CPU, and the session never moved off it"
    );
    println!("ATTACH:done");
}

/// Subscribes to `req_id` of `n` full chunks, checks every byte, releases it.
fn deliver_and_verify(c: &mut DecoderClient, req_id: &str, n: usize) {
    c.subscribe(req_id).unwrap();
    match next(c, req_id) {
        Event::Ready(d) => {
            verify(c, &d, n, CHUNK as usize);
            c.release(d).unwrap();
        }
        other => panic!("expected READY for {req_id}, got {other:?}"),
    }
}

/// An attachment's rings and the client's view of the receive buffer are
/// mapped with their page tables filled (docs/attach.md, "Mapping"): a
/// freshly attached decoder's first pass over both rings, and its first
/// read of every slot, take no page fault on either side (without it: one
/// per 4 KiB of submissions on the client's side and of completions on the
/// session's, several µs each on a VM, in the middle of round trips). Run
/// in a child process of its own, where the session thread is this test's
/// only one.
#[test]
fn a_fresh_attachment_takes_no_page_fault_on_its_rings_or_slots() {
    const TEST: &str = "a_fresh_attachment_takes_no_page_fault_on_its_rings_or_slots";
    if std::env::var(ROLE).is_err() {
        let mut child = ChildProc::spawn(rerun_alone(TEST).env(ROLE, "fresh"));
        child.expect_line("ATTACH:done");
        child.wait_success("the fresh-attachment child");
        return;
    }
    // 1 MiB: 256 pages, read 16 to a fault without the filled page tables
    // (the kernel's fault-around for a page already in memory).
    const SLOTS: usize = 256;
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(SLOTS));
    let _d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(SLOTS, None));
    let mut c = connect(&dir.sock());
    let session = session_tid(c.hello().client_id);
    // Warm up the code paths, the heap and the stacks of both threads.
    refused_round_trips(&mut c, 4);
    store(&s, r.endpoint(), "warm", 1, CHUNK as usize);
    deliver_and_verify(&mut c, "warm", 1);
    wait_for("the warm-up slot back", || allocated(&r) == 0);
    // Every slot filled (the sender's copies and the test's buffers are
    // this thread's too: done before counting).
    for i in 0..SLOTS / 8 {
        store(&s, r.endpoint(), &format!("fill-{i}"), 8, CHUNK as usize);
    }
    let (client_before, session_before) = (thread_faults(0), thread_faults(session));
    // Every completion entry of the ring (and its submission ring many
    // times over) written and read once.
    let cq_entries = AttachConfig::new(dir.sock()).cq_capacity as u64;
    refused_round_trips(&mut c, cq_entries + 8);
    // Every slot of the receive buffer read through the client's mapping.
    for i in 0..SLOTS / 8 {
        deliver_and_verify(&mut c, &format!("fill-{i}"), 8);
    }
    let client = thread_faults(0) - client_before;
    let session = thread_faults(session) - session_before;
    eprintln!("page faults after the warm-up: client {client}, session {session}");
    // A little slack for either heap growing a page (the session allocates
    // per delivery; 2-3 faults seen in debug builds): without the filled
    // page tables the counts are about 56 in the client and 42 in the
    // session, and 16 in the client for the receive buffer alone.
    assert!(
        client <= 2 && session <= 8,
        "page faults on a fresh attachment's rings and slots: {client} in the client, \
         {session} in its session (each side should have its pages mapped up front)"
    );
    println!("ATTACH:done");
}

/// A subscription dropped while its READY is already on the completion
/// ring (the session takes a complete request at once and posts it): the
/// client skips that READY, its next event is what came after it, and the
/// request's slots are back (the daemon released it on the unsubscribe).
/// The client used to fail there with "READY for a tag not subscribed",
/// as the random decoder's test found. Without the pause the unsubscribe
/// may overtake the READY instead; the outcome must be the same.
#[test]
fn a_delivery_that_crossed_an_unsubscribe_is_skipped_and_its_slots_return() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(8));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = sender(sender_cfg(8, None));
    let mut c = connect(&dir.sock());
    for pause in [true, false] {
        let req = unique("crossed");
        store(&s, r.endpoint(), &req, 2, 100);
        r.wait_ready(&req, deadline())
            .expect("ready at the receiver");
        let tag = c.subscribe(&req).unwrap();
        if pause {
            // Long enough for the session to have posted the READY.
            thread::sleep(Duration::from_millis(100));
        }
        c.unsubscribe(tag).unwrap();
        c.submit_raw(DecoderSubmit::release(0xFE11CE)).unwrap();
        match next(&mut c, "the fence after the unsubscribe") {
            Event::Refused { tag: t, .. } => assert_eq!(t, 0xFE11CE),
            other => panic!("pause {pause}: expected the fence's REFUSED, got {other:?}"),
        }
        wait_for("the crossed delivery's slots", || allocated(&r) == 0);
        assert_eq!(d.subscriptions(), 0);
    }
}

/// A release that finds the submission ring full is not lost: the
/// session stops reading submissions while its completion ring and outbox
/// are full (this client reads no events), and `release` of a held
/// delivery then still succeeds; the RELEASE goes out once the client
/// reads its events, and the slots come back while it stays attached. The
/// client used to return `Full` there, having consumed the delivery, so
/// its slots stayed held until it detached.
#[test]
fn a_release_that_finds_the_submission_ring_full_goes_out_later() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(8));
    let _d = daemon(&r, &dir.sock(), |cfg| {
        cfg.sq_capacity = 16;
        cfg.cq_capacity = 64;
    });
    let s = sender(sender_cfg(8, None));
    let req = unique("full-release");
    store(&s, r.endpoint(), &req, 2, 100);
    let mut c = connect(&dir.sock());
    let tag = c.subscribe(&req).unwrap();
    let d = match next(&mut c, "the delivery") {
        Event::Ready(d) => d,
        other => panic!("expected READY, got {other:?}"),
    };
    assert_eq!((d.tag(), allocated(&r)), (tag, 2));
    // RELEASEs of unknown tags, their REFUSED answers unread, until the
    // ring stays full (the session stopped reading it).
    let mut sent = 0u64;
    let mut full_since: Option<Instant> = None;
    let end = deadline();
    while full_since.is_none_or(|t| t.elapsed() < Duration::from_millis(200)) {
        assert!(
            Instant::now() < end,
            "the submission ring never stayed full"
        );
        match c.submit_raw(DecoderSubmit::release(1 << 40 | sent)) {
            Ok(()) => {
                sent += 1;
                full_since = None;
            }
            Err(AttachError::Full) => {
                full_since.get_or_insert_with(Instant::now);
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("submission failed: {e}"),
        }
    }
    c.release(d)
        .expect("a release finding the ring full is kept, not refused");
    for i in 0..sent {
        match next(&mut c, "the REFUSED answers") {
            Event::Refused { tag, .. } => assert_eq!(tag, 1 << 40 | i),
            other => panic!("expected REFUSED {i}, got {other:?}"),
        }
    }
    wait_for("the released slots, the client still attached", || {
        allocated(&r) == 0
    });
}

/// The Python client skips a READY that crossed the release of its
/// subscription too (`decoder_check.py` mode `crossed`: it releases once
/// the READY is on the ring, unread); it used to return it with no req_id,
/// pointing at slots the daemon had already given back. The receiver
/// binary's buffer is then free for a request of all its slots.
#[test]
fn the_python_client_skips_a_delivery_that_crossed_its_release() {
    let dir = TempDir::new("kvferry-attach");
    let shm = dir.0.join("buf");
    let (_recv, endpoint) = spawn_receiver_binary(&dir.sock(), &shm);
    let s = sender(sender_cfg(8, None));
    let mut py = python_decoder(&dir.sock(), "py-crossed", 2, 50, "crossed");
    py.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-crossed", 2, 50);
    py.expect_line("ATTACH:ok");
    py.wait_success("the python decoder whose READY crossed its release");
    // All 4 slots: delivered only if the crossed request's came back.
    let mut py = python_decoder(&dir.sock(), "py-after", 4, CHUNK as usize, "release");
    py.expect_line("ATTACH:subscribed");
    store_for_python(&s, &endpoint, "py-after", 4, CHUNK as usize);
    py.expect_line("ATTACH:ok");
    py.wait_success("the python decoder after it");
}

/// A thread writing requests `{prefix}-{i}` of `1 + i % 3` chunks (the
/// last one 100 bytes) into a receiver, one at a time, each ready before
/// the next (the buffer's slots, not the sender's pending area, bound what
/// waits for the decoders), until stopped; dropping it stops and joins it,
/// so it ends however the test does (a failed assertion included).
struct Writer {
    /// Its requests are `{prefix}-{i}`.
    prefix: String,
    /// The requests written so far: `(req_id, chunks)`.
    written: Arc<std::sync::Mutex<Vec<(String, usize)>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Writer {
    fn start(s: &Arc<Sender>, r: &Arc<Receiver>, prefix: &str) -> Self {
        use std::sync::atomic::Ordering;
        let written: Arc<std::sync::Mutex<Vec<(String, usize)>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, r, w, halt, pre) = (
            Arc::clone(s),
            Arc::clone(r),
            Arc::clone(&written),
            Arc::clone(&stop),
            prefix.to_owned(),
        );
        let thread = thread::spawn(move || {
            let mut i = 0;
            // Relaxed: a stop flag; what was written is under the mutex.
            while !halt.load(Ordering::Relaxed) {
                let req = format!("{pre}-{i}");
                let n = 1 + i % 3;
                let spec = TransferSpec::new(&req, r.endpoint(), n, true);
                let keys: Vec<String> = (0..n).map(|k| format!("{req}/{k:03}")).collect();
                let bufs: Vec<Vec<u8>> = (0..n).map(|k| chunk(&req, k, n, 100)).collect();
                let chunks: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                if s.store(&spec, &keys, &chunks).is_ok() {
                    w.lock().unwrap().push((req.clone(), n));
                    // Relaxed: as above.
                    while !halt.load(Ordering::Relaxed)
                        && r.wait_ready(&req, Instant::now() + Duration::from_millis(20))
                            .is_err()
                    {}
                }
                i += 1;
            }
        });
        Self {
            prefix: prefix.to_owned(),
            written,
            stop,
            thread: Some(thread),
        }
    }

    /// The id of its request number `i`.
    fn id(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// Requests written so far.
    fn count(&self) -> usize {
        self.written.lock().unwrap().len()
    }

    /// Asks the thread to stop (it ends once its current store returns).
    fn stop(&self) {
        // Relaxed: see the thread.
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
        if thread::panicking() {
            // A test failing already: the thread ends by itself once its
            // store returns, with nobody waiting for it.
            return;
        }
        if let Some(t) = self.thread.take() {
            // Bounded: its store waits at most the sender's timeouts, and
            // its wait for readiness checks the flag every 20 ms.
            assert!(t.join().is_ok(), "the writer thread panicked");
        }
    }
}

impl Writer {
    /// Stops the writer and hands every request it wrote that is not in
    /// `taken` to a new decoder on `sock`, by req_id (a wildcard gets only
    /// requests that become ready while it stands), until the writer has
    /// ended (its last store waits for room in the buffer): each is
    /// delivered and checked byte for byte, or refused as consumed
    /// (`TakeRefused`), which only a request `may_be_consumed` allows.
    /// Each goes into `taken`.
    fn deliver_the_rest(
        &self,
        sock: &Path,
        taken: &mut HashSet<String>,
        may_be_consumed: impl Fn(&str) -> bool,
    ) {
        self.stop();
        let mut c = connect(sock);
        let end = deadline();
        loop {
            let left: Vec<(String, usize)> = {
                let w = self.written.lock().unwrap();
                w.iter()
                    .filter(|(q, _)| !taken.contains(q))
                    .cloned()
                    .collect()
            };
            for (req, n) in left {
                let tag = c.subscribe(&req).expect("subscribes");
                match next(&mut c, "a request the decoders left") {
                    Event::Ready(dl) => {
                        assert_eq!(dl.tag(), tag);
                        verify(&c, &dl, n, 100);
                        c.release(dl).unwrap();
                    }
                    Event::Refused {
                        reason: Some(Refusal::TakeRefused),
                        ..
                    } if may_be_consumed(&req) => {}
                    other => panic!("{req}: expected READY, got {other:?}"),
                }
                taken.insert(req);
            }
            if self.is_finished() && self.count() == taken.len() {
                return;
            }
            assert!(
                Instant::now() < end,
                "the writer never finished ({} of {} requests taken)",
                taken.len(),
                self.count()
            );
            thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Checks that every session of `d` ended (`who` decoders' detached), with
/// no subscription left and no session thread panicking since the count
/// was `panics_before`.
fn sessions_ended_clean(d: &DecoderDaemon, panics_before: usize, who: &str) {
    wait_for(&format!("{who} sessions to end"), || d.clients() == 0);
    assert_eq!(
        d.subscriptions(),
        0,
        "subscriptions left after {who} sessions ended"
    );
    assert_eq!(
        process::attach_session_panics(),
        panics_before,
        "a session thread panicked"
    );
}

/// The Python decoder taking 3000 random steps against the receiver
/// binary (`clients/python/decoder_fuzz.py`: subscriptions of written,
/// taken and unknown requests, releases of deliveries and of waiting
/// subscriptions, a wildcard, RELEASEs of unknown tags), 200 one-chunk
/// requests written meanwhile: every delivery checked byte for byte,
/// every event of a tag in play, each request delivered once, and every
/// one accounted for at the end (delivered, or consumed unseen by a
/// release that crossed its READY); the receiver never panics.
/// `KVFERRY_FUZZ_SEED` picks another sequence.
#[test]
fn random_steps_of_the_python_decoder_against_the_receiver_binary() {
    let dir = TempDir::new("kvferry-attach");
    let shm = dir.0.join("buf");
    let log_path = dir.0.join("receiver.stderr");
    let log = std::fs::File::create(&log_path).expect("the receiver's stderr file");
    let (_recv, endpoint) = spawn_receiver_binary_with(&dir.sock(), &shm, &[], Stdio::from(log));
    let s = sender(sender_cfg(8, None));
    let prefix = format!("pyfz{}", std::process::id());
    const N: usize = 200;
    for i in 0..N {
        store_for_python(&s, &endpoint, &format!("{prefix}-{i}"), 1, 100);
    }
    let seed = process::fuzz_seed().to_string();
    let sock = dir.sock();
    let mut py = process::python_client(
        "decoder_fuzz.py",
        &[sock.to_str().unwrap(), &prefix, &N.to_string(), &seed],
    );
    py.expect_line(&format!("FUZZ:ok accounted={N} "));
    py.wait_success("the python decoder's random steps");
    process::assert_no_panic_logged(&log_path, "the receiver");
}

/// A decoder taking 3000 random steps while a sender keeps writing
/// requests of 1-3 chunks: valid ones on its own live state (SUBSCRIBEs of
/// written, future, taken and unknown req_ids; a wildcard now and then;
/// every delivery checked byte for byte, then released, or held a while;
/// UNSUBSCRIBEs of waiting tags) mixed with raw entries the session must
/// refuse (RELEASEs of unknown tags, SUBSCRIBEs of daemon tags or of
/// req_ids empty, too long or not UTF-8, unknown ops). The Rust client's
/// check of every event passes, no session thread panics, and once it
/// detaches every request it did not take is delivered whole to the next
/// decoder and the receive buffer ends empty. `KVFERRY_FUZZ_SEED` picks
/// another sequence.
#[test]
fn random_steps_of_a_decoder_never_break_its_session() {
    use kvferry::attach::layout::{MAX_REQ_ID, OP_RELEASE, OP_SUBSCRIBE};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let panics_before = process::attach_session_panics();
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = Arc::new(sender(sender_cfg(8, None)));
    let prefix = format!("fz{}", std::process::id());
    let writer = Writer::start(&s, &r, &prefix);
    let written = Arc::clone(&writer.written);
    wait_for("the writer's first requests", || writer.count() >= 4);
    let mut c = connect(&dir.sock());
    let mut rng = SmallRng::seed_from_u64(process::fuzz_seed());
    let n_of = |req: &str| -> usize {
        let i: usize = req.rsplit('-').next().unwrap().parse().unwrap();
        1 + i % 3
    };
    let mut waiting: Vec<u64> = Vec::new();
    let mut held: Vec<kvferry::attach::Delivery> = Vec::new();
    let mut taken: HashSet<String> = HashSet::new();
    // Every req_id it subscribed to: one it unsubscribed once the session
    // had taken it (READY not posted yet) is released unseen, as docs/
    // attach.md says of a RELEASE racing its delivery.
    let mut subscribed: HashSet<String> = HashSet::new();
    let mut wild: Option<u64> = None;
    let mut raw_tag = 1u64 << 40;
    let mut backlog = std::collections::VecDeque::new();
    let (mut ready, mut refused) = (0, 0);
    for step in 0..3000 {
        match rng.random_range(0..12) {
            0..=3 => {
                let w = written.lock().unwrap().len();
                let req = match rng.random_range(0..6) {
                    // Written and not taken yet (most often: deliveries).
                    0..=2 => {
                        let pool: Vec<String> = written
                            .lock()
                            .unwrap()
                            .iter()
                            .filter(|(q, _)| !taken.contains(q))
                            .map(|(q, _)| q.clone())
                            .collect();
                        if pool.is_empty() {
                            format!("{prefix}-{w}")
                        } else {
                            pool[rng.random_range(0..pool.len())].clone()
                        }
                    }
                    // Not written yet: waits, then is delivered.
                    3 => format!("{prefix}-{}", w + rng.random_range(0..3)),
                    // Taken already, or never written: waits for nothing.
                    4 => taken
                        .iter()
                        .next()
                        .cloned()
                        .unwrap_or_else(|| format!("{prefix}-x")),
                    _ => format!("{prefix}-{}", rng.random_range(1 << 20..1 << 21)),
                };
                if let Ok(tag) = c.subscribe(&req) {
                    waiting.push(tag);
                    subscribed.insert(req);
                }
            }
            4 if wild.is_none() && rng.random_bool(0.2) => {
                wild = c.subscribe_all().ok();
            }
            4 => {
                if let Some(tag) = wild.take() {
                    let _ = c.unsubscribe(tag);
                }
            }
            5 | 6 if !held.is_empty() => {
                let d = held.swap_remove(rng.random_range(0..held.len()));
                c.release(d).expect("release of a held delivery");
            }
            7 | 8 if !waiting.is_empty() => {
                let tag = waiting.swap_remove(rng.random_range(0..waiting.len()));
                let _ = c.unsubscribe(tag);
            }
            _ => {
                raw_tag += 1;
                let sub = match rng.random_range(0..5) {
                    0 => DecoderSubmit::release(raw_tag),
                    // A daemon tag: never the client's.
                    1 => DecoderSubmit::subscribe(DAEMON_TAG | raw_tag, "fz-x").unwrap(),
                    2 => {
                        let mut e = DecoderSubmit::subscribe(raw_tag, "x").unwrap();
                        e.req_id_len = [0, MAX_REQ_ID as u32 + 1, u32::MAX][rng.random_range(0..3)];
                        e
                    }
                    3 => {
                        let mut e = DecoderSubmit::subscribe(raw_tag, "xx").unwrap();
                        e.req_id[..2].copy_from_slice(&[0xff, 0xfe]);
                        e
                    }
                    _ => {
                        let mut e = DecoderSubmit::release(raw_tag);
                        e.op = [0, OP_SUBSCRIBE + 100, OP_RELEASE + 7, u32::MAX]
                            [rng.random_range(0..4)];
                        e
                    }
                };
                // A full ring (the session has not run for a while on a
                // busy machine) is waited out; one that stays full is a
                // hang.
                // Events are read meanwhile (kept for the drain below): a
                // session whose completion ring is full reads no more.
                let end = deadline();
                while let Err(e) = c.submit_raw(sub) {
                    assert!(
                        Instant::now() < end,
                        "step {step}: the submission ring stayed full: {e} (subscriptions {}, held {}, waiting {})",
                        d.subscriptions(),
                        held.len(),
                        waiting.len()
                    );
                    match c.next_event(Instant::now() + Duration::from_millis(1)) {
                        Ok(ev) => backlog.push_back(ev),
                        Err(AttachError::Timeout) => {}
                        Err(e) => panic!("step {step}: the client's check of an event failed: {e}"),
                    }
                }
            }
        }
        loop {
            let ev = match backlog.pop_front() {
                Some(ev) => Ok(ev),
                None => c.next_event(Instant::now() + Duration::from_micros(50)),
            };
            match ev {
                Ok(Event::Ready(dl)) => {
                    ready += 1;
                    let n = n_of(dl.req_id());
                    verify(&c, &dl, n, 100);
                    taken.insert(dl.req_id().to_owned());
                    waiting.retain(|t| *t != dl.tag());
                    held.push(dl);
                    if held.len() > 6 {
                        let dl = held.remove(0);
                        c.release(dl).expect("release");
                    }
                }
                Ok(Event::Failed { tag, .. }) => waiting.retain(|t| *t != tag),
                Ok(Event::Refused { tag, .. }) => {
                    refused += 1;
                    waiting.retain(|t| *t != tag);
                }
                Err(AttachError::Timeout) => break,
                Err(e) => panic!("step {step}: the client's check of an event failed: {e}"),
            }
        }
    }
    assert!(
        ready > 0 && refused > 0,
        "the steps did little: {ready} ready, {refused} refused, {} written",
        written.lock().unwrap().len()
    );
    drop(held);
    drop(c);
    writer.stop();
    sessions_ended_clean(&d, panics_before, "the fuzzing decoder's");
    // A request consumed unseen must be one it subscribed to: one it
    // unsubscribed once the session had taken it.
    writer.deliver_the_rest(&dir.sock(), &mut taken, |req| subscribed.contains(req));
    wait_for("the receive buffer to empty", || allocated(&r) == 0);
}

/// Decoder `w` of [`concurrent_random_decoders_never_share_nor_lose_a_delivery`]:
/// `steps` random valid steps on one receiver daemon, racing the other
/// decoders for the same requests: SUBSCRIBEs of written requests not
/// delivered yet (often one another decoder holds) and of the next ones,
/// a wildcard (decoder 0), releases now or later, UNSUBSCRIBEs of waiting
/// tags, and now and then a detach with deliveries held and subscriptions
/// waiting, then a fresh attachment. Every delivery is checked byte for
/// byte and recorded in `delivered`, where it must be new. Returns its
/// deliveries.
fn random_decoder(
    sock: &Path,
    writer: &Writer,
    delivered: &std::sync::Mutex<HashSet<String>>,
    w: u64,
    steps: usize,
) -> usize {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(process::fuzz_seed() ^ (w << 32));
    let n_of = |req: &str| -> usize {
        let i: usize = req.rsplit('-').next().unwrap().parse().unwrap();
        1 + i % 3
    };
    let mut c = connect(sock);
    let mut waiting: Vec<u64> = Vec::new();
    let mut held: Vec<kvferry::attach::Delivery> = Vec::new();
    let mut wild: Option<u64> = None;
    // Tags this decoder unsubscribed: a refusal of one may follow.
    let mut let_go = std::collections::HashSet::new();
    let mut ready = 0;
    for step in 0..steps {
        match rng.random_range(0..10) {
            0..=3 => {
                // Written and not delivered yet, or one of the next ones.
                let (pool, count) = {
                    let w = writer.written.lock().unwrap();
                    let d = delivered.lock().unwrap();
                    let pool: Vec<String> = w
                        .iter()
                        .map(|(q, _)| q)
                        .filter(|q| !d.contains(*q))
                        .cloned()
                        .collect();
                    (pool, w.len())
                };
                let req = if !pool.is_empty() && rng.random_bool(0.8) {
                    pool[rng.random_range(0..pool.len())].clone()
                } else {
                    writer.id(count + rng.random_range(0..3))
                };
                if let Ok(tag) = c.subscribe(&req) {
                    waiting.push(tag);
                }
            }
            4 if w == 0 => match wild.take() {
                Some(tag) => c.unsubscribe(tag).expect("unsubscribe of the wildcard"),
                None => wild = Some(c.subscribe_all().expect("wildcard")),
            },
            5 | 6 if !held.is_empty() => {
                let d = held.swap_remove(rng.random_range(0..held.len()));
                c.release(d).expect("release of a held delivery");
            }
            7 if !waiting.is_empty() => {
                let tag = waiting.swap_remove(rng.random_range(0..waiting.len()));
                c.unsubscribe(tag).expect("unsubscribe of a waiting tag");
                let_go.insert(tag);
            }
            8 if rng.random_bool(0.05) => {
                // Gone with deliveries held and subscriptions waiting.
                held.clear();
                waiting.clear();
                let_go.clear();
                wild = None;
                c = connect(sock);
            }
            _ => {}
        }
        loop {
            match c.next_event(Instant::now() + Duration::from_micros(50)) {
                Ok(Event::Ready(d)) => {
                    verify(&c, &d, n_of(d.req_id()), 100);
                    assert!(
                        delivered.lock().unwrap().insert(d.req_id().to_owned()),
                        "decoder {w}, step {step}: {} delivered twice",
                        d.req_id()
                    );
                    ready += 1;
                    waiting.retain(|t| *t != d.tag());
                    held.push(d);
                    if held.len() > 4 {
                        let d = held.remove(0);
                        c.release(d).expect("release");
                    }
                }
                Ok(Event::Refused { tag, reason, .. }) => {
                    // Another decoder's subscription, or its delivery (not
                    // released yet); and the RELEASE of an unsubscribe
                    // that crossed the refusal of its SUBSCRIBE.
                    assert!(
                        matches!(
                            reason,
                            Some(
                                Refusal::AlreadySubscribed
                                    | Refusal::TakeRefused
                                    | Refusal::TooManyOutstanding
                            )
                        ) || (reason == Some(Refusal::UnknownTag) && let_go.remove(&tag)),
                        "decoder {w}, step {step}: a valid step refused: {reason:?}"
                    );
                    waiting.retain(|t| *t != tag);
                }
                Ok(other) => panic!("decoder {w}, step {step}: unexpected {other:?}"),
                Err(AttachError::Timeout) => break,
                Err(e) => panic!("decoder {w}, step {step}: the client's check failed: {e}"),
            }
        }
    }
    ready
}

/// Three decoders attached to one receiver daemon race for the requests a
/// sender keeps writing ([`random_decoder`]'s steps: SUBSCRIBEs of the same
/// req_ids, a wildcard, releases, UNSUBSCRIBEs, detaches holding
/// deliveries). No request is delivered twice, every delivery holds its
/// own bytes, no session panics; once they are gone, one more decoder gets
/// every request left (or finds it consumed unseen) and the receive buffer
/// ends empty: nothing a detached or unsubscribed decoder held stays
/// allocated.
/// `KVFERRY_FUZZ_SEED` picks another sequence.
#[test]
fn concurrent_random_decoders_never_share_nor_lose_a_delivery() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let panics_before = process::attach_session_panics();
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(16));
    let d = daemon(&r, &dir.sock(), |_| {});
    let s = Arc::new(sender(sender_cfg(8, None)));
    let writer = Writer::start(&s, &r, &format!("cd{}", std::process::id()));
    wait_for("the writer's first requests", || writer.count() >= 4);
    let writer = Arc::new(writer);
    let delivered = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let ready = {
        let (sock, writer, delivered) = (dir.sock(), Arc::clone(&writer), Arc::clone(&delivered));
        process::on_threads(3, "random decoder", WAIT * 4, move |w| {
            random_decoder(&sock, &writer, &delivered, w, 1500)
        })
    };
    assert!(
        ready.iter().all(|&n| n > 0),
        "a decoder got nothing: {ready:?}"
    );
    sessions_ended_clean(&d, panics_before, "the decoders'");
    // Consumed unseen: an UNSUBSCRIBE or a detach crossed the session's take.
    writer.stop();
    let mut delivered = std::mem::take(&mut *delivered.lock().unwrap());
    writer.deliver_the_rest(&dir.sock(), &mut delivered, |_| true);
    wait_for("the receive buffer to empty", || allocated(&r) == 0);
}

/// Another process of the user replaces the receive buffer's name (in
/// `/dev/shm`, `0600`) with a FIFO. The daemon used to open the buffer by
/// path for every attachment, on its one accept thread, which then
/// blocked in `open(2)` for a writer: no decoder could attach any more,
/// and the daemon's drop waited out its join deadline. It now hands out a
/// descriptor opened once, at start, through its own descriptor of the
/// mapped file, so the name no longer matters.
#[test]
fn a_receive_buffer_name_replaced_by_a_fifo_does_not_wedge_the_accept_thread() {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let dir = TempDir::new("kvferry-attach");
    let r = Arc::new(receiver(4));
    let d = daemon(&r, &dir.sock(), |_| {});
    // A sender of the shm transport maps the buffer by its name, at its
    // first request: before the name goes.
    let s = sender(sender_cfg(4, None));
    let mut first = connect(&dir.sock());
    first.subscribe("before-fifo").unwrap();
    store(&s, r.endpoint(), "before-fifo", 1, 10);
    match next(&mut first, "before-fifo") {
        Event::Ready(dl) => first.release(dl).unwrap(),
        other => panic!("expected READY, got {other:?}"),
    }
    let path = r.region().file_path().expect("a named buffer").to_owned();
    std::fs::remove_file(&path).unwrap();
    let fifo = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    let attached = DecoderClient::connect(d.socket(), Duration::from_secs(10));
    // Whatever happened, unwedge an accept thread blocked on the FIFO (a
    // writer's open ends its open) so the process ends clean.
    // SAFETY: a NUL-terminated path; the descriptor is closed at once.
    let w = unsafe { libc::open(fifo.as_ptr(), libc::O_WRONLY | libc::O_NONBLOCK) };
    let wedged = w >= 0;
    if w >= 0 {
        // SAFETY: our descriptor.
        unsafe { libc::close(w) };
    }
    let _ = std::fs::remove_file(&path);
    assert!(
        !wedged && attached.is_ok(),
        "the accept thread opened the buffer by its name, now a FIFO, and blocked there \
         (attach: {attached:?})"
    );
    // The attached decoder maps the real buffer: a request's bytes arrive.
    let mut c = attached.unwrap();
    c.subscribe("after-fifo").unwrap();
    store(&s, r.endpoint(), "after-fifo", 2, 99);
    match next(&mut c, "after-fifo") {
        Event::Ready(dl) => {
            verify(&c, &dl, 2, 99);
            c.release(dl).unwrap();
        }
        other => panic!("expected READY, got {other:?}"),
    }
}
