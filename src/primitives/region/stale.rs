//! Stale default buffer files: a receiver killed with SIGKILL (or one that
//! crashed) cannot remove its `kvferry-<pid>-<n>.buf`, and each such file
//! pins `capacity_chunks × chunk_bytes` of RAM in `/dev/shm` until someone
//! deletes it. The first receiver of a process that creates a buffer at a
//! default path therefore sweeps the directory once
//! ([`remove_stale_buffers`]). The same sweep removes a dead receiver's
//! local control socket (`kvferry-<pid>-<n>.buf.ctl`, no RAM, but litter)
//! under the rule every `ipc://` bind follows: a socket nobody serves.
//!
//! A file is removed only when all of these hold:
//! - its name is exactly `kvferry-<pid>-<n>.buf` and `<pid>` is not this
//!   process;
//! - no live process has that pid in this pid namespace (none, or a
//!   zombie: `primitives::stale::owner`);
//! - it is a regular file (opened with `O_NOFOLLOW`: a symlink is never
//!   followed, nor removed) owned by this effective uid;
//! - nobody holds its lock: every live creator holds a shared `flock` on
//!   its buffer for as long as the region lives ([`lock_shared`]), and
//!   flocks work across pid namespaces that share the tmpfs, so a live
//!   receiver in another container (whose pid means nothing here) keeps
//!   its file, as does one whose pid was reused by an unrelated process
//!   (that pid is alive, so the file is kept: a leak, never a loss);
//! - under the exclusive lock taken for the check, the path still names
//!   the inode that was checked.
//!
//! The one window left: a new process that got the dead pid (pid reuse)
//! and creates its buffer at the very same name between that last check
//! and the unlink. Its creator sees the exclusive lock and retries on a
//! fresh inode ([`lock_shared`] callers in `Region::create`), so the
//! window is the few instructions between `fstat` of the path and
//! `unlink`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::primitives::stale::{self, Owner};

/// `kvferry-<pid>-<n>.buf` → `pid`, or `None` for any other name.
pub(super) fn buffer_pid(name: &str) -> Option<u32> {
    stale::pid_in_name(name, "kvferry-", ".buf")
}

/// Takes the creator's shared lock on a buffer file (held until the file
/// is closed): a sweeper's exclusive lock fails while it is held.
/// `WouldBlock` if a sweeper holds the file right now.
pub(super) fn lock_shared(file: &File) -> io::Result<()> {
    stale::flock_nb(file, libc::LOCK_SH)
}

/// Removes `dir/name` if it is a stale buffer file (see the module docs);
/// returns whether it did.
fn remove_if_stale(dir: &Path, name: &str, own_pid: u32, euid: u32) -> bool {
    let Some(pid) = buffer_pid(name) else {
        return false;
    };
    if pid == own_pid || stale::owner(pid) != Owner::Dead {
        return false;
    }
    let path = dir.join(name);
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    else {
        return false;
    };
    let Ok(meta) = file.metadata() else {
        return false;
    };
    if !meta.is_file() || meta.uid() != euid || stale::flock_nb(&file, libc::LOCK_EX).is_err() {
        return false;
    }
    // Under the lock: the name must still be the inode checked above.
    let same = std::fs::symlink_metadata(&path)
        .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
    same && std::fs::remove_file(&path).is_ok()
}

/// `kvferry-<pid>-<n>.buf.ctl` (the local control socket a receiver binds
/// next to its buffer file, `ReceiverConfig::local_control`) → `pid`.
pub(super) fn control_socket_pid(name: &str) -> Option<u32> {
    stale::pid_in_name(name, "kvferry-", ".buf.ctl")
}

/// Removes `dir/name` if it is a dead receiver's local control socket: the
/// name is `kvferry-<pid>-<n>.buf.ctl` of a dead pid other than this
/// process's, it is a socket (not followed if a symlink) owned by this
/// effective uid, and nobody accepts on it (the rule every `ipc://` bind
/// follows). Returns whether it did.
fn remove_if_stale_socket(dir: &Path, name: &str, own_pid: u32, euid: u32) -> bool {
    let Some(pid) = control_socket_pid(name) else {
        return false;
    };
    if pid == own_pid || stale::owner(pid) != Owner::Dead {
        return false;
    }
    let path = dir.join(name);
    let owned_socket = std::fs::symlink_metadata(&path)
        .is_ok_and(|m| m.file_type().is_socket() && m.uid() == euid);
    owned_socket && crate::util::socket_file::remove_stale_socket(&path).is_ok() && !path.exists()
}

/// Removes the buffer files of dead receivers from `dir` (see the module
/// docs for what counts as dead), and their local control sockets, and
/// returns how many buffer files it removed; each removal is
/// logged. Errors reading the directory end the sweep quietly: it is a
/// best-effort cleanup, never a reason to fail a start.
pub fn remove_stale_buffers(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let own_pid = std::process::id();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if remove_if_stale(dir, name, own_pid, euid) {
            tracing::info!(file = %dir.join(name).display(), "removed a dead receiver's buffer file");
            removed += 1;
        }
        if remove_if_stale_socket(dir, name, own_pid, euid) {
            tracing::info!(file = %dir.join(name).display(), "removed a dead receiver's control socket");
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that was alive a moment ago and is dead now (a reaped child).
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert_eq!(
            stale::owner(pid),
            Owner::Dead,
            "pid {pid} was reused at once"
        );
        pid
    }

    fn scratch() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvferry-stale-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn names_parse_strictly() {
        assert_eq!(buffer_pid("kvferry-123-0.buf"), Some(123));
        assert_eq!(buffer_pid("kvferry-7-42.buf"), Some(7));
        for bad in [
            "kvferry-123.buf",
            "kvferry--0.buf",
            "kvferry-0-0.buf",
            "kvferry-12a-0.buf",
            "kvferry-1-0.buf.bak",
            "kvferry-attach-1-0",
            "kvferry-+1-0.buf",
            "kvferry-99999999999-0.buf",
            "other-1-0.buf",
        ] {
            assert_eq!(buffer_pid(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_dead_unlocked_own_regular_files_go() {
        let dir = scratch();
        let dead = dead_pid();
        let own = std::process::id();
        let stale = dir.join(format!("kvferry-{dead}-0.buf"));
        let locked = dir.join(format!("kvferry-{dead}-1.buf"));
        let link = dir.join(format!("kvferry-{dead}-2.buf"));
        let mine = dir.join(format!("kvferry-{own}-0.buf"));
        let live = dir.join("kvferry-1-0.buf"); // init is alive
        let other = dir.join(format!("kvferry-{dead}.buf"));
        let target = dir.join("target");
        for p in [&stale, &locked, &mine, &live, &other, &target] {
            std::fs::write(p, b"x").unwrap();
        }
        std::os::unix::fs::symlink(&target, &link).unwrap();
        // A live creator (in another pid namespace, say) holds its lock.
        let holder = File::open(&locked).unwrap();
        lock_shared(&holder).unwrap();

        assert_eq!(remove_stale_buffers(&dir), 1);
        assert!(!stale.exists(), "the dead receiver's file is removed");
        for kept in [&locked, &mine, &live, &other, &target] {
            assert!(kept.exists(), "{} must stay", kept.display());
        }
        assert!(
            std::fs::symlink_metadata(&link).is_ok(),
            "a symlink is neither followed nor removed"
        );

        // Once the lock holder is gone, its file is stale too.
        drop(holder);
        assert_eq!(remove_stale_buffers(&dir), 1);
        assert!(!locked.exists());

        // Another uid's file stays (needs root to make one).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let foreign = dir.join(format!("kvferry-{dead}-3.buf"));
            std::fs::write(&foreign, b"x").unwrap();
            std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
            assert_eq!(remove_stale_buffers(&dir), 0);
            assert!(foreign.exists(), "another user's file stays");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_receivers_control_socket_goes_and_a_served_one_stays() {
        use std::os::unix::net::UnixListener;
        assert_eq!(control_socket_pid("kvferry-123-0.buf.ctl"), Some(123));
        assert_eq!(control_socket_pid("kvferry-123-0.buf"), None);
        let dir = scratch();
        let dead = dead_pid();
        let stale = dir.join(format!("kvferry-{dead}-0.buf.ctl"));
        let served = dir.join(format!("kvferry-{dead}-1.buf.ctl"));
        let file = dir.join(format!("kvferry-{dead}-2.buf.ctl"));
        let alive = dir.join("kvferry-1-0.buf.ctl"); // init is alive
        drop(UnixListener::bind(&stale).unwrap()); // its file stays, unserved
        let _listening = UnixListener::bind(&served).unwrap();
        drop(UnixListener::bind(&alive).unwrap());
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(remove_stale_buffers(&dir), 0, "no buffer file here");
        assert!(!stale.exists(), "the dead receiver's socket is removed");
        for kept in [&served, &file, &alive] {
            assert!(kept.exists(), "{} must stay", kept.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
