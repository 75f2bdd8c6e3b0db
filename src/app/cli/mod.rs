//! Command-line interface: one subcommand per role.

mod cpus;
mod node_cmd;
mod proxy_cmd;
mod receiver_cmd;
mod run_cmd;
mod sender_cmd;
mod signals;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvferry: move KV-cache chunks from prefill to decode nodes with
/// reservation-based admission.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, about)]
pub struct Cli {
    /// The role to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the main job: xPyD on one machine, with a report.
    Run(run_cmd::RunArgs),
    /// Run a receiver (decode side): admission, slots, the receive buffer.
    Receiver(receiver_cmd::ReceiverCmdArgs),
    /// Run a sender (prefill side) against receivers in other processes.
    Sender(sender_cmd::SenderArgs),
    /// Run a receiver and a sender in one process for the decode and
    /// prefill workers of one host (both attach; the control messages
    /// between the two stay in the process).
    Node(node_cmd::NodeArgs),
    /// Run a proxy listener: count ProxyNotif per request.
    Proxy(proxy_cmd::ProxyArgs),
}

/// Runs a parsed command line; the exit code follows the outcome (2 for bad
/// arguments, 1 for runtime failures).
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Run(a) => run_cmd::run(a),
        Command::Receiver(a) => receiver_cmd::run(a),
        Command::Sender(a) => sender_cmd::run(a),
        Command::Node(a) => node_cmd::run(a),
        Command::Proxy(a) => proxy_cmd::run(a),
    }
}

/// Starts the `--metrics` server at `addr`, if given, serving `render`;
/// the error is the exit code (its message printed).
pub(crate) fn start_metrics(
    addr: Option<std::net::SocketAddr>,
    render: impl Fn() -> String + Send + Sync + 'static,
) -> Result<Option<crate::metrics::MetricsServer>, ExitCode> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    crate::metrics::MetricsServer::start(addr, render)
        .map(Some)
        .map_err(|e| runtime_error(format!("metrics on {addr}: {e}")))
}

/// Logs to stderr, filtered by `RUST_LOG` (default: warnings only).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Writes one line to stdout and flushes it, ignoring errors: a daemon whose
/// stdout was closed (its parent read the first line and went away, or a
/// pipe into `head`) keeps serving. `println!` would panic on that EPIPE
/// (Rust ignores SIGPIPE), killing the daemon mid-run.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}
pub(crate) use say;

/// Prints a usage error and returns exit code 2.
pub(crate) fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvferry: {msg}");
    ExitCode::from(2)
}

/// Prints a runtime error and returns exit code 1.
pub(crate) fn runtime_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvferry: {msg}");
    ExitCode::from(1)
}
