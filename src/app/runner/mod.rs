//! `kvferry run`: xPyD on one machine. Prefill senders push chunked requests
//! into decode receivers through reservation admission; decoders verify and
//! consume every request; a watchdog declares a deadlock if nothing finishes
//! for the stall timeout; the report says what moved, how fast, and whether
//! anything leaked.
//!
//! Roles run in-process and talk over loopback ZMQ and the chosen data plane
//! (shared memory by default), exactly as separate processes would.

pub mod config;
mod monitor;
pub mod payload;
pub mod report;
mod workers;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::protocol::ErrorCode;
use crate::proxy::ProxyListener;
use crate::receiver::{AcceptorFactory, Receiver, ReceiverConfig, ReceiverError};
use crate::sender::{RequestStatus, Sender, SenderConfig};
use crate::stats::StageHistograms;
use crate::transport::{FaultConfig, TransportConfig};

pub use config::{static_peers_of, ChunkRange, RunConfig};
pub use report::RunReport;

use payload::Payloads;

/// Errors that stop a run before it produces a report.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Invalid configuration (exit code 2).
    #[error("{0}")]
    Config(String),
    /// The chosen transport is not available here (exit code 2).
    #[error("{0}")]
    Unavailable(String),
    /// A role could not start.
    #[error("cannot start the run: {0}")]
    Start(String),
}

/// How progress is shown while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// A progress bar (stderr is a terminal).
    Bar,
    /// A plain line every few seconds.
    Lines,
    /// Nothing.
    Quiet,
}

/// What one request is, for the decoders and the bookkeeping.
#[derive(Debug, Clone)]
struct Planned {
    request: u64,
    total: u32,
    decoder: usize,
    started: Instant,
}

/// Counters shared by the run's threads.
#[derive(Debug, Default)]
struct Tally {
    completed: AtomicU64,
    aborted: AtomicU64,
    failed: AtomicU64,
    unexpected: AtomicU64,
    mismatches: AtomicU64,
    /// Requests that reached any terminal state (the watchdog's progress).
    finished: AtomicU64,
}

/// State shared by prefillers, decoders, callbacks and the monitor.
struct Run {
    cfg: RunConfig,
    payloads: Payloads,
    /// In-process decoders (empty when the receivers are other processes).
    receivers: Vec<Arc<Receiver>>,
    /// Receiver endpoints, one per decoder.
    endpoints: Vec<String>,
    senders: Vec<Arc<Sender>>,
    /// Prefix of sender ids and request ids (unique per process role).
    prefix: String,
    tally: Tally,
    planned: Mutex<HashMap<String, Planned>>,
    end_to_end: Mutex<hdrhistogram::Histogram<u64>>,
    /// Failed requests by code, with one example reason each.
    failures: Mutex<std::collections::BTreeMap<String, (u64, String)>>,
    /// Set when the run is over (or the watchdog fired): threads stop.
    stop: AtomicBool,
}

impl Run {
    fn finish(&self, outcome: &RequestStatus, fail_injected: bool) {
        match outcome {
            RequestStatus::Completed => {
                self.tally.completed.fetch_add(1, Ordering::Relaxed);
            }
            RequestStatus::Cancelled => {
                self.tally.aborted.fetch_add(1, Ordering::Relaxed);
            }
            RequestStatus::Failed { code, reason } => {
                self.tally.failed.fetch_add(1, Ordering::Relaxed);
                let mut f = self.failures.lock();
                let e = f
                    .entry(code.as_str().to_owned())
                    .or_insert_with(|| (0, reason.clone()));
                e.0 += 1;
                if !(fail_injected && *code == ErrorCode::WriteFailed) {
                    self.tally.unexpected.fetch_add(1, Ordering::Relaxed);
                }
            }
            RequestStatus::InProgress => return,
        }
        // Relaxed everywhere in the tally: plain statistics, read by the
        // monitor and at the end after the threads were joined.
        self.tally.finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs the whole job in-process and returns its report.
pub fn run(cfg: RunConfig, progress: Progress) -> Result<RunReport, RunError> {
    run_with(cfg, progress, |_, _| {})
}

/// [`run`], calling `on_start` with the receivers' endpoints and the senders
/// once every role is up (tests aim a rogue client at the receivers mid-run;
/// the CLI serves the senders' metrics).
pub fn run_with(
    cfg: RunConfig,
    progress: Progress,
    on_start: impl FnOnce(&[String], &[Arc<Sender>]),
) -> Result<RunReport, RunError> {
    cfg.validate().map_err(RunError::Config)?;
    if !cfg.static_buffers.is_empty() {
        return Err(RunError::Config(
            "static_buffers address receivers outside this process: use `kvferry sender`".into(),
        ));
    }
    // rdma: every receiver also sets up a queue pair per sender at Hello.
    let acceptor = AcceptorFactory::for_transport(&cfg.transport, &TransportConfig::default())
        .map_err(|e| RunError::Unavailable(e.to_string()))?;
    let mut receivers = Vec::new();
    for d in 0..cfg.decoders {
        let r = Receiver::start(ReceiverConfig {
            listen: "tcp://127.0.0.1:0".into(),
            receiver_id: format!("decoder-{d}"),
            capacity_chunks: cfg.capacity_chunks,
            chunk_bytes: cfg.chunk_bytes,
            quarantine_grace: Duration::from_secs(2),
            // Offer the TCP data plane on loopback when the run uses it.
            tcp_data: (cfg.transport == "tcp")
                .then(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            acceptor: acceptor.clone(),
            ..ReceiverConfig::default()
        })
        .map_err(|e| match e {
            // No RDMA device: the transport is unavailable (exit code 2).
            ReceiverError::Transport(e) => RunError::Unavailable(e.to_string()),
            e => RunError::Start(e.to_string()),
        })?;
        receivers.push(Arc::new(r));
    }
    let proxy =
        ProxyListener::bind("tcp://127.0.0.1:0").map_err(|e| RunError::Start(e.to_string()))?;
    let endpoints: Vec<String> = receivers.iter().map(|r| r.endpoint().to_owned()).collect();
    let proxy_endpoint = proxy.endpoint().to_owned();
    execute(
        cfg,
        progress,
        receivers,
        endpoints,
        Some(proxy),
        Some(proxy_endpoint),
        "prefiller",
        on_start,
    )
}

/// Runs only the prefill side (the `kvferry sender` role) against receivers
/// in other processes: `cfg.prefillers` senders spread requests over
/// `endpoints` and notify the proxy at `proxy`. Completion is counted when
/// the sender's ProxyNotif goes out (the decoders are elsewhere).
pub fn run_remote(
    cfg: RunConfig,
    endpoints: Vec<String>,
    proxy: Option<String>,
    sender_id: &str,
    progress: Progress,
    on_start: impl FnOnce(&[String], &[Arc<Sender>]),
) -> Result<RunReport, RunError> {
    if endpoints.is_empty() {
        return Err(RunError::Config(
            "--connect needs at least one receiver endpoint".into(),
        ));
    }
    let cfg = RunConfig {
        decoders: endpoints.len(),
        ..cfg
    };
    cfg.validate().map_err(RunError::Config)?;
    execute(
        cfg,
        progress,
        Vec::new(),
        endpoints,
        None,
        proxy,
        sender_id,
        on_start,
    )
}

#[allow(clippy::too_many_arguments)]
fn execute(
    cfg: RunConfig,
    progress: Progress,
    receivers: Vec<Arc<Receiver>>,
    endpoints: Vec<String>,
    proxy: Option<ProxyListener>,
    proxy_endpoint: Option<String>,
    sender_prefix: &str,
    on_start: impl FnOnce(&[String], &[Arc<Sender>]),
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    let static_peers = cfg.static_peers().map_err(RunError::Config)?;
    let mut senders = Vec::new();
    for p in 0..cfg.prefillers {
        let fault = (cfg.fail_rate > 0.0).then(|| FaultConfig {
            fail_rate: cfg.fail_rate,
            seed: cfg.seed.wrapping_add(p as u64),
            ..FaultConfig::default()
        });
        let s = Sender::new(SenderConfig {
            sender_id: format!("{sender_prefix}-{p}"),
            proxy: proxy_endpoint.clone(),
            staging_slots: cfg.staging_slots,
            chunk_bytes: cfg.chunk_bytes,
            max_pending_bytes: cfg.max_pending_bytes,
            transport: cfg.transport.clone(),
            transport_config: TransportConfig {
                fault,
                ..TransportConfig::default()
            },
            staging_timeout: cfg.stall_timeout() * 3,
            static_peers: static_peers.clone(),
            ..SenderConfig::default()
        });
        match s {
            Ok(s) => senders.push(Arc::new(s)),
            Err(crate::sender::SenderError::Transport(e)) => {
                return Err(RunError::Unavailable(e.to_string()))
            }
            Err(e) => return Err(RunError::Start(e.to_string())),
        }
    }
    let end_to_end = hdrhistogram::Histogram::new_with_bounds(1, crate::stats::HIGHEST_US, 3)
        .map_err(|e| RunError::Start(e.to_string()))?;
    let run = Arc::new(Run {
        payloads: Payloads::new(cfg.chunk_bytes as usize, cfg.seed),
        receivers,
        endpoints,
        senders,
        prefix: sender_prefix.to_owned(),
        tally: Tally::default(),
        planned: Mutex::new(HashMap::new()),
        end_to_end: Mutex::new(end_to_end),
        failures: Mutex::new(std::collections::BTreeMap::new()),
        stop: AtomicBool::new(false),
        cfg,
    });
    let handles =
        workers::start(&run, proxy.as_ref()).map_err(|e| RunError::Start(e.to_string()))?;
    on_start(&run.endpoints, &run.senders);
    let watch = monitor::watch(&run, progress, started);
    let mut report = RunReport {
        sender_path: if run.cfg.copy_store {
            "copying-store".into()
        } else {
            "in-place".into()
        },
        sender_copies_per_chunk: u32::from(run.cfg.copy_store),
        config: run.cfg.clone(),
        deadlock: watch.deadlock,
        stall_dump: watch.dump,
        ..RunReport::default()
    };
    // Every request is terminal (or the watchdog fired): stop the workers.
    // Release: pairs with the Acquire loads in the worker loops.
    run.stop.store(true, Ordering::Release);
    if !watch.deadlock {
        // Every request is terminal: the workers only finish what they are
        // in, each wait of theirs bounded by the stall timeout.
        handles.join(run.cfg.stall_timeout() + crate::threads::STOP_JOIN_DEADLINE);
    }
    // Stop consumers and senders; measure leaks once the engine settled.
    let elapsed = started.elapsed();
    let settle = Instant::now() + Duration::from_secs(5);
    loop {
        let (staging, recv, reserved) = leaks(&run);
        if (staging, recv, reserved) == (0, 0, 0) || Instant::now() >= settle || watch.deadlock {
            report.leaked_staging_slots = staging;
            report.leaked_receiver_slots = recv;
            report.leaked_reservations = reserved;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut stages = StageHistograms::new();
    let mut bytes = 0;
    let mut chunks = 0;
    for s in &run.senders {
        stages.merge(&s.shared_stats().histograms());
        let snap = s.stats();
        bytes += snap.counter(crate::stats::Counter::Bytes);
        chunks += snap.counter(crate::stats::Counter::Chunks);
    }
    let e2e = {
        let h = run.end_to_end.lock();
        report::Percentiles {
            p50: h.value_at_quantile(0.5),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
            count: h.len(),
        }
    };
    report.set_latencies(&stages.snapshot(), e2e);
    let secs = elapsed.as_secs_f64().max(1e-9);
    report.completed = run.tally.completed.load(Ordering::Relaxed);
    report.aborted = run.tally.aborted.load(Ordering::Relaxed);
    report.failed = run.tally.failed.load(Ordering::Relaxed);
    report.unexpected_failures = run.tally.unexpected.load(Ordering::Relaxed);
    report.checksum_mismatches = run.tally.mismatches.load(Ordering::Relaxed);
    report.bytes = bytes;
    report.gbps = bytes as f64 / secs / 1e9;
    report.chunks_per_s = chunks as f64 / secs;
    report.elapsed_s = secs;
    report.max_concurrent_admitted = watch.max_admitted;
    report.failures = run.failures.lock().clone();
    report.peak_staging_slots = watch.peak_staging;
    report.peak_receiver_slots = watch.peak_receiver;
    report.peak_rss_bytes = report::peak_rss_bytes();
    report.registered_bytes = run.cfg.chunk_bytes
        * (run.cfg.staging_slots * run.cfg.prefillers + run.cfg.capacity_chunks * run.cfg.decoders)
            as u64;
    // The senders' callbacks hold the run (which holds the senders): break
    // the cycle so the run, its senders and its receivers (and their
    // shared-memory files) are dropped when this function returns.
    for s in &run.senders {
        s.clear_callback();
    }
    if !watch.deadlock {
        // Orderly teardown; after a deadlock threads may be stuck, so the
        // caller exits instead.
        drop(proxy);
    } else {
        std::mem::forget(proxy);
    }
    Ok(report)
}

/// (staging slots, receive slots, reserved chunks) still held.
fn leaks(run: &Run) -> (u64, u64, u64) {
    let staging = run.senders.iter().map(|s| s.staging_in_use() as u64).sum();
    let (mut recv, mut reserved) = (0, 0);
    for r in &run.receivers {
        let s = r.stats();
        recv += s.allocated_chunks as u64;
        reserved += s.reserved_chunks as u64;
    }
    (staging, recv, reserved)
}
