//! The `kvferry` command: run the roles of a PD-disaggregated transfer.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    kvferry::cli::init_tracing();
    let cli = kvferry::cli::Cli::parse();
    kvferry::cli::run(cli)
}
