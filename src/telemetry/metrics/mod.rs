//! Prometheus text exposition: a small writer and an HTTP endpoint.
//!
//! - [`MetricsWriter`] renders counters, gauges and hdrhistogram-backed
//!   histograms in the text format 0.0.4, without a registry.
//! - [`write_stats`] renders a [`crate::stats::SharedStats`] with the
//!   `kvferry_<role>_<name>` naming convention.
//! - [`MetricsServer`] serves the rendered text on `GET /metrics`.

mod export;
mod http;
mod names;
mod server;
mod writer;

pub use export::{write_stats, DEFAULT_LATENCY_BUCKETS_US};
pub use names::{
    is_valid_label_name, is_valid_metric_name, sanitize_label_name, sanitize_metric_name,
};
pub use server::{MetricsServer, MetricsServerConfig, CONTENT_TYPE};
pub use writer::MetricsWriter;
