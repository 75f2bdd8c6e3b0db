//! `--cpus`: the CPUs a daemon's threads run on; `--copy-cpu`: the CPU its
//! copy engine runs on; `--spare-cpu`: the CPU a receiver leaves to a
//! sender's copy engine.

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

/// `--copy-cpu`: where a daemon that serves attached prefill workers
/// (`kvferry sender --attach`, `kvferry node`) runs its transport's engine
/// thread (shm's copy engine, the one thread that moves the workers' bytes
/// and the pipeline's serial stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyCpu {
    /// The default: when `--cpus` is not given and the process may run on
    /// two CPUs or more, the last of them goes to the engine alone and
    /// every other thread of the daemon runs on the rest ([`auto_split`]);
    /// otherwise the scheduler's choice.
    Auto,
    /// The scheduler's choice: no pin, no CPU kept for the engine.
    None,
    /// Pinned to this CPU (leave it out of `--cpus` to keep the daemon's
    /// other threads off it).
    Cpu(usize),
}

impl CopyCpu {
    /// Parses `auto`, `none` or a CPU id; anything else is an error naming it.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            t => t
                .parse()
                .map(Self::Cpu)
                .map_err(|_| format!("{s:?} is not a CPU id, `auto` or `none`")),
        }
    }

    /// The choice of a daemon that places threads only while it serves
    /// attached processes (`attached`): the option as `given`, `auto` by
    /// default; without `--attach`, [`CopyCpu::None`] (the option needs it).
    pub fn for_attach(given: Option<Self>, attached: bool) -> Self {
        if attached {
            given.unwrap_or(Self::Auto)
        } else {
            Self::None
        }
    }

    /// Parses `--spare-cpu`: `auto` or `none` (a receiver has no engine of
    /// its own to pin; `--cpus` keeps its threads off any other CPU).
    pub fn parse_spare(s: &str) -> Result<Self, String> {
        match Self::parse(s) {
            Ok(Self::Cpu(_)) | Err(_) => Err(format!(
                "{s:?} is not `auto` or `none` (to keep off another CPU, list the others in --cpus)"
            )),
            choice => choice,
        }
    }
}

/// `--copy-cpu auto` without `--cpus`: the engine's CPU and the CPUs of
/// every other thread, from the CPUs the process may run on (`allowed`,
/// sorted) and those the daemon's other options pin a thread to
/// (`pinned`). The engine takes the last allowed CPU no option pins a
/// thread to, the rest of the process every other allowed CPU; `None`
/// (leave every thread to the scheduler) when that leaves no CPU for the
/// rest, as on a one-CPU machine.
///
/// Why by default: on a machine with few CPUs the scheduler puts the
/// daemon's hand-off threads (control, sessions, completion poll) beside
/// the engine, which then waits for a CPU while it has bytes to move; kept
/// apart, end to end ran 1.2× faster on the project's two-vCPU VM with the
/// workers left to the scheduler (docs/attach.md, "Placing the threads").
/// On a machine with many CPUs it costs one CPU's worth of choice for a
/// thread that sleeps when idle.
pub fn auto_split(allowed: &[usize], pinned: &[usize]) -> Option<(usize, Vec<usize>)> {
    let copy = *allowed.iter().rev().find(|c| !pinned.contains(c))?;
    let rest: Vec<usize> = allowed.iter().copied().filter(|&c| c != copy).collect();
    (!rest.is_empty()).then_some((copy, rest))
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
    /// Checks `copy` (the option that chose it, `--copy-cpu` or a
    /// receiver's `--spare-cpu`, and its value) and each of `pins` (an
    /// option of the daemon that names one CPU, and its value if given)
    /// against the CPUs this process may run on, then confines the calling
    /// thread, and so every thread spawned after, to `--cpus`, or with
    /// [`CopyCpu::Auto`] and no `--cpus` to the CPUs [`auto_split`] leaves
    /// the rest; call it before the daemon starts anything. Returns the CPU
    /// to pin the copy engine to, if any (for `--spare-cpu`, the CPU left
    /// to a sender's; a daemon without either passes [`CopyCpu::None`]).
    /// The error names the option.
    pub fn apply(
        &self,
        (copy_option, copy): (&str, CopyCpu),
        pins: &[(&str, Option<usize>)],
    ) -> Result<Option<usize>, String> {
        let copy_pin = match copy {
            CopyCpu::Cpu(cpu) => Some(cpu),
            CopyCpu::Auto | CopyCpu::None => None,
        };
        for &(option, pin) in std::iter::once(&(copy_option, copy_pin)).chain(pins) {
            if let Some(cpu) = pin {
                threads::check_allowed(cpu).map_err(|e| format!("{option}: {e}"))?;
            }
        }
        let (confine, copy_pin) = match (&self.cpus, copy) {
            (Some(list), _) => (Some(list.0.clone()), copy_pin),
            (None, CopyCpu::Auto) => {
                let pinned: Vec<usize> = pins.iter().filter_map(|&(_, p)| p).collect();
                match auto_split(threads::allowed_cpus(), &pinned) {
                    Some((copy, rest)) => (Some(rest), Some(copy)),
                    None => (None, None),
                }
            }
            (None, _) => (None, copy_pin),
        };
        if let Some(cpus) = confine {
            threads::confine_current(&cpus).map_err(|e| match self.cpus {
                Some(_) => format!("--cpus: {e}"),
                None => format!("{copy_option} auto: {e}"),
            })?;
        }
        Ok(copy_pin)
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
        // Neither `--cpus` nor `auto`: nothing is confined, so the test
        // thread keeps its CPUs.
        let none = CpuArgs { cpus: None };
        let first = threads::allowed_cpus()[0];
        assert_eq!(
            none.apply(("--copy-cpu", CopyCpu::Cpu(first)), &[]),
            Ok(Some(first))
        );
        assert_eq!(
            none.apply(("--copy-cpu", CopyCpu::None), &[("--pin-cpu", None)]),
            Ok(None)
        );
        let e = none
            .apply(("--copy-cpu", CopyCpu::Cpu(1000)), &[])
            .unwrap_err();
        assert!(e.starts_with("--copy-cpu: cpu 1000 is not"), "{e}");
        // Each pin is checked, the first bad one named.
        let e = none
            .apply(("--copy-cpu", CopyCpu::None), &[("--pin-cpu", Some(1000))])
            .unwrap_err();
        assert!(e.starts_with("--pin-cpu: cpu 1000 is not"), "{e}");
        // A bad pin is refused before `auto` confines anything.
        let e = none
            .apply(("--spare-cpu", CopyCpu::Auto), &[("--pin-cpu", Some(1000))])
            .unwrap_err();
        assert!(e.starts_with("--pin-cpu: cpu 1000 is not"), "{e}");
    }

    #[test]
    fn copy_cpu_takes_auto_none_or_a_cpu_id() {
        assert_eq!(CopyCpu::parse("auto"), Ok(CopyCpu::Auto));
        assert_eq!(CopyCpu::parse("none"), Ok(CopyCpu::None));
        assert_eq!(CopyCpu::parse(" 3"), Ok(CopyCpu::Cpu(3)));
        for bad in ["", "-1", "x", "1,2", "Auto"] {
            let e = CopyCpu::parse(bad).unwrap_err();
            assert!(
                e.contains("is not a CPU id, `auto` or `none`"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_daemon_places_threads_only_while_it_serves_attached_processes() {
        assert_eq!(CopyCpu::for_attach(None, true), CopyCpu::Auto);
        assert_eq!(
            CopyCpu::for_attach(Some(CopyCpu::Cpu(1)), true),
            CopyCpu::Cpu(1)
        );
        assert_eq!(
            CopyCpu::for_attach(Some(CopyCpu::None), true),
            CopyCpu::None
        );
        assert_eq!(CopyCpu::for_attach(None, false), CopyCpu::None);
    }

    #[test]
    fn spare_cpu_takes_auto_or_none_only() {
        assert_eq!(CopyCpu::parse_spare("auto"), Ok(CopyCpu::Auto));
        assert_eq!(CopyCpu::parse_spare(" none"), Ok(CopyCpu::None));
        for bad in ["", "1", "x", "Auto"] {
            let e = CopyCpu::parse_spare(bad).unwrap_err();
            assert!(e.contains("is not `auto` or `none`"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn auto_gives_the_engine_the_last_cpu_no_option_pins_and_the_rest_the_others() {
        assert_eq!(auto_split(&[0, 1], &[]), Some((1, vec![0])));
        assert_eq!(auto_split(&[0, 2, 5, 7], &[]), Some((7, vec![0, 2, 5])));
        // A CPU another option pins a thread to is not the engine's.
        assert_eq!(auto_split(&[0, 1, 2], &[2]), Some((1, vec![0, 2])));
        assert_eq!(auto_split(&[0, 1], &[1]), Some((0, vec![1])));
        // Nothing left for the rest, or no CPU for the engine: the
        // scheduler's choice.
        assert_eq!(auto_split(&[3], &[]), None);
        assert_eq!(auto_split(&[3], &[3]), None);
        assert_eq!(auto_split(&[], &[]), None);
    }
}
