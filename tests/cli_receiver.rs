//! `kvferry receiver` as a process: start, announce, serve one AllocRequest
//! and a metrics scrape, exit 0 on SIGTERM removing its buffer file; bad
//! arguments exit 2 with a message on stderr.
//!
//! The ZMQ endpoint is bound on port 0 (the announced line carries the real
//! port). The metrics port is picked by binding 127.0.0.1:0 and closing it,
//! which leaves a small race with other processes on the machine; if the
//! receiver then fails to start, the test retries once with a new port.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::*;
use kvferry::protocol::Descriptor;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

struct Running {
    child: Child,
    endpoint: String,
    metrics: SocketAddr,
}

/// Starts the receiver; `None` if it exited before announcing itself (e.g.
/// the metrics port was taken meanwhile).
fn spawn_receiver() -> Option<Running> {
    spawn_receiver_with(&[])
}

/// [`spawn_receiver`] with `extra` arguments.
fn spawn_receiver_with(extra: &[&str]) -> Option<Running> {
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = Command::new(BIN)
        .args([
            "receiver",
            "--listen",
            "tcp://127.0.0.1:0",
            "--capacity-chunks",
            "8",
            "--chunk-bytes",
            "4096",
            "--metrics",
            &metrics.to_string(),
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry receiver");
    let lines = ChildLines::take(&mut child);
    match lines.after_prefix(&mut child, "kvferry receiver listening on ") {
        Some(endpoint) => Some(Running {
            child,
            endpoint,
            metrics,
        }),
        None => {
            let st = wait_exit(&mut child, "after closing stdout");
            eprintln!(
                "receiver exited before announcing ({st}): {}",
                stderr_of(&mut child)
            );
            None
        }
    }
}

#[test]
fn receiver_serves_scrapes_and_exits_cleanly_on_sigterm() {
    let Running {
        mut child,
        endpoint,
        metrics,
    } = spawn_receiver()
        .or_else(spawn_receiver)
        .expect("receiver starts (two attempts)");
    assert!(
        endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"),
        "announced endpoint carries the real port: {endpoint}"
    );

    let c = Client::connect(&endpoint, "cli-test");
    let ack = c.hello();
    assert_eq!((ack.chunk_bytes, ack.capacity_chunks), (4096, 8));
    let shm = match &ack.descriptor {
        Descriptor::Shm { path, .. } => PathBuf::from(path),
        other => panic!("expected an shm descriptor, got {other:?}"),
    };
    assert!(shm.exists(), "buffer file {} exists", shm.display());
    // By default a same-host sender is offered a Unix socket next to the
    // buffer file for its control messages (docs/protocol.md, "Local
    // control").
    let ctl = PathBuf::from(format!("{}.ctl", shm.display()));
    assert_eq!(
        ack.control.as_deref(),
        Some(format!("ipc://{}", ctl.display()).as_str())
    );
    assert!(ctl.exists(), "control socket {} exists", ctl.display());
    let rep = c.call(&alloc("cli-1", &keys("k", 2), 2, true, Some(1)), "cli-1");
    assert_eq!(rep.seq, Some(1));
    assert_ok(&rep, 2);

    let body = scrape(metrics);
    let m = |name: &str| metric(&body, name).unwrap_or_else(|| panic!("{name} in:\n{body}"));
    assert_eq!(m("kvferry_receiver_capacity_chunks"), 8.0);
    assert_eq!(m("kvferry_receiver_allocated_chunks"), 2.0);
    assert_eq!(m("kvferry_receiver_reserved_chunks"), 0.0);
    assert_eq!(
        m("kvferry_receiver_tracked_requests"),
        1.0,
        "awaiting TransferDone"
    );
    assert_eq!(
        m("kvferry_receiver_requests_total{outcome=\"admitted\"}"),
        1.0
    );

    assert!(sigterm(&child), "kill(SIGTERM)");
    let st = wait_exit(&mut child, "after SIGTERM");
    let err = stderr_of(&mut child);
    assert_eq!(st.code(), Some(0), "exit status {st}; stderr: {err}");
    assert!(
        !shm.exists(),
        "buffer file {} removed on exit",
        shm.display()
    );
    assert!(
        !ctl.exists(),
        "control socket {} removed on exit",
        ctl.display()
    );
}

/// `--no-local-control`: the `HelloAck` offers no Unix socket and none is
/// bound next to the buffer file.
#[test]
fn no_local_control_offers_no_unix_socket() {
    let Running {
        mut child,
        endpoint,
        ..
    } = spawn_receiver_with(&["--no-local-control"])
        .or_else(|| spawn_receiver_with(&["--no-local-control"]))
        .expect("receiver starts (two attempts)");
    let ack = Client::connect(&endpoint, "cli-no-local").hello();
    assert_eq!(ack.control, None, "nothing offered");
    let Descriptor::Shm { path, .. } = &ack.descriptor else {
        panic!("expected an shm descriptor, got {:?}", ack.descriptor)
    };
    let ctl = PathBuf::from(format!("{path}.ctl"));
    assert!(!ctl.exists(), "nothing bound at {}", ctl.display());
    assert!(sigterm(&child), "kill(SIGTERM)");
    let st = wait_exit(&mut child, "after SIGTERM");
    assert_eq!(st.code(), Some(0), "exit status {st}");
}

/// A complete request no decoder takes is released after
/// `--unconsumed-expiry-ms` (default 120 s; a daemon whose decoder never
/// comes must not hold its buffer for good), counted as
/// `unconsumed_expired`.
#[test]
fn a_request_no_decoder_takes_is_released_after_the_unconsumed_expiry() {
    let args = ["--unconsumed-expiry-ms", "200"];
    let Running {
        mut child,
        endpoint,
        metrics,
    } = spawn_receiver_with(&args)
        .or_else(|| spawn_receiver_with(&args))
        .expect("receiver starts (two attempts)");
    let c = Client::connect(&endpoint, "cli-expiry");
    c.hello();
    let rep = c.call(&alloc("exp-1", &keys("k", 3), 3, true, Some(1)), "exp-1");
    assert_ok(&rep, 3);
    c.send(&transfer_done("exp-1"));
    let m = |name: &str| metric(&scrape(metrics), name).unwrap_or(-1.0);
    wait_until("the unconsumed request released", || {
        m("kvferry_receiver_requests_total{outcome=\"unconsumed_expired\"}") == 1.0
    });
    assert_eq!(m("kvferry_receiver_allocated_chunks"), 0.0);
    assert!(sigterm(&child), "kill(SIGTERM)");
    let st = wait_exit(&mut child, "after SIGTERM");
    assert_eq!(st.code(), Some(0), "exit status {st}");
}

#[test]
fn sigterm_right_after_the_announcement_is_a_clean_exit() {
    let Some(mut r) = spawn_receiver().or_else(spawn_receiver) else {
        panic!("receiver starts (two attempts)");
    };
    assert!(sigterm(&r.child), "kill(SIGTERM)");
    let st = wait_exit(&mut r.child, "SIGTERM right after start");
    assert_eq!(st.code(), Some(0), "exit status {st}");
    let _ = (r.endpoint, r.metrics);
}

#[test]
fn bad_arguments_exit_2_with_a_message() {
    for (args, needle) in [
        (&["--capacity-chunks", "0"][..], "capacity-chunks"),
        (&["--chunk-bytes", "abc"][..], "chunk-bytes"),
        (&["--chunk-bytes", "4294967296"][..], "chunk-bytes"),
        (&["--lease-ms", "-1"][..], "-1"),
        (&["--metrics", "not-an-address"][..], "metrics"),
        (
            &["--attach-poll-idle-us", "10000001"][..],
            "attach-poll-idle-us",
        ),
        (&["--no-such-flag"][..], "no-such-flag"),
    ] {
        let (st, err) = status_and_stderr(
            Command::new(BIN)
                .arg("receiver")
                .args(["--listen", "tcp://127.0.0.1:0"])
                .args(args),
            &format!("with {args:?}"),
        );
        assert_eq!(st.code(), Some(2), "{args:?}: status {st}, stderr: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: stderr names the problem ({needle}): {err}"
        );
    }
}

#[test]
fn an_unusable_endpoint_is_a_runtime_error() {
    let (st, err) = status_and_stderr(
        Command::new(BIN).args(["receiver", "--listen", "bogus://nowhere"]),
        "with a bad endpoint",
    );
    assert_eq!(st.code(), Some(1), "status {st}, stderr: {err}");
    assert!(err.contains("bogus://nowhere"), "{err}");
}

/// `--listen` / `--also-listen` on `ipc://` paths, through the binaries:
/// a regular file at the path is refused (exit 1, the file intact; libzmq
/// alone would have unlinked it); `--also-listen` endpoints are announced
/// and serve, a `kvferry sender` completing its requests over the ipc
/// one; a second receiver given the live one's path is refused and the
/// first serves on (libzmq alone would have taken the path over); a
/// receiver SIGKILLed leaves its socket file, which the next one takes
/// over; SIGTERM removes it.
#[test]
fn ipc_endpoints_never_take_a_file_or_a_live_receivers_socket() {
    let dir = TempDir::new("kvferry-cli-ipc");
    let ipc = |name: &str| format!("ipc://{}", dir.join(name).display());
    // Each receiver with a buffer file of its own, `buf` in `dir`.
    let receiver = |buf: &str, args: &[&str]| {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "receiver",
            "--capacity-chunks",
            "8",
            "--chunk-bytes",
            "4096",
        ])
        .arg("--shm-path")
        .arg(dir.join(buf))
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
        cmd
    };

    std::fs::write(dir.join("notes"), b"keep me").unwrap();
    let (st, err) = status_and_stderr(
        &mut receiver("buf-0", &["--listen", &ipc("notes")]),
        "a receiver on a regular file",
    );
    assert_eq!(st.code(), Some(1), "status {st}, stderr: {err}");
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(dir.join("notes")).unwrap(), b"keep me");

    let mut first = ChildProc::spawn(&mut receiver(
        "buf-1",
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--also-listen",
            &ipc("ctl.sock"),
            "--consume",
        ],
    ));
    let lines = first.after_prefixes(&[
        "kvferry receiver listening on ",
        "kvferry receiver also listening on ",
    ]);
    assert_eq!(lines[1], ipc("ctl.sock"), "{lines:?}");

    let (st, err) = status_and_stderr(
        &mut receiver("buf-2", &["--listen", &ipc("ctl.sock")]),
        "a second receiver on the live one's socket",
    );
    assert_eq!(st.code(), Some(1), "status {st}, stderr: {err}");
    assert!(err.contains("served by a live daemon"), "{err}");

    let mut sender = ChildProc::spawn(Command::new(BIN).stdin(Stdio::null()).args([
        "sender",
        "--connect",
        &ipc("ctl.sock"),
        "--requests",
        "12",
        "--chunks",
        "1..4",
        "--chunk-bytes",
        "4096",
        "--capacity-chunks",
        "8",
        "--json",
        "--quiet",
    ]));
    let report = sender
        .lines
        .rest(&mut sender.child, "the sender over ipc")
        .join("\n");
    sender.wait_success("the sender over ipc");
    let v: serde_json::Value =
        serde_json::from_str(&report).unwrap_or_else(|e| panic!("a JSON report ({e}):\n{report}"));
    assert_eq!(v["completed"], 12, "{v}");

    assert!(sigterm(&first.child), "kill(SIGTERM)");
    first.wait_success("the receiver after SIGTERM");
    assert!(
        !dir.join("ctl.sock").exists(),
        "its socket file outlived it"
    );

    // SIGKILLed: the file stays, and the next receiver takes it over.
    let mut killed = ChildProc::spawn(&mut receiver("buf-3", &["--listen", &ipc("ctl.sock")]));
    killed.after_prefixes(&["kvferry receiver listening on "]);
    killed.sigkill();
    assert!(
        dir.join("ctl.sock").exists(),
        "SIGKILL removed the socket file"
    );
    let mut next = ChildProc::spawn(&mut receiver("buf-4", &["--listen", &ipc("ctl.sock")]));
    let lines = next.after_prefixes(&["kvferry receiver listening on "]);
    assert_eq!(lines[0], ipc("ctl.sock"));
    let c = Client::connect(&lines[0], "cli-ipc");
    assert_eq!(c.hello().capacity_chunks, 8);
}
