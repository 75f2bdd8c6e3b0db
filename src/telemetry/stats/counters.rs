//! Engine counters (monotonic) and gauges (current level).

use serde::Serialize;

/// A monotonic event counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Counter {
    /// Requests admitted by the receiver (reservation granted).
    Admitted,
    /// Requests parked in the receiver's admission FIFO (did not fit yet).
    Parked,
    /// Requests rejected (can never fit, or refused by policy).
    Rejected,
    /// Requests cancelled by the caller or by a lease expiry.
    Cancelled,
    /// Requests that failed (transport or protocol error).
    Failed,
    /// Requests whose every chunk arrived and whose ProxyNotif was sent.
    Completed,
    /// Payload bytes transferred.
    Bytes,
    /// Chunks transferred.
    Chunks,
    /// Batches handed to `store()`.
    Batches,
    /// `store()` calls refused with `Backpressure` (pending area full).
    Backpressure,
}

impl Counter {
    /// Number of counters.
    pub const COUNT: usize = 10;

    /// Every counter.
    pub const ALL: [Counter; Counter::COUNT] = [
        Counter::Admitted,
        Counter::Parked,
        Counter::Rejected,
        Counter::Cancelled,
        Counter::Failed,
        Counter::Completed,
        Counter::Bytes,
        Counter::Chunks,
        Counter::Batches,
        Counter::Backpressure,
    ];

    /// snake_case name, used in JSON and metric names.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::Admitted => "admitted",
            Counter::Parked => "parked",
            Counter::Rejected => "rejected",
            Counter::Cancelled => "cancelled",
            Counter::Failed => "failed",
            Counter::Completed => "completed",
            Counter::Bytes => "bytes",
            Counter::Chunks => "chunks",
            Counter::Batches => "batches",
            Counter::Backpressure => "backpressure",
        }
    }

    /// Position in [`Counter::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// One-line description (the metric's HELP text).
    pub const fn help(self) -> &'static str {
        match self {
            Counter::Admitted => "Requests admitted by the receiver.",
            Counter::Parked => "Requests parked in the admission FIFO.",
            Counter::Rejected => "Requests rejected.",
            Counter::Cancelled => "Requests cancelled (caller or lease expiry).",
            Counter::Failed => "Requests failed (transport or protocol error).",
            Counter::Completed => "Requests fully transferred and notified.",
            Counter::Bytes => "Payload bytes transferred.",
            Counter::Chunks => "Chunks transferred.",
            Counter::Batches => "Batches stored.",
            Counter::Backpressure => "store() calls refused with Backpressure.",
        }
    }
}

/// A level that goes up and down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gauge {
    /// Staging (sender) or receive (receiver) slots currently in use.
    SlotsInUse,
    /// Requests between `store()` and completion (or admission and release).
    RequestsInFlight,
}

impl Gauge {
    /// Number of gauges.
    pub const COUNT: usize = 2;

    /// Every gauge.
    pub const ALL: [Gauge; Gauge::COUNT] = [Gauge::SlotsInUse, Gauge::RequestsInFlight];

    /// snake_case name, used in JSON and metric names.
    pub const fn name(self) -> &'static str {
        match self {
            Gauge::SlotsInUse => "slots_in_use",
            Gauge::RequestsInFlight => "requests_in_flight",
        }
    }

    /// Position in [`Gauge::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// One-line description (the metric's HELP text).
    pub const fn help(self) -> &'static str {
        match self {
            Gauge::SlotsInUse => "Slots currently in use.",
            Gauge::RequestsInFlight => "Requests currently in flight.",
        }
    }
}

/// Counter values at snapshot time (one JSON field per counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CounterValues {
    /// [`Counter::Admitted`].
    pub admitted: u64,
    /// [`Counter::Parked`].
    pub parked: u64,
    /// [`Counter::Rejected`].
    pub rejected: u64,
    /// [`Counter::Cancelled`].
    pub cancelled: u64,
    /// [`Counter::Failed`].
    pub failed: u64,
    /// [`Counter::Completed`].
    pub completed: u64,
    /// [`Counter::Bytes`].
    pub bytes: u64,
    /// [`Counter::Chunks`].
    pub chunks: u64,
    /// [`Counter::Batches`].
    pub batches: u64,
    /// [`Counter::Backpressure`].
    pub backpressure: u64,
}

impl CounterValues {
    /// The value of `c`.
    pub fn get(&self, c: Counter) -> u64 {
        *self.field(c)
    }

    /// Build from values indexed by [`Counter::index`].
    pub(crate) fn from_array(values: [u64; Counter::COUNT]) -> Self {
        let mut v = Self::default();
        for c in Counter::ALL {
            *v.field_mut(c) = values[c.index()];
        }
        v
    }

    fn field(&self, c: Counter) -> &u64 {
        match c {
            Counter::Admitted => &self.admitted,
            Counter::Parked => &self.parked,
            Counter::Rejected => &self.rejected,
            Counter::Cancelled => &self.cancelled,
            Counter::Failed => &self.failed,
            Counter::Completed => &self.completed,
            Counter::Bytes => &self.bytes,
            Counter::Chunks => &self.chunks,
            Counter::Batches => &self.batches,
            Counter::Backpressure => &self.backpressure,
        }
    }

    fn field_mut(&mut self, c: Counter) -> &mut u64 {
        match c {
            Counter::Admitted => &mut self.admitted,
            Counter::Parked => &mut self.parked,
            Counter::Rejected => &mut self.rejected,
            Counter::Cancelled => &mut self.cancelled,
            Counter::Failed => &mut self.failed,
            Counter::Completed => &mut self.completed,
            Counter::Bytes => &mut self.bytes,
            Counter::Chunks => &mut self.chunks,
            Counter::Batches => &mut self.batches,
            Counter::Backpressure => &mut self.backpressure,
        }
    }
}

/// Gauge values at snapshot time (one JSON field per gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct GaugeValues {
    /// [`Gauge::SlotsInUse`].
    pub slots_in_use: i64,
    /// [`Gauge::RequestsInFlight`].
    pub requests_in_flight: i64,
}

impl GaugeValues {
    /// The value of `g`.
    pub fn get(&self, g: Gauge) -> i64 {
        match g {
            Gauge::SlotsInUse => self.slots_in_use,
            Gauge::RequestsInFlight => self.requests_in_flight,
        }
    }

    /// Build from values indexed by [`Gauge::index`].
    pub(crate) fn from_array(values: [i64; Gauge::COUNT]) -> Self {
        Self {
            slots_in_use: values[Gauge::SlotsInUse.index()],
            requests_in_flight: values[Gauge::RequestsInFlight.index()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_table_is_consistent() {
        let mut arr = [0u64; Counter::COUNT];
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert!(!c.help().is_empty());
            arr[i] = 100 + i as u64;
        }
        let v = CounterValues::from_array(arr);
        let json = serde_json::to_value(v).unwrap();
        assert_eq!(json.as_object().unwrap().len(), Counter::COUNT);
        for c in Counter::ALL {
            assert_eq!(v.get(c), 100 + c.index() as u64);
            // The JSON key is the counter's name and holds its value.
            assert_eq!(json[c.name()], 100 + c.index() as u64, "{}", c.name());
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
    }

    #[test]
    fn gauge_table_is_consistent() {
        let v = GaugeValues::from_array([-3, 9]);
        let json = serde_json::to_value(v).unwrap();
        assert_eq!(json.as_object().unwrap().len(), Gauge::COUNT);
        for (i, g) in Gauge::ALL.iter().enumerate() {
            assert_eq!(g.index(), i);
            assert!(!g.help().is_empty());
            assert_eq!(json[g.name()], v.get(*g));
        }
        assert_eq!(v.get(Gauge::SlotsInUse), -3);
    }
}
