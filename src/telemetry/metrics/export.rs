//! Writing a [`SharedStats`] as Prometheus metrics named
//! `kvferry_<role>_<name>`.

use super::names::sanitize_metric_name;
use super::MetricsWriter;
use crate::stats::{Counter, Gauge, SharedStats, Stage};

/// Default upper bounds (µs) for the stage latency histograms: 10 µs .. 10 s.
pub const DEFAULT_LATENCY_BUCKETS_US: &[u64] = &[
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 10_000_000,
];

/// Write every counter, gauge and stage histogram of `stats`:
///
/// - `kvferry_<role>_<counter>_total` (counter), e.g. `kvferry_sender_bytes_total`;
/// - `kvferry_<role>_<gauge>` (gauge), e.g. `kvferry_receiver_slots_in_use`;
/// - `kvferry_<role>_stage_duration_microseconds{stage="<stage>"}` (histogram
///   with [`DEFAULT_LATENCY_BUCKETS_US`]).
///
/// `role` (`sender`, `receiver`, `proxy`, …) is sanitised to a valid name
/// part, so it may come from configuration.
pub fn write_stats(w: &mut MetricsWriter, role: &str, stats: &SharedStats) {
    let role = sanitize_metric_name(role);
    let counters = stats.counters();
    for c in Counter::ALL {
        let name = format!("kvferry_{role}_{}_total", c.name());
        w.counter(&name, c.help(), counters.get(c));
    }
    let gauges = stats.gauges();
    for g in Gauge::ALL {
        let name = format!("kvferry_{role}_{}", g.name());
        w.gauge(&name, g.help(), gauges.get(g) as f64);
    }
    let hists = stats.histograms();
    let name = format!("kvferry_{role}_stage_duration_microseconds");
    for stage in Stage::ALL {
        w.histogram_with_labels(
            &name,
            "Time a request spends in each pipeline stage, in microseconds.",
            &[("stage", stage.name())],
            hists.get(stage),
            DEFAULT_LATENCY_BUCKETS_US,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn writes_all_stats_with_role_prefix() {
        let s = SharedStats::new();
        s.add(Counter::Bytes, 4096);
        s.gauge_set(Gauge::SlotsInUse, 3);
        s.record(Stage::Transfer, Duration::from_micros(70));
        let mut w = MetricsWriter::new();
        write_stats(&mut w, "send-er", &s);
        let text = w.finish();
        assert!(
            text.contains("\nkvferry_send_er_bytes_total 4096\n"),
            "{text}"
        );
        assert!(text.contains("\nkvferry_send_er_slots_in_use 3\n"));
        assert!(text.contains(
            "kvferry_send_er_stage_duration_microseconds_bucket{stage=\"transfer\",le=\"50\"} 0\n\
             kvferry_send_er_stage_duration_microseconds_bucket{stage=\"transfer\",le=\"100\"} 1\n"
        ));
        for c in Counter::ALL {
            assert!(text.contains(&format!(
                "# TYPE kvferry_send_er_{}_total counter",
                c.name()
            )));
        }
        for stage in Stage::ALL {
            assert!(text.contains(&format!(
                "kvferry_send_er_stage_duration_microseconds_count{{stage=\"{}\"}}",
                stage.name()
            )));
        }
        assert_eq!(
            text.matches("# TYPE kvferry_send_er_stage_duration_microseconds histogram")
                .count(),
            1
        );
    }
}
