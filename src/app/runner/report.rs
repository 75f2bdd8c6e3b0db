//! The report printed at the end of `kvferry run`: a readable table, or one
//! JSON object with `--json`.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::stats::{LatencySummary, Stage, StageSummary};

use super::config::RunConfig;

/// p50 / p99 / max of one stage, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest sample.
    pub max: u64,
    /// Samples.
    pub count: u64,
}

impl From<&LatencySummary> for Percentiles {
    fn from(s: &LatencySummary) -> Self {
        Self {
            p50: s.p50_us,
            p99: s.p99_us,
            max: s.max_us,
            count: s.count,
        }
    }
}

/// Everything the run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunReport {
    /// Requests whose every chunk reached its decoder and verified.
    pub completed: u64,
    /// Requests the prefillers cancelled on purpose.
    pub aborted: u64,
    /// Requests that failed (injected write failures, or anything else).
    pub failed: u64,
    /// Failures not caused by fault injection.
    pub unexpected_failures: u64,
    /// Failed requests by error code, with one example reason each.
    pub failures: BTreeMap<String, (u64, String)>,
    /// Payload bytes moved by completed writes.
    pub bytes: u64,
    /// Payload throughput, GB/s (10^9 bytes).
    pub gbps: f64,
    /// Chunks moved per second.
    pub chunks_per_s: f64,
    /// Per-stage latency (µs): pending, admission_wait, staging_wait,
    /// transfer, notify, and end_to_end (first store → decoder verified).
    pub latency_us: BTreeMap<&'static str, Percentiles>,
    /// Most requests admitted at once, per decoder.
    pub max_concurrent_admitted: Vec<u64>,
    /// Most staging slots in use at once, summed over prefillers.
    pub peak_staging_slots: u64,
    /// Most receive slots in use at once, summed over decoders.
    pub peak_receiver_slots: u64,
    /// Staging slots still held at the end.
    pub leaked_staging_slots: u64,
    /// Receive slots still held at the end.
    pub leaked_receiver_slots: u64,
    /// Reserved chunks still held at the end.
    pub leaked_reservations: u64,
    /// Chunks whose bytes did not match what was stored (or were missing).
    pub checksum_mismatches: u64,
    /// Wall-clock seconds of the run.
    pub elapsed_s: f64,
    /// The watchdog found no progress for the stall timeout.
    pub deadlock: bool,
    /// Peak resident memory of the process, bytes.
    pub peak_rss_bytes: u64,
    /// Registered memory (staging + receive buffers), bytes.
    pub registered_bytes: u64,
    /// How prefillers handed chunks over: `"in-place"` (`Request::stage`,
    /// filled in staging) or `"copying-store"` (`Sender::store`).
    pub sender_path: String,
    /// Copies the sender made of each chunk before the data plane: 0 in
    /// place, 1 through `store` (a batch stored before its request was
    /// admitted waits in the pending area: one more).
    pub sender_copies_per_chunk: u32,
    /// The configuration that ran.
    pub config: RunConfig,
    /// State dump taken by the watchdog (empty unless `deadlock`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stall_dump: Vec<String>,
}

impl RunReport {
    /// Fills `latency_us` from a stage summary plus the end-to-end numbers.
    pub fn set_latencies(&mut self, stages: &StageSummary, end_to_end: Percentiles) {
        for stage in Stage::ALL {
            self.latency_us
                .insert(stage.name(), Percentiles::from(stages.get(stage)));
        }
        self.latency_us.insert("end_to_end", end_to_end);
    }

    /// True if nothing leaked, nothing was corrupted, no deadlock, and every
    /// request that was not deliberately aborted or failed completed.
    pub fn success(&self) -> bool {
        !self.deadlock
            && self.unexpected_failures == 0
            && self.checksum_mismatches == 0
            && self.leaked_staging_slots == 0
            && self.leaked_receiver_slots == 0
            && self.leaked_reservations == 0
            && self.completed + self.aborted + self.failed == self.config.requests as u64
    }

    /// The verdict the table's last line and the JSON's `result` give:
    /// `"OK"` if [`success`](Self::success), else `"FAILED"`.
    pub fn verdict(&self) -> &'static str {
        if self.success() {
            "OK"
        } else {
            "FAILED"
        }
    }

    /// The report as one pretty-printed JSON object: `result` (the
    /// [`verdict`](Self::verdict)) first, then every field.
    pub fn to_json(&self) -> serde_json::Result<String> {
        #[derive(Serialize)]
        struct WithVerdict<'a> {
            result: &'static str,
            #[serde(flatten)]
            report: &'a RunReport,
        }
        serde_json::to_string_pretty(&WithVerdict {
            result: self.verdict(),
            report: self,
        })
    }

    /// The readable table.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        let _ = writeln!(
            s,
            "kvferry run: {}P{}D over {}, {} requests of {} chunks × {} KiB, batch {}, concurrency {}/prefiller",
            c.prefillers,
            c.decoders,
            c.transport,
            c.requests,
            c.chunks,
            c.chunk_bytes / 1024,
            c.batch,
            c.concurrency
        );
        let _ = writeln!(
            s,
            "  receive buffer {} slots/decoder, staging {} slots/prefiller, abort rate {}, fail rate {}, seed {}",
            c.capacity_chunks, c.staging_slots, c.abort_rate, c.fail_rate, c.seed
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  requests     completed {:>8}   aborted {:>6}   failed {:>6}",
            self.completed, self.aborted, self.failed
        );
        let _ = writeln!(
            s,
            "  moved        {:>10.2} GB in {:.2} s   {:>7.2} GB/s   {:>9.0} chunks/s",
            self.bytes as f64 / 1e9,
            self.elapsed_s,
            self.gbps,
            self.chunks_per_s
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  latency (µs)          p50        p99        max    samples"
        );
        for (name, p) in &self.latency_us {
            let _ = writeln!(
                s,
                "    {name:<16} {:>10} {:>10} {:>10} {:>10}",
                p.p50, p.p99, p.max, p.count
            );
        }
        let _ = writeln!(s);
        let admitted: Vec<String> = self
            .max_concurrent_admitted
            .iter()
            .map(u64::to_string)
            .collect();
        let _ = writeln!(
            s,
            "  max concurrent admitted per decoder   {}",
            admitted.join(", ")
        );
        let _ = writeln!(
            s,
            "  peak staging slots in use             {} of {}",
            self.peak_staging_slots,
            c.staging_slots * c.prefillers
        );
        let _ = writeln!(
            s,
            "  peak receive slots in use             {} of {}",
            self.peak_receiver_slots,
            c.capacity_chunks * c.decoders
        );
        let _ = writeln!(
            s,
            "  sender path                           {} ({} sender copies per chunk{}, then the {} data plane's)",
            self.sender_path,
            self.sender_copies_per_chunk,
            if self.sender_copies_per_chunk > 0 {
                "; +1 for batches held in the pending area"
            } else {
                ""
            },
            c.transport
        );
        let _ = writeln!(
            s,
            "  memory                                peak RSS {:.1} MiB, registered buffers {:.1} MiB",
            self.peak_rss_bytes as f64 / (1 << 20) as f64,
            self.registered_bytes as f64 / (1 << 20) as f64
        );
        let _ = writeln!(s);
        let ok = |v: u64| {
            if v == 0 {
                "0 ✓".to_string()
            } else {
                format!("{v} ✗")
            }
        };
        let _ = writeln!(
            s,
            "  leak check   staging slots {}   receive slots {}   reservations {}",
            ok(self.leaked_staging_slots),
            ok(self.leaked_receiver_slots),
            ok(self.leaked_reservations)
        );
        let _ = writeln!(
            s,
            "  integrity    checksum mismatches {}   unexpected failures {}",
            ok(self.checksum_mismatches),
            ok(self.unexpected_failures)
        );
        if self.deadlock {
            let _ = writeln!(
                s,
                "  DEADLOCK: no request finished for {} s; state dump:",
                c.stall_timeout_s
            );
            for line in &self.stall_dump {
                let _ = writeln!(s, "    {line}");
            }
        }
        let _ = writeln!(s, "  result       {}", self.verdict());
        s
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}
