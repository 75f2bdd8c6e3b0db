//! Runs the built `examples/`: the one-process 1P1D and the two-process
//! decoder/prefill pair (over shm and over tcp), each with a deadline.
//!
//! `cargo test` builds the examples before it runs any test (they land in
//! `target/<profile>/examples/`); `cargo test --test examples` alone does
//! not, so run `cargo build --examples` first in that case — the test says
//! so instead of running a stale binary silently.
#![cfg(not(feature = "shuttle-model"))]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Longest an example process may run (it has its own, shorter, deadlines
/// on every wait; this catches a hang of the process itself).
const HANG: Duration = Duration::from_secs(120);

/// The built example `name` (next to this test's `deps/` directory).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "example binary {} not built: `cargo test` builds the examples; \
         with `--test examples` alone run `cargo build --examples` first",
        path.display()
    );
    path
}

fn spawn(name: &str, args: &[&str]) -> Child {
    Command::new(example(name))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn example {name}: {e}"))
}

/// Waits for `child` to exit within [`HANG`] (killing it and failing,
/// naming `what`, otherwise); returns its stdout after the lines already
/// read, and fails with its stderr on a non-zero exit.
fn finish(mut child: Child, what: &str) -> String {
    let end = Instant::now() + HANG;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hung: example {what} still running after {HANG:?}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(status.success(), "example {what} exited {status}: {err}");
    out
}

#[test]
fn one_process_1p1d_moves_and_verifies_its_requests() {
    let out = finish(spawn("one_process_1p1d", &[]), "one_process_1p1d");
    assert!(
        out.contains("8 requests") && out.contains("verified") && out.contains("8 proxy"),
        "unexpected output: {out}"
    );
}

/// The decoder prints its endpoint; the prefill process sends to it.
fn two_process_pair(transport: &str) {
    let requests = "3";
    let mut decoder = spawn("decoder", &[requests]);
    let stdout = decoder.stdout.take().expect("decoder stdout");
    let (tx, rx) = mpsc::channel();
    // Reads the announcement line on a thread, so the wait has a deadline.
    let reader = thread::spawn(move || {
        let mut lines = BufReader::new(stdout);
        let mut first = String::new();
        let _ = lines.read_line(&mut first);
        let _ = tx.send(first);
        let mut rest = String::new();
        let _ = lines.read_to_string(&mut rest);
        rest
    });
    let Ok(first) = rx.recv_timeout(HANG) else {
        let _ = decoder.kill();
        let _ = decoder.wait();
        panic!("hung: the decoder did not print its endpoint within {HANG:?}");
    };
    let endpoint = first
        .trim()
        .strip_prefix("decoder listening on ")
        .unwrap_or_else(|| panic!("decoder's first line: {first:?}"))
        .to_owned();

    let prefill = finish(
        spawn("prefill", &[&endpoint, requests, transport]),
        &format!("prefill over {transport}"),
    );
    assert!(prefill.contains("3 requests sent"), "prefill: {prefill}");
    finish(decoder, "decoder");
    let decoded = reader.join().expect("reader thread");
    assert!(
        decoded.contains("req-2 in place") && decoded.contains("3 requests received"),
        "decoder: {decoded}"
    );
}

#[test]
fn decoder_and_prefill_processes_over_shm() {
    two_process_pair("shm");
}

#[test]
fn decoder_and_prefill_processes_over_tcp() {
    two_process_pair("tcp");
}
