//! A registry-free writer for the Prometheus text exposition format 0.0.4.

use std::collections::HashMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;

use super::names::{
    is_valid_label_name, is_valid_metric_name, push_f64, push_help, push_label_value,
    sanitize_label_name, sanitize_metric_name,
};

/// The metric type written on the `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: its HELP/TYPE header and all its sample lines.
#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: Kind,
    samples: String,
}

/// Builds a text-format (0.0.4) exposition, e.g. for [`super::MetricsServer`].
///
/// Samples are grouped per metric name: `# HELP` and `# TYPE` are written
/// once per name however many label sets are added, and all samples of a
/// name come out together (in first-use order) even if the calls
/// interleave. Names that are not valid Prometheus names trip a
/// `debug_assert` and are sanitised (invalid characters → `_`) in release
/// builds; label values and HELP texts are escaped.
///
/// Conventions for kvferry (see `docs/observability.md`): names are
/// `kvferry_<role>_<name>`, counters end in `_total`.
///
/// ```
/// let mut w = kvferry::metrics::MetricsWriter::new();
/// w.counter("kvferry_sender_chunks_total", "Chunks transferred.", 42);
/// w.gauge("kvferry_sender_slots_in_use", "Slots in use.", 3.0);
/// let text = w.finish();
/// assert!(text.contains("kvferry_sender_chunks_total 42\n"));
/// ```
#[derive(Debug, Default)]
pub struct MetricsWriter {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

impl MetricsWriter {
    /// An empty exposition.
    pub fn new() -> Self {
        Self::default()
    }

    /// A gauge sample without labels.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.gauge_with_labels(name, help, &[], value);
    }

    /// A gauge sample with labels.
    pub fn gauge_with_labels(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        if let Some((fam, family)) = self.family(name, help, Kind::Gauge) {
            push_sample(&mut family.samples, &fam, "", labels, None);
            push_f64(&mut family.samples, value);
            family.samples.push('\n');
        }
    }

    /// A counter sample without labels (name it `..._total`).
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.counter_with_labels(name, help, &[], value);
    }

    /// A counter sample with labels; HELP/TYPE are written once per name.
    pub fn counter_with_labels(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: u64,
    ) {
        if let Some((fam, family)) = self.family(name, help, Kind::Counter) {
            push_sample(&mut family.samples, &fam, "", labels, None);
            let _ = writeln!(family.samples, "{value}");
        }
    }

    /// A histogram without labels; see [`MetricsWriter::histogram_with_labels`].
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram<u64>, buckets: &[u64]) {
        self.histogram_with_labels(name, help, &[], h, buckets);
    }

    /// A histogram: `name_bucket{le="b"}` for each upper bound in `buckets`
    /// (cumulative counts; bounds in the histogram's own unit, sorted and
    /// de-duplicated here) plus `le="+Inf"`, then `name_sum` and
    /// `name_count`.
    ///
    /// The counts come from an hdrhistogram, so they are exact to its
    /// resolution: a value is counted under `le` if it falls in the same
    /// hdrhistogram bucket as `le` or a lower one (as
    /// `Histogram::count_between`). `_sum` is `mean × count`, exact to the
    /// same resolution.
    pub fn histogram_with_labels(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        h: &Histogram<u64>,
        buckets: &[u64],
    ) {
        let Some((fam, family)) = self.family(name, help, Kind::Histogram) else {
            return;
        };
        let mut bounds = buckets.to_vec();
        bounds.sort_unstable();
        bounds.dedup();
        let mut cumulative = vec![0u64; bounds.len()];
        for v in h.iter_recorded() {
            let lowest = h.lowest_equivalent(v.value_iterated_to());
            let first = bounds.partition_point(|&b| b < lowest);
            // A value counts in its first bucket and (cumulatively) all later
            // ones; add once here and prefix-sum below.
            if let Some(c) = cumulative.get_mut(first) {
                *c = c.saturating_add(v.count_at_value());
            }
        }
        let mut running = 0u64;
        let mut le = String::new();
        for (bound, count) in bounds.iter().zip(cumulative.iter()) {
            running = running.saturating_add(*count);
            le.clear();
            let _ = write!(le, "{bound}");
            push_sample(&mut family.samples, &fam, "_bucket", labels, Some(&le));
            let _ = writeln!(family.samples, "{running}");
        }
        let total = h.len();
        push_sample(&mut family.samples, &fam, "_bucket", labels, Some("+Inf"));
        let _ = writeln!(family.samples, "{total}");
        push_sample(&mut family.samples, &fam, "_sum", labels, None);
        push_f64(&mut family.samples, h.mean() * total as f64);
        family.samples.push('\n');
        push_sample(&mut family.samples, &fam, "_count", labels, None);
        let _ = writeln!(family.samples, "{total}");
    }

    /// The exposition text so far.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(
            self.families
                .iter()
                .map(|f| f.samples.len() + f.help.len() + 2 * f.name.len() + 32)
                .sum(),
        );
        for f in &self.families {
            out.push_str("# HELP ");
            out.push_str(&f.name);
            out.push(' ');
            push_help(&mut out, &f.help);
            out.push_str("\n# TYPE ");
            out.push_str(&f.name);
            out.push(' ');
            out.push_str(f.kind.as_str());
            out.push('\n');
            out.push_str(&f.samples);
        }
        out
    }

    /// Consume the writer and return the exposition text.
    pub fn finish(self) -> String {
        self.render()
    }

    /// The family for `name` (created on first use), with its sanitised
    /// name. `None` if `name` was already used with another type (a
    /// programming error: debug_assert, and the samples are dropped in
    /// release builds rather than producing an invalid exposition).
    fn family(&mut self, name: &str, help: &str, kind: Kind) -> Option<(String, &mut Family)> {
        debug_assert!(is_valid_metric_name(name), "invalid metric name {name:?}");
        let clean = sanitize_metric_name(name).into_owned();
        let idx = match self.index.get(&clean) {
            Some(&i) => i,
            None => {
                self.families.push(Family {
                    name: clean.clone(),
                    help: help.to_owned(),
                    kind,
                    samples: String::new(),
                });
                self.index.insert(clean.clone(), self.families.len() - 1);
                self.families.len() - 1
            }
        };
        let family = &mut self.families[idx];
        debug_assert!(
            family.kind == kind,
            "metric {clean:?} used as {} and as {}",
            family.kind.as_str(),
            kind.as_str()
        );
        if family.kind != kind {
            return None;
        }
        Some((clean, family))
    }
}

/// Append `name{suffix}{labels[,le="…"]} ` (with the trailing space).
fn push_sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &[(&str, &str)],
    le: Option<&str>,
) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        let mut first = true;
        for (k, v) in labels {
            debug_assert!(is_valid_label_name(k), "invalid label name {k:?}");
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(&sanitize_label_name(k));
            out.push_str("=\"");
            push_label_value(out, v);
            out.push('"');
        }
        if let Some(le) = le {
            if !first {
                out.push(',');
            }
            out.push_str("le=\"");
            out.push_str(le);
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges() {
        let mut w = MetricsWriter::new();
        w.counter("kvferry_sender_chunks_total", "Chunks.", 7);
        w.gauge("kvferry_sender_slots_in_use", "Slots\nin use \\ now.", 2.5);
        assert_eq!(
            w.finish(),
            "# HELP kvferry_sender_chunks_total Chunks.\n\
             # TYPE kvferry_sender_chunks_total counter\n\
             kvferry_sender_chunks_total 7\n\
             # HELP kvferry_sender_slots_in_use Slots\\nin use \\\\ now.\n\
             # TYPE kvferry_sender_slots_in_use gauge\n\
             kvferry_sender_slots_in_use 2.5\n"
        );
    }

    #[test]
    fn labels_write_header_once_and_group_samples() {
        let mut w = MetricsWriter::new();
        w.counter_with_labels("req_total", "Requests.", &[("outcome", "ok")], 1);
        w.gauge("other", "Other.", 0.0);
        w.counter_with_labels("req_total", "ignored", &[("outcome", "a\"b\\c\nd")], 2);
        w.gauge_with_labels("g", "G.", &[("a", "1"), ("b", "2")], -1.0);
        let text = w.render();
        assert_eq!(text.matches("# HELP req_total").count(), 1);
        assert_eq!(text.matches("# TYPE req_total counter").count(), 1);
        assert!(text.contains(
            "req_total{outcome=\"ok\"} 1\nreq_total{outcome=\"a\\\"b\\\\c\\nd\"} 2\n# HELP other"
        ));
        assert!(text.contains("g{a=\"1\",b=\"2\"} -1\n"));
    }

    #[test]
    fn histogram_buckets_sum_count() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        for v in [5u64, 50, 500, 5000, 10] {
            h.record(v).unwrap();
        }
        let mut w = MetricsWriter::new();
        // Unsorted, duplicated bounds are normalised.
        w.histogram("lat_us", "Latency.", &h, &[1000, 10, 100, 10]);
        let text = w.finish();
        let expected = "# HELP lat_us Latency.\n# TYPE lat_us histogram\n\
            lat_us_bucket{le=\"10\"} 2\n\
            lat_us_bucket{le=\"100\"} 3\n\
            lat_us_bucket{le=\"1000\"} 4\n\
            lat_us_bucket{le=\"+Inf\"} 5\n";
        assert!(text.starts_with(expected), "{text}");
        let sum_line = text.lines().find(|l| l.starts_with("lat_us_sum ")).unwrap();
        let sum: f64 = sum_line["lat_us_sum ".len()..].parse().unwrap();
        assert!((sum - 5565.0).abs() < 6.0, "sum {sum}");
        assert!(text.ends_with("lat_us_count 5\n"));
    }

    #[test]
    fn histogram_with_labels_and_empty() {
        let h = Histogram::<u64>::new_with_bounds(1, 1000, 3).unwrap();
        let mut w = MetricsWriter::new();
        w.histogram_with_labels("stage_us", "S.", &[("stage", "transfer")], &h, &[1]);
        w.histogram_with_labels("stage_us", "S.", &[("stage", "notify")], &h, &[]);
        let text = w.finish();
        assert_eq!(text.matches("# TYPE stage_us histogram").count(), 1);
        assert!(text.contains("stage_us_bucket{stage=\"transfer\",le=\"1\"} 0\n"));
        assert!(text.contains("stage_us_bucket{stage=\"transfer\",le=\"+Inf\"} 0\n"));
        assert!(text.contains("stage_us_sum{stage=\"notify\"} 0\n"));
        assert!(text.contains("stage_us_count{stage=\"notify\"} 0\n"));
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "invalid metric name")]
    fn invalid_name_trips_debug_assert() {
        MetricsWriter::new().counter("bad-name", "x", 1);
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "used as counter and as gauge")]
    fn type_clash_trips_debug_assert() {
        let mut w = MetricsWriter::new();
        w.counter("m", "x", 1);
        w.gauge("m", "x", 1.0);
    }

    #[cfg(not(debug_assertions))]
    #[test]
    fn invalid_name_is_sanitized_in_release() {
        let mut w = MetricsWriter::new();
        w.counter("bad-name", "x", 1);
        w.gauge("bad-name", "type clash is dropped", 1.0);
        assert_eq!(
            w.finish(),
            "# HELP bad_name x\n# TYPE bad_name counter\nbad_name 1\n"
        );
    }
}
