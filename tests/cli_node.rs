//! `kvferry node` (docs/attach.md, "One process for both roles"): a
//! receiver and a sender in one process, each serving attached workers.
//! Run as a user would, with the real binary and the Python and Rust
//! clients: every byte a worker writes in place is read back in place by
//! a decoder; a remote `kvferry sender` reaches the node's receiver on
//! `--listen`; a decoder or a worker SIGKILLed while holding slots gives
//! them back; an idle node uses no CPU; bad options are refused at start.
//! Every wait has a deadline.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    cpu_ticks, python3, python_client, python_pattern, scrape, status_and_stderr, ChildProc,
    TempDir,
};
use kvferry::attach::{AttachError, PrefillClient, PrefillEvent};

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");
const WAIT: Duration = Duration::from_secs(30);
/// Bytes per chunk (small: the tests check every byte).
const CHUNK: u64 = 16 * 1024;

/// A node with `capacity` receive slots and `staging` staging slots in
/// `shares` shares, its sockets and buffer file in `dir`; returns it and
/// its `--listen` endpoint.
fn node(dir: &TempDir, capacity: u32, staging: u32, shares: u32) -> (ChildProc, String) {
    node_with(dir, capacity, staging, shares, &[])
}

/// [`node`] with `extra` options.
fn node_with(
    dir: &TempDir,
    capacity: u32,
    staging: u32,
    shares: u32,
    extra: &[&str],
) -> (ChildProc, String) {
    let mut p = ChildProc::spawn(
        Command::new(BIN)
            .args(["node", "--listen", "tcp://127.0.0.1:0"])
            .args(extra)
            .args(["--capacity-chunks", &capacity.to_string()])
            .args(["--chunk-bytes", &CHUNK.to_string()])
            .args(["--staging-slots", &staging.to_string()])
            .args(["--attach-shares", &shares.to_string()])
            .arg("--attach")
            .arg(dir.join("decoders.sock"))
            .arg("--prefill-attach")
            .arg(dir.join("workers.sock"))
            .arg("--shm-path")
            .arg(dir.join("buf"))
            .stdin(Stdio::null()),
    );
    let found = p.after_prefixes(&[
        "kvferry node listening on ",
        "kvferry node decoder attach on ",
        "kvferry node prefill attach on ",
    ]);
    (p, found[0].clone())
}

/// A Python decoder (`decoder_check.py`) on `sock`, subscribed to `req`
/// (`n` chunks of the pattern, the last `last` bytes), in `mode`
/// (`release` or `hold`).
fn subscribed(sock: &str, req: &str, n: usize, last: usize, mode: &str) -> ChildProc {
    let (n, last) = (n.to_string(), last.to_string());
    let mut dec = python_client("decoder_check.py", &[sock, req, &n, &last, mode]);
    dec.expect_line("ATTACH:subscribed");
    dec
}

/// Waits for a [`subscribed`] decoder to have checked every byte and
/// released (`what` names it if it fails or hangs).
fn delivered(mut dec: ChildProc, what: &str) {
    dec.expect_line("ATTACH:ok");
    dec.wait_success(what);
}

/// A Python worker (`prefill_check.py`) on `sock` writes `req` (`n`
/// chunks of the pattern, the last `last` bytes) and sees it DONE.
fn python_worker(sock: &str, req: &str, n: usize, last: usize, what: &str) {
    let (n, last) = (n.to_string(), last.to_string());
    let mut pf = python_client("prefill_check.py", &[sock, req, &n, &last]);
    pf.expect_line("PREFILL:ok");
    pf.wait_success(what);
}

fn path(dir: &TempDir, name: &str) -> String {
    dir.join(name).to_str().expect("utf-8 path").to_owned()
}

fn next(c: &mut PrefillClient, what: &str) -> PrefillEvent {
    c.next_event(Instant::now() + WAIT)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// A Rust worker on `sock` writes request `req_id` (`n` chunks of the
/// pattern, the last `last` bytes) in place and waits for DONE. Attaches
/// again while the daemon refuses it for want of a free share (a share
/// comes back when the session of a killed worker ends), up to [`WAIT`].
fn rust_worker(sock: &str, req_id: &str, n: usize, last: usize) {
    let end = Instant::now() + WAIT;
    let mut c = loop {
        match PrefillClient::connect(Path::new(sock), WAIT) {
            Ok(c) => break c,
            Err(AttachError::Refused(_)) if Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the rust worker cannot attach: {e}"),
        }
    };
    let tag = c.begin(req_id, 0, n as u32).unwrap();
    c.stage(tag, n as u32).unwrap();
    let b = match next(&mut c, "the rust worker's STAGED") {
        PrefillEvent::Staged(b) => b,
        other => panic!("expected STAGED, got {other:?}"),
    };
    let mut lens = Vec::new();
    for i in 0..n {
        let len = if i + 1 == n { last } else { CHUNK as usize };
        c.slot_mut(&b, i).unwrap()[..len].copy_from_slice(&python_pattern(i, len));
        lens.push(len as u32);
    }
    let keys: Vec<String> = (0..n).map(|i| format!("{req_id}/{i:03}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.submit(b, &keys, &lens).unwrap();
    match next(&mut c, "the rust worker's DONE") {
        PrefillEvent::Done { tag: t } => assert_eq!(t, tag),
        other => panic!("expected DONE, got {other:?}"),
    }
}

#[test]
fn python_and_rust_workers_feed_python_decoders_through_one_node_and_a_remote_sender() {
    let dir = TempDir::new("kvferry-node");
    let (_node, endpoint) = node(&dir, 8, 16, 2);
    let (decoders, workers) = (path(&dir, "decoders.sock"), path(&dir, "workers.sock"));
    // A Python worker of the node writes; a Python decoder of the node
    // reads every byte.
    let dec = subscribed(&decoders, "node-1", 5, 777, "release");
    python_worker(&workers, "node-1", 5, 777, "python worker of the node");
    delivered(dec, "python decoder of the node");
    // The Rust worker client, the same pattern.
    let dec = subscribed(&decoders, "node-2", 3, 100, "release");
    rust_worker(&workers, "node-2", 3, 100);
    delivered(dec, "python decoder of the rust worker's request");
    // A sender in another process reaches the node's receiver on --listen
    // (over TCP, like one on another host): its worker's bytes arrive too.
    let remote = path(&dir, "remote.sock");
    let mut send = ChildProc::spawn(
        Command::new(BIN)
            .args(["sender", "--connect", &endpoint])
            .args(["--chunk-bytes", &CHUNK.to_string(), "--staging-slots", "8"])
            .args(["--attach-shares", "1"])
            .args(["--attach", &remote])
            .stdin(Stdio::null()),
    );
    send.expect_line("kvferry sender attach on ");
    let dec = subscribed(&decoders, "node-3", 4, 5000, "release");
    python_worker(
        &remote,
        "node-3",
        4,
        5000,
        "python worker of the remote sender",
    );
    delivered(dec, "python decoder of the remote sender's request");
}

/// A Python worker that stages `n` slots of `req_id`, says
/// `HOLD:staged` and sleeps until killed.
const HOLDING_WORKER: &str = r#"
import sys, time, kvferry_attach
c = kvferry_attach.PrefillClient(sys.argv[1])
n = int(sys.argv[3])
tag = c.begin(sys.argv[2], 0, n)
batch = c.stage(tag, n)
ev = c.next_event(timeout=30.0)
if ev[0] != "staged" or len(ev[3]) != n:
    sys.exit("expected STAGED of %d slots, got %r" % (n, ev))
print("HOLD:staged", flush=True)
time.sleep(120)
"#;

#[test]
fn a_decoder_or_worker_killed_holding_slots_in_a_node_gives_them_back() {
    let dir = TempDir::new("kvferry-node-kill");
    // 8 receive slots and 8 staging slots in one share: a request of 8
    // chunks takes all of either.
    let (_node, _) = node(&dir, 8, 8, 1);
    let (decoders, workers) = (path(&dir, "decoders.sock"), path(&dir, "workers.sock"));
    // A decoder holds all 8 receive slots and is killed.
    let mut holder = subscribed(&decoders, "held-1", 8, 100, "hold");
    rust_worker(&workers, "held-1", 8, 100);
    holder.expect_line("ATTACH:holding");
    holder.sigkill();
    // The next request of 8 chunks fits only if the killed decoder's
    // slots came back (otherwise it waits for admission past WAIT).
    let dec = subscribed(&decoders, "after-1", 8, 100, "release");
    rust_worker(&workers, "after-1", 8, 100);
    delivered(dec, "the decoder after the killed one");
    // A worker holds all 8 staging slots (the one share) and is killed:
    // the next worker gets the share and all 8 slots again.
    let mut worker =
        ChildProc::spawn(python3().args(["-c", HOLDING_WORKER, &workers, "held-2", "8"]));
    worker.expect_line("HOLD:staged");
    worker.sigkill();
    let dec = subscribed(&decoders, "after-2", 8, 100, "release");
    rust_worker(&workers, "after-2", 8, 100);
    delivered(dec, "the decoder of the worker after the killed one");
}

/// An idle node uses no CPU, with a decoder and a worker attached and a
/// request moved before (every thread spun, yielded, then parked).
#[test]
fn an_idle_node_with_clients_attached_uses_no_cpu() {
    let dir = TempDir::new("kvferry-node-idle");
    let (p, _) = node(&dir, 8, 8, 1);
    let (decoders, workers) = (path(&dir, "decoders.sock"), path(&dir, "workers.sock"));
    let dec = subscribed(&decoders, "idle-1", 2, 100, "release");
    rust_worker(&workers, "idle-1", 2, 100);
    delivered(dec, "the decoder before the idle window");
    let _decoder = kvferry::attach::DecoderClient::connect(Path::new(&decoders), WAIT)
        .expect("an idle decoder attaches");
    let _worker =
        PrefillClient::connect(Path::new(&workers), WAIT).expect("an idle worker attaches");
    // Past the sessions' linger and the first sleeps.
    std::thread::sleep(Duration::from_millis(200));
    let pid = p.child.id();
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_ticks(pid) - before;
    assert!(used <= 3, "the idle node used {used} CPU ticks in 1 s");
}

/// `--metrics` serves both roles' metrics on one port.
#[test]
fn a_nodes_metrics_hold_both_roles() {
    let dir = TempDir::new("kvferry-node-metrics");
    let (mut p, _) = node_with(&dir, 8, 8, 1, &["--metrics", "127.0.0.1:0"]);
    let addr = p.expect_line("kvferry node metrics on ");
    let addr = addr.trim_start_matches("kvferry node metrics on ").trim();
    // A 200 answer (`scrape` fails on anything else), holding both roles.
    let text = scrape(addr.parse().expect("a socket address"));
    for role in ["kvferry_receiver_", "kvferry_sender_"] {
        assert!(text.contains(role), "no {role} metrics in:\n{text}");
    }
}

#[test]
fn kvferry_node_refuses_bad_options_at_start_naming_them() {
    let dir = TempDir::new("kvferry-node-refuse");
    let (d, w) = (path(&dir, "d.sock"), path(&dir, "w.sock"));
    let cases: [(&[&str], &str); 5] = [
        (&["--prefill-attach", &w], "--attach PATH"),
        (
            &["--attach", &d, "--prefill-attach", &d],
            "different sockets",
        ),
        (
            &[
                "--attach",
                &d,
                "--prefill-attach",
                &w,
                "--copy-cpu",
                "100000",
            ],
            "--copy-cpu: ",
        ),
        (
            &["--attach", &d, "--prefill-attach", &w, "--cpus", "0-x"],
            "--cpus",
        ),
        (
            &["--attach", &d, "--prefill-attach", &w, "--connect", ""],
            "--connect has an empty endpoint",
        ),
    ];
    for (args, says) in cases {
        let (status, stderr) = status_and_stderr(
            Command::new(BIN)
                .args(["node", "--listen", "tcp://127.0.0.1:0"])
                .args(args),
            "kvferry node with a bad option",
        );
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !dir.join("d.sock").exists() && !dir.join("w.sock").exists(),
            "{args:?}: a refused node bound a socket"
        );
    }
}
