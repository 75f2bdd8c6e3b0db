//! `kvferry sender`: the prefill role as its own process.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, Weak};

use clap::Args;

use crate::metrics::MetricsServer;
use crate::runner;
use crate::sender::Sender;

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
    /// Sender id prefix (DEALER identities are `<id>-<n>-to-<endpoint>`).
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
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

/// Generates the load and prints the report.
pub fn run(a: SenderArgs) -> ExitCode {
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
