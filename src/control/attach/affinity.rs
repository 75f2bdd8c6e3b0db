//! An attached client keeping off its daemon's copy-engine CPU. A daemon
//! that keeps a CPU for a copy engine (`--copy-cpu auto`, the default of a
//! sender or node serving attached workers; a receiver's `--spare-cpu`)
//! names it in the hello ([`Hello::engine_cpu`]). Its own threads stay
//! off it, but the clients are other processes: left to the scheduler,
//! a client that runs there takes the CPU from the engine while it has
//! bytes to move, and every hand-off between the client and its session
//! crosses CPUs. So a client, once attached, takes that CPU out of the
//! affinity set of the thread that attached, as the daemon does for its
//! own threads, unless the thread may run there only (a placement of the
//! operator's, kept) or [`KEEP_AFFINITY_ENV`] is set. Threads the client's
//! process spawns afterwards from that thread inherit the set; others keep
//! theirs. docs/attach.md, "Placing the threads".

use std::ffi::OsStr;

use super::layout::{Hello, NO_CPU};

/// Set to anything but empty or `0`, a client keeps the attaching
/// thread's affinity set as it is (the Python client reads the same).
pub const KEEP_AFFINITY_ENV: &str = "KVFERRY_ATTACH_KEEP_AFFINITY";

/// The CPU a client should take out of its thread's set, given the hello's
/// [`Hello::engine_cpu`] and the value of [`KEEP_AFFINITY_ENV`].
fn to_keep_off(engine_cpu: u32, keep: Option<&OsStr>) -> Option<usize> {
    let opted_out = keep.is_some_and(|v| !v.is_empty() && v != "0");
    if opted_out || engine_cpu == NO_CPU {
        return None;
    }
    usize::try_from(engine_cpu).ok()
}

/// Takes the CPU `hello` names out of the calling thread's affinity set
/// (module docs); returns it if it did.
pub(super) fn keep_off_engine_cpu(hello: &Hello) -> Option<usize> {
    let keep = std::env::var_os(KEEP_AFFINITY_ENV);
    let cpu = to_keep_off(hello.engine_cpu, keep.as_deref())?;
    let moved = crate::threads::keep_current_off(cpu);
    tracing::debug!(
        cpu,
        moved,
        "attach: keeping off the daemon's copy-engine CPU"
    );
    moved.then_some(cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_cpu_is_kept_off_unless_none_is_named_or_the_user_opted_out() {
        assert_eq!(to_keep_off(1, None), Some(1));
        assert_eq!(
            to_keep_off(0, Some(OsStr::new(""))),
            Some(0),
            "empty: unset"
        );
        assert_eq!(
            to_keep_off(3, Some(OsStr::new("0"))),
            Some(3),
            "0: not opted out"
        );
        assert_eq!(to_keep_off(1, Some(OsStr::new("1"))), None);
        assert_eq!(to_keep_off(1, Some(OsStr::new("yes"))), None);
        assert_eq!(to_keep_off(NO_CPU, None), None, "the daemon keeps no CPU");
    }

    #[test]
    fn a_hello_naming_a_cpu_of_the_threads_set_takes_it_out() {
        crate::threads::on_two_cpus("none to keep off", |a, b| {
            let mut hello = Hello::refusal(0);
            assert_eq!(keep_off_engine_cpu(&hello), None, "no CPU named");
            hello.engine_cpu = b as u32;
            // The test binary never sets KEEP_AFFINITY_ENV.
            assert_eq!(keep_off_engine_cpu(&hello), Some(b));
            assert_eq!(crate::threads::current_cpus(), vec![a]);
            hello.engine_cpu = a as u32;
            assert_eq!(keep_off_engine_cpu(&hello), None, "the only CPU left stays");
            assert_eq!(crate::threads::current_cpus(), vec![a]);
        });
    }
}
