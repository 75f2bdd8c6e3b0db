//! `--cpus`: the CPUs a daemon's threads run on.

use clap::Args;

use crate::threads;

/// A CPU list as `taskset -c` spells it: ids and ranges, comma-separated
/// (`0`, `0,2`, `0-3,6`); sorted, without repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

impl CpuList {
    /// Parses `s`; an empty list, an empty item, a reversed range or an id
    /// that is not a number is an error naming it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let id = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("{t:?} in {s:?} is not a CPU id"))
        };
        let mut cpus = Vec::new();
        for item in s.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(format!("{s:?} has an empty item"));
            }
            let Some((lo, hi)) = item.split_once('-') else {
                cpus.push(id(item)?);
                continue;
            };
            let (lo, hi) = (id(lo)?, id(hi)?);
            if lo > hi {
                return Err(format!("{item:?} in {s:?} is a reversed range"));
            }
            // Bounded by the kernel's set size before it is expanded.
            if hi >= threads::CPU_SET_CAPACITY {
                return Err(format!("{hi} in {s:?} is past the largest CPU id"));
            }
            cpus.extend(lo..=hi);
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(Self(cpus))
    }
}

/// The `--cpus` option every daemon takes.
#[derive(Debug, Args)]
pub struct CpuArgs {
    /// Run every thread of this process (ZMQ's included) on these CPUs:
    /// ids and ranges, as `taskset -c` takes them (e.g. `0` or `0-3,6`).
    /// A thread given a CPU of its own (`kvferry sender --copy-cpu`) runs
    /// there instead: leave that CPU out of this list to keep the others
    /// off it. Default: the CPUs the process was started on.
    #[arg(long, value_name = "LIST", value_parser = CpuList::parse)]
    pub cpus: Option<CpuList>,
}

impl CpuArgs {
    /// Checks each of `pins` (an option of the daemon that names one CPU,
    /// and its value if given) against the CPUs this process may run on,
    /// then confines the calling thread, and so every thread spawned
    /// after, to `--cpus`; call it before the daemon starts anything. The
    /// error names the option.
    pub fn apply(&self, pins: &[(&str, Option<usize>)]) -> Result<(), String> {
        for &(option, pin) in pins {
            if let Some(cpu) = pin {
                threads::check_allowed(cpu).map_err(|e| format!("{option}: {e}"))?;
            }
        }
        let Some(list) = &self.cpus else {
            return Ok(());
        };
        threads::confine_current(&list.0).map_err(|e| format!("--cpus: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_list_takes_ids_and_ranges_sorted_without_repeats() {
        assert_eq!(CpuList::parse("0"), Ok(CpuList(vec![0])));
        assert_eq!(CpuList::parse("3, 0-2,2"), Ok(CpuList(vec![0, 1, 2, 3])));
        assert_eq!(CpuList::parse("6,1-1"), Ok(CpuList(vec![1, 6])));
    }

    #[test]
    fn a_bad_cpu_list_is_an_error_naming_the_bad_part() {
        for (bad, says) in [
            ("", "empty item"),
            ("0,,1", "empty item"),
            ("x", "\"x\" in \"x\" is not a CPU id"),
            ("3-1", "reversed range"),
            ("0-", "is not a CPU id"),
            ("-1", "is not a CPU id"),
            ("0-99999999999", "past the largest CPU id"),
        ] {
            let e = CpuList::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_pin_this_process_may_not_run_on_is_refused_by_name() {
        let none = CpuArgs { cpus: None };
        assert_eq!(
            none.apply(&[("--copy-cpu", Some(threads::allowed_cpus()[0]))]),
            Ok(())
        );
        assert_eq!(none.apply(&[("--copy-cpu", None)]), Ok(()));
        let e = none.apply(&[("--copy-cpu", Some(1000))]).unwrap_err();
        assert!(e.starts_with("--copy-cpu: cpu 1000 is not"), "{e}");
        // Each pin is checked, the first bad one named.
        let e = none
            .apply(&[("--copy-cpu", None), ("--pin-cpu", Some(1000))])
            .unwrap_err();
        assert!(e.starts_with("--pin-cpu: cpu 1000 is not"), "{e}");
    }
}
