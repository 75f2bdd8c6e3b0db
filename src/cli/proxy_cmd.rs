//! `kvferry proxy`.

use std::io::Write;
use std::process::ExitCode;

use clap::Args;

use crate::proxy::ProxyListener;

/// Arguments of `kvferry proxy`.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// ZMQ endpoint to bind the PULL socket on.
    #[arg(long, default_value = "tcp://127.0.0.1:7500")]
    pub listen: String,
}

/// Runs a proxy listener until SIGINT/SIGTERM, printing one line per
/// ProxyNotif.
pub fn run(a: ProxyArgs) -> ExitCode {
    let termination = match super::signals::Termination::install() {
        Ok(t) => t,
        Err(e) => return super::runtime_error(format!("cannot install signal handlers: {e}")),
    };
    let listener = match ProxyListener::bind(&a.listen) {
        Ok(l) => l,
        Err(e) => return super::runtime_error(e),
    };
    listener.set_callback(|n| {
        println!("ProxyNotif req_id={} count={}", n.req_id, n.count);
    });
    println!("kvferry proxy listening on {}", listener.endpoint());
    let _ = std::io::stdout().flush();
    termination.wait();
    let (total, malformed) = listener.totals();
    println!("kvferry proxy: {total} notifications, {malformed} malformed frames");
    ExitCode::SUCCESS
}
