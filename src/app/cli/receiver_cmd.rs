//! `kvferry receiver`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::attach::{AttachConfig, DecoderDaemon};
use crate::metrics::MetricsServer;
use crate::receiver::bounds::Bounds;
use crate::receiver::{AcceptorFactory, Receiver, ReceiverConfig, ReceiverError, TcpDataLimits};
use crate::transport::TransportConfig;

use super::cpus::{CopyCpu, CpuArgs};

/// Arguments of `kvferry receiver`: the receiver's, and the CPU it leaves
/// to a sender's copy engine.
#[derive(Debug, Args)]
pub struct ReceiverCmdArgs {
    /// The receiver's options, as `kvferry node` takes them too.
    #[command(flatten)]
    pub receiver: ReceiverArgs,
    /// With --attach: `auto` (the default) keeps every thread of this
    /// daemon off the last CPU it may run on (and --pin-cpu does not name),
    /// when --cpus is not given and it may run on two CPUs or more: where a
    /// `kvferry sender --attach` on this host runs its copy engine by
    /// default, the thread that writes this receiver's buffer. `none`: no
    /// CPU left out (docs/attach.md, "Placing the threads").
    #[arg(long, value_name = "auto|none", requires = "attach", value_parser = CopyCpu::parse_spare)]
    pub spare_cpu: Option<CopyCpu>,
}

/// The receiver's options, shared by `kvferry receiver` and `kvferry node`.
#[derive(Debug, Args)]
pub struct ReceiverArgs {
    /// ZMQ endpoint to bind for AllocRequests. An `ipc://PATH` one takes
    /// PATH only if nothing is there or a socket nobody serves (a
    /// receiver that died); it is removed at exit.
    #[arg(long, default_value = "tcp://127.0.0.1:7400")]
    pub listen: String,
    /// More endpoints the same socket binds (comma-separated or repeated),
    /// as `--listen`'s: e.g. `ipc:///run/kvferry/recv.ctl` for a kvferry
    /// sender on this host while `--listen` serves remote and LMCache
    /// senders over TCP (docs/attach.md, "Two daemons on one host").
    #[arg(long, value_delimiter = ',', value_name = "ENDPOINT")]
    pub also_listen: Vec<String>,
    /// Do not offer kvferry senders on this host a Unix socket for their
    /// control messages. By default, with the shm data plane, `HelloAck`
    /// names the first `ipc:///` endpoint among `--listen` and
    /// `--also-listen`, or else `ipc://{buffer file}.ctl`, bound for it
    /// and removed at exit; a kvferry sender given a `tcp://` endpoint
    /// moves its control messages there (docs/protocol.md, "Local
    /// control").
    #[arg(long)]
    pub no_local_control: bool,
    /// Slots in the receive buffer.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub capacity_chunks: u32,
    /// Bytes per slot (the largest chunk accepted; below 4 GiB).
    #[arg(long, default_value_t = 262_144, value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    pub chunk_bytes: u64,
    /// How long a request may wait for admission, in milliseconds.
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub admission_timeout_ms: u64,
    /// Lease of an admitted request without progress, in milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ms: u64,
    /// Quarantine of slots whose writes may still land, in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub quarantine_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Path of the shared-memory buffer file (default: /dev/shm/kvferry-<pid>-0.buf).
    #[arg(long)]
    pub shm_path: Option<PathBuf>,
    /// Identity announced to kvferry senders.
    #[arg(long)]
    pub receiver_id: Option<String>,
    /// Pin the control thread to this CPU.
    #[arg(long)]
    pub pin_cpu: Option<usize>,
    /// Release each request's chunks as soon as it is complete, like a
    /// decoder that only counts (for load tests): on its TransferDone
    /// (kvferry senders), or --consume-grace-ms after its last batch was
    /// answered (LMCache senders and anonymous batches, which send none).
    #[arg(long)]
    pub consume: bool,
    /// With --consume: milliseconds after its last reply an allocation
    /// without TransferDone counts as delivered. Must exceed the time the
    /// sender takes to write a batch (a slot may be reused after it).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub consume_grace_ms: u64,
    /// Release a complete request's chunks that no decoder took, subscribed
    /// to or read by key this long after its TransferDone, in
    /// milliseconds (a decoder that never comes, or a request completed
    /// while no attached wildcard stood, must not hold the buffer for
    /// good); 0 keeps them until consumed. LMCache senders' requests, read
    /// by key, are not affected.
    #[arg(long, default_value_t = 120_000)]
    pub unconsumed_expiry_ms: u64,
    /// Also offer the TCP data plane: bind its listener here (e.g.
    /// `10.0.0.2:7401`; port 0 picks one).
    #[arg(long)]
    pub tcp_data: Option<SocketAddr>,
    /// IP announced to senders for the TCP data plane (needed when
    /// `--tcp-data` binds a wildcard address).
    #[arg(long)]
    pub tcp_advertise: Option<std::net::IpAddr>,
    /// Time a new TCP data connection gets to present its secret, in
    /// milliseconds.
    #[arg(long, default_value_t = 3_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub tcp_auth_timeout_ms: u64,
    /// Time a started TCP write gets beyond its length at 1 MiB/s, in
    /// milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub tcp_io_timeout_ms: u64,
    /// TCP data connections not serving a sender at once: waiting for their
    /// secret, or refused (a new one evicts the oldest refused, else the
    /// oldest waiting one). Also the room authenticated ones always leave.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub tcp_max_unauthenticated: u32,
    /// TCP data connections one sender may hold (a newer one closes its
    /// oldest).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub tcp_max_per_sender: u32,
    /// Also offer the RDMA data plane (one queue pair per sender, set up at
    /// Hello; device from KVFERRY_RDMA_DEVICE / _PORT / _GID_INDEX). Needs
    /// a binary built with the `rdma` cargo feature and an RDMA device.
    #[arg(long)]
    pub rdma: bool,
    /// Bytes all parked requests and their queued batches may hold; past it
    /// new parked work is answered `overloaded` (docs/security.md).
    #[arg(long, default_value_t = Bounds::default().max_parked_bytes)]
    pub max_parked_bytes: usize,
    /// Bytes one peer's parked requests may hold.
    #[arg(long, default_value_t = Bounds::default().max_peer_parked_bytes)]
    pub max_peer_parked_bytes: usize,
    /// Bytes of ended-request records (tombstones, LMCache cancel records)
    /// and anonymous allocations' records.
    #[arg(long, default_value_t = Bounds::default().max_ended_bytes)]
    pub max_record_bytes: usize,
    /// Bytes of per-peer state; past it new peers are answered `overloaded`.
    #[arg(long, default_value_t = Bounds::default().max_peer_bytes)]
    pub max_peer_state_bytes: usize,
    /// Refuse anonymous allocations (req_id "", LMCache's untracked path).
    #[arg(long)]
    pub no_anonymous: bool,
    /// Lifetime of an anonymous allocation no decoder consumed, in milliseconds.
    #[arg(long, default_value_t = Bounds::default().anonymous_lifetime.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub anonymous_lifetime_ms: u64,
    /// Incoming frames queued per peer connection; past it that peer's
    /// connection is not read until the receiver catches up (backpressure).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(i32).range(1..))]
    pub recv_queue_per_peer: i32,
    /// Replies queued per peer connection; past it (the peer does not read
    /// its replies) further replies to it are dropped and counted.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(i32).range(1..))]
    pub reply_queue_per_peer: i32,
    /// Serve attached decoder processes on this Unix socket (rings and the
    /// buffer passed as descriptors; the process becomes non-dumpable; see
    /// docs/attach.md).
    #[arg(long)]
    pub attach: Option<PathBuf>,
    /// With --attach: live attachments at most.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub attach_max_clients: u32,
    /// With --attach: subscriptions plus held requests per client at most.
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
    #[command(flatten)]
    pub cpus: CpuArgs,
}

/// Runs a receiver until SIGINT/SIGTERM.
pub fn run(
    ReceiverCmdArgs {
        receiver: a,
        spare_cpu,
    }: ReceiverCmdArgs,
) -> ExitCode {
    // Before anything is spawned: every thread after inherits it. A
    // receiver serving attached decoders leaves the last CPU to a sender's
    // copy engine on this host (the node gives its own engine that CPU).
    let spare = CopyCpu::for_attach(spare_cpu, a.attach.is_some());
    let spared = match a
        .cpus
        .apply(("--spare-cpu", spare), &[("--pin-cpu", a.pin_cpu)])
    {
        Ok(s) => s,
        Err(e) => return super::usage_error(e),
    };
    let termination = match super::signals::Termination::install() {
        Ok(t) => t,
        Err(e) => return super::runtime_error(format!("cannot install signal handlers: {e}")),
    };
    let metrics = a.metrics;
    let served = match Served::start(a, Vec::new(), spared) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let metrics_server = match super::start_metrics(metrics, served.metrics()) {
        Ok(m) => m,
        Err(code) => return code,
    };
    served.announce("receiver", "attach", metrics_server.as_ref());
    // After the announcements: scripts wait for them, not for this.
    if let Some(cpu) = spared {
        super::say!("kvferry receiver leaves cpu {cpu} to a sender's copy engine");
    }
    let _ = std::io::stdout().flush();
    termination.wait();
    // Ends the sessions (releasing what clients held) before the receiver.
    drop(served);
    ExitCode::SUCCESS
}

/// A running receiver and, with `--attach`, its decoder daemon: what
/// `kvferry receiver` and `kvferry node` serve. Dropping it ends the
/// sessions (releasing what their clients held), then the receiver.
pub(super) struct Served {
    // Declared first: dropped before the receiver it serves.
    attach: Option<DecoderDaemon>,
    pub(super) receiver: Arc<Receiver>,
    rdma: bool,
    /// How many of the receiver's `also_endpoints` are `--also-listen`'s
    /// (announced; the caller's own follow them).
    announced_also: usize,
}

impl Served {
    /// Starts the receiver `a` describes, binding its `--also-listen` and
    /// then `also_listen` too (see [`ReceiverConfig::also_listen`]; the
    /// latter not announced), and its decoder daemon if
    /// `--attach` is given, whose hello names `engine_cpu` (the CPU the
    /// caller keeps for a copy engine, [`AttachConfig::engine_cpu`]).
    /// `--cpus`/`--pin-cpu` and `--metrics` are the caller's. The error is
    /// the exit code, its message printed.
    pub(super) fn start(
        a: ReceiverArgs,
        also_listen: Vec<String>,
        engine_cpu: Option<usize>,
    ) -> Result<Self, ExitCode> {
        if (a.capacity_chunks as u64)
            .checked_mul(a.chunk_bytes)
            .is_none()
        {
            return Err(super::usage_error(
                "capacity-chunks × chunk-bytes overflows",
            ));
        }
        let acceptor = if a.rdma {
            match AcceptorFactory::for_transport("rdma", &TransportConfig::default()) {
                Ok(f) => f,
                Err(e) => return Err(super::usage_error(format!("--rdma: {e}"))),
            }
        } else {
            None
        };
        let announced_also = a.also_listen.len();
        let cfg = ReceiverConfig {
            listen: a.listen.clone(),
            also_listen: a.also_listen.iter().cloned().chain(also_listen).collect(),
            receiver_id: a
                .receiver_id
                .unwrap_or_else(|| format!("receiver-{}", std::process::id())),
            capacity_chunks: a.capacity_chunks as usize,
            chunk_bytes: a.chunk_bytes,
            admission_timeout: Duration::from_millis(a.admission_timeout_ms),
            lease: Duration::from_millis(a.lease_ms),
            quarantine_grace: Duration::from_millis(a.quarantine_ms),
            shm_path: a.shm_path,
            pin_cpu: a.pin_cpu,
            auto_consume: a.consume,
            consume_grace: Duration::from_millis(a.consume_grace_ms),
            unconsumed_expiry: (a.unconsumed_expiry_ms > 0)
                .then(|| Duration::from_millis(a.unconsumed_expiry_ms)),
            tcp_data: a.tcp_data,
            tcp_data_advertise: a.tcp_advertise,
            tcp_data_limits: TcpDataLimits {
                auth_timeout: Duration::from_millis(a.tcp_auth_timeout_ms),
                io_timeout: Duration::from_millis(a.tcp_io_timeout_ms),
                max_unauthenticated: a.tcp_max_unauthenticated as usize,
                max_per_sender: a.tcp_max_per_sender as usize,
                ..TcpDataLimits::default()
            },
            acceptor,
            bounds: Bounds {
                max_parked_bytes: a.max_parked_bytes,
                max_peer_parked_bytes: a.max_peer_parked_bytes,
                max_ended_bytes: a.max_record_bytes,
                max_peer_bytes: a.max_peer_state_bytes,
                allow_anonymous: !a.no_anonymous,
                anonymous_lifetime: Duration::from_millis(a.anonymous_lifetime_ms),
            },
            recv_queue_per_peer: a.recv_queue_per_peer,
            reply_queue_per_peer: a.reply_queue_per_peer,
            local_control: !a.no_local_control,
            ..ReceiverConfig::default()
        };
        let receiver = match Receiver::start(cfg) {
            Ok(r) => Arc::new(r),
            // --rdma on a host without a device: nothing to retry (exit 2).
            Err(e @ ReceiverError::Transport(_)) => {
                return Err(super::usage_error(format!("--rdma: {e}")))
            }
            Err(e) => return Err(super::runtime_error(e)),
        };
        let attach = match &a.attach {
            Some(path) => {
                let cfg = AttachConfig {
                    max_clients: a.attach_max_clients as usize,
                    max_outstanding: a.attach_max_outstanding as usize,
                    keep_dumpable: a.attach_keep_dumpable,
                    poll_idle: Duration::from_micros(a.attach_poll_idle_us.into()),
                    engine_cpu,
                    ..AttachConfig::new(path)
                };
                match DecoderDaemon::start(Arc::clone(&receiver), cfg) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        return Err(super::runtime_error(format!(
                            "--attach {}: {e}",
                            path.display()
                        )))
                    }
                }
            }
            None => None,
        };
        Ok(Self {
            attach,
            receiver,
            rdma: a.rdma,
            announced_also,
        })
    }

    /// The receiver's metrics text, for `--metrics`. Holds it weakly: a
    /// scrape still being served must not keep the receiver (and its
    /// buffer file) alive past the end of the command.
    pub(super) fn metrics(&self) -> impl Fn() -> String + Send + Sync + 'static {
        let r = Arc::downgrade(&self.receiver);
        move || r.upgrade().map(|r| r.render_metrics()).unwrap_or_default()
    }

    /// Prints the lines a launcher waits for, naming the daemon `role`
    /// (`kvferry <role> listening on …`, `kvferry <role> <attach> on
    /// <socket>`, …), `metrics`' address among them.
    pub(super) fn announce(&self, role: &str, attach: &str, metrics: Option<&MetricsServer>) {
        super::say!("kvferry {role} listening on {}", self.receiver.endpoint());
        for also in self
            .receiver
            .also_endpoints()
            .iter()
            .take(self.announced_also)
        {
            super::say!("kvferry {role} also listening on {also}");
        }
        if let Some(control) = self.receiver.control_endpoint() {
            super::say!("kvferry {role} local control on {control}");
        }
        if let Some(d) = &self.attach {
            super::say!("kvferry {role} {attach} on {}", d.socket().display());
        }
        if let Some(addr) = self.receiver.tcp_data_addr() {
            super::say!("kvferry {role} tcp data on {addr}");
        }
        if let Some(m) = metrics {
            super::say!("kvferry {role} metrics on {}", m.local_addr());
        }
        if self.rdma {
            super::say!("kvferry {role} offers rdma");
        }
    }
}
