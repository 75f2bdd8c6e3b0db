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
    cpu_ticks, metric, node_command, python3, python_client, python_pattern, scrape,
    status_and_stderr, ChildProc, TempDir,
};
use kvferry::attach::{AttachError, PrefillClient, PrefillEvent};
use kvferry::protocol::ErrorCode;

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
    let (p, found) = node_announcing(dir, capacity, staging, shares, extra, &[]);
    (p, found[0].clone())
}

/// [`node_with`], waiting for the lines starting with `more` too (in any
/// order); returns what follows the listen line's prefix, then each of
/// `more`'s.
fn node_announcing(
    dir: &TempDir,
    capacity: u32,
    staging: u32,
    shares: u32,
    extra: &[&str],
    more: &[&str],
) -> (ChildProc, Vec<String>) {
    let mut p = ChildProc::spawn(node_command(dir, CHUNK, capacity, staging, shares).args(extra));
    let mut prefixes = vec![
        "kvferry node listening on ",
        "kvferry node decoder attach on ",
        "kvferry node prefill attach on ",
    ];
    prefixes.extend_from_slice(more);
    let mut found = p.after_prefixes(&prefixes);
    found.drain(1..3);
    (p, found)
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
    rust_worker_to(sock, 0, req_id, n, last);
}

/// [`rust_worker`] writing to receiver `receiver` of the node's (0: its
/// own, 1.. its `--connect` ones).
fn rust_worker_to(sock: &str, receiver: u32, req_id: &str, n: usize, last: usize) {
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
    let tag = c.begin(req_id, receiver, n as u32).unwrap();
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

/// The `kvferry_receiver_tcp_data_connections` gauge at the metrics
/// server `addr`.
fn tcp_data_connections(addr: &str) -> f64 {
    let text = scrape(addr.parse().expect("a socket address"));
    metric(&text, "kvferry_receiver_tcp_data_connections")
        .unwrap_or_else(|| panic!("no tcp data gauge in:\n{text}"))
}

/// `--transport tcp`: the node's sender writes over TCP, to its own
/// receiver (which then offers it, on loopback by default) as to a
/// `kvferry receiver --tcp-data` of another process; a receiver that
/// offers no TCP data plane gets nothing written (the request fails, not
/// the node), where one over shm would have worked.
#[test]
fn a_node_over_tcp_writes_its_own_receiver_and_a_remote_one_over_tcp() {
    let dir = TempDir::new("kvferry-node-tcp");
    let remote_receiver = |name: &str, extra: &[&str]| {
        let mut p = ChildProc::spawn(
            Command::new(BIN)
                .args(["receiver", "--listen", "tcp://127.0.0.1:0"])
                .args(extra)
                .args([
                    "--capacity-chunks",
                    "8",
                    "--chunk-bytes",
                    &CHUNK.to_string(),
                ])
                .args(["--metrics", "127.0.0.1:0", "--spare-cpu", "none"])
                .arg("--attach")
                .arg(dir.join(&format!("{name}.sock")))
                .arg("--shm-path")
                .arg(dir.join(&format!("{name}.buf")))
                .stdin(Stdio::null()),
        );
        let found = p.after_prefixes(&[
            "kvferry receiver listening on ",
            "kvferry receiver metrics on ",
        ]);
        (p, found)
    };
    let (_tcp, tcp_found) = remote_receiver("tcp", &["--tcp-data", "127.0.0.1:0"]);
    let (_shm, shm_found) = remote_receiver("shm", &[]);
    let connect = format!("{},{}", tcp_found[0], shm_found[0]);
    let (_node, found) = node_announcing(
        &dir,
        8,
        16,
        2,
        &[
            "--transport",
            "tcp",
            "--connect",
            &connect,
            "--metrics",
            "127.0.0.1:0",
        ],
        &["kvferry node tcp data on ", "kvferry node metrics on "],
    );
    let node_metrics = &found[2];
    let workers = path(&dir, "workers.sock");
    // Receiver 0, the node's own: a Python worker's bytes, read back in
    // place by a Python decoder of the node.
    let dec = subscribed(&path(&dir, "decoders.sock"), "own-1", 5, 777, "release");
    python_worker(&workers, "own-1", 5, 777, "python worker of a tcp node");
    delivered(dec, "python decoder of a tcp node");
    assert!(
        tcp_data_connections(node_metrics) >= 1.0,
        "the node's own receiver was not written over TCP"
    );
    // Receiver 1, another process's, offering TCP: a Rust worker's bytes.
    let dec = subscribed(&path(&dir, "tcp.sock"), "remote-1", 3, 100, "release");
    rust_worker_to(&workers, 1, "remote-1", 3, 100);
    delivered(dec, "python decoder of the remote tcp receiver");
    assert!(
        tcp_data_connections(&tcp_found[1]) >= 1.0,
        "the remote receiver was not written over TCP"
    );
    // Receiver 2 offers shm only: the request fails, naming no data plane
    // reached, and the node serves on.
    let mut c = PrefillClient::connect(Path::new(&workers), WAIT).expect("a worker attaches");
    let tag = c.begin("no-tcp-1", 2, 1).unwrap();
    match next(&mut c, "the request to a receiver without tcp") {
        PrefillEvent::Failed { tag: t, code } => {
            assert_eq!(t, tag);
            assert_eq!(code, Some(ErrorCode::PeerUnavailable));
        }
        other => panic!("expected FAILED (peer unavailable), got {other:?}"),
    }
    assert_eq!(tcp_data_connections(&shm_found[1]), 0.0);
    drop(c);
    let dec = subscribed(&path(&dir, "decoders.sock"), "own-2", 2, 10, "release");
    rust_worker(&workers, "own-2", 2, 10);
    delivered(dec, "python decoder of the node after the failed request");
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
    let cases: [(&[&str], &str); 9] = [
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
        (
            &["--attach", &d, "--prefill-attach", &w, "--transport", "udp"],
            "--transport",
        ),
        (
            &[
                "--attach",
                &d,
                "--prefill-attach",
                &w,
                "--static-buffer",
                "x",
            ],
            "expected ENDPOINT=PATH",
        ),
        (
            &[
                "--attach",
                &d,
                "--prefill-attach",
                &w,
                "--transport",
                "tcp",
                "--static-buffer",
                "tcp://127.0.0.1:1=/nonexistent",
            ],
            "--static-buffer needs --transport shm",
        ),
        (
            &[
                "--attach",
                &d,
                "--prefill-attach",
                &w,
                "--static-buffer",
                "tcp://127.0.0.1:1=/nonexistent/kvferry.buf",
            ],
            "--static-buffer: ",
        ),
    ];
    // Without the rdma feature (with it, the device decides).
    let rdma: &[&str] = &[
        "--attach",
        &d,
        "--prefill-attach",
        &w,
        "--transport",
        "rdma",
    ];
    let rdma = (!cfg!(feature = "rdma")).then_some((rdma, "--transport rdma: "));
    for (args, says) in cases.into_iter().chain(rdma) {
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
