//! Prometheus exposition of a receiver's accounting.

use crate::metrics::MetricsWriter;

use super::Receiver;

/// Bucket bounds (µs) of the admission-wait histogram.
const ADMISSION_BUCKETS_US: &[u64] = &[
    10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 60_000_000,
];

/// Writes one gauge a row: (name, help, value).
fn gauges(w: &mut MetricsWriter, rows: &[(&str, &str, f64)]) {
    for &(name, help, value) in rows {
        w.gauge(name, help, value);
    }
}

impl Receiver {
    /// The receiver's metrics in Prometheus text format 0.0.4.
    pub fn render_metrics(&self) -> String {
        let s = self.stats();
        let hist = self.admission_wait_histogram();
        let mut w = MetricsWriter::new();
        #[rustfmt::skip]
        let rows = [
            ("kvferry_receiver_capacity_chunks", "Slots in the receive buffer.", s.capacity_chunks as f64),
            ("kvferry_receiver_reserved_chunks", "Chunks reserved by admitted requests and not yet allocated.", s.reserved_chunks as f64),
            ("kvferry_receiver_allocated_chunks", "Slots allocated (being written, awaiting the decoder, or quarantined).", s.allocated_chunks as f64),
            ("kvferry_receiver_parked_requests", "Requests waiting for admission.", s.core.parked_requests as f64),
            ("kvferry_receiver_tracked_requests", "Requests being tracked.", s.core.tracked_requests as f64),
            ("kvferry_receiver_keys", "Keys held in the receive buffer.", s.core.keys as f64),
            ("kvferry_receiver_quarantined_slots", "Slots fenced until in-flight writes of a failed request cannot land.", s.core.quarantined_slots as f64),
        ];
        gauges(&mut w, &rows);
        for (outcome, n) in &s.core.requests_total {
            w.counter_with_labels(
                "kvferry_receiver_requests_total",
                "Requests by outcome.",
                &[("outcome", outcome)],
                *n,
            );
        }
        for (code, n) in &s.core.errors_total {
            w.counter_with_labels(
                "kvferry_receiver_errors_total",
                "Error replies by code.",
                &[("code", code)],
                *n,
            );
        }
        #[rustfmt::skip]
        let rows = [
            ("kvferry_receiver_peers", "Peers with state in the receiver (said Hello, or hold requests or records).", s.core.peers as f64),
            ("kvferry_receiver_parked_bytes", "Bytes charged to parked requests and their queued batches.", s.core.parked_bytes as f64),
            ("kvferry_receiver_record_bytes", "Bytes charged to ended-request records and anonymous allocations.", s.core.record_bytes as f64),
            ("kvferry_receiver_peer_bytes", "Bytes charged to per-peer state.", s.core.peer_bytes as f64),
            ("kvferry_receiver_anonymous_allocations", "Anonymous allocations (req_id \"\") whose lifetime has not ended.", s.core.anonymous_allocations as f64),
        ];
        gauges(&mut w, &rows);
        w.counter(
            "kvferry_receiver_replies_dropped_total",
            "Replies dropped because the peer's reply queue was full or the peer was gone.",
            s.replies_dropped,
        );
        w.counter(
            "kvferry_receiver_bad_frames_total",
            "Frames that could not be decoded.",
            s.bad_frames,
        );
        let t = self.tcp_data_stats();
        #[rustfmt::skip]
        let rows = [
            ("kvferry_receiver_tcp_data_connections", "TCP data connections open.", t.connections as f64),
            ("kvferry_receiver_tcp_data_unauthenticated_connections", "TCP data connections not serving a sender (waiting for their preamble, or refused).", t.unauthenticated as f64),
        ];
        gauges(&mut w, &rows);
        for (reason, n) in [
            ("unauthenticated", t.rejected_unauthenticated),
            ("not_granted", t.rejected_not_granted),
            ("timed_out", t.timed_out),
            ("evicted", t.evicted),
        ] {
            w.counter_with_labels(
                "kvferry_receiver_tcp_data_rejected_total",
                "TCP data connections closed by the receiver, by reason.",
                &[("reason", reason)],
                n,
            );
        }
        w.histogram(
            "kvferry_receiver_admission_wait_us",
            "Time from a request's first batch to its admission, microseconds.",
            &hist,
            ADMISSION_BUCKETS_US,
        );
        w.finish()
    }
}
