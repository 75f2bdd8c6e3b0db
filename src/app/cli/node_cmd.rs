//! `kvferry node`: a receiver and a sender in one process, for a host that
//! runs both the decode and the prefill workers of a deployment
//! (single-node prefill/decode disaggregation). Both roles serve attached
//! workers as `kvferry receiver --attach` and `kvferry sender --attach` do,
//! with the same code; what one process changes is the path between them.
//! The sender reaches its own receiver over `inproc://` ZMQ (receiver 0 of
//! a worker's BEGIN), so an `AllocRequest`, its reply and `TransferDone`
//! pass from one control thread to the other with no ZMQ I/O thread, no
//! TCP and no other process in between: about a third of the CPU the two
//! daemons spend per request (docs/attach.md, "One process for both
//! roles"). The bytes still move once, in the shm copy engine; with
//! `--transport tcp|rdma` the sender writes over that data plane instead,
//! to receivers on other hosts as to its own.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::attach::AttachConfig;
use crate::receiver::AcceptorFactory;
use crate::sender::SenderConfig;
use crate::transport::TransportConfig;

use super::cpus::CopyCpu;
use super::receiver_cmd::{ReceiverArgs, Served};
use super::sender_cmd::{default_shares, Attached};

/// Arguments of `kvferry node`.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The receiver's options, as `kvferry receiver` takes them. Its
    /// `--attach` (required here) is the decoders' socket; `--listen` is
    /// where senders of other processes and hosts (kvferry's or LMCache's)
    /// reach this node's receiver; `--chunk-bytes` sizes the staging slots
    /// too; `--cpus` confines both roles; `--attach-max-clients`,
    /// `--attach-max-outstanding`, `--attach-keep-dumpable` and
    /// `--attach-poll-idle-us` apply to both sockets; `--metrics` serves
    /// both roles' metrics.
    #[command(flatten)]
    pub receiver: ReceiverArgs,
    /// Serve attached prefill workers on this Unix socket (as `kvferry
    /// sender --attach`): a worker's BEGIN names receiver 0 for this
    /// node's own, 1.. for the `--connect` ones in order.
    #[arg(long, value_name = "PATH")]
    pub prefill_attach: PathBuf,
    /// Staging slots of the sender, `--chunk-bytes` each.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub staging_slots: u32,
    /// Per-worker staging shares (as `kvferry sender --attach-shares`).
    /// Default: --attach-max-clients, fewer if --staging-slots cannot hold
    /// that many page-aligned shares.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub attach_shares: Option<u32>,
    /// The CPU of the transport's engine thread (shm's copy engine, the
    /// one thread that moves the workers' bytes): a CPU id, `none` (the
    /// scheduler's choice) or `auto`: without --cpus, on two CPUs or more,
    /// the last CPU this process may run on (and --pin-cpu does not name)
    /// goes to the engine alone and every other thread of both roles runs
    /// on the rest. With an id, leave it out of --cpus to give it the CPU
    /// to itself (docs/attach.md, "Placing the threads").
    #[arg(long, value_name = "CPU|auto|none", default_value = "auto", value_parser = CopyCpu::parse)]
    pub copy_cpu: CopyCpu,
    /// More receivers (comma-separated or repeated) for the prefill
    /// workers: receivers 1.. of a BEGIN. Over `--transport shm` they are
    /// kvferry receivers on this host; over tcp or rdma, on any host, each
    /// offering that data plane (`kvferry receiver --tcp-data` / `--rdma`).
    #[arg(long, value_delimiter = ',')]
    pub connect: Vec<String>,
    /// The sender's data plane: `shm` (a copy engine on this host), `tcp`
    /// or `rdma`. The node's own receiver (receiver 0) is written over it
    /// too, so it offers it: `tcp` binds `--tcp-data` (127.0.0.1:0 when
    /// not given), `rdma` turns on `--rdma`.
    #[arg(long, default_value = "shm", value_parser = ["shm", "tcp", "rdma"])]
    pub transport: String,
    /// ENDPOINT=PATH (repeatable), as `kvferry sender --static-buffer`:
    /// the `--connect` receiver at ENDPOINT does not answer Hello (an
    /// LMCache receiver); write its chunks into the kvferry shm buffer
    /// file PATH on this host (slot size and count from its header). Needs
    /// `--transport shm`.
    #[arg(long, value_name = "ENDPOINT=PATH")]
    pub static_buffer: Vec<String>,
    /// The proxy's PULL endpoint for ProxyNotif.
    #[arg(long)]
    pub proxy: Option<String>,
    /// Sender id prefix (DEALER identities are `<id>-to-<endpoint>~<random
    /// per process>`).
    #[arg(long, default_value = "node")]
    pub sender_id: String,
}

/// The in-process endpoint the node's receiver also binds and its sender
/// connects to (unique in the process, reachable from no other).
fn inproc_endpoint() -> String {
    format!("inproc://kvferry-node-{}", std::process::id())
}

/// The node's own receiver offers the data plane its sender writes over
/// (receiver 0 of a BEGIN is written like the others): a TCP data
/// listener (on loopback unless `--tcp-data` says where) or RDMA.
fn offer_own_transport(a: &mut NodeArgs) -> Result<(), String> {
    match a.transport.as_str() {
        "tcp" => {
            a.receiver
                .tcp_data
                .get_or_insert((std::net::Ipv4Addr::LOCALHOST, 0).into());
        }
        "rdma" => {
            // Named for the option the user gave, before anything starts.
            AcceptorFactory::for_transport("rdma", &TransportConfig::default())
                .map_err(|e| format!("--transport rdma: {e}"))?;
            a.receiver.rdma = true;
        }
        _ => {}
    }
    Ok(())
}

/// Runs a node until SIGINT/SIGTERM.
pub fn run(mut a: NodeArgs) -> ExitCode {
    if let Err(e) = offer_own_transport(&mut a) {
        return super::usage_error(e);
    }
    // Before anything is spawned: every thread after inherits it.
    let r = &a.receiver;
    let copy_cpu = match r
        .cpus
        .apply(("--copy-cpu", a.copy_cpu), &[("--pin-cpu", r.pin_cpu)])
    {
        Ok(c) => c,
        Err(e) => return super::usage_error(e),
    };
    let Some(decoders) = r.attach.clone() else {
        return super::usage_error(
            "kvferry node serves attached decoders: --attach PATH (their socket) is required",
        );
    };
    if decoders == a.prefill_attach {
        return super::usage_error("--attach and --prefill-attach must be different sockets");
    }
    if a.connect.iter().any(|c| c.trim().is_empty()) {
        return super::usage_error("--connect has an empty endpoint");
    }
    let static_peers = match crate::runner::static_peers_of(&a.static_buffer, &a.transport) {
        Ok(p) => p,
        Err(e) => return super::usage_error(e),
    };
    let termination = match super::signals::Termination::install() {
        Ok(t) => t,
        Err(e) => return super::runtime_error(format!("cannot install signal handlers: {e}")),
    };
    let chunk_bytes = r.chunk_bytes;
    let (max_clients, max_outstanding) = (r.attach_max_clients, r.attach_max_outstanding);
    let keep_dumpable = r.attach_keep_dumpable;
    let poll_idle = Duration::from_micros(r.attach_poll_idle_us.into());
    let metrics = r.metrics;
    let inproc = inproc_endpoint();
    let receiver = match Served::start(a.receiver, vec![inproc.clone()], copy_cpu) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let staging_slots = a.staging_slots as usize;
    let shares = a.attach_shares.map_or_else(
        || default_shares(staging_slots, chunk_bytes, max_clients),
        |n| n as usize,
    );
    let connect: Vec<String> = std::iter::once(inproc).chain(a.connect).collect();
    let sender = Attached::start(
        SenderConfig {
            sender_id: a.sender_id,
            proxy: a.proxy,
            staging_slots,
            staging_shares: shares,
            chunk_bytes,
            transport: a.transport,
            transport_config: TransportConfig {
                pin_cpu: copy_cpu,
                ..TransportConfig::default()
            },
            static_peers,
            ..SenderConfig::default()
        },
        connect,
        AttachConfig {
            max_clients: max_clients as usize,
            max_outstanding: max_outstanding as usize,
            keep_dumpable,
            poll_idle,
            engine_cpu: copy_cpu,
            ..AttachConfig::new(&a.prefill_attach)
        },
    );
    let sender = match sender {
        Ok(s) => s,
        Err(code) => return code,
    };
    let (receiver_text, sender_text) = (receiver.metrics(), sender.metrics());
    let metrics = match super::start_metrics(metrics, move || receiver_text() + &sender_text()) {
        Ok(m) => m,
        Err(code) => {
            sender.stop();
            return code;
        }
    };
    receiver.announce("node", "decoder attach", None);
    super::say!(
        "kvferry node prefill attach on {}",
        sender.daemon.socket().display()
    );
    if let Some(m) = &metrics {
        super::say!("kvferry node metrics on {}", m.local_addr());
    }
    // After the announcements: scripts wait for them, not for this.
    if let Some(cpu) = copy_cpu {
        super::say!("kvferry node copy engine on cpu {cpu}");
    }
    let _ = std::io::stdout().flush();
    termination.wait();
    drop(metrics);
    // The sender first: its transfers end while its receiver still serves.
    sender.stop();
    drop(receiver);
    ExitCode::SUCCESS
}
