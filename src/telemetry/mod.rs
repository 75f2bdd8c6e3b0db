//! Observability: per-stage statistics and their Prometheus exposition.

pub mod metrics;
pub mod stats;
