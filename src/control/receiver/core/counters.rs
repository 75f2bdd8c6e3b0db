//! The counters and gauges of [`CoreStats`]: a snapshot, and the bumps
//! (a method group of [`ReceiverCore`]).

use crate::protocol::ErrorCode;

use super::{CoreStats, ReceiverCore};

impl ReceiverCore {
    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> CoreStats {
        let mut s = self.stats.clone();
        s.parked_requests = self.queue.len();
        s.tracked_requests = self.requests.len();
        s.keys = self.keys.len();
        s.quarantined_slots = self.tombstones.values().map(|t| t.quarantined.len()).sum();
        s.slots_in_use = self.slots.in_use();
        s.peers = self.peers.len();
        s.parked_bytes = self.parked_bytes;
        s.record_bytes = self.record_bytes;
        s.peer_bytes = self.peer_bytes;
        s.anonymous_allocations = self.anonymous.len();
        s
    }

    /// Records the number of admitted requests if it is a new peak.
    pub(super) fn note_admitted(&mut self) {
        let admitted = self.requests.len() - self.queue.len();
        self.stats.peak_admitted = self.stats.peak_admitted.max(admitted);
    }

    pub(super) fn bump_request(&mut self, outcome: &'static str) {
        *self.stats.requests_total.entry(outcome).or_default() += 1;
    }

    pub(super) fn bump_error(&mut self, code: ErrorCode) {
        *self.stats.errors_total.entry(code.as_str()).or_default() += 1;
    }
}
