//! What a SIGKILLed `kvferry receiver` leaves in `/dev/shm` (its receive
//! buffer file and its attach ring directory) is removed by the next
//! receiver to start, and never what a live one, a symlink or a locked
//! directory holds (`src/primitives/stale.rs`).
//!
//! This is a test binary of its own with a single test: every receiver and
//! attach daemon sweeps `/dev/shm` when it starts, so a test running in
//! parallel in the same binary could remove the dead receiver's leftovers
//! before this test's receiver does, or a directory this test is about to
//! lock. Cargo runs test binaries one after another, so here nothing else
//! sweeps.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use kvferry::attach::DecoderClient;
use kvferry::protocol::Descriptor;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

/// A running `kvferry receiver` on the default buffer path with an attach
/// socket, and the leftovers a SIGKILL would leave: its buffer file (from
/// its HelloAck) and its ring directory (from its attach hello).
struct Running {
    proc: ChildProc,
    sock: PathBuf,
    buffer: PathBuf,
    ring_dir: PathBuf,
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
    let buffer = match Client::connect(&endpoint, "stale-test").hello().descriptor {
        Descriptor::Shm { path, .. } => PathBuf::from(path),
        other => panic!("expected an shm descriptor, got {other:?}"),
    };
    let attached = DecoderClient::connect(sock, PROC_WAIT).expect("attaches");
    let ring_dir = Path::new(&attached.hello().sq_path)
        .parent()
        .expect("ring files live in a directory")
        .to_owned();
    assert!(buffer.exists(), "buffer file {} exists", buffer.display());
    assert!(ring_dir.is_dir(), "ring dir {} exists", ring_dir.display());
    assert!(
        ring_dir.starts_with("/dev/shm"),
        "{} is on /dev/shm",
        ring_dir.display()
    );
    Running {
        proc,
        sock: sock.to_owned(),
        buffer,
        ring_dir,
    }
}

/// Removes a file (a symlink) when dropped, also when the test fails.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Removes an empty directory when dropped, also when the test fails.
struct RemoveDirOnDrop(PathBuf);

impl Drop for RemoveDirOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_starting_receiver_removes_what_a_sigkilled_one_left_and_never_a_live_ones() {
    let dir = TempDir::new("kvferry-stale");
    let mut live = start_receiver(&dir.join("live.sock"));
    let mut killed = start_receiver(&dir.join("killed.sock"));
    let dead_pid = killed.proc.child.id();
    killed.proc.sigkill();
    assert!(
        killed.buffer.exists() && killed.ring_dir.is_dir(),
        "SIGKILL leaves {} and {} behind (nothing can remove them at exit)",
        killed.buffer.display(),
        killed.ring_dir.display()
    );
    // A symlink with a dead daemon's name is never followed.
    let target = dir.join("not-a-ring-dir");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("precious"), b"x").unwrap();
    let link = PathBuf::from(format!("/dev/shm/kvferry-attach-{dead_pid}-4242"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let _link = RemoveOnDrop(link.clone());
    // A directory with a dead pid's name that a process still locks (a
    // daemon in another pid namespace) is kept.
    let locked = PathBuf::from(format!("/dev/shm/kvferry-attach-{dead_pid}-4343"));
    let _ = std::fs::remove_dir(&locked);
    std::fs::create_dir(&locked).unwrap();
    let locked_guard = RemoveDirOnDrop(locked.clone());
    let lock = std::fs::File::open(&locked).unwrap();
    // SAFETY: flock on a descriptor we own; no memory involved.
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );

    let mut next = start_receiver(&dir.join("next.sock"));
    assert!(
        !killed.buffer.exists(),
        "the next receiver removed the dead one's {}",
        killed.buffer.display()
    );
    assert!(
        !killed.ring_dir.exists(),
        "the next receiver removed the dead one's {}",
        killed.ring_dir.display()
    );
    for r in [&live, &next] {
        assert!(r.buffer.exists(), "a live {} is kept", r.buffer.display());
        assert!(r.ring_dir.is_dir(), "a live {} is kept", r.ring_dir.display());
    }
    assert!(
        target.join("precious").exists(),
        "the symlink was not followed"
    );
    assert!(
        link.symlink_metadata().is_ok(),
        "a symlink is not a ring directory"
    );
    assert!(locked.is_dir(), "a locked ring directory is kept");
    drop((lock, locked_guard));
    // The live receivers still serve, and clean up after themselves on
    // SIGTERM.
    for r in [&mut live, &mut next] {
        drop(DecoderClient::connect(&r.sock, PROC_WAIT).expect("attaches"));
        // SAFETY: kill with a pid we spawned and still own (not yet reaped).
        unsafe { libc::kill(r.proc.child.id() as libc::pid_t, libc::SIGTERM) };
        r.proc.wait_success("a receiver's exit on SIGTERM");
        assert!(!r.buffer.exists(), "{} removed on exit", r.buffer.display());
        assert!(
            !r.ring_dir.exists(),
            "{} removed on exit",
            r.ring_dir.display()
        );
    }
}
