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
