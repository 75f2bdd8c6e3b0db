//! `kvferry proxy`: the request router's side as its own process. It counts
//! ProxyNotif per request (one per sender TP rank) and reports, at exit,
//! how many requests became ready and how far apart their ranks reported.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use parking_lot::Mutex;
use serde::Serialize;

use crate::metrics::{MetricsServer, MetricsWriter};
use crate::proxy::{Notification, ProxyListener, MEMORY_BYTES};
use crate::recent::RecentMap;

/// Arguments of `kvferry proxy`.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// ZMQ endpoint to bind the PULL socket on.
    #[arg(long, default_value = "tcp://127.0.0.1:7500")]
    pub listen: String,
    /// ProxyNotifs that make a request ready (the decoder's TP size).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub expect: u32,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Print one line per ready request.
    #[arg(long)]
    pub verbose: bool,
    /// Print the exit report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Bytes of per-request records, for each of: notification counts,
    /// untaken notifications, first-arrival times of requests not yet at
    /// `--expect` (the oldest are forgotten past it; docs/security.md).
    #[arg(long, default_value_t = MEMORY_BYTES)]
    pub memory_bytes: usize,
}

/// What the proxy saw, reported at exit.
#[derive(Debug, Default, Serialize)]
struct ProxyReport {
    notifications: u64,
    malformed_frames: u64,
    requests_ready: u64,
    /// `ProxyFailed`s received (one per failing sender rank).
    failure_notifications: u64,
    elapsed_s: f64,
    ready_per_s: f64,
    /// Time from a request's first to its last expected ProxyNotif (the
    /// spread of its TP ranks), microseconds.
    rank_spread_us: Spread,
}

#[derive(Debug, Default, Serialize)]
struct Spread {
    p50: u64,
    p99: u64,
    max: u64,
}

struct Tracker {
    expect: usize,
    /// First arrival per request not yet ready, bounded in bytes.
    first_seen: RecentMap<Instant>,
    ready: u64,
    failed: u64,
    spread_us: hdrhistogram::Histogram<u64>,
    verbose: bool,
}

impl Tracker {
    fn on(&mut self, n: &Notification) {
        if let Some(f) = &n.failure {
            // The request will not become ready: forget its first arrival.
            self.first_seen.remove(&n.req_id);
            self.failed += 1;
            if self.verbose {
                super::say!("failed {} ({:?}: {})", n.req_id, f.code, f.reason);
            }
            return;
        }
        let first = *self.first_seen.get_or_insert_with(&n.req_id, || n.at);
        if n.count == self.expect {
            self.first_seen.remove(&n.req_id);
            self.ready += 1;
            let us =
                n.at.saturating_duration_since(first)
                    .as_micros()
                    .min(u128::from(u64::MAX)) as u64;
            let _ = self.spread_us.record(us.max(1));
            if self.verbose {
                super::say!("ready {} ({} notifications)", n.req_id, n.count);
            }
        }
    }
}

/// Runs a proxy listener until SIGINT/SIGTERM, then prints its report.
pub fn run(a: ProxyArgs) -> ExitCode {
    let termination = match super::signals::Termination::install() {
        Ok(t) => t,
        Err(e) => return super::runtime_error(format!("cannot install signal handlers: {e}")),
    };
    let listener = match ProxyListener::bind_with_memory(&a.listen, a.memory_bytes) {
        Ok(l) => Arc::new(l),
        Err(e) => return super::runtime_error(e),
    };
    let spread_us = match hdrhistogram::Histogram::new_with_bounds(1, crate::stats::HIGHEST_US, 3) {
        Ok(h) => h,
        Err(e) => return super::runtime_error(format!("histogram: {e}")),
    };
    let tracker = Arc::new(Mutex::new(Tracker {
        expect: a.expect as usize,
        first_seen: RecentMap::new(a.memory_bytes),
        ready: 0,
        failed: 0,
        spread_us,
        verbose: a.verbose,
    }));
    {
        let ready = Arc::clone(&tracker);
        listener.set_callback(move |n| ready.lock().on(n));
        let failed = Arc::clone(&tracker);
        listener.set_failure_callback(move |n| failed.lock().on(n));
    }
    let _metrics = match a.metrics {
        Some(addr) => {
            let weak = Arc::downgrade(&listener);
            let tracker = Arc::clone(&tracker);
            let render = move || {
                let mut w = MetricsWriter::new();
                if let Some(l) = weak.upgrade() {
                    let (total, malformed) = l.totals();
                    w.counter(
                        "kvferry_proxy_notifications_total",
                        "ProxyNotif frames received.",
                        total,
                    );
                    w.counter(
                        "kvferry_proxy_malformed_total",
                        "Frames that were not a ProxyNotif.",
                        malformed,
                    );
                }
                let t = tracker.lock();
                w.counter(
                    "kvferry_proxy_requests_ready_total",
                    "Requests with every expected ProxyNotif.",
                    t.ready,
                );
                w.histogram(
                    "kvferry_proxy_rank_spread_us",
                    "Time from a request's first to its last expected ProxyNotif, microseconds.",
                    &t.spread_us,
                    &[10, 100, 1_000, 10_000, 100_000, 1_000_000],
                );
                w.finish()
            };
            match MetricsServer::start(addr, render) {
                Ok(m) => Some(m),
                Err(e) => return super::runtime_error(format!("metrics on {addr}: {e}")),
            }
        }
        None => None,
    };
    let started = Instant::now();
    super::say!("kvferry proxy listening on {}", listener.endpoint());
    let _ = std::io::stdout().flush();
    termination.wait();
    let (notifications, malformed_frames) = listener.totals();
    let t = tracker.lock();
    let elapsed_s = started.elapsed().as_secs_f64();
    let report = ProxyReport {
        notifications,
        malformed_frames,
        requests_ready: t.ready,
        failure_notifications: t.failed,
        elapsed_s,
        ready_per_s: t.ready as f64 / elapsed_s.max(1e-9),
        rank_spread_us: Spread {
            p50: t.spread_us.value_at_quantile(0.5),
            p99: t.spread_us.value_at_quantile(0.99),
            max: t.spread_us.max(),
        },
    };
    if a.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => super::say!("{s}"),
            Err(e) => return super::runtime_error(format!("cannot encode the report: {e}")),
        }
    } else {
        super::say!(
            "kvferry proxy: {} notifications, {} requests ready, {} failure notifications ({:.0}/s over {:.1} s), {} malformed frames; rank spread p50 {} µs p99 {} µs max {} µs",
            report.notifications,
            report.requests_ready,
            report.failure_notifications,
            report.ready_per_s,
            report.elapsed_s,
            report.malformed_frames,
            report.rank_spread_us.p50,
            report.rank_spread_us.p99,
            report.rank_spread_us.max
        );
    }
    ExitCode::SUCCESS
}
