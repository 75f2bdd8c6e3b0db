//! `kvferry sender`: the prefill role as its own process.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use clap::Args;

use crate::attach::{AttachConfig, PrefillDaemon};
use crate::metrics::MetricsServer;
use crate::runner::{self, RunConfig};
use crate::sender::{Sender, SenderConfig};
use crate::transport::TransportConfig;

use super::cpus::{CopyCpu, CpuArgs};
use super::run_cmd::{finish, progress_mode, LoadArgs};

/// Arguments of `kvferry sender`.
#[derive(Debug, Args)]
pub struct SenderArgs {
    /// Receiver endpoints (comma-separated or repeated); requests are spread
    /// over them round-robin.
    #[arg(long, required = true, value_delimiter = ',')]
    pub connect: Vec<String>,
    /// The proxy's PULL endpoint for ProxyNotif.
    #[arg(long)]
    pub proxy: Option<String>,
    /// Sender id prefix (DEALER identities are `<id>-<n>-to-<endpoint>~<random per process>`).
    #[arg(long, default_value = "sender")]
    pub sender_id: String,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// ENDPOINT=PATH (repeatable; TOML `static_buffers`): the receiver at
    /// ENDPOINT does not answer Hello (an LMCache receiver); write its
    /// chunks into the kvferry shm buffer file PATH on this host (slot size
    /// and count from its header). kvferry cannot reach an LMCache
    /// receiver's own (NIXL) buffer.
    #[arg(long, value_name = "ENDPOINT=PATH")]
    pub static_buffer: Vec<String>,
    /// Chunk keys: kvferry (`req/index/total`) or lmcache (CacheEngineKey
    /// strings, required by an LMCache receiver) [default: kvferry; TOML
    /// `key_format`].
    #[arg(long)]
    pub key_format: Option<String>,
    /// The load to generate (same options as `kvferry run`; `--prefillers`
    /// is the number of senders in this process).
    #[command(flatten)]
    pub load: LoadArgs,
    /// Serve attached prefill workers on this Unix socket instead of
    /// generating load (rings and staging shares passed as descriptors;
    /// the process becomes non-dumpable; see docs/attach.md); a worker's
    /// BEGIN names its receiver by index into --connect. The load
    /// generator's options (--requests, --batch, --prefillers, ...; and
    /// such --config keys) are refused with it.
    #[arg(long)]
    pub attach: Option<PathBuf>,
    /// With --attach: live attachments at most.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub attach_max_clients: u32,
    /// With --attach: per-worker staging shares (each worker maps only its
    /// own; docs/attach.md). Default: --attach-max-clients, fewer if
    /// --staging-slots cannot hold that many page-aligned shares. A worker
    /// past the free shares is refused (hello status 4).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub attach_shares: Option<u32>,
    /// With --attach: requests, and staged batches, per worker at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub attach_max_outstanding: u32,
    /// With --attach: keep the process dumpable (core dumps, debuggers)
    /// instead of making it non-dumpable, which is what keeps other
    /// processes of this user out of its descriptors and memory
    /// (docs/attach.md, "Trust"). For debugging only.
    #[arg(long)]
    pub attach_keep_dumpable: bool,
    /// With --attach: microseconds a session keeps polling its client's
    /// ring after its last work before it sleeps (io_uring's
    /// sq_thread_idle; docs/attach.md, "Polling sessions"). A client that
    /// comes back within it pays no doorbell wake-up; the session keeps a
    /// CPU busy (yielding) that long after each burst. 0: only the
    /// adaptive linger (50-250 µs).
    #[arg(long, default_value_t = 0, value_name = "US", value_parser = clap::value_parser!(u32).range(0..=10_000_000))]
    pub attach_poll_idle_us: u32,
    /// With --attach: the CPU of the transport's engine thread (shm's copy
    /// engine, the one thread that moves the workers' bytes): a CPU id,
    /// `none` (the scheduler's choice) or `auto`, the default: without
    /// --cpus, on two CPUs or more, the last CPU this process may run on
    /// goes to the engine alone and every other thread runs on the rest.
    /// With an id, leave that CPU out of --cpus to give it the CPU to
    /// itself. On a small machine keep the workers off it too (`taskset`)
    /// (docs/attach.md, "Placing the threads").
    #[arg(long, value_name = "CPU|auto|none", requires = "attach", value_parser = CopyCpu::parse)]
    pub copy_cpu: Option<CopyCpu>,
    #[command(flatten)]
    pub cpus: CpuArgs,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

/// Generates the load and prints the report.
pub fn run(a: SenderArgs) -> ExitCode {
    // Before anything is spawned: every thread after inherits it. The
    // load generator runs a copy engine per prefiller: none is placed.
    let copy = CopyCpu::for_attach(a.copy_cpu, a.attach.is_some());
    let copy_cpu = match a.cpus.apply(("--copy-cpu", copy), &[]) {
        Ok(c) => c,
        Err(e) => return super::usage_error(e),
    };
    let mut cfg = match a.load.config() {
        Ok(c) => c,
        Err(e) => return super::usage_error(e),
    };
    if a.load.prefillers.is_none() {
        cfg.prefillers = 1;
    }
    cfg.static_buffers.extend(a.static_buffer.iter().cloned());
    if let Some(f) = &a.key_format {
        cfg.key_format = f.clone();
    }
    if let Err(e) = cfg.validate().and_then(|()| cfg.static_peers().map(drop)) {
        return super::usage_error(e);
    }
    if a.connect.iter().any(|c| c.trim().is_empty()) {
        return super::usage_error("--connect has an empty endpoint");
    }
    if let Some(path) = a.attach.clone() {
        if let Err(e) = refuse_unused_with_attach(&a) {
            return super::usage_error(e);
        }
        return serve_attached(&a, &cfg, path, copy_cpu);
    }
    let server: Mutex<Option<MetricsServer>> = Mutex::new(None);
    let mut metrics_error = None;
    let result = runner::run_remote(
        cfg,
        a.connect.clone(),
        a.proxy.clone(),
        &a.sender_id,
        progress_mode(a.quiet),
        |_, senders| {
            let Some(addr) = a.metrics else { return };
            let weak: Vec<Weak<Sender>> = senders.iter().map(Arc::downgrade).collect();
            let render = move || {
                let live: Vec<Arc<Sender>> = weak.iter().filter_map(Weak::upgrade).collect();
                crate::sender::metrics::render_metrics(&live)
            };
            match MetricsServer::start(addr, render) {
                Ok(m) => {
                    if let Ok(mut s) = server.lock() {
                        *s = Some(m);
                    }
                }
                Err(e) => metrics_error = Some(format!("metrics on {addr}: {e}")),
            }
        },
    );
    if let Some(e) = metrics_error {
        eprintln!("kvferry: {e}");
    }
    finish(result, a.json)
}

/// The `--config` keys `--attach` uses: the sender's geometry, data
/// plane and bounds. Every other key configures the load generator.
const ATTACH_CONFIG_KEYS: [&str; 5] = [
    "chunk_bytes",
    "staging_slots",
    "transport",
    "max_pending_bytes",
    "static_buffers",
];

/// `--attach` serves workers instead of generating load: every load option
/// it would ignore (on the command line or as a `--config` key) is an
/// error naming it, never silently dropped.
fn refuse_unused_with_attach(a: &SenderArgs) -> Result<(), String> {
    let l = &a.load;
    let mut unused: Vec<String> = [
        ("--prefillers", l.prefillers.is_some()),
        ("--decoders", l.decoders.is_some()),
        ("--requests", l.requests.is_some()),
        ("--chunks", l.chunks.is_some()),
        ("--batch", l.batch.is_some()),
        ("--capacity-chunks", l.capacity_chunks.is_some()),
        ("--concurrency", l.concurrency.is_some()),
        ("--abort-rate", l.abort_rate.is_some()),
        ("--fail-rate", l.fail_rate.is_some()),
        ("--seed", l.seed.is_some()),
        ("--stall-timeout", l.stall_timeout.is_some()),
        ("--copy-store", l.copy_store),
        ("--key-format", a.key_format.is_some()),
        ("--json", a.json),
        ("--quiet", a.quiet),
    ]
    .into_iter()
    .filter(|&(_, set)| set)
    .map(|(name, _)| name.to_owned())
    .collect();
    if let Some(path) = &l.config {
        // Read again for its keys (`LoadArgs::config` parsed it already).
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let table: toml::Table =
            toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        unused.extend(
            table
                .keys()
                .filter(|k| !ATTACH_CONFIG_KEYS.contains(&k.as_str()))
                .map(|k| format!("{k} (in {})", path.display())),
        );
    }
    if unused.is_empty() {
        return Ok(());
    }
    Err(format!(
        "--attach serves attached prefill workers and generates no load, so it does not use {}; \
         it uses --connect, --proxy, --sender-id, --metrics, --static-buffer, --chunk-bytes, \
         --staging-slots, --transport, the --attach-* options and, from --config, {}",
        unused.join(", "),
        ATTACH_CONFIG_KEYS.join(", ")
    ))
}

/// `--attach`: one sender serving attached prefill workers until
/// SIGINT/SIGTERM.
fn serve_attached(
    a: &SenderArgs,
    cfg: &RunConfig,
    path: PathBuf,
    copy_cpu: Option<usize>,
) -> ExitCode {
    let static_peers = match cfg.static_peers() {
        Ok(p) => p,
        Err(e) => return super::usage_error(e),
    };
    let termination = match super::signals::Termination::install() {
        Ok(t) => t,
        Err(e) => return super::runtime_error(format!("cannot install signal handlers: {e}")),
    };
    let shares = a.attach_shares.map_or_else(
        || default_shares(cfg.staging_slots, cfg.chunk_bytes, a.attach_max_clients),
        |n| n as usize,
    );
    let served = Attached::start(
        SenderConfig {
            sender_id: a.sender_id.clone(),
            proxy: a.proxy.clone(),
            staging_slots: cfg.staging_slots,
            staging_shares: shares,
            chunk_bytes: cfg.chunk_bytes,
            max_pending_bytes: cfg.max_pending_bytes,
            transport: cfg.transport.clone(),
            transport_config: TransportConfig {
                pin_cpu: copy_cpu,
                ..TransportConfig::default()
            },
            static_peers,
            ..SenderConfig::default()
        },
        a.connect.clone(),
        AttachConfig {
            max_clients: a.attach_max_clients as usize,
            max_outstanding: a.attach_max_outstanding as usize,
            keep_dumpable: a.attach_keep_dumpable,
            poll_idle: Duration::from_micros(a.attach_poll_idle_us.into()),
            engine_cpu: copy_cpu,
            ..AttachConfig::new(&path)
        },
    );
    let served = match served {
        Ok(s) => s,
        Err(code) => return code,
    };
    let metrics = match super::start_metrics(a.metrics, served.metrics()) {
        Ok(m) => m,
        Err(code) => {
            served.stop();
            return code;
        }
    };
    super::say!(
        "kvferry sender attach on {}",
        served.daemon.socket().display()
    );
    if let Some(m) = &metrics {
        super::say!("kvferry sender metrics on {}", m.local_addr());
    }
    // After the announcements: scripts take the first line as the daemon's
    // readiness.
    if let Some(cpu) = copy_cpu {
        super::say!("kvferry sender copy engine on cpu {cpu}");
    }
    let _ = std::io::stdout().flush();
    termination.wait();
    drop(metrics);
    served.stop();
    ExitCode::SUCCESS
}

/// Staging shares when `--attach-shares` is not given: one per possible
/// client, fewer if the slots cannot hold that many page-aligned shares.
pub(super) fn default_shares(staging_slots: usize, chunk_bytes: u64, max_clients: u32) -> usize {
    crate::staging::max_shares(staging_slots, chunk_bytes).min(max_clients as usize)
}

/// A sender serving attached prefill workers: what `kvferry sender
/// --attach` and `kvferry node` run.
pub(super) struct Attached {
    // Declared first: dropped (its sessions ended) before the sender.
    pub(super) daemon: PrefillDaemon,
    pub(super) sender: Arc<Sender>,
}

impl Attached {
    /// Starts the sender `cfg` describes and its prefill daemon, whose
    /// workers name their receivers by index into `connect`. The error is
    /// the exit code, its message printed.
    pub(super) fn start(
        cfg: SenderConfig,
        connect: Vec<String>,
        attach: AttachConfig,
    ) -> Result<Self, ExitCode> {
        let path = attach.socket.clone();
        let sender = Sender::new(cfg)
            .map(Arc::new)
            .map_err(super::runtime_error)?;
        let daemon = PrefillDaemon::start(Arc::clone(&sender), connect, attach)
            .map_err(|e| super::runtime_error(format!("--attach {}: {e}", path.display())))?;
        Ok(Self { daemon, sender })
    }

    /// The sender's metrics text, for `--metrics`. Holds it weakly: a
    /// scrape still being served must not keep it alive.
    pub(super) fn metrics(&self) -> impl Fn() -> String + Send + Sync + 'static {
        let weak = Arc::downgrade(&self.sender);
        move || {
            let live: Vec<Arc<Sender>> = weak.upgrade().into_iter().collect();
            crate::sender::metrics::render_metrics(&live)
        }
    }

    /// Ends the sessions (cancelling their live requests), then closes the
    /// sender, waiting at most 5 s for its transfers.
    pub(super) fn stop(self) {
        drop(self.daemon);
        match Arc::try_unwrap(self.sender) {
            Ok(s) => {
                s.close(Instant::now() + Duration::from_secs(5));
            }
            Err(s) => drop(s),
        }
    }
}
