//! Prometheus exposition of senders' statistics.

use std::sync::Arc;

use crate::metrics::{write_stats, MetricsWriter};
use crate::stats::{Counter, SharedStats};

use super::Sender;

/// Renders the summed statistics of `senders` (one process may run several)
/// as Prometheus text: `kvferry_sender_<counter>_total`,
/// `kvferry_sender_stage_duration_microseconds{stage}`, plus staging and
/// pending-area occupancy and active requests.
pub fn render_metrics(senders: &[Arc<Sender>]) -> String {
    let total = SharedStats::new();
    let (mut staging, mut pending, mut active) = (0usize, 0usize, 0usize);
    for s in senders {
        let stats = s.shared_stats();
        total.merge(&stats.histograms());
        for c in Counter::ALL {
            total.add(c, stats.get(c));
        }
        staging += s.staging_in_use();
        pending += s.pending_bytes();
        active += s.active_requests();
    }
    let mut w = MetricsWriter::new();
    write_stats(&mut w, "sender", &total);
    w.gauge(
        "kvferry_sender_staging_slots_in_use",
        "Staging slots held.",
        staging as f64,
    );
    w.gauge(
        "kvferry_sender_pending_bytes",
        "Bytes held in the pending area.",
        pending as f64,
    );
    w.gauge(
        "kvferry_sender_active_requests",
        "Requests not yet terminal.",
        active as f64,
    );
    w.finish()
}
