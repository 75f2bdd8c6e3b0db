//! Ring directories left by attach daemons that died without their `Drop`
//! (SIGKILL, a crash): `kvferry-attach-<pid>-<n>` in the ring directory's
//! parent (`/dev/shm` by default). A starting daemon removes those that
//! are this user's and whose daemon is gone. Never another live daemon's:
//! a directory is stale only if no process has its pid, the process with
//! that pid is a zombie, or that process started after the directory last
//! changed (the pid was reused), and no process holds the `flock` every
//! daemon keeps on its directory (which also covers daemons in another pid
//! namespace sharing `/dev/shm`). Symlinks are never followed.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use super::poll::own_uid;
use crate::primitives::stale;

/// Name prefix of every attach ring directory (`AttachConfig::new`).
pub(super) const PREFIX: &str = "kvferry-attach-";

/// Entries of `parent` scanned at most per start (a bound on the work a
/// crowded `/dev/shm` causes).
const MAX_SCAN: usize = 4096;

/// The pid in a ring directory's name `kvferry-attach-<pid>-<n>`.
pub(super) fn pid_of(name: &str) -> Option<u32> {
    stale::pid_in_name(name, PREFIX, "")
}

/// Opens directory `dir` (not through a symlink) and takes an exclusive
/// `flock` on it: blocking-free; `WouldBlock` if another process holds it.
pub(super) fn try_lock(dir: &Path) -> io::Result<fs::File> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)?;
    stale::flock_nb(&f, libc::LOCK_EX)?;
    Ok(f)
}

/// The lock a daemon holds on its own ring directory for its life.
pub(super) fn lock_dir(dir: &Path) -> io::Result<fs::File> {
    try_lock(dir).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "attach ring directory {}: cannot lock it: {e}",
                dir.display()
            ),
        )
    })
}

/// Removes the stale ring directories in `parent` (see the module docs);
/// returns how many. Errors of single entries are logged and skipped.
pub(super) fn remove_stale(parent: &Path) -> usize {
    let Ok(entries) = fs::read_dir(parent) else {
        return 0;
    };
    let uid = own_uid();
    let mut removed = 0;
    for entry in entries.take(MAX_SCAN).flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(pid_of) else {
            continue;
        };
        let path = entry.path();
        // lstat: a symlink is not a directory here, so it is never followed.
        let Ok(m) = fs::symlink_metadata(&path) else {
            continue;
        };
        if !m.is_dir() || m.uid() != uid {
            continue;
        }
        let changed = UNIX_EPOCH
            + Duration::from_secs(u64::try_from(m.ctime()).unwrap_or(0))
            + Duration::from_nanos(u64::try_from(m.ctime_nsec()).unwrap_or(0));
        if !stale::is_stale(changed, stale::owner(pid)) {
            continue;
        }
        // A live daemon (whatever its pid namespace) holds the lock; ours,
        // held while removing, is dropped with the directory.
        let Ok(_lock) = try_lock(&path) else {
            tracing::debug!(dir = %path.display(), "attach: ring directory locked by a live daemon");
            continue;
        };
        // remove_dir_all does not follow symlinks inside the directory.
        match fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::info!(dir = %path.display(), pid, "attach: removed a dead daemon's ring directory");
                removed += 1;
            }
            Err(e) => {
                tracing::warn!(dir = %path.display(), error = %e, "attach: cannot remove a stale ring directory")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_strictly() {
        assert_eq!(pid_of("kvferry-attach-123-0"), Some(123));
        assert_eq!(pid_of("kvferry-attach-123-45"), Some(123));
        for bad in [
            "kvferry-attach-123",
            "kvferry-attach--0",
            "kvferry-attach-0-0",
            "kvferry-attach-12a-0",
            "kvferry-attach-12-0x",
            "kvferry-attach-12-",
            "kvferry-recv-12-0",
            "xkvferry-attach-12-0",
        ] {
            assert_eq!(pid_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_locked_directory_cannot_be_locked_again() {
        let d = std::env::temp_dir().join(format!("kvferry-lock-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir(&d).unwrap();
        let held = lock_dir(&d).unwrap();
        // flock locks belong to the open file description: a second open
        // (as another daemon's cleanup does) is refused.
        let e = try_lock(&d).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        drop(held);
        assert!(try_lock(&d).is_ok());
        let link = d.with_extension("link");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(try_lock(&link).is_err(), "never through a symlink");
        fs::remove_file(&link).unwrap();
        fs::remove_dir(&d).unwrap();
    }
}
