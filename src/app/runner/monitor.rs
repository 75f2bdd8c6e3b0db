//! The run's monitor, on the calling thread: samples occupancy peaks, shows
//! progress, and is the watchdog that declares a deadlock when no request
//! finishes for the stall timeout.

use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Progress, Run};

/// What the monitor saw.
pub(super) struct Watch {
    pub deadlock: bool,
    pub dump: Vec<String>,
    pub max_admitted: Vec<u64>,
    pub peak_staging: u64,
    pub peak_receiver: u64,
}

/// Sampling period of occupancy and progress.
const TICK: Duration = Duration::from_millis(25);

/// Watches until every request finished or the watchdog fires.
pub(super) fn watch(run: &Arc<Run>, progress: Progress, started: Instant) -> Watch {
    let total = run.cfg.requests as u64;
    let mut w = Watch {
        deadlock: false,
        dump: Vec::new(),
        max_admitted: vec![0; run.receivers.len()],
        peak_staging: 0,
        peak_receiver: 0,
    };
    let bar = (progress == Progress::Bar && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let mut last_line = Instant::now();
    let mut last_progress = (0u64, Instant::now());
    loop {
        // Relaxed: statistics only.
        let finished = run.tally.finished.load(Ordering::Relaxed);
        let staging: u64 = run.senders.iter().map(|s| s.staging_in_use() as u64).sum();
        w.peak_staging = w.peak_staging.max(staging);
        let mut recv = 0;
        for (i, r) in run.receivers.iter().enumerate() {
            let s = r.stats();
            recv += s.allocated_chunks as u64;
            let admitted = s
                .core
                .tracked_requests
                .saturating_sub(s.core.parked_requests) as u64;
            w.max_admitted[i] = w.max_admitted[i].max(admitted);
        }
        w.peak_receiver = w.peak_receiver.max(recv);
        let bytes: u64 = run
            .senders
            .iter()
            .map(|s| s.stats().counter(crate::stats::Counter::Bytes))
            .sum();
        let gbps = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9;
        if let Some(b) = &bar {
            b.set_position(finished);
            b.set_message(format!("{gbps:.2} GB/s"));
        } else if progress != Progress::Quiet && last_line.elapsed() >= Duration::from_secs(2) {
            last_line = Instant::now();
            eprintln!("kvferry run: {finished}/{total} requests finished, {gbps:.2} GB/s");
        }
        if finished >= total {
            break;
        }
        if finished != last_progress.0 {
            last_progress = (finished, Instant::now());
        } else if last_progress.1.elapsed() >= run.cfg.stall_timeout() {
            w.deadlock = true;
            for (i, s) in run.senders.iter().enumerate() {
                for line in s.dump() {
                    w.dump.push(format!("prefiller {i}: {line}"));
                }
            }
            for (i, r) in run.receivers.iter().enumerate() {
                w.dump.push(format!("decoder {i}: {:?}", r.stats()));
            }
            w.dump.extend(thread_states());
            break;
        }
        std::thread::sleep(TICK);
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    w
}

/// One line per thread of this process: name, scheduler state and the
/// kernel function it sleeps in (Linux `/proc`), for the stall dump.
fn thread_states() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for t in tasks.flatten() {
        let dir = t.path();
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let state = read("stat")
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next().map(str::to_owned));
        lines.push(format!(
            "thread {} {:?}: state {}, waiting in {}",
            t.file_name().to_string_lossy(),
            read("comm"),
            state.unwrap_or_default(),
            read("wchan")
        ));
    }
    lines
}
