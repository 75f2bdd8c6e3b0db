//! Leftovers of kvferry processes that died without cleaning up (SIGKILL,
//! a crash) in a tmpfs several processes share (`/dev/shm`): the name
//! rule (`<prefix><pid>-<n><suffix>`), whether the process of a pid is
//! gone, and the non-blocking `flock` every live owner holds on its file, which is what finally keeps a live owner's leftovers
//! (its pid may mean nothing here: another pid namespace). The sweeps
//! itself is the owner's: receive-buffer files
//! (`region::remove_stale_buffers`). (Attach rings are memfds: they leave
//! nothing behind.)

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `<prefix><pid>-<n><suffix>` → `pid` (decimal digits only, pid > 0), or
/// `None` for any other name.
pub(crate) fn pid_in_name(name: &str, prefix: &str, suffix: &str) -> Option<u32> {
    let (pid, n) = name
        .strip_prefix(prefix)?
        .strip_suffix(suffix)?
        .split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(n) {
        return None;
    }
    pid.parse().ok().filter(|&p| p > 0)
}

/// `flock(file, op | LOCK_NB)`: `WouldBlock` if another open file
/// description holds a conflicting lock.
pub(crate) fn flock_nb(file: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: flock on a descriptor this `File` owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Where the process of a pid stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// No such process, or a zombie: it cannot use anything.
    Dead,
    /// A live process that started at this time (`None`: unknown).
    Alive(Option<SystemTime>),
}

/// The state of process `pid`, from `/proc/<pid>/stat`.
pub(crate) fn owner(pid: u32) -> Owner {
    let stat = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Owner::Dead,
        // Unreadable (hidepid): treat as alive, start unknown.
        Err(_) => return Owner::Alive(None),
    };
    // Fields after the command name (which may contain spaces and ')'):
    // state is field 3, starttime field 22 (proc(5)).
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return Owner::Alive(None);
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return Owner::Dead;
    }
    let started = fields
        .get(19)
        .and_then(|t| t.parse::<u64>().ok())
        .and_then(|ticks| Some(boot_time()? + ticks_to_duration(ticks)?));
    Owner::Alive(started)
}

fn ticks_to_duration(ticks: u64) -> Option<Duration> {
    // SAFETY: sysconf takes an integer name and has no other effect.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0)?;
    Some(Duration::from_secs(ticks / hz) + Duration::from_nanos((ticks % hz) * 1_000_000_000 / hz))
}

/// The boot time (`btime` of `/proc/stat`, whole seconds).
fn boot_time() -> Option<SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_started_in_the_past() {
        match owner(std::process::id()) {
            Owner::Alive(Some(started)) => {
                assert!(
                    started <= SystemTime::now() + Duration::from_secs(2),
                    "{started:?}"
                )
            }
            other => panic!("this process reads as {other:?}"),
        }
        // pid_max is at most 2^22: this pid never exists.
        assert_eq!(owner(u32::MAX / 2), Owner::Dead);
    }
}
