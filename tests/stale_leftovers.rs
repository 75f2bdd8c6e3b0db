//! What a SIGKILLed `kvferry receiver` leaves in `/dev/shm` (its receive
//! buffer file and the local control socket next to it; its attach rings
//! are memfds and leave nothing) is removed by the next receiver to start,
//! and never what a live one holds (`src/primitives/stale.rs`).
//!
//! This is a test binary of its own with a single test: every receiver and
//! attach daemon sweeps `/dev/shm` when it starts, so a test running in
//! parallel in the same binary could remove the dead receiver's leftovers
//! before this test's receiver does, or a directory this test is about to
//! lock. Cargo runs test binaries one after another, so here nothing else
//! sweeps.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use kvferry::attach::DecoderClient;
use kvferry::protocol::Descriptor;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

/// A running `kvferry receiver` on the default buffer path with an attach
/// socket, and the leftovers a SIGKILL would leave: its buffer file (from
/// its HelloAck) and its local control socket (`{buffer}.ctl`, docs/
/// protocol.md "Local control").
struct Running {
    proc: ChildProc,
    sock: PathBuf,
    buffer: PathBuf,
    control: PathBuf,
}

/// Entries of `/dev/shm` whose name carries `pid` (kvferry names its files
/// `kvferry-<pid>-...`, and attach ring directories were
/// `kvferry-attach-<pid>-<n>`).
fn shm_names_of(pid: u32) -> Vec<String> {
    let tag = format!("-{pid}-");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("kvferry") && n.contains(&tag))
        .collect()
}

fn start_receiver(sock: &Path) -> Running {
    let mut proc = ChildProc::spawn(
        Command::new(BIN)
            .args(["receiver", "--listen", "tcp://127.0.0.1:0"])
            .args(["--capacity-chunks", "2", "--chunk-bytes", "4096"])
            .arg("--attach")
            .arg(sock)
            .stdin(Stdio::null()),
    );
    let endpoint = proc
        .after_prefixes(&[
            "kvferry receiver listening on ",
            "kvferry receiver attach on ",
        ])
        .remove(0);
    let ack = Client::connect(&endpoint, "stale-test").hello();
    let buffer = match ack.descriptor {
        Descriptor::Shm { path, .. } => PathBuf::from(path),
        other => panic!("expected an shm descriptor, got {other:?}"),
    };
    let control = PathBuf::from(format!("{}.ctl", buffer.display()));
    assert_eq!(
        ack.control,
        Some(format!("ipc://{}", control.display())),
        "the local control socket next to the buffer"
    );
    let attached = DecoderClient::connect(sock, PROC_WAIT).expect("attaches");
    assert!(buffer.exists(), "buffer file {} exists", buffer.display());
    let name = buffer.file_name().unwrap().to_string_lossy().into_owned();
    let mut names = shm_names_of(proc.child.id());
    names.sort();
    assert_eq!(
        names,
        [name.clone(), format!("{name}.ctl")],
        "an attached client's rings have no name in /dev/shm"
    );
    drop(attached);
    Running {
        proc,
        sock: sock.to_owned(),
        buffer,
        control,
    }
}

#[test]
fn a_starting_receiver_removes_what_a_sigkilled_one_left_and_never_a_live_ones() {
    let dir = TempDir::new("kvferry-stale");
    let mut live = start_receiver(&dir.join("live.sock"));
    let mut killed = start_receiver(&dir.join("killed.sock"));
    killed.proc.sigkill();
    for left in [&killed.buffer, &killed.control] {
        assert!(
            left.exists(),
            "SIGKILL leaves {} behind (nothing can remove it at exit)",
            left.display()
        );
    }
    let mut next = start_receiver(&dir.join("next.sock"));
    for left in [&killed.buffer, &killed.control] {
        assert!(
            !left.exists(),
            "the next receiver removed the dead one's {}",
            left.display()
        );
    }
    for r in [&live, &next] {
        for kept in [&r.buffer, &r.control] {
            assert!(kept.exists(), "a live {} is kept", kept.display());
        }
    }
    // The live receivers still serve, and clean up after themselves on
    // SIGTERM.
    for r in [&mut live, &mut next] {
        drop(DecoderClient::connect(&r.sock, PROC_WAIT).expect("attaches"));
        sigterm(&r.proc.child);
        r.proc.wait_success("a receiver's exit on SIGTERM");
        for gone in [&r.buffer, &r.control] {
            assert!(!gone.exists(), "{} removed on exit", gone.display());
        }
    }
}
