//! Per-stage latency histograms (hdrhistogram, microseconds).

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::Stage;

/// Highest trackable latency: one hour, in microseconds. Longer durations are
/// recorded as one hour.
pub const HIGHEST_US: u64 = 3_600_000_000;
/// Value precision of the histograms.
pub const SIGNIFICANT_DIGITS: u8 = 3;

/// A new empty histogram with the stage bounds (1 µs .. 1 h, 3 digits).
pub(crate) fn new_stage_histogram() -> Histogram<u64> {
    // The bounds are constants that satisfy hdrhistogram's requirements
    // (low >= 1, high >= 2 * low, sigfig <= 5), so creation cannot fail.
    Histogram::new_with_bounds(1, HIGHEST_US, SIGNIFICANT_DIGITS)
        .expect("constant histogram bounds are valid")
}

/// `d` in whole microseconds, clamped to `1 ..= HIGHEST_US` (a sub-µs stage
/// counts as 1 µs).
pub(crate) fn duration_to_us(d: Duration) -> u64 {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    us.clamp(1, HIGHEST_US)
}

/// Add `src` into `dst` without ever failing: both have the stage bounds, so
/// `add` succeeds; should it not, fall back to re-recording (saturating).
pub(crate) fn merge_into(dst: &mut Histogram<u64>, src: &Histogram<u64>) {
    if dst.add(src).is_err() {
        for v in src.iter_recorded() {
            dst.saturating_record_n(v.value_iterated_to(), v.count_at_value());
        }
    }
}

/// Summary of one latency histogram, in microseconds (to 3 significant
/// digits, as recorded).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LatencySummary {
    /// Number of recorded durations.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest recorded value.
    pub max_us: u64,
    /// Arithmetic mean.
    pub mean_us: f64,
}

impl LatencySummary {
    /// Summarise `h` (all zero when it is empty).
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
            mean_us: h.mean(),
        }
    }
}

/// Latency summaries of all stages (one JSON object keyed by stage name).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StageSummary {
    /// [`Stage::Pending`].
    pub pending: LatencySummary,
    /// [`Stage::AdmissionWait`].
    pub admission_wait: LatencySummary,
    /// [`Stage::StagingWait`].
    pub staging_wait: LatencySummary,
    /// [`Stage::Transfer`].
    pub transfer: LatencySummary,
    /// [`Stage::Notify`].
    pub notify: LatencySummary,
}

impl StageSummary {
    /// The summary of `stage`.
    pub fn get(&self, stage: Stage) -> &LatencySummary {
        match stage {
            Stage::Pending => &self.pending,
            Stage::AdmissionWait => &self.admission_wait,
            Stage::StagingWait => &self.staging_wait,
            Stage::Transfer => &self.transfer,
            Stage::Notify => &self.notify,
        }
    }

    pub(crate) fn get_mut(&mut self, stage: Stage) -> &mut LatencySummary {
        match stage {
            Stage::Pending => &mut self.pending,
            Stage::AdmissionWait => &mut self.admission_wait,
            Stage::StagingWait => &mut self.staging_wait,
            Stage::Transfer => &mut self.transfer,
            Stage::Notify => &mut self.notify,
        }
    }
}

/// One latency histogram per [`Stage`], in microseconds.
///
/// Not thread-safe by itself (use [`super::SharedStats`] across threads);
/// meant for one thread's private recording, merging and reports.
/// Each histogram preallocates about 190 KB of counts (zeroed lazily by the
/// OS), so create these once, not per request.
#[derive(Debug, Clone)]
pub struct StageHistograms {
    hists: [Histogram<u64>; Stage::COUNT],
}

impl Default for StageHistograms {
    fn default() -> Self {
        Self::new()
    }
}

impl StageHistograms {
    /// Empty histograms for every stage.
    pub fn new() -> Self {
        Self {
            hists: std::array::from_fn(|_| new_stage_histogram()),
        }
    }

    /// Record one duration of `stage` (clamped to 1 µs .. 1 h).
    pub fn record(&mut self, stage: Stage, d: Duration) {
        self.hists[stage.index()].saturating_record(duration_to_us(d));
    }

    /// Record a raw microsecond value (clamped to 1 .. [`HIGHEST_US`]).
    pub fn record_us(&mut self, stage: Stage, us: u64) {
        self.hists[stage.index()].saturating_record(us.clamp(1, HIGHEST_US));
    }

    /// Add every value of `other` into `self`.
    pub fn merge(&mut self, other: &StageHistograms) {
        for (dst, src) in self.hists.iter_mut().zip(other.hists.iter()) {
            merge_into(dst, src);
        }
    }

    /// Add the values of `src` into the histogram of `stage`.
    pub(crate) fn merge_stage(&mut self, stage: Stage, src: &Histogram<u64>) {
        merge_into(&mut self.hists[stage.index()], src);
    }

    /// The histogram of `stage`.
    pub fn get(&self, stage: Stage) -> &Histogram<u64> {
        &self.hists[stage.index()]
    }

    /// Number of durations recorded for `stage`.
    pub fn count(&self, stage: Stage) -> u64 {
        self.hists[stage.index()].len()
    }

    /// Forget every recorded value.
    pub fn reset(&mut self) {
        self.hists.iter_mut().for_each(Histogram::reset);
    }

    /// Per-stage summaries.
    pub fn snapshot(&self) -> StageSummary {
        let mut s = StageSummary::default();
        for stage in Stage::ALL {
            *s.get_mut(stage) = LatencySummary::of(self.get(stage));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_data() {
        let mut h = StageHistograms::new();
        for us in 1..=1000u64 {
            h.record(Stage::Transfer, Duration::from_micros(us));
        }
        let s = h.snapshot();
        let t = s.get(Stage::Transfer);
        assert_eq!(t.count, 1000);
        assert_eq!(t.p50_us, 500);
        assert_eq!(t.p99_us, 990);
        assert_eq!(t.max_us, 1000);
        assert!((t.mean_us - 500.5).abs() < 0.01, "mean {}", t.mean_us);
        // Other stages untouched.
        assert_eq!(*s.get(Stage::Pending), LatencySummary::default());
        assert_eq!(h.count(Stage::Notify), 0);
    }

    #[test]
    fn large_values_keep_three_significant_digits() {
        let mut h = StageHistograms::new();
        h.record(Stage::Notify, Duration::from_micros(1_234_567));
        let m = h.snapshot().notify.max_us;
        assert!((1_233_000..=1_236_000).contains(&m), "max {m}");
    }

    #[test]
    fn clamping_below_and_above_the_range() {
        let mut h = StageHistograms::new();
        h.record(Stage::Pending, Duration::from_nanos(10));
        h.record(Stage::Pending, Duration::ZERO);
        h.record(Stage::Pending, Duration::from_secs(10 * 3600));
        h.record(Stage::Pending, Duration::MAX);
        h.record_us(Stage::Pending, 0);
        let p = h.snapshot().pending;
        assert_eq!(p.count, 5);
        assert_eq!(p.p50_us, 1);
        assert!(p.max_us >= HIGHEST_US && p.max_us <= HIGHEST_US + HIGHEST_US / 1000);
    }

    #[test]
    fn merge_adds_all_values() {
        let mut a = StageHistograms::new();
        let mut b = StageHistograms::new();
        for us in 1..=100 {
            a.record_us(Stage::StagingWait, us);
            b.record_us(Stage::StagingWait, us + 100);
            b.record_us(Stage::AdmissionWait, 7);
        }
        a.merge(&b);
        let s = a.snapshot();
        assert_eq!(s.staging_wait.count, 200);
        assert_eq!(s.staging_wait.p50_us, 100);
        assert_eq!(s.staging_wait.max_us, 200);
        assert_eq!(s.admission_wait.count, 100);
        assert_eq!(s.admission_wait.p99_us, 7);
        a.reset();
        assert_eq!(a.snapshot(), StageSummary::default());
    }

    #[test]
    fn merge_into_fallback_saturates_foreign_histograms() {
        // A histogram with a larger range than the stage bounds takes the
        // fallback path instead of failing.
        let mut dst = new_stage_histogram();
        let mut src = Histogram::<u64>::new_with_bounds(1, u64::MAX / 4, 3).unwrap();
        src.record(10).unwrap();
        src.record(HIGHEST_US * 100).unwrap();
        merge_into(&mut dst, &src);
        assert_eq!(dst.len(), 2);
        assert_eq!(dst.value_at_quantile(0.0), 10);
    }

    #[test]
    fn summary_serializes_with_stage_keys() {
        let mut h = StageHistograms::new();
        h.record_us(Stage::AdmissionWait, 42);
        let v = serde_json::to_value(h.snapshot()).unwrap();
        for stage in Stage::ALL {
            assert!(v.get(stage.name()).is_some(), "missing {}", stage.name());
        }
        assert_eq!(v["admission_wait"]["count"], 1);
        assert_eq!(v["admission_wait"]["p50_us"], 42);
    }
}
