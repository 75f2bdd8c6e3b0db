//! Raw Linux futex calls on a 32-bit word. Shared (non-`PRIVATE`) futex ops,
//! so a waiter and a waker in different processes that map the same file meet
//! on the same kernel wait queue (keyed by inode and offset).

use std::ptr;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use crate::sync::FutexWait;

/// `FUTEX_WAIT`: sleep while `*word == expected`, for at most `timeout`.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> FutexWait {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        // subsec_nanos() < 1e9 always fits a c_long.
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, aligned 32-bit atomic for the whole call; the
    // timespec (or null) outlives the call; FUTEX_WAIT reads the other
    // arguments only as plain values. The kernel only reads `*word`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            ptr::null::<u32>(),
            0u32,
        )
    };
    if r == 0 {
        return FutexWait::Woken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => FutexWait::Changed,
        Some(libc::EINTR) => FutexWait::Interrupted,
        Some(libc::ETIMEDOUT) => FutexWait::TimedOut,
        // Any other error (e.g. EFAULT, ENOSYS) cannot be waited on: report a
        // spurious wakeup and let the caller's loop re-check its condition.
        _ => FutexWait::Woken,
    }
}

/// `FUTEX_WAKE` every waiter on `word`. Returns how many were woken.
pub(crate) fn wake_all(word: &AtomicU32) -> usize {
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is live.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            libc::c_int::MAX,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0u32,
        )
    };
    usize::try_from(r).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_with_wrong_value_returns_changed() {
        let w = AtomicU32::new(5);
        assert_eq!(
            wait(&w, 4, Some(Duration::from_secs(5))),
            FutexWait::Changed
        );
    }

    #[test]
    fn wait_times_out() {
        let w = AtomicU32::new(0);
        assert_eq!(
            wait(&w, 0, Some(Duration::from_millis(1))),
            FutexWait::TimedOut
        );
    }

    #[test]
    fn wake_without_waiter_wakes_nobody() {
        let w = AtomicU32::new(0);
        assert_eq!(wake_all(&w), 0);
    }
}
