//! Per-request latency histograms and engine counters.
//!
//! - [`Stage`]: the pipeline stages a request's time is split into.
//! - [`StageHistograms`]: one hdrhistogram per stage (µs, 1 µs .. 1 h, 3
//!   significant digits), single-threaded, mergeable, summarised as
//!   [`StageSummary`].
//! - [`SharedStats`]: the thread-safe recorder the engine threads share
//!   (per-stage mutex-protected histograms plus atomic [`Counter`]s and
//!   [`Gauge`]s), read as a serialisable [`StatsSnapshot`].
//!
//! See `docs/observability.md` for what each stage measures and what a
//! record costs.

mod counters;
mod histograms;
mod shared;
mod stage;

pub use counters::{Counter, CounterValues, Gauge, GaugeValues};
pub use histograms::{
    LatencySummary, StageHistograms, StageSummary, HIGHEST_US, SIGNIFICANT_DIGITS,
};
pub use shared::{SharedStats, StatsSnapshot};
pub use stage::Stage;
